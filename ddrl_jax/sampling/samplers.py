"""Rollout samplers: T steps under `jax.lax.scan`, vmapped over the N rollouts of each of B groups.

A denoiser is any ``apply_fn(params, x_t, t, cond) -> velocity`` with a leading batch axis on x_t, t and
cond (a pytree). The samplers call it once per step on all B*N rollouts, flattened group-major (slot
b*N + n is rollout n of group b), so the network sees one real batch axis: sharding constraints and
context-parallel attention inside the model apply to it directly (a per-sample call inside vmap would
hide the slot axis from them). The per-sample transition kernels are vmapped around that call. The
training-time recompute of a step mean goes through the same `Sampler.batched_step`; in a separately
compiled program it matches the stored mean up to round-off (about 1 ulp on CPU), which is why the
losses offer `old_mean='detached'` for an exactly-1 ratio.
"""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ddrl_jax.sampling import schedules
from ddrl_jax.sampling import transitions

KINDS = ('cosmos_2ab', 'flow_sde', 'dance_sde', 'ddim')


class Trajectory(NamedTuple):
  """Rollouts with their per-step transitions. Shapes for a (B, N) batch; S = sample shape.

  x_in:       (B, N, T, *S) state the denoiser saw at step i (the churned state for cosmos_2ab)
  x0_prev:    (B, N, T, *S) cosmos_2ab: the rollout's stale x0 of step i-1 (zeros elsewhere)
  mean:       (B, N, T, *S) transition mean under the rollout parameters (mu_old)
  x_next:     (B, N, T, *S) sampled next state: the policy-gradient target of step i
  step:       (B, N, T) int32 step index i
  t_in:       (B, N, T) rectified-flow time of x_in (what the denoiser was given)
  sigma_in:   (B, N, T) sampler-native level of x_in (churned VE sigma, or flow sigma)
  sigma_next: (B, N, T) next schedule level
  sigma_prev: (B, N, T) cosmos_2ab: previous churned sigma (a positive dummy at step 0)
  std:        (B, N, T) transition std (0 for deterministic samplers)
  x0:         (B, N, *S) final clean sample
  noise:      (B, N, *S) the rollout's initial standard-normal noise
  nfe:        (B, N) int32 denoiser calls made by each rollout
  """
  x_in: jax.Array
  x0_prev: jax.Array
  mean: jax.Array
  x_next: jax.Array
  step: jax.Array
  t_in: jax.Array
  sigma_in: jax.Array
  sigma_next: jax.Array
  sigma_prev: jax.Array
  std: jax.Array
  x0: jax.Array
  noise: jax.Array
  nfe: jax.Array


# Fields of `Trajectory` that carry a step axis; `gather_steps` selects trained steps from them.
STEP_FIELDS = ('x_in', 'x0_prev', 'mean', 'x_next', 'step', 't_in', 'sigma_in', 'sigma_next',
               'sigma_prev', 'std')


class StepInputs(NamedTuple):
  """What a step's mean depends on besides the network. Per-sample shapes: (*S) or scalars."""
  x_in: jax.Array
  x0_prev: jax.Array
  step: jax.Array
  t_in: jax.Array
  sigma_in: jax.Array
  sigma_next: jax.Array
  sigma_prev: jax.Array


def _call_single(apply_fn, params, x, t, cond):
  """Calls a batched apply_fn on one sample (adds and removes a batch axis of 1)."""
  batched = jax.tree.map(lambda a: a[None], cond)
  return apply_fn(params, x[None], jnp.reshape(t, (1,)), batched)[0]


def slot_conditions(cond, batch, num_rollouts):
  """Conditions per rollout slot: (B, ...) leaves are repeated N times (group-major); leaves that already
  have B*N rows are per-slot and kept (the trainer holds them that way, sharded like the rollouts)."""
  def per_slot(a):
    if a.shape[0] == batch * num_rollouts:
      return a
    if a.shape[0] == batch:
      return jnp.repeat(a, num_rollouts, axis=0)
    raise ValueError(f'a condition of shape {a.shape} has neither B = {batch} nor B*N = '
                     f'{batch * num_rollouts} rows')
  return jax.tree.map(per_slot, cond)


