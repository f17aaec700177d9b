"""One Cosmos-Predict2.5-2B DDRL iteration on one accelerator: step times, MFU and peak memory, one JSON line.

  python benchmarks/gpu_step.py                                   # one H100 / H200 (or one TPU chip)
  python benchmarks/gpu_step.py --frames=29                       # an H200 (flags below)
  JAX_PLATFORMS=cpu python benchmarks/gpu_step.py --tiny          # tiny model on the CPU (the test's run)
  JAX_PLATFORMS=cpu python benchmarks/gpu_step.py --topology=v5p-8 --compile_only   # memory, no chip
  python benchmarks/gpu_step.py --config=configs/sd35m.py:flow_grpo     # another family's recipe
  JAX_PLATFORMS=cpu python benchmarks/gpu_step.py --config=configs/sd35m.py:flow_grpo_smoke --tiny

--config=FILE[:ARG] runs that config's own recipe and shapes (any model family, with its LoRA adapters:
the frozen base in the compute dtype, adapter-sized optimizer state, as the trainer holds them) on one
device with --groups x --rollouts slots; the video-shape flags below apply to the Cosmos default only.

What runs: configs/cosmos2b.py's DDRL recipe and the video task (ddrl_jax/tasks/video.py) at the shape
the flags choose, on a one-device mesh, through the trainer's own jitted functions
(`update.build_step_fns`): the rollout (a scan over T steps, one network call on the B*N slots per step,
plus cosmos' final clean call), the data-term gradient and the update (policy gradient, AdamW, EMA),
with the recipe's bf16 compute, full remat and the platform's attention kernel (models/attention.py:
'cudnn' on GPU, 'splash' on TPU; 'xla' on CPU). Conditions, paired latents and rewards are random: the
VAE, the text encoder and the reward service do not run (their work is not in the FLOPs).

Each function is compiled ahead of time first (compile_s, and XLA's memory_analysis per function), then
iterations run: the first is a warm-up and is left out of the times when a later one ran; at most
--iterations are timed, and none starts when the time so far plus the last iteration's would pass
--budget_s (stopped_early: true). The line is printed in every case, with "error" when something failed
(exit status 1). Times are medians over the timed iterations; MFU is the analytic model FLOPs of the
iteration (ddrl_jax/flops.py: 3 forwards per trained step for the policy and for the data term, no
remat recompute) over time_iteration_s and the chip's dense peak for the compute dtype; peak memory is
`device.memory_stats()['peak_bytes_in_use']` where the platform reports it (GPU, TPU), else the largest
per-function memory_analysis (argument + output - alias + temp bytes).

Default shape, for one 80 GB H100 up to a 141 GB H200: 2B at its 28 blocks, 1 group x N = 2 rollouts, T = 20
with the even steps 0..18 trained (the recipe), 512 text tokens, 13 frames at 480x832 (latent 4 x 60 x 104,
6,240 tokens per sample; the recipe is 93 frames at 720p, 86,400 tokens). Chosen by compile-only
memory_analysis of the largest function, `update`, for one v5p chip (`--topology=v5p-8 --compile_only`,
splash attention, libtpu on the 2-core CPU host, 2026-12-01): 59.9 GiB at 780 tokens (5 frames, 240x416),
69.3 GiB at the default 6,240, 81.0 GiB at 12,480 (29 frames; rollout 16.0 GiB, data_grads 46.2 GiB there):
~60 GiB that does not shrink with the shape (fp32 params, Adam moments and EMA, 2.06e9 x 16 bytes = 30.7
GiB; the data gradient 7.7 GiB; the update's gradient accumulators and optimizer temporaries) plus ~1.8 MiB
per token for the two slots. An 80 GB H100 gives XLA 92% of its 79.6 GiB (XLA_PYTHON_CLIENT_MEM_FRACTION,
set to 0.92 here unless already set), 73 GiB: the default should fit with a few GiB to spare, but this is a
TPU estimate (GPU fusion, padding and cuDNN workspaces differ): read peak_bytes of the first run. On an H200
(128 GiB at 0.92) `--frames=29` fits (32 s per iteration at 40% MFU), and by the same slope ~45 frames (~92
GiB, 59 s). The default iteration is 81 forwards x 2 slots x 3.04e13 FLOPs = 4.9e15 model FLOPs, ~12 s at
40% MFU of an H100: compile, warm-up and 3 timed iterations stay well inside the 420 s budget.
"""
import argparse
import concurrent.futures
import json
import math
import os
import statistics
import sys
import time

