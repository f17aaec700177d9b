"""RL losses: importance ratio at the rollout, policy-gradient, NFE counts, data loss, KL, PPO clip.

References are written here with numpy (or, for gradients, with plain jax over `Sampler.step_mean`).
"""
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddrl_jax import rl
from ddrl_jax import sampling

B, N, T = 2, 3, 8
SHIFT = 3.0


def _cond(b=B):
  return jnp.linspace(-1.0, 1.0, b, dtype=jnp.float32).reshape(b, 1)


def _advantages(seed=0):
  return jnp.asarray(np.random.RandomState(seed).randn(B, N), jnp.float32)


def _steps(train_steps):
  pool = jnp.asarray(train_steps, jnp.int32)
  return jnp.broadcast_to(pool, (B, N, len(train_steps)))


def _random_steps(train_steps, k, seed=0):
  rng = np.random.RandomState(seed)
  out = np.stack([np.stack([rng.permutation(np.asarray(train_steps))[:k] for _ in range(N)])
                  for _ in range(B)])
  return jnp.asarray(out, jnp.int32)


def _perturb(params, scale, seed=1):
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda l: l + jnp.asarray(scale * rng.randn(*l.shape), l.dtype), params)


def _data_x0():
  return jnp.asarray([[0.5, -1.0], [1.5, 0.25]], jnp.float32)


@pytest.fixture(scope='module')
def rollouts(tiny_mlp):
  """algorithm name -> (sampler, traj) with the algorithm's default sampler, T=8."""
  out = {}
  for name, alg in rl.ALGORITHMS.items():
    s = sampling.make_sampler(alg.default_sampler, T, shift=SHIFT)
    traj = s.rollout(tiny_mlp.apply_fn, tiny_mlp.params, _cond(), jax.random.key(7), num_rollouts=N,
                     sample_shape=(2,))
    out[name] = (s, traj)
  return out


def _alg_loss(name, apply_fn, params, s, traj, steps, **kw):
  adv, cond, key = _advantages(), _cond(), jax.random.key(11)
  if name == 'ddrl':
    data = rl.DataTerm(_data_x0(), cond, beta=0.01, steps='full')
    return rl.ddrl_loss(apply_fn, params, s, traj, adv, steps, cond, data, key, **kw)
  if name == 'flow_grpo':
    return rl.flow_grpo_loss(apply_fn, params, params, s, traj, adv, steps, cond, key, **kw)
  fn = rl.dance_grpo_loss if name == 'dance_grpo' else rl.ddpo_loss
  return fn(apply_fn, params, s, traj, adv, steps, cond, key, **kw)


# ---------------------------------------------------------------------------- (a) ratio at rollout
@pytest.mark.parametrize('name', sorted(rl.ALGORITHMS))
def test_ratio_is_one_before_update(rollouts, tiny_mlp, name):
  alg = rl.ALGORITHMS[name]
  s, traj = rollouts[name]
  steps = _steps(alg.default_train_steps(T))

  @jax.jit
  def three(tr):
    f = lambda t, **kw: _alg_loss(name, tiny_mlp.apply_fn, tiny_mlp.params, s, t, steps, **kw)[1]
    # The stored means of another step do not belong to the stored transitions: the check can fail.
    wrong = tr._replace(mean=jnp.roll(tr.mean, 1, axis=2))
    return (f(tr, old_mean='detached'), f(tr, old_mean='rollout', log_ratio_form='gaussian'),
            f(wrong, old_mean='rollout', log_ratio_form='gaussian'))

  detached, rollout, wrong = jax.device_get(three(traj))
  assert float(detached['ratio_mean']) == 1.0
  assert float(detached['ratio_max_dev']) == 0.0
  assert float(detached['clipfrac']) == 0.0
  assert float(rollout['ratio_max_dev']) <= 1e-6, float(rollout['ratio_max_dev'])
  assert abs(float(rollout['ratio_mean']) - 1.0) <= 1e-6
  assert float(wrong['ratio_max_dev']) > 1e-3


