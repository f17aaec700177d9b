"""Speed of one DDRL iteration (cosmos-rl's algorithm) in JAX, against the machine's matmul peak, the
analytic FLOPs and a PyTorch eager peer on diffusers' CosmosTransformer3DModel, all in one run.

  JAX_PLATFORMS=cpu python benchmarks/step_speed.py            # the default shape, a few minutes on 2 cores
  JAX_PLATFORMS=cpu python benchmarks/step_speed.py --quick    # tiny sizes, seconds (writes no JSON lines)
  ... --ocr                 # also the README's OCR main job (configs/ocr_tiny.py) through the trainer
  ... --skip_torch --skip_compile_sweep --width=128 --blocks=4 --heads=4 --latent=1,16,16 --groups=8 ...
  ... --skip_torch --skip_compile_sweep --skip_dit_alone   # trainer vs the public loss path only

The iteration (default shape): the Cosmos DiT (`models.cosmos_dit.CosmosDiT`, D 128, 4 blocks, 4 heads,
adaLN-LoRA 32, 8 text tokens of width 64 without crossattn_proj: 1,275,520 parameters) on a 16 x 1 x 16 x 16
latent (patch 1x2x2: 64 tokens); B = 8 groups x N = 8 rollouts; T = 20 steps of the cosmos_2ab sampler with
churn; the even steps 0, 2, ..., 18 trained; the full data term (data_beta 0.01, random data); AdamW after
global-norm clipping. The config is configs/cosmos_common.py's recipe on one device, without the EMA.

JAX: the trainer's own jitted functions (`update.build_step_fns` on a one-device mesh, the video task's
apply_fn of the DiT, remat 'none' unless --remat) timed as the trainer runs them:
  rollout     (params, slot conditions, key) -> Trajectory      forward only, T + 1 network calls
  data_grads  the data term's gradient, one trained step at a time (the trainer runs it while rewards
              are pending)
  update      the policy gradient, added to the data gradient, then clipping and AdamW
  train = data_grads + update (the issue's "update"); iteration = rollout + train.
The public path: what a library user writes (README "Use the loss from your own JAX code"),
jax.jit(jax.value_and_grad(rl.ddrl_loss, has_aux=True)) with the recipe's options, timed in every run
right after the trainer's update on that run's rollouts (so both see the same load), against the train
phase: the goal is public <= 1.1 x train. --reference_path also times the same of
rl.rl_loss_reference (reverse mode through the plain scan over the trained steps: the form the public
loss had before its per-step custom VJP; about 9 GiB of temporaries at the default shape).
PyTorch: benchmarks/torch_peer.py, the same network calls in eager mode with the same parameters (the
diffusers weights are converted to the JAX model; one forward is compared, ~1e-6 apart).

Compile excluded: every timed function runs once first (its compile), then --runs more times; the tables
report the median of those runs (and the JSON lines every run and the min).

FLOPs: `cosmos_dit.forward_flops` per sample forward F (2 x multiply-accumulates of the matmuls and the
attention); per iteration and sample nfe * F for the rollout (nfe = T + 1 for cosmos_2ab, read from the
trajectory), 3F (forward + backward) per trained step for the policy term and 3F for the data term. The
FLOP limit of a phase is its FLOPs / the matmul peak, the best fp32 GFLOP/s of square jnp and torch
matmuls measured in the same run. The analytic F is checked against XLA's cost analysis of a jitted
forward; XLA counts the body of the blocks' scan (a while loop) once, so the cost of one Block compiled
alone is added num_blocks - 1 times; a difference over 10% stops the run.

Also: the DiT alone at batch B*N (forward; forward + backward of a mean-square loss) for remat 'none' and
'full'; compile times of rollout / data_grads / update against T and depth (scans: they should be flat);
the goals (iteration <= 1.3 x its FLOP limit; JAX >= 1.6 x faster than the torch peer; fwd+bwd <= 3 x fwd;
the public path <= 1.1 x the trainer's train phase).
One JSON line per measurement is appended to benchmarks/step_speed.jsonl (--out), each with the load
average when it was taken. Other processes on the machine distort the numbers, torch's most: its spinning
OpenMP threads slowed the eager iteration 10-15x on a 2-core VM with two other busy processes, where
XLA's thread pool lost about the share of the cores it did not get (compare `cpu_per_wall`).
"""
import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

# pylint: disable=g-import-not-at-top,wrong-import-position
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from configs import cosmos_common
from ddrl_jax import config as config_lib
from ddrl_jax import flops as flops_lib
from ddrl_jax import optim
from ddrl_jax import parallel
from ddrl_jax import rl
from ddrl_jax import update as update_lib
from ddrl_jax import xla_flags
from ddrl_jax.models.cosmos import convert as cosmos_convert
from ddrl_jax.models.cosmos import dit as cosmos_dit
from ddrl_jax.models.cosmos import family as cosmos_family

GOAL_FLOP_LIMIT = 1.3     # iteration seconds <= this x its FLOP limit
GOAL_TORCH_SPEEDUP = 1.6  # torch peer iteration seconds >= this x JAX's
GOAL_BWD_RATIO = 3.0      # DiT forward + backward <= this x forward (remat 'none')
GOAL_PUBLIC_RATIO = 1.1   # jax.value_and_grad(rl.ddrl_loss) <= this x the trainer's train phase
XLA_TOLERANCE = 0.10      # |XLA FLOPs / analytic - 1| above this stops the run
OCR_PHASES = ('time_rollout_and_submit', 'time_data_grad', 'time_reward_wait', 'time_update')


@dataclasses.dataclass(frozen=True)
class Shape:
  """The benchmarked iteration: DiT width / blocks / heads / adaLN-LoRA / text width, the latent
  (frames, H, W) of `channels` channels, text tokens, B groups x N rollouts, T sampler steps, remat."""
  width: int = 128
  blocks: int = 4
  heads: int = 4
  lora: int = 32
  context_dim: int = 64
  latent: tuple = (1, 16, 16)
  text_tokens: int = 8
  groups: int = 8
  rollouts: int = 8
  steps: int = 20
  remat: str = 'none'
  channels: int = 16

  @property
  def samples(self):
    return self.groups * self.rollouts

  @property
  def sample_shape(self):
    return (self.channels,) + tuple(self.latent)

  @property
  def trained_steps(self):
    """cosmos-rl's even steps 0, 2, ..., T - 2."""
    return tuple(range(0, self.steps - 1, 2))

  def dit(self, **overrides):
    """The CosmosDiTConfig (text context already `context_dim` wide: no crossattn_proj)."""
    kw = dict(in_channels=self.channels, model_channels=self.width, num_blocks=self.blocks,
              num_heads=self.heads, adaln_lora_dim=self.lora, crossattn_in=None,
              context_dim=self.context_dim, patch=(1, 2, 2), remat_policy=self.remat)
    kw.update(overrides)
    return cosmos_dit.CosmosDiTConfig(**kw)


