"""The baseline presets against the arithmetic of the code they cite.

Each `_ref_*` function below is a numpy port of one reference computation, written from its public source
(not from ddrl_jax): yifan123/flow_grpo (flow_grpo/stat_tracking.py, scripts/train_sd3.py,
flow_grpo/diffusers_patch/sd3_sde_with_logprob.py), XueZeyue/DanceGRPO (fastvideo/train_grpo_flux.py) and
nvidia-cosmos/cosmos-rl (cosmos_rl/policy/model/wfm/models/t2v_model.py, cosmos_rl/policy/trainer/
wfm_trainer.py). The tests compare ddrl_jax's functions with them on small arrays.
"""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import common
from configs import ocr_tiny
from configs import toy2d
from ddrl_jax import config as config_lib
from ddrl_jax import flops
from ddrl_jax import rl
from ddrl_jax import sampling
from ddrl_jax import update

B, N, T = 3, 4, 6


# ------------------------------------------------------------------------------ reference ports
def _ref_flow_grpo_tracker(prompts, rewards, global_std):
  """PerPromptStatTracker.update(type='grpo') then clear(): per-prompt mean, np.std (+ 1e-4) of the
  batch or of the prompt, in float64."""
  prompts, rewards = np.asarray(prompts), np.asarray(rewards, np.float64)
  adv = np.zeros_like(rewards)
  for p in np.unique(prompts):
    mine = rewards[prompts == p]
    std = (np.std(rewards) if global_std else np.std(mine)) + 1e-4
    adv[prompts == p] = (mine - np.mean(mine)) / std
  return adv


def _ref_flow_grpo_keep(adv):
  """train_sd3.py: samples whose advantage is 0 at every time are removed before training."""
  return np.abs(adv) != 0


def _ref_flow_grpo_std_dev(sigmas, i, noise_level):
  """sde_step_with_logprob: std_dev_t = sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * a with
  sigma_max = sigmas[1]; the sample's noise is std_dev_t * sqrt(-dt)."""
  sigma = sigmas[i]
  return np.sqrt(sigma / (1 - (sigmas[1] if sigma == 1 else sigma))) * noise_level


def _ref_flow_grpo_kl(mean, mean_ref, std_dev_t):
  """train_sd3.py kl_loss: ((mu - mu_ref)^2).mean(dim=(1,2,3), keepdim) / (2 std_dev_t^2), then mean."""
  per = ((mean - mean_ref)**2).mean(axis=(1, 2, 3)) / (2 * std_dev_t**2)
  return per.mean()