def test_bad_old_mean_and_kl_without_ref(rollouts, tiny_mlp):
  s, traj = rollouts['flow_grpo']
  steps = _steps((0, 1))
  args = (tiny_mlp.apply_fn, tiny_mlp.params, s, traj, _advantages(), steps, _cond(), jax.random.key(0))
  with pytest.raises(ValueError):
    rl.rl_loss(*args, clip_range=1e-4, kl_beta=0.04, ref_params=None)
  with pytest.raises(ValueError):
    rl.rl_loss(*args, clip_range=1e-4, old_mean='stale')
  with pytest.raises(ValueError):
    rl.flow_grpo_loss(tiny_mlp.apply_fn, tiny_mlp.params, None, s, traj, _advantages(), steps, _cond(),
                      jax.random.key(0))


# ------------------------------------------------------------------- (b) policy-gradient gradient
def _ref_pg_loss(apply_fn, params, sampler, traj, adv, steps, cond):
  """-mean_{b,n,k} A * logp_theta(x_next | x_in), logp = per-element-mean Gaussian log density."""
  steps = np.asarray(steps)
  bi, ni = np.meshgrid(np.arange(B), np.arange(N), indexing='ij')
  one = lambda inp, c: sampler.step_mean(apply_fn, params, inp, c)[0]
  total = 0.0
  for k in range(steps.shape[-1]):
    sk = steps[..., k]
    pick = lambda a: a[bi, ni, sk]
    inp = sampling.StepInputs(x_in=pick(traj.x_in), x0_prev=pick(traj.x0_prev), step=pick(traj.step),
                              t_in=pick(traj.t_in), sigma_in=pick(traj.sigma_in),
                              sigma_next=pick(traj.sigma_next), sigma_prev=pick(traj.sigma_prev))
    mean = jax.vmap(jax.vmap(one, in_axes=(0, None)), in_axes=(0, 0))(inp, cond)
    std = pick(traj.std)[..., None]
    logp = (-(pick(traj.x_next) - mean)**2 / (2 * std**2) - jnp.log(std)
            - 0.5 * math.log(2 * math.pi)).mean(-1)
    total = total + (adv * logp).mean()
  return -total / steps.shape[-1]


