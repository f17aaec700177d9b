"""Video rewards: seconds per video on this CPU at tiny size, and the paper's batch on GPU reward workers.

  JAX_PLATFORMS=cpu python benchmarks/reward_speed.py [--quick] [--out=benchmarks/reward_speed.jsonl]

Measured on this machine (tiny random models in the real checkpoint layouts, from each module's
`save_tiny`; torch on --threads threads, 1 by default, so the numbers are per core; every timing follows
a warm-up call, so model loading and first-call costs are excluded; medians of --repeats calls):
  cpu_tiny     seconds per video of videoalign, cosmos_reason1, vbench (every dimension the size accepts)
               and of each VBench dimension alone, at 5x32x32 (configs/cosmos2b.py:smoke's videos) and
               17x128x128 (the smallest common size with motion smoothness: AMT-S needs >= 113 px a side).
               The AMT-S of motion smoothness is full size (~3M parameters); the other networks are tiny.
  service      the three rewards through the real path, `rewards.make_reward_service(config.reward)`
               with 1 and 2 local worker processes (one torch thread each), against the same rewards in
               this process (InlinePool, one thread), timed alternately: the overhead per video at 17x128x128.
  transport    a model-free reward (mean_intensity) on videos of the paper's size, 93x720x1280 uint8
               (257 MB), inline against one worker process, alternately: the cost of shipping a video.
  host_inputs  at the paper's size, the CPU work of VideoAlign's and Reason1's inputs (frame choice,
               resize, patch rows), which stays on a GPU reward worker's host; and the whole call with the
               tiny models (tiny networks, real token counts).
  cpu_control  a one-thread matmul loop alone and as two processes at once: the cores this run really had
               (on a shared VM other sessions' processes take their share; 2.0 on an idle 2-core machine).
Counted, not timed:
  flops_check  the Qwen-VL FLOP formula below against torch's FlopCounterMode on the two tiny models.
  paper_flops  model FLOPs of one video at the paper's size (2 per multiply-accumulate): VBench's five
               networks at their real widths with random weights (DINO ViT-B/16, CLIP ViT-B/32 and
               ViT-L/14 on the meta device, MUSIQ on the CPU, AMT-S on the meta device), counted by
               FlopCounterMode on one frame (one frame pair for AMT-S) of the reward's own preprocessing;
               VideoAlign (Qwen2-VL-2B) and Cosmos-Reason1 (Qwen2.5-VL-7B) by the formula from their
               published config.json values, with the modules' own frame sampling and sizes.
Estimated (the assumptions are the constants below, repeated in the rows): seconds per video on one
H100 SXM = FLOPs / (MFU x the peak of the dtype each part runs in); one DDRL iteration of
configs/cosmos2b.py (ddrl_jax.flops, 256 H100s at an assumed MFU); the reward GPUs that score the paper's
128 videos within 5% of an iteration, strictly and with the data gradient overlapping the scoring
(wait = max(0, scoring - data gradient)).
"""
import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIZES = {'smoke': (5, 32, 32), 'motion': (17, 128, 128)}      # (frames, height, width)
PROMPT = 'a red fox runs through fresh snow at dawn, the camera follows it from the side'
VIDEO_REWARDS = ('videoalign', 'vbench', 'cosmos_reason1')

# The paper's batch (configs/cosmos2b.py): 16 prompts x 8 rollouts of 93 frames at 1280x720, 16 fps.
PAPER = dict(groups=16, rollouts=8, frames=93, height=720, width=1280, fps=16.0)
WAIT_FRACTION = 0.05            # the goal: the trainer waits for rewards at most 5% of an iteration
TRAIN_MFU = 0.40                # assumed MFU of the DDRL iteration on the 256 H100s
REWARD_MFU = (0.30, 0.10)       # assumed MFU of the reward networks: the main figure and a pessimistic one

# Published config.json values (Hugging Face Qwen/Qwen2-VL-2B-Instruct, the VideoReward base; and
# Qwen/Qwen2.5-VL-7B-Instruct, the architecture of nvidia/Cosmos-Reason1-7B-Reward), in this file's form.
QWEN2_VL_2B = dict(
    vision=dict(width=1280, depth=32, mlp=5120, gated=False, out=1536, patch=14, temporal_patch=2,
                merge=2, window=0, full_blocks=()),
    text=dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960))
QWEN25_VL_7B = dict(
    vision=dict(width=1280, depth=32, mlp=3420, gated=True, out=3584, patch=14, temporal_patch=2,
                merge=2, window=112, full_blocks=(7, 15, 23, 31)),
    text=dict(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944))
# Text tokens beside the video's (estimate: no real tokenizer here): the rubric at ~4 characters per token
# plus ~100 for the chat template and a generation prompt of ~75 words.
CHARS_PER_TOKEN = 4
EXTRA_TEXT_TOKENS = 100