# Tiny but still matmul-bound (XLA's count of the elementwise work stays under the check's 10%).
QUICK = Shape(width=128, blocks=2, heads=4, lora=16, context_dim=32, latent=(1, 4, 4), text_tokens=2,
              groups=2, rollouts=2, steps=4)


# ----------------------------------------------------------------------------------------- helpers


def machine_info():
  """CPU model (/proc/cpuinfo), core count, load average (other work on the machine) and versions."""
  cpu = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as f:
      cpu = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), cpu)
  except OSError:
    pass
  info = dict(cpu=cpu, cores=os.cpu_count(), load_average=os.getloadavg(), platform=platform.platform(),
              python=platform.python_version(), jax=jax.__version__, jax_backend=jax.default_backend(),
              jax_devices=jax.device_count(), xla_flags=os.environ.get("XLA_FLAGS", ""))
  for name in ('torch', 'diffusers', 'flax', 'optax'):
    try:
      info[name] = __import__(name).__version__
    except ImportError:
      info[name] = None
  return info


def run_times(fn, runs):
  """(seconds of the first call, [seconds of each of `runs` further calls]); `fn` blocks on its result."""
  t0 = time.perf_counter()
  fn()
  first = time.perf_counter() - t0
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return first, times


def med(times):
  return float(statistics.median(times))


def _cost_flops(compiled):
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost['flops'])


# ------------------------------------------------------------------------------------- matmul peak


def matmul_peak_jax(sizes=(512, 1024, 2048), runs=3):
  """{n: best GFLOP/s of a jitted fp32 (n, n) x (n, n) jnp matmul} (2 n^3 FLOPs)."""
  out = {}
  matmul = jax.jit(jnp.matmul)
  for n in sizes:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    _, times = run_times(lambda: matmul(a, b).block_until_ready(), runs)
    out[n] = 2.0 * n**3 / min(times) / 1e9
  return out


# ------------------------------------------------------------------------------------------ FLOPs


def forward_flops(cfg, latent, text_tokens):
  """Analytic FLOPs of one forward of one sample (`cosmos_dit.forward_flops`)."""
  return float(sum(cosmos_dit.forward_flops(cfg, latent, text_tokens)[1].values()))


def iteration_flops(config, fwd, nfe):
  """FLOPs of one iteration's phases (`ddrl_jax.flops.iteration_flops`, the count the trainer logs) for
  a per-sample forward `fwd` and the rollout's nfe: rollout, data_grads, update (the policy term and any
  reference forward), train and iteration."""
  f = flops_lib.iteration_flops(config, fwd, nfe)
  update = f.policy + f.reference
  return dict(rollout=f.rollout, data_grads=f.data, update=update, train=f.data + update,
              iteration=f.rollout + f.data + update)


def _dit_inputs(cfg, batch, latent, text_tokens, seed=0):
  """x (batch, C, T, H, W), t (batch, T), text (batch, L, context_dim) random float32."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch, cfg.in_channels) + tuple(latent)).astype(np.float32)
  t = rng.uniform(0.05, 1.0, (batch, latent[0])).astype(np.float32)
  text = rng.standard_normal((batch, text_tokens, cfg.context_dim)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(t), jnp.asarray(text)


def _forward_cost(cfg, batch, latent, text_tokens):
  graphdef, params = nnx.split(nnx.eval_shape(lambda: cosmos_dit.CosmosDiT(cfg, rngs=nnx.Rngs(0))))
  fwd = jax.jit(lambda p, *a: nnx.merge(graphdef, p)(*a))
  return _cost_flops(fwd.lower(params, *_dit_inputs(cfg, batch, latent, text_tokens)).compile())


def _block_cost(cfg, batch, latent, text_tokens):
  """XLA FLOPs of one `cosmos_dit.Block` forward on (batch, T', H'W', D) tokens, compiled alone."""
  frames, h, w = latent[0] // cfg.patch[0], latent[1] // cfg.patch[1], latent[2] // cfg.patch[2]
  d = cfg.model_channels
  graphdef, params = nnx.split(nnx.eval_shape(lambda: cosmos_dit.Block(cfg, nnx.Rngs(0))))
  args = (jnp.zeros((batch, frames, h * w, d)), jnp.zeros((batch, text_tokens, cfg.context_dim)),
          jnp.zeros((batch, frames, d)), jnp.zeros((batch, frames, 3 * d)),
          cosmos_dit.rope_cos_sin(cfg, frames, h, w))
  fn = jax.jit(lambda p, *a: nnx.merge(graphdef, p)(*a))
  return _cost_flops(fn.lower(params, *args).compile())


def xla_flops_check(cfg, latent, text_tokens, batch=2):
  """XLA's cost analysis of a jitted forward of `batch` samples against the analytic FLOPs.

  XLA counts the body of the blocks' scan once, whatever the trip count: that shows as the same raw
  count for 1 and num_blocks blocks, and is then corrected by adding num_blocks - 1 times the cost of one
  Block compiled alone. Returns a dict (raw, one_block, block, corrected, analytic, rel_diff, ...)."""
  cfg = dataclasses.replace(cfg, remat_policy='none')
  raw = _forward_cost(cfg, batch, latent, text_tokens)
  one = _forward_cost(dataclasses.replace(cfg, num_blocks=1), batch, latent, text_tokens)
  block = _block_cost(cfg, batch, latent, text_tokens)
  once = cfg.num_blocks > 1 and abs(raw - one) <= 0.01 * one
  corrected = raw + (cfg.num_blocks - 1) * block if once else raw
  analytic = batch * forward_flops(cfg, latent, text_tokens)
  one_analytic = batch * forward_flops(dataclasses.replace(cfg, num_blocks=1), latent, text_tokens)
  return dict(batch=batch, xla_raw=raw, xla_one_block=one, xla_block=block, scan_body_counted_once=once,
              xla_corrected=corrected, analytic=analytic, rel_diff=corrected / analytic - 1.0,
              one_block_rel_diff=one / one_analytic - 1.0)


# ------------------------------------------------------------------------------------ JAX iteration


def ddrl_config(shape):
  """configs/cosmos_common.py's DDRL recipe at `shape` on one device, without the power EMA."""
  c = cosmos_common.get_config('cosmos2b')
  c.batch_size, c.num_rollouts = shape.groups, shape.rollouts
  c.sampler.num_steps = shape.steps
  c.rl.train_steps = shape.trained_steps
  c.optim.ema_power_s = None
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, context=1, tensor=1))
  c.sharding.context_impl = 'none'
  config_lib.validate(c, 1)
  return c


