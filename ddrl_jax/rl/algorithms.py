"""DDRL and the GRPO-family losses as pure functions of an ``apply_fn(params, x_t, t, cond)``.

Every loss takes a rollout `Trajectory` (B groups x N rollouts x T steps), per-rollout advantages (B, N) and
the trained step indices (B, N, K), and returns (scalar loss, metrics). The K trained steps are visited by a
`lax.scan` (compile time independent of K), the network is recomputed only at those steps, and the rollout's
stored means play the old policy: DDRL and DanceGRPO/DDPO need no copy of old or reference parameters.

Three forms of the same objective:
  * `rl_loss_reference` / `data_loss_reference` return the loss as a plain scan over K; `jax.grad` of them
    differentiates that scan, so reverse mode stacks the residuals of all K steps (every activation of
    2K network calls at the DDRL shape of benchmarks/step_speed.py: 9 GiB of temporaries against the
    per-step form's 0.5 GiB, and 1.5 to 2.5 times its time on a shared 2-core CPU). They support
    every JAX transformation (forward mode too) and are what the other forms are tested against.
  * `rl_loss_and_grad` / `data_loss_and_grad` return (loss, metrics, grads): a scan over the K steps whose
    body takes the gradient of one step's term and adds it to a float32 gradient carry (cosmos-rl
    back-propagates each trained step separately too). Exact (every term is a mean over steps of
    per-step terms, the PPO clip is per step), and activation memory does not grow with K. The trainer
    uses this form; gradients are taken with respect to the `params` given (e.g. a bf16 compute copy) and
    accumulated in float32.
  * `rl_loss` / `data_loss` and the named losses (`ddrl_loss`, `flow_grpo_loss`, ...): the reference's
    value with a custom VJP (`per_step_vjp`), so `jax.grad` / `jax.value_and_grad` of them with respect to
    `params` runs the per-step form: the trainer's cost and memory from a library user's plain
    `jax.value_and_grad`. Derivatives with respect to anything else fall back to the reference's own;
    forward mode (jax.jvp, jax.hessian) is not defined for them (use the reference).

    L = loss_scale * mean_k [ L_pg,k + kl_beta * KL_k + data_beta * L_data,k ]          (data steps 'full')
    L = loss_scale * ( mean_k [ L_pg,k + kl_beta * KL_k ] + data_beta / K * L_data,k=0 )   ('first')
    L = loss_scale * ( mean_k [ L_pg,k + kl_beta * KL_k ] + data_beta * L_data at one random trained
        step per rollout )                                                               ('random_step')

Random draws (the data term's fresh noise, condition dropout and random step; DiffusionNFT's noise) are
made per rollout slot from `slot_keys(key, B, N)`: slot (b, n)'s draws depend on its own key only, so a
batch split into chunks of slots (the trainer's micro-batches, `ddrl_jax.update`) draws what the whole
batch draws. Every `key` argument is either one PRNG key or those (B, N) per-slot keys.

Means over samples that leave some out (FlowGRPO's zero-advantage filter; DiffusionNFT's failed samples)
divide by `mean_total` when given: the chunked update passes the whole batch's count over the number of
chunks, so that the mean of the chunks' values is the batch's mean.

KL_k has two forms (`step_kl`): 'exact', the KL of the two equal-variance Gaussian steps,
mean (mu_theta - mu_ref)^2 / (2 std^2) with the transition std; and 'flow_grpo', FlowGRPO's code
(yifan123/flow_grpo scripts/train_sd3.py, the `kl_loss` of its training loop), which divides by
2 std_dev_t^2 where std_dev_t is the std without its sqrt(|dt|) factor (`flow_grpo_std_dev`): the exact
KL times |dt|, i.e. 1/|dt| (10x at 10 uniform steps) weaker at the same kl_beta.
"""
import dataclasses
import functools
from typing import Any, ClassVar, Optional

import jax
from jax.custom_derivatives import custom_vjp_primal_tree_values
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp
import numpy as np

from ddrl_jax.rl import diffusion_loss
from ddrl_jax.rl import options as options_lib
from ddrl_jax.rl import policy
from ddrl_jax.rl.options import RLOptions
from ddrl_jax.sampling import samplers


# How the data term picks its steps; 'reduced' is the name 'random_step' had before 'first' existed.
DATA_STEP_MODES = options_lib.DATA_STEP_MODES
KL_FORMS = options_lib.KL_FORMS


def data_term_steps(mode, num_k):
  """Trained steps per rollout at which the data term runs: K for 'full', 1 otherwise."""
  if mode not in DATA_STEP_MODES:
    raise ValueError(f'data loss steps must be one of {DATA_STEP_MODES}, got {mode!r}')
  return num_k if mode == 'full' else 1


@functools.partial(jax.tree_util.register_dataclass, data_fields=['x0', 'cond'],
                   meta_fields=['beta', 'steps', 'noise', 'cond_dropout', 'weighting'])