@pytest.mark.parametrize('name', sorted(rl.ALGORITHMS))
def test_pg_gradient_matches_reinforce(rollouts, tiny_mlp, name):
  alg = rl.ALGORITHMS[name]
  s, traj = rollouts[name]
  pool = alg.default_train_steps(T)
  # 3 random steps per rollout from the algorithm's pool (exercises the per-sample gather; keeps compiles small)
  steps = _random_steps(pool, 3, seed=len(name))
  adv, cond = _advantages(3), _cond()

  def loss(p, scale):
    return rl.rl_loss(tiny_mlp.apply_fn, p, s, traj, adv, steps, cond, jax.random.key(0), clip_range=1e-4,
                      log_ratio_form='gaussian', old_mean='detached', loss_scale=scale)[0]

  grad = jax.jit(jax.grad(loss))
  g = grad(tiny_mlp.params, 1.0)
  g_ref = jax.jit(jax.grad(lambda p: _ref_pg_loss(tiny_mlp.apply_fn, p, s, traj, adv, steps, cond)))(
      tiny_mlp.params)
  gmax = max(float(jnp.abs(l).max()) for l in jax.tree.leaves(g_ref))
  assert gmax > 0
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * gmax)
  # loss_scale multiplies the gradient
  for a, b in zip(jax.tree.leaves(grad(tiny_mlp.params, 10.0)), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(np.asarray(a), 10 * np.asarray(b), rtol=1e-4, atol=1e-4 * gmax)


# -------------------------------------------------------------------------------- (c) NFE counting
def _counting(apply_fn, counter):
  def counted(params, x, t, cond):
    n = x.shape[0]
    # x is passed to the callback so it stays inside the scan / vmap it belongs to (a callback with no
    # operands is hoisted out of the scan under jax.grad and runs once).
    jax.debug.callback(lambda _x: counter.__setitem__(0, counter[0] + n), x)
    return apply_fn(params, x, t, cond)
  return counted


def test_callback_counter_counts_rows():
  """Sanity check of the counting mechanism itself: one count per vmapped element and per scan step."""
  counter = [0]
  f = _counting(lambda p, x, t, c: x * p, counter)
  def g(p, xs):
    def body(carry, x):
      y = jax.vmap(lambda xi: f(p, xi[None], None, None)[0])(x)
      return carry + y.sum(), None
    return jax.lax.scan(body, 0.0, xs)[0]
  jax.jit(jax.grad(g))(1.0, jnp.ones((4, 5, 2))).block_until_ready()
  jax.effects_barrier()
  assert counter[0] == 20
  counter[0] = 0
  jax.jit(lambda p: f(p, jnp.ones((7, 2)), None, None).sum())(1.0).block_until_ready()
  jax.effects_barrier()
  assert counter[0] == 7


@pytest.fixture(scope='module')
def counted_rollout(tiny_mlp):
  """(counter, counting apply_fn, sampler, traj, rows counted by the rollout) for cosmos_2ab, T=8."""
  counter = [0]
  apply_fn = _counting(tiny_mlp.apply_fn, counter)
  s = sampling.make_sampler('cosmos_2ab', T)
  traj = s.rollout(apply_fn, tiny_mlp.params, _cond(), jax.random.key(0), num_rollouts=N, sample_shape=(2,))
  jax.block_until_ready(traj)
  jax.effects_barrier()
  return counter, apply_fn, s, traj, counter[0]


def test_rollout_nfe_count(counted_rollout):
  *_, traj, rollout_rows = counted_rollout
  assert rollout_rows / B == N * (T + 1)
  np.testing.assert_array_equal(np.asarray(traj.nfe), T + 1)


@pytest.mark.parametrize('data_steps', ['reduced', 'full'])
def test_ddrl_loss_nfe_count(counted_rollout, tiny_mlp, data_steps):
  counter, apply_fn, s, traj, _ = counted_rollout
  cond = _cond()
  train_steps = rl.ALGORITHMS['ddrl'].default_train_steps(T)
  k = len(train_steps)
  data = rl.DataTerm(_data_x0(), cond, beta=0.01, steps=data_steps)
  loss = lambda p: rl.ddrl_loss(apply_fn, p, s, traj, _advantages(), _steps(train_steps), cond, data,
                                jax.random.key(1))[0]
  counter[0] = 0
  g = jax.jit(jax.grad(loss))(tiny_mlp.params)
  jax.block_until_ready(g)
  jax.effects_barrier()
  expected = N * (1 + k) if data_steps == 'reduced' else 2 * N * k
  assert counter[0] / B == expected, (counter[0], expected)


# ---------------------------------------------------------------------------------- (d) data loss
def test_cosmos_loss_weight_is_edm_weight():
  sigma = np.array([0.01, 0.3, 1.0, 5.0, 200.0])
  t = sigma / (1 + sigma)
  # EDM weight (sigma^2+1)/sigma^2 on the x0 error; x0_hat - x0 = -t (v_hat - v) gives a factor t^2.
  np.testing.assert_allclose(np.asarray(rl.cosmos_loss_weight(t)), (sigma**2 + 1) / sigma**2 * t**2,
                             rtol=1e-10)


@pytest.mark.parametrize('sample_shape', [(2,), (2, 3)])
def test_velocity_loss_numpy(tiny_mlp_factory, sample_shape):
  m = tiny_mlp_factory(sample_shape=sample_shape, cond_dim=2, seed=3)
  rng = np.random.RandomState(0)
  b = 5
  x0 = rng.randn(b, *sample_shape).astype(np.float32)
  eps = rng.randn(b, *sample_shape).astype(np.float32)
  t = rng.uniform(0.05, 0.95, b).astype(np.float32)
  cond = rng.randn(b, 2).astype(np.float32)
  got = np.asarray(rl.velocity_loss(m.apply_fn, m.params, x0, eps, t, cond))
  tb = t.astype(np.float64).reshape((-1,) + (1,) * len(sample_shape))
  x_t = (1 - tb) * x0 + tb * eps
  v = m.np_apply(m.params, x_t, t, cond)
  mse = ((v - (eps.astype(np.float64) - x0)) ** 2).reshape(b, -1).mean(-1)
  ref = (t.astype(np.float64)**2 + (1 - t.astype(np.float64))**2) * mse
  chex.assert_shape(got, (b,))
  np.testing.assert_allclose(got, ref, rtol=1e-5)
  w = rng.uniform(0.1, 3.0, b).astype(np.float32)
  np.testing.assert_allclose(np.asarray(rl.velocity_loss(m.apply_fn, m.params, x0, eps, t, cond, w)),
                             w * mse, rtol=1e-5)


def test_drop_condition():
  cond = {'a': jnp.arange(1, 25, dtype=jnp.float32).reshape(8, 3), 'b': jnp.arange(1, 9, dtype=jnp.int32)}
  key = jax.random.key(0)
  out = rl.drop_condition(cond, key, 1.0)
  for k in cond:
    assert out[k].dtype == cond[k].dtype and out[k].shape == cond[k].shape
    np.testing.assert_array_equal(np.asarray(out[k]), 0)
  out = rl.drop_condition(cond, key, 0.0)
  for k in cond:
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(cond[k]))
  # rate 0.5 over many samples: whole rows kept or dropped, consistently across leaves
  big = {'a': jnp.ones((4000, 3)), 'b': jnp.ones((4000,), jnp.int32)}
  out = rl.drop_condition(big, key, 0.5)
  a, bb = np.asarray(out['a']), np.asarray(out['b'])
  assert ((a == 0).all(1) | (a == 1).all(1)).all()
  np.testing.assert_array_equal(a[:, 0], bb)
  assert abs((bb == 0).mean() - 0.5) < 0.05


