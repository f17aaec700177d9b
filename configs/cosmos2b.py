"""Cosmos-Predict2.5-2B DDRL post-training (cosmos-rl's 2b-720-reason-embedding-ddrl recipe).

  python -m ddrl_jax.train --config=configs/cosmos2b.py --workdir=/tmp/cosmos2b
  python -m ddrl_jax.train --config=configs/cosmos2b.py:smoke --workdir=/tmp/cosmos2b_smoke

Full: 16 groups x 8 rollouts, 93 frames at 1280x720 (latent 16x24x90x160), mesh fsdp 8 x data 16 x
context 2 = 256 devices. ':smoke' is the same path at toy size (see configs/cosmos_common.py).
"""
from configs import cosmos_common


def get_config(arg=''):
  return cosmos_common.get_config('cosmos2b', arg)