@dataclasses.dataclass(frozen=True)
class DataTerm:
  """The off-policy diffusion-loss term of DDRL.

  x0: (B, *S) clean data paired with each group's condition (shared by the group's N rollouts).
  cond: pytree of (B, ...) conditions of that data.
  beta: data_beta, its weight.
  steps: 'full' (at every trained step: 2N|T| calls per condition); 'first' (cosmos-rl's
    `data_on_first_only`, cosmos_rl/policy/trainer/wfm_trainer.py `rl_training_step`: only at the first
    trained step, and since cosmos-rl divides every step's loss by the K trained steps, with weight
    beta / K: N(1 + |T|) calls); 'random_step' (at one random trained step per rollout, weight beta, the
    paper's "randomly sample t": N(1 + |T|) calls). 'reduced' is an alias of 'random_step'.
  noise: 'rollout' (the rollout's initial noise, cosmos-rl's use_rl_sigma_and_noise) or 'fresh'.
  cond_dropout: probability of the null (zero) condition per sample.
  weighting: 'path_kl' (the sampler's exact per-step KL weight; the default), 'cosmos_rl' (t^2 + (1-t)^2,
    cosmos-rl's; 'cosmos' is its old name), 'eps_mse' ((1-t)^2: the paper's Algorithm 1, an unweighted
    epsilon-MSE) or 'none'. `total_data_weight` compares two weightings' strengths.
  """
  x0: Any
  cond: Any
  beta: float = 0.01
  steps: str = 'full'
  noise: str = 'rollout'
  cond_dropout: float = 0.2
  weighting: str = 'path_kl'

  def __post_init__(self):
    object.__setattr__(self, 'weighting', options_lib.canonical(self.weighting))   # 'cosmos' -> 'cosmos_rl'
    if self.steps not in DATA_STEP_MODES:
      raise ValueError(f'data loss steps must be one of {DATA_STEP_MODES}, got {self.steps!r}')
    if self.noise not in options_lib.DATA_NOISES:
      raise ValueError(f"data loss noise must be 'rollout' or 'fresh', got {self.noise!r}")
    if self.weighting not in diffusion_loss.WEIGHTINGS:
      raise ValueError(f'data loss weighting must be one of {diffusion_loss.WEIGHTINGS}, '
                       f'got {self.weighting!r}')


def slot_keys(key, batch, num_rollouts):
  """(B, N) typed PRNG keys, one per rollout slot: `key` split B*N ways (group-major), or `key` itself when
  it already is (B, N) keys (a chunk of a batch's slots). Raw uint32 keys are wrapped."""
  if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(key)
  if key.shape == (batch, num_rollouts):
    return key
  if key.shape != ():
    raise ValueError(f'key: one PRNG key or ({batch}, {num_rollouts}) per-slot keys, got shape {key.shape}')
  return jax.random.split(key, batch * num_rollouts).reshape(batch, num_rollouts)


def split_slot_keys(keys, num):
  """(B, N) keys -> (num, B, N) keys: each slot's key split `num` ways (leading axis for a scan)."""
  return jnp.moveaxis(jax.vmap(jax.vmap(lambda k: jax.random.split(k, num)))(keys), 2, 0)


def repeat_groups(tree, n):
  """(B, ...) -> (B * N, ...), each group's entry repeated N times (group-major)."""
  return jax.tree.map(lambda a: jnp.repeat(a, n, axis=0), tree)


def _data_loss_at(apply_fn, params, sampler, inp, traj_noise, data, keys):
  """Mean data loss over (B, N) at the noise levels of the step inputs `inp` ((B, N) scalars); keys (B, N)
  per-slot keys of this step."""
  n = inp.t_in.shape[1]
  k_noise, k_drop = split_slot_keys(keys, 2)
  x0 = repeat_groups(data.x0, n)
  if data.noise == 'rollout':
    noise = traj_noise.reshape(x0.shape)
  else:
    noise = jax.vmap(lambda k: jax.random.normal(k, x0.shape[1:], x0.dtype))(k_noise.reshape(-1))
  cond = diffusion_loss.drop_condition(repeat_groups(data.cond, n), k_drop.reshape(-1), data.cond_dropout)
  weight = data_weight(sampler, data.weighting, inp).reshape(-1)
  return diffusion_loss.velocity_loss(apply_fn, params, x0, noise, inp.t_in.reshape(-1), cond,
                                      weight).mean()


def data_weight(sampler, weighting, inp):
  """The data term's per-sample weight at the step inputs `inp` (shape of `inp.t_in`): 'cosmos_rl'
  t^2 + (1-t)^2, 'path_kl' the sampler's exact per-step path-KL weight, 'eps_mse' (1-t)^2, 'none' 1."""
  weighting = options_lib.canonical(weighting)
  t = inp.t_in
  if weighting == 'cosmos_rl':
    return diffusion_loss.cosmos_loss_weight(t)
  if weighting == 'path_kl':
    return sampler.path_kl_weight(inp)
  if weighting == 'eps_mse':
    return diffusion_loss.eps_mse_weight(t)
  if weighting == 'none':
    return jnp.ones_like(t, jnp.float32)
  raise ValueError(f'data loss weighting must be one of {diffusion_loss.WEIGHTINGS}, got {weighting!r}')


def total_data_weight(sampler, weighting, steps):
  """Sum of the data term's weight over the trained `steps` of `sampler`'s schedule: with data_beta, the
  data term's total strength (two weightings carry the same strength when beta * total agree)."""
  idx = jnp.asarray(steps, jnp.int32)
  zero = jnp.zeros((len(steps),), jnp.float32)      # placeholder states (path_kl_weight zeroes them)
  inp = jax.tree.map(lambda a: a[idx], sampler.schedule())._replace(x_in=zero, x0_prev=zero)
  return float(jnp.sum(data_weight(sampler, weighting, inp)))


def _step_inputs(picked):
  return samplers.StepInputs(**{f: picked[f] for f in samplers.StepInputs._fields})


def f32_zeros(tree):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


