"""Rollout samplers: shapes, trajectory bookkeeping, and that stored (mean, std) are the real transition.

Means are re-derived with numpy kernels and a numpy forward of the tiny MLP (conftest), independently of
the package's kernels.
"""
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ddrl_jax import rl
from ddrl_jax import sampling

T = 6
SHIFT = 3.0
KINDS = sampling.KINDS


def _sampler(kind):
  return sampling.make_sampler(kind, T, shift=SHIFT)


def _cond(b):
  return jnp.linspace(-1.0, 1.0, b, dtype=jnp.float32).reshape(b, 1)


@pytest.fixture(scope='module')
def small(tiny_mlp):
  """kind -> (sampler, traj, cond) for B=2, N=3."""
  out = {}
  for kind in KINDS:
    s = _sampler(kind)
    cond = _cond(2)
    traj = s.rollout(tiny_mlp.apply_fn, tiny_mlp.params, cond, jax.random.key(0), num_rollouts=3,
                     sample_shape=(2,))
    out[kind] = (s, jax.tree.map(np.asarray, traj), cond)
  return out


@pytest.fixture(scope='module')
def big(tiny_mlp):
  """kind -> traj for B=4, N=64 (statistics of the stored transitions)."""
  out = {}
  for kind in KINDS:
    traj = _sampler(kind).rollout(tiny_mlp.apply_fn, tiny_mlp.params, _cond(4), jax.random.key(1),
                                  num_rollouts=64, sample_shape=(2,))
    out[kind] = jax.tree.map(np.asarray, traj)
  return out


# ------------------------------------------------------------------------------ independent schedule
def np_schedule(kind):
  """(sigma_in, sigma_next, t_in, sigma_prev, eta) per step, from closed forms."""
  if kind == 'cosmos_2ab':
    lo, hi = 0.01 ** (1 / 7), 200.0 ** (1 / 7)
    sig = np.array([(hi + k / T * (lo - hi)) ** 7 for k in range(T + 1)])
    eta = min(1.0 / (T + 1), math.sqrt(1.2) - 1)
    sigma_in = (1 + eta) * sig[:-1]
    return sigma_in, sig[1:], sigma_in / (1 + sigma_in), np.r_[np.nan, sigma_in[:-1]], eta
  s = np.linspace(1, 0, T + 1)
  sig = SHIFT * s / (1 + (SHIFT - 1) * s)
  return sig[:-1], sig[1:], sig[:-1], None, None


def np_step_mean(kind, x_in, v, x0_prev, i, sampler):
  """Numpy transition mean of step i for states x_in (..., 2) and velocities v (same shape)."""
  sigma_in, sigma_next, t_in, sigma_prev, _ = np_schedule(kind)
  s, sn = sigma_in[i], sigma_next[i]
  if kind == 'cosmos_2ab':
    t = t_in[i]
    x0 = (1 - t) * x_in - t * v
    if i == 0:
      return (sn / s) * x_in + (1 - sn / s) * x0
    h = np.log(s / sn)
    phi1 = (1 - np.exp(-h)) / h
    c2 = (np.log(s) - np.log(sigma_prev[i])) / h
    # exact exponential integration of x0 linearly extrapolated in log sigma (see test_transitions)
    return np.exp(-h) * x_in + (1 - np.exp(-h)) * x0 - (x0 - x0_prev) * (1 - phi1) / c2
  dt = sn - s
  a = sampler.noise
  if kind == 'flow_sde':
    st = sn if s == 1.0 else s
    sc = a * np.sqrt(s / (1 - st))
    return x_in * (1 + sc**2 * dt / (2 * s)) + v * (1 + sc**2 * (1 - s) / (2 * s)) * dt
  if kind == 'dance_sde':
    x0 = x_in - s * v
    score = -(x_in - (1 - s) * x0) / s**2
    return x_in + dt * v - 0.5 * a**2 * score * dt
  # ddim: DDPO in VP form, back-scaled (see test_transitions.np_ddpo_vp)
  c_t, c_s = np.hypot(1 - s, s), np.hypot(1 - sn, sn)
  abar_t, abar_s = (1 - s)**2 / c_t**2, (1 - sn)**2 / c_s**2
  x0 = x_in - s * v
  eps = (x_in / c_t - np.sqrt(abar_t) * x0) / np.sqrt(1 - abar_t)
  std_vp = a * np.sqrt((1 - abar_s) / (1 - abar_t)) * np.sqrt(max(1 - abar_t / abar_s, 0.0))
  return c_s * (np.sqrt(abar_s) * x0 + np.sqrt(max(1 - abar_s - std_vp**2, 0.0)) * eps)