def _ref_dance_grpo(rewards, num_generations, adv_clip_max=5.0):
  """train_one_step with use_group: per consecutive group (r - mean) / (torch std (unbiased) + 1e-8),
  clamped to +-adv_clip_max in the loss."""
  rewards = np.asarray(rewards, np.float64)
  adv = np.zeros_like(rewards)
  for i in range(len(rewards) // num_generations):
    g = rewards[i * num_generations:(i + 1) * num_generations]
    adv[i * num_generations:(i + 1) * num_generations] = (g - g.mean()) / (g.std(ddof=1) + 1e-8)
  return np.clip(adv, -adv_clip_max, adv_clip_max)


def _ref_cosmos_reward_advantage(group_rewards, group_valid):
  """t2v_model._sync_rewards_across_rollouts for one reward model and one rollout group: failed rewards
  (0 in the gather) replaced by sum / count of valid ones; advantage = (r - mean) / (torch std + 1e-4)."""
  gathered = np.where(group_valid, group_rewards, 0.0).astype(np.float64)
  mean_reward = gathered.sum() / group_valid.sum() if group_valid.sum() > 0 else 0.0
  gathered = np.where(group_valid, gathered, mean_reward)
  return (gathered - gathered.mean()) / (gathered.std(ddof=1) + 1e-4)


def _ref_cosmos_advantages(rewards, valid, n, exp_reward, clip=5.0):
  """wfm_trainer.rl_training_step: mean over reward models of their advantages, then exp_reward
  (A <- -exp(-A)), then the clamp. rewards, valid: (B*N, R)."""
  out = np.zeros(rewards.shape[0])
  for g in range(rewards.shape[0] // n):
    rows = slice(g * n, (g + 1) * n)
    per_model = [_ref_cosmos_reward_advantage(rewards[rows, i], valid[rows, i])
                 for i in range(rewards.shape[1])]
    adv = sum(per_model) / len(per_model)
    if exp_reward:
      adv = -np.exp(-adv)
    out[rows] = np.clip(adv, -clip, clip)
  return out


# ---------------------------------------------------------------------------------- KL forms
def test_flow_grpo_std_dev_is_the_reference_std_dev_t():
  s = sampling.make_sampler('flow_sde', T, shift=3.0, noise_level=0.7)
  sig = np.asarray(s.sigmas, np.float64)
  for i in range(T - 1):
    _, std = sampling.flow_sde_step(0.0, 0.0, sig[i], sig[i + 1], s.noise)
    got = float(rl.flow_grpo_std_dev('flow_sde', std, sig[i], sig[i + 1]))
    np.testing.assert_allclose(got, _ref_flow_grpo_std_dev(sig, i, 0.7), rtol=1e-6)
    # the transition std is std_dev_t * sqrt(|dt|)
    np.testing.assert_allclose(float(std), got * np.sqrt(sig[i] - sig[i + 1]), rtol=1e-6)
  for kind in ('cosmos_2ab', 'dance_sde', 'ddim'):
    with pytest.raises(ValueError, match='flow_sde'):
      rl.flow_grpo_std_dev(kind, 1.0, 0.5, 0.25)


def test_step_kl_forms_against_train_sd3():
  rng = np.random.RandomState(0)
  s = sampling.make_sampler('flow_sde', T, shift=3.0)
  sig = np.asarray(s.sigmas)
  mean = rng.randn(B, N, 2, 3, 3).astype(np.float32)
  mean_ref = mean + 0.1 * rng.randn(*mean.shape).astype(np.float32)
  for i in (0, 2, T - 2):
    _, std = sampling.flow_sde_step(0.0, 0.0, sig[i], sig[i + 1], s.noise)
    full = lambda a: jnp.full((B, N), a, jnp.float32)
    args = (mean, mean_ref, full(std), full(sig[i]), full(sig[i + 1]), 'flow_sde')
    got_fg = float(rl.step_kl(*args, form='flow_grpo').mean())
    want = _ref_flow_grpo_kl(mean.reshape(B * N, 2, 3, 3), mean_ref.reshape(B * N, 2, 3, 3),
                             _ref_flow_grpo_std_dev(sig, i, s.noise))
    np.testing.assert_allclose(got_fg, want, rtol=1e-5)
    # the exact Gaussian step KL is FlowGRPO's divided by |dt|
    got_exact = float(rl.step_kl(*args, form='exact').mean())
    np.testing.assert_allclose(got_exact, want / (sig[i] - sig[i + 1]), rtol=1e-5)
  with pytest.raises(ValueError, match='kl_form'):
    rl.step_kl(*args, form='k3')


def _flow_rollout(tiny_mlp, kind='flow_sde'):
  s = sampling.make_sampler(kind, T, shift=3.0)
  cond = jnp.linspace(-1.0, 1.0, B, dtype=jnp.float32).reshape(B, 1)
  traj = s.rollout(tiny_mlp.apply_fn, tiny_mlp.params, cond, jax.random.key(3), num_rollouts=N,
                   sample_shape=(2,))
  return s, traj, cond


def _perturbed(params, scale=0.1):
  rng = np.random.RandomState(5)
  return jax.tree.map(lambda a: a + jnp.asarray(scale * rng.randn(*a.shape), a.dtype), params)


def test_rl_loss_kl_form_flow_grpo_is_exact_times_dt(tiny_mlp):
  s, traj, cond = _flow_rollout(tiny_mlp)
  adv = jnp.asarray(np.random.RandomState(1).randn(B, N), jnp.float32)
  ref = _perturbed(tiny_mlp.params)
  sig = np.asarray(s.sigmas)
  for k in (0, 3):
    steps = jnp.full((B, N, 1), k, jnp.int32)
    kl = {}
    for form in rl.algorithms.KL_FORMS:
      _, m = rl.flow_grpo_loss(tiny_mlp.apply_fn, tiny_mlp.params, ref, s, traj, adv, steps, cond,
                               jax.random.key(0), kl_form=form)
      kl[form] = float(m['kl'])
    assert kl['exact'] > 0
    np.testing.assert_allclose(kl['flow_grpo'], kl['exact'] * (sig[k] - sig[k + 1]), rtol=1e-5)
  # kl_form='flow_grpo' needs flow_sde transitions
  s2, traj2, _ = _flow_rollout(tiny_mlp, 'dance_sde')
  with pytest.raises(ValueError, match='flow_sde'):
    rl.rl_loss(tiny_mlp.apply_fn, tiny_mlp.params, s2, traj2, adv, steps, cond, jax.random.key(0),
               clip_range=1e-4, ref_params=ref, kl_beta=0.04, kl_form='flow_grpo')
  with pytest.raises(ValueError, match='kl_form'):
    rl.rl_loss(tiny_mlp.apply_fn, tiny_mlp.params, s, traj, adv, steps, cond, jax.random.key(0),
               clip_range=1e-4, ref_params=ref, kl_beta=0.04, kl_form='k3')


def test_drop_zero_advantages_is_flow_grpo_filtered_mean(tiny_mlp):
  """With the ratio exactly 1 the per-sample loss is -A: FlowGRPO's mean over the kept samples is
  -sum(A) / kept, and the gradient is the unfiltered one times (B*N) / kept."""
  s, traj, cond = _flow_rollout(tiny_mlp)
  adv = np.random.RandomState(2).randn(B, N).astype(np.float32)
  adv[1] = 0.0                       # a zero-std group
  adv[2, 1] = 0.0
  keep = _ref_flow_grpo_keep(adv)
  steps = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (B, N, 3))
  ref = _perturbed(tiny_mlp.params)

  def loss(p, drop, kl_beta=0.0):
    return rl.rl_loss_reference(tiny_mlp.apply_fn, p, s, traj, jnp.asarray(adv), steps, cond,
                                jax.random.key(0), clip_range=1e-4, old_mean='detached',
                                drop_zero_advantages=drop, ref_params=ref, kl_beta=kl_beta,
                                kl_form='flow_grpo')

  (_, m_drop), g_drop = jax.value_and_grad(lambda p: loss(p, True), has_aux=True)(tiny_mlp.params)
  (_, m_all), g_all = jax.value_and_grad(lambda p: loss(p, False), has_aux=True)(tiny_mlp.params)
  np.testing.assert_allclose(float(m_drop['pg_loss']), -adv[keep].mean(), rtol=1e-6)
  np.testing.assert_allclose(float(m_all['pg_loss']), -adv.mean(), rtol=1e-6)
  np.testing.assert_allclose(float(m_drop['kept_fraction']), keep.mean())
  for a, b in zip(jax.tree.leaves(g_drop), jax.tree.leaves(g_all)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b) * adv.size / keep.sum(), rtol=1e-5,
                               atol=1e-8)
  # the KL, too, is averaged over the kept samples only
  _, m_kl = loss(tiny_mlp.params, True, kl_beta=0.04)
  _, m_kl_all = loss(tiny_mlp.params, False, kl_beta=0.04)
  assert float(m_kl['kl']) > 0 and abs(float(m_kl['kl']) - float(m_kl_all['kl'])) > 1e-9
  # rl_loss_and_grad agrees with jax.grad of rl_loss_reference with the filter on
  _, m2, g2 = rl.rl_loss_and_grad(tiny_mlp.apply_fn, tiny_mlp.params, s, traj, jnp.asarray(adv), steps,
                                  cond, jax.random.key(0), clip_range=1e-4, old_mean='detached',
                                  drop_zero_advantages=True)
  np.testing.assert_allclose(float(m2['pg_loss']), float(m_drop['pg_loss']), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g_drop)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)