# Where each VBench network runs on a GPU and so which H100 peak its FLOPs meet: CLIP in fp16 (as VBench);
# DINO, MUSIQ and AMT-S in float32, whose matmuls run at the FP32 peak under PyTorch's default
# (torch.backends.cuda.matmul.allow_tf32 = False) and whose convolutions at the TF32 peak (cudnn.allow_tf32
# = True by default).
VBENCH_DTYPES = {
    'subject_consistency': {'matmul': 'float32', 'conv': 'tf32'},
    'background_consistency': {'matmul': 'float16', 'conv': 'float16'},
    'motion_smoothness': {'matmul': 'float32', 'conv': 'tf32'},
    'aesthetic_quality': {'matmul': 'float16', 'conv': 'float16'},
    'imaging_quality': {'matmul': 'float32', 'conv': 'tf32'},
}


# ------------------------------------------------------------------------------------------ helpers
def host_info():
  """{'date', 'cpu' (lscpu's model name), 'cores', 'platform', 'load_average_start'} of this machine (the
  load average shows other work sharing the cores)."""
  cpu = platform.processor() or platform.machine()
  try:
    out = subprocess.run(['lscpu'], capture_output=True, text=True, check=True).stdout
    cpu = next((l.split(':', 1)[1].strip() for l in out.splitlines() if l.startswith('Model name')), cpu)
  except (OSError, subprocess.CalledProcessError):
    pass
  date = subprocess.run(['date', '-u', '+%Y-%m-%d %H:%M UTC'], capture_output=True, text=True).stdout.strip()
  return dict(date=date, cpu=cpu, cores=os.cpu_count(), platform=platform.platform(),
              load_average_start=[round(x, 2) for x in os.getloadavg()])


def random_videos(num, frames, height, width, seed=0):
  """(num, frames, height, width, 3) uint8 noise and num prompts (the rewards' cost does not depend on
  the pixels)."""
  rng = np.random.default_rng(seed)
  return rng.integers(0, 256, (num, frames, height, width, 3), dtype=np.uint8), [PROMPT] * num


def timed_calls(fn, repeats):
  """[seconds of each of `repeats` calls of fn] after one warm-up call (loading, first-call costs)."""
  fn()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return times


def alternate_calls(fa, fb, repeats):
  """([seconds of fa], [seconds of fb]) over `repeats` rounds of fa then fb, after one warm-up call of
  each: both see the same load on a shared machine."""
  fa()
  fb()
  ta, tb = [], []
  for _ in range(repeats):
    for fn, times in ((fa, ta), (fb, tb)):
      t0 = time.perf_counter()
      fn()
      times.append(time.perf_counter() - t0)
  return ta, tb


SPIN = ('import time, torch; torch.set_num_threads(1); a = torch.rand(512, 512); t = time.perf_counter(); '
        '[a @ a for _ in range(300)]; print(time.perf_counter() - t)')


def cpu_control_row():
  """cpu_control row: the cores this benchmark gets on a shared machine, from a one-thread matmul loop run
  alone and then as two processes at once (on an idle 2-core machine both take as long as one alone)."""
  def run(n):
    procs = [subprocess.Popen([sys.executable, '-c', SPIN], stdout=subprocess.PIPE, text=True)
             for _ in range(n)]
    return [float(p.communicate()[0]) for p in procs]
  alone, two = run(1)[0], run(2)
  row = dict(bench='cpu_control', alone_seconds=alone, two_at_once_seconds=two,
             effective_cores=2 * alone / max(two), load_average=[round(x, 2) for x in os.getloadavg()])
  print(row, flush=True)
  return [row]


def failed(scores):
  """Videos with a non-finite score in any column of a scores dict (or in a (M,) array)."""
  cols = scores.values() if isinstance(scores, dict) else [scores]
  return int((~np.all([np.isfinite(np.asarray(c)) for c in cols], axis=0)).sum())


def guarded(name, fn):
  """fn()'s rows, or one row saying why it failed (the benchmark goes on)."""
  try:
    return fn()
  except Exception as e:  # pylint: disable=broad-except  (a failing reward is a result to report)
    row = dict(bench=name, error=f'{type(e).__name__}: {e}'[:300])
    print(row, flush=True)
    return [row]


# ------------------------------------------------------------------------------ tiny models, CPU
def tiny_kwargs(folder):
  """{reward: kwargs} of tiny random models written by each module's save_tiny under `folder`."""
  from ddrl_jax.rewards import cosmos_reason1  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import vbench  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import videoalign  # pylint: disable=g-import-not-at-top
  return {'videoalign': videoalign.save_tiny(os.path.join(folder, 'videoalign')),
          'cosmos_reason1': cosmos_reason1.save_tiny(os.path.join(folder, 'cosmos_reason1')),
          'vbench': vbench.save_tiny(os.path.join(folder, 'vbench'))}