def accumulate(acc, grads, scale=1.0):
  return jax.tree.map(lambda a, g: a + scale * g.astype(jnp.float32), acc, grads)


def _perturbed(tree):
  """Whether any leaf of a tree of `CustomVJPPrimal`s is being differentiated."""
  return any(leaf.perturbed for leaf in jax.tree.leaves(tree))


def _is_zero(tree):
  """Whether every cotangent leaf of `tree` is a symbolic zero (an output nobody differentiates)."""
  return all(isinstance(c, SymbolicZero) for c in jax.tree.leaves(
      tree, is_leaf=lambda c: isinstance(c, SymbolicZero)))


def _instantiate(tree):
  """Cotangents with each symbolic zero replaced by an array of zeros of its shape and dtype."""
  zeros = lambda c: np.zeros(c.shape, c.dtype) if c.dtype == jax.dtypes.float0 else jnp.zeros(
      c.shape, c.dtype)
  return jax.tree.map(lambda c: zeros(c) if isinstance(c, SymbolicZero) else c, tree,
                      is_leaf=lambda c: isinstance(c, SymbolicZero))


def per_step_vjp(reference, loss_and_grad):
  """`reference` with a reverse-mode rule that takes the parameter gradient one trained step at a time.

  Args:
    reference: (params, frozen, rest) -> (scalar loss, aux pytree), a plain JAX function (the scan over
      the K trained steps). `frozen` (reference parameters, or None) must enter it only under
      stop_gradient, so its gradient is zero.
    loss_and_grad: (params, frozen, rest) -> (loss, aux, float32 grads of loss with respect to params),
      the same values with the gradient accumulated per step (`rl_loss_and_grad`).
  Returns:
    a function (params, frozen, rest) -> (loss, aux) equal to `reference`. Under jax.grad / vjp with
    respect to `params` (and `frozen`), with the loss differentiated and not aux, its forward pass runs
    `loss_and_grad` and its backward pass scales those grads by the loss's cotangent: no residuals are
    stacked over the K steps. A derivative with respect to `rest` or of aux runs reference's own VJP,
    recomputed from the inputs. Forward mode is not defined (a custom VJP); apply_fn must not close over
    a value being differentiated (JAX raises an error): pass it as `params`.
  """
  @jax.custom_vjp
  def loss(params, frozen, rest):
    return reference(params, frozen, rest)

  def fwd(params, frozen, rest):
    per_step = _perturbed(params) and not _perturbed(rest)
    params, frozen, rest = custom_vjp_primal_tree_values((params, frozen, rest))
    if not per_step:
      return reference(params, frozen, rest), (None, params, frozen, rest)
    value, aux, grads = loss_and_grad(params, frozen, rest)
    return (value, aux), (grads, params, frozen, rest)

  def bwd(res, cotangent):
    grads, params, frozen, rest = res
    ct_loss, ct_aux = cotangent
    if grads is None or not _is_zero(ct_aux):
      return jax.vjp(reference, params, frozen, rest)[1](_instantiate(cotangent))
    if isinstance(ct_loss, SymbolicZero):
      return None, None, None
    # None: frozen's gradient is zero (stop_gradient), rest is not differentiated.
    return jax.tree.map(lambda g, p: (ct_loss * g).astype(p.dtype), grads, params), None, None

  loss.defvjp(fwd, bwd, symbolic_zeros=True)
  return loss


def data_loss_and_grad(apply_fn, params, sampler, traj, steps, data, key):
  """`data_loss` and its gradient, accumulated one trained step at a time ('full'; 'first' and
  'random_step' have one term). Returns (loss, float32 grads with the structure of params)."""
  num_k = steps.shape[-1]
  key = slot_keys(key, *steps.shape[:2])
  k_steps = split_slot_keys(key, 2)[0]
  if data.steps != 'full':
    value, grads = jax.value_and_grad(
        lambda p: data_loss_reference(apply_fn, p, sampler, traj, steps, data, key))(params)
    return value, accumulate(f32_zeros(params), grads)

  def body(acc, xs):
    step, step_key = xs
    inp = _step_inputs(samplers.gather_step(traj, step))
    value, grads = jax.value_and_grad(
        lambda p: _data_loss_at(apply_fn, p, sampler, inp, traj.noise, data, step_key))(params)
    return accumulate(acc, grads, 1.0 / num_k), value

  grads, per_step = jax.lax.scan(body, f32_zeros(params),
                                 (jnp.moveaxis(steps, -1, 0), split_slot_keys(k_steps, num_k)))
  return per_step.mean(), grads


def data_loss(apply_fn, params, sampler, traj, steps, data, key):
  """DDRL's diffusion loss on `data` (a `DataTerm`) at the noise levels of the trained steps: the value of
  `data_loss_reference`, whose docstring has the arguments, with the per-step gradient (`per_step_vjp`):
  jax.grad of it with respect to params runs `data_loss_and_grad`. Returns the scalar loss."""
  reference = lambda p, _, rest: (data_loss_reference(apply_fn, p, sampler, *rest), None)

  def per_step(p, _, rest):
    value, grads = data_loss_and_grad(apply_fn, p, sampler, *rest)
    return value, None, grads
  return per_step_vjp(reference, per_step)(params, None, (traj, steps, data, key))[0]


