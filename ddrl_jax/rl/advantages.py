"""Group-relative advantages. Rewards arrive flat, (B*N,), with the N rollouts of a group consecutive.

An advantage is built in three stages, in cosmos-rl's order (cosmos_rl/policy/trainer/wfm_trainer.py,
`rl_training_step`: the mean of the per-reward advantages, then `exp_reward`, then the clamp):

  1. normalize each reward within its group ('cosmos_rl' (old name 'cosmos'), 'flow_grpo' or 'dance_grpo', below);
  2. with several rewards, average the normalized rewards (`multi_reward_advantages`);
  3. transform (None or 'neg_exp': lambda(A) = -exp(-A)), clamp to [-clip, clip], and give failed samples
     their advantage (`finish_advantages`).

The normalizations, each as its cited code computes it:
  'cosmos_rl'  cosmos-rl (cosmos_rl/policy/model/wfm/models/t2v_model.py, `_sync_rewards_across_rollouts`):
               failed rewards replaced by the group's valid mean and kept in the statistics; group mean,
               torch's unbiased std, A = (r - mean) / (std + eps), eps = 1e-4.
  'flow_grpo'  FlowGRPO (yifan123/flow_grpo flow_grpo/stat_tracking.py, `PerPromptStatTracker.update`):
               the mean per prompt; the std (numpy's population std) either of the whole batch
               (`global_std=True`, the `general_ocr_sd3` config in config/grpo.py) or per prompt; + 1e-4.
  'dance_grpo' DanceGRPO (XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py, `train_one_step` with
               `use_group`): group mean, torch's unbiased std, + 1e-8.
FlowGRPO and DanceGRPO have no failed rewards; here a failed sample is left out of their statistics.
Where the reference arithmetic and this module differ, the function's docstring says how.
"""
import jax.numpy as jnp
from jax.scipy.special import logsumexp

from ddrl_jax.rl import options

NORMALIZATIONS = options.NORMALIZATIONS
TRANSFORMS = (None, 'neg_exp')
# How a failed sample's advantage is set: 'zero' gives A = 0 after the transform and clamp (the sample
# does not move the policy); 'transformed_zero' gives it lambda(0) (cosmos-rl: -exp(0) = -1 with neg_exp).
FAILED_MODES = options.FAILED_MODES


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


def cosmos_zscores(rewards, group_size, eps=1e-4):
  """cosmos-rl's per-group z-score (t2v_model.py, `_sync_rewards_across_rollouts`).

  Failed rewards are filled with the group's valid mean and stay in the std (which they shrink), as
  cosmos-rl fills them before its `gather_rewards.std()`. cosmos-rl's std runs over each reward gathered
  once per context-parallel rank (N * cp entries); here it runs over the N rollouts.

  Args:
    rewards: (B*N,) rewards, groups consecutive; NaN/Inf = failed.
    group_size: N (>= 2).
    eps: added to the std.
  Returns:
    (B*N,) float32 z-scores, exactly 0 at failed samples.
  """
  if group_size < 2:
    raise ValueError(f'group_size must be >= 2 for a group std, got {group_size}')
  r, valid = fill_failed(rewards, group_size)
  mean = r.mean(axis=1, keepdims=True)
  std = r.std(axis=1, ddof=1, keepdims=True)
  return jnp.where(valid, (r - mean) / (std + eps), 0.0).reshape(-1)


def _constant_groups(r, valid, same):
  """(B, 1) True where every valid reward of the prompt (the groups `same` marks) is equal."""
  hi = jnp.where(valid, r, -jnp.inf).max(axis=1)
  lo = jnp.where(valid, r, jnp.inf).min(axis=1)
  hi = jnp.where(same, hi[None, :], -jnp.inf).max(axis=1)
  lo = jnp.where(same, lo[None, :], jnp.inf).min(axis=1)
  return (hi <= lo)[:, None]


