"""Theorem 3.1 on the toy: does each method approach p* ∝ p_data exp(r / beta), or leave the data manifold?

Trains every method from the same pretrained base for the same number of iterations, B groups x N
rollouts, and prints one JSON line per method: mean reward, sliced-Wasserstein distance to p* and to the
data, off-manifold mass (farther than 3 std from every component), NFEs, and wall time (compile included;
`time_per_iter_s` excludes the first 5 iterations).

  python benchmarks/toy2d_theory.py --out=benchmarks/toy2d_theory.jsonl --plot=benchmarks/toy2d_theory.png

The plot (needs matplotlib) shows 2048 final samples of each method over the data and p* components.
"""
import argparse
import functools
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import toy2d as toy_config  # noqa: E402
from ddrl_jax import metrics as metrics_lib  # noqa: E402
from ddrl_jax import trainer as trainer_lib  # noqa: E402
from ddrl_jax.tasks import toy2d  # noqa: E402

# (name, preset, overrides)
METHODS = [
    ('ddrl_exact_groupZ', 'ddrl_exact', {'rl.exact_log_partition': None}),
    ('ddrl_exact_trueZ', 'ddrl_exact', {}),
    ('ddrl_exact_trueZ_a0.5', 'ddrl_exact', {'sampler.noise_level': 0.5}),
    ('ddrl_zscore_b0.01', 'ddrl', {'rl.data_beta': 0.01}),
    ('ddrl_zscore_b0.1', 'ddrl', {'rl.data_beta': 0.1}),
    ('ddrl_zscore_b1', 'ddrl', {'rl.data_beta': 1.0}),
    ('ddrl_reduced_b0.01', 'ddrl_reduced', {'rl.data_beta': 0.01}),
    ('flow_grpo_kl0.04', 'flow_grpo', {}),
    ('flow_grpo_kl1', 'flow_grpo', {'rl.kl_beta': 1.0}),
    ('dance_grpo', 'dance_grpo', {}),
    ('ddpo', 'ddpo', {}),
]


def _set(config, dotted, value):
  *path, last = dotted.split('.')
  node = config
  for p in path:
    node = node[p]
  node[last] = value


_ORIG_INIT = toy2d.Toy2D.init_model
_LAST_KEY = [None]


@functools.lru_cache(maxsize=None)
def _pretrained(task_key_data):
  """Pretrains once per process; every method starts from these exact parameters."""
  task = toy2d.Toy2D(toy_config.get_config('ddrl'))
  return _ORIG_INIT(task, jax.random.wrap_key_data(np.asarray(task_key_data, np.uint32)))


def _policy_samples(trainer, params, num=2048):
  """(num, 2) samples of the policy (the rollout sampler) with fixed conditions and key."""
  cond = trainer.task.conditions(None, num)    # one rollout per slot, as the trainer samples
  return np.asarray(trainer._sample(params, cond, jax.random.key(2024))).reshape(-1, 2)