# -------------------------------------------------------------------------------- advantages
def _rewards_with_zero_std_group(seed=0):
  r = np.random.RandomState(seed).rand(B * N).astype(np.float32)
  r[N:2 * N] = 0.75                   # a zero-std group (all rollouts scored the same)
  return r


@pytest.mark.parametrize('global_std', [True, False])
def test_flow_grpo_advantages_are_the_stat_tracker(global_std):
  r = _rewards_with_zero_std_group()
  prompts = np.repeat([f'prompt {g}' for g in range(B)], N)
  want = _ref_flow_grpo_tracker(prompts, r, global_std)
  got = np.asarray(rl.flow_grpo_zscores(r, N, global_std=global_std))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # the zero-std group gets exactly 0, so FlowGRPO's filter drops exactly its rollouts
  assert (got[N:2 * N] == 0).all() and (want[N:2 * N] == 0).all()
  np.testing.assert_array_equal(got != 0, _ref_flow_grpo_keep(want))
  # two groups with one prompt share its statistics (FlowGRPO groups by prompt string)
  prompts2 = np.repeat(['a', 'b', 'a'], N)
  got2 = np.asarray(rl.flow_grpo_zscores(r, N, global_std=global_std, prompt_ids=[0, 1, 0]))
  np.testing.assert_allclose(got2, _ref_flow_grpo_tracker(prompts2, r, global_std), rtol=1e-5,
                             atol=1e-6)


