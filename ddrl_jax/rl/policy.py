"""Log-probabilities, importance ratios and the PPO-clipped policy-gradient loss."""
import math

import jax.numpy as jnp

from ddrl_jax.rl.options import LOG_RATIO_FORMS
from ddrl_jax.rl.options import canonical


def _per_sample_mean(x, batch_ndim):
  return x.reshape(x.shape[:batch_ndim] + (-1,)).mean(axis=-1)


def gaussian_log_prob(x, mean, std, batch_ndim=1):
  """log N(x; mean, std^2), averaged over the non-batch elements (the convention of every diffusion-RL repo).

  Args:
    x, mean: (*batch, *S).
    std: scalar or (*batch,) (one std per sample).
    batch_ndim: number of leading batch axes.
  Returns:
    (*batch,) per-sample mean log-density.
  """
  std = jnp.asarray(std, jnp.float32)
  std = std.reshape(std.shape + (1,) * (x.ndim - std.ndim))
  log_density = -((x - mean)**2) / (2.0 * std**2) - jnp.log(std) - 0.5 * math.log(2.0 * math.pi)
  return _per_sample_mean(log_density, batch_ndim)


def log_ratio(x_next, mean_theta, mean_old, std, form='cosmos_rl', batch_ndim=2):
  """log pi_theta(x'|x) - log pi_old(x'|x) per sample.

  form='cosmos_rl' ('cosmos', its old name): cosmos-rl's unnormalized -mean[(x' - mu_theta)^2 -
    (x' - mu_old)^2] (no 1/(2 s^2); weights steps by sigma^2). form='gaussian': the normalized Gaussian
    log-prob ratio (same mean, divided by 2 s^2).
  Shapes: x_next, means (*batch, *S); std (*batch,). Returns (*batch,).
  """
  sq = _per_sample_mean((x_next - mean_theta)**2 - (x_next - mean_old)**2, batch_ndim)
  form = canonical(form)
  if form == 'cosmos_rl':
    return -sq
  if form == 'gaussian':
    return -sq / (2.0 * jnp.asarray(std)**2)
  raise ValueError(f'unknown log-ratio form {form!r}; known: {LOG_RATIO_FORMS}')


def clipped_policy_loss(advantages, log_ratios, clip_range):
  """PPO-clip surrogate per sample: max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = exp(log_ratio).

  Returns:
    (loss per sample, ratio, clipped indicator), each shaped like advantages.
  """
  ratio = jnp.exp(log_ratios)
  clipped_ratio = jnp.clip(ratio, 1.0 - clip_range, 1.0 + clip_range)
  loss = jnp.maximum(-advantages * ratio, -advantages * clipped_ratio)
  return loss, ratio, (jnp.abs(ratio - 1.0) > clip_range)
