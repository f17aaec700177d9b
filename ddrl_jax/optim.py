"""Optimizer, gradient sanitizing and cosmos-rl's power EMA."""
import jax
import jax.numpy as jnp
import numpy as np
import optax


def learning_rate_schedule(optim):
  """Linear warmup from lr * warmup_init_factor to lr over warmup_steps, then constant (cosmos-rl)."""
  if optim.warmup_steps <= 0:
    return optax.constant_schedule(optim.learning_rate)
  return optax.join_schedules(
      [optax.linear_schedule(optim.learning_rate * optim.warmup_init_factor, optim.learning_rate,
                             optim.warmup_steps),
       optax.constant_schedule(optim.learning_rate)], [optim.warmup_steps])


def make_optimizer(optim):
  """Global-norm clipping then AdamW (weight decay on every parameter, as cosmos-rl's one group)."""
  return optax.chain(
      optax.clip_by_global_norm(optim.grad_clip),
      optax.adamw(learning_rate_schedule(optim), b1=optim.b1, b2=optim.b2, eps=optim.eps,
                  weight_decay=optim.weight_decay))


def zero_nonfinite(grads):
  """Sets NaN/Inf gradient entries to 0 (cosmos-rl's force_finite). Returns (grads, number zeroed)."""
  leaves = jax.tree.leaves(grads)
  count = sum(jnp.sum(~jnp.isfinite(g)) for g in leaves) if leaves else jnp.int32(0)
  return jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0.0), grads), count


def power_ema_gamma(s):
  """The exponent gamma of a power EMA of relative width s: largest real root of
  gamma^3 + 7 gamma^2 + (16 - s^-2) gamma + (12 - s^-2) = 0 (s = 0.1 gives ~6.94)."""
  roots = np.roots([1.0, 7.0, 16.0 - s**-2, 12.0 - s**-2])
  return float(roots[np.isreal(roots)].real.max())


def power_ema_beta(step, gamma):
  """beta(it) = (1 - 1/(it + 1))^(gamma + 1); 0 at it = 0 (the EMA starts at the parameters)."""
  step = jnp.asarray(step, jnp.float32)
  return (1.0 - 1.0 / (step + 1.0)) ** (gamma + 1.0)


def ema_update(ema, params, beta):
  return jax.tree.map(lambda e, p: beta * e + (1.0 - beta) * p, ema, params)
