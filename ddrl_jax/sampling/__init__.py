"""Pure-JAX diffusion samplers with per-step Gaussian transitions (for policy gradients)."""
from ddrl_jax.sampling.samplers import KINDS
from ddrl_jax.sampling.samplers import Sampler
from ddrl_jax.sampling.samplers import StepInputs
from ddrl_jax.sampling.samplers import Trajectory
from ddrl_jax.sampling.samplers import gather_steps
from ddrl_jax.sampling.samplers import make_sampler
from ddrl_jax.sampling.schedules import churn_eta
from ddrl_jax.sampling.schedules import karras_sigmas
from ddrl_jax.sampling.schedules import rf_time
from ddrl_jax.sampling.schedules import shifted_flow_sigmas
from ddrl_jax.sampling.transitions import cosmos_2ab_mean
from ddrl_jax.sampling.transitions import cosmos_x0
from ddrl_jax.sampling.transitions import dance_sde_step
from ddrl_jax.sampling.transitions import ddim_step
from ddrl_jax.sampling.transitions import flow_sde_step
