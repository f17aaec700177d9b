"""Image rewards: seconds per image on this CPU, PyTorch and JAX paths, tiny and real size (issue 47).

  JAX_PLATFORMS=cpu python benchmarks/image_reward_speed.py [--quick] [--out=benchmarks/image_reward_speed.jsonl]

The rewards: torch pickscore, clipscore, clipscore_flowgrpo, laion_aesthetic, hpsv21, imagereward
(clip_rewards.py, hps.py, imagereward.py) and JAX pickscore_jax, clipscore_jax, clipscore_flowgrpo_jax,
laion_aesthetic_jax (clip_jax.py), plus hpsv21_jax when the registry has it when this runs (a printed
`not_timed` row otherwise). Not timed, and said so in a row each: unified_reward (an HTTP client of a
UnifiedReward-7b server; there is no model in this process) and the geneval rewards (their Mask2Former
detector needs mmdet 2.x / mmcv 1.x with CUDA ops, which do not install here).

Every reward is called as the trainer calls it: reward(samples, prompts) on host numpy (M, H, W, 3) uint8
images (the SD3 task's `reward_inputs` decodes to them) and M prompt strings. Torch runs on --threads threads
(1 by default, so the numbers are per core); JAX on the CPU device, with XLA's Eigen thread pool off when
--threads is 1 (XLA_FLAGS=--xla_cpu_multi_thread_eigen=false), so that both paths get one core. Every
timing follows a warm-up call (loading, JIT compilation and first calls excluded); medians of --repeats
calls; a torch reward and its JAX counterpart are timed alternately, call for call, so that both see the
same load on a shared machine.

Measured on this machine:
  cpu_control  a one-thread matmul loop alone and as two processes at once (reward_speed.py's): the cores
               this run really had (2.0 on an idle 2-core machine).
  cpu_tiny     seconds per image of each reward on tiny random models in the real checkpoint layouts (each
               module's `save_tiny`), at 64x64 (configs/sd35m.py:smoke's resolution) and 512x512 (the SD3.5
               recipe's). The tiny models take 32x32 pixels, so this is the wrapper: checks, tokenizing, the
               resize of the image to 32 (which dominates at 512) and a negligible network.
  preprocess   each reward's pixel path alone at its REAL target (224x224 pixels) from 64x64 and 512x512
               uint8: the torch host functions (processor's PIL bicubic for pickscore / laion_aesthetic,
               the tensor antialiased bilinear of clipscore, HPS's resize-longer-side-and-pad, ImageReward's
               PIL bicubic and crop) and the JAX `device_pixels` of the 'pil' and 'tensor' paths (and
               hps_jax's resize-and-pad when hpsv21_jax is registered), jitted alone.
  real_clip_l  CLIP ViT-L/14 at the openai/clip-vit-large-patch14 sizes with random weights (a transformers
               CLIPModel saved with the real 49,408-token CLIP BPE and the CLIP image processor, ~1.7 GB),
               loaded by `clipscore` (torch) and `clipscore_jax`: seconds per image at batch 4 on 512x512
               images, the achieved GFLOP/s (of the whole call, and of the model alone after the measured
               preprocessing), and the two paths' scores against each other.
Counted, not timed (model FLOPs per image, 2 per multiply-accumulate, at the published config sizes):
  flops        torch's FlopCounterMode on the meta device (nothing allocated): PickScore_v1 = CLIP ViT-H/14
               (HF CLIPModel, text at the prompt's own length: the reward pads to the batch's longest),
               CLIPScore = CLIP ViT-L/14 (text padded to 77), the aesthetic = CLIP ViT-L/14's vision tower
               + the MLP head, HPSv2.1 = open_clip ViT-H-14 (text 77), ImageReward = BLIP ViT-L/16 at 224 +
               BERT-base with cross-attention over 35 tokens. For the JAX rewards (hpsv21_jax: hps_jax's
               ViT-H-14 on clip_jax's ClipModel, when registered) also XLA's count,
               `jax.jit(fn).lower(abstract inputs).compile().cost_analysis()['flops']` of the reward's own
               pure function on `nnx.eval_shape`d parameters (nothing allocated): the model alone on 224
               pixels (`scores_from_pixels`) and the whole `scores` from 512x512 uint8 (device
               preprocessing included). XLA's cost analysis counts a while loop's body once, so the count
               compiles the model with its layer scan fully unrolled (the same ops; clip_jax's Encoder is
               patched for the count only). XLA counts elementwise work too (softmax, GELU, LayerNorm),
               FlopCounterMode only matmuls and convolutions.
Estimated (the assumptions are the constants below, repeated in the rows):
  estimate     CPU seconds per image of each real model on this machine: the measured preprocessing at
               512x512 + the model FLOPs / the model-alone GFLOP/s that real_clip_l achieved in that path;
               seconds per image on one H100 SXM = FLOPs / (MFU x the peak of the dtype) at MFU 30% and 10%
               in float32 (the torch rewards' default dtype; PyTorch's matmuls meet the FP32 peak under its
               default allow_tf32=False) and bfloat16; and the recipe's batch (configs/sd35m.py: 24 prompts x
               24 rollouts) on one H100 in bfloat16 at 30%.
"""
import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import reward_speed as rs        # benchmarks/reward_speed.py: host_info, cpu_control_row, timing helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPT = ('a watercolor painting of a lighthouse on a rocky cliff at sunset, seagulls flying over the '
          'crashing waves')
