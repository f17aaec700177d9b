"""DiffusionNFT: negative-aware fine-tuning on the forward process (Zheng et al. 2025), as a pure loss.

Follows NVlabs/DiffusionNFT `scripts/train_nft_sd3.py` (the training loop) and `config/nft.py` (sd3_ocr),
the path cosmos-rl now runs for diffusion RL. Unlike the GRPO family it needs no trajectory and no
log-probabilities: only each rollout's clean sample x0, its reward, and three velocity predictions at a
forward-process point x_t = (1 - t) x0 + t eps with fresh noise (the rectified-flow convention of
`diffusion_loss.velocity_loss`; x0_hat = x_t - t v):

  v = v_theta(x_t), v_old = sg v_old(x_t)                        the "old" policy: an EMA of theta
  v+ = beta v + (1 - beta) v_old,  v- = (1 + beta) v_old - beta v   implicit positive / negative policies
  e+- = x_t - t v+- - x0                                          their x0-prediction errors
  w+- = sg max(mean |e+-|, 1e-5)                                  adaptive weight, per sample
  r = clip(clip(A, -a, a) / a / 2 + 1/2, 0, 1)                    optimality probability from the advantage
  L = mean_samples,t [ a (r mean(e+^2) / w+ + (1 - r) mean(e-^2) / w-) / beta ]
      + kl_beta mean_samples,t mean (v - v_ref)^2                  optional, to the frozen base

with a = adv_clip_max. Positive-reward samples pull v+ toward them, negative ones push v- toward them,
which moves theta away. The reference is CFG-free: run it with the task's guidance at 1 (the OCR preset's
default). The old policy samples the rollouts
and is updated after each optimizer step as old <- d old + (1 - d) theta with d = `old_decay(step)`.

Times: each rollout trains at K = int(T * train_fraction) of the sampler's T grid times (a random
permutation per rollout; the reference's `timestep_fraction` 0.99 of its 10 steps), with fresh noise per
time. The mean over times and samples is the reference's loss divided by its gradient-accumulation count.

Differences from the reference, kept on purpose: one optimizer step per rollout batch (sd3_ocr takes 2,
each on half of the epoch's samples), so `old_decay`'s step count, which is the reference's optimizer
steps, advances once per iteration here and twice per epoch there (its 75 flat steps are 37.5 rollout
epochs in sd3_ocr, 75 iterations here); the per-sample x0 weight is computed in float32 (the reference
uses float64). Failed samples (non-finite rewards; the reference has none) are left out of the means
through `valid`: with advantage 0 they would get r = 1/2, whose gradient pulls theta toward the old
policy rather than vanishing.
"""
import functools

import jax
import jax.numpy as jnp

from ddrl_jax.rl import algorithms

# DiffusionNFT's `return_decay` schedules of the old policy: (flat steps, rate per step, cap).
OLD_DECAY_SCHEDULES = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}


def old_decay(step, schedule):
  """EMA decay of the old policy after optimizer step `step` (int or () int array): 0 for the first
  `flat` steps (old = theta), then min((step - flat) * rate, cap). schedule: a key of
  OLD_DECAY_SCHEDULES (sd3_ocr uses 2, the other sd3 configs 1)."""
  if schedule not in OLD_DECAY_SCHEDULES:
    raise ValueError(f'nft old-policy decay schedule {schedule!r} unknown; known: '
                     f'{sorted(OLD_DECAY_SCHEDULES)}')
  flat, rate, cap = OLD_DECAY_SCHEDULES[schedule]
  step = jnp.asarray(step, jnp.float32)
  return jnp.where(step < flat, 0.0, jnp.minimum((step - flat) * rate, cap))


def update_old_params(old_params, params, decay):
  """old <- decay * old + (1 - decay) * params (leaves keep old_params' dtypes)."""
  return jax.tree.map(lambda o, p: (decay * o + (1.0 - decay) * p).astype(o.dtype), old_params, params)


def optimality_weights(advantages, adv_clip_max):
  """(...) advantages -> r in [0, 1]: the advantage clipped to +-adv_clip_max, mapped linearly so that
  A = 0 gives 1/2 and A = +-adv_clip_max gives 1 / 0."""
  if not adv_clip_max > 0:
    raise ValueError(f'adv_clip_max must be > 0, got {adv_clip_max!r}')
  clipped = jnp.clip(advantages, -adv_clip_max, adv_clip_max)
  return jnp.clip(clipped / adv_clip_max / 2.0 + 0.5, 0.0, 1.0)


def _per_sample_mean(a):
  return a.reshape(a.shape[0], -1).mean(axis=-1)