def jax_params(shape, torch_state=None):
  """(graphdef, params) of the DiT: converted from a diffusers state dict when given, else nnx init."""
  cfg = shape.dit()
  if torch_state is not None:
    model = cosmos_convert.merge_params(cfg, cosmos_convert.convert_diffusers_state_dict(torch_state, cfg))
  else:
    model = cosmos_dit.CosmosDiT(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  return graphdef, jax.tree.map(jnp.asarray, params)


def param_count(params):
  return sum(math.prod(np.shape(a)) for a in jax.tree.leaves(params))


def step_fns(shape, graphdef, params):
  """The trainer's jitted functions for `shape` (`update.build_step_fns` on a one-device mesh).

  params may be abstract. Returns a namespace: config, plan, sampler, optimizer, state_sh, fns."""
  config = ddrl_config(shape)
  mesh = parallel.make_mesh(config.mesh, jax.devices()[:1])
  plan = parallel.ShardingPlan.from_config(config, mesh)
  optimizer = optim.make_optimizer(config.optim)
  sampler = update_lib.make_sampler(config)
  apply_fn = cosmos_family.make_video_apply_fn(graphdef, config.cosmos.cond_timestep)
  abstract_state = jax.eval_shape(lambda p: update_lib.init_train_state(p, config, optimizer), params)
  state_sh = plan.state(abstract_state, optimizer)
  fns = update_lib.build_step_fns(config, plan, state_sh, apply_fn, sampler, shape.sample_shape, optimizer)
  return types.SimpleNamespace(config=config, plan=plan, sampler=sampler, optimizer=optimizer,
                               state_sh=state_sh, abstract_state=abstract_state, fns=fns)


def iteration_inputs(shape, plan, seed=0):
  """Random inputs: slot conditions {'text': (B*N, L, C)}, the data batch (x0 (B, *S), its text) and
  rewards (B*N, 1), placed as the trainer places them."""
  rng = np.random.default_rng(seed)
  text = rng.standard_normal((shape.groups, shape.text_tokens, shape.context_dim)).astype(np.float32)
  x0 = rng.standard_normal((shape.groups,) + shape.sample_shape).astype(np.float32)
  rewards = rng.standard_normal((shape.samples, 1)).astype(np.float32)
  slots = jax.device_put({'text': np.repeat(text, shape.rollouts, axis=0)}, plan.batch())
  data = update_lib.place_data(plan, update_lib.DataBatch(x0=x0, cond={'text': text}))
  return slots, data, jax.device_put(rewards, plan.batch())


PUBLIC_FORMS = {'public': 'jax.value_and_grad(rl.ddrl_loss)',
                'reference': 'jax.value_and_grad(rl.rl_loss_reference)'}


def public_grad_fn(graphdef, config, sampler, form='public'):
  """The README's way, jitted: jax.value_and_grad of rl.ddrl_loss ('public') or of rl.rl_loss_reference
  ('reference', the plain scan) with the recipe's options, as a function (params, traj (B, N, T, ...),
  advantages (B, N), steps (B, N, K), cond {'text': (B, L, C)}, data DataTerm, key) -> ((loss, metrics),
  grads)."""
  r = config.rl
  apply_fn = cosmos_family.make_video_apply_fn(graphdef, config.cosmos.cond_timestep)
  kw = dict(clip_range=r.clip_range, log_ratio_form=r.log_ratio or 'cosmos_rl', loss_scale=r.loss_scale,
            old_mean=r.old_mean)

  def loss_fn(p, traj, advantages, steps, cond, data, key):
    if form == 'public':
      return rl.ddrl_loss(apply_fn, p, sampler, traj, advantages, steps, cond, data, key, **kw)
    return rl.rl_loss_reference(apply_fn, p, sampler, traj, advantages, steps, cond, key, data=data, **kw)

  return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


def public_inputs(shape, config, rollout, data, key):
  """The public loss's arguments after params from the trainer's (B*N, 1, ...) `RolloutBatch` and
  `DataBatch`: the group-layout trajectory, the advantages, the trained steps (B, N, K), the group
  conditions, the `DataTerm` and the key the trainer's update draws the data noise from."""
  traj, rewards, cond = update_lib.group_rollout_batch(rollout, shape.rollouts)
  steps = jnp.broadcast_to(jnp.asarray(shape.trained_steps, jnp.int32),
                           (shape.groups, shape.rollouts, len(shape.trained_steps)))
  r = config.rl
  term = rl.DataTerm(x0=data.x0, cond=data.cond, beta=r.data_beta, steps=r.data_loss_steps,
                     noise=r.data_noise, cond_dropout=r.cond_dropout, weighting=r.data_weighting)
  return traj, update_lib.compute_advantages(rewards, config), steps, cond, term, jax.random.split(key)[1]


def run_jax_iteration(shape, graphdef, params, runs, seed=0, public_forms=('public',)):
  """Times the trainer's rollout, data_grads and update: one warm-up iteration (compiles), then `runs`.
  After each update, each of `public_forms` (see `public_grad_fn`) on the same rollouts and parameters
  (`{form}_s`; its first call, compile included, is `{form}_warmup_s`; its last loss `{form}_loss`).

  Returns per-run lists rollout_s, data_grads_s, update_s, train_s (= data_grads + update), iteration_s
  and cpu_per_wall (process CPU seconds per second: the cores this process got), the warm-up seconds,
  the last metrics (loss, pg_loss, data_loss), nfe and param_change."""
  s = step_fns(shape, graphdef, params)
  init = jax.jit(lambda p: update_lib.init_train_state(p, s.config, s.optimizer),
                 in_shardings=(s.state_sh.params,), out_shardings=s.state_sh)
  state = init(params)
  slots, data, rewards = iteration_inputs(shape, s.plan, seed)
  k_roll, k_update = jax.random.split(jax.random.key(seed))
  before = np.asarray(jax.tree.leaves(state.params)[0]).copy()
  times = {k: [] for k in ('rollout_s', 'data_grads_s', 'update_s', 'train_s', 'iteration_s', 'cpu_per_wall')}
  times.update({f'{form}_s': [] for form in public_forms})
  public = {form: public_grad_fn(graphdef, s.config, s.sampler, form) for form in public_forms}
  out = {}
  for run in range(runs + 1):
    t0, c0 = time.perf_counter(), time.process_time()
    traj = jax.block_until_ready(s.fns.rollout(state.params, slots, k_roll))
    t1 = time.perf_counter()
    batch = update_lib.RolloutBatch(traj=traj, rewards=None, cond=slots)
    grads, data_metrics = jax.block_until_ready(s.fns.data_grads(state.params, batch, data, k_update))
    t2 = time.perf_counter()
    state, metrics = jax.block_until_ready(
        s.fns.update(state, batch._replace(rewards=rewards), grads, k_update))
    t3 = time.perf_counter()
    public_s = {}
    for form, fn in public.items():     # the parameters the update returned, this run's rollouts
      args = jax.block_until_ready(
          public_inputs(shape, s.config, batch._replace(rewards=rewards), data, k_update))
      t4 = time.perf_counter()
      (loss, _), grads = jax.block_until_ready(fn(state.params, *args))
      public_s[form] = time.perf_counter() - t4
      out[f'{form}_loss'] = float(loss)
      out[f'{form}_grad_norm'] = float(optax.tree.norm(grads))
    if run == 0:
      out['warmup_s'] = t3 - t0
      out.update({f'{form}_warmup_s': v for form, v in public_s.items()})
      continue
    for form, v in public_s.items():
      times[f'{form}_s'].append(v)
    for k, v in (('rollout_s', t1 - t0), ('data_grads_s', t2 - t1), ('update_s', t3 - t2),
                 ('train_s', t3 - t1), ('iteration_s', t3 - t0),
                 ('cpu_per_wall', (time.process_time() - c0) / (t3 - t0))):
      times[k].append(v)
    metrics = update_lib.combine_metrics(metrics, data_metrics, s.config)
    out.update({k: float(metrics[k]) for k in ('loss', 'pg_loss', 'data_loss')})
  after = np.asarray(jax.tree.leaves(state.params)[0])
  out.update(times, nfe=int(np.asarray(traj.nfe).reshape(-1)[0]),
             param_change=float(np.abs(after - before).max()),
             x0_finite=bool(np.isfinite(np.asarray(traj.x0)).all()))
  return out


def compile_times(shape):
  """Seconds to lower and to compile (wall and process CPU: the CPU seconds do not count the time other
  processes take) the trainer's rollout, data_grads and update at `shape`, on abstract inputs."""
  cfg = shape.dit()
  graphdef, params = nnx.split(nnx.eval_shape(lambda: cosmos_dit.CosmosDiT(cfg, rngs=nnx.Rngs(0))))
  s = step_fns(shape, graphdef, params)
  slots = {'text': jax.ShapeDtypeStruct((shape.samples, shape.text_tokens, shape.context_dim), jnp.float32)}
  data = update_lib.DataBatch(
      x0=jax.ShapeDtypeStruct((shape.groups,) + shape.sample_shape, jnp.float32),
      cond={'text': jax.ShapeDtypeStruct((shape.groups, shape.text_tokens, shape.context_dim), jnp.float32)})
  key = jax.random.key(0)
  traj = jax.eval_shape(s.fns.rollout, params, slots, key)
  batch = update_lib.RolloutBatch(traj=traj, rewards=None, cond=slots)
  grads = jax.eval_shape(s.fns.data_grads, params, batch, data, key)[0]
  rewards = jax.ShapeDtypeStruct((shape.samples, 1), jnp.float32)
  args = dict(rollout=(params, slots, key), data_grads=(params, batch, data, key),
              update=(s.abstract_state, batch._replace(rewards=rewards), grads, key))
  out = {}
  for name, a in args.items():
    t0 = time.perf_counter()
    lowered = getattr(s.fns, name).lower(*a)
    t1, c1 = time.perf_counter(), time.process_time()
    lowered.compile()
    out[name] = dict(lower_s=t1 - t0, compile_s=time.perf_counter() - t1,
                     compile_cpu_s=time.process_time() - c1)
  return out


def time_dit_jax(shape, graphdef, params, remat, runs):
  """The DiT alone at batch B*N with remat `remat`: per-run seconds of a jitted forward and of a jitted
  value_and_grad of mean(v^2). Returns (forward_s, forward_backward_s) lists."""
  cfg = shape.dit(remat_policy=remat)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: cosmos_dit.CosmosDiT(cfg, rngs=nnx.Rngs(0))))
  x, t, text = _dit_inputs(cfg, shape.samples, shape.latent, shape.text_tokens)
  net = lambda p: nnx.merge(graphdef, p)(x, t, text)
  forward = jax.jit(net)
  forward_backward = jax.jit(jax.value_and_grad(lambda p: jnp.mean(net(p)**2)))
  _, fwd = run_times(lambda: forward(params).block_until_ready(), runs)
  _, fwd_bwd = run_times(lambda: jax.block_until_ready(forward_backward(params)), runs)
  return fwd, fwd_bwd