TORCH_REWARDS = ('pickscore', 'clipscore', 'clipscore_flowgrpo', 'laion_aesthetic', 'hpsv21', 'imagereward')
JAX_OF = {'pickscore': 'pickscore_jax', 'clipscore': 'clipscore_jax',
          'clipscore_flowgrpo': 'clipscore_flowgrpo_jax', 'laion_aesthetic': 'laion_aesthetic_jax',
          'hpsv21': 'hpsv21_jax'}
NOT_TIMED = {
    'unified_reward': 'an HTTP client of an OpenAI-compatible UnifiedReward-7b-v1.5 server (sglang / vLLM); '
                      'no model runs in this process, so there is nothing to time here',
    'geneval': "GenEval's Mask2Former detector needs mmdet 2.x with mmcv 1.x built with CUDA ops, which do "
               'not install here (PyPI has only mmdet 3 / mmcv 2); not timed',
}
REAL_PIXELS = 224                # every real model here takes 224x224 pixels
REAL_BATCH = 4                   # images per call of the measured real CLIP-L
REWARD_MFU = (0.30, 0.10)        # assumed MFU of the reward networks on a GPU: main figure and pessimistic
H100 = 'h100_sxm'

# Published config sizes (Hugging Face config.json of each release, open_clip's model_configs/ViT-H-14.json,
# BLIP's create_vit('large') and THUDM/ImageReward's med_config.json),
# in transformers CLIPConfig form for the two CLIPs.
CLIP_L14 = dict(   # openai/clip-vit-large-patch14: CLIPScore and the aesthetic predictor's backbone
    model_type='clip', projection_dim=768,
    text_config=dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                     num_attention_heads=12, max_position_embeddings=77, hidden_act='quick_gelu',
                     bos_token_id=0, eos_token_id=2, pad_token_id=1),
    vision_config=dict(image_size=224, patch_size=14, hidden_size=1024, intermediate_size=4096,
                       num_hidden_layers=24, num_attention_heads=16, hidden_act='quick_gelu'))
CLIP_H14 = dict(   # yuvalkirstain/PickScore_v1 (laion/CLIP-ViT-H-14-laion2B-s32B-b79K's shape)
    model_type='clip', projection_dim=1024,
    text_config=dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                     num_attention_heads=16, max_position_embeddings=77, hidden_act='gelu',
                     bos_token_id=49406, eos_token_id=49407, pad_token_id=1),
    vision_config=dict(image_size=224, patch_size=14, hidden_size=1280, intermediate_size=5120,
                       num_hidden_layers=32, num_attention_heads=16, hidden_act='gelu'))
IMAGEREWARD_VOCAB = 30524        # med_config.json: bert-base-uncased's 30522 + [DEC], [ENC]
WHAT = {
    'pickscore': 'CLIP ViT-H/14 (HF), text + vision',
    'clipscore': 'CLIP ViT-L/14 (HF), text (77) + vision',
    'clipscore_flowgrpo': 'CLIP ViT-L/14 (HF), text (77) + vision',
    'laion_aesthetic': 'CLIP ViT-L/14 vision + MLP head',
    'hpsv21': 'open_clip ViT-H-14, text (77) + vision',
    'imagereward': 'BLIP ViT-L/16 + BERT-base cross-attention (35 tokens)',
}