def test_data_term_rejects_bad_options():
  x0, c = _data_x0(), _cond()
  with pytest.raises(ValueError):
    rl.DataTerm(x0, c, steps='some')
  with pytest.raises(ValueError):
    rl.DataTerm(x0, c, noise='stale')
  with pytest.raises(ValueError):
    rl.DataTerm(x0, c, weighting='edm')
  rl.DataTerm(x0, c, steps='reduced', noise='fresh', weighting='path_kl')   # valid


def _np_data_loss_per_step(tiny_mlp, traj, k_steps, weight_fn=None):
  """(K, B, N) per-sample data losses at the stored t_in of each trained step (rollout noise, no dropout)."""
  x0 = np.repeat(np.asarray(_data_x0(), np.float64)[:, None], N, axis=1)     # (B, N, 2)
  eps = np.asarray(traj.noise, np.float64)
  cond = np.repeat(np.asarray(_cond()), N, axis=0)
  out = []
  for k in k_steps:
    t = np.asarray(traj.t_in, np.float64)[:, :, k]
    x_t = (1 - t[..., None]) * x0 + t[..., None] * eps
    v = tiny_mlp.np_apply(tiny_mlp.params, x_t.reshape(B * N, 2), t.reshape(-1), cond).reshape(B, N, 2)
    w = t**2 + (1 - t)**2 if weight_fn is None else weight_fn(k)
    out.append(w * ((v - (eps - x0))**2).mean(-1))
  return np.stack(out)


def test_ddrl_data_loss_full_and_reduced(rollouts, tiny_mlp):
  s, traj = rollouts['ddrl']
  train_steps = rl.ALGORITHMS['ddrl'].default_train_steps(T)
  per = _np_data_loss_per_step(tiny_mlp, traj, train_steps)

  @jax.jit
  def both(tr):
    out = {}
    for steps_opt in ('full', 'reduced'):
      data = rl.DataTerm(_data_x0(), _cond(), beta=0.01, steps=steps_opt, cond_dropout=0.0,
                         weighting='cosmos_rl')
      out[steps_opt] = rl.ddrl_loss(tiny_mlp.apply_fn, tiny_mlp.params, s, tr, _advantages(),
                                    _steps(train_steps), _cond(), data, jax.random.key(2), loss_scale=10.0)
    return out

  for steps_opt, (loss, m) in jax.device_get(both(traj)).items():
    if steps_opt == 'full':
      np.testing.assert_allclose(float(m['data_loss']), per.mean(), rtol=1e-5)
    else:
      # one random trained step per rollout: between the per-sample min and max over steps
      assert per.min(0).mean() - 1e-6 <= float(m['data_loss']) <= per.max(0).mean() + 1e-6
      assert abs(float(m['data_loss']) - per.mean()) > 1e-6  # not silently the full average
    np.testing.assert_allclose(float(loss), 10.0 * (float(m['pg_loss']) + 0.01 * float(m['data_loss'])),
                               rtol=1e-5)
    np.testing.assert_allclose(float(m['loss']), float(loss), rtol=1e-6)