# ------------------------------------------------------------------------------------------- torch


def torch_parity(model, graphdef, params, shape, batch=2):
  """max |v_jax - v_torch| / max(1, max |v_torch|) of one forward of `batch` random samples."""
  import torch  # pylint: disable=import-outside-toplevel
  import torch_peer  # pylint: disable=import-outside-toplevel
  cfg = shape.dit()
  x, t, text = _dit_inputs(cfg, batch, shape.latent, shape.text_tokens, seed=3)
  t = t[:, 0]
  ours = np.asarray(jax.jit(cosmos_family.make_video_apply_fn(graphdef, 1e-4))(params, x, t, {'text': text}))
  with torch.no_grad():
    ref = torch_peer.velocity(model, torch.tensor(np.asarray(x)), torch.tensor(np.asarray(t)),
                              torch.tensor(np.asarray(text))).numpy()
  return float(np.abs(ours - ref).max() / max(1.0, np.abs(ref).max()))


# --------------------------------------------------------------------------------------------- OCR


def ocr_iteration(iterations=4):
  """The README's OCR main job (configs/ocr_tiny.py, the shipped base) run by the trainer for
  `iterations` in a temporary workdir; the per-phase seconds of metrics.jsonl, the first (compiling)
  iteration excluded. Returns the medians, per-iteration rows and the job's analytic FLOPs."""
  from configs import ocr_tiny  # pylint: disable=import-outside-toplevel
  from ddrl_jax import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  from ddrl_jax.tasks import ocr as ocr_task  # pylint: disable=import-outside-toplevel
  config = ocr_tiny.get_config('ddrl')
  config.num_iterations = iterations
  config.eval_every = -1
  config.checkpoint_every = iterations
  with tempfile.TemporaryDirectory() as tmp:
    workdir = os.path.join(tmp, 'run')
    t0 = time.perf_counter()
    trainer_lib.Trainer(config, workdir, devices=jax.devices()[:1]).train(progress=False)
    wall = time.perf_counter() - t0
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      rows = [r for r in map(json.loads, f) if 'time_update' in r]
  timed = rows[1:]
  phases = {k: med([r[k] for r in timed]) for k in OCR_PHASES}
  phases['iteration'] = med([sum(r[k] for k in OCR_PHASES) for r in timed])
  dit = cosmos_family.t2i_config(config.ocr).dit
  nfe = flops_lib.sampler_nfe(config)
  flops = iteration_flops(config, forward_flops(dit, (1,) + ocr_task.OCRTask.sample_shape[1:],
                                                config.ocr.text_length), nfe)
  return dict(phases=phases, per_iteration=[{k: r[k] for k in OCR_PHASES} for r in rows],
              flops=flops, nfe=nfe, sampler=config_lib.sampler_kind(config), wall_s=wall,
              iterations=iterations, reward_mean=[r.get('reward_mean') for r in rows])