def test_flow_grpo_advantages_with_a_failed_sample():
  """FlowGRPO has no failed rewards: here a failed sample is left out of the statistics, gets 0 and
  is dropped by the zero-advantage filter like a zero-std group."""
  r = _rewards_with_zero_std_group(1)
  r[2 * N + 1] = np.nan
  prompts = np.repeat(np.arange(B), N)
  ok = np.isfinite(r)
  want = np.zeros(B * N)
  want[ok] = _ref_flow_grpo_tracker(prompts[ok], r[ok], True)
  got = np.asarray(rl.group_advantages(r, N, normalization='flow_grpo'))
  np.testing.assert_allclose(got, np.clip(want, -5, 5), rtol=1e-5, atol=1e-6)
  assert got[2 * N + 1] == 0.0


def test_dance_grpo_advantages():
  r = _rewards_with_zero_std_group(2)
  r[0] = 30.0                          # an outlier: the clamp at adv_clip_max = 5 is active
  want = _ref_dance_grpo(r, N)
  got = np.asarray(rl.group_advantages(r, N, eps=1e-8, normalization='dance_grpo'))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert (got[N:2 * N] == 0).all()
  # unbiased std: the population std would give another answer
  biased = np.clip((r[2 * N:] - r[2 * N:].mean()) / (r[2 * N:].std() + 1e-8), -5, 5)
  assert np.abs(got[2 * N:] - biased).max() > 1e-2
  # A group of equal values that float32 does not average exactly: DanceGRPO's 1e-8 eps would turn
  # the round-off into O(1) advantages of one sign (numpy float32: 0.72 for 12 copies of 0.31); here 0.
  equal = np.full(12, 0.31, np.float32)
  f32_mean = equal.mean(dtype=np.float32)
  assert (equal[0] - f32_mean) / (equal.std(ddof=1, dtype=np.float32) + 1e-8) > 0.5
  np.testing.assert_array_equal(np.asarray(rl.dance_grpo_zscores(equal, 12)), 0.0)


def test_dance_grpo_failed_sample_is_left_out():
  r = _rewards_with_zero_std_group(3)
  r[5] = np.nan
  got = np.asarray(rl.group_advantages(r, N, eps=1e-8, normalization='dance_grpo'))
  assert got[5] == 0.0
  np.testing.assert_array_equal(got[N:2 * N], 0.0)   # the other members are equal: still zero std
  np.testing.assert_allclose(got[:N], _ref_dance_grpo(r[:N], N), rtol=1e-5)
  np.testing.assert_allclose(got[2 * N:], _ref_dance_grpo(r[2 * N:], N), rtol=1e-5)


def _two_rewards(seed=0):
  rng = np.random.RandomState(seed)
  r = rng.randn(B * N, 2).astype(np.float32)
  r[:, 1] = 3.0 * r[:, 1] + 1.0
  r[2, 0] = -6.0                        # far below its group: -exp(-A) saturates the clamp
  r[N:2 * N, 0] = 0.5                   # zero std for reward 0 in group 1
  r[2 * N + 1] = np.nan                 # a failed sample (both rewards)
  return r


