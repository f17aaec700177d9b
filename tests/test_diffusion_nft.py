"""DiffusionNFT (ddrl_jax/rl/nft.py) against the arithmetic of NVlabs/DiffusionNFT scripts/train_nft_sd3.py,
ported here in numpy, and against closed forms of its gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddrl_jax.rl import nft
from ddrl_jax.sampling import samplers


def linear_apply(params, x_t, t, cond):
  """A velocity model linear in its parameters: v = x_t @ W + t b + cond @ C (per sample rows)."""
  flat = x_t.reshape(x_t.shape[0], -1)
  v = flat @ params['w'] + t[:, None] * params['b'] + cond @ params['c']
  return v.reshape(x_t.shape)


def make_params(key, dim, cond_dim, scale=0.3):
  kw, kb, kc = jax.random.split(key, 3)
  return {'w': scale * jax.random.normal(kw, (dim, dim)), 'b': jax.random.normal(kb, (dim,)),
          'c': scale * jax.random.normal(kc, (cond_dim, dim))}


def reference_step_loss(v, v_old, v_ref, x0, x_t, t, adv, beta, adv_clip_max, kl_beta):
  """The reference's per-time loss on numpy arrays, step by step as train_nft_sd3.py computes it
  (advantages clamped, mapped to r; positive/implicit negative predictions; x0 errors over adaptive
  per-sample weights; policy loss times adv_clip_max; plus train.beta times the mean velocity MSE)."""
  axes = tuple(range(1, x0.ndim))
  a = np.clip(adv, -adv_clip_max, adv_clip_max)
  r = np.clip(a / adv_clip_max / 2.0 + 0.5, 0, 1)
  te = t.reshape((-1,) + (1,) * (x0.ndim - 1))
  pos_pred = beta * v + (1 - beta) * v_old
  neg_pred = (1.0 + beta) * v_old - beta * v
  x0_pos = x_t - te * pos_pred
  w_pos = np.clip(np.abs(x0_pos.astype(np.float64) - x0).mean(axis=axes, keepdims=True), 1e-5, None)
  pos_loss = ((x0_pos - x0)**2 / w_pos).mean(axis=axes)
  x0_neg = x_t - te * neg_pred
  w_neg = np.clip(np.abs(x0_neg.astype(np.float64) - x0).mean(axis=axes, keepdims=True), 1e-5, None)
  neg_loss = ((x0_neg - x0)**2 / w_neg).mean(axis=axes)
  ori = r * pos_loss / beta + (1.0 - r) * neg_loss / beta
  loss = (ori * adv_clip_max).mean()
  kl = ((v - v_ref)**2).mean(axis=axes).mean()
  return loss + kl_beta * kl


@pytest.fixture(name='problem')
def fixture_problem():
  m, dim, cond_dim = 12, 6, 3
  keys = jax.random.split(jax.random.key(0), 8)
  params = make_params(keys[0], dim, cond_dim)
  old = jax.tree.map(lambda p, d: p + 0.05 * d, params, make_params(keys[1], dim, cond_dim))
  ref = jax.tree.map(lambda p, d: p + 0.1 * d, params, make_params(keys[2], dim, cond_dim))
  x0 = jax.random.normal(keys[3], (m, 2, 3))
  noise = jax.random.normal(keys[4], (m, 2, 3))
  t = jax.random.uniform(keys[5], (m,), minval=0.05, maxval=1.0)
  cond = jax.random.normal(keys[6], (m, cond_dim))
  adv = 4.0 * jax.random.normal(keys[7], (m,))      # some beyond the clip of 5
  return dict(params=params, old=old, ref=ref, x0=x0, noise=noise, t=t, cond=cond, adv=adv)


@pytest.mark.parametrize('beta,kl_beta', [(1.0, 0.0), (0.1, 1e-4), (0.5, 0.3)])
def test_step_loss_matches_the_reference_arithmetic(problem, beta, kl_beta):
  p = problem
  loss, metrics = nft.step_loss(linear_apply, p['params'], p['old'], p['ref'], p['x0'], p['t'],
                                p['noise'], p['cond'], nft.optimality_weights(p['adv'], 5.0),
                                beta=beta, adv_clip_max=5.0, kl_beta=kl_beta)
  tb = np.asarray(p['t'])[:, None, None]
  x_t = (1 - tb) * np.asarray(p['x0']) + tb * np.asarray(p['noise'])
  v, v_old, v_ref = (np.asarray(linear_apply(q, jnp.asarray(x_t), p['t'], p['cond']), np.float64)
                     for q in (p['params'], p['old'], p['ref']))
  want = reference_step_loss(v, v_old, v_ref, np.asarray(p['x0'], np.float64), x_t,
                             np.asarray(p['t'], np.float64), np.asarray(p['adv'], np.float64), beta,
                             5.0, kl_beta)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  assert ('kl' in metrics) == (kl_beta > 0)


def test_optimality_weights():
  a = jnp.array([-100.0, -5.0, -2.5, 0.0, 2.5, 5.0, 7.0])
  np.testing.assert_allclose(nft.optimality_weights(a, 5.0), [0, 0, 0.25, 0.5, 0.75, 1, 1])
  with pytest.raises(ValueError, match='adv_clip_max'):
    nft.optimality_weights(a, 0.0)


def test_old_decay_schedules():
  # sd3_ocr's schedule 2: old = theta for the first 75 steps, then +0.0075 per step up to 0.999.
  steps = jnp.array([0, 74, 75, 76, 100, 208, 1000])
  np.testing.assert_allclose(nft.old_decay(steps, 2), [0, 0, 0, 0.0075, 0.1875, 0.9975, 0.999],
                             rtol=1e-6)
  np.testing.assert_allclose(nft.old_decay(jnp.array([0, 10, 600]), 1), [0, 0.01, 0.5], rtol=1e-6)
  np.testing.assert_allclose(nft.old_decay(jnp.array([0, 500]), 0), [0, 0])
  with pytest.raises(ValueError, match='decay schedule'):
    nft.old_decay(0, 3)
  old = {'w': jnp.ones((2,))}
  new = {'w': jnp.zeros((2,))}
  np.testing.assert_allclose(nft.update_old_params(old, new, 0.25)['w'], [0.25, 0.25])


@pytest.mark.parametrize('r_value,sign', [(1.0, 1.0), (0.0, -1.0), (0.5, 0.0)])
def test_gradient_at_old_equals_policy_is_a_weighted_x0_regression(problem, r_value, sign):
  """With old = theta (the first 75 iterations of sd3_ocr), v+ and v- both equal v in value and move
  with +-beta, so for any beta the gradient is (2r - 1) a times the gradient of mean((x_t - t v - x0)^2)/w
  with w the (detached) mean |x0 error|: regression onto the sample for r = 1, away from it for r = 0,
  nothing at r = 1/2."""
  p = problem
  m = p['x0'].shape[0]
  r = jnp.full((m,), r_value)
  tb = p['t'][:, None, None]
  x_t = (1 - tb) * p['x0'] + tb * p['noise']

  def regression(params):
    err = x_t - tb * linear_apply(params, x_t, p['t'], p['cond']) - p['x0']
    w = jax.lax.stop_gradient(jnp.abs(err).reshape(m, -1).mean(-1))
    return ((err**2).reshape(m, -1).mean(-1) / w).mean()

  want = jax.tree.map(lambda g: sign * 5.0 * g, jax.grad(regression)(p['params']))
  for beta in (1.0, 0.1):
    got = jax.grad(lambda q: nft.step_loss(linear_apply, q, p['params'], None, p['x0'], p['t'],
                                           p['noise'], p['cond'], r, beta=beta,
                                           adv_clip_max=5.0)[0])(p['params'])
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-4)


def test_loss_and_grad_equals_grad_of_the_loss(problem):
  p = problem
  b, n, k = 3, 4, 3
  num_steps = 5
  times = jnp.linspace(1.0, 0.2, num_steps)
  shape = p['x0'].shape[1:]
  traj = samplers.Trajectory(
      x_in=None, x0_prev=None, mean=None, x_next=None, step=None, sigma_in=None, sigma_next=None,
      sigma_prev=None, std=None, noise=None, nfe=None,
      t_in=jnp.broadcast_to(times, (b, n, num_steps)), x0=p['x0'].reshape((b, n) + shape))
  steps = jax.vmap(lambda kk: jax.random.permutation(kk, num_steps)[:k])(
      jax.random.split(jax.random.key(3), b * n)).reshape(b, n, k)
  adv = p['adv'].reshape(b, n)
  kw = dict(beta=0.1, adv_clip_max=5.0, kl_beta=0.01, loss_scale=2.0)
  key = jax.random.key(9)
  loss, metrics = nft.nft_loss(linear_apply, p['params'], p['old'], p['ref'], traj, adv, steps,
                               p['cond'], key, **kw)
  loss2, metrics2, grads = nft.nft_loss_and_grad(linear_apply, p['params'], p['old'], p['ref'], traj,
                                                 adv, steps, p['cond'], key, **kw)
  want = jax.grad(lambda q: nft.nft_loss(linear_apply, q, p['old'], p['ref'], traj, adv, steps,
                                         p['cond'], key, **kw)[0])(p['params'])
  np.testing.assert_allclose(loss, loss2, rtol=1e-6)
  assert set(metrics) == set(metrics2)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  # The loss is the mean over the K drawn times of step_loss at those times: fresh noise per time and
  # slot, slot i's from the j-th split of its own key (the i-th split of `key`).
  slot_keys = jax.random.split(key, b * n)
  per_step = []
  for j in range(k):
    t = jnp.take_along_axis(traj.t_in, steps[..., j:j + 1], axis=2)[..., 0].reshape(-1)
    noise = jnp.stack([jax.random.normal(jax.random.split(slot_keys[i], k)[j], shape)
                       for i in range(b * n)])
    per_step.append(nft.step_loss(linear_apply, p['params'], p['old'], p['ref'], p['x0'], t, noise,
                                  p['cond'], nft.optimality_weights(adv.reshape(-1), 5.0), beta=0.1,
                                  adv_clip_max=5.0, kl_beta=0.01)[0])
  np.testing.assert_allclose(loss, 2.0 * np.mean(per_step), rtol=1e-5)


def test_bad_options_raise(problem):
  p = problem
  r = jnp.full((p['x0'].shape[0],), 0.5)
  with pytest.raises(ValueError, match='beta must be > 0'):
    nft.step_loss(linear_apply, p['params'], p['old'], None, p['x0'], p['t'], p['noise'], p['cond'], r,
                  beta=0.0, adv_clip_max=5.0)
  with pytest.raises(ValueError, match='needs ref_params'):
    nft.step_loss(linear_apply, p['params'], p['old'], None, p['x0'], p['t'], p['noise'], p['cond'], r,
                  beta=1.0, adv_clip_max=5.0, kl_beta=1e-4)


@pytest.mark.slow
def test_diffusion_nft_trains_through_the_trainer(tmp_path):
  """The real loop on the toy task: rollouts sampled by the old policy, rewards, the NFT update, and the
  old policy moved toward the new parameters by its schedule after every optimizer step."""
  from configs import toy2d as toy_config  # pylint: disable=import-outside-toplevel
  from ddrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from ddrl_jax import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  c = toy_config.get_config('ddrl')
  c.algorithm, c.sampler.kind = 'diffusion_nft', ''
  c.rl.train_steps, c.rl.train_fraction = None, 0.99
  c.rl.nft_beta, c.rl.nft_old_decay, c.rl.kl_beta, c.rl.loss_scale = 0.1, 1, 1e-4, 1.0
  c.toy2d.width, c.toy2d.depth = 32, 2
  c.toy2d.pretrain_steps, c.toy2d.pretrain_batch = 200, 256
  c.sampler.num_steps = 6
  c.batch_size, c.num_rollouts = 8, 4
  c.num_iterations, c.eval_every, c.eval_samples, c.checkpoint_every = 3, 0, 64, 3
  c.optim.warmup_steps = 0
  config_lib.validate(c, num_devices=1)
  assert config_lib.sampler_kind(c) == 'flow_sde'
  trainer = trainer_lib.Trainer(c, tmp_path, devices=jax.devices()[:1])
  trainer.restore_or_init()
  trainer._build()  # pylint: disable=protected-access
  rolled_with = []
  real_rollout = trainer._rollout  # pylint: disable=protected-access

  def spy(params, *args):
    rolled_with.append(params is trainer.state.old_params and params is not trainer.state.params)
    return real_rollout(params, *args)

  trainer._rollout = spy  # pylint: disable=protected-access
  initial = jax.tree.map(np.asarray, trainer.state.params)
  old = initial
  rows = []
  for it in range(3):
    rows.append(trainer.train_iteration(it))
    params = jax.tree.map(np.asarray, trainer.state.params)
    decay = float(nft.old_decay(it + 1, 1))
    old = jax.tree.map(lambda o, p, d=decay: d * o + (1 - d) * p, old, params)
    for got, want in zip(jax.tree.leaves(trainer.state.old_params), jax.tree.leaves(old)):
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert rolled_with == [True] * 3               # every rollout sampled by the old policy
  jax.tree.map(np.testing.assert_array_equal, trainer.state.ref_params, initial)
  assert trainer.state.ema_params is not None
  trainer.save()
  trainer.ckpt.wait_until_finished()
  trainer.close_rewards()
  for r in rows:
    assert all(np.isfinite(v) for v in r.values()), r
    assert r['grad_norm'] > 0 and r['nft_policy_loss'] > 0 and 'kl' in r and 'data_loss' not in r
    assert 0.4 < r['nft_r_mean'] < 0.6          # z-scored advantages map around 1/2
  resumed = trainer_lib.Trainer(c, tmp_path, devices=jax.devices()[:1])
  assert resumed.restore_or_init() == 3
  for got, want in zip(jax.tree.leaves(resumed.state.old_params), jax.tree.leaves(trainer.state.old_params)):
    np.testing.assert_array_equal(got, want)
  resumed.close_rewards()


def test_failed_samples_leave_the_means(problem):
  """A failed sample (valid False) neither counts in the loss nor moves the parameters: the masked loss and
  gradient equal those of the valid subset alone."""
  p = problem
  r = nft.optimality_weights(p['adv'], 5.0)
  valid = jnp.arange(p['x0'].shape[0]) % 3 != 0
  kw = dict(beta=0.1, adv_clip_max=5.0, kl_beta=0.01)

  def masked(q):
    return nft.step_loss(linear_apply, q, p['old'], p['ref'], p['x0'], p['t'], p['noise'], p['cond'], r,
                         valid=valid, **kw)[0]

  def subset(q):
    take = lambda a: a[valid]
    return nft.step_loss(linear_apply, q, p['old'], p['ref'], take(p['x0']), take(p['t']),
                         take(p['noise']), take(p['cond']), take(r), **kw)[0]

  np.testing.assert_allclose(masked(p['params']), subset(p['params']), rtol=1e-6)
  for g, w in zip(jax.tree.leaves(jax.grad(masked)(p['params'])), jax.tree.leaves(jax.grad(subset)(p['params']))):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
  poisoned = p['x0'].at[0].set(jnp.nan)               # sample 0 is failed: its NaN must not leak
  grads = jax.grad(lambda q: nft.step_loss(linear_apply, q, p['old'], p['ref'], poisoned, p['t'], p['noise'],
                                           p['cond'], r, valid=valid, **kw)[0])(p['params'])
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(jax.grad(subset)(p['params']))):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
  none_valid = nft.step_loss(linear_apply, p['params'], p['old'], p['ref'], p['x0'], p['t'], p['noise'],
                             p['cond'], r, valid=jnp.zeros_like(valid), **kw)[0]
  assert float(none_valid) == 0.0


def test_validates_with_any_sampler():
  """NFT trains on re-noised clean samples, never on transitions: a deterministic last step is fine."""
  from configs import toy2d as toy_config  # pylint: disable=import-outside-toplevel
  from ddrl_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  for kind in ('cosmos_2ab', 'ddim', 'flow_sde', 'dance_sde'):
    c = toy_config.get_config('diffusion_nft')
    c.sampler.kind = kind
    config_lib.validate(c, num_devices=1)
    assert config_lib.train_steps(c) == tuple(range(c.sampler.num_steps))