# ------------------------------------------------------------------------------------------ helpers
def sizes():
  """{'smoke': side, 'recipe': side}: configs/sd35m.py's image side in its smoke presets and its recipe."""
  from configs import sd35m  # pylint: disable=g-import-not-at-top
  return {'smoke': int(sd35m.get_config('smoke').sd3.resolution),
          'recipe': int(sd35m.get_config('flow_grpo_pickscore').sd3.resolution)}


def recipe_batch():
  """Images per iteration of configs/sd35m.py's image-reward recipe (prompts x rollouts)."""
  from configs import sd35m  # pylint: disable=g-import-not-at-top
  c = sd35m.get_config('flow_grpo_pickscore')
  return int(c.batch_size * c.num_rollouts)


def random_images(num, side, seed=0):
  """(num, side, side, 3) uint8 noise and num prompts (the cost does not depend on the pixels)."""
  rng = np.random.default_rng(seed)
  return rng.integers(0, 256, (num, side, side, 3), dtype=np.uint8), [PROMPT] * num


def per_image_stats(times, images):
  per = [t / images for t in times]
  return dict(seconds_per_image=statistics.median(per), seconds_per_image_min=min(per),
              seconds_per_image_runs=per)


def jax_registered():
  """The JAX rewards the registry knows now (hpsv21_jax only once it is registered)."""
  from ddrl_jax.rewards import registry  # pylint: disable=g-import-not-at-top
  known = set(registry.known_rewards())
  return {t: j for t, j in JAX_OF.items() if j in known}


def not_timed_rows(jax_of):
  rows = [dict(bench='not_timed', reward=name, reason=why) for name, why in NOT_TIMED.items()]
  if 'hpsv21' not in jax_of:
    rows.append(dict(bench='not_timed', reward='hpsv21_jax',
                     reason='not in ddrl_jax.rewards.registry when this ran (being added); skipped'))
  for r in rows:
    print(r, flush=True)
  return rows


# ------------------------------------------------------------------------------ tiny models, CPU
def tiny_kwargs(folder):
  """{reward: kwargs} of tiny random models written by each module's save_tiny under `folder`."""
  from ddrl_jax.rewards import clip_rewards  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import hps  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import imagereward  # pylint: disable=g-import-not-at-top
  clip = clip_rewards.save_tiny(os.path.join(folder, 'clip'))
  hps_kw = hps.save_tiny(os.path.join(folder, 'hps'))
  ir_kw = imagereward.save_tiny(os.path.join(folder, 'imagereward'))
  one = {'checkpoint': clip['checkpoint']}
  out = {'pickscore': one, 'clipscore': one, 'clipscore_flowgrpo': one, 'laion_aesthetic': clip,
         'hpsv21': hps_kw, 'imagereward': ir_kw}
  for t, j in JAX_OF.items():
    out[j] = dict(out[t])
  return out


def torch_kw(kw, batch):
  return dict(kw, device='cpu', batch_size=batch)


def jax_kw(kw, batch):
  """The JAX rewards' kwargs: the torch ones' files, no device= (they run on the default JAX device)."""
  return dict(kw, batch_size=batch)


def cpu_tiny_rows(kwargs, jax_of, side_name, side, images, repeats):
  """cpu_tiny rows: median seconds per image of each torch reward and its JAX counterpart (timed
  alternately) at side x side."""
  from ddrl_jax.rewards import make_reward  # pylint: disable=g-import-not-at-top
  samples, prompts = random_images(images, side)
  rows = []
  for name in TORCH_REWARDS:
    jname = jax_of.get(name)

    def one(name=name, jname=jname):
      out = {}
      torch_reward = make_reward(name, **torch_kw(kwargs[name], images))
      fa = lambda: out.update(t=torch_reward(samples, prompts))
      res, jax_reward = [], None
      if jname:
        try:
          jax_reward = make_reward(jname, **jax_kw(kwargs[jname], images))
        except Exception as e:  # pylint: disable=broad-except  (the torch reward is timed anyway)
          res.append(dict(bench='cpu_tiny', reward=jname, path='jax', size=side_name,
                          error=f'{type(e).__name__}: {e}'[:300]))
          print(res[-1], flush=True)
      if jax_reward is not None:
        fb = lambda: out.update(j=jax_reward(samples, prompts))
        ta, tb = rs.alternate_calls(fa, fb, repeats)
      else:
        ta, tb = rs.timed_calls(fa, repeats), None
      for reward, path, times, key in ((name, 'torch', ta, 't'), (jname, 'jax', tb, 'j')):
        if times is None:
          continue
        row = dict(bench='cpu_tiny', reward=reward, path=path, size=side_name, height=side, width=side,
                   images=images, repeats=repeats, failed=rs.failed(out[key]),
                   **per_image_stats(times, images))
        print(row, flush=True)
        res.append(row)
      return res
    rows += rs.guarded('cpu_tiny', one)
  return rows