def _call_batched(apply_fn, params, x, t, cond):
  """apply_fn on (B, N, *S) states and (B, N) times as one (B*N)-batch call; returns (B, N, *S)."""
  b, n = t.shape
  flat = lambda a: a.reshape((b * n,) + a.shape[2:])
  v = apply_fn(params, flat(x), flat(t), slot_conditions(cond, b, n))
  return v.reshape((b, n) + v.shape[1:])


@dataclasses.dataclass(frozen=True)
class Sampler:
  """A stochastic sampler: its kind, schedule and noise. Hashable, so it can be a static jit argument.

  kind: 'cosmos_2ab' (VE Karras sigmas, EDM churn eta, 2AB), 'flow_sde' (FlowGRPO, noise = a),
    'dance_sde' (DanceGRPO, noise = eta), 'ddim' (DDPO, noise = eta).
  sigmas: (T + 1,) schedule levels, decreasing.
  noise: the kind's stochasticity (churn eta, a, eta); 0 makes the sampler deterministic (an ODE solver).
  s_noise: cosmos' extra scale on churn noise.
  """
  kind: str
  sigmas: tuple
  noise: float
  s_noise: float = 1.0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f'unknown sampler kind {self.kind!r}; known: {KINDS}')

  @property
  def num_steps(self):
    return len(self.sigmas) - 1

  @property
  def is_cosmos(self):
    return self.kind == 'cosmos_2ab'

  def deterministic(self):
    """The same schedule without noise: the ODE sampler used for evaluation."""
    return dataclasses.replace(self, noise=0.0)

  def schedule(self):
    """Per-step schedule arrays (each (T,) float32, `step` int32) as a `StepInputs` without states."""
    sig = np.asarray(self.sigmas, np.float64)
    steps = np.arange(self.num_steps)
    if self.is_cosmos:
      sigma_in = (1.0 + self.noise) * sig[:-1]
      t_in = schedules.rf_time(sigma_in)
      sigma_prev = np.concatenate([2.0 * sigma_in[:1], sigma_in[:-1]])  # step 0: positive dummy
    else:
      sigma_in = sig[:-1]
      t_in = sigma_in
      sigma_prev = np.zeros_like(sigma_in)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    return StepInputs(x_in=None, x0_prev=None, step=jnp.asarray(steps, jnp.int32), t_in=f32(t_in),
                      sigma_in=f32(sigma_in), sigma_next=f32(sig[1:]), sigma_prev=f32(sigma_prev))

  def kernel(self, inp, velocity):
    """Transition (mean, std) given the network's velocity at `inp` (per-sample shapes)."""
    if self.is_cosmos:
      x0 = transitions.cosmos_x0(inp.x_in, velocity, inp.t_in)
      mean = transitions.cosmos_2ab_mean_traced(inp.x_in, x0, inp.sigma_in, inp.sigma_next,
                                                inp.x0_prev, inp.sigma_prev, inp.step == 0)
      # The next step's churn is this transition's noise: sqrt(sigma_hat'^2 - sigma'^2) * s_noise.
      std = inp.sigma_next * np.sqrt(self.noise**2 + 2.0 * self.noise) * self.s_noise
      return mean, std, x0
    step_fn = {'flow_sde': transitions.flow_sde_step, 'dance_sde': transitions.dance_sde_step,
               'ddim': transitions.ddim_step}[self.kind]
    mean, std = step_fn(inp.x_in, velocity, inp.sigma_in, inp.sigma_next, self.noise)
    return mean, std, inp.x_in - inp.sigma_in * velocity

  def network_input(self, x_in, t_in):
    """The denoiser input for a state: cosmos feeds (1 - t) x_sigma; flow states are fed as they are."""
    return (1.0 - t_in) * x_in if self.is_cosmos else x_in

  def step_mean(self, apply_fn, params, inp, cond):
    """(mean, std, x0_hat) of one step for one sample, recomputed with `params`."""
    velocity = _call_single(apply_fn, params, self.network_input(inp.x_in, inp.t_in), inp.t_in, cond)
    return self.kernel(inp, velocity)

  def path_kl_weight(self, inp):
    """Per-step weight w with KL(step with v* || step with v_theta) = w * ||v_theta - v*||^2.

    w = (d mean / d v)^2 / (2 std^2), the step's term of this sampler's path KL (Girsanov in the
    continuous limit); every kernel is affine in v, so d mean / d v is a scalar per step. Shapes follow
    `inp.t_in`. Used by the Theorem 3.1 check; needs std > 0.
    """
    zero = jnp.zeros_like(inp.t_in)
    inp = inp._replace(x_in=zero, x0_prev=zero)
    mean_at_0, std, _ = self.kernel(inp, zero)
    gain = self.kernel(inp, zero + 1.0)[0] - mean_at_0
    return gain**2 / (2.0 * std**2)

  def batched_step(self, apply_fn, params, inp, cond):
    """(mean, std, x0_hat) of one step for every rollout: `inp` fields are (B, N, ...), cond (B, ...) or
    per slot (B*N, ...).

    The rollout and the training-time recompute both call this: one network call on the B*N flattened
    rollouts, the per-sample kernel vmapped over (B, N).
    """
    per_sample = lambda f: jax.vmap(jax.vmap(f))
    x_net = per_sample(self.network_input)(inp.x_in, inp.t_in)
    velocity = _call_batched(apply_fn, params, x_net, inp.t_in, cond)
    return per_sample(self.kernel)(inp, velocity)

  def _batched(self, apply_fn, params, cond, key, num_rollouts, sample_shape, keep_trajectory):
    """Rollouts for a (B, N) batch: scan over the T steps of a step vmapped over (B, N)."""
    sample_shape = tuple(sample_shape)
    batch = jax.tree.leaves(cond)[0].shape[0]
    bn = (batch, num_rollouts)
    keys = key if key.shape == bn else jax.random.split(key, bn)
    draw = lambda k: jax.random.normal(k, (self.num_steps + 2,) + sample_shape)
    z = jnp.moveaxis(jax.vmap(jax.vmap(draw))(keys), 2, 0)   # (T + 2, B, N, *S)
    noise = z[0]
    if self.is_cosmos:
      sigma0 = float(self.sigmas[0])
      churn0 = sigma0 * np.sqrt((1.0 + self.noise)**2 - 1.0) * self.s_noise
      x = sigma0 * noise + churn0 * z[1]
    else:
      x = noise
    sched = self.schedule()
    per_sample = lambda a: jnp.broadcast_to(a.reshape(a.shape + (1, 1)), a.shape + bn)
    scan_sched = jax.tree.map(per_sample, sched._replace(x_in=None, x0_prev=None))

    def body(carry, xs):
      x_in, x0_prev = carry
      sched_i, z_i = xs
      inp = sched_i._replace(x_in=x_in, x0_prev=x0_prev)
      mean, std, x0_hat = self.batched_step(apply_fn, params, inp, cond)
      std_b = std.reshape(std.shape + (1,) * len(sample_shape))
      x_next = mean + std_b * z_i
      record = (x_in, x0_prev, mean, x_next, std) if keep_trajectory else (mean,)
      return (x_next, x0_hat if self.is_cosmos else x0_prev), record

    (x_last, _), rec = jax.lax.scan(body, (x, jnp.zeros_like(x)), (scan_sched, z[2:]))
    nfe = self.num_steps
    mean_last = (rec[2] if keep_trajectory else rec[0])[-1]
    if self.is_cosmos:
      # cosmos ends with one clean call on the last (unchurned) mean at sigma_min.
      t_min = jnp.full(bn, schedules.rf_time(float(self.sigmas[-1])), jnp.float32)
      x_net = jax.vmap(jax.vmap(self.network_input))(mean_last, t_min)
      v_last = _call_batched(apply_fn, params, x_net, t_min, cond)
      x0 = jax.vmap(jax.vmap(transitions.cosmos_x0))(mean_last, v_last, t_min)
      nfe += 1
    else:
      x0 = x_last
    out = dict(x0=x0, noise=noise, nfe=jnp.full(bn, nfe, jnp.int32))
    if keep_trajectory:
      to_bn = lambda a: jnp.moveaxis(a, 0, 2)    # (T, B, N, ...) -> (B, N, T, ...)
      x_in, x0_prev, mean, x_next, std = map(to_bn, rec)
      out.update(x_in=x_in, x0_prev=x0_prev, mean=mean, x_next=x_next, std=std,
                 **{f: to_bn(getattr(scan_sched, f)) for f in
                    ('step', 't_in', 'sigma_in', 'sigma_next', 'sigma_prev')})
    return out

  def rollout(self, apply_fn, params, cond, key, *, num_rollouts, sample_shape):
    """N rollouts for each of B conditions.

    Args:
      apply_fn: batched denoiser, see module docstring.
      params: its parameters (pytree).
      cond: pytree of (B, ...) conditions.
      key: PRNG key; rollout (b, n) draws its noise from its own split of it (split(key, (B, N))[b, n]).
        (B, N) keys are those splits themselves: a chunk of a batch's slots then draws what it draws in
        the whole batch.
      num_rollouts: N.
      sample_shape: S, the shape of one sample (static).
    Returns:
      `Trajectory` with (B, N, ...) leading axes.
    """
    return Trajectory(**self._batched(apply_fn, params, cond, key, num_rollouts, sample_shape, True))

  def sample(self, apply_fn, params, cond, key, *, num_rollouts, sample_shape):
    """Final samples only: (B, N, *S). `self.deterministic().sample` is the ODE eval sampler."""
    return self._batched(apply_fn, params, cond, key, num_rollouts, sample_shape, False)['x0']