def data_loss_reference(apply_fn, params, sampler, traj, steps, data, key):
  """DDRL's diffusion loss on `data` (a `DataTerm`) at the noise levels of the trained steps, as a plain
  scan over them (reverse mode keeps every step's residuals; `data_loss` is the same value with the
  per-step gradient).

  The same value (and random draws) as the data part of `rl_loss(..., data=data, key=key)`, so a
  trainer can take its gradient while rewards are still pending and add the policy gradient later.
  Args: traj (B, N, T, ...) Trajectory, steps (B, N, K) trained step indices, key as rl_loss's.
  Returns: the unweighted scalar loss (rl_loss adds loss_scale * data.beta * it): the mean over the K
    trained steps of the per-step data term, which for 'first' is the loss at steps[..., 0] and 0 at the
    other steps (so L_first / K, cosmos-rl's weighting), and for 'random_step' the loss at one random
    trained step per rollout.
  """
  num_k = steps.shape[-1]
  k_steps, k_reduced = split_slot_keys(slot_keys(key, *steps.shape[:2]), 2)
  if data.steps == 'first':
    # The key of step 0 in 'full', so 'first' is exactly 1/K of the first term of 'full'.
    first = _step_inputs(samplers.gather_step(traj, steps[..., 0]))
    step_key = split_slot_keys(k_steps, num_k)[0]
    return _data_loss_at(apply_fn, params, sampler, first, traj.noise, data, step_key) / num_k
  picked = samplers.gather_steps(traj, steps)
  if data.steps == 'full':
    def body(_, xs):
      pick, step_key = xs
      return None, _data_loss_at(apply_fn, params, sampler, _step_inputs(pick), traj.noise, data,
                                 step_key)
    _, per_step = jax.lax.scan(body, None, (picked, split_slot_keys(k_steps, num_k)))
    return per_step.mean()
  k_pick, k_data = split_slot_keys(k_reduced, 2)
  which = jax.vmap(jax.vmap(lambda k: jax.random.randint(k, (), 0, num_k)))(k_pick)   # (B, N) positions
  # Only the noise levels of the drawn step matter: the (K, B, N) scalar fields.
  levels = {f: jnp.take_along_axis(picked[f], which[None], axis=0)[0]
            for f in ('step', 't_in', 'sigma_in', 'sigma_next', 'sigma_prev')}
  inp = samplers.StepInputs(x_in=None, x0_prev=None, **levels)
  return _data_loss_at(apply_fn, params, sampler, inp, traj.noise, data, k_data)


def rl_loss(apply_fn, params, sampler, traj, advantages, steps, cond, key, *, clip_range,
            log_ratio_form='gaussian', ref_params=None, kl_beta=0.0,
            data: Optional[DataTerm] = None, loss_scale=1.0, old_mean='rollout', kl_form='exact',
            drop_zero_advantages=False, pg_weight=1.0, mean_total=None):
  """The shared clipped policy-gradient loss with optional reverse-KL and data terms.

  Args:
    apply_fn: batched denoiser (params, x_t, t, cond) -> velocity.
    params: trained parameters.
    sampler: the `Sampler` that made `traj`.
    traj: `Trajectory` with (B, N, T, ...) step fields.
    advantages: (B, N).
    steps: (B, N, K) int32 trained step indices.
    cond: pytree of (B, ...) rollout conditions, or of (B*N, ...) per-slot ones.
    key: PRNG key, or (B, N) per-slot keys (`slot_keys`): data noise, condition dropout, the random_step
      variant's step draw.
    clip_range: PPO epsilon.
    log_ratio_form: 'cosmos_rl' or 'gaussian' (see `policy.log_ratio`; 'cosmos' is accepted).
    ref_params: frozen reference parameters, required iff kl_beta > 0.
    kl_beta: weight of the per-step KL(step under theta || step under ref) of `step_kl`.
    data: optional `DataTerm` (DDRL).
    loss_scale: overall factor (cosmos-rl: 10).
    old_mean: 'rollout' uses the means stored by the rollout (cosmos-rl); the ratio is then 1 only up to
      the round-off between the two compiled programs (~1 ulp of the mean, which the unnormalized
      'cosmos' form multiplies by (x' - mu) ~ sigma and can push past a 1e-4 clip at high sigma).
      'detached' uses stop_gradient(mu_theta): the same gradient, ratio exactly 1. Valid because every
      update here is the first one after its rollout (one optimizer step per rollout batch).
    kl_form: 'exact' (the Gaussian step KL, mean (mu_theta - mu_ref)^2 / (2 std^2)) or 'flow_grpo'
      (FlowGRPO's code: / (2 std_dev_t^2), std_dev_t = std / sqrt(|dt|); flow_sde rollouts only). See
      `step_kl`.
    drop_zero_advantages: FlowGRPO's filter (scripts/train_sd3.py, the `mask` on
      `samples["advantages"]` before training): rollouts whose advantage is exactly 0 leave the update,
      so the policy-gradient and KL means run over the other rollouts (all rollouts dropped: 0).
      FlowGRPO also re-adds random dropped samples until its batch splits evenly; that is not done here.
    mean_total: what the kept-sample means divide by (None: the kept count of this batch; module
      docstring).
    pg_weight: weight of the policy-gradient term (1; 0 trains the KL and data terms alone, a control
      that separates what the data term does by itself). The metric pg_loss stays unweighted.
  Returns:
    (loss, metrics dict of scalars).

  The value is `rl_loss_reference`'s; jax.grad / jax.value_and_grad with respect to params (has_aux or
  not) runs `rl_loss_and_grad`, one trained step's backward at a time (`per_step_vjp`), so reverse mode
  costs what the trainer's update costs. ref_params gets a zero gradient (the KL's reference is frozen).
  """
  opts = dict(clip_range=clip_range, log_ratio_form=log_ratio_form, kl_beta=kl_beta,
              loss_scale=loss_scale, old_mean=old_mean, kl_form=kl_form,
              drop_zero_advantages=drop_zero_advantages, pg_weight=pg_weight, mean_total=mean_total)
  _check_rl_options(old_mean, kl_beta, ref_params, kl_form, sampler)

  def reference(p, ref, rest):
    traj, advantages, steps, cond, key, data = rest
    return rl_loss_reference(apply_fn, p, sampler, traj, advantages, steps, cond, key, ref_params=ref,
                             data=data, **opts)

  def per_step(p, ref, rest):
    traj, advantages, steps, cond, key, data = rest
    return rl_loss_and_grad(apply_fn, p, sampler, traj, advantages, steps, cond, key, ref_params=ref,
                            data=data, **opts)

  return per_step_vjp(reference, per_step)(params, ref_params,
                                           (traj, advantages, steps, cond, key, data))


