"""Toy 2-D Gaussian mixture with a linear reward: DDRL and baselines on a 2-core CPU in about a minute.

  python -m ddrl_jax.train --config=configs/toy2d.py --workdir=/tmp/toy2d
  python -m ddrl_jax.train --config=configs/toy2d.py:flow_grpo --workdir=/tmp/toy2d_flowgrpo

The ':arg' picks an algorithm preset: ddrl_exact (default: the paper's lambda(x) = -exp(-x) transform with the
closed-form Z, which converges to the tilted optimum p*), ddrl (as practiced in cosmos-rl: group z-score,
unnormalized log-ratio, data_beta 0.01), ddrl_reduced, flow_grpo, dance_grpo, ddpo.
"""
import ml_collections

from configs import common
from ddrl_jax.tasks import toy2d


def get_config(arg='ddrl_exact'):
  config = common.base_config()
  config.task = 'toy2d'
  config.num_iterations = 300
  config.batch_size = 32         # B condition groups per iteration
  config.num_rollouts = 8        # N rollouts per group
  config.log_every = 10
  config.checkpoint_every = 100
  config.eval_every = 50
  config.eval_samples = 2048

  config.sampler.num_steps = 20

  config.optim.learning_rate = 3e-4
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
  # r(x) = w . x, scored in a thread: two multiply-adds per sample need no worker processes.
  config.reward.fns = ml_collections.ConfigDict({'linear': 1.0})
  config.reward.kwargs = ml_collections.ConfigDict({'linear': {'w': config.toy2d.reward_w}})
  config.reward.workers = 0
  config.reward.chunk_size = 4096
  common.apply_algorithm_preset(config, arg)
  if arg != 'ddrl_exact':
    # DDRL as practiced in cosmos-rl, on its sampler, keeps its data weighting by name (the path-KL
    # weight of cosmos_2ab's last steps is 10 to 50 times t^2 + (1-t)^2).
    config.rl.data_weighting = 'cosmos_rl'
  if arg == 'ddrl_exact':
    # Z = beta log E_pdata[exp(r / beta)] in closed form (the paper's Z is under the reference model; a
    # per-group on-policy estimate has no fixed point at p*, see benchmarks/RESULTS.md).
    t = config.toy2d
    config.rl.exact_beta = t.tilt_beta
    config.rl.exact_log_partition = float(toy2d.log_partition(t.means, t.std, t.weights, t.reward_w,
                                                              t.tilt_beta))
  return config