# JAX on a GPU preallocates 75% of its memory by default; the 2B iteration needs more than that of an
# 80 GB card. Set the variable to override (it must be set before JAX starts).
os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.92')

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from configs import cosmos2b  # pylint: disable=g-import-not-at-top,wrong-import-position
from ddrl_jax import aot  # pylint: disable=wrong-import-position
from ddrl_jax import cli  # pylint: disable=wrong-import-position
from ddrl_jax import config as config_lib  # pylint: disable=wrong-import-position
from ddrl_jax import flops as flops_lib  # pylint: disable=wrong-import-position
from ddrl_jax import program as program_lib  # pylint: disable=wrong-import-position
from ddrl_jax import parallel  # pylint: disable=wrong-import-position
from ddrl_jax import tasks  # pylint: disable=wrong-import-position
from ddrl_jax import update as update_lib  # pylint: disable=wrong-import-position
from ddrl_jax import xla_flags  # pylint: disable=wrong-import-position
from ddrl_jax.models import attention as attention_lib  # pylint: disable=wrong-import-position
from ddrl_jax.models import lora as lora_lib  # pylint: disable=wrong-import-position
from ddrl_jax.models.cosmos import dit as cosmos_dit  # pylint: disable=wrong-import-position
from ddrl_jax.parallel import topology as topology_lib  # pylint: disable=wrong-import-position

FUNCTIONS = ('rollout', 'data_grads', 'update')
# Flag defaults: (full run on an accelerator, --tiny on the CPU).
DEFAULTS = dict(frames=(13, 5), height=(480, 32), width=(832, 32), num_steps=(20, 4), text_length=(512, 16),
                dtype=('bfloat16', 'float32'), remat=('full', 'none'))
VAE_TIME, VAE_SPACE, PATCH = 4, 8, 2     # Wan2.1: 4x temporal, 8x spatial; the DiT's 2x2 patches


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--config', default='', help="FILE[:ARG], e.g. configs/sd35m.py:flow_grpo ('': the "
                                              "Cosmos 2B recipe at the shape flags)")
  p.add_argument('--tiny', action='store_true', help='the tiny DiT and VAE of cosmos2b:smoke (CPU); with '
                                                     '--config: allow the CPU (a *_smoke config)')
  p.add_argument('--frames', type=int, help='video frames, 4k + 1 (13; tiny 5)')
  p.add_argument('--height', type=int, help='pixels, a multiple of 16 (480; tiny 32)')
  p.add_argument('--width', type=int, help='pixels, a multiple of 16 (832; tiny 32)')
  p.add_argument('--groups', type=int, default=1, help='B condition groups')
  p.add_argument('--rollouts', type=int, default=2, help='N rollouts per group (>= 2)')
  p.add_argument('--num_steps', type=int, help='T sampler steps (20; tiny 4)')
  p.add_argument('--train_steps', default='', help="trained steps, e.g. '0,2,4' ('': the even steps "
                                                   "0, 2, ..., T - 2, the recipe's)")
  p.add_argument('--num_blocks', type=int, default=0, help='override the DiT depth (0: the model\'s)')
  p.add_argument('--text_length', type=int, help='text tokens (512; tiny 16)')
  p.add_argument('--data_loss_steps', default='full', choices=('full', 'reduced'))
  p.add_argument('--dtype', choices=('bfloat16', 'float32'), help='compute dtype (bf16; tiny fp32)')
  p.add_argument('--remat', choices=sorted(cosmos_dit.REMAT_POLICIES),
                 help="block remat policy (full; tiny none)")
  p.add_argument('--attention', default='', help="attention kernel ('': the platform's)")
  p.add_argument('--iterations', type=int, default=3, help='timed iterations at most (after a warm-up)')
  p.add_argument('--budget_s', type=float, default=420.0, help='start no phase that would end past this')
  p.add_argument('--topology', default='', help="compile for a TPU slice's first chip (e.g. v5p-8) "
                                                "instead of the local device; needs --compile_only")
  p.add_argument('--compile_only', action='store_true', help='compile and report memory; run nothing')
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--micro_batch', type=int, default=0, help='config.micro_batch: rollout slots per chunk '
                 '(one device; 0: the whole batch at once)')
  args = p.parse_args(argv)
  for name, (full, tiny) in DEFAULTS.items():
    if getattr(args, name) is None:
      setattr(args, name, tiny if args.tiny else full)
  if args.topology and not args.compile_only:
    p.error('--topology compiles for chips this host does not have: add --compile_only')
  return args


