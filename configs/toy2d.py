"""Toy 2-D Gaussian mixture with a linear reward: DDRL and baselines on a 2-core CPU in about a minute.

  python -m ddrl_jax.train --config=configs/toy2d.py --workdir=/tmp/toy2d
  python -m ddrl_jax.train --config=configs/toy2d.py:flow_grpo --workdir=/tmp/toy2d_flowgrpo

The ':arg' picks an algorithm preset: ddrl (default), ddrl_reduced, ddrl_exact, flow_grpo, dance_grpo, ddpo.
"""
import ml_collections

from configs import common


def get_config(arg='ddrl'):
  config = common.base_config()
  config.task = 'toy2d'
  config.num_iterations = 300
  config.batch_size = 8          # B condition groups per iteration
  config.num_rollouts = 8        # N rollouts per group
  config.log_every = 10
  config.checkpoint_every = 100
  config.eval_every = 100
  config.eval_samples = 2048

  config.sampler.num_steps = 20

  config.optim.learning_rate = 1e-3
  config.optim.warmup_steps = 10
  config.optim.weight_decay = 0.0

  config.rl.clip_range = 1e-4
  config.rl.loss_scale = 1.0

  config.toy2d = ml_collections.ConfigDict(dict(
      means=((-1.5, -1.5), (-1.5, 1.5), (1.5, -1.5), (1.5, 1.5)),
      std=0.4,
      weights=(0.25, 0.25, 0.25, 0.25),
      reward_w=(1.0, 0.5),
      tilt_beta=1.5,            # p* ∝ p_data exp(w.x / tilt_beta): shift s^2 w / beta = (0.11, 0.05)
      width=256, depth=3,
      pretrain_steps=3000, pretrain_batch=1024, pretrain_lr=2e-3,
  ))
  common.apply_algorithm_preset(config, arg)
  return config