# ------------------------------------------------------------------------------------------ report


def phase_rows(flops, seconds, peak):
  """[(phase, seconds, GFLOP, GFLOP/s, seconds / FLOP limit)] for the phases in `seconds`; `flops`
  names each phase's FLOPs, the limit is FLOPs / peak GFLOP/s."""
  return [(name, sec, flops[name] / 1e9, flops[name] / sec / 1e9, sec * peak * 1e9 / flops[name])
          for name, sec in seconds.items()]


def print_phases(title, rows):
  print(f'\n{title}')
  print(f'  {"phase":<14}{"median s":>10}{"GFLOP":>10}{"GFLOP/s":>10}{"x limit":>9}')
  for name, sec, gflop, rate, ratio in rows:
    print(f'  {name:<14}{sec:>10.3f}{gflop:>10.2f}{rate:>10.1f}{ratio:>9.2f}')


def goals(jax_s, limit_s, torch_s, fwd_bwd_ratio, public_ratio=None):
  """[(goal, measured value, met)]; value and met are None where the measurement was skipped.
  public_ratio: the public path's seconds / the trainer's train phase (median of the per-run ratios)."""
  speedup = torch_s / jax_s if torch_s else None
  check = lambda v, ok: None if v is None else bool(ok(v))
  return [(f'iteration <= {GOAL_FLOP_LIMIT} x FLOP limit', jax_s / limit_s,
           check(jax_s / limit_s, lambda v: v <= GOAL_FLOP_LIMIT)),
          (f'JAX >= {GOAL_TORCH_SPEEDUP} x faster than torch', speedup,
           check(speedup, lambda v: v >= GOAL_TORCH_SPEEDUP)),
          (f'DiT fwd+bwd <= {GOAL_BWD_RATIO} x fwd (remat none)', fwd_bwd_ratio,
           check(fwd_bwd_ratio, lambda v: v <= GOAL_BWD_RATIO)),
          (f'value_and_grad(ddrl_loss) <= {GOAL_PUBLIC_RATIO} x train', public_ratio,
           check(public_ratio, lambda v: v <= GOAL_PUBLIC_RATIO))]


def json_rows(rows, command, info, shape):
  """Each measurement dict with the command, the date, the machine and the shape added."""
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')
  return [dict(r, shape=dataclasses.asdict(shape), command=command, date=date, machine=info) for r in rows]


def write_jsonl(rows, path):
  with open(path, 'a') as f:
    for row in rows:
      f.write(json.dumps(row, default=float) + '\n')


# -------------------------------------------------------------------------------------- measurements


def measure_peak(torch_peer, sizes):
  """The matmul peak GFLOP/s: the best of the jnp and torch square fp32 matmuls at `sizes`."""
  peak_jax = matmul_peak_jax(sizes)
  peak_torch = torch_peer.matmul_peak(sizes) if torch_peer else {}
  peak = max(list(peak_jax.values()) + list(peak_torch.values()))
  print('matmul fp32 GFLOP/s  jax: ' + ', '.join(f'{n}: {v:.1f}' for n, v in peak_jax.items()) +
        ('  torch: ' + ', '.join(f'{n}: {v:.1f}' for n, v in peak_torch.items()) if peak_torch else '') +
        f'  -> peak {peak:.1f}')
  return peak, dict(measurement='matmul_peak', jax_gflops=peak_jax, torch_gflops=peak_torch or None,
                    peak_gflops=peak)


