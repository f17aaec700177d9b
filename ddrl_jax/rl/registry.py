"""Every algorithm by its `config.algorithm` name. Adding one is a module defining an `Algorithm` (or a
subclass with its own loss) and a line here."""
from ddrl_jax.rl import algorithms
from ddrl_jax.rl import nft

ALGORITHMS = {
    **algorithms.CLIPPED_PG,              # ddrl, flow_grpo, dance_grpo, ddpo
    'diffusion_nft': nft.DIFFUSION_NFT,   # rl/nft.py
}


def get_algorithm(name):
  if name not in ALGORITHMS:
    raise ValueError(f'config.algorithm={name!r} is unknown; known: {sorted(ALGORITHMS)}')
  return ALGORITHMS[name]