def np_std(kind, i, sampler):
  sigma_in, sigma_next, _, _, eta = np_schedule(kind)
  s, sn = sigma_in[i], sigma_next[i]
  a = sampler.noise
  if kind == 'cosmos_2ab':
    return sn * np.sqrt(eta**2 + 2 * eta)
  if kind == 'flow_sde':
    st = sn if s == 1.0 else s
    return a * np.sqrt(s / (1 - st)) * np.sqrt(s - sn)
  if kind == 'dance_sde':
    return a * np.sqrt(s - sn)
  r = (1 - s) * sn / ((1 - sn) * s)
  return a * sn * np.sqrt(max(1 - r**2, 0.0))


def _velocity(tiny_mlp, kind, x_in, t, cond):
  """Numpy velocity for (B, N, 2) states at scalar time t; cond (B, 1)."""
  b, n = x_in.shape[:2]
  net_in = (1 - t) * x_in if kind == 'cosmos_2ab' else x_in
  c = np.repeat(np.asarray(cond), n, axis=0)
  v = tiny_mlp.np_apply(tiny_mlp.params, net_in.reshape(b * n, 2), np.full(b * n, t), c)
  return v.reshape(b, n, 2)


# ------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize('kind', KINDS)
def test_shapes_nfe_finite(small, kind):
  s, traj, _ = small[kind]
  for f in ('x_in', 'x0_prev', 'mean', 'x_next'):
    chex.assert_shape(getattr(traj, f), (2, 3, T, 2))
  for f in ('step', 't_in', 'sigma_in', 'sigma_next', 'sigma_prev', 'std'):
    chex.assert_shape(getattr(traj, f), (2, 3, T))
  chex.assert_shape([traj.x0, traj.noise], (2, 3, 2))
  chex.assert_shape(traj.nfe, (2, 3))
  np.testing.assert_array_equal(traj.nfe, T + 1 if kind == 'cosmos_2ab' else T)
  chex.assert_tree_all_finite(traj)
  np.testing.assert_array_equal(traj.step, np.broadcast_to(np.arange(T), (2, 3, T)))


