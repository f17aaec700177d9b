"""Model definitions (Flax NNX) and PyTorch-checkpoint converters.

Families live in subpackages (`models.cosmos`, `models.wan`) and register in `models.family`; shared layers
are `models.layers`, adapters `models.lora`. Import submodules directly, e.g. `from ddrl_jax.models.cosmos import dit`.
"""