def build_models(shape, torch_peer):
  """(graphdef, params, torch model or None, row): the JAX DiT carries the torch model's weights when
  there is one; the parameter counts must agree, and one forward is compared."""
  cfg = shape.dit()
  torch_model = torch_peer.make_model(cfg) if torch_peer else None
  graphdef, params = jax_params(shape, torch_peer.state_dict_numpy(torch_model) if torch_peer else None)
  n_jax = param_count(params)
  n_torch = torch_peer.param_count(torch_model) if torch_peer else None
  parity = torch_parity(torch_model, graphdef, params, shape) if torch_peer else None
  print(f'parameters  jax: {n_jax:,}' + (f'  torch: {n_torch:,}  forward parity (same weights): max |v_jax - '
                                         f'v_torch| / max(1, max |v_torch|) = {parity:.2e}' if torch_peer else ''))
  if torch_peer and n_jax != n_torch:
    raise RuntimeError(f'parameter counts differ: jax {n_jax:,}, torch {n_torch:,}')
  return graphdef, params, torch_model, dict(measurement='params', jax=n_jax, torch=n_torch, parity=parity)


def measure_flops_check(shape):
  """(per-sample forward FLOPs, row); raises when XLA's count is off by more than XLA_TOLERANCE."""
  cfg = shape.dit()
  fwd = forward_flops(cfg, shape.latent, shape.text_tokens)
  c = xla_flops_check(cfg, shape.latent, shape.text_tokens)
  print(f'forward FLOPs of {c["batch"]} samples: analytic {c["analytic"]:.4e}; XLA raw {c["xla_raw"]:.4e} '
        f'(1-block model {c["xla_one_block"]:.4e}: scan body counted once: {c["scan_body_counted_once"]}); '
        f'XLA + (blocks - 1) x one Block {c["xla_corrected"]:.4e}: {c["rel_diff"]:+.2%} '
        f'(1-block model {c["one_block_rel_diff"]:+.2%})')
  if abs(c['rel_diff']) > XLA_TOLERANCE:
    raise RuntimeError(f'analytic forward FLOPs and XLA cost analysis differ by {c["rel_diff"]:+.1%} '
                       f'(> {XLA_TOLERANCE:.0%}): {c}')
  return fwd, dict(measurement='flops_check', forward_flops_per_sample=fwd, **c)


def measure_jax(shape, graphdef, params, fwd, peak, runs, public_forms=('public',)):
  """(result of run_jax_iteration, its FLOPs, median seconds per phase, row) with the table printed."""
  jx = run_jax_iteration(shape, graphdef, params, runs, public_forms=public_forms)
  flops = iteration_flops(ddrl_config(shape), fwd, jx['nfe'])
  sec = {k: med(jx[f'{k}_s']) for k in ('rollout', 'data_grads', 'update', 'train', 'iteration')}
  print_phases(f'JAX iteration (median of {runs}; warm-up incl. compile {jx["warmup_s"]:.1f} s; nfe {jx["nfe"]}; '
               f'loss {jx["loss"]:.4g}, pg {jx["pg_loss"]:.3g}, data {jx["data_loss"]:.4g}; max |param '
               f'change| {jx["param_change"]:.2e}; process CPU / wall {med(jx["cpu_per_wall"]):.2f})',
               phase_rows(flops, sec, peak))
  print_split(sec['rollout'], sec['train'], flops)
  row = dict(measurement='iteration', framework='jax', flops=flops, peak_gflops=peak,
             flop_limit_s=flops['iteration'] / (peak * 1e9), median_s=sec,
             min_s={k: min(jx[f'{k}_s']) for k in sec}, gflops={k: flops[k] / v / 1e9 for k, v in sec.items()},
             **{k: v for k, v in jx.items() if not k.startswith(tuple(PUBLIC_FORMS))})
  return jx, flops, sec, row


def public_path_rows(jx, flops, peak, forms):
  """Rows of the public path(s) against the trainer's train phase of the same runs: per-run ratios
  (public / train, each run's pair under the same load) and their median, with the table printed."""
  print(f'\npublic path: jax.jit(jax.value_and_grad(...)) timed after each run\'s update, against that run\'s '
        f'train phase (median of {len(jx["train_s"])}; GFLOP: the train phase\'s)')
  print(f'  {"":<42}{"median s":>10}{"GFLOP/s":>10}{"x limit":>9}{"/ train":>9}')
  rows, train = [], jx['train_s']
  print(f'  {"trainer train (data_grads + update)":<42}{med(train):>10.3f}{flops["train"] / med(train) / 1e9:>10.1f}'
        f'{med(train) * peak * 1e9 / flops["train"]:>9.2f}{1.0:>9.2f}')
  for form in forms:
    t = jx[f'{form}_s']
    ratio = med([a / b for a, b in zip(t, train)])
    print(f'  {PUBLIC_FORMS[form]:<42}{med(t):>10.3f}{flops["train"] / med(t) / 1e9:>10.1f}'
          f'{med(t) * peak * 1e9 / flops["train"]:>9.2f}{ratio:>9.2f}   (warm-up incl. compile '
          f'{jx[f"{form}_warmup_s"]:.1f} s; loss {jx[f"{form}_loss"]:.4g})')
    rows.append(dict(measurement='public_path', form=form, call=PUBLIC_FORMS[form], seconds=t,
                     median_s=med(t), train_s=train, median_train_s=med(train),
                     ratio_to_train=ratio, ratios=[a / b for a, b in zip(t, train)],
                     warmup_s=jx[f'{form}_warmup_s'], loss=jx[f'{form}_loss'],
                     grad_norm=jx[f'{form}_grad_norm'], flops_train=flops['train'], peak_gflops=peak))
  return rows


def print_split(forward_s, train_s, flops):
  """The forward-only (rollout) / forward + backward (train) split of time and of FLOPs."""
  total = forward_s + train_s
  print(f'  forward (rollout) / forward + backward (train): {forward_s / total:.0%} / {train_s / total:.0%} '
        f'of the time, {flops["rollout"] / flops["iteration"]:.0%} / {flops["train"] / flops["iteration"]:.0%} '
        f'of the FLOPs')


TORCH_PHASES = dict(rollout='rollout', data='data_grads', update='train', iteration='iteration')