@pytest.mark.parametrize('exp_reward', [False, True])
def test_multi_reward_order_is_cosmos_rl(exp_reward):
  r = _two_rewards()
  valid = np.isfinite(r)
  want = _ref_cosmos_advantages(np.nan_to_num(r), valid, N, exp_reward)
  per_reward = lambda x: rl.normalized_rewards(x, N, 'cosmos')
  got = np.asarray(rl.multi_reward_advantages(
      r, [1.0, 1.0], per_reward, 'advantage_mean', transform='neg_exp' if exp_reward else None,
      clip=5.0, failed='transformed_zero'))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # cosmos-rl gives the failed sample A = 0 before exp_reward, i.e. -1 after it
  assert got[2 * N + 1] == (-1.0 if exp_reward else 0.0)
  # failed='zero' (the default) differs only there: the failed sample gets 0
  zero = np.asarray(rl.multi_reward_advantages(
      r, [1.0, 1.0], per_reward, 'advantage_mean', transform='neg_exp' if exp_reward else None,
      clip=5.0))
  np.testing.assert_array_equal(np.delete(zero, 2 * N + 1), np.delete(got, 2 * N + 1))
  assert zero[2 * N + 1] == 0.0
  if exp_reward:
    # the old order (transform and clamp per reward, then the mean) is a different number
    old = np.mean([np.asarray(rl.group_advantages(r[:, i], N, transform='neg_exp')) for i in (0, 1)],
                  axis=0)
    assert np.abs(old - zero).max() > 0.1


def test_compute_advantages_follows_the_config():
  c = toy2d.get_config('ddrl')
  c.reward.fns = ml_collections.ConfigDict({'a': 1.0, 'b': 1.0})
  c.rl.adv_transform, c.rl.failed_advantage = 'neg_exp', 'transformed_zero'
  r = _two_rewards(1)
  got = np.asarray(update.compute_advantages(jnp.asarray(r).reshape(B, N, 2), c)).reshape(-1)
  np.testing.assert_allclose(got, _ref_cosmos_advantages(np.nan_to_num(r), np.isfinite(r), N, True),
                             rtol=1e-5, atol=1e-5)
  # the flow_grpo preset: FlowGRPO's tracker (global std), clamped at 5
  c = toy2d.get_config('flow_grpo')
  r1 = _rewards_with_zero_std_group(4)
  got = np.asarray(update.compute_advantages(jnp.asarray(r1).reshape(B, N, 1), c)).reshape(-1)
  want = np.clip(_ref_flow_grpo_tracker(np.repeat(np.arange(B), N), r1, True), -5, 5)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # the dance_grpo preset: DanceGRPO's group advantage
  c = toy2d.get_config('dance_grpo')
  got = np.asarray(update.compute_advantages(jnp.asarray(r1).reshape(B, N, 1), c)).reshape(-1)
  np.testing.assert_allclose(got, _ref_dance_grpo(r1, N), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------ data term 'first'
def test_data_loss_first_is_cosmos_data_on_first_only(tiny_mlp):
  """cosmos-rl adds data_beta * L_data only at train_on[0] and divides every step's loss by
  K = len(train_on): the data gradient is data_beta / K times the single-step one."""
  s = sampling.make_sampler('cosmos_2ab', T)
  cond = jnp.linspace(-1.0, 1.0, B, dtype=jnp.float32).reshape(B, 1)
  traj = s.rollout(tiny_mlp.apply_fn, tiny_mlp.params, cond, jax.random.key(4), num_rollouts=N,
                   sample_shape=(2,))
  x0 = jnp.asarray(np.random.RandomState(0).randn(B, 2), jnp.float32)
  steps = jnp.broadcast_to(jnp.asarray([1, 3, 4], jnp.int32), (B, N, 3))
  k = steps.shape[-1]
  key = jax.random.key(9)
  term = lambda mode: rl.DataTerm(x0, cond, beta=0.01, steps=mode, cond_dropout=0.0)
  data_loss = lambda p, mode, st: rl.data_loss(tiny_mlp.apply_fn, p, s, traj, st, term(mode), key)
  first, g_first = jax.value_and_grad(data_loss)(tiny_mlp.params, 'first', steps)
  single, g_single = jax.value_and_grad(data_loss)(tiny_mlp.params, 'full', steps[..., :1])
  np.testing.assert_allclose(float(first), float(single) / k, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_first), jax.tree.leaves(g_single)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b) / k, rtol=1e-5, atol=1e-9)
  # data_loss_and_grad (the trainer's form) agrees
  value, grads = rl.data_loss_and_grad(tiny_mlp.apply_fn, tiny_mlp.params, s, traj, steps,
                                       term('first'), key)
  np.testing.assert_allclose(float(value), float(first), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(g_first)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-9)
  # the other steps do not matter: moving them leaves 'first' unchanged
  moved = steps.at[..., 1:].set(0)
  np.testing.assert_allclose(float(data_loss(tiny_mlp.params, 'first', moved)), float(first), rtol=1e-6)
  # the full loss: loss_scale * (mean_k pg_k + data_beta * L_first / K), cosmos-rl's sum over steps
  adv = jnp.asarray(np.random.RandomState(3).randn(B, N), jnp.float32)
  loss, m = rl.ddrl_loss(tiny_mlp.apply_fn, tiny_mlp.params, s, traj, adv, steps, cond, term('first'),
                         key, loss_scale=10.0)
  np.testing.assert_allclose(float(loss), 10.0 * (float(m['pg_loss']) + 0.01 * float(single) / k),
                             rtol=1e-5)
  # 'reduced' is the old name of 'random_step'
  np.testing.assert_array_equal(np.asarray(data_loss(tiny_mlp.params, 'reduced', steps)),
                                np.asarray(data_loss(tiny_mlp.params, 'random_step', steps)))
  with pytest.raises(ValueError, match='data loss steps'):
    term('last')


