"""ddrl_jax: data-regularized RL (DDRL) and GRPO-family post-training of diffusion models in JAX.

Importing ddrl_jax on a host without a TPU, with JAX_PLATFORMS unset, sets JAX_PLATFORMS to the platforms
the host has ('cuda,cpu' or 'cpu'; `xla_flags.host_platforms`), before JAX is imported here, so that an
installed libtpu (the `aot` extra) does not print its TPU-probing errors on every start. A TPU host, or a
JAX_PLATFORMS the user set, is left alone.
"""
import os as _os

__version__ = "0.1.0"

if not _os.environ.get('JAX_PLATFORMS'):
  from ddrl_jax import xla_flags as _xla_flags
  _platforms = _xla_flags.host_platforms()
  if _platforms:
    _os.environ['JAX_PLATFORMS'] = _platforms