def size_kwargs(kwargs, size):
  """The rewards' kwargs for videos of `size` (F, H, W): VBench with the dimensions that accept it."""
  from ddrl_jax.rewards import vbench  # pylint: disable=g-import-not-at-top
  out = dict(kwargs)
  out['vbench'] = dict(kwargs['vbench'], dimensions=tuple(vbench.accepted_dimensions(*size)))
  return out


def reward_cases(kwargs):
  """[(reward, dimension or None, kwargs)]: the three rewards, then each VBench dimension alone."""
  cases = [(name, None, kwargs[name]) for name in VIDEO_REWARDS]
  for d in kwargs['vbench']['dimensions']:
    cases.append(('vbench', d, dict(kwargs['vbench'], dimensions=(d,))))
  return cases


def cpu_rows(kwargs, size_name, videos, repeats):
  """cpu_tiny rows: median seconds per video of each reward and VBench dimension at SIZES[size_name]."""
  from ddrl_jax.rewards import make_reward  # pylint: disable=g-import-not-at-top
  size = SIZES[size_name]
  samples, prompts = random_videos(videos, *size)
  rows = []
  for name, dim, kw in reward_cases(size_kwargs(kwargs, size)):
    def one(name=name, dim=dim, kw=kw):
      reward = make_reward(name, **kw)
      out = {}
      times = timed_calls(lambda: out.update(s=reward.scores(samples, prompts)), repeats)
      per = [t / videos for t in times]
      row = dict(bench='cpu_tiny', reward=name, dimension=dim, size=size_name,
                 frames=size[0], height=size[1], width=size[2], videos=videos, repeats=repeats,
                 seconds_per_video=statistics.median(per), seconds_per_video_min=min(per),
                 seconds_per_video_runs=per, failed=failed(out['s']))
      if name == 'vbench' and dim is None:
        row['dimensions'] = list(kw['dimensions'])
      print(row, flush=True)
      return [row]
    rows += guarded('cpu_tiny', one)
  return rows