def rl_loss_reference(apply_fn, params, sampler, traj, advantages, steps, cond, key, *, clip_range,
                      log_ratio_form='gaussian', ref_params=None, kl_beta=0.0,
                      data: Optional[DataTerm] = None, loss_scale=1.0, old_mean='rollout',
                      kl_form='exact', drop_zero_advantages=False, pg_weight=1.0, mean_total=None):
  """`rl_loss` (same arguments and value) as a plain scan over the K trained steps: reverse mode through it
  keeps the residuals of every step (module docstring). The form the others are tested against."""
  _check_rl_options(old_mean, kl_beta, ref_params, kl_form, sampler)
  picked = samplers.gather_steps(traj, steps)
  step = functools.partial(_policy_step, apply_fn, sampler, advantages, cond, ref_params=ref_params,
                           clip_range=clip_range, log_ratio_form=log_ratio_form, kl_beta=kl_beta,
                           old_mean=old_mean, kl_form=kl_form,
                           drop_zero_advantages=drop_zero_advantages, pg_weight=pg_weight,
                           mean_total=mean_total)
  _, per_step = jax.lax.scan(lambda _, pick: (None, step(params, pick)[1]), None, picked)
  metrics = _step_metrics(per_step)
  total = pg_weight * metrics['pg_loss']
  if kl_beta > 0:
    total = total + kl_beta * metrics['kl']
  if data is not None:
    metrics['data_loss'] = data_loss_reference(apply_fn, params, sampler, traj, steps, data, key)
    total = total + data.beta * metrics['data_loss']
  total = loss_scale * total
  metrics['loss'] = total
  return total, metrics


def rl_loss_and_grad(apply_fn, params, sampler, traj, advantages, steps, cond, key, *, clip_range,
                     log_ratio_form='gaussian', ref_params=None, kl_beta=0.0,
                     data: Optional[DataTerm] = None, loss_scale=1.0, old_mean='rollout',
                     kl_form='exact', drop_zero_advantages=False, pg_weight=1.0, mean_total=None):
  """`rl_loss` with its gradient accumulated one trained step at a time (module docstring).

  Same arguments as `rl_loss`. Returns (loss, metrics, grads): the loss and metrics equal rl_loss's, and
  grads (float32, the structure of params) equal jax.grad of it up to float summation order.
  """
  _check_rl_options(old_mean, kl_beta, ref_params, kl_form, sampler)
  num_k = steps.shape[-1]
  step = functools.partial(_policy_step, apply_fn, sampler, advantages, cond, ref_params=ref_params,
                           clip_range=clip_range, log_ratio_form=log_ratio_form, kl_beta=kl_beta,
                           old_mean=old_mean, kl_form=kl_form,
                           drop_zero_advantages=drop_zero_advantages, pg_weight=pg_weight,
                           mean_total=mean_total)

  def body(acc, step_k):      # step_k (B, N): this step's inputs are gathered here, one step at a time
    (_, out), grads = jax.value_and_grad(step, has_aux=True)(params, samplers.gather_step(traj, step_k))
    return accumulate(acc, grads, loss_scale / num_k), out

  grads, per_step = jax.lax.scan(body, f32_zeros(params), jnp.moveaxis(steps, -1, 0))
  metrics = _step_metrics(per_step)
  total = pg_weight * metrics['pg_loss']
  if kl_beta > 0:
    total = total + kl_beta * metrics['kl']
  if data is not None:
    metrics['data_loss'], data_grads = data_loss_and_grad(apply_fn, params, sampler, traj, steps, data,
                                                          key)
    grads = accumulate(grads, data_grads, loss_scale * data.beta)
    total = total + data.beta * metrics['data_loss']
  total = loss_scale * total
  metrics['loss'] = total
  return total, metrics, grads


def _check_rl_options(old_mean, kl_beta, ref_params, kl_form, sampler):
  if old_mean not in options_lib.OLD_MEANS:
    raise ValueError(f"old_mean must be 'rollout' or 'detached', got {old_mean!r}")
  if kl_beta > 0 and ref_params is None:
    raise ValueError('kl_beta > 0 needs ref_params')
  if kl_form not in KL_FORMS:
    raise ValueError(f'kl_form must be one of {KL_FORMS}, got {kl_form!r}')
  if kl_beta > 0 and kl_form == 'flow_grpo':
    _require_flow_sde(sampler.kind)


