"""Transition kernels against numpy re-implementations of the reference formulas.

References: yifan123/flow_grpo flow_grpo/diffusers_patch/sd3_sde_with_logprob.py (FlowGRPO), XueZeyue/DanceGRPO
fastvideo/train_grpo_flux.py `flux_step` (DanceGRPO), kvablack/ddpo-pytorch ddim_with_logprob.py (DDPO) and
nvidia-cosmos/cosmos-rl's WFM sampler (cosmos 2AB, the RES 2AB solver with churn).
"""
import numpy as np
import pytest
from scipy import integrate

from ddrl_jax import sampling
from ddrl_jax.sampling import transitions

RTOL, ATOL = 2e-5, 2e-6

# Pairs (sigma, sigma_next) from a shifted schedule, including the first (sigma == 1) and last (-> 0) steps.
# The samplers pass float32 sigmas, so the kernels get float32 scalars here too and the references use the
# same (float32-rounded) values in float64.
FLOW_PAIRS = [(np.float32(a), np.float32(b)) for a, b in
              [(1.0, 0.9), (0.9, 0.75), (0.75, 0.5), (0.5, 0.2), (0.3, 0.05), (0.2, 0.0)]]


def _xv(seed=0, shape=(3, 4)):
  rng = np.random.RandomState(seed)
  return rng.randn(*shape), rng.randn(*shape)


# ------------------------------------------------------------------------------- numpy references
def np_flow_grpo(x, v, sigma, sigma_next, a):
  """FlowGRPO sde_step_with_logprob in the doc's expanded form."""
  dt = sigma_next - sigma
  sigma_tilde = sigma_next if sigma == 1.0 else sigma
  s = a * np.sqrt(sigma / (1.0 - sigma_tilde))
  mean = x * (1.0 + s**2 * dt / (2.0 * sigma)) + v * (1.0 + s**2 * (1.0 - sigma) / (2.0 * sigma)) * dt
  return mean, s * np.sqrt(-dt)


def np_dance(x, v, sigma, sigma_next, eta):
  """DanceGRPO flux_step: mu = x + dsigma v - 1/2 eta^2 score dsigma, score = -(x - (1-sigma) x0)/sigma^2."""
  dsigma = sigma_next - sigma
  x0 = x - sigma * v
  score = -(x - (1.0 - sigma) * x0) / sigma**2
  mean = x + dsigma * v - 0.5 * eta**2 * score * dsigma
  return mean, eta * np.sqrt(sigma - sigma_next)


def np_ddpm_posterior(x, v, t, s):
  """q(x_s | x_t, x0 = x0_hat) for x_u = a_u x0 + b_u eps, a = 1 - u, b = u, derived from the Markov chain
  x_t = (a_t / a_s) x_s + b_{t|s} eps', b_{t|s}^2 = b_t^2 - (a_t / a_s)^2 b_s^2."""
  a_t, b_t, a_s, b_s = 1.0 - t, t, 1.0 - s, s
  x0 = x - t * v
  a_ts = a_t / a_s
  var_ts = b_t**2 - a_ts**2 * b_s**2
  cov = a_ts * b_s**2                     # Cov(x_s, x_t | x0) per element
  mean = a_s * x0 + cov / b_t**2 * (x - a_t * x0)
  var = b_s**2 - cov**2 / b_t**2          # = b_s^2 var_ts / b_t^2
  np.testing.assert_allclose(var, b_s**2 * var_ts / b_t**2, rtol=1e-9, atol=1e-15)
  return mean, np.sqrt(max(var, 0.0))