def make_sampler(kind, num_steps, *, sigma_min=0.01, sigma_max=200.0, rho=7.0, s_churn=1.0,
                 s_noise=1.0, shift=1.0, noise_level=0.7, eta=1.0):
  """Builds a `Sampler` from config-style arguments (each kind reads only its own)."""
  if kind == 'cosmos_2ab':
    sigmas = schedules.karras_sigmas(num_steps, sigma_min, sigma_max, rho)
    noise = schedules.churn_eta(s_churn, num_steps)
  elif kind in ('flow_sde', 'dance_sde', 'ddim'):
    sigmas = schedules.shifted_flow_sigmas(num_steps, shift)
    noise = noise_level if kind == 'flow_sde' else eta
  else:
    raise ValueError(f'unknown sampler kind {kind!r}; known: {KINDS}')
  return Sampler(kind=kind, sigmas=tuple(float(s) for s in sigmas), noise=float(noise),
                 s_noise=float(s_noise))


def gather_steps(traj, steps):
  """Selects per-sample trained steps.

  Args:
    traj: `Trajectory` with (B, N, T, ...) step fields.
    steps: (B, N, K) int step indices.
  Returns:
    `StepInputs` plus `mean`, `x_next`, `std` as a dict of (K, B, N, ...) arrays (K leading for a scan).
  """
  out = {}
  for name in STEP_FIELDS:
    arr = getattr(traj, name)
    idx = steps.reshape(steps.shape + (1,) * (arr.ndim - 3))
    picked = jnp.take_along_axis(arr, idx, axis=2)
    out[name] = jnp.moveaxis(picked, 2, 0)
  return out


def gather_step(traj, step):
  """One trained step per sample: step (B, N) int indices -> the `gather_steps` fields at them, each
  (B, N, ...). Gathering inside a scan over K this way holds one step's inputs at a time."""
  out = {}
  for name in STEP_FIELDS:
    arr = getattr(traj, name)
    idx = step.reshape(step.shape + (1,) * (arr.ndim - 2))
    out[name] = jnp.take_along_axis(arr, idx, axis=2)[:, :, 0]
  return out

