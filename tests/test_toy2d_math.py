"""Toy 2-D task math: the closed-form tilted optimum against Monte-Carlo importance weighting, and the
evaluation metrics against scipy / hand-derived values."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from scipy.special import logsumexp

from ddrl_jax.tasks import toy2d

MEANS = np.array([[-2.0, 0.0], [2.0, 0.0], [0.0, 2.5]])
STD = 0.5
WEIGHTS = np.array([0.5, 0.3, 0.2])
W = np.array([1.0, 0.5])
BETA = 1.5


def np_gmm_sample(rng, num, means=MEANS, std=STD, weights=WEIGHTS):
  comp = rng.choice(len(weights), size=num, p=weights)
  return means[comp] + std * rng.randn(num, 2), comp


def np_mixture_logpdf(x, means, std, weights):
  comps = np.stack([stats.multivariate_normal(m, std**2 * np.eye(2)).logpdf(x) for m in means], -1)
  return logsumexp(comps + np.log(weights), axis=-1)


@pytest.fixture(scope='module')
def mc():
  rng = np.random.RandomState(0)
  x, comp = np_gmm_sample(rng, 400_000)
  logw = (x @ W) / BETA
  w = np.exp(logw - logw.max())
  return x, comp, w / w.sum(), logw


def test_tilted_gmm_matches_importance_weighting(mc):
  x, comp, w, _ = mc
  t_means, t_weights = toy2d.tilted_gmm(MEANS, STD, WEIGHTS, W, BETA)
  assert t_means.shape == (3, 2) and t_weights.shape == (3,)
  assert t_weights.sum() == pytest.approx(1.0)
  frac = np.array([w[comp == k].sum() for k in range(3)])
  np.testing.assert_allclose(t_weights, frac, atol=1e-2)
  np.testing.assert_allclose((t_weights[:, None] * t_means).sum(0), (w[:, None] * x).sum(0), atol=1e-2)
  for k in range(3):
    mk = (w[comp == k, None] * x[comp == k]).sum(0) / frac[k]
    np.testing.assert_allclose(t_means[k], mk, atol=2e-2)
  # the tilt moves mass toward w and shifts every mean by s^2 w / beta
  np.testing.assert_allclose(t_means - MEANS, np.broadcast_to(STD**2 * W / BETA, (3, 2)), atol=1e-12)
  assert t_weights[1] > WEIGHTS[1] and t_weights[0] < WEIGHTS[0]


def test_log_partition_matches_monte_carlo(mc):
  *_, logw = mc
  z_mc = BETA * (logsumexp(logw) - np.log(len(logw)))
  z = toy2d.log_partition(MEANS, STD, WEIGHTS, W, BETA)
  assert abs(z - z_mc) < 1e-2, (z, z_mc)


def test_tilted_density_is_data_density_times_exp_reward():
  """log p*(x) = log p_data(x) + r(x)/beta - Z/beta at every x (scipy densities)."""
  t_means, t_weights = toy2d.tilted_gmm(MEANS, STD, WEIGHTS, W, BETA)
  z = toy2d.log_partition(MEANS, STD, WEIGHTS, W, BETA)
  x = np.random.RandomState(1).uniform(-4, 4, (200, 2))
  lhs = np_mixture_logpdf(x, t_means, STD, t_weights)
  rhs = np_mixture_logpdf(x, MEANS, STD, WEIGHTS) + (x @ W) / BETA - z / BETA
  np.testing.assert_allclose(lhs, rhs, atol=1e-8)


def test_gmm_log_density_matches_scipy():
  x = np.random.RandomState(2).uniform(-5, 5, (100, 2)).astype(np.float32)
  got = np.asarray(toy2d.gmm_log_density(jnp.asarray(x), MEANS, STD, WEIGHTS))
  np.testing.assert_allclose(got, np_mixture_logpdf(x.astype(np.float64), MEANS, STD, WEIGHTS),
                             rtol=1e-5, atol=1e-4)
  # integrates to one on a grid
  h = 0.025
  g1, g2 = np.meshgrid(np.arange(-6, 6, h) + h / 2, np.arange(-5, 7, h) + h / 2)
  pts = jnp.asarray(np.stack([g1.ravel(), g2.ravel()], -1), jnp.float32)
  mass = float(jnp.exp(toy2d.gmm_log_density(pts, MEANS, STD, WEIGHTS)).sum()) * h * h
  assert mass == pytest.approx(1.0, abs=2e-3)


def test_gmm_sample_moments():
  x = np.asarray(toy2d.gmm_sample(jax.random.key(0), 100_000, MEANS, STD, WEIGHTS))
  np.testing.assert_allclose(x.mean(0), WEIGHTS @ MEANS, atol=0.02)
  comp = np.argmin(((x[:, None] - MEANS[None]) ** 2).sum(-1), axis=1)
  np.testing.assert_allclose(np.bincount(comp, minlength=3) / len(x), WEIGHTS, atol=0.01)


def test_sliced_wasserstein():
  rng = np.random.RandomState(3)
  a = jnp.asarray(rng.randn(2000, 2), jnp.float32)
  key = jax.random.key(5)
  assert float(toy2d.sliced_wasserstein(a, a, key)) < 1e-6
  # same cloud in another order: still 0
  assert float(toy2d.sliced_wasserstein(a, a[::-1], key)) < 1e-6
  d = np.array([1.0, -0.5], np.float32)
  sw = float(toy2d.sliced_wasserstein(a, a + d, key))
  # a pure shift moves every sorted projection by d.theta: SW = mean_theta |d.theta|
  dirs = np.asarray(jax.random.normal(key, (256, 2)), np.float64)
  dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
  assert sw == pytest.approx(np.abs(dirs @ d).mean(), rel=1e-4)
  # over uniform directions E|d.theta| = 2|d|/pi
  assert sw == pytest.approx(2 * np.linalg.norm(d) / np.pi, rel=0.1)
  # independent samples of the same law are much closer than shifted ones
  b = jnp.asarray(rng.randn(2000, 2), jnp.float32)
  assert float(toy2d.sliced_wasserstein(a, b, key)) < 0.1 * sw


def test_off_manifold_fraction():
  rng = np.random.RandomState(4)
  x, _ = np_gmm_sample(rng, 100_000)
  frac = float(toy2d.off_manifold_fraction(jnp.asarray(x, jnp.float32), MEANS, STD))
  # P(|z| > 3) for a 2-D standard normal = exp(-9/2) (chi-2 tail); components are well separated.
  assert frac < 0.02
  assert frac == pytest.approx(np.exp(-4.5), abs=2e-3)
  far = jnp.asarray([[20.0, 20.0], [-10.0, 0.0], [0.0, -8.0]])
  assert float(toy2d.off_manifold_fraction(far, MEANS, STD)) == 1.0
  assert float(toy2d.off_manifold_fraction(jnp.asarray(MEANS, jnp.float32), MEANS, STD)) == 0.0