def np_ddpo_vp(x, v, t, s, eta):
  """DDPO's DDIM(eta) in VP form: rescale the RF state by c = sqrt(a^2 + b^2), abar = a^2 / c^2, apply
  std_vp = eta sqrt((1-abar_s)/(1-abar_t)) sqrt(1 - abar_t/abar_s), mu_vp = sqrt(abar_s) x0 +
  sqrt(1 - abar_s - std_vp^2) eps, then scale back by c_s."""
  c_t, c_s = np.hypot(1 - t, t), np.hypot(1 - s, s)
  abar_t, abar_s = (1 - t)**2 / c_t**2, (1 - s)**2 / c_s**2
  x_vp = x / c_t
  x0 = x - t * v                                   # x0 is the same in both parameterizations
  eps = (x_vp - np.sqrt(abar_t) * x0) / np.sqrt(1 - abar_t)
  std_vp = eta * np.sqrt((1 - abar_s) / (1 - abar_t)) * np.sqrt(max(1 - abar_t / abar_s, 0.0))
  mean_vp = np.sqrt(abar_s) * x0 + np.sqrt(max(1 - abar_s - std_vp**2, 0.0)) * eps
  return c_s * mean_vp, c_s * std_vp


def np_euler(x, v, sigma, sigma_next):
  return x + v * (sigma_next - sigma)


