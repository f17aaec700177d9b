"""Cosmos-Predict2.5-14B DDRL post-training (cosmos-rl's 14b-720-reason-embedding-ddrl recipe).

  python -m ddrl_jax.train --config=configs/cosmos14b.py --workdir=/tmp/cosmos14b

Full: 16 groups x 8 rollouts, 93 frames at 1280x720, lr 3e-6, mesh fsdp 32 x data 4 x context 8 = 1024
devices. ':smoke' is the same path at toy size (see configs/cosmos_common.py).
"""
from configs import cosmos_common


def get_config(arg=''):
  return cosmos_common.get_config('cosmos14b', arg)