def flow_grpo_zscores(rewards, group_size, eps=1e-4, global_std=True, prompt_ids=None):
  """FlowGRPO's per-prompt stat tracker (flow_grpo/stat_tracking.py, `PerPromptStatTracker.update`).

  A = (r - mean_prompt) / (std + eps), with numpy's population std (ddof 0) of the whole batch
  (global_std=True, as FlowGRPO's `general_ocr_sd3` and the base config set `sample.global_std`) or of
  the prompt's samples. FlowGRPO groups by prompt string over the gathered batch; here each group is
  one prompt unless `prompt_ids` says that several groups share one (their samples then share the mean
  and the per-prompt std, as in FlowGRPO).

  Differences: FlowGRPO has no failed rewards; a failed sample is left out of every statistic and gets
  0. FlowGRPO computes in float64; a prompt whose valid rewards are all equal gets exactly 0 here, as
  FlowGRPO's float64 mean gives it (float32 round-off would leave ~1e-8 / eps).

  Args:
    rewards: (B*N,) rewards, groups consecutive; NaN/Inf = failed.
    group_size: N.
    eps: added to the std (FlowGRPO: 1e-4).
    global_std: the std of all valid rewards in the batch (True) or of the prompt's (False).
    prompt_ids: optional (B,) integer id of each group's prompt; None: every group its own prompt.
  Returns:
    (B*N,) float32 z-scores, 0 at failed samples.
  """
  r = _grouped(rewards, group_size)
  b = r.shape[0]
  valid = jnp.isfinite(r)
  if prompt_ids is None:
    same = jnp.eye(b, dtype=bool)
  else:
    ids = jnp.asarray(prompt_ids).reshape(-1)
    if ids.shape[0] != b:
      raise ValueError(f'prompt_ids must be (B,) = ({b},), one id per group; got {ids.shape}')
    same = ids[:, None] == ids[None, :]
  # Sums over the groups of each prompt, written elementwise (a float32 matmul may run at reduced
  # precision on accelerators).
  per_prompt = lambda per_group: jnp.where(same, per_group[None, :], 0.0).sum(axis=1)
  r0 = jnp.where(valid, r, 0.0)
  count = per_prompt(valid.sum(axis=1).astype(jnp.float32))          # (B,) valid samples per prompt
  mean = (per_prompt(r0.sum(axis=1)) / jnp.maximum(count, 1.0))[:, None]
  dev = jnp.where(valid & ~_constant_groups(r, valid, same), r - mean, 0.0)
  if global_std:
    n_all = jnp.maximum(valid.sum(), 1)
    batch_mean = r0.sum() / n_all
    std = jnp.sqrt(jnp.where(valid, (r - batch_mean)**2, 0.0).sum() / n_all)
  else:
    std = jnp.sqrt(per_prompt((dev**2).sum(axis=1)) / jnp.maximum(count, 1.0))[:, None]
  return (dev / (std + eps)).reshape(-1)


def dance_grpo_zscores(rewards, group_size, eps=1e-8):
  """DanceGRPO's group advantage (fastvideo/train_grpo_flux.py, `train_one_step`, `use_group`).

  A = (r - mean_g) / (std_g + eps) with torch's unbiased std over the group and eps = 1e-8.

  Differences: DanceGRPO has no failed rewards; a failed sample is left out of the statistics and gets
  0. A group whose valid rewards are all equal gets exactly 0 here; in DanceGRPO's float32 arithmetic
  the mean of equal values can be off by an ulp, and eps = 1e-8 turns that into O(1) advantages of one
  sign (e.g. 12 copies of 0.31 give A = 0.72 for every sample in numpy float32).

  Args:
    rewards: (B*N,) rewards, groups consecutive; NaN/Inf = failed.
    group_size: N (>= 2).
    eps: added to the std (DanceGRPO: 1e-8).
  Returns:
    (B*N,) float32 z-scores, 0 at failed samples.
  """
  if group_size < 2:
    raise ValueError(f'group_size must be >= 2 for a group std, got {group_size}')
  r = _grouped(rewards, group_size)
  valid = jnp.isfinite(r)
  count = valid.sum(axis=1, keepdims=True).astype(jnp.float32)
  mean = jnp.where(valid, r, 0.0).sum(axis=1, keepdims=True) / jnp.maximum(count, 1.0)
  constant = _constant_groups(r, valid, jnp.eye(r.shape[0], dtype=bool))
  dev = jnp.where(valid & ~constant, r - mean, 0.0)
  std = jnp.sqrt((dev**2).sum(axis=1, keepdims=True) / jnp.maximum(count - 1.0, 1.0))
  return (dev / (std + eps)).reshape(-1)


def normalized_rewards(rewards, group_size, normalization='cosmos_rl', *, eps=1e-4, global_std=True,
                       prompt_ids=None):
  """Stage 1: (B*N,) rewards -> (B*N,) z-scores by `normalization` (one of NORMALIZATIONS), 0 at failed
  samples. eps is the normalization's std offset; global_std and prompt_ids apply to 'flow_grpo' only."""
  normalization = options.canonical(normalization)
  if normalization == 'cosmos_rl':
    return cosmos_zscores(rewards, group_size, eps)
  if normalization == 'flow_grpo':
    return flow_grpo_zscores(rewards, group_size, eps, global_std, prompt_ids)
  if normalization == 'dance_grpo':
    return dance_grpo_zscores(rewards, group_size, eps)
  raise ValueError(f'unknown advantage normalization {normalization!r}; known: {NORMALIZATIONS}')