# ------------------------------------------------------------------------------------- flow kernels
@pytest.mark.parametrize('sigma,sigma_next', FLOW_PAIRS)
@pytest.mark.parametrize('a', [0.7, 1.2])
def test_flow_sde_step(sigma, sigma_next, a):
  x, v = _xv(1)
  mean, std = transitions.flow_sde_step(x.astype(np.float32), v.astype(np.float32), sigma, sigma_next, a)
  ref_mean, ref_std = np_flow_grpo(x, v, sigma, sigma_next, a)
  np.testing.assert_allclose(np.asarray(mean), ref_mean, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(float(std), ref_std, rtol=RTOL)


def test_flow_sde_sigma_one_substitution():
  x, v = _xv(2)
  # At sigma == 1, s = a sqrt(1 / (1 - sigma_next)) so std = s sqrt(1 - sigma_next) = a exactly.
  for a, sn in [(0.7, 0.9), (0.9, 0.5), (1.2, 0.97)]:
    mean, std = transitions.flow_sde_step(x, v, 1.0, sn, a)
    assert np.isfinite(np.asarray(mean)).all()
    np.testing.assert_allclose(float(std), a, rtol=1e-6)


@pytest.mark.parametrize('sigma,sigma_next', FLOW_PAIRS)
def test_flow_sde_zero_noise_is_euler(sigma, sigma_next):
  x, v = _xv(3)
  mean, std = transitions.flow_sde_step(x, v, sigma, sigma_next, 0.0)
  np.testing.assert_allclose(np.asarray(mean), np_euler(x, v, sigma, sigma_next), rtol=RTOL, atol=ATOL)
  assert float(std) == 0.0


@pytest.mark.parametrize('sigma,sigma_next', [p for p in FLOW_PAIRS])
@pytest.mark.parametrize('eta', [0.3, 1.0])
def test_dance_sde_step(sigma, sigma_next, eta):
  x, v = _xv(4)
  mean, std = transitions.dance_sde_step(x, v, sigma, sigma_next, eta)
  ref_mean, ref_std = np_dance(x, v, sigma, sigma_next, eta)
  np.testing.assert_allclose(np.asarray(mean), ref_mean, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(float(std), eta * np.sqrt(sigma - sigma_next), rtol=1e-6)
  np.testing.assert_allclose(float(std), ref_std, rtol=1e-6)


@pytest.mark.parametrize('sigma,sigma_next', FLOW_PAIRS)
def test_ddim_eta1_is_ddpm_posterior(sigma, sigma_next):
  x, v = _xv(5)
  mean, std = transitions.ddim_step(x, v, sigma, sigma_next, 1.0)
  ref_mean, ref_std = np_ddpm_posterior(x, v, sigma, sigma_next)
  np.testing.assert_allclose(float(std), ref_std, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(mean), ref_mean, rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize('sigma,sigma_next', FLOW_PAIRS)
@pytest.mark.parametrize('eta', [0.0, 0.5, 1.0])
def test_ddim_matches_ddpo_vp_formula(sigma, sigma_next, eta):
  x, v = _xv(6)
  mean, std = transitions.ddim_step(x, v, sigma, sigma_next, eta)
  ref_mean, ref_std = np_ddpo_vp(x, v, sigma, sigma_next, eta)
  np.testing.assert_allclose(float(std), ref_std, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(mean), ref_mean, rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize('sigma,sigma_next', FLOW_PAIRS)
def test_ddim_eta0_is_euler(sigma, sigma_next):
  x, v = _xv(7)
  mean, std = transitions.ddim_step(x, v, sigma, sigma_next, 0.0)
  np.testing.assert_allclose(np.asarray(mean), np_euler(x, v, sigma, sigma_next), rtol=RTOL, atol=1e-5)
  assert float(std) == 0.0


def test_ddim_last_step_is_x0_hat():
  x, v = _xv(8)
  mean, std = transitions.ddim_step(x, v, 0.3, 0.0, 1.0)
  np.testing.assert_allclose(np.asarray(mean), x - 0.3 * v, rtol=RTOL, atol=ATOL)
  assert float(std) == 0.0


def test_kernels_are_elementwise_and_broadcast():
  """Per-sample sigmas broadcast against (batch, *S) states like vmapping per sample would."""
  x, v = _xv(9, (3, 2))
  sig = np.array([[0.9], [0.5], [0.3]])
  sig_n = np.array([[0.75], [0.2], [0.0]])
  mean, std = transitions.dance_sde_step(x, v, sig, sig_n, 0.5)
  for i in range(3):
    m, s = np_dance(x[i], v[i], sig[i, 0], sig_n[i, 0], 0.5)
    np.testing.assert_allclose(np.asarray(mean)[i], m, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(std)[i, 0], s, rtol=1e-6)


# ------------------------------------------------------------------------------------------ cosmos
def test_cosmos_x0_recovers_clean_sample():
  """With the true velocity v = eps - x0 at x_sigma = x0 + sigma eps, cosmos_x0 returns x0."""
  rng = np.random.RandomState(0)
  x0, eps = rng.randn(4, 3), rng.randn(4, 3)
  for sigma in [0.01, 1.0, 50.0]:
    t = sigma / (1 + sigma)
    got = transitions.cosmos_x0(x0 + sigma * eps, eps - x0, t)
    np.testing.assert_allclose(np.asarray(got), x0, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('sigma_hat,sigma_next', [(209.5, 120.0), (3.0, 1.5), (0.08, 0.01)])
def test_cosmos_first_step_is_euler(sigma_hat, sigma_next):
  rng = np.random.RandomState(1)
  x_hat, x0 = sigma_hat * rng.randn(5), rng.randn(5)
  got = sampling.cosmos_2ab_mean(x_hat, x0, sigma_hat, sigma_next, None, None)
  ref = x_hat + (sigma_next - sigma_hat) * (x_hat - x0) / sigma_hat   # Euler in sigma: dx/dsigma = (x - x0)/sigma
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('sigma_hat,sigma_next,sigma_hat_prev', [
    (100.0, 40.0, 250.0), (3.0, 1.5, 7.0), (0.08, 0.01, 0.2), (1.0, 0.9, 1.2)])
def test_cosmos_2ab_constant_x0_is_exact(sigma_hat, sigma_next, sigma_hat_prev):
  """For x0 constant, the VE ODE dx/dsigma = (x - x0)/sigma has solution x0 + (sigma'/sigma)(x - x0)."""
  rng = np.random.RandomState(2)
  x_hat, x0 = sigma_hat * rng.randn(6) + 1.0, rng.randn(6)
  got = sampling.cosmos_2ab_mean(x_hat, x0, sigma_hat, sigma_next, x0, sigma_hat_prev)
  r = sigma_next / sigma_hat
  np.testing.assert_allclose(np.asarray(got), r * x_hat + (1 - r) * x0, rtol=1e-5, atol=1e-5)


def _exp_integrator_linear_x0(x_hat, x0, sigma_hat, sigma_next, x0_prev, sigma_hat_prev):
  """Exact solution of dx/du = x - x0(u) (u = ln sigma) from u_hat to u_next with x0(u) linearly extrapolated
  through (u_prev, x0_prev) and (u_hat, x0); the integrals are done numerically."""
  u_h, u_n, u_p = np.log(sigma_hat), np.log(sigma_next), np.log(sigma_hat_prev)
  h = u_h - u_n
  slope = (x0 - x0_prev) / (u_h - u_p)               # d x0 / du
  i0 = integrate.quad(lambda tau: np.exp(tau - h), 0, h, epsabs=1e-13, epsrel=1e-13)[0]
  i1 = integrate.quad(lambda tau: tau * np.exp(tau - h), 0, h, epsabs=1e-13, epsrel=1e-13)[0]
  # x(u_n) = e^{-h} x_hat + int_0^h e^{tau - h} x0(u_h - tau) dtau,  x0(u_h - tau) = x0 - slope tau
  return np.exp(-h) * x_hat + i0 * x0 - i1 * slope


@pytest.mark.parametrize('sigma_hat,sigma_next,sigma_hat_prev', [
    (100.0, 40.0, 250.0), (3.0, 1.5, 7.0), (0.5, 0.1, 0.6), (1.0, 0.9, 1.2)])
def test_cosmos_2ab_equals_exponential_integrator_of_linear_x0(sigma_hat, sigma_next, sigma_hat_prev):
  rng = np.random.RandomState(3)
  x_hat, x0, x0_prev = sigma_hat * rng.randn(6), rng.randn(6), rng.randn(6)
  got = sampling.cosmos_2ab_mean(x_hat, x0, sigma_hat, sigma_next, x0_prev, sigma_hat_prev)
  ref = _exp_integrator_linear_x0(x_hat, x0, sigma_hat, sigma_next, x0_prev, sigma_hat_prev)
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-5 * max(1.0, sigma_hat))


def test_cosmos_2ab_is_second_order():
  """On a smooth x0(u), the one-step error of 2AB is O(h^3) (second order) while first-step Euler is O(h^2)."""
  x0_fn = lambda u: np.array([np.sin(3 * u), np.cos(2 * u) + u])
  u_h = np.log(2.0)
  x_hat = np.array([0.3, -0.7])

  def exact(h):
    u_n = u_h - h
    out = np.exp(-h) * x_hat
    for d in range(2):
      out[d] += integrate.quad(lambda tau: np.exp(tau - h) * x0_fn(u_h - tau)[d], 0, h,
                               epsabs=1e-14, epsrel=1e-14)[0]
    return out, np.exp(u_n)

  errs_ab, errs_euler = [], []
  hs = [0.1, 0.05, 0.025]
  for h in hs:
    ref, sigma_next = exact(h)
    sigma_hat, sigma_prev = np.exp(u_h), np.exp(u_h + h)
    ab = sampling.cosmos_2ab_mean(x_hat, x0_fn(u_h), sigma_hat, sigma_next, x0_fn(u_h + h), sigma_prev)
    eu = sampling.cosmos_2ab_mean(x_hat, x0_fn(u_h), sigma_hat, sigma_next, None, None)
    errs_ab.append(np.abs(np.asarray(ab, np.float64) - ref).max())
    errs_euler.append(np.abs(np.asarray(eu, np.float64) - ref).max())
  for i in range(len(hs) - 1):
    assert errs_ab[i] / errs_ab[i + 1] > 6.0, errs_ab        # ~8 for O(h^3)
    assert 3.0 < errs_euler[i] / errs_euler[i + 1] < 5.0, errs_euler  # ~4 for O(h^2)
  assert errs_ab[-1] < 0.25 * errs_euler[-1], (errs_ab, errs_euler)


def test_cosmos_2ab_traced_matches_untraced():
  rng = np.random.RandomState(4)
  x_hat, x0, x0p = 3 * rng.randn(4), rng.randn(4), rng.randn(4)
  first = transitions.cosmos_2ab_mean_traced(x_hat, x0, 3.0, 1.5, x0p, 7.0, True)
  later = transitions.cosmos_2ab_mean_traced(x_hat, x0, 3.0, 1.5, x0p, 7.0, False)
  r = 1.5 / 3.0
  np.testing.assert_allclose(np.asarray(first), r * x_hat + (1 - r) * x0, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(later),
                             _exp_integrator_linear_x0(x_hat, x0, 3.0, 1.5, x0p, 7.0), rtol=1e-4, atol=1e-5)
