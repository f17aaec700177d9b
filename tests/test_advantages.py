"""Group advantages against numpy re-derivations."""
import chex
import numpy as np
import pytest
from scipy.special import logsumexp

from ddrl_jax import rl


def np_group_adv(r, n, clip=5.0, eps=1e-4, transform=None):
  g = np.asarray(r, np.float64).reshape(-1, n).copy()
  for row in g:
    ok = np.isfinite(row)
    row[~ok] = row[ok].mean() if ok.any() else 0.0
  a = (g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + eps)
  if transform == 'neg_exp':
    a = -np.exp(-a)
  if clip is not None:
    a = np.clip(a, -clip, clip)
  return a.reshape(-1)


def test_zscore_unbiased_std():
  rng = np.random.RandomState(0)
  r = rng.randn(3 * 8).astype(np.float32) * 2 + 1
  got = np.asarray(rl.group_advantages(r, 8))
  chex.assert_shape(got, (24,))
  np.testing.assert_allclose(got, np_group_adv(r, 8), rtol=1e-5, atol=1e-5)
  # ddof=1 matters: the biased std would give a visibly different result
  g = r.reshape(3, 8).astype(np.float64)
  biased = ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-4)).reshape(-1)
  assert np.abs(got - biased).max() > 1e-2
  # groups are consecutive: each group's advantages sum to ~0
  np.testing.assert_allclose(got.reshape(3, 8).sum(1), 0.0, atol=1e-4)


def test_eps_in_denominator():
  r = np.array([0.0, 0.0, 0.0, 1e-4], np.float32)
  got = np.asarray(rl.group_advantages(r, 4))
  np.testing.assert_allclose(got, np_group_adv(r, 4), rtol=1e-4)
  # with std = 5e-5 and eps = 1e-4 the advantage of the top member is 0.75e-4 / 1.5e-4 = 0.5
  assert got[-1] == pytest.approx(0.75e-4 / (5e-5 + 1e-4), rel=1e-3)
  # constant group: all zero, no NaN
  np.testing.assert_array_equal(np.asarray(rl.group_advantages(np.ones(4), 4)), 0.0)


def test_clamp_with_outlier():
  n = 64
  r = np.zeros(n, np.float32)
  r[5] = 10.0
  raw = np_group_adv(r, n, clip=None)
  assert raw[5] > 5.0  # (n-1)/sqrt(n) ~ 7.9
  got = np.asarray(rl.group_advantages(r, n))
  assert got[5] == pytest.approx(5.0)
  np.testing.assert_allclose(got, np_group_adv(r, n), rtol=1e-5, atol=1e-6)
  # negative outlier clamps at -5
  got = np.asarray(rl.group_advantages(-r, n))
  assert got[5] == pytest.approx(-5.0)
  # no clamp
  np.testing.assert_allclose(np.asarray(rl.group_advantages(r, n, clip=None)), raw, rtol=1e-5)


def test_neg_exp_transform():
  rng = np.random.RandomState(1)
  r = rng.randn(2 * 16).astype(np.float32)
  r[3] = -8.0   # -exp(-A) with A very negative exceeds -5 -> clamped
  got = np.asarray(rl.group_advantages(r, 16, transform='neg_exp'))
  a = np_group_adv(r, 16, clip=None)
  np.testing.assert_allclose(got, np.clip(-np.exp(-a), -5, 5), rtol=1e-5, atol=1e-6)
  assert got[3] == pytest.approx(-5.0)
  assert (got < 0).all()
  with pytest.raises(ValueError):
    rl.group_advantages(r, 16, transform='exp')


def test_nan_rewards():
  r = np.array([1.0, np.nan, 3.0, 4.0, 0.5, 2.0, np.nan, np.nan], np.float32)
  got = np.asarray(rl.group_advantages(r, 4))
  assert np.isfinite(got).all()
  assert got[1] == 0.0 and got[6] == 0.0 and got[7] == 0.0
  # others: z-score with NaN replaced by the group's valid mean
  filled = np.array([1.0, 8 / 3, 3.0, 4.0, 0.5, 2.0, 1.25, 1.25])
  ref = np_group_adv(filled, 4)
  mask = np.isfinite(r)
  np.testing.assert_allclose(got[mask], ref[mask], rtol=1e-5, atol=1e-6)
  # the filled value does not move the group mean
  f, valid = rl.fill_failed(r, 4)
  np.testing.assert_allclose(np.asarray(f).reshape(-1), filled, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(valid).reshape(-1), mask)


def test_all_nan_group():
  r = np.array([np.nan] * 4 + [1.0, 2.0, 3.0, 5.0], np.float32)
  got = np.asarray(rl.group_advantages(r, 4))
  assert np.isfinite(got).all()
  np.testing.assert_array_equal(got[:4], 0.0)
  np.testing.assert_allclose(got[4:], np_group_adv(r[4:], 4), rtol=1e-5)
  got = np.asarray(rl.exact_tilt_advantages(r, 4, beta=1.0))
  assert np.isfinite(got).all()
  np.testing.assert_array_equal(got[:4], 0.0)


def test_bad_args():
  with pytest.raises(ValueError):
    rl.group_advantages(np.zeros(4), 1)
  with pytest.raises(ValueError):
    rl.group_advantages(np.zeros(5), 2)      # N does not divide
  with pytest.raises(ValueError):
    rl.group_advantages(np.zeros((2, 4)), 4)  # not flat


@pytest.mark.parametrize('beta', [0.5, 2.0])
def test_exact_tilt_advantages(beta):
  rng = np.random.RandomState(2)
  n = 8
  r = rng.randn(3 * n).astype(np.float32)
  g = r.reshape(3, n).astype(np.float64)
  z = beta * np.log(np.mean(np.exp(g / beta), axis=1, keepdims=True))
  ref = (-np.exp(-(g - z) / beta)).reshape(-1)
  got = np.asarray(rl.exact_tilt_advantages(r, n, beta))
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  assert (got < 0).all()
  # mean over the group of exp(-(r - Z)/beta) ... with the self-normalized Z: mean(-A * e^{... }) check
  # E[exp((r - Z)/beta)] = 1 per group by definition of Z
  np.testing.assert_allclose(np.mean(np.exp((g - z) / beta), axis=1), 1.0, rtol=1e-12)
  # explicit log partition
  z_exp = 0.3
  got = np.asarray(rl.exact_tilt_advantages(r, n, beta, log_partition=z_exp))
  np.testing.assert_allclose(got, -np.exp(-(r.astype(np.float64) - z_exp) / beta), rtol=1e-5)


def test_exact_tilt_nan_and_large_rewards():
  beta = 0.1
  r = np.array([50.0, 51.0, np.nan, 49.5], np.float32)   # exp(r/beta) overflows float32 without logsumexp
  got = np.asarray(rl.exact_tilt_advantages(r, 4, beta))
  valid = np.isfinite(r)
  rv = r[valid].astype(np.float64)
  z = beta * (logsumexp(rv / beta) - np.log(len(rv)))
  np.testing.assert_allclose(got[valid], -np.exp(-(rv - z) / beta), rtol=1e-4)
  assert got[2] == 0.0
