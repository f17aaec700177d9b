"""Per-step stochastic transitions x_{i+1} ~ N(mean, std^2 I) of the diffusion samplers.

Conventions: the denoiser predicts the rectified-flow velocity v = eps - x0 at x_t = (1 - t) x0 + t eps.
Flow kernels (FlowGRPO, DanceGRPO, DDIM) work on that state directly with sigma = t in [0, 1] and
dt = sigma_next - sigma < 0. The cosmos kernel works on VE states x_sigma = x0 + sigma eps (nvidia-cosmos/
cosmos-rl's WFM sampler, the RES 2AB solver with churn). Every function is elementwise in x and broadcasts
scalar sigmas, so it runs unchanged per sample under vmap or on a whole batch.
"""
import jax.numpy as jnp


def flow_sde_step(x, velocity, sigma, sigma_next, noise_level):
  """FlowGRPO's marginal-preserving reverse SDE step (flow_grpo sd3_sde_with_logprob.py).

  s = a * sqrt(sigma / (1 - sigma~)), sigma~ = sigma except sigma_next (= sigmas[1]) when sigma == 1;
  mean = x + [v + s^2 / (2 sigma) * (x + (1 - sigma) v)] dt;  std = s * sqrt(-dt).
  noise_level a = 0 gives the Euler ODE step.

  Args:
    x, velocity: (..., *S) state at sigma and the predicted velocity there.
    sigma, sigma_next: scalars (or broadcastable), 1 >= sigma > sigma_next >= 0.
    noise_level: a.
  Returns:
    (mean, std): mean shaped like x; std shaped like sigma.
  """
  dt = sigma_next - sigma
  sigma_tilde = jnp.where(sigma == 1.0, sigma_next, sigma)
  s = noise_level * jnp.sqrt(sigma / (1.0 - sigma_tilde))
  drift = velocity + s**2 / (2.0 * sigma) * (x + (1.0 - sigma) * velocity)
  return x + drift * dt, s * jnp.sqrt(-dt)


def dance_sde_step(x, velocity, sigma, sigma_next, eta):
  """DanceGRPO's SDE step (DanceGRPO train_grpo_flux.py flux_step): FlowGRPO's drift with s == eta.

  mean = x + dsigma [v + eta^2 / (2 sigma) (x + (1 - sigma) v)];  std = eta * sqrt(sigma - sigma_next).
  Shapes as in `flow_sde_step`.
  """
  dsigma = sigma_next - sigma
  drift = velocity + eta**2 / (2.0 * sigma) * (x + (1.0 - sigma) * velocity)
  return x + drift * dsigma, eta * jnp.sqrt(-dsigma)


def ddim_step(x, velocity, sigma, sigma_next, eta):
  """DDPO's DDIM(eta) step written for the rectified-flow path x_t = a_t x0 + b_t eps, a = 1 - t, b = t.

  DDPO's formula (ddpo-pytorch ddim_with_logprob.py) in its general Gaussian-path form:
  std = eta * b_s * sqrt(1 - (a_t b_s / (a_s b_t))^2);  mean = a_s x0_hat + sqrt(b_s^2 - std^2) eps_hat,
  with x0_hat = x - t v and eps_hat = x + (1 - t) v. With a = sqrt(abar), b = sqrt(1 - abar) this is exactly
  DDPO's sigma_t; eta = 1 is the DDPM ancestral step, eta = 0 the deterministic DDIM (= Euler here).
  Shapes as in `flow_sde_step`; needs sigma_next < 1.
  """
  x0_hat = x - sigma * velocity
  eps_hat = x + (1.0 - sigma) * velocity
  ratio = (1.0 - sigma) * sigma_next / ((1.0 - sigma_next) * sigma)
  keep = jnp.maximum(1.0 - ratio**2, 0.0)
  std = eta * sigma_next * jnp.sqrt(keep)
  # sqrt(b_s^2 - std^2) written without the difference of squares (no cancellation).
  mean = ((1.0 - sigma_next) * x0_hat
          + sigma_next * jnp.sqrt(jnp.maximum(1.0 - eta**2 * keep, 0.0)) * eps_hat)
  return mean, std


def cosmos_x0(x_hat, velocity, t):
  """x0 prediction of cosmos' rectified-flow preconditioning: x0 = (1 - t) x_sigma - t v."""
  return (1.0 - t) * x_hat - t * velocity


def _euler_2ab(x_hat, x0, sigma_hat, sigma_next):
  ratio = sigma_next / sigma_hat
  return ratio * x_hat + (1.0 - ratio) * x0


def _adams_bashforth_2ab(x_hat, x0, sigma_hat, sigma_next, x0_prev, sigma_hat_prev):
  h = jnp.log(sigma_hat / sigma_next)
  phi1 = -jnp.expm1(-h) / h                       # phi_1(-h) = (1 - e^-h) / h
  phi2 = (phi1 - 1.0) / (-h)                      # phi_2(-h)
  c2 = (jnp.log(sigma_hat) - jnp.log(sigma_hat_prev)) / h  # < 0: the previous point lies behind
  b2 = phi2 / c2
  return jnp.exp(-h) * x_hat + h * ((phi1 - b2) * x0 + b2 * x0_prev)


def cosmos_2ab_mean(x_hat, x0, sigma_hat, sigma_next, x0_prev, sigma_hat_prev):
  """Mean of cosmos-rl's res-multistep 2AB step in log-sigma time (cosmos_rl sampler/__init__.py).

  h = ln(sigma_hat / sigma_next); first step (x0_prev is None): Euler/DDIM
  x' = (sigma_next / sigma_hat) x_hat + (1 - sigma_next / sigma_hat) x0; later steps:
  x' = e^-h x_hat + h [(phi1 - phi2/c2) x0 + (phi2/c2) x0_prev], c2 = (ln sigma_hat - ln sigma_hat_prev) / h.

  Args:
    x_hat: (..., *S) churned VE state; x0: its x0 prediction (same shape).
    sigma_hat: churned sigma of this step; sigma_next: the next (unchurned) schedule sigma.
    x0_prev: previous step's x0 prediction (stale, from the rollout) or None for the first step.
    sigma_hat_prev: previous step's churned sigma (ignored when x0_prev is None).
  Returns:
    mean, shaped like x_hat.
  """
  if x0_prev is None:
    return _euler_2ab(x_hat, x0, sigma_hat, sigma_next)
  return _adams_bashforth_2ab(x_hat, x0, sigma_hat, sigma_next, x0_prev, sigma_hat_prev)


def cosmos_2ab_mean_traced(x_hat, x0, sigma_hat, sigma_next, x0_prev, sigma_hat_prev, is_first):
  """`cosmos_2ab_mean` with the first-step switch as a traced boolean (for scans over steps).

  The caller must pass a finite, positive dummy sigma_hat_prev at the first step so the unused
  branch (and its gradient) stays finite.
  """
  euler = _euler_2ab(x_hat, x0, sigma_hat, sigma_next)
  ab2 = _adams_bashforth_2ab(x_hat, x0, sigma_hat, sigma_next, x0_prev, sigma_hat_prev)
  return jnp.where(is_first, euler, ab2)