# ------------------------------------------------------------------------------ preprocessing, CPU
def real_processor():
  """A CLIPImageProcessor as the CLIP releases ship it: short side 224 bicubic, centre crop 224, /255,
  OpenAI mean / std (transformers' defaults are those values)."""
  import transformers  # pylint: disable=g-import-not-at-top
  return transformers.CLIPImageProcessor(size={'shortest_edge': REAL_PIXELS},
                                         crop_size={'height': REAL_PIXELS, 'width': REAL_PIXELS})


def pixel_paths(with_hps_jax):
  """{(path name, 'torch' | 'jax'): (fn(samples) that returns the model's pixels, rewards using it)}."""
  import jax  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import clip_jax  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import clip_rewards  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import hps  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import imagereward  # pylint: disable=g-import-not-at-top
  proc = real_processor()
  jit_pil = jax.jit(lambda x: clip_jax.device_pixels(x, clip_jax.pixel_spec(proc, 'pil')))
  jit_tensor = jax.jit(lambda x: clip_jax.device_pixels(x, clip_jax.pixel_spec(proc, 'tensor')))
  out = {
      ('processor_pil_bicubic', 'torch'): (lambda s: clip_rewards.processor_pixels(proc, s),
                                           ('pickscore', 'laion_aesthetic')),
      ('tensor_bilinear_aa', 'torch'): (lambda s: clip_rewards.tensor_pixels(proc, s),
                                        ('clipscore', 'clipscore_flowgrpo')),
      ('hps_resize_longer_pad', 'torch'): (lambda s: hps.pixels(s, REAL_PIXELS), ('hpsv21',)),
      ('imagereward_pil_bicubic', 'torch'): (lambda s: imagereward.pixels(s, REAL_PIXELS), ('imagereward',)),
      ('processor_pil_bicubic', 'jax'): (lambda s: jit_pil(s).block_until_ready(),
                                         ('pickscore_jax', 'laion_aesthetic_jax')),
      ('tensor_bilinear_aa', 'jax'): (lambda s: jit_tensor(s).block_until_ready(),
                                      ('clipscore_jax', 'clipscore_flowgrpo_jax')),
  }
  if with_hps_jax:
    from ddrl_jax.rewards import hps_jax  # pylint: disable=g-import-not-at-top
    jit_hps = jax.jit(lambda x: hps_jax.device_pixels(x, REAL_PIXELS))
    out[('hps_resize_longer_pad', 'jax')] = (lambda s: jit_hps(s).block_until_ready(), ('hpsv21_jax',))
  return out


def preprocess_rows(side_names, images, repeats, with_hps_jax):
  """preprocess rows: seconds per image of each pixel path at the real 224 target."""
  rows = []
  paths = pixel_paths(with_hps_jax)
  for side_name, side in side_names.items():
    samples, _ = random_images(images, side, seed=1)
    for (path, impl), (fn, used_by) in paths.items():
      def one(path=path, impl=impl, fn=fn, used_by=used_by, samples=samples, side=side, side_name=side_name):
        times = rs.timed_calls(lambda: fn(samples), repeats)
        row = dict(bench='preprocess', pixel_path=path, path=impl, rewards=list(used_by), size=side_name,
                   height=side, width=side, target=REAL_PIXELS, images=images, repeats=repeats,
                   **per_image_stats(times, images))
        print(row, flush=True)
        return [row]
      rows += rs.guarded('preprocess', one)
  return rows


# ------------------------------------------------------------------------------------- FLOP counts
def clip_token_count(prompt):
  """Tokens of `prompt` under the CLIP BPE (start and end included): PickScore's padded length for a batch
  of one prompt (it pads to the batch's longest)."""
  from ddrl_jax.rewards import hps  # pylint: disable=g-import-not-at-top
  return len(hps.shared_tokenizer(77).ids(prompt))


def hf_clip(cfg, device='meta'):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  config = transformers.CLIPConfig(text_config=cfg['text_config'], vision_config=cfg['vision_config'],
                                   projection_dim=cfg['projection_dim'])
  with torch.device(device):
    return transformers.CLIPModel(config).eval()


