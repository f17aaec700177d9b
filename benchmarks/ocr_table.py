"""The paper's image table at small scale: DDRL vs FlowGRPO vs DanceGRPO from one OCR base model.

  python benchmarks/ocr_table.py [--iterations=80] [--eval_every=20] [--methods=ddrl,ddrl_reduced,...]
      [--workdir=/tmp/ocr_table] [--prompts=64] [--per_prompt=4]

Every method starts from configs/ocr_tiny.py's base checkpoint and runs the same number of iterations
with the same prompts per iteration, rollouts per prompt and sampler (FlowGRPO's SDE, so they differ
only in their objective). Each checkpoint (every --eval_every iterations) is evaluated by
ddrl_jax.evaluate.evaluate_ocr on held-out strings: OCR accuracy, style drift, diversity, held-out
diffusion loss. Writes ocr_table.jsonl (every evaluation), ocr_table.png (OCR accuracy against style
drift over training, one line per method) and one sample grid per method into benchmarks/, and prints
the table's markdown for RESULTS.md.
"""
import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from configs import ocr_tiny
from ddrl_jax import config as config_lib
from ddrl_jax import evaluate as evaluate_lib
from ddrl_jax import image_grid
from ddrl_jax import trainer as trainer_lib
from ddrl_jax import rl as rl_lib

HERE = os.path.dirname(os.path.abspath(__file__))
COLUMNS = ('ocr_heldout', 'ocr_heldout_exact', 'style_drift', 'diversity', 'heldout_diffusion_loss')


def evaluate(config, trainer, args, method, iteration, rows, seconds, reference=None):
  """Evaluates the trainer's params; returns (grid, image statistics) and appends a row."""
  metrics, grid, stats = evaluate_lib.evaluate_ocr(
      config, trainer.apply_fn, trainer.state.params, trainer.task, prompts=args.prompts,
      per_prompt=args.per_prompt, reference_stats=reference, return_stats=True)
  nfe_rollout, nfe_train = nfe_per_condition(config) if method != 'base' else (0, 0)
  row = dict(method=method, iteration=iteration, train_seconds=seconds, nfe_rollout=nfe_rollout,
             nfe_train=nfe_train, **metrics)
  rows.append(row)
  print(json.dumps({k: row[k] for k in ('method', 'iteration', 'train_seconds') + COLUMNS}),
        flush=True)
  return grid, stats


def run_method(method, args, rows, reference):
  """Trains `method` from the base (resuming a finished or partial workdir) and evaluates it; returns
  (last grid, last image statistics). reference: the base's statistics (style drift from the base)."""
  config = ocr_tiny.get_config('ddrl' if method == 'base' else method)
  config.num_iterations = args.iterations
  config.checkpoint_every = args.iterations
  config.eval_every = -1
  workdir = os.path.join(args.workdir, method)
  trainer = trainer_lib.Trainer(config, workdir)
  start = trainer.restore_or_init()
  trainer._build()  # pylint: disable=protected-access
  grid, stats = evaluate(config, trainer, args, method, start, rows, 0.0, reference)
  if method == 'base':
    trainer.close_rewards()
    return grid, stats
  seconds = 0.0
  for it in range(start, args.iterations):
    t0 = time.perf_counter()
    trainer.train_iteration(it)
    seconds += time.perf_counter() - t0
    if (it + 1) % args.eval_every == 0 or it + 1 == args.iterations:
      grid, stats = evaluate(config, trainer, args, method, it + 1, rows, seconds, reference)
  if args.iterations > start:
    trainer.save()                 # the trained state, so a rerun re-evaluates it without training
    trainer.ckpt.wait_until_finished()
  trainer.close_rewards()
  return grid, stats