def test_path_kl_weighted_data_loss(rollouts, tiny_mlp):
  """weighting='path_kl': w_i = (d mean / d v)^2 / (2 std^2), here for the FlowGRPO kernel in numpy."""
  s, traj = rollouts['flow_grpo']
  steps = (0, 2, 5)
  sig, sig_n = np.asarray(traj.sigma_in[0, 0], np.float64), np.asarray(traj.sigma_next[0, 0], np.float64)
  a = s.noise

  def weight(k):
    st = sig_n[k] if sig[k] == 1.0 else sig[k]
    sc2 = a**2 * sig[k] / (1 - st)
    dt = sig_n[k] - sig[k]
    gain = (1 + sc2 * (1 - sig[k]) / (2 * sig[k])) * dt
    return gain**2 / (2 * sc2 * (-dt))

  per = _np_data_loss_per_step(tiny_mlp, traj, steps, weight)
  data = rl.DataTerm(_data_x0(), _cond(), beta=0.5, steps='full', cond_dropout=0.0, weighting='path_kl')
  _, m = rl.rl_loss(tiny_mlp.apply_fn, tiny_mlp.params, s, traj, _advantages(), _steps(steps), _cond(),
                    jax.random.key(0), clip_range=1e-4, data=data)
  np.testing.assert_allclose(float(m['data_loss']), per.mean(), rtol=1e-4)


def test_eps_mse_weighted_data_loss_is_the_papers_epsilon_mse(rollouts, tiny_mlp):
  """weighting='eps_mse' equals Algorithm 1's unweighted MSE of the predicted noise, computed in numpy
  from eps_hat = x_t + (1 - t) v_hat (not from the (1 - t)^2 weight it reduces to)."""
  s, traj = rollouts['ddrl']
  steps = (0, 3, 6)
  x0 = np.repeat(np.asarray(_data_x0(), np.float64)[:, None], N, axis=1)
  eps = np.asarray(traj.noise, np.float64)
  cond = np.repeat(np.asarray(_cond()), N, axis=0)
  per = []
  for k in steps:
    t = np.asarray(traj.t_in, np.float64)[:, :, k]
    x_t = (1 - t[..., None]) * x0 + t[..., None] * eps
    v = tiny_mlp.np_apply(tiny_mlp.params, x_t.reshape(B * N, 2), t.reshape(-1), cond).reshape(B, N, 2)
    eps_hat = x_t + (1 - t[..., None]) * v
    per.append(((eps_hat - eps)**2).mean(-1))
  data = rl.DataTerm(_data_x0(), _cond(), beta=0.5, steps='full', cond_dropout=0.0, weighting='eps_mse')
  _, m = rl.rl_loss(tiny_mlp.apply_fn, tiny_mlp.params, s, traj, _advantages(), _steps(steps), _cond(),
                    jax.random.key(0), clip_range=1e-4, data=data)
  np.testing.assert_allclose(float(m['data_loss']), np.mean(per), rtol=1e-4)


# --------------------------------------------------------------------------------------- (e) KL
def test_flow_grpo_kl(rollouts, tiny_mlp):
  s, traj = rollouts['flow_grpo']
  train_steps = rl.ALGORITHMS['flow_grpo'].default_train_steps(T)
  steps = _steps(train_steps)
  p = tiny_mlp.params
  ref_p = _perturb(p, 0.1)

  @jax.jit
  def both(tr):
    args = (s, tr, _advantages(), steps, _cond(), jax.random.key(0))
    return (rl.flow_grpo_loss(tiny_mlp.apply_fn, p, p, *args)[1],
            rl.flow_grpo_loss(tiny_mlp.apply_fn, p, ref_p, *args, kl_beta=0.04))

  m_same, (loss, m) = jax.device_get(both(traj))
  assert float(m_same['kl']) == 0.0
  # numpy: FlowGRPO means under both parameter sets at the stored states
  x_in = np.asarray(traj.x_in, np.float64)
  cond = np.repeat(np.asarray(_cond()), N, axis=0)
  a = s.noise
  kls = []
  for k in train_steps:
    sg, sn = float(traj.sigma_in[0, 0, k]), float(traj.sigma_next[0, 0, k])
    dt = sn - sg
    st = sn if sg == 1.0 else sg
    sc = a * np.sqrt(sg / (1 - st))
    x = x_in[:, :, k].reshape(B * N, 2)
    mus = []
    for params in (p, ref_p):
      v = tiny_mlp.np_apply(params, x, np.full(B * N, sg), cond)
      mus.append(x * (1 + sc**2 * dt / (2 * sg)) + v * (1 + sc**2 * (1 - sg) / (2 * sg)) * dt)
    std = sc * np.sqrt(-dt)
    np.testing.assert_allclose(float(traj.std[0, 0, k]), std, rtol=1e-5)
    kls.append(((mus[0] - mus[1])**2).mean(-1) / (2 * std**2))
  ref_kl = np.mean(kls)
  assert ref_kl > 1e-4
  np.testing.assert_allclose(float(m['kl']), ref_kl, rtol=1e-3)
  np.testing.assert_allclose(float(loss), float(m['pg_loss']) + 0.04 * float(m['kl']), rtol=1e-5)