def torch_parts(name, pick_tokens):
  """{'vision', 'text', 'head'} FlopCounterMode FLOPs of one image of torch reward `name` at its real
  size on the meta device, and {part: tokens} of its text."""
  import torch  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import clip_rewards  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import hps  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import imagereward  # pylint: disable=g-import-not-at-top
  meta = torch.device('meta')
  px = torch.zeros(1, 3, REAL_PIXELS, REAL_PIXELS, device=meta)
  ids = lambda n: torch.zeros(1, n, dtype=torch.long, device=meta)
  count = lambda fn: rs.counted(fn)[0]
  if name in ('pickscore', 'clipscore', 'clipscore_flowgrpo', 'laion_aesthetic'):
    model = hf_clip(CLIP_H14 if name == 'pickscore' else CLIP_L14)
    parts = {'vision': count(lambda: model.get_image_features(pixel_values=px))}
    if name == 'laion_aesthetic':
      mlp = clip_rewards.aesthetic_mlp(clip_rewards.tiny_aesthetic_state(CLIP_L14['projection_dim'])).to(meta)
      feats = torch.zeros(1, CLIP_L14['projection_dim'], device=meta)
      parts['head'] = count(lambda: mlp(feats))
      return parts, {}
    n = pick_tokens if name == 'pickscore' else clip_rewards.MAX_TOKENS
    parts['text'] = count(lambda: model.get_text_features(input_ids=ids(n), attention_mask=ids(n)))
    return parts, {'text_tokens': n}
  if name == 'hpsv21':
    model = hps.build_model(None, 'meta').eval()
    n = hps.VIT_H_14['text_cfg']['context_length']
    parts = {'vision': count(lambda: model.encode_image(px)),
             'text': count(lambda: model.encode_text(ids(n)))}
    return parts, {'text_tokens': n}
  med = dict(imagereward.MED_DEFAULTS, vocab_size=IMAGEREWARD_VOCAB, add_cross_attention=True)
  model = imagereward.build_model(med, None, 'meta').eval()
  n = imagereward.MAX_TOKENS
  vision = count(lambda: model.vision(pixel_values=px))
  total = count(lambda: model(px, ids(n), ids(n)))
  return {'vision': vision, 'text_cross': total - vision}, {'text_tokens': n}


@contextlib.contextmanager
def unrolled_layers():
  """clip_jax's Encoder with its layer scan fully unrolled (the same ops; XLA's cost analysis then sees
  every layer instead of one while-loop body)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import clip_jax  # pylint: disable=g-import-not-at-top
  original = clip_jax.Encoder.__call__

  def call(self, x, causal):
    scan = nnx.scan(lambda layer, carry: layer(carry, causal), in_axes=(0, nnx.Carry), out_axes=nnx.Carry,
                    unroll=True, transform_metadata={nnx.PARTITION_NAME: 'layers'})
    return scan(self.layers, x)

  clip_jax.Encoder.__call__ = call
  try:
    yield
  finally:
    clip_jax.Encoder.__call__ = original


def abstract_jax_reward(jname):
  """(the JAX reward object at real size with abstract parameters, its abstract params): the reward's
  class without its file loading (config, graph, pixel spec and precision set as __init__ sets them)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import clip_jax  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import registry  # pylint: disable=g-import-not-at-top
  cls = registry.get_factory(jname)
  reward = cls.__new__(cls)
  if jname == 'hpsv21_jax':         # hps_jax: open_clip ViT-H-14 on clip_jax's ClipModel
    from ddrl_jax.rewards import hps_jax  # pylint: disable=g-import-not-at-top
    reward.config = hps_jax.clip_config(None, jnp.float32)
    reward.image_size = reward.config.image_size
  else:
    reward.config = clip_jax.config_from_hf(CLIP_H14 if jname == 'pickscore_jax' else CLIP_L14,
                                            jname, jnp.float32, cls.with_text)
    reward.spec = clip_jax.pixel_spec(real_processor(), cls.pixel_path)
  reward._graphdef, state = clip_jax.abstract_state(reward.config)  # pylint: disable=protected-access
  reward.matmul_precision = 'highest'
  params = {'clip': state}
  if jname == 'laion_aesthetic_jax':
    from ddrl_jax.rewards import clip_rewards  # pylint: disable=g-import-not-at-top
    dims = (CLIP_L14['projection_dim'],) + clip_rewards.AESTHETIC_WIDTHS
    params['head'] = [(jax.ShapeDtypeStruct((a, b), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.float32))
                      for a, b in zip(dims[:-1], dims[1:])]
  return reward, params


