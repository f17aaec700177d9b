"""Noise schedules.

Two families of noise levels are used:

* VE / EDM sigmas (cosmos-rl): ``x_sigma = x0 + sigma * eps`` with Karras spacing. The network is fed the
  rectified-flow input ``(1 - t) * x_sigma`` at time ``t = sigma / (1 + sigma)`` (``rf_time``).
* Flow-matching sigmas in [0, 1] (FlowGRPO, DanceGRPO, DDPO-on-flow): ``x_t = (1 - t) x0 + t eps`` with
  ``t = sigma`` directly, optionally shifted.
"""
import math

import numpy as np


def karras_sigmas(num_steps, sigma_min=0.01, sigma_max=200.0, rho=7.0):
  """Karras et al. (EDM) sigmas, decreasing from ``sigma_max`` to ``sigma_min``.

  sigma_k = (sigma_max^(1/rho) + k/num_steps * (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho, k = 0..num_steps.

  Returns:
    (num_steps + 1,) float64 numpy array. Static: schedules are built once from the config.
  """
  if num_steps < 1:
    raise ValueError(f'num_steps must be >= 1, got {num_steps}')
  if not 0 < sigma_min < sigma_max:
    raise ValueError(f'need 0 < sigma_min < sigma_max, got {sigma_min}, {sigma_max}')
  ramp = np.arange(num_steps + 1, dtype=np.float64) / num_steps
  lo, hi = sigma_min ** (1.0 / rho), sigma_max ** (1.0 / rho)
  return (hi + ramp * (lo - hi)) ** rho


def rf_time(sigma):
  """Rectified-flow time of a VE sigma: t = sigma / (1 + sigma). Works on numpy and jax arrays."""
  return sigma / (1.0 + sigma)


def shifted_flow_sigmas(num_steps, shift=1.0):
  """Flow-matching sigmas from 1 to 0 with the SD3/FLUX shift: s' = shift*s / (1 + (shift-1)*s).

  Returns:
    (num_steps + 1,) float64 numpy array, 1.0 first and 0.0 last.
  """
  if num_steps < 1:
    raise ValueError(f'num_steps must be >= 1, got {num_steps}')
  if shift <= 0:
    raise ValueError(f'shift must be > 0, got {shift}')
  s = np.linspace(1.0, 0.0, num_steps + 1)
  return shift * s / (1.0 + (shift - 1.0) * s)


def churn_eta(s_churn, num_steps):
  """EDM churn factor as cosmos-rl uses it: eta = min(s_churn / (num_steps + 1), sqrt(1.2) - 1).

  The churned level of step k is sigma_hat = (1 + eta) * sigma_k.
  """
  if s_churn < 0:
    raise ValueError(f's_churn must be >= 0, got {s_churn}')
  return min(s_churn / (num_steps + 1), math.sqrt(1.2) - 1.0)