def step_loss(apply_fn, params, old_params, ref_params, x0, t, noise, cond, r, *, beta, adv_clip_max,
              kl_beta=0.0, valid=None, mean_total=None):
  """The loss at one forward-process time per sample, and its metrics.

  Args:
    apply_fn: batched denoiser (params, x_t, t, cond) -> velocity.
    params, old_params, ref_params: trained, old-policy and reference parameters (ref_params may be None
      when kl_beta == 0). old and ref predictions are under stop_gradient.
    x0: (M, *S) clean rollout samples; t: (M,) times in (0, 1]; noise: (M, *S) standard normal.
    cond: pytree of (M, ...) conditions; r: (M,) optimality weights (`optimality_weights`).
    beta: the NFT mixing strength (> 0); adv_clip_max: the advantage clip (the loss is scaled by it);
    kl_beta: weight of the velocity MSE to the reference.
    valid: (M,) bool, samples that count (None: all); the means run over them (0 if none).
    mean_total: what those means divide by (None: the valid count; a chunk of a batch gives the batch's
      count over its number of chunks, `algorithms.sample_mean`).
  Returns:
    (scalar loss, dict of scalar metrics).
  """
  if not beta > 0:
    raise ValueError(f'nft beta must be > 0, got {beta!r}')
  if kl_beta > 0 and ref_params is None:
    raise ValueError('nft kl_beta > 0 needs ref_params')
  tb = t.reshape((-1,) + (1,) * (x0.ndim - 1))
  if valid is not None:     # a failed sample may be non-finite: a NaN would reach the gradient through 0 x NaN
    x0 = jnp.where(valid.reshape(tb.shape), x0, 0.0).astype(x0.dtype)
  x_t = (1.0 - tb) * x0 + tb * noise
  v = apply_fn(params, x_t, t, cond).astype(jnp.float32)
  v_old = jax.lax.stop_gradient(apply_fn(old_params, x_t, t, cond).astype(jnp.float32))
  v_pos = beta * v + (1.0 - beta) * v_old
  v_neg = (1.0 + beta) * v_old - beta * v
  err_pos = x_t - tb * v_pos - x0
  err_neg = x_t - tb * v_neg - x0
  w_pos = jax.lax.stop_gradient(jnp.maximum(_per_sample_mean(jnp.abs(err_pos)), 1e-5))
  w_neg = jax.lax.stop_gradient(jnp.maximum(_per_sample_mean(jnp.abs(err_neg)), 1e-5))
  positive = _per_sample_mean(err_pos**2) / w_pos
  negative = _per_sample_mean(err_neg**2) / w_neg
  per_sample = (r * positive + (1.0 - r) * negative) / beta
  mean = lambda per_sample: algorithms.sample_mean(per_sample, valid, mean_total)
  policy = mean(per_sample * adv_clip_max)
  metrics = dict(nft_policy_loss=policy, nft_unweighted_loss=mean(per_sample),
                 nft_old_deviation=mean(_per_sample_mean((v - v_old)**2)), nft_r_mean=mean(r))
  loss = policy
  if kl_beta > 0:
    v_ref = jax.lax.stop_gradient(apply_fn(ref_params, x_t, t, cond).astype(jnp.float32))
    kl = mean(_per_sample_mean((v - v_ref)**2))
    metrics['kl'] = kl
    loss = loss + kl_beta * kl
  return loss, metrics


def _flat(a):
  return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def _step_args(traj, advantages, cond, step_k, keys, adv_clip_max):
  """step_loss's (x0, t, noise, cond, r) at one trained step per rollout (step_k (B, N); keys (B, N), the
  step's per-slot keys), as (B*N, ...)."""
  x0 = _flat(traj.x0)
  t = _flat(jnp.take_along_axis(traj.t_in, step_k[..., None], axis=2)[..., 0])
  noise = jax.vmap(lambda k: jax.random.normal(k, x0.shape[1:], jnp.float32))(_flat(keys)).astype(x0.dtype)
  return x0, t, noise, cond, _flat(optimality_weights(advantages, adv_clip_max))


def nft_loss(apply_fn, params, old_params, ref_params, traj, advantages, steps, cond, key, *, beta,
             adv_clip_max, kl_beta=0.0, loss_scale=1.0, valid=None, mean_total=None):
  """DiffusionNFT's loss over the K trained times of every rollout (the reference form: jax.grad of it
  keeps all K steps' residuals).

  Args: traj `Trajectory` (B, N, ...) (only x0 and t_in are read), advantages (B, N), steps (B, N, K)
    indices into the sampler's T steps, cond pytree of (B*N, ...) slot conditions, key PRNG key or (B, N)
    per-slot keys (`algorithms.slot_keys`: the fresh noise, one draw per slot and trained step), valid
    (B, N) bool or None (failed samples False); the rest as `step_loss`.
  Returns: (loss, metrics): means over the K steps.
  """
  keys = algorithms.split_slot_keys(algorithms.slot_keys(key, *steps.shape[:2]), steps.shape[-1])
  step = functools.partial(step_loss, apply_fn, beta=beta, adv_clip_max=adv_clip_max, kl_beta=kl_beta,
                           valid=None if valid is None else valid.reshape(-1), mean_total=mean_total)

  def body(_, xs):
    step_k, k = xs
    return None, step(params, old_params, ref_params,
                      *_step_args(traj, advantages, cond, step_k, k, adv_clip_max))

  _, (losses, metrics) = jax.lax.scan(body, None, (jnp.moveaxis(steps, -1, 0), keys))
  metrics = {k: v.mean() for k, v in metrics.items()}
  metrics['loss'] = loss_scale * losses.mean()
  return metrics['loss'], metrics


