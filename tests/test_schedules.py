"""Schedules against closed forms computed independently (python floats / hard-coded values)."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from ddrl_jax import sampling


@pytest.mark.parametrize('num_steps', [1, 5, 10, 20])
@pytest.mark.parametrize('sigma_min,sigma_max', [(0.01, 200.0), (0.002, 80.0)])
def test_karras_endpoints_monotone_length(num_steps, sigma_min, sigma_max):
  s = np.asarray(sampling.karras_sigmas(num_steps, sigma_min, sigma_max))
  assert s.shape == (num_steps + 1,)
  assert abs(s[0] - sigma_max) <= 1e-9 * sigma_max
  assert abs(s[-1] - sigma_min) <= 1e-9 * sigma_min
  assert np.all(np.diff(s) < 0)


@pytest.mark.parametrize('num_steps,k', [(10, 5), (20, 7), (7, 3)])
def test_karras_middle_matches_closed_form(num_steps, k):
  smin, smax, rho = 0.01, 200.0, 7.0
  s = sampling.karras_sigmas(num_steps, smin, smax, rho)
  # sigma_k = (smax^(1/rho) + k/N (smin^(1/rho) - smax^(1/rho)))^rho, with python floats.
  expected = math.pow(math.pow(smax, 1 / rho) + (k / num_steps) * (math.pow(smin, 1 / rho) -
                                                                    math.pow(smax, 1 / rho)), rho)
  assert s[k] == pytest.approx(expected, rel=1e-12)
  # Karras spacing: sigma^(1/rho) is linear in k.
  root = np.asarray(s, np.float64) ** (1 / rho)
  np.testing.assert_allclose(np.diff(root), np.full(num_steps, np.diff(root)[0]), rtol=1e-9)


def test_karras_cosmos_values():
  # The doc's numbers: 21 values, sigma_hat_0 = (1 + 1/21) * 200 ~ 209.5.
  s = sampling.karras_sigmas(20)
  assert len(s) == 21
  assert (1 + sampling.churn_eta(1.0, 20)) * s[0] == pytest.approx(209.52, abs=0.01)


def test_rf_time():
  assert sampling.rf_time(1.0) == pytest.approx(0.5)
  assert sampling.rf_time(0.0) == 0.0
  sig = np.array([0.01, 0.5, 3.0, 200.0])
  t = sampling.rf_time(sig)
  np.testing.assert_allclose(t, [0.01 / 1.01, 0.5 / 1.5, 0.75, 200 / 201], rtol=1e-12)
  # Inverse: sigma = t / (1 - t).
  np.testing.assert_allclose(t / (1 - t), sig, rtol=1e-10)
  tj = sampling.rf_time(jnp.asarray(sig, jnp.float32))
  assert isinstance(tj, jnp.ndarray)
  np.testing.assert_allclose(np.asarray(tj), t, rtol=1e-6)


@pytest.mark.parametrize('num_steps', [1, 4, 10])
@pytest.mark.parametrize('shift', [1.0, 3.0, 5.0, 0.5])
def test_shifted_flow_sigmas_endpoints_monotone(num_steps, shift):
  s = np.asarray(sampling.shifted_flow_sigmas(num_steps, shift))
  assert s.shape == (num_steps + 1,)
  assert s[0] == pytest.approx(1.0, abs=1e-12)
  assert s[-1] == pytest.approx(0.0, abs=1e-12)
  assert np.all(np.diff(s) < 0)


def test_shifted_flow_sigmas_shift1_is_linspace():
  np.testing.assert_allclose(sampling.shifted_flow_sigmas(7, 1.0), np.linspace(1, 0, 8), atol=1e-15)


def test_shifted_flow_sigmas_shift3_values():
  s = sampling.shifted_flow_sigmas(4, 3.0)
  # s = 0.75, 0.5, 0.25 -> 3s / (1 + 2s): 2.25/2.5, 1.5/2, 0.75/1.5
  np.testing.assert_allclose(s, [1.0, 0.9, 0.75, 0.5, 0.0], atol=1e-12)
  # shift > 1 pushes every interior level up
  assert np.all(s[1:-1] > np.linspace(1, 0, 5)[1:-1])


def test_churn_eta():
  assert sampling.churn_eta(1.0, 20) == pytest.approx(1.0 / 21, rel=1e-12)
  assert sampling.churn_eta(0.0, 20) == 0.0
  assert sampling.churn_eta(0.5, 6) == pytest.approx(0.5 / 7, rel=1e-12)
  cap = math.sqrt(1.2) - 1.0
  assert sampling.churn_eta(10.0, 5) == pytest.approx(cap, rel=1e-12)
  assert sampling.churn_eta(100.0, 20) == pytest.approx(cap, rel=1e-12)
  # just below / above the cap
  n = 9
  assert sampling.churn_eta(0.99 * cap * (n + 1), n) == pytest.approx(0.99 * cap, rel=1e-12)
  assert sampling.churn_eta(1.01 * cap * (n + 1), n) == pytest.approx(cap, rel=1e-12)


@pytest.mark.parametrize('call', [
    lambda: sampling.karras_sigmas(0),
    lambda: sampling.karras_sigmas(-3),
    lambda: sampling.karras_sigmas(10, sigma_min=1.0, sigma_max=1.0),
    lambda: sampling.karras_sigmas(10, sigma_min=5.0, sigma_max=1.0),
    lambda: sampling.karras_sigmas(10, sigma_min=0.0, sigma_max=1.0),
    lambda: sampling.shifted_flow_sigmas(0),
    lambda: sampling.shifted_flow_sigmas(10, shift=0.0),
    lambda: sampling.shifted_flow_sigmas(10, shift=-1.0),
    lambda: sampling.churn_eta(-1.0, 10),
])
def test_bad_args_raise(call):
  with pytest.raises(ValueError):
    call()