# ------------------------------------------------------------------------------ (f) PPO clip / ratio
def test_clipped_policy_loss_numpy():
  rng = np.random.RandomState(0)
  adv = rng.randn(64).astype(np.float32)
  lr = (rng.randn(64) * 3e-4).astype(np.float32)
  eps = 1e-4
  loss, ratio, clipped = rl.clipped_policy_loss(jnp.asarray(adv), jnp.asarray(lr), eps)
  r = np.exp(lr.astype(np.float64))
  ref = np.maximum(-adv * r, -adv * np.clip(r, 1 - eps, 1 + eps))
  np.testing.assert_allclose(np.asarray(loss), ref, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(ratio), r, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(clipped), np.abs(r - 1) > eps)
  assert 0 < np.asarray(clipped).mean() < 1
  # the pessimistic bound: positive A with r > 1 + eps is clipped, negative A with r > 1 + eps is not
  loss2, _, _ = rl.clipped_policy_loss(jnp.array([1.0, -1.0]), jnp.log(jnp.array([1.5, 1.5])), 0.2)
  np.testing.assert_allclose(np.asarray(loss2), [-1.2, 1.5], rtol=1e-6)


def test_log_ratio_forms_numpy():
  rng = np.random.RandomState(1)
  x, m1, m0 = (rng.randn(2, 3, 4).astype(np.float32) for _ in range(3))
  std = rng.uniform(0.5, 2.0, (2, 3)).astype(np.float32)
  sq = ((x - m1)**2 - (x - m0)**2).astype(np.float64).mean(-1)
  np.testing.assert_allclose(np.asarray(rl.log_ratio(x, m1, m0, std, form='cosmos')), -sq, rtol=1e-5,
                             atol=1e-6)
  g = np.asarray(rl.log_ratio(x, m1, m0, std, form='gaussian'))
  np.testing.assert_allclose(g, -sq / (2 * std.astype(np.float64)**2), rtol=1e-5, atol=1e-6)
  # gaussian form equals the difference of normalized Gaussian log-probs
  from scipy import stats
  lp = lambda m: stats.norm.logpdf(x, m, std[..., None]).mean(-1)
  np.testing.assert_allclose(g, lp(m1) - lp(m0), rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError):
    rl.log_ratio(x, m1, m0, std, form='kl')


def test_drop_condition_drops_only_text_of_a_dict_condition():
  cond = {'text': jnp.ones((64, 3, 2)), 'first_frame': jnp.ones((64, 4))}
  out = rl.drop_condition(cond, jax.random.key(0), 0.5)
  np.testing.assert_array_equal(out['first_frame'], cond['first_frame'])
  dropped = np.asarray(out['text']).reshape(64, -1).sum(axis=1) == 0
  assert 10 < dropped.sum() < 54                     # about half, whole samples at a time
  assert set(np.unique(np.asarray(out['text']))) <= {0.0, 1.0}