@contextlib.contextmanager
def reward_config(kwargs, workers, chunk_size):
  """configs/cosmos2b.py:smoke's config.reward naming the three video rewards, as a service (closed after)."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from configs import cosmos2b  # pylint: disable=g-import-not-at-top
  from ddrl_jax import rewards  # pylint: disable=g-import-not-at-top
  c = cosmos2b.get_config('smoke').reward
  c.fns = ml_collections.ConfigDict({name: 1.0 for name in VIDEO_REWARDS})
  c.kwargs = ml_collections.ConfigDict({n: dict(kwargs[n]) for n in VIDEO_REWARDS})
  c.workers, c.chunk_size, c.chunk_timeout_s = workers, chunk_size, 600.0
  service = rewards.make_reward_service(c)
  try:
    yield service
  finally:
    service.close()


def service_rows(kwargs, size_name, videos, repeats, workers_list):
  """service rows: the three rewards through make_reward_service with each worker count against the same
  rewards scored in this process (InlinePool: one thread, no process boundary), timed alternately."""
  from ddrl_jax import rewards  # pylint: disable=g-import-not-at-top
  size = SIZES[size_name]
  kw = size_kwargs(kwargs, size)
  samples, prompts = random_videos(videos, *size, seed=1)
  inline = rewards.InlinePool({n: kw[n] for n in VIDEO_REWARDS})
  rows = []
  for workers in workers_list:
    def one(workers=workers):
      out = {}
      with reward_config(kw, workers, chunk_size=1) as service:
        t_in, t_sv = alternate_calls(
            lambda: inline.submit(samples, prompts, chunk_size=1).result(600),
            lambda: out.update(r=service.submit(samples, prompts).result()), repeats)
      t_in, t_sv = statistics.median(t_in) / videos, statistics.median(t_sv) / videos
      row = dict(bench='service', size=size_name, frames=size[0], height=size[1], width=size[2],
                 rewards=list(VIDEO_REWARDS), workers=workers, videos=videos, chunk_size=1,
                 repeats=repeats, in_process_seconds_per_video=t_in, seconds_per_video_wall=t_sv,
                 speedup=t_in / t_sv, failed=out['r'].num_failed,
                 failures={k: v for k, v in out['r'].failures.items() if v})
      if workers == 1:
        row['overhead_seconds_per_video'] = t_sv - t_in
        row['overhead_fraction'] = (t_sv - t_in) / t_in
      print(row, flush=True)
      return [row]
    rows += guarded('service', one)
  return rows


def transport_rows(videos, repeats):
  """transport rows: mean_intensity on paper-size videos, inline (a thread) against one worker process,
  timed alternately."""
  from ddrl_jax import rewards  # pylint: disable=g-import-not-at-top
  f, h, w = PAPER['frames'], PAPER['height'], PAPER['width']
  samples, prompts = random_videos(videos, f, h, w, seed=2)
  with rewards.InlinePool({'mean_intensity': {}}) as inline, \
      rewards.WorkerPool({'mean_intensity': {}}, 1, chunk_timeout_s=600) as worker:
    t_in, t_wk = alternate_calls(lambda: inline.submit(samples, prompts, chunk_size=1).result(600),
                                 lambda: worker.submit(samples, prompts, chunk_size=1).result(600), repeats)
  t_in, t_wk = statistics.median(t_in) / videos, statistics.median(t_wk) / videos
  mb = samples[0].nbytes / 1e6
  row = dict(bench='transport', reward='mean_intensity', frames=f, height=h, width=w, videos=videos,
             repeats=repeats, mb_per_video=mb, inline_seconds_per_video=t_in,
             worker_seconds_per_video=t_wk, overhead_seconds_per_video=t_wk - t_in,
             mb_per_s_through_pool=mb / (t_wk - t_in) if t_wk > t_in else None)
  print(row, flush=True)
  return [row]


def input_seconds(name, reward, video):
  """Seconds of the CPU part of one paper-size video's inputs: frame choice and resize, then patch rows
  (Qwen-VL's layout, with the real patch 14, temporal patch 2 and merge 2)."""
  from ddrl_jax.rewards import cosmos_reason1  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import videoalign  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  if name == 'videoalign':
    idx, (h, w) = reward.plan(video[None])
    frames = videoalign.resize_frames(video[idx], h, w)
  else:
    idx, (h, w), _ = reward.plan(video[None])
    frames = cosmos_reason1.resize_frames(video[idx], h, w)
  rows, grid = videoalign.patchify(frames, videoalign.CLIP_MEAN, videoalign.CLIP_STD)
  return time.perf_counter() - t0, len(idx), (h, w), tuple(int(g) for g in grid), rows.shape[0]


def host_input_rows(kwargs, repeats):
  """host_inputs rows: VideoAlign's and Reason1's CPU input work on one paper-size video, and their whole
  call with the tiny models (tiny networks on the real token counts)."""
  from ddrl_jax.rewards import make_reward  # pylint: disable=g-import-not-at-top
  samples, prompts = random_videos(1, PAPER['frames'], PAPER['height'], PAPER['width'], seed=3)
  rows = []
  for name in ('videoalign', 'cosmos_reason1'):
    def one(name=name):
      reward = make_reward(name, **kwargs[name])
      info = {}
      times = timed_calls(lambda: info.update(r=input_seconds(name, reward, samples[0])), repeats)
      calls = timed_calls(lambda: reward.scores(samples, prompts), repeats)
      _, n, hw, grid, patches = info['r']
      row = dict(bench='host_inputs', reward=name, frames=PAPER['frames'], height=PAPER['height'],
                 width=PAPER['width'], repeats=repeats, frames_read=n, frame_size=list(hw),
                 grid=list(grid), patches=patches, input_seconds_per_video=statistics.median(times),
                 tiny_call_seconds_per_video=statistics.median(calls))
      print(row, flush=True)
      return [row]
    rows += guarded('host_inputs', one)
  return rows


# ------------------------------------------------------------------------------------- FLOP counts
def window_lengths(gh, gw, merge, window, patch):
  """Patches in each attention window of one gh x gw slice (Qwen2.5-VL's windows of window // merge //
  patch merged units a side; edge windows smaller)."""
  lh, lw, ws = gh // merge, gw // merge, window // merge // patch
  return [min(ws, lh - i) * min(ws, lw - j) * merge**2
          for i in range(0, lh, ws) for j in range(0, lw, ws)]


def qwen_vl_flops(arch, grid, text_len):
  """{'vision', 'vision_attention', 'text', 'text_attention'}: model FLOPs (2 per multiply-accumulate) of
  one Qwen-VL prefill over one video of grid (t, gh, gw) patches inside a sequence of text_len tokens (its
  video tokens included).

  Vision: the patch embedding (3 x temporal_patch x patch^2 inputs), per layer q, k, v, o (4 W^2) and the
  MLP (2 or, gated, 3 x W x mlp) per patch, the merger (4W -> 4W -> out) per merged token; attention
  2 S^2 W per layer and sequence of S patches (each temporal slice; each window in Qwen2.5-VL's window
  layers). Text: per token per layer q, o (2 H^2), k, v (2 H kv_heads head_dim) and the gated MLP (3 H I);
  attention 2 L^2 H per layer, counted in full (causal masking would halve it). The reward heads read a
  few positions only (left out)."""
  v, x = arch['vision'], arch['text']
  t, gh, gw = grid
  w, patches = v['width'], t * gh * gw
  per_patch = 3 * v['temporal_patch'] * v['patch']**2 * w + v['depth'] * (
      4 * w * w + (3 if v['gated'] else 2) * w * v['mlp'])
  merger = patches // v['merge']**2 * (16 * w * w + 4 * w * v['out'])
  full = t * (gh * gw)**2
  if v['window']:
    windowed = t * sum(s * s for s in window_lengths(gh, gw, v['merge'], v['window'], v['patch']))
    squares = len(v['full_blocks']) * full + (v['depth'] - len(v['full_blocks'])) * windowed
  else:
    squares = v['depth'] * full
  h = x['hidden']
  per_token = 2 * h * h + 2 * h * x['kv_heads'] * (h // x['heads']) + 3 * h * x['intermediate']
  return {'vision': 2.0 * (patches * per_patch + merger), 'vision_attention': 2.0 * 2 * squares * w,
          'text': 2.0 * x['layers'] * text_len * per_token,
          'text_attention': 2.0 * x['layers'] * 2 * text_len**2 * h}


def arch_from_hf(cfg):
  """This file's architecture dict of a transformers Qwen2-VL / Qwen2.5-VL config (the tiny models')."""
  v, x = cfg.vision_config, cfg.text_config
  if cfg.model_type == 'qwen2_vl':
    vision = dict(width=v.embed_dim, depth=v.depth, mlp=int(v.embed_dim * v.mlp_ratio), gated=False,
                  out=v.hidden_size, window=0, full_blocks=())
  else:
    vision = dict(width=v.hidden_size, depth=v.depth, mlp=v.intermediate_size, gated=True,
                  out=v.out_hidden_size, window=v.window_size, full_blocks=tuple(v.fullatt_block_indexes))
  vision.update(patch=v.patch_size, temporal_patch=v.temporal_patch_size, merge=v.spatial_merge_size)
  text = dict(hidden=x.hidden_size, layers=x.num_hidden_layers, heads=x.num_attention_heads,
              kv_heads=x.num_key_value_heads, intermediate=x.intermediate_size)
  return dict(vision=vision, text=text)


def counted(fn):
  """(total FLOPs, {'conv', 'matmul'} FLOPs) torch's FlopCounterMode counts in fn() under no_grad."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch.utils import flop_counter  # pylint: disable=g-import-not-at-top
  with torch.no_grad(), flop_counter.FlopCounterMode(display=False) as fc:
    fn()
  ops = fc.get_flop_counts().get('Global', {})
  conv = sum(v for k, v in ops.items() if 'convolution' in str(k))
  return float(fc.get_total_flops()), {'conv': float(conv), 'matmul': float(fc.get_total_flops() - conv)}


def tiny_model_inputs(name, reward, samples, prompts):
  """(the tiny transformers model, its keyword inputs) for the first video, as the reward builds them."""
  from ddrl_jax.rewards import cosmos_reason1  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import videoalign  # pylint: disable=g-import-not-at-top
  if name == 'videoalign':
    idx, (h, w) = reward.plan(samples)
    return reward.vam.model, reward.vam.inputs([videoalign.resize_frames(samples[0][idx], h, w)],
                                                prompts[:1])
  idx, (h, w), fps = reward.plan(samples)
  return reward.judge.model, reward.judge.inputs([cosmos_reason1.resize_frames(samples[0][idx], h, w)],
                                                 prompts[:1], fps, reward.system)


def flops_check_rows(kwargs):
  """flops_check rows: qwen_vl_flops on the tiny models' configs and inputs against FlopCounterMode's
  count of the whole reward call on one video, at both tiny sizes. The comparison is of the linear and
  convolution parts: the tiny models attend through torch's CPU scaled_dot_product_attention, which
  FlopCounterMode does not count (the attention terms stay formula-only)."""
  from ddrl_jax.rewards import make_reward  # pylint: disable=g-import-not-at-top
  rows = []
  for size_name, size in SIZES.items():
    samples, prompts = random_videos(1, *size, seed=4)
    for name in ('videoalign', 'cosmos_reason1'):
      def one(name=name, size_name=size_name, samples=samples, prompts=prompts):
        reward = make_reward(name, **kwargs[name])
        model, inputs = tiny_model_inputs(name, reward, samples, prompts)
        grid = tuple(int(g) for g in inputs['video_grid_thw'][0])
        formula = qwen_vl_flops(arch_from_hf(model.config), grid, int(inputs['input_ids'].shape[1]))
        total, _ = counted(lambda: reward.scores(samples, prompts))
        linear = formula['vision'] + formula['text']
        row = dict(bench='flops_check', reward=name, size=size_name, grid=list(grid),
                   text_len=int(inputs['input_ids'].shape[1]), counted_flops=total,
                   formula_linear_flops=linear, ratio=total / linear,
                   formula_attention_flops=formula['vision_attention'] + formula['text_attention'])
        print(row, flush=True)
        return [row]
      rows += guarded('flops_check', one)
  return rows


def vbench_networks():
  """{dimension: fn(frames (n, H, W, 3) uint8)} running the dimension's network at its real width with
  random weights on its own preprocessing (meta device where the network allows it)."""
  import torch  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import vbench  # pylint: disable=g-import-not-at-top
  clip = vbench.import_submodule('clip.model')
  meta = torch.device('meta')
  dino = {k: v.to(meta) for k, v in vbench.tiny_dino_state(dim=768, depth=12).items()}   # ViT-B/16
  with meta:
    text = dict(context_length=77, vocab_size=49408, transformer_width=512, transformer_heads=8,
                transformer_layers=12)
    b32 = clip.CLIP(embed_dim=512, image_resolution=224, vision_layers=12, vision_width=768,
                    vision_patch_size=32, **text)
    l14 = clip.CLIP(embed_dim=768, image_resolution=224, vision_layers=24, vision_width=1024,
                    vision_patch_size=14, **dict(text, transformer_width=768, transformer_heads=12))
    amt = vbench.import_submodule(vbench.AMT_NETWORK).Model(**vbench.AMT_CONFIG).eval()
  with tempfile.TemporaryDirectory() as tmp:      # MUSIQ as pyiqa's SPAQ release is shaped
    path = os.path.join(tmp, 'musiq.pth')
    torch.save(vbench.tiny_musiq_state(hidden=384, mlp_dim=1152, layers=14, stem=64), path)
    musiq = vbench.load_musiq(path, 'cpu')
  clip_in = lambda f, dev: vbench.clip_inputs(vbench.frames_tensor(f, dev))

  def amt_pair(f):
    x = torch.zeros((1, 3) + tuple(-(-s // vbench.AMT_DIVISOR) * vbench.AMT_DIVISOR for s in f.shape[1:3]),
                    device=meta)
    amt(x, x, torch.full((1, 1, 1, 1), 0.5, device=meta), scale_factor=1.0, eval=True)

  return {
      'subject_consistency': lambda f: vbench.dino_features(dino, vbench.dino_inputs(
          vbench.frames_tensor(f, meta))),
      'background_consistency': lambda f: b32.encode_image(clip_in(f, meta)),
      'motion_smoothness': amt_pair,
      'aesthetic_quality': lambda f: l14.encode_image(clip_in(f, meta)),
      'imaging_quality': lambda f: vbench.musiq_scores(*musiq, vbench.musiq_inputs(
          vbench.frames_tensor(f, 'cpu'))),
  }


def peak(dtype):
  """H100 SXM dense peak FLOP/s of `dtype` (ddrl_jax.flops.PEAK_FLOPS)."""
  from ddrl_jax import flops as flops_lib  # pylint: disable=g-import-not-at-top
  return flops_lib.PEAK_FLOPS['h100_sxm'][dtype]


def h100_seconds(parts, dtypes, mfu):
  """Seconds on one H100 of {part: FLOPs} with each part at mfu x the peak of dtypes[part]."""
  return sum(f / (mfu * peak(dtypes[p])) for p, f in parts.items())


def estimate_row(reward, dimension, parts, dtypes, basis, **extra):
  """A paper_flops row: FLOPs per paper-size video by part and H100 seconds at each REWARD_MFU."""
  row = dict(bench='paper_flops', reward=reward, dimension=dimension, frames=PAPER['frames'],
             height=PAPER['height'], width=PAPER['width'], flops_per_video=sum(parts.values()),
             flops_parts=parts, dtypes=dtypes, basis=basis, **extra)
  for mfu in REWARD_MFU:
    row[f'h100_seconds_per_video_mfu{int(mfu * 100)}'] = h100_seconds(parts, dtypes, mfu)
  print(row, flush=True)
  return row


def vbench_flop_rows():
  """paper_flops rows of the five VBench dimensions: per-frame (per-pair) counts x frames (pairs)."""
  frames = np.zeros((1, PAPER['height'], PAPER['width'], 3), np.uint8)
  pairs = -(-PAPER['frames'] // 2) - 1          # consecutive even frames: 0-2, 2-4, ..., 90-92
  rows = []
  for dim, fn in vbench_networks().items():
    _, parts = counted(lambda fn=fn: fn(frames))
    units = pairs if dim == 'motion_smoothness' else PAPER['frames']
    per_video = {k: v * units for k, v in parts.items() if v}
    rows.append(estimate_row('vbench', dim, per_video, VBENCH_DTYPES[dim],
                             'counted: FlopCounterMode on the real-width network, random weights',
                             flops_per_unit=sum(parts.values()), units=units,
                             unit='frame pair' if dim == 'motion_smoothness' else 'frame'))
  return rows


def qwen_flop_rows():
  """paper_flops rows of VideoAlign (Qwen2-VL-2B) and Cosmos-Reason1 (Qwen2.5-VL-7B) by formula, with the
  modules' own frame sampling and sizes for the paper's video."""
  from ddrl_jax.rewards import cosmos_reason1  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import videoalign  # pylint: disable=g-import-not-at-top
  f, h, w, fps = PAPER['frames'], PAPER['height'], PAPER['width'], PAPER['fps']
  idx_va, hw_va = videoalign.sampling_plan(f, h, w, fps)
  idx_cr, hw_cr, _ = cosmos_reason1.sampling_plan(f, h, w, fps)
  rows = []
  for name, arch, n, (fh, fw), rubric in (('videoalign', QWEN2_VL_2B, len(idx_va), hw_va, videoalign.RUBRIC),
                                          ('cosmos_reason1', QWEN25_VL_7B, len(idx_cr), hw_cr,
                                           cosmos_reason1.RUBRIC)):
    v = arch['vision']
    grid = (-(-n // v['temporal_patch']), fh // v['patch'], fw // v['patch'])
    video_tokens = grid[0] * grid[1] * grid[2] // v['merge']**2
    text_tokens = math.ceil(len(rubric) / CHARS_PER_TOKEN) + EXTRA_TEXT_TOKENS
    parts = qwen_vl_flops(arch, grid, video_tokens + text_tokens)
    rows.append(estimate_row(
        name, None, parts, dict.fromkeys(parts, 'bfloat16'),
        'formula on the published config (text tokens estimated)', frames_read=n, frame_size=[fh, fw],
        grid=list(grid), patches=grid[0] * grid[1] * grid[2], video_tokens=video_tokens,
        text_tokens_estimate=text_tokens))
  return rows


# ------------------------------------------------------------------------------------ arithmetic
def iteration_estimate():
  """One DDRL iteration of configs/cosmos2b.py: ddrl_jax.flops' model FLOPs by part, and seconds on its
  256 H100s at TRAIN_MFU (the whole iteration and its data-gradient phase)."""
  from configs import cosmos2b  # pylint: disable=g-import-not-at-top
  from ddrl_jax import flops as flops_lib  # pylint: disable=g-import-not-at-top
  from ddrl_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top
  c = cosmos2b.get_config()
  fwd = family_lib.from_config(c, 'cosmos').forward_flops((16,) + tuple(c.cosmos.latent_shape))
  it = flops_lib.iteration_flops(c, fwd)
  chips = c.mesh.data * c.mesh.fsdp * c.mesh.context * c.mesh.tensor
  rate = chips * peak('bfloat16') * TRAIN_MFU
  # The data gradient runs while the rewards are scored (trainer.train_iteration): it can hide them.
  return dict(forward_flops_per_sample=fwd, passes=flops_lib.iteration_passes(c)._asdict(),
              flops=it._asdict(), flops_total=it.total, chips=chips, train_mfu=TRAIN_MFU,
              iteration_seconds=it.total / rate, data_grad_seconds=it.data / rate,
              videos=c.batch_size * c.num_rollouts)


def gpus_needed(seconds_per_video, videos, budget):
  """The fewest GPUs (each scoring whole videos, ceil(videos / G) of them) that score `videos` within
  `budget` seconds; None when one video alone takes longer."""
  for g in range(1, videos + 1):
    if math.ceil(videos / g) * seconds_per_video <= budget:
      return g
  return None


def combos():
  """Reward sets a GPU worker hosts together (VideoAlign 2B + VBench + Reason1 7B in bf16 fit one H100)."""
  return {'videoalign': ('videoalign',), 'vbench': ('vbench',), 'cosmos_reason1': ('cosmos_reason1',),
          'videoalign+vbench': ('videoalign', 'vbench'),
          'videoalign+vbench+cosmos_reason1': ('videoalign', 'vbench', 'cosmos_reason1')}


def host_seconds(rows):
  """{reward: measured CPU seconds per paper-size video outside the GPU} and the transport seconds per
  video (one per worker, whatever its rewards), from host_inputs and transport rows (0 when missing)."""
  inputs = {r['reward']: r['input_seconds_per_video'] for r in rows
            if r.get('bench') == 'host_inputs' and 'input_seconds_per_video' in r}
  transport = [r['overhead_seconds_per_video'] for r in rows
               if r.get('bench') == 'transport' and 'overhead_seconds_per_video' in r]
  return inputs, max(0.0, transport[0]) if transport else 0.0


def gpu_seconds(flop_rows, key):
  """{reward: estimated H100 seconds per paper-size video} from paper_flops rows (VBench: its five
  dimensions summed) at the MFU named by key ('mfu30', ...)."""
  out = {}
  for r in flop_rows:
    if r.get('bench') == 'paper_flops':
      out[r['reward']] = out.get(r['reward'], 0.0) + r[f'h100_seconds_per_video_{key}']
  return out


def pool_entry(seconds_per_video, videos, budget, overlapped, data_grad):
  """Seconds per video and per batch on one GPU; the GPUs for the strict and for the overlapped goal, and
  at each count the scoring time and the trainer's wait after its data gradient (max(0, scoring - data
  gradient))."""
  out = dict(seconds_per_video=seconds_per_video, seconds_per_batch_one_gpu=seconds_per_video * videos)
  for goal, limit in (('strict', budget), ('overlapped', overlapped)):
    g = gpus_needed(seconds_per_video, videos, limit)
    out[f'gpus_{goal}'] = g
    if g:
      scoring = math.ceil(videos / g) * seconds_per_video
      out[f'scoring_seconds_{goal}'] = scoring
      out[f'wait_seconds_{goal}'] = max(0.0, scoring - data_grad)
  return out


def arithmetic_row(flop_rows, rows):
  """The paper_arithmetic row: per reward set, seconds per video and per batch on one H100, and the reward
  GPUs for the strict (scoring <= 5% of an iteration) and the overlapped (scoring - data gradient <= 5%)
  goal; at each REWARD_MFU, and at the first with this machine's measured host work per video (inputs,
  transport) added serially (a worker that does not overlap its CPU and GPU work)."""
  it = iteration_estimate()
  budget = WAIT_FRACTION * it['iteration_seconds']
  overlapped = it['data_grad_seconds'] + budget
  inputs, transport = host_seconds(rows)
  variants = {f'mfu{int(m * 100)}': (gpu_seconds(flop_rows, f'mfu{int(m * 100)}'), False) for m in REWARD_MFU}
  first = f'mfu{int(REWARD_MFU[0] * 100)}'
  variants[first + '_plus_host'] = (variants[first][0], True)
  per = {}
  for combo, names in combos().items():
    for label, (gpu, with_host) in variants.items():
      if all(n in gpu for n in names):
        s = sum(gpu[n] for n in names)
        if with_host:
          s += sum(inputs.get(n, 0.0) for n in names) + transport
        per.setdefault(combo, {})[label] = pool_entry(s, it['videos'], budget, overlapped,
                                                       it['data_grad_seconds'])
  row = dict(bench='paper_arithmetic', iteration=it, wait_fraction=WAIT_FRACTION, reward_mfu=list(REWARD_MFU),
             strict_budget_seconds=budget, overlapped_budget_seconds=overlapped,
             host_input_seconds_per_video=inputs, transport_seconds_per_video=transport, reward_sets=per)
  print(json.dumps(row, indent=1), flush=True)
  return row


# ------------------------------------------------------------------------------------------- main
def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--quick', action='store_true', help='2 videos, 1 timed call, 1 service run')
  parser.add_argument('--threads', type=int, default=1, help='torch threads (workers: OMP_NUM_THREADS)')
  parser.add_argument('--out', default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    'reward_speed.jsonl'))
  args = parser.parse_args()
  os.environ['OMP_NUM_THREADS'] = str(args.threads)      # the reward workers' torch threads
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(args.threads)
  videos, repeats = (2, 1) if args.quick else (4, 3)
  meta = dict(host_info(), command=' '.join(['python'] + sys.argv), torch_threads=args.threads,
              torch=torch.__version__, quick=args.quick)
  print(meta, flush=True)
  t0 = time.perf_counter()
  rows = cpu_control_row()
  with tempfile.TemporaryDirectory() as tmp:
    kwargs = tiny_kwargs(tmp)
    for size_name in SIZES:
      rows += cpu_rows(kwargs, size_name, videos, repeats)
    rows += guarded('service', lambda: service_rows(kwargs, 'motion', videos, repeats,
                                                    (2,) if args.quick else (1, 2)))
    rows += guarded('transport', lambda: transport_rows(2, repeats))
    rows += host_input_rows(kwargs, repeats)
    rows += flops_check_rows(kwargs)
  flop_rows = guarded('paper_flops', vbench_flop_rows) + guarded('paper_flops', qwen_flop_rows)
  rows += flop_rows
  rows.append(arithmetic_row(flop_rows, rows))
  meta['benchmark_seconds'] = time.perf_counter() - t0
  meta['load_average_end'] = [round(x, 2) for x in os.getloadavg()]
  with open(args.out, 'w') as f:
    for r in rows:
      f.write(json.dumps(dict(meta, **r), default=str) + '\n')
  print(f'{len(rows)} rows -> {args.out} ({meta["benchmark_seconds"]:.0f} s)', flush=True)


if __name__ == '__main__':
  main()