def _require_flow_sde(sampler_kind):
  if sampler_kind != 'flow_sde':
    raise ValueError(f"kl_form='flow_grpo' divides by FlowGRPO's std_dev_t, which only the flow_sde "
                     f"sampler defines; this sampler is {sampler_kind!r} (use kl_form='exact')")


def flow_grpo_std_dev(sampler_kind, std, sigma_in, sigma_next):
  """FlowGRPO's std_dev_t: the flow_sde transition std without its sqrt(|dt|) factor.

  flow_grpo/diffusers_patch/sd3_sde_with_logprob.py (`sde_step_with_logprob`) samples with std
  std_dev_t * sqrt(-dt), std_dev_t = a sqrt(sigma / (1 - sigma~)), and returns std_dev_t, which
  scripts/train_sd3.py divides the KL by. Our flow_sde step stores std = std_dev_t * sqrt(sigma_in -
  sigma_next), so std_dev_t = std / sqrt(sigma_in - sigma_next). Only flow_sde has this quantity.

  Args:
    sampler_kind: the `Sampler.kind` that made the transitions.
    std, sigma_in, sigma_next: broadcastable (e.g. (B, N)) transition std and the step's two levels.
  Returns:
    std_dev_t, shaped like the broadcast of the inputs.
  """
  _require_flow_sde(sampler_kind)
  return std / jnp.sqrt(sigma_in - sigma_next)


def step_kl(mean_theta, mean_ref, std, sigma_in, sigma_next, sampler_kind, form='exact'):
  """Per-sample KL of one step to the reference, (B, N).

  Both forms average (mu_theta - mu_ref)^2 over the sample's elements (FlowGRPO's `.mean(dim=(1,2,3))`):
    'exact':     / (2 std^2), the KL of N(mu_theta, std^2 I) from N(mu_ref, std^2 I) per element;
    'flow_grpo': / (2 std_dev_t^2) (yifan123/flow_grpo scripts/train_sd3.py, its `kl_loss`; see its
                 issues #22 and #78), = 'exact' x |dt|.
  Args:
    mean_theta, mean_ref: (B, N, *S) step means.
    std, sigma_in, sigma_next: (B, N) transition std and levels (`Trajectory` fields).
    sampler_kind: the sampler's kind ('flow_grpo' needs 'flow_sde').
    form: one of KL_FORMS.
  """
  sq = ((mean_theta - mean_ref)**2).reshape(mean_ref.shape[:2] + (-1,)).mean(-1)
  if form == 'exact':
    scale = std
  elif form == 'flow_grpo':
    scale = flow_grpo_std_dev(sampler_kind, std, sigma_in, sigma_next)
  else:
    raise ValueError(f'kl_form must be one of {KL_FORMS}, got {form!r}')
  return sq / (2.0 * scale**2)


def sample_mean(per_sample, keep, total=None):
  """Mean of (B, N) per-sample terms over all samples (keep None) or over the kept ones: their sum over
  `total` (default: how many are kept here; the chunked update gives the whole batch's count over its
  number of chunks, module docstring)."""
  if keep is None:
    return per_sample.mean()
  total = keep.sum() if total is None else total
  return jnp.where(keep, per_sample, 0.0).sum() / jnp.maximum(total, 1)


def _policy_step(apply_fn, sampler, advantages, cond, params, pick, *, ref_params, clip_range,
                 log_ratio_form, kl_beta, old_mean, kl_form='exact', drop_zero_advantages=False,
                 pg_weight=1.0, mean_total=None):
  """One trained step's policy terms: (pg_weight * pg + kl_beta * kl, metrics of the step); pick as gather_steps'
  entries at one k ((B, N, ...) fields)."""
  inp = _step_inputs(pick)
  mean_theta = sampler.batched_step(apply_fn, params, inp, cond)[0]
  mean_old = pick['mean'] if old_mean == 'rollout' else jax.lax.stop_gradient(mean_theta)
  lr = policy.log_ratio(pick['x_next'], mean_theta, mean_old, pick['std'], log_ratio_form)
  pg, ratio, clipped = policy.clipped_policy_loss(advantages, lr, clip_range)
  keep = advantages != 0 if drop_zero_advantages else None
  out = dict(pg_loss=sample_mean(pg, keep, mean_total), ratio_mean=ratio.mean(),
             ratio_max_dev=jnp.abs(ratio - 1.0).max(), clipfrac=clipped.mean(),
             approx_kl=0.5 * (lr**2).mean())
  if keep is not None:
    out['kept_fraction'] = keep.mean()
  term = pg_weight * out['pg_loss']
  if kl_beta > 0:
    mean_ref = jax.lax.stop_gradient(sampler.batched_step(apply_fn, ref_params, inp, cond)[0])
    kl = step_kl(mean_theta, mean_ref, pick['std'], pick['sigma_in'], pick['sigma_next'], sampler.kind,
                 kl_form)
    out['kl'] = sample_mean(kl, keep, mean_total)
    term = term + kl_beta * out['kl']
  return term, out


def _step_metrics(per_step):
  """Means over the K steps of the per-step metrics (the max for ratio_max_dev)."""
  metrics = {k: v.mean() for k, v in per_step.items()}
  metrics['ratio_max_dev'] = per_step['ratio_max_dev'].max()
  return metrics