def xla_flops(jname, side, whole):
  """(XLA's compiled FLOP count of one image, compile seconds): the model alone on 224 pixels, or with
  whole the reward's `scores` from side x side uint8 (device preprocessing included)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import clip_rewards  # pylint: disable=g-import-not-at-top
  reward, params = abstract_jax_reward(jname)
  ids = jax.ShapeDtypeStruct((1, clip_rewards.MAX_TOKENS), jnp.int32) if reward.config.with_text else None
  t0 = time.perf_counter()
  with unrolled_layers():
    if whole:
      lowered = jax.jit(reward.scores).lower(params, jax.ShapeDtypeStruct((1, side, side, 3), jnp.uint8), ids)
    else:
      lowered = jax.jit(reward.scores_from_pixels).lower(
          params, jax.ShapeDtypeStruct((1, REAL_PIXELS, REAL_PIXELS, 3), jnp.float32), ids)
    cost = lowered.compile().cost_analysis()
  if isinstance(cost, (list, tuple)):      # older jax: one dict per computation
    cost = cost[0]
  return float(cost['flops']), time.perf_counter() - t0


def flop_rows(jax_of, recipe_side, quick):
  """flops rows: FlopCounterMode's count per image of every torch reward at real size, and XLA's count of
  its JAX counterpart (clipscore_flowgrpo's equal clipscore's: the same networks; counted once)."""
  pick_tokens = clip_token_count(PROMPT)
  rows, cache = [], {}
  for name in TORCH_REWARDS:
    def one(name=name):
      base = 'clipscore' if name == 'clipscore_flowgrpo' else name
      if base not in cache:
        cache[base] = torch_parts(base, pick_tokens)
      parts, extra = cache[base]
      row = dict(bench='flops', reward=name, what=WHAT[name], pixels=REAL_PIXELS,
                 torch_flops_per_image=sum(parts.values()), torch_flops_parts=parts,
                 torch_basis='FlopCounterMode, meta device, published config sizes', **extra)
      jname = jax_of.get(name)
      if jname:
        jbase = 'clipscore_jax' if jname == 'clipscore_flowgrpo_jax' else jname
        key = ('xla', jbase)
        if key not in cache:
          model, t_model = xla_flops(jbase, recipe_side, whole=False)
          whole = t_whole = None
          if not quick:
            whole, t_whole = xla_flops(jbase, recipe_side, whole=True)
          cache[key] = (model, t_model, whole, t_whole)
        model, t_model, whole, t_whole = cache[key]
        row.update(jax_reward=jname, xla_flops_per_image=model, xla_compile_seconds=t_model,
                   xla_text_tokens=77 if name != 'laion_aesthetic' else None,
                   xla_over_torch=model / row['torch_flops_per_image'])
        if whole is not None:
          row.update(xla_flops_per_image_whole=whole, xla_whole_input=[recipe_side, recipe_side],
                     xla_preprocess_flops=whole - model, xla_whole_compile_seconds=t_whole)
      print(row, flush=True)
      return [row]
    rows += rs.guarded('flops', one)
  return rows


# -------------------------------------------------------------------------- real CLIP-L, measured
def write_clip_bpe(folder):
  """vocab.json and merges.txt of the real CLIP BPE (49,408 tokens), exported from the installed
  openai-clip package's tokenizer tables; returns the vocabulary size."""
  from ddrl_jax.rewards import hps  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import vbench  # pylint: disable=g-import-not-at-top
  simple = vbench.import_submodule('clip.simple_tokenizer').SimpleTokenizer(hps.bpe_path())
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, 'vocab.json'), 'w', encoding='utf-8') as f:
    json.dump(simple.encoder, f)
  merges = sorted(simple.bpe_ranks.items(), key=lambda kv: kv[1])
  with open(os.path.join(folder, 'merges.txt'), 'w', encoding='utf-8') as f:
    f.write('#version: 0.2\n' + ''.join(f'{a} {b}\n' for (a, b), _ in merges))
  return len(simple.encoder)