def nft_loss_and_grad(apply_fn, params, old_params, ref_params, traj, advantages, steps, cond, key, *,
                      beta, adv_clip_max, kl_beta=0.0, loss_scale=1.0, valid=None, mean_total=None):
  """`nft_loss` with its gradient accumulated one trained time at a time (activation memory independent
  of K). Returns (loss, metrics, float32 grads with the structure of params); equal to jax.grad of
  nft_loss up to float summation order (the same noise draws)."""
  num_k = steps.shape[-1]
  keys = algorithms.split_slot_keys(algorithms.slot_keys(key, *steps.shape[:2]), num_k)
  step = functools.partial(step_loss, apply_fn, beta=beta, adv_clip_max=adv_clip_max, kl_beta=kl_beta,
                           valid=None if valid is None else valid.reshape(-1), mean_total=mean_total)

  def body(acc, xs):
    step_k, k = xs
    args = _step_args(traj, advantages, cond, step_k, k, adv_clip_max)
    (value, metrics), grads = jax.value_and_grad(
        lambda p: step(p, old_params, ref_params, *args), has_aux=True)(params)
    acc = algorithms.accumulate(acc, grads, loss_scale / num_k)
    return acc, (value, metrics)

  grads, (losses, metrics) = jax.lax.scan(body, algorithms.f32_zeros(params), (jnp.moveaxis(steps, -1, 0), keys))
  metrics = {k: v.mean() for k, v in metrics.items()}
  metrics['loss'] = loss_scale * losses.mean()
  return metrics['loss'], metrics, grads



class DiffusionNFT(algorithms.Algorithm):
  """DiffusionNFT as an `Algorithm`: its forward-process loss on the rollouts' clean samples (`nft_loss`),
  an old policy (an EMA of the trained one, `old_decay`) that samples the rollouts, and the reference's
  KL at every trained time. CFG-free; only the clean samples and the sampler's time grid are used."""

  CHECKED_KEYS = ('nft_beta', 'nft_old_decay', 'adv_clip')

  def problems(self, rl, sampler_kind):
    del sampler_kind                 # the loss re-noises clean samples: any sampler's grid will do
    out = []
    if not rl.nft_beta > 0:
      out.append(('nft_beta', rl.nft_beta, 'must be > 0'))
    if rl.nft_old_decay not in OLD_DECAY_SCHEDULES:
      out.append(('nft_old_decay', rl.nft_old_decay, f'known schedules: {sorted(OLD_DECAY_SCHEDULES)}'))
    if rl.adv_clip is None or not rl.adv_clip > 0:
      out.append(('adv_clip', rl.adv_clip, 'diffusion_nft maps advantages in [-adv_clip, adv_clip] to [0, 1]; '
                  'must be > 0'))
    return out

  def reference_passes(self, num_trained, kl_on):
    """The old policy's forward at every trained time, and the reference's with a KL."""
    return num_trained + super().reference_passes(num_trained, kl_on)

  def init_old(self, params):
    return jax.tree.map(jnp.array, params)

  def update_old(self, old_params, params, step, options):
    decay = old_decay(step + 1, options.nft_old_decay)
    return update_old_params(old_params, params, decay), {'nft_old_decay': decay}

  def _kwargs(self, options):
    return dict(beta=options.nft_beta, adv_clip_max=options.adv_clip, kl_beta=options.kl_beta,
                loss_scale=options.loss_scale)

  def mean_total(self, advantages, valid, options, num_chunks):
    """The valid-sample count of the batch over `num_chunks` (the means run over valid samples)."""
    del advantages, options
    return None if valid is None else valid.sum() / num_chunks

  MAX_METRICS = ()

  def loss(self, apply_fn, params, ref_params, sampler, traj, advantages, steps, cond, data, key, options,
           *, old_params=None, valid=None, mean_total=None):
    del sampler, data
    return nft_loss(apply_fn, params, old_params, ref_params, traj, advantages, steps, cond, key,
                    valid=valid, mean_total=mean_total, **self._kwargs(options))

  def loss_and_grad(self, apply_fn, params, ref_params, sampler, traj, advantages, steps, cond, data, key,
                    options, *, old_params=None, valid=None, mean_total=None):
    del sampler, data
    return nft_loss_and_grad(apply_fn, params, old_params, ref_params, traj, advantages, steps, cond, key,
                             valid=valid, mean_total=mean_total, **self._kwargs(options))


DIFFUSION_NFT = DiffusionNFT('diffusion_nft', 'flow_sde', uses_reference=True, uses_data=False,
                             step_selection='random', default_log_ratio='gaussian',
                             default_steps=algorithms.every_step, objective='nft', trains_transitions=False)