def ddrl_loss(apply_fn, params, sampler, traj, advantages, steps, cond, data, key, *,
              clip_range=1e-4, log_ratio_form='cosmos_rl', loss_scale=1.0, old_mean='rollout'):
  """DDRL (arXiv 2512.04332, Algorithm 1 as in cosmos-rl): clipped policy gradient + data_beta * diffusion
  loss on data paired with the conditions. No reference or old parameters. `data` is a `DataTerm`.

  Returns (loss, metrics) (`rl_loss`). jax.value_and_grad of it with respect to params computes the
  gradient one trained step at a time, as the trainer does (`per_step_vjp`)."""
  return rl_loss(apply_fn, params, sampler, traj, advantages, steps, cond, key, clip_range=clip_range,
                 log_ratio_form=log_ratio_form, data=data, loss_scale=loss_scale, old_mean=old_mean)


def flow_grpo_loss(apply_fn, params, ref_params, sampler, traj, advantages, steps, cond, key, *,
                   kl_beta=0.04, clip_range=1e-4, log_ratio_form='gaussian', loss_scale=1.0,
                   old_mean='rollout', kl_form='exact', drop_zero_advantages=False):
  """FlowGRPO: clipped policy gradient + kl_beta * per-step reverse KL to frozen reference parameters.

  kl_form='exact' (the default here, kept for existing callers) is the KL of the two equal-variance
  Gaussian steps, mean (mu_theta - mu_ref)^2 / (2 std^2) with the transition std; kl_form='flow_grpo' is
  FlowGRPO's code (yifan123/flow_grpo scripts/train_sd3.py), which divides by 2 std_dev_t^2 without the
  |dt| factor (its issues #22/#78), 1/|dt| weaker at the same kl_beta. The `flow_grpo` config preset uses
  kl_form='flow_grpo' and FlowGRPO's zero-advantage filter (drop_zero_advantages=True); see `rl_loss`."""
  return rl_loss(apply_fn, params, sampler, traj, advantages, steps, cond, key, clip_range=clip_range,
                 log_ratio_form=log_ratio_form, ref_params=ref_params, kl_beta=kl_beta,
                 loss_scale=loss_scale, old_mean=old_mean, kl_form=kl_form,
                 drop_zero_advantages=drop_zero_advantages)


def dance_grpo_loss(apply_fn, params, sampler, traj, advantages, steps, cond, key, *,
                    clip_range=1e-4, log_ratio_form='gaussian', loss_scale=1.0, old_mean='rollout'):
  """DanceGRPO: clipped policy gradient on a random subset of steps per sample; no KL, no data."""
  return rl_loss(apply_fn, params, sampler, traj, advantages, steps, cond, key, clip_range=clip_range,
                 log_ratio_form=log_ratio_form, loss_scale=loss_scale, old_mean=old_mean)


def ddpo_loss(apply_fn, params, sampler, traj, advantages, steps, cond, key, *,
              clip_range=1e-4, log_ratio_form='gaussian', loss_scale=1.0, old_mean='rollout'):
  """DDPO (DDIM eta=1 rollouts): clipped policy gradient over shuffled steps; no KL, no data."""
  return rl_loss(apply_fn, params, sampler, traj, advantages, steps, cond, key, clip_range=clip_range,
                 log_ratio_form=log_ratio_form, loss_scale=loss_scale, old_mean=old_mean)


# ------------------------------------------------------------------------------------------------
# Typed options and the registry (chosen by config.algorithm).


def every_other_step(num_steps):
  """cosmos-rl's DDRL default: 0, 2, ..., 18 of 20."""
  return tuple(range(0, num_steps - 1, 2))


def all_but_the_last(num_steps):
  """DanceGRPO / DDPO: every step but the last."""
  return tuple(range(max(1, num_steps - 1)))


def first_99_percent(num_steps):
  """FlowGRPO: the first int(0.99 T) steps (timestep_fraction 0.99)."""
  return tuple(range(max(1, int(0.99 * num_steps))))