def save_real_clip_l(folder):
  """A random-weight CLIPModel at openai/clip-vit-large-patch14's sizes in the layout the rewards load
  (config.json, model.safetensors, CLIP tokenizer, CLIPImageProcessor); returns (folder, seconds, bytes)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  vocab = write_clip_bpe(folder)
  assert vocab == CLIP_L14['text_config']['vocab_size'], vocab
  tok = transformers.CLIPTokenizer(os.path.join(folder, 'vocab.json'), os.path.join(folder, 'merges.txt'),
                                   model_max_length=77)
  tok.save_pretrained(folder)
  real_processor().save_pretrained(folder)
  torch.manual_seed(0)
  model = hf_clip(CLIP_L14, 'cpu')
  model.save_pretrained(folder)
  del model
  gc.collect()
  size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
  return folder, time.perf_counter() - t0, size


def real_rows(folder_info, flops, pre, side, repeats):
  """real_clip_l rows: clipscore (torch) and clipscore_jax on the real-size random CLIP-L, batch
  REAL_BATCH of side x side images, timed alternately; GFLOP/s of the whole call and of the model alone
  (the call less the measured preprocessing of its pixel path)."""
  from ddrl_jax.rewards import make_reward  # pylint: disable=g-import-not-at-top
  folder, save_seconds, size = folder_info
  samples, prompts = random_images(REAL_BATCH, side, seed=2)
  t0 = time.perf_counter()
  torch_reward = make_reward('clipscore', checkpoint=folder, device='cpu', batch_size=REAL_BATCH)
  t_torch_load = time.perf_counter() - t0
  t0 = time.perf_counter()
  jax_reward = make_reward('clipscore_jax', checkpoint=folder, batch_size=REAL_BATCH)
  t_jax_load = time.perf_counter() - t0
  out = {}
  t0 = time.perf_counter()
  out['j'] = jax_reward(samples, prompts)
  t_jax_first = time.perf_counter() - t0      # compile + first call
  ta, tb = rs.alternate_calls(lambda: out.update(t=torch_reward(samples, prompts)),
                              lambda: out.update(j=jax_reward(samples, prompts)), repeats)
  rows = []
  for path, times, key in (('torch', ta, 't'), ('jax', tb, 'j')):
    stats = per_image_stats(times, REAL_BATCH)
    f = flops['torch'] if path == 'torch' else flops['xla']
    p = pre.get((path, 'tensor_bilinear_aa'))
    row = dict(bench='real_clip_l', reward='clipscore' if path == 'torch' else 'clipscore_jax', path=path,
               config='openai/clip-vit-large-patch14 sizes, random weights, real CLIP BPE', height=side,
               width=side, images=REAL_BATCH, repeats=repeats, folder_bytes=size,
               folder_write_seconds=save_seconds,
               load_seconds=t_torch_load if path == 'torch' else t_jax_load,
               flops_per_image=f, flops_basis='FlopCounterMode' if path == 'torch' else 'XLA cost_analysis',
               failed=rs.failed(out[key]), **stats)
    row['gflops_per_s_whole_call'] = f / stats['seconds_per_image'] / 1e9
    if p is not None:
      row['preprocess_seconds_per_image'] = p
      row['model_seconds_per_image'] = stats['seconds_per_image'] - p
      row['gflops_per_s_model'] = f / (stats['seconds_per_image'] - p) / 1e9
    if path == 'jax':
      row['first_call_seconds'] = t_jax_first
    print(row, flush=True)
    rows.append(row)
  diff = np.abs(out['t'].astype(np.float64) - out['j'].astype(np.float64))
  rows.append(dict(bench='real_clip_l_parity', torch_scores=out['t'].tolist(), jax_scores=out['j'].tolist(),
                   max_abs_diff=float(diff.max())))
  print(rows[-1], flush=True)
  return rows


# ------------------------------------------------------------------------------------ estimates
def peak(dtype):
  from ddrl_jax import flops as flops_lib  # pylint: disable=g-import-not-at-top
  return flops_lib.PEAK_FLOPS[H100][dtype]


def estimate_rows(rows, recipe_side, batch):
  """estimate rows: per reward and path, CPU seconds per image of the real model on this machine (measured
  preprocessing + FLOPs / real_clip_l's model-alone rate of that path) and H100 seconds per image."""
  real = {r['path']: r for r in rows if r.get('bench') == 'real_clip_l' and 'gflops_per_s_model' in r}
  pre = {(r['path'], rw): r['seconds_per_image'] for r in rows if r.get('bench') == 'preprocess'
         and r['height'] == recipe_side for rw in r['rewards']}
  out = []
  for r in rows:
    if r.get('bench') != 'flops':
      continue
    for path, reward, f, basis in (('torch', r['reward'], r['torch_flops_per_image'], 'FlopCounterMode'),
                                   ('jax', r.get('jax_reward'), r.get('xla_flops_per_image'), 'XLA')):
      if reward is None or f is None:
        continue
      row = dict(bench='estimate', reward=reward, path=path, flops_per_image=f, flops_basis=basis,
                 height=recipe_side, width=recipe_side, recipe_batch=batch, reward_mfu=list(REWARD_MFU))
      if path in real and (path, reward) in pre:
        rate = real[path]['gflops_per_s_model'] * 1e9
        row.update(cpu_rate_gflops_per_s=rate / 1e9, cpu_preprocess_seconds_per_image=pre[(path, reward)],
                   cpu_seconds_per_image_estimate=pre[(path, reward)] + f / rate,
                   cpu_basis='measured preprocessing + FLOPs / real CLIP-L model-alone rate, this path')
      for dtype in ('float32', 'bfloat16'):
        for mfu in REWARD_MFU:
          row[f'h100_{dtype}_seconds_per_image_mfu{int(mfu * 100)}'] = f / (mfu * peak(dtype))
      row['h100_bfloat16_recipe_batch_seconds_mfu30'] = batch * f / (REWARD_MFU[0] * peak('bfloat16'))
      row['h100_float32_recipe_batch_seconds_mfu30'] = batch * f / (REWARD_MFU[0] * peak('float32'))
      print(row, flush=True)
      out.append(row)
  return out


# ------------------------------------------------------------------------------------------- main
def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--quick', action='store_true',
                      help='4 tiny images, 1 timed call, no whole-reward XLA counts (~2-3 min)')
  parser.add_argument('--threads', type=int, default=1,
                      help='torch threads; 1 also turns off XLA Eigen threads')
  parser.add_argument('--out', default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    'image_reward_speed.jsonl'))
  args = parser.parse_args()
  if args.threads == 1:      # before jax is imported: one XLA CPU thread, as torch
    flag = '--xla_cpu_multi_thread_eigen=false'
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + flag).strip()
  os.environ['OMP_NUM_THREADS'] = str(args.threads)
  import jax  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(args.threads)
  images, repeats = (4, 1) if args.quick else (8, 5)
  real_repeats = 1 if args.quick else 3
  meta = dict(rs.host_info(), command=' '.join(['python'] + sys.argv), torch_threads=args.threads,
              torch=torch.__version__, jax=jax.__version__, jax_backend=jax.default_backend(),
              xla_flags=os.environ.get('XLA_FLAGS', ''), quick=args.quick)
  print(meta, flush=True)
  t0 = time.perf_counter()
  side_names = sizes()
  batch = recipe_batch()
  jax_of = jax_registered()
  rows = rs.cpu_control_row() + not_timed_rows(jax_of)
  with tempfile.TemporaryDirectory() as tmp:
    kwargs = tiny_kwargs(tmp)
    for side_name, side in side_names.items():
      rows += cpu_tiny_rows(kwargs, jax_of, side_name, side, images, repeats)
  rows += preprocess_rows(side_names, images, repeats, 'hpsv21' in jax_of)
  rows += flop_rows(jax_of, side_names['recipe'], args.quick)
  flops = {}
  for r in rows:
    if r.get('bench') == 'flops' and r['reward'] == 'clipscore':
      flops = {'torch': r['torch_flops_per_image'], 'xla': r.get('xla_flops_per_image')}
  pre = {(r['path'], r['pixel_path']): r['seconds_per_image'] for r in rows
         if r.get('bench') == 'preprocess' and r['height'] == side_names['recipe']}
  with tempfile.TemporaryDirectory() as tmp:
    info = rs.guarded('real_clip_l', lambda: [save_real_clip_l(os.path.join(tmp, 'clip_l14'))])[0]
    if isinstance(info, tuple) and flops.get('xla'):
      rows += rs.guarded('real_clip_l',
                         lambda: real_rows(info, flops, pre, side_names['recipe'], real_repeats))
    gc.collect()
  rows += estimate_rows(rows, side_names['recipe'], batch)
  rows.append(rs.cpu_control_row()[0] | {'bench': 'cpu_control_end'})
  meta['benchmark_seconds'] = time.perf_counter() - t0
  meta['load_average_end'] = [round(x, 2) for x in os.getloadavg()]
  with open(args.out, 'w') as f:
    for r in rows:
      f.write(json.dumps(dict(meta, **r), default=str) + '\n')
  print(f'{len(rows)} rows -> {args.out} ({meta["benchmark_seconds"]:.0f} s)', flush=True)


if __name__ == '__main__':
  main()