def test_data_term_steps_and_flops():
  assert [rl.algorithms.data_term_steps(m, 5) for m in ('full', 'first', 'random_step', 'reduced')] == \
      [5, 1, 1, 1]
  for preset, data in (('ddrl', 3 * 3), ('ddrl_reduced', 3), ('ddrl_reduced_random', 3)):
    c = toy2d.get_config(preset)
    c.sampler.num_steps = 6                    # ddrl trains steps 0, 2, 4: K = 3
    assert flops.iteration_passes(c).data == data, preset


# ---------------------------------------------------------------------------------- presets
def test_presets_carry_the_cited_values():
  fg = toy2d.get_config('flow_grpo').rl
  assert (fg.kl_beta, fg.kl_form, fg.adv_normalization, fg.adv_global_std, fg.adv_eps, fg.adv_clip,
          fg.clip_range, fg.drop_zero_advantages) == (0.04, 'flow_grpo', 'flow_grpo', True, 1e-4, 5.0,
                                                      1e-4, True)
  fx = toy2d.get_config('flow_grpo_exact_kl').rl
  assert fx.kl_form == 'exact' and fx.kl_beta == 0.04 and fx.adv_normalization == 'flow_grpo'
  dg = toy2d.get_config('dance_grpo').rl
  assert (dg.adv_normalization, dg.adv_eps, dg.adv_clip, dg.train_fraction, dg.kl_beta) == \
      ('dance_grpo', 1e-8, 5.0, 0.6, 0.0)
  assert toy2d.get_config('ddrl_reduced').rl.data_loss_steps == 'first'
  assert toy2d.get_config('ddrl_reduced_random').rl.data_loss_steps == 'random_step'
  assert toy2d.get_config('ddrl').rl.data_loss_steps == 'full'


@pytest.mark.parametrize('preset', common.PRESETS)
def test_every_preset_validates(preset):
  for make in (toy2d.get_config, ocr_tiny.get_config):
    config_lib.validate(make(preset), num_devices=1)


@pytest.mark.parametrize('key,value', [
    ('rl.kl_form', 'k3'), ('rl.adv_normalization', 'grpo'), ('rl.failed_advantage', 'nan'),
    ('rl.data_loss_steps', 'last'), ('rl.adv_eps', 0.0)])
def test_bad_new_keys_name_the_key(key, value):
  c = toy2d.get_config('flow_grpo')
  section, name = key.split('.')
  c[section][name] = value
  with pytest.raises(ValueError, match=key.replace('.', r'\.')):
    config_lib.validate(c, num_devices=1)


def test_flow_grpo_kl_form_needs_the_flow_sde_sampler():
  c = toy2d.get_config('flow_grpo')
  c.sampler.kind = 'dance_sde'
  with pytest.raises(ValueError, match=r'config\.rl\.kl_form.*flow_sde'):
    config_lib.validate(c, num_devices=1)
  c.rl.kl_form = 'exact'
  config_lib.validate(c, num_devices=1)