def finish_advantages(z, valid, *, transform=None, clip=5.0, failed='zero'):
  """Stage 3: transform, clamp and the failed-sample rule, in cosmos-rl's order (wfm_trainer.py,
  `rl_training_step`: `exp_reward`, then the clamp to [adv_clip_min, adv_clip_max]).

  Args:
    z: (...) normalized (and, for several rewards, averaged) rewards.
    valid: (...) bool, False for failed samples.
    transform: None or 'neg_exp' (lambda(A) = -exp(-A), cosmos-rl `exp_reward`).
    clip: clamp |A| <= clip after the transform (None: no clamp).
    failed: 'zero' (A = 0: a failed sample does not move the policy; the default here) or
      'transformed_zero' (cosmos-rl: a failed sample enters the transform with A = 0, so neg_exp gives it
      -1 and it is pushed down like a below-average sample).
  Returns:
    float32 advantages shaped like z.
  """
  if transform not in TRANSFORMS:
    raise ValueError(f"unknown advantage transform {transform!r}; known: None, 'neg_exp'")
  if failed not in FAILED_MODES:
    raise ValueError(f'unknown failed-sample rule {failed!r}; known: {FAILED_MODES}')
  adv = jnp.where(valid, jnp.asarray(z, jnp.float32), 0.0)
  if transform == 'neg_exp':
    adv = -jnp.exp(-adv)
  if clip is not None:
    adv = jnp.clip(adv, -clip, clip)
  return jnp.where(valid, adv, 0.0) if failed == 'zero' else adv


def group_advantages(rewards, group_size, *, clip=5.0, eps=1e-4, transform=None, normalization='cosmos_rl',
                     global_std=True, failed='zero', prompt_ids=None):
  """GRPO advantages of one reward: `normalized_rewards`, then `finish_advantages`.

  The defaults are cosmos-rl's: A = clamp((r - mean_g) / (std_g + 1e-4)), unbiased std, failed samples
  filled with the group's valid mean (they do not move it) and given A = 0; count them with
  `(~jnp.isfinite(rewards)).sum()`.

  Args:
    rewards: (B*N,) rewards, groups consecutive.
    group_size: N (>= 2).
    clip, transform, failed: as `finish_advantages`.
    eps, normalization, global_std, prompt_ids: as `normalized_rewards`.
  Returns:
    (B*N,) float32 advantages.
  """
  z = normalized_rewards(rewards, group_size, normalization, eps=eps, global_std=global_std,
                         prompt_ids=prompt_ids)
  valid = jnp.isfinite(jnp.asarray(rewards, jnp.float32))
  return finish_advantages(z, valid, transform=transform, clip=clip, failed=failed)


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


def multi_reward_advantages(rewards, weights, advantage_fn, combine='advantage_mean', *, transform=None,
                            clip=None, failed='zero'):
  """Advantages of several rewards per sample, in cosmos-rl's order.

  cosmos-rl (wfm_trainer.py, `rl_training_step`) averages the per-reward z-scores, then applies
  `exp_reward`, then the clamp. So does 'advantage_mean' here, with `advantage_fn` the per-reward
  normalization (e.g. `normalized_rewards` with its options bound) and the transform and clamp given
  here. Two differences: the mean is weighted, sum_i w_i A_i / sum_i w_i (cosmos-rl's is unweighted: the
  same for equal weights); and a sample with any failed reward is failed for every reward (cosmos-rl
  fills each reward's failures separately), so all rewards see the same valid set.

  Args:
    rewards: (B*N, R) rewards, groups consecutive; NaN/Inf = failed.
    weights: (R,) positive weights.
    advantage_fn: (B*N,) rewards -> (B*N,) normalized rewards, 0 at failed samples. (A function that
      transforms or clamps itself, such as `exact_tilt_advantages`, is used with transform=None.)
    combine: 'advantage_mean' (normalize each reward, then the weighted mean) or 'weighted_sum' (normalize
      sum_i w_i r_i).
    transform, clip, failed: applied after the combination, as in `finish_advantages`.
  Returns:
    (B*N,) float32 advantages.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  weights = jnp.asarray(weights, jnp.float32)
  if rewards.ndim != 2 or rewards.shape[1] != weights.shape[0]:
    raise ValueError(f'rewards must be (B*N, R) with R = {weights.shape[0]} weights; got {rewards.shape}')
  valid = jnp.isfinite(rewards).all(axis=1)
  rewards = jnp.where(valid[:, None], rewards, jnp.nan)
  if combine == 'weighted_sum':
    z = advantage_fn((rewards * weights).sum(axis=1))
  elif combine == 'advantage_mean':
    per_reward = jnp.stack([advantage_fn(rewards[:, i]) for i in range(rewards.shape[1])], axis=1)
    z = (per_reward * weights).sum(axis=1) / weights.sum()
  else:
    raise ValueError(f"combine must be 'advantage_mean' or 'weighted_sum', got {combine!r}")
  return finish_advantages(z, valid, transform=transform, clip=clip, failed=failed)