def measure_torch(torch_peer, torch_model, shape, flops, peak, runs, nfe):
  """(median seconds per phase, row) of the torch peer's iteration, with the table printed."""
  config = ddrl_config(shape)
  cfg = shape.dit()
  tr = torch_peer.run_iteration(torch_model, config, update_lib.make_sampler(config), cfg, shape.latent,
                                shape.text_tokens, runs)
  if tr['nfe'] != nfe:
    raise RuntimeError(f'torch rollout made {tr["nfe"]} network calls, JAX {nfe}')
  sec = {k: med(tr[f'{k}_s']) for k in ('rollout', 'data', 'policy', 'adamw', 'update', 'iteration')}
  print_phases(f'torch eager iteration (median of {runs}; warm-up {tr["warmup_s"]:.1f} s; loss {tr["loss"]:.4g}, '
               f'pg {tr["pg_loss"]:.3g}, data {tr["data_loss"]:.4g}; max |param change| {tr["param_change"]:.2e}; '
               f'policy {sec["policy"]:.3f} s + AdamW {sec["adamw"]:.3f} s; process CPU / wall '
               f'{med(tr["cpu_per_wall"]):.2f})',
               phase_rows(flops, {TORCH_PHASES[k]: sec[k] for k in TORCH_PHASES}, peak))
  print_split(sec['rollout'], sec['update'], flops)
  fwd = flops['rollout'] / (shape.samples * nfe)
  extra = torch_peer.extra_forward_flops(cfg, shape.latent)
  print(f'  (diffusers computes the adaLN-LoRA modulations per token: {extra / fwd:+.1%} FLOPs per forward '
        f'beyond the analytic count, not included above)')
  row = dict(measurement='iteration', framework='torch', flops=flops, peak_gflops=peak,
             flop_limit_s=flops['iteration'] / (peak * 1e9), median_s=sec,
             min_s={k: min(tr[f'{k}_s']) for k in sec},
             gflops={k: flops[v] / sec[k] / 1e9 for k, v in TORCH_PHASES.items()},
             extra_forward_flops_per_sample=extra, torch_threads=torch_peer.torch.get_num_threads(), **tr)
  return sec, row


def measure_dit_alone(shape, graphdef, params, fwd, torch_peer, torch_model, runs):
  """(JAX fwd+bwd / fwd at remat 'none', rows): the DiT alone at batch B*N, JAX and torch, remat none/full
  (torch: gradient checkpointing off/on)."""
  print(f'\nDiT alone at batch {shape.samples} (median of {runs}; GFLOP/s of F and 3F per sample)')
  print(f'  {"":<18}{"fwd s":>9}{"fwd+bwd s":>11}{"ratio":>8}{"fwd GFLOP/s":>13}{"fwd+bwd GFLOP/s":>17}')
  batch_f = shape.samples * fwd
  ratio_none, rows = None, []
  for remat in ('none', 'full'):
    results = [('jax',) + time_dit_jax(shape, graphdef, params, remat, runs)]
    if torch_peer:
      results.append(('torch',) + torch_peer.time_dit(torch_model, shape.samples, shape.latent, shape.text_tokens,
                                                      runs, checkpointing=remat == 'full'))
    for fw, f_s, fb_s in results:
      ratio = med(fb_s) / med(f_s)
      if fw == 'jax' and remat == 'none':
        ratio_none = ratio
      print(f'  {fw + " remat " + remat:<18}{med(f_s):>9.4f}{med(fb_s):>11.4f}{ratio:>8.2f}'
            f'{batch_f / med(f_s) / 1e9:>13.1f}{3 * batch_f / med(fb_s) / 1e9:>17.1f}')
      rows.append(dict(measurement='dit_alone', framework=fw, remat=remat, batch=shape.samples,
                       forward_s=f_s, forward_backward_s=fb_s, median_forward_s=med(f_s),
                       median_forward_backward_s=med(fb_s), ratio=ratio, forward_flops=batch_f))
  return ratio_none, rows


def measure_compile(shape):
  """Rows of compile seconds of rollout / data_grads / update for T in (5, 10, 20) at the shape's depth
  and for depths (1, 2, 4) at its T."""
  print('\ncompile seconds of the trainer functions: trace + lower, XLA compile (its process CPU seconds)')
  sweep = [dataclasses.replace(shape, steps=t) for t in (5, 10, 20)]
  sweep += [dataclasses.replace(shape, blocks=b) for b in (1, 2, 4) if b != shape.blocks]
  rows = []
  for s in sorted(set(sweep), key=lambda s: (s.blocks, s.steps)):
    ct = compile_times(s)
    print(f'  T={s.steps:<3} blocks={s.blocks}:  ' + '   '.join(
        f'{k} {v["lower_s"]:.2f} + {v["compile_s"]:.2f} ({v["compile_cpu_s"]:.1f})' for k, v in ct.items()))
    rows.append(dict(measurement='compile', steps=s.steps, blocks=s.blocks, seconds=ct,
                     total_s={k: v['lower_s'] + v['compile_s'] for k, v in ct.items()}))
  return rows


def measure_ocr(iterations, peak):
  o = ocr_iteration(iterations)
  print(f'\nOCR main job (configs/ocr_tiny.py through the trainer: {o["sampler"]}, nfe {o["nfe"]}; median of '
        f'{iterations - 1} iterations after the first; trainer wall {o["wall_s"]:.0f} s)')
  print('  ' + '  '.join(f'{k} {v:.3f}' for k, v in o['phases'].items()))
  f, it = o['flops'], o['phases']['iteration']
  print(f'  iteration {f["iteration"] / 1e9:.1f} GFLOP: {f["iteration"] / it / 1e9:.1f} GFLOP/s, '
        f'{it * peak * 1e9 / f["iteration"]:.2f} x its FLOP limit')
  return dict(measurement='ocr_iteration', peak_gflops=peak, **o)