def every_step(num_steps):
  return tuple(range(num_steps))


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """How an algorithm is wired, and its update: its default sampler, whether it holds a reference or uses
  data, how it picks trained steps ('fixed': the same list for every rollout; 'random': a random subset
  per rollout) and which (`default_steps(T)`), and its loss. This class is the clipped policy gradient on
  the stored trajectory (`rl_loss`: DDRL, FlowGRPO, DanceGRPO, DDPO); an algorithm with another objective
  subclasses it (DiffusionNFT, rl/nft.py) and is registered in rl/registry.py. The trainer calls only
  these methods: `loss_and_grad`, `init_old` / `update_old` (an old policy that samples the rollouts),
  `reference_passes` (FLOPs) and `problems` (config checks)."""
  name: str
  default_sampler: str
  uses_reference: bool
  uses_data: bool
  step_selection: str
  default_log_ratio: str
  default_steps: Any = all_but_the_last     # num_steps -> the default trained steps (or candidate pool)
  objective: str = 'clipped_pg'
  # Whether the loss trains the sampler's stochastic transitions (so a deterministic last step of
  # cosmos_2ab / ddim cannot be trained); False for objectives that re-noise clean samples.
  trains_transitions: bool = True
  CHECKED_KEYS: ClassVar[tuple] = ('kl_beta', 'kl_form')     # the rl keys `problems` checks

  def default_train_steps(self, num_steps):
    """Trained steps (fixed) or the candidate pool (random) when the config gives none."""
    return tuple(self.default_steps(num_steps))

  def select_steps(self, key, batch, num_rollouts, train_steps, fraction):
    """(B, N, K) int32 trained step indices."""
    pool = jnp.asarray(train_steps, jnp.int32)
    if self.step_selection == 'fixed':
      return jnp.broadcast_to(pool, (batch, num_rollouts, pool.shape[0]))
    k = max(1, int(len(train_steps) * fraction))
    keys = jax.random.split(key, batch * num_rollouts)
    perm = jax.vmap(lambda kk: jax.random.permutation(kk, pool))(keys)
    return perm[:, :k].reshape(batch, num_rollouts, k)

  # ------------------------------------------------------------------------- config checks
  def problems(self, rl, sampler_kind):
    """[(rl key, value, what is wrong)] of `rl` (RLOptions) for this algorithm with `sampler_kind`."""
    out = []
    if not self.uses_reference and rl.kl_beta != 0:
      out.append(('kl_beta', rl.kl_beta, f'{self.name} holds no reference model; only flow_grpo and '
                  'diffusion_nft use a KL'))
    if self.uses_reference and rl.kl_beta > 0 and rl.kl_form == 'flow_grpo' and sampler_kind != 'flow_sde':
      out.append(('kl_form', rl.kl_form, "FlowGRPO's KL divides by its std_dev_t, which only the flow_sde "
                  f"sampler defines; sampler.kind is {sampler_kind!r} (use rl.kl_form='exact')"))
    return out

  # ----------------------------------------------------------------------------- FLOPs
  def reference_passes(self, num_trained, kl_on):
    """Forward passes per rollout of frozen copies (the KL reference, an old policy): K with a KL."""
    return num_trained if self.uses_reference and kl_on else 0

  # ------------------------------------------------------------------------ old policy
  def init_old(self, params):
    """The old policy's parameters at step 0 (None: the algorithm keeps none)."""
    del params
    return None

  def update_old(self, old_params, params, step, options):
    """(old params after optimizer step `step`, metrics); unchanged without an old policy."""
    del params, step, options
    return old_params, {}

  # ------------------------------------------------------------------------------- loss
  def _options(self, ref_params, data, options):
    """rl_loss keyword arguments from `RLOptions`: the named losses' wiring."""
    if not isinstance(options, RLOptions):
      raise TypeError(f'{self.name}: options must be rl.RLOptions (RLOptions.from_mapping(config.rl)), '
                      f'got {type(options).__name__}')
    kw = dict(clip_range=options.clip_range, log_ratio_form=options.log_ratio or self.default_log_ratio,
              loss_scale=options.loss_scale, old_mean=options.old_mean,
              drop_zero_advantages=options.drop_zero_advantages, pg_weight=options.pg_weight)
    if self.uses_data:
      kw['data'] = data
    if self.uses_reference:
      kw.update(ref_params=ref_params, kl_beta=options.kl_beta, kl_form=options.kl_form)
    return kw

  def mean_total(self, advantages, valid, options, num_chunks):
    """What this algorithm's masked sample means divide by in each of `num_chunks` chunks of a batch with
    (B, N) `advantages` and `valid` samples (None: its means are plain means). The clipped policy
    gradient's mask is FlowGRPO's zero-advantage filter."""
    del valid
    if not options.drop_zero_advantages:
      return None
    return (advantages != 0).sum() / num_chunks

  # Metrics that are maxima, not means, over a batch's samples (the chunked update takes their max).
  MAX_METRICS: ClassVar[tuple] = ('ratio_max_dev',)

  def loss(self, apply_fn, params, ref_params, sampler, traj, advantages, steps, cond, data, key, options,
           *, old_params=None, valid=None, mean_total=None):
    """The algorithm's loss (`rl_loss`: the per-step gradient) with `options` (RLOptions). `old_params`
    and `valid` are for objectives that use them (the clipped policy gradient reads neither: the
    rollout's stored means are its old policy, and failed samples have advantage 0); `mean_total` is
    `self.mean_total`'s value for a chunk of a batch (None for a whole batch)."""
    del old_params, valid
    return rl_loss(apply_fn, params, sampler, traj, advantages, steps, cond, key,
                   mean_total=mean_total, **self._options(ref_params, data, options))

  def loss_and_grad(self, apply_fn, params, ref_params, sampler, traj, advantages, steps, cond, data, key,
                    options, *, old_params=None, valid=None, mean_total=None):
    """(loss, metrics, float32 grads): `loss` with the gradient accumulated per trained step."""
    del old_params, valid
    return rl_loss_and_grad(apply_fn, params, sampler, traj, advantages, steps, cond, key,
                            mean_total=mean_total, **self._options(ref_params, data, options))


# The clipped policy-gradient algorithms; rl/registry.py holds every algorithm (DiffusionNFT too).
CLIPPED_PG = {
    'ddrl': Algorithm('ddrl', 'cosmos_2ab', uses_reference=False, uses_data=True,
                      step_selection='fixed', default_log_ratio='cosmos_rl', default_steps=every_other_step),
    'flow_grpo': Algorithm('flow_grpo', 'flow_sde', uses_reference=True, uses_data=False,
                           step_selection='fixed', default_log_ratio='gaussian',
                           default_steps=first_99_percent),
    'dance_grpo': Algorithm('dance_grpo', 'dance_sde', uses_reference=False, uses_data=False,
                            step_selection='random', default_log_ratio='gaussian'),
    'ddpo': Algorithm('ddpo', 'ddim', uses_reference=False, uses_data=False,
                      step_selection='random', default_log_ratio='gaussian'),
}


def get_algorithm(name):
  """The registered algorithm `name` (rl/registry.py)."""
  from ddrl_jax.rl import registry  # pylint: disable=g-import-not-at-top
  return registry.get_algorithm(name)
