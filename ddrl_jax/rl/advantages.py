"""Group-relative advantages. Rewards arrive flat, (B*N,), with the N rollouts of a group consecutive."""
import jax.numpy as jnp
from jax.scipy.special import logsumexp


def _grouped(rewards, group_size):
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim != 1 or rewards.shape[0] % group_size:
    raise ValueError(f'rewards must be (B*N,) with N={group_size} dividing it; got {rewards.shape}')
  return rewards.reshape(-1, group_size)


def fill_failed(rewards, group_size):
  """Replaces NaN rewards (failed samples) with their group's mean of valid rewards.

  Returns:
    (filled (B, N), valid (B, N) bool). A group with no valid reward is filled with 0.
  """
  r = _grouped(rewards, group_size)
  valid = jnp.isfinite(r)
  count = valid.sum(axis=1, keepdims=True)
  mean = jnp.where(valid, r, 0.0).sum(axis=1, keepdims=True) / jnp.maximum(count, 1)
  return jnp.where(valid, r, mean), valid


def group_advantages(rewards, group_size, *, clip=5.0, eps=1e-4, transform=None):
  """GRPO advantages as in cosmos-rl: A = (r - mean_g) / (std_g + eps), unbiased std, then clamp.

  Failed samples (NaN or infinite reward) are filled with the group's valid mean, so they get advantage
  exactly 0 and do not move the group's mean; count them with `(~jnp.isfinite(rewards)).sum()`.

  Args:
    rewards: (B*N,) rewards, groups consecutive.
    group_size: N (>= 2).
    clip: clamp |A| <= clip after the transform (None: no clamp).
    eps: added to the std.
    transform: None, or 'neg_exp' for the paper's lambda(A) = -exp(-A) (cosmos-rl `exp_reward`).
  Returns:
    (B*N,) float32 advantages.
  """
  if group_size < 2:
    raise ValueError(f'group_size must be >= 2 for a group std, got {group_size}')
  r, valid = fill_failed(rewards, group_size)
  mean = r.mean(axis=1, keepdims=True)
  std = r.std(axis=1, ddof=1, keepdims=True)
  adv = (r - mean) / (std + eps)
  if transform == 'neg_exp':
    adv = -jnp.exp(-adv)
  elif transform is not None:
    raise ValueError(f"unknown advantage transform {transform!r}; known: None, 'neg_exp'")
  if clip is not None:
    adv = jnp.clip(adv, -clip, clip)
  return jnp.where(valid, adv, 0.0).reshape(-1)


def exact_tilt_advantages(rewards, group_size, beta, log_partition=None):
  """The paper's exact transform: A = lambda((r - Z) / beta) = -exp(-(r - Z) / beta).

  With this A (and no clamp) the DDRL objective E[lambda((r - Z)/beta)] - KL(p_data || p_theta) is
  maximized by p*(x) ∝ p_data(x) exp(r(x)/beta) (Theorem 3.1), provided Z = beta log E_pdata[exp(r/beta)].

  Args:
    rewards: (B*N,), groups consecutive; NaN = failed (advantage 0).
    group_size: N.
    beta: temperature.
    log_partition: Z. None estimates it per group as beta * log mean exp(r / beta) over the valid rewards.
  Returns:
    (B*N,) float32 advantages (all <= 0).
  """
  r = _grouped(rewards, group_size)
  valid = jnp.isfinite(r)
  scaled = jnp.where(valid, r / beta, -jnp.inf)
  if log_partition is None:
    count = jnp.maximum(valid.sum(axis=1, keepdims=True), 1)
    z_over_beta = logsumexp(scaled, axis=1, keepdims=True) - jnp.log(count)
  else:
    z_over_beta = jnp.asarray(log_partition, jnp.float32) / beta
  adv = -jnp.exp(-(jnp.where(valid, scaled, 0.0) - z_over_beta))
  return jnp.where(valid, adv, 0.0).reshape(-1)


def multi_reward_advantages(rewards, weights, advantage_fn, combine='advantage_mean'):
  """Advantages of several rewards per sample.

  Args:
    rewards: (B*N, R) rewards, groups consecutive; a sample with any non-finite reward is failed for
      every reward (advantage 0), so all rewards see the same valid set.
    weights: (R,) positive weights.
    advantage_fn: (B*N,) rewards -> (B*N,) advantages (e.g. `group_advantages` with its options bound).
    combine: 'advantage_mean' (cosmos-rl: one advantage per reward, then sum_i w_i A_i / sum_i w_i) or
      'weighted_sum' (the advantage of sum_i w_i r_i).
  Returns:
    (B*N,) float32 advantages.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  weights = jnp.asarray(weights, jnp.float32)
  if rewards.ndim != 2 or rewards.shape[1] != weights.shape[0]:
    raise ValueError(f'rewards must be (B*N, R) with R = {weights.shape[0]} weights; got {rewards.shape}')
  failed = ~jnp.isfinite(rewards).all(axis=1, keepdims=True)
  rewards = jnp.where(failed, jnp.nan, rewards)
  if combine == 'weighted_sum':
    return advantage_fn(rewards @ weights)
  if combine != 'advantage_mean':
    raise ValueError(f"combine must be 'advantage_mean' or 'weighted_sum', got {combine!r}")
  per_reward = jnp.stack([advantage_fn(rewards[:, i]) for i in range(rewards.shape[1])], axis=1)
  return per_reward @ weights / weights.sum()