def benchmark(shape, runs=3, torch_peer_on=True, compile_sweep=True, dit_alone=True, ocr=False,
              ocr_iterations=4, peak_sizes=(512, 1024, 2048), torch_threads=None, reference_path=False):
  """Runs the measurements, printing their tables. Returns (measurement rows, summary dict).

  torch_threads: torch's intra-op threads; None = os.cpu_count() (the benchmark's setting).
  reference_path: also time value_and_grad of rl.rl_loss_reference (the plain scan) beside the public
  rl.ddrl_loss."""
  forms = ('public', 'reference') if reference_path else ('public',)
  torch_peer = None
  if torch_peer_on:
    import torch_peer  # pylint: disable=import-outside-toplevel,redefined-outer-name
    print(f'torch threads: {torch_peer.set_threads(torch_threads)} (default: torch.set_num_threads(os.cpu_count()))')
  rows = []
  add = lambda *new: rows.extend(dict(r, load_average=os.getloadavg()) for r in new)
  peak, row = measure_peak(torch_peer, peak_sizes)
  add(row)
  graphdef, params, torch_model, row = build_models(shape, torch_peer)
  add(row)
  fwd, row = measure_flops_check(shape)
  add(row)
  jx, flops, jax_sec, row = measure_jax(shape, graphdef, params, fwd, peak, runs, forms)
  add(row)
  public = public_path_rows(jx, flops, peak, forms)
  add(*public)
  torch_sec = None
  if torch_peer:
    torch_sec, row = measure_torch(torch_peer, torch_model, shape, flops, peak, runs, jx['nfe'])
    add(row)
  ratio = None
  if dit_alone:
    ratio, more = measure_dit_alone(shape, graphdef, params, fwd, torch_peer, torch_model, runs)
    add(*more)
  if compile_sweep:
    add(*measure_compile(shape))
  if ocr:
    add(measure_ocr(ocr_iterations, peak))
  result = goals(jax_sec['iteration'], flops['iteration'] / (peak * 1e9),
                 torch_sec['iteration'] if torch_sec else None, ratio, public[0]['ratio_to_train'])
  if torch_sec:
    print(f'\npublic path {public[0]["median_s"]:.3f} s against the torch peer\'s update (data + policy + '
          f'AdamW) {torch_sec["update"]:.3f} s: {public[0]["median_s"] / torch_sec["update"]:.2f} x')
  print('\ngoals')
  for name, value, met in result:
    print(f'  {name:<44}{"n/a" if value is None else f"{value:.2f}":>8}   '
          f'{"n/a" if met is None else ("met" if met else "NOT met")}')
  add(dict(measurement='goals', goals=[dict(goal=g, value=v, met=m) for g, v, m in result]))
  return rows, dict(jax=jx, jax_s=jax_sec, torch_s=torch_sec, flops=flops, peak=peak, goals=result,
                    public=public)


# -------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  d = Shape()
  p.add_argument('--width', type=int, default=d.width)
  p.add_argument('--blocks', type=int, default=d.blocks)
  p.add_argument('--heads', type=int, default=d.heads)
  p.add_argument('--lora', type=int, default=d.lora, help='adaLN-LoRA dim')
  p.add_argument('--context_dim', type=int, default=d.context_dim, help='text embedding width')
  p.add_argument('--latent', default=','.join(map(str, d.latent)), help='latent frames,H,W (16 channels)')
  p.add_argument('--tokens', type=int, default=None,
                 help='latent tokens (a square number): sets --latent to 1,2*sqrt,2*sqrt')
  p.add_argument('--text_tokens', type=int, default=d.text_tokens)
  p.add_argument('--groups', type=int, default=d.groups, help='B')
  p.add_argument('--rollouts', type=int, default=d.rollouts, help='N')
  p.add_argument('--steps', type=int, default=d.steps, help='T sampler steps')
  p.add_argument('--remat', default=d.remat, help="the iteration's remat policy")
  p.add_argument('--runs', type=int, default=3, help='timed runs after the warm-up')
  p.add_argument('--skip_torch', action='store_true')
  p.add_argument('--skip_compile_sweep', action='store_true')
  p.add_argument('--skip_dit_alone', action='store_true', help='skip the DiT-alone fwd / fwd+bwd table')
  p.add_argument('--reference_path', action='store_true',
                 help='also time value_and_grad of rl.rl_loss_reference (the plain scan; ~9 GiB at the '
                      'default shape)')
  p.add_argument('--ocr', action='store_true', help="also the OCR main job's iteration (the trainer)")
  p.add_argument('--ocr_iterations', type=int, default=4, help='the first one (compile) is excluded')
  p.add_argument('--quick', action='store_true', help='tiny sizes (a smoke test)')
  p.add_argument('--out', default=None,
                 help="JSON lines file ('' = none; default benchmarks/step_speed.jsonl, none with --quick)")
  return p.parse_args(argv)


def shape_of(args):
  if args.quick:
    return QUICK
  latent = tuple(int(v) for v in args.latent.split(','))
  if args.tokens:
    side = math.isqrt(args.tokens)
    if side * side != args.tokens:
      raise SystemExit(f'--tokens={args.tokens} is not a square number')
    latent = (1, 2 * side, 2 * side)
  return Shape(width=args.width, blocks=args.blocks, heads=args.heads, lora=args.lora,
               context_dim=args.context_dim, latent=latent, text_tokens=args.text_tokens,
               groups=args.groups, rollouts=args.rollouts, steps=args.steps, remat=args.remat)


def main(argv=None):
  xla_flags.apply()          # the CLIs' XLA:CPU defaults, before the first JAX computation
  args = parse_args(argv)
  shape = shape_of(args)
  info = machine_info()
  print(f'{info["cpu"]}, {info["cores"]} cores, load average {info["load_average"]}; jax {info["jax"]} '
        f'({info["jax_backend"]}), torch {info["torch"]}, diffusers {info["diffusers"]}')
  if info['load_average'][0] > 0.5:
    print('WARNING: the machine is busy before the start (1-minute load average '
          f'{info["load_average"][0]:.1f}); the timings include that contention')
  print(f'shape: {dataclasses.asdict(shape)}')
  rows, _ = benchmark(shape, runs=args.runs, torch_peer_on=not args.skip_torch,
                      compile_sweep=not args.skip_compile_sweep, dit_alone=not args.skip_dit_alone,
                      reference_path=args.reference_path, ocr=args.ocr, ocr_iterations=args.ocr_iterations,
                      peak_sizes=(256, 512) if args.quick else (512, 1024, 2048))
  info['load_average_end'] = os.getloadavg()
  out = args.out if args.out is not None else ('' if args.quick else os.path.join(HERE, 'step_speed.jsonl'))
  if out:
    write_jsonl(json_rows(rows, ' '.join(['python'] + sys.argv), info, shape), out)
    print(f'\n{len(rows)} JSON lines appended to {out}')


if __name__ == '__main__':
  main()