def _plot(path, base_samples, samples, task):
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  panels = [('base (pretrained)', base_samples),
            ('p* (closed form)', np.asarray(task.sample_optimum(jax.random.key(1), 2048)))]
  panels += list(samples.items())
  cols = 4
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
  for ax, (name, pts) in zip(axes.flat, panels):
    ax.scatter(pts[:, 0], pts[:, 1], s=1.5, alpha=0.35, color='tab:blue')
    for m in task.means:
      ax.add_patch(plt.Circle(m, 3 * task.std, fill=False, color='gray', lw=0.8))
    for m, wt in zip(task.tilted_means, task.tilted_weights):
      ax.plot(*m, 'x', color='tab:red', ms=4 + 12 * wt)
    ax.set_xlim(-4, 6)
    ax.set_ylim(-4, 6)
    ax.set_title(name, fontsize=9)
    ax.set_aspect('equal')
  for ax in list(axes.flat)[len(panels):]:
    ax.axis('off')
  fig.suptitle('toy2d: final samples; circles = data components (3 std), x = p* means (size ~ weight)',
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--iterations', type=int, default=300)
  ap.add_argument('--eval_every', type=int, default=50)
  ap.add_argument('--batch', type=int, default=0, help='0: the config default')
  ap.add_argument('--learning_rate', type=float, default=0.0, help='0: the config default')
  ap.add_argument('--eval_samples', type=int, default=8192)
  ap.add_argument('--methods', default='all')
  ap.add_argument('--out', default='')
  ap.add_argument('--plot', default='')
  args = ap.parse_args()

  def cached_init(self, key):
    _LAST_KEY[0] = tuple(np.asarray(jax.random.key_data(key)))
    return _pretrained(_LAST_KEY[0])
  toy2d.Toy2D.init_model = cached_init
  base = None
  base_samples = None
  samples = {}
  lines = []
  for name, preset, overrides in METHODS:
    if args.methods != 'all' and name not in args.methods.split(','):
      continue
    config = toy_config.get_config(preset)
    config.num_iterations = args.iterations
    config.batch_size = args.batch or config.batch_size
    config.optim.learning_rate = args.learning_rate or config.optim.learning_rate
    config.eval_every = args.eval_every
    config.eval_samples = args.eval_samples
    config.checkpoint_every = 10**9
    task = toy2d.Toy2D(config)
    for k, v in overrides.items():
      _set(config, k, v)
    with tempfile.TemporaryDirectory() as workdir:
      t0 = time.perf_counter()
      trainer = trainer_lib.Trainer(config, workdir)
      trainer.train(progress=False)
      wall = time.perf_counter() - t0
      if base_samples is None:
        base_samples = _policy_samples(trainer, _pretrained(_LAST_KEY[0])[1])
      samples[name] = _policy_samples(trainer, trainer.state.params)
      records = metrics_lib.read_metrics(workdir)
    train = [r for r in records if 'loss' in r]
    evals = [r for r in records if 'eval/reward' in r]
    per_iter = float(np.mean([r['time_rollout'] + r['time_reward'] + r['time_update']
                              for r in train[5:]]))
    if base is None:
      base = {k.split('/')[1]: v for k, v in evals[0].items() if k.startswith('eval/')}
      base_line = dict(method='base (pretrained)', **base)
      print(json.dumps(base_line), flush=True)
      lines.append(base_line)
      key = jax.random.key(123)
      floor = float(toy2d.sliced_wasserstein(task.sample_optimum(key, args.eval_samples),
                                             task.sample_optimum(jax.random.fold_in(key, 1),
                                                                 args.eval_samples),
                                             jax.random.fold_in(key, 2)))
      optimum = task.sample_optimum(key, args.eval_samples)
      ref_line = dict(method='p* samples (floor)', sw_to_optimum=floor,
                      reward=float(np.mean(np.asarray(optimum) @ task.w)),
                      off_manifold=float(toy2d.off_manifold_fraction(optimum, task.means, task.std)))
      print(json.dumps(ref_line), flush=True)
      lines.append(ref_line)
    final = {k.split('/')[1]: v for k, v in evals[-1].items() if k.startswith('eval/')}
    line = dict(method=name, iterations=args.iterations, batch=config.batch_size,
                rollouts=config.num_rollouts, nfe_rollout_per_cond=config.num_rollouts *
                train[-1]['nfe_rollout'], wall_s=round(wall, 1), time_per_iter_s=round(per_iter, 4),
                **{k: round(v, 4) for k, v in final.items()},
                curve=[(r['step'], round(r['eval/reward'], 3), round(r['eval/sw_to_optimum'], 3),
                        round(r['eval/off_manifold'], 4)) for r in evals])
    print(json.dumps(line), flush=True)
    lines.append(line)
  toy2d.Toy2D.init_model = _ORIG_INIT
  if args.plot:
    _plot(args.plot, base_samples, samples, task)
  if args.out:
    with open(args.out, 'w') as f:
      f.writelines(json.dumps(l) + '\n' for l in lines)


if __name__ == '__main__':
  main()