def latent_shape(frames, height, width):
  """(T, H, W) Wan latent of a (frames, height, width) video; ValueError unless the DiT can patch it."""
  if frames < 1 or (frames - 1) % VAE_TIME:
    raise ValueError(f'--frames={frames}: must be 4k + 1 (Wan VAE: 4x causal temporal compression)')
  for name, v in (('height', height), ('width', width)):
    if v < VAE_SPACE * PATCH or v % (VAE_SPACE * PATCH):
      raise ValueError(f'--{name}={v}: must be a positive multiple of {VAE_SPACE * PATCH} '
                       f'(8x VAE times the 2x2 patch)')
  return (1 + (frames - 1) // VAE_TIME, height // VAE_SPACE, width // VAE_SPACE)


def parse_steps(text, num_steps):
  """'0,2,4' -> (0, 2, 4); '' -> the recipe's even steps 0, 2, ..., num_steps - 2."""
  if not text:
    return tuple(range(0, num_steps - 1, 2))
  try:
    return tuple(int(s) for s in text.split(','))
  except ValueError:
    raise ValueError(f'--train_steps={text!r}: expected comma-separated step indices') from None


def attention_kernel(flag, platform, dtype):
  """The --attention kernel, or the platform's; on GPU float32 compute takes 'xla' (cuDNN's flash
  attention needs bf16/fp16 inputs)."""
  if not flag and platform in ('gpu', 'cuda') and dtype == 'float32':
    return 'xla'
  return attention_lib.resolve(flag, platform)


def load_config(spec):
  """`FILE[:ARG]` -> FILE's get_config(ARG) (ml_collections' config-file convention)."""
  path, _, arg = spec.partition(':')
  path = path if os.path.isabs(path) else os.path.join(_ROOT, path)
  if not os.path.exists(path):
    raise ValueError(f'--config={spec!r}: no file {path}')
  return cli.load_config(f'{path}:{arg}' if arg else path)


def make_config(args, platform):
  """--config's recipe, or configs/cosmos2b.py (':smoke' with --tiny) at the flags' shape; on a
  one-device mesh with --groups x --rollouts slots."""
  if args.config:
    c = load_config(args.config)
    c.batch_size, c.num_rollouts = args.groups, args.rollouts
    c.mesh.update(data=1, fsdp=1, context=1, tensor=1)
    c.sharding.context_impl = 'none'
    c.micro_batch = args.micro_batch
    return c
  c = cosmos2b.get_config('smoke' if args.tiny else '')
  c.batch_size, c.num_rollouts = args.groups, args.rollouts
  c.micro_batch = args.micro_batch
  c.mesh.update(data=1, fsdp=1, context=1, tensor=1)
  c.sharding.context_impl = 'none'
  c.sampler.num_steps = args.num_steps
  c.rl.train_steps = parse_steps(args.train_steps, args.num_steps)
  c.rl.data_loss_steps = args.data_loss_steps
  cc = c.cosmos
  cc.frames, cc.height, cc.width = args.frames, args.height, args.width
  cc.latent_shape = latent_shape(args.frames, args.height, args.width)
  cc.text_length = args.text_length
  cc.dtype, cc.remat_policy = args.dtype, args.remat
  cc.attention.kernel = attention_kernel(args.attention, platform, args.dtype)
  if args.num_blocks:
    cc.dit_overrides.num_blocks = args.num_blocks
  return c


def choose_device(args):
  """The one device to run on: the local default backend's first, or a TPU slice's first chip."""
  if args.topology:
    return topology_lib.topology_devices(args.topology)[0]
  device = jax.devices()[0]
  if device.platform == 'cpu' and not args.tiny:
    raise SystemExit(f'gpu_step.py: no accelerator (JAX backend {jax.default_backend()!r}, device kind '
                     f'{device.device_kind!r}); run it on a GPU or TPU host, or pass --tiny for the '
                     f'CPU-sized model, or --topology=v5p-8 --compile_only for a memory estimate')
  return device


def _random_like(abstract, key):
  """Concrete arrays of an abstract (sharded ShapeDtypeStruct) tree: normal floats, 0/1 integers."""
  leaves, treedef = jax.tree.flatten(abstract)
  keys = jax.random.split(key, len(leaves))

  def make(a, k):
    if jnp.issubdtype(a.dtype, jnp.floating):
      x = jax.random.normal(k, a.shape, a.dtype)
    elif jnp.issubdtype(a.dtype, jnp.integer):
      x = jax.random.randint(k, a.shape, 0, 2, a.dtype)
    else:
      return jax.device_put(jax.random.fold_in(key, 1), a.sharding)    # a PRNG key
    return jax.device_put(x, a.sharding)

  return jax.tree.unflatten(treedef, [make(a, k) for a, k in zip(leaves, keys)])


def memory_bytes(compiled):
  """argument + output - alias + temp bytes of a compiled function (XLA's memory_analysis), or None."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes)


def compile_all(fns, abstract):
  """Lowers the step functions (tracing, in turn) and compiles them concurrently (XLA compiles off the
  GIL; on a many-core host this cuts the compile wall time).
  Returns ({fn: compiled}, {fn: compile seconds}, lowering seconds of all)."""
  t0 = time.perf_counter()
  lowered = {name: getattr(fns, name).lower(*abstract[name]) for name in FUNCTIONS}
  lower_s = round(time.perf_counter() - t0, 2)

  def compile_one(name):
    t0 = time.perf_counter()
    out = lowered[name].compile()
    return out, round(time.perf_counter() - t0, 2)

  with concurrent.futures.ThreadPoolExecutor(len(FUNCTIONS)) as pool:
    done = dict(zip(FUNCTIONS, pool.map(compile_one, FUNCTIONS)))
  return {k: v[0] for k, v in done.items()}, {k: v[1] for k, v in done.items()}, lower_s


class Budget:
  """Seconds since `start`; whether a phase of `estimate_s` still ends inside `limit_s`."""

  def __init__(self, limit_s, start):
    self.limit_s, self.start = limit_s, start

  def elapsed(self):
    return time.perf_counter() - self.start

  def allows(self, estimate_s):
    return self.elapsed() + estimate_s <= self.limit_s


def build(config, device):
  """(task, step fns, abstract args per function, state shardings, plan) on a one-device mesh."""
  config_lib.validate(config, 1)
  mesh = parallel.make_mesh(config.mesh, [device])
  task = tasks.get_task(config)
  program = program_lib.assemble(config, task, mesh, jax.random.key(config.seed))   # the trainer's program
  fns = program.step_fns()
  args = aot.abstract_inputs(config, program.plan, task, fns, program.state_shardings, program.abstract_state)
  return task, fns, args, program.state_shardings, program.optimizer


def init_state(task, config, optimizer, state_sh, seed):
  """The train state on the device: random params initialized under jit with their shardings (under
  LoRA: the adapters trained, the base frozen in the compute dtype)."""
  spec = lora_lib.from_config(config)
  params = task.init_params_sharded(jax.random.key(seed),
                                    lora_lib.combine(state_sh.params, state_sh.frozen))
  trained, frozen = lora_lib.split(params, spec)
  cast = task.cast_params if frozen is not None and task.cast_params is not None else (lambda f: f)
  init = jax.jit(lambda p, f: update_lib.init_train_state(p, config, optimizer, cast(f)),
                 in_shardings=(state_sh.params, state_sh.frozen), out_shardings=state_sh)
  return init(trained, frozen)


def run_iteration(compiled, state, inputs, key):
  """One timed iteration: (state, {'rollout', 'data_grad', 'update': seconds}, update metrics, nfe)."""
  slot_cond, data, rewards = inputs
  t0 = time.perf_counter()
  params = update_lib.model_params(state)        # with the frozen base under LoRA
  traj = jax.block_until_ready(compiled['rollout'](params, slot_cond, key))
  t1 = time.perf_counter()
  batch = update_lib.RolloutBatch(traj=traj, rewards=rewards, cond=slot_cond)
  grads, _ = jax.block_until_ready(compiled['data_grads'](params, batch, data, key))
  t2 = time.perf_counter()
  state, metrics = compiled['update'](state, batch, grads, key)
  metrics = jax.device_get(metrics)
  t3 = time.perf_counter()
  nfe = float(np.mean(jax.device_get(traj.nfe)))
  return state, dict(rollout=t1 - t0, data_grad=t2 - t1, update=t3 - t2), metrics, nfe


def shape_report(config, task):
  if config.task != 'video':
    return dict(family=task.family.name, sample_shape=list(task.sample_shape), groups=config.batch_size,
                rollouts=config.num_rollouts, micro_batch=config.micro_batch, num_steps=config.sampler.num_steps,
                train_steps=list(config_lib.train_steps(config)), lora_rank=config.lora.rank,
                dtype=task.compute_dtype, remat=task.family.remat_policy)
  cc = config.cosmos
  lt, lh, lw = cc.latent_shape
  p = task.family.dit.patch
  return dict(model=cc.model, num_blocks=task.family.dit.num_blocks, frames=cc.frames, height=cc.height,
              width=cc.width, latent_shape=list(cc.latent_shape),
              tokens=(lt // p[0]) * (lh // p[1]) * (lw // p[2]), text_length=cc.text_length,
              groups=config.batch_size, rollouts=config.num_rollouts, micro_batch=config.micro_batch,
              num_steps=config.sampler.num_steps, train_steps=list(config.rl.train_steps),
              data_loss_steps=config.rl.data_loss_steps, dtype=cc.dtype, remat=cc.remat_policy,
              attention=cc.attention.kernel)


def summarize(times, warmup_excluded):
  """Median seconds per part over the timed iterations (all but the warm-up when a later one ran)."""
  timed = times[1:] if warmup_excluded else times
  out = {f'time_{k}_s': statistics.median(t[k] for t in timed) for k in ('rollout', 'data_grad', 'update')}
  out['time_iteration_s'] = statistics.median(sum(t.values()) for t in timed)
  return out


def benchmark(args, report, start):
  """Fills `report` (a dict, printed by `main` whatever happens) with the run's results; `start` is
  the perf_counter time the budget counts from."""
  budget = Budget(args.budget_s, start)
  device = choose_device(args)
  report.update(device_kind=device.device_kind, platform=device.platform, jax=jax.__version__,
                budget_s=args.budget_s, stopped_early=False)
  config = make_config(args, device.platform)
  t0 = time.perf_counter()
  task, fns, abstract, state_sh, optimizer = build(config, device)
  report['build_s'] = round(time.perf_counter() - t0, 2)
  report['shape'] = shape_report(config, task)
  f_sample = task.forward_flops_per_sample()
  if not budget.allows(0.0):
    report['stopped_early'] = True
    return
  t0 = time.perf_counter()
  compiled, report['compile_s'], report['lower_s'] = compile_all(fns, abstract)
  report['compile_wall_s'] = round(time.perf_counter() - t0, 2)
  report['aot_bytes'] = {name: memory_bytes(c) for name, c in compiled.items()}
  known = [b for b in report['aot_bytes'].values() if b is not None]
  report.update(peak_bytes=max(known) if known else None, memory_source='memory_analysis')
  if args.topology:
    report['hbm_bytes'] = topology_lib.hbm_bytes(args.topology)
  passes = flops_lib.iteration_flops(config, f_sample)
  report.update(forward_flops_per_sample=f_sample, flops_per_iteration=passes.total,
                flops_breakdown=passes._asdict(),
                peak_flops_per_s=flops_lib.devices_peak_flops([device], task.compute_dtype))
  if args.compile_only:
    return

  key = jax.random.key(args.seed)
  state = init_state(task, config, optimizer, state_sh, args.seed)
  _, slot_cond, key_abstract = abstract['rollout']
  data, rewards = abstract['data_grads'][2], abstract['update'][1].rewards
  inputs = _random_like((slot_cond, data, rewards), jax.random.fold_in(key, 7))
  times, last = [], 0.0
  while len(times) < 1 + args.iterations:
    if not budget.allows(last):
      report['stopped_early'] = True
      break
    step_key = jax.device_put(jax.random.fold_in(key, len(times)), key_abstract.sharding)
    state, t, metrics, nfe = run_iteration(compiled, state, inputs, step_key)
    times.append(t)
    last = sum(t.values())
  if not times:
    return
  warmup_excluded = len(times) > 1
  report.update(summarize(times, warmup_excluded), iterations_timed=len(times) - warmup_excluded,
                warmup_excluded=warmup_excluded, loss=float(metrics['loss']),
                loss_finite=bool(np.isfinite(metrics['loss'])), nfe_rollout=nfe)
  total = flops_lib.iteration_flops(config, f_sample, nfe).total
  report.update(flops_per_iteration=total,
                **flops_lib.throughput_metrics(total, report['time_iteration_s'],
                                               report['peak_flops_per_s']))
  stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
  if stats and 'peak_bytes_in_use' in stats:
    report.update(peak_bytes=int(stats['peak_bytes_in_use']), memory_source='memory_stats',
                  bytes_limit=stats.get('bytes_limit'))


def main(argv=None):
  """Runs the benchmark; prints and returns its report (one JSON line). Exit status 1 on an error."""
  xla_flags.apply()          # the CLIs' XLA:CPU defaults (the --tiny run), before the first computation
  start = time.perf_counter()
  args = parse_args(sys.argv[1:] if argv is None else argv)
  report, status = {}, 0
  try:
    benchmark(args, report, start)
  except (Exception, SystemExit) as e:  # pylint: disable=broad-except
    if isinstance(e, SystemExit) and not isinstance(e.code, str):
      raise
    report['error'] = f'{type(e).__name__}: {str(e).splitlines()[0][:800] if str(e) else ""}'
    status = 1
  report['wall_s'] = round(time.perf_counter() - start, 2)
  print(json.dumps(report, default=_jsonable), flush=True)
  if status and argv is None:
    sys.exit(status)
  return report


def _jsonable(x):
  if isinstance(x, (np.integer, np.floating)):
    return x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return str(x)


if __name__ == '__main__':
  main()