# ------------------------------------------------------------- (g) the public losses' per-step VJP
def _named_and_reference(name, apply_fn, s, traj, steps, adv, x0, ref_params):
  """(named public loss, rl_loss_reference with the same options), each a function of params."""
  cond, key = _cond(), jax.random.key(11)
  args = lambda p: (apply_fn, p, s, traj, adv, steps, cond, key)
  # clip ranges that clip some of the samples at _perturb(params, 0.03); DDRL's unnormalized ratio moves more
  kw = dict(clip_range=0.2 if name == 'ddrl' else 0.01, loss_scale=10.0)
  reference = lambda p, **more: rl.rl_loss_reference(*args(p), **kw, **more)
  if name == 'ddrl':
    data = rl.DataTerm(x0, cond, beta=0.5, steps='full')
    return (lambda p: rl.ddrl_loss(apply_fn, p, s, traj, adv, steps, cond, data, key, **kw),
            lambda p: reference(p, log_ratio_form='cosmos', data=data))
  if name == 'flow_grpo':
    return (lambda p: rl.flow_grpo_loss(apply_fn, p, ref_params, s, traj, adv, steps, cond, key,
                                        kl_beta=0.3, **kw),
            lambda p: reference(p, ref_params=ref_params, kl_beta=0.3))
  fn = rl.dance_grpo_loss if name == 'dance_grpo' else rl.ddpo_loss
  return lambda p: fn(*args(p), **kw), reference


