"""Model definitions (Flax NNX) and PyTorch-checkpoint converters.

Import the submodules directly, e.g. `from ddrl_jax.models import cosmos_dit, cosmos_convert`.
"""
