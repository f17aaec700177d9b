"""The diffusion (data) loss in the velocity parameterization: DDRL's forward-KL regularizer."""
import jax
import jax.numpy as jnp

from ddrl_jax.rl.options import WEIGHTINGS


def cosmos_loss_weight(t):
  """cosmos-rl's data-loss weight in velocity form: EDM (sigma^2 + 1)/sigma^2 on x0-MSE = t^2 + (1-t)^2."""
  return t**2 + (1.0 - t)**2


def eps_mse_weight(t):
  """The DDRL paper's Algorithm 1 (an unweighted epsilon-MSE) in velocity form: eps_hat = x_t + (1 - t) v_hat,
  so |eps_hat - eps|^2 = (1 - t)^2 |v_hat - v|^2."""
  return (1.0 - t)**2


def drop_condition(cond, key, rate):
  """Replaces each sample's condition by zeros (the null condition) with probability `rate`.

  cond: pytree of (batch, ...) arrays. If it is a dict with a 'text' entry, only that entry is dropped
  (cosmos drops the text embedding but keeps image-to-video frames); otherwise every leaf is.
  key: one PRNG key, or (batch,) keys, one per sample (each sample's draw then depends on its key only).
  Returns the same structure.
  """
  leaves = jax.tree.leaves(cond)
  if rate <= 0 or not leaves:
    return cond
  if isinstance(cond, dict) and 'text' in cond:
    return {**cond, 'text': drop_condition(cond['text'], key, rate)}
  if key.ndim and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate))(key)
  else:
    keep = jax.random.bernoulli(key, 1.0 - rate, (leaves[0].shape[0],))
  return jax.tree.map(lambda c: jnp.where(keep.reshape((-1,) + (1,) * (c.ndim - 1)), c, 0).astype(c.dtype),
                      cond)


def velocity_loss(apply_fn, params, x0, noise, t, cond, weight=None):
  """Per-sample weighted velocity MSE at x_t = (1 - t) x0 + t noise, target v = noise - x0.

  Args:
    apply_fn: batched denoiser (params, x_t, t, cond) -> velocity.
    x0, noise: (batch, *S) clean data and standard-normal noise.
    t: (batch,) rectified-flow times in (0, 1).
    cond: pytree of (batch, ...) conditions.
    weight: (batch,) per-sample weight; None = cosmos' t^2 + (1 - t)^2.
  Returns:
    (batch,) weight * mean over elements of (v_theta - v)^2.
  """
  tb = t.reshape((-1,) + (1,) * (x0.ndim - 1))
  x_t = (1.0 - tb) * x0 + tb * noise
  v = apply_fn(params, x_t, t, cond)
  mse = ((v - (noise - x0))**2).reshape(x0.shape[0], -1).mean(axis=-1)
  return (cosmos_loss_weight(t) if weight is None else weight) * mse