@pytest.mark.parametrize('kind', KINDS)
def test_schedule_fields(small, kind):
  s, traj, _ = small[kind]
  sigma_in, sigma_next, t_in, sigma_prev, _ = np_schedule(kind)
  np.testing.assert_allclose(traj.sigma_in[0, 0], sigma_in, rtol=1e-6)
  np.testing.assert_allclose(traj.sigma_next[0, 0], sigma_next, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(traj.t_in[0, 0], t_in, rtol=1e-6)
  if kind == 'cosmos_2ab':
    np.testing.assert_allclose(traj.sigma_prev[0, 0, 1:], sigma_prev[1:], rtol=1e-6)
    assert traj.sigma_prev[0, 0, 0] > 0   # positive dummy at step 0
  for f in ('sigma_in', 't_in', 'std'):
    np.testing.assert_array_equal(getattr(traj, f), np.broadcast_to(getattr(traj, f)[:1, :1], (2, 3, T)))


@pytest.mark.parametrize('kind', KINDS)
def test_trajectory_consistency(small, kind):
  _, traj, _ = small[kind]
  np.testing.assert_array_equal(traj.x_in[:, :, 1:], traj.x_next[:, :, :-1])
  if kind != 'cosmos_2ab':
    np.testing.assert_array_equal(traj.x_in[:, :, 0], traj.noise)
    np.testing.assert_array_equal(traj.x0, traj.x_next[:, :, -1])
    np.testing.assert_array_equal(traj.x0_prev, 0.0)


@pytest.mark.parametrize('kind', KINDS)
def test_stored_means_match_numpy_kernels(small, tiny_mlp, kind):
  s, traj, cond = small[kind]
  _, _, t_in, _, _ = np_schedule(kind)
  for i in range(T):
    x_in = traj.x_in[:, :, i].astype(np.float64)
    v = _velocity(tiny_mlp, kind, x_in, t_in[i], cond)
    ref = np_step_mean(kind, x_in, v, traj.x0_prev[:, :, i].astype(np.float64), i, s)
    scale = 1.0 + np.abs(x_in).max()
    np.testing.assert_allclose(traj.mean[:, :, i], ref, rtol=1e-5, atol=2e-6 * scale, err_msg=f'step {i}')
    np.testing.assert_allclose(traj.std[:, :, i], np_std(kind, i, s), rtol=1e-5, atol=1e-7)


def test_cosmos_x0_prev_and_final_sample(small, tiny_mlp):
  s, traj, cond = small['cosmos_2ab']
  _, _, t_in, _, eta = np_schedule('cosmos_2ab')
  np.testing.assert_array_equal(traj.x0_prev[:, :, 0], 0.0)
  for i in range(T - 1):
    x_in = traj.x_in[:, :, i].astype(np.float64)
    v = _velocity(tiny_mlp, 'cosmos_2ab', x_in, t_in[i], cond)
    x0 = (1 - t_in[i]) * x_in - t_in[i] * v
    np.testing.assert_allclose(traj.x0_prev[:, :, i + 1], x0, rtol=1e-4, atol=1e-5 * (1 + np.abs(x_in).max()))
  # Final clean call at sigma_min on the last (unchurned) mean.
  t_min = 0.01 / 1.01
  m = traj.mean[:, :, -1].astype(np.float64)
  v = _velocity(tiny_mlp, 'cosmos_2ab', m, t_min, cond)
  np.testing.assert_allclose(traj.x0, (1 - t_min) * m - t_min * v, rtol=1e-5, atol=1e-5)
  # std of step i = sigma_{i+1} sqrt(eta^2 + 2 eta), eta = churn_eta(1, T)
  assert eta == pytest.approx(sampling.churn_eta(1.0, T))
  lo, hi = 0.01 ** (1 / 7), 200.0 ** (1 / 7)
  sig_next = np.array([(hi + k / T * (lo - hi)) ** 7 for k in range(1, T + 1)])
  np.testing.assert_allclose(traj.std[0, 0], sig_next * np.sqrt(eta**2 + 2 * eta), rtol=1e-5)


@pytest.mark.parametrize('kind', KINDS)
def test_log_prob_is_gaussian_density_of_transition(small, kind):
  _, traj, _ = small[kind]
  pos = traj.std[0, 0] > 0
  assert pos.sum() >= T - 1
  x, m, sd = traj.x_next[:, :, pos], traj.mean[:, :, pos], traj.std[:, :, pos]
  ref = stats.norm.logpdf(x.astype(np.float64), m.astype(np.float64),
                          sd.astype(np.float64)[..., None]).mean(-1)
  got = rl.gaussian_log_prob(jnp.asarray(x), jnp.asarray(m), jnp.asarray(sd), batch_ndim=3)
  chex.assert_shape(got, ref.shape)
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('kind', KINDS)
def test_stored_std_is_the_real_noise(big, kind):
  traj = big[kind]
  pos = traj.std[0, 0] > 0
  z = (traj.x_next[:, :, pos].astype(np.float64) - traj.mean[:, :, pos]) / traj.std[:, :, pos][..., None]
  # pooled over (B=4, N=64, steps, 2 elems)
  assert abs(z.mean()) < 0.05, z.mean()
  assert abs(z.std() - 1) < 0.05, z.std()
  # per step (512 draws each)
  for j in range(z.shape[2]):
    assert abs(z[:, :, j].mean()) < 0.2
    assert abs(z[:, :, j].std() - 1) < 0.1, (j, z[:, :, j].std())
  # independent across steps
  flat = z.transpose(2, 0, 1, 3).reshape(z.shape[2], -1)
  corr = np.corrcoef(flat)
  assert np.abs(corr - np.eye(len(corr))).max() < 0.15
  if kind == 'cosmos_2ab':
    # initial churn: x_in_0 = sigma_max eps + sigma_max sqrt((1 + eta)^2 - 1) z
    eta = sampling.churn_eta(1.0, T)
    z0 = (traj.x_in[:, :, 0] - 200.0 * traj.noise) / (200.0 * np.sqrt((1 + eta)**2 - 1))
    assert abs(z0.mean()) < 0.1 and abs(z0.std() - 1) < 0.1
  # the initial noise is standard normal
  assert abs(traj.noise.mean()) < 0.1 and abs(traj.noise.std() - 1) < 0.1


@pytest.mark.parametrize('kind', KINDS)
def test_deterministic_sampler(tiny_mlp, kind):
  s = _sampler(kind).deterministic()
  assert s.noise == 0.0 and s.sigmas == _sampler(kind).sigmas
  traj = s.rollout(tiny_mlp.apply_fn, tiny_mlp.params, _cond(2), jax.random.key(3), num_rollouts=2,
                   sample_shape=(2,))
  np.testing.assert_array_equal(np.asarray(traj.std), 0.0)
  np.testing.assert_array_equal(np.asarray(traj.x_next), np.asarray(traj.mean))
  if kind == 'cosmos_2ab':
    np.testing.assert_allclose(np.asarray(traj.x_in[:, :, 0]), 200.0 * np.asarray(traj.noise), rtol=1e-6)


@pytest.mark.parametrize('kind', KINDS)
def test_rollouts_get_different_noise(small, kind):
  _, traj, _ = small[kind]
  flat = traj.noise.reshape(6, 2)
  d = np.abs(flat[:, None] - flat[None]).min(-1) + np.eye(6)
  assert (d > 0).all()
  pos = traj.std[0, 0] > 0
  xn = traj.x_next[:, :, pos].reshape(6, -1)
  assert (np.abs(xn[:, None] - xn[None]).max(-1) + np.eye(6) > 1e-3).all()


@pytest.mark.parametrize('kind', KINDS)
def test_sample_equals_rollout_x0(small, tiny_mlp, kind):
  s, traj, cond = small[kind]
  x0 = s.sample(tiny_mlp.apply_fn, tiny_mlp.params, cond, jax.random.key(0), num_rollouts=3,
                sample_shape=(2,))
  chex.assert_shape(x0, (2, 3, 2))
  np.testing.assert_allclose(np.asarray(x0), traj.x0, rtol=1e-5, atol=1e-5)
  # a different key gives a different sample
  x0b = s.sample(tiny_mlp.apply_fn, tiny_mlp.params, cond, jax.random.key(9), num_rollouts=3,
                 sample_shape=(2,))
  assert np.abs(np.asarray(x0b) - traj.x0).max() > 1e-3


def test_unknown_kind_raises():
  with pytest.raises(ValueError):
    sampling.make_sampler('euler', 4)
  with pytest.raises(ValueError):
    sampling.Sampler(kind='euler', sigmas=(1.0, 0.0), noise=0.0)