@pytest.mark.parametrize('name', ['ddrl', 'flow_grpo', 'dance_grpo', 'ddpo'])
def test_public_loss_gradient_equals_the_plain_scan(rollouts, tiny_mlp, name):
  """jax.value_and_grad of each named loss (its custom VJP runs `rl_loss_and_grad`, one trained step at a
  time) against the same of `rl_loss_reference` (reverse mode through the plain scan), away from the
  rollout parameters so the PPO clip is active for some samples."""
  s, traj = rollouts[name]
  steps = _random_steps(rl.ALGORITHMS[name].default_train_steps(T), 3, seed=len(name))
  params = _perturb(tiny_mlp.params, 0.03)
  public, reference = _named_and_reference(name, tiny_mlp.apply_fn, s, traj, steps, _advantages(3),
                                           _data_x0(), _perturb(tiny_mlp.params, 0.1, seed=2))
  (v1, m1), g1 = jax.jit(jax.value_and_grad(public, has_aux=True))(params)
  (v0, m0), g0 = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
  np.testing.assert_allclose(v1, v0, rtol=1e-6)
  chex.assert_trees_all_close(m1, m0, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(g1, g0, rtol=1e-5, atol=1e-7)
  assert 0 < float(m0['clipfrac']) < 1, m0          # the clip takes part
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g0)) > 1e-4
  # without has_aux, and plain evaluation (no derivative: the primal is the reference itself)
  chex.assert_trees_all_close(jax.grad(lambda p: public(p)[0])(params), g0, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(public(params)[0], v0, rtol=1e-6)


def test_public_loss_other_derivatives_fall_back_to_the_reference(rollouts, tiny_mlp):
  """Derivatives the per-step rule does not cover run the reference's own VJP: of a metric, with respect
  to the advantages and the data; and the params passed as their own KL reference (zero gradient)."""
  s, traj = rollouts['ddrl']
  steps = _steps((0, 2, 4))
  params, adv, x0 = _perturb(tiny_mlp.params, 0.03), _advantages(3), _data_x0()

  def derivatives(i):       # i = 0: the public ddrl_loss, 1: rl_loss_reference
    loss = lambda p, a=adv, d=x0: _named_and_reference('ddrl', tiny_mlp.apply_fn, s, traj, steps, a, d,
                                                       None)[i](p)
    return (jax.grad(lambda p: loss(p)[1]['data_loss'])(params),
            jax.grad(lambda p: loss(p)[0] + loss(p)[1]['pg_loss'])(params),
            jax.grad(lambda a, d: loss(params, a, d)[0], argnums=(0, 1))(adv, x0))

  public, reference = jax.jit(lambda: derivatives(0))(), jax.jit(lambda: derivatives(1))()
  chex.assert_trees_all_close(public, reference, rtol=1e-5, atol=1e-7)
  assert float(jnp.abs(public[2][1]).max()) > 0          # the data x0 gradient is not dropped
  s, traj = rollouts['flow_grpo']
  rest = (s, traj, adv, steps, _cond(), jax.random.key(11))
  g_public = jax.grad(lambda p: rl.flow_grpo_loss(tiny_mlp.apply_fn, p, p, *rest, kl_beta=0.3)[0])(params)
  g_reference = jax.grad(lambda p: rl.rl_loss_reference(tiny_mlp.apply_fn, p, *rest, clip_range=1e-4,
                                                        ref_params=p, kl_beta=0.3)[0])(params)
  chex.assert_trees_all_close(g_public, g_reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('data_steps', ['full', 'random_step'])
def test_public_data_loss_gradient_equals_the_plain_scan(rollouts, tiny_mlp, data_steps):
  """jax.value_and_grad of rl.data_loss (its custom VJP runs `data_loss_and_grad`) against the same of
  `data_loss_reference`."""
  s, traj = rollouts['ddrl']
  term = rl.DataTerm(_data_x0(), _cond(), beta=0.5, steps=data_steps)
  args = (s, traj, _steps((0, 2, 4)), term, jax.random.key(5))
  public, reference = (jax.jit(jax.value_and_grad(lambda p, f=f: f(tiny_mlp.apply_fn, p, *args)))
                       for f in (rl.data_loss, rl.data_loss_reference))
  chex.assert_trees_all_close(public(tiny_mlp.params), reference(tiny_mlp.params), rtol=1e-5, atol=1e-7)


def test_pg_weight_zero_leaves_only_the_regularizer(rollouts, tiny_mlp):
  """rl.pg_weight (the data-term-only control of benchmarks/ocr_table.py): at 0 the DDRL gradient is
  loss_scale * data_beta times rl.data_loss's gradient, FlowGRPO's is loss_scale * kl_beta times the KL's;
  at 0.5 the policy-gradient part is half of pg_weight 1's; pg_loss is reported unweighted."""
  s, traj = rollouts['ddrl']
  steps, adv, cond, key = _steps((0, 2, 4)), _advantages(), _cond(), jax.random.key(11)
  params = _perturb(tiny_mlp.params, 0.05)
  data = rl.DataTerm(_data_x0(), cond, beta=0.3, steps='full', cond_dropout=0.0)
  alg = rl.ALGORITHMS['ddrl']

  def ddrl(weight):
    opts = rl.RLOptions(clip_range=1e-4, loss_scale=10.0, pg_weight=weight)
    return alg.loss_and_grad(tiny_mlp.apply_fn, params, None, s, traj, adv, steps, cond, data, key, opts)

  loss0, m0, g0 = ddrl(0.0)
  _, want = jax.value_and_grad(lambda p: rl.data_loss(tiny_mlp.apply_fn, p, s, traj, steps, data, key))(params)
  chex.assert_trees_all_close(g0, jax.tree.map(lambda g: 10.0 * 0.3 * g, want), rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(float(loss0), 10.0 * 0.3 * float(m0['data_loss']), rtol=1e-6)
  assert abs(float(m0['pg_loss'])) > 0                         # still measured, not weighted in
  _, m1, g1 = ddrl(1.0)
  _, _, gh = ddrl(0.5)
  chex.assert_trees_all_close(jax.tree.map(lambda a, b: a - b, gh, g0),
                              jax.tree.map(lambda a, b: 0.5 * (a - b), g1, g0), rtol=1e-4, atol=1e-7)
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0))) > 1e-4

  s, traj = rollouts['flow_grpo']
  ref = tiny_mlp.params
  fg = rl.ALGORITHMS['flow_grpo']
  only_kl = fg.loss_and_grad(tiny_mlp.apply_fn, params, ref, s, traj, adv, steps, cond, None, key,
                             rl.RLOptions(clip_range=1e-4, kl_beta=0.2, pg_weight=0.0))
  no_adv = fg.loss_and_grad(tiny_mlp.apply_fn, params, ref, s, traj, jnp.zeros_like(adv), steps, cond, None,
                            key, rl.RLOptions(clip_range=1e-4, kl_beta=0.2))
  chex.assert_trees_all_close(only_kl[2], no_adv[2], rtol=1e-5, atol=1e-8)   # zero advantages: KL only
  np.testing.assert_allclose(float(only_kl[0]), 0.2 * float(only_kl[1]['kl']), rtol=1e-6)