def plot(rows, path):
  """OCR against style drift over training, one line per method: to the data and from the base."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  panels = [('style_drift', 'style drift to the data (Frechet distance of image statistics)'),
            ('style_drift_from_reference', 'style drift from the base model')]
  panels = [p for p in panels if any(p[0] in r for r in rows)]
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
  axes = axes[0]
  for ax, (key, label) in zip(axes, panels):
    for method in dict.fromkeys(r['method'] for r in rows):
      rs = [r for r in rows if r['method'] == method and key in r]
      if rs:
        ax.plot([r[key] for r in rs], [r['ocr_heldout'] for r in rs], 'o-', label=method)
        ax.annotate(str(rs[-1]['iteration']), (rs[-1][key], rs[-1]['ocr_heldout']), fontsize=7)
    ax.set_xlabel(label)
    ax.set_ylabel('held-out OCR accuracy')
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def nfe_per_condition(config):
  """(rollout, training) network evaluations per condition and iteration, as the paper's Table 3 counts.

  Training: N|T| policy calls, plus N|T| data-loss calls for DDRL (N for 'reduced') or N|T| frozen
  reference calls for FlowGRPO's KL; a call with a backward pass counts once. Classifier-free guidance
  doubles every call.
  """
  algo = rl_lib.get_algorithm(config.algorithm)
  pool = config_lib.train_steps(config)
  k = len(pool) if algo.step_selection == 'fixed' else max(1, int(len(pool) * config.rl.train_fraction))
  n, g = config.num_rollouts, evaluate_lib.guidance_factor(config)
  extra = 0
  if algo.uses_data and config.rl.data_beta > 0:
    extra = n if config.rl.data_loss_steps == 'reduced' else n * k
  elif config.algorithm == 'flow_grpo' and config.rl.kl_beta > 0:
    extra = n * k
  return n * config.sampler.num_steps * g, (n * k + extra) * g


def table(rows, nfe):
  last = {}
  for r in rows:
    last[r['method']] = r
  from_base = any('style_drift_from_reference' in r for r in rows)
  lines = ['| method | OCR (held-out) | exact | OCR (FlowGRPO texts) | style drift to data | '
           + ('style drift from base | ' if from_base else '') + 'diversity | held-out diffusion loss | '
           'NFE / image (eval) | NFE / condition / iteration (rollout + training) | train time |',
           '|---' * (10 + from_base) + '|']
  for m, r in last.items():
    drift_from_base = f"{r.get('style_drift_from_reference', float('nan')):.2f} | " if from_base else ''
    lines.append(f"| {m} | {r['ocr_heldout']:.3f} | {r['ocr_heldout_exact']:.3f} | "
                 f"{r['ocr_flowgrpo']:.2f} | {r['style_drift']:.2f} (data {r['data_style_drift']:.2f}) | "
                 f"{drift_from_base}"
                 f"{r['diversity']:.2f} (data {r['data_diversity']:.2f}) | "
                 f"{r['heldout_diffusion_loss']:.4f} | {nfe} | {r['nfe_rollout']} + {r['nfe_train']} | "
                 f"{r['train_seconds'] / 60:.1f} min |")
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--iterations', type=int, default=80)
  parser.add_argument('--eval_every', type=int, default=20)
  parser.add_argument('--methods', default='base,ddrl,ddrl_reduced,flow_grpo,dance_grpo')
  parser.add_argument('--workdir', default='/tmp/ocr_table')
  parser.add_argument('--prompts', type=int, default=64)
  parser.add_argument('--per_prompt', type=int, default=4)
  parser.add_argument('--out', default=HERE)
  args = parser.parse_args()
  meta = dict(date=time.strftime('%Y-%m-%d'), machine=f'{platform.machine()} {os.cpu_count()} cores',
              command=' '.join(['python'] + sys.argv))
  rows, reference = [], None
  for method in args.methods.split(','):
    grid, stats = run_method(method, args, rows, reference)
    if method == 'base':
      reference = stats
    image_grid.write_grid(os.path.join(args.out, f'ocr_table_{method}.png'), grid,
                          columns=args.per_prompt * 2)
    with open(os.path.join(args.out, 'ocr_table.jsonl'), 'w') as f:
      for r in rows:
        f.write(json.dumps(dict(meta, **r)) + '\n')
  plot(rows, os.path.join(args.out, 'ocr_table.png'))
  print(table(rows, evaluate_lib.nfe_per_image(ocr_tiny.get_config())))


if __name__ == '__main__':
  main()
