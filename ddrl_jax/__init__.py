"""ddrl_jax: data-regularized RL (DDRL) and GRPO-family post-training of diffusion models in JAX."""
__version__ = "0.1.0"
