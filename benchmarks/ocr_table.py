"""The paper's image table at CPU scale: DDRL against faithful FlowGRPO, DanceGRPO and DiffusionNFT, several
seeds per method, with confidence intervals, two OCR readers and the hacking statistics.

  python benchmarks/ocr_table.py                        # the full plan; resumes wherever it stopped
  python benchmarks/ocr_table.py --budget_minutes=120   # stop cleanly after ~2 hours (rerun to go on)
  python benchmarks/ocr_table.py --report               # only the table and plot from the recorded rows
  python benchmarks/ocr_table.py --cells='ddrl:0;dance_grpo:0' --iterations=40 --eval_every=20
  python benchmarks/ocr_table.py --cells='ddrl:0;ddrl+lora4:0;ddrl+lora16:0' --iterations=80 --eval_every=40 \
      --workdir=workdir_ocr_lora --out=benchmarks/ocr_lora        # LoRA against full fine-tuning

A method '<preset>+lora<r>' is the preset with LoRA adapters of rank r, alpha 2r, on the default targets
(the DiT blocks' attention projections), at LORA_LEARNING_RATE.

Every cell (method, seed) starts from configs/ocr_tiny.py's shipped base model and runs the same
iterations of 8 prompts x 8 rollouts with the same SDE sampler (methods differ in their objective; the
presets in configs/common.py cite the code each follows). The seed changes the RL randomness (prompts,
rollout noise, steps); the base model and the evaluation (prompts, seeds) are the same for every cell.
Each cell's training metrics go to its workdir's metrics.jsonl (and TensorBoard events), as the trainer's
own loop writes them. Every --eval_every iterations a cell is checkpointed and evaluated by ddrl_jax.evaluate.evaluate_ocr:
held-out OCR by the training reader (Tesseract) and by a second reader (RapidOCR / PP-OCR), style drift to
the data and from the base's own samples, diversity, the texture and colour statistics, held-out diffusion
loss. Rows are appended to <workdir>/evaluations.jsonl as they are made, so a killed or budgeted run
loses at most one interval and the next run continues from the cells' checkpoints (a kill between a
checkpoint and its evaluation row re-evaluates that checkpoint, and its interval's training time is
not counted).

Outputs in --out (benchmarks/): ocr_methods.jsonl (every evaluation, with command, date and machine),
ocr_methods.png (held-out OCR against drift from the base, and Tesseract against RapidOCR, over
training; means over seeds), ocr_methods_<method>.png (samples of the first seed at its last evaluation),
and on stdout three markdown tables: mean and 95% t-interval over seeds at each method's last common
iteration; DDRL minus every other method (Welch 95% intervals) with DDRL's share of its OCR gain; and
every method at the first evaluation where it reached DDRL's final OCR (regularization at equal reward).
(ocr_table.jsonl / ocr_table*.png are the earlier 80-iteration, one-seed table of RESULTS.md.)
"""
import argparse
import collections
import json
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from configs import ocr_tiny
from ddrl_jax import evaluate as evaluate_lib
from ddrl_jax import flops as flops_lib
from ddrl_jax import image_grid
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import trainer as trainer_lib
from ddrl_jax import xla_flags
from ddrl_jax.models import lora

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# The plan of issue 14: 3 seeds for the main methods, one for the variants; FlowGRPO with the exact KL got
# 3 seeds too, because its one seed matched DDRL's reward at lower drift (RESULTS.md).
DEFAULT_CELLS = ('ddrl:0,1,2;flow_grpo:0,1,2;dance_grpo:0,1,2;diffusion_nft:0,1,2;'
                 'ddrl_reduced:0;ddrl_synthetic:0;flow_grpo_exact_kl:0,1,2')
LABELS = {'base': 'base', 'ddrl': 'DDRL', 'flow_grpo': 'FlowGRPO', 'dance_grpo': 'DanceGRPO',
          'diffusion_nft': 'DiffusionNFT', 'ddrl_reduced': 'DDRL reduced (first step)',
          'ddrl_reduced_random': 'DDRL reduced (random step)', 'ddrl_synthetic': 'DDRL, synthetic data',
          'flow_grpo_exact_kl': 'FlowGRPO, exact KL (stronger)'}
# (metric key, column title, format): the table's columns, those present in the rows.
COLUMNS = (
    ('ocr_heldout', 'OCR Tesseract (training reader)', '.3f'),
    ('ocr_heldout_rapid', 'OCR RapidOCR (held-out reader)', '.3f'),
    ('reader_gap', 'reader gap (Tess. - Rapid)', '.3f'),
    ('ocr_heldout_exact', 'exact (Tess.)', '.3f'),
    ('style_drift_from_reference', 'style drift from base', '.2f'),
    ('style_drift', 'style drift to data', '.2f'),
    ('diversity', 'diversity', '.2f'),
    ('texture_energy', 'texture energy', '.3f'),
    ('patch_grid_energy', 'patch-grid energy', '.3f'),
    ('colour_spread', 'colour spread', '.2f'),
    ('heldout_diffusion_loss', 'held-out diffusion loss', '.4f'),
)
DATA_REFERENCE = {'style_drift': 'data_style_drift', 'diversity': 'data_diversity',
                  'texture_energy': 'data_texture_energy', 'patch_grid_energy': 'data_patch_grid_energy',
                  'colour_spread': 'data_colour_spread'}


LORA_LEARNING_RATE = 1e-3     # 10x the full fine-tuning rate of configs/ocr_tiny.py


def make_config(method):
  """The ocr_tiny preset of `method`, with LoRA for '<preset>+lora<r>'."""
  preset, _, rank = method.partition('+lora')
  config = ocr_tiny.get_config(preset)
  if rank:
    config.lora.update(rank=int(rank), alpha=2.0 * int(rank))
    config.optim.learning_rate = LORA_LEARNING_RATE
  return config


def parse_cells(text):
  """'ddrl:0,1;dance_grpo:0' -> [('ddrl', 0), ('dance_grpo', 0), ('ddrl', 1)]: seed-major, so a partial run
  has every method at seed 0 before any method at seed 1."""
  cells = []
  for part in filter(None, (p.strip() for p in text.split(';'))):
    method, _, seeds = part.partition(':')
    if not seeds:
      raise ValueError(f'--cells entry {part!r} is not method:seed[,seed...]')
    cells += [(method.strip(), int(s)) for s in seeds.split(',')]
  for method, _ in cells:
    make_config(method)                    # an unknown preset raises here, before anything runs
  order = {m: i for i, m in enumerate(dict.fromkeys(m for m, _ in cells))}
  return sorted(dict.fromkeys(cells), key=lambda c: (c[1], order[c[0]]))


def read_rows(path):
  if not os.path.exists(path):
    return []
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


def append_row(path, row):
  with open(path, 'a', encoding='utf-8') as f:
    f.write(json.dumps(row) + '\n')
    f.flush()
    os.fsync(f.fileno())


def passes_per_condition(config):
  """(rollout, training) network passes per condition and iteration (a backward counts as 2 passes):
  N times `ddrl_jax.flops.iteration_passes`, with classifier-free guidance doubling every call."""
  p = flops_lib.iteration_passes(config)
  n, g = config.num_rollouts, evaluate_lib.guidance_factor(config)
  return int(round(n * p.rollout * g)), int(round(n * (p.total - p.rollout) * g))


class Runner:
  """Trains and evaluates cells, recording one row per evaluation in <workdir>/evaluations.jsonl."""

  def __init__(self, args, meta):
    self.args, self.meta = args, meta
    os.makedirs(args.workdir, exist_ok=True)
    self.rows_path = os.path.join(args.workdir, 'evaluations.jsonl')
    self.rows = read_rows(self.rows_path)
    self.deadline = time.monotonic() + 60 * args.budget_minutes if args.budget_minutes > 0 else None
    self.reference = None
    self.cells = []

  def out_of_time(self):
    return self.deadline is not None and time.monotonic() > self.deadline

  def recorded(self, method, seed, iteration):
    return any(r['method'] == method and r['seed'] == seed and r['iteration'] == iteration
               for r in self.rows)

  def evaluate(self, config, trainer, method, seed, iteration, train_seconds):
    """Evaluates the trainer's params, appends the row; returns the (P, K) grid and image statistics."""
    a = self.args
    metrics, grid, stats = evaluate_lib.evaluate_ocr(
        config, trainer.apply_fn, lora.combine(trainer.state.params, trainer.state.frozen), trainer.task,
        prompts=a.prompts,
        per_prompt=a.per_prompt, reference_stats=self.reference, return_stats=True)
    rollout, train = passes_per_condition(config) if method != 'base' else (0, 0)
    row = dict(self.meta, method=method, seed=seed, iteration=iteration, train_seconds=train_seconds,
               passes_rollout=rollout, passes_train=train, **metrics)
    self.rows.append(row)
    append_row(self.rows_path, row)
    shown = {k: round(row[k], 4) for k, _, _ in COLUMNS if k in row}
    print(json.dumps(dict(method=method, seed=seed, iteration=iteration, **shown)), flush=True)
    return grid, stats

  def base(self):
    """The base model's evaluation (once) and its image statistics, the reference of 'drift from base'."""
    stats_path = os.path.join(self.args.workdir, 'base_stats.npy')
    config = ocr_tiny.get_config('ddrl')
    trainer = trainer_lib.Trainer(config, os.path.join(self.args.workdir, 'base'))
    trainer.restore_or_init()
    if not self.recorded('base', 0, 0) or not os.path.exists(stats_path):
      self.rows = [r for r in self.rows if r['method'] != 'base']
      grid, stats = self.evaluate(config, trainer, 'base', 0, 0, 0.0)
      np.save(stats_path, stats)
      image_grid.write_grid(os.path.join(self.args.out, 'ocr_methods_base.png'), grid,
                            columns=self.args.per_prompt * 2)
    trainer.close_rewards()
    self.reference = np.load(stats_path)

  def cell(self, method, seed):
    """Trains one cell from its latest checkpoint to --iterations, evaluating every --eval_every."""
    a = self.args
    config = make_config(method)
    config.seed = seed
    config.num_iterations = a.iterations
    config.checkpoint_every = a.eval_every
    config.eval_every = -1
    trainer = trainer_lib.Trainer(config, os.path.join(a.workdir, method, f'seed{seed}'))
    start = trainer.restore_or_init()
    if start >= a.iterations and self.recorded(method, seed, start):
      trainer.close_rewards()
      return True
    trainer._build()  # pylint: disable=protected-access
    previous = [r for r in self.rows if r['method'] == method and r['seed'] == seed
                and r['iteration'] <= start]
    seconds = max((r['train_seconds'] for r in previous), default=0.0)
    grid = None
    if not self.recorded(method, seed, start):
      grid, _ = self.evaluate(config, trainer, method, seed, start, seconds)
    it = start
    writer = metrics_lib.MetricWriter(trainer.workdir, resume_step=start)   # the cell's training curves
    while it < a.iterations and not self.out_of_time():
      stop = min(a.iterations, (it // a.eval_every + 1) * a.eval_every)
      t0 = time.perf_counter()
      for i in range(it, stop):
        writer.write(i + 1, trainer.train_iteration(i))
      seconds += time.perf_counter() - t0
      it = stop
      writer.flush()
      trainer.save()
      trainer.ckpt.wait_until_finished()
      grid, _ = self.evaluate(config, trainer, method, seed, it, seconds)
    writer.close()
    if grid is not None and seed == min(s for m, s in self.cells if m == method):
      image_grid.write_grid(os.path.join(a.out, f'ocr_methods_{method}.png'), grid,
                            columns=a.per_prompt * 2)
    trainer.close_rewards()
    return it >= a.iterations

  def run(self, cells):
    """Trains and evaluates `cells` in order; True when every cell reached --iterations."""
    self.cells = cells
    self.base()
    done = []
    for method, seed in cells:
      if done and self.out_of_time():     # the budget is checked before each interval (in `cell`) too
        break
      done.append(self.cell(method, seed))
    finished = len(done) == len(cells) and all(done)
    if not finished:
      print(f'budget of {self.args.budget_minutes} min spent; rerun the same command to continue',
            flush=True)
    return finished


# ------------------------------------------------------------------------------------------ report
def t_interval(values, confidence=0.95):
  """(mean, half-width of the two-sided t confidence interval); half-width nan for one value."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  values = np.asarray(values, np.float64)
  mean = float(values.mean())
  if values.size < 2:
    return mean, float('nan')
  sem = values.std(ddof=1) / math.sqrt(values.size)
  return mean, float(stats.t.ppf(0.5 + confidence / 2, values.size - 1) * sem)


def by_cell(rows):
  """{method: {seed: {iteration: row}}} (the last row recorded for an evaluation wins)."""
  out = collections.defaultdict(lambda: collections.defaultdict(dict))
  for r in rows:
    out[r['method']][r['seed']][r['iteration']] = r
  return out


def summary(rows, iteration=None):
  """{method: (iteration, n_seeds, {key: (mean, half-width)})} at `iteration` (default: the last
  iteration every seed of the method reached)."""
  out = {}
  for method, seeds in by_cell(rows).items():
    common = set.intersection(*(set(evals) for evals in seeds.values()))
    it = iteration if iteration is not None else max(common)
    at = [evals[it] for evals in seeds.values() if it in evals]
    if not at:
      continue
    keys = {k for r in at for k, v in r.items() if isinstance(v, (int, float))}
    out[method] = (it, len(at), {k: t_interval([r[k] for r in at if k in r]) for k in sorted(keys)})
  return out


def cell_text(stat, fmt):
  mean, half = stat
  return f'{mean:{fmt}}' if not np.isfinite(half) else f'{mean:{fmt}} ± {half:{fmt}}'


def markdown_head(head):
  """The header and separator lines of a markdown table with columns `head`."""
  return ['| ' + ' | '.join(head) + ' |', '|---' * len(head) + '|']


def table(rows):
  """Markdown: mean ± 95% half-width over seeds per method at its last common iteration."""
  summ = summary(rows)
  present = [c for c in COLUMNS if any(c[0] in s[2] for s in summ.values())]
  head = ['method', 'iteration', 'seeds'] + [title for _, title, _ in present] + [
      'passes / condition / iteration (rollout + training)', 'train time (min)']
  lines = markdown_head(head)
  base = summ.get('base')
  if base is not None:
    cells = []
    for key, _, fmt in present:
      text = cell_text(base[2][key], fmt) if key in base[2] else '-'
      ref = DATA_REFERENCE.get(key)
      if ref and ref in base[2]:
        text += f' (data {base[2][ref][0]:{fmt}})'
      cells.append(text)
    lines.append('| base | 0 | - | ' + ' | '.join(cells) + ' | - | - |')
  for method, (it, n, stats) in summ.items():
    if method == 'base':
      continue
    cells = [cell_text(stats[k], fmt) if k in stats else '-' for k, _, fmt in present]
    cost = f"{stats['passes_rollout'][0]:.0f} + {stats['passes_train'][0]:.0f}"
    lines.append(f'| {LABELS.get(method, method)} | {it} | {n} | ' + ' | '.join(cells) +
                 f" | {cost} | {cell_text((stats['train_seconds'][0] / 60, stats['train_seconds'][1] / 60), '.1f')} |")
  return '\n'.join(lines)


# The paper's expectations (issue 14, item 6) compare DDRL against every other method on these.
CONTRAST_KEYS = (
    ('ocr_heldout', 'Tesseract', '.3f'),
    ('ocr_heldout_rapid', 'RapidOCR', '.3f'),
    ('reader_gap', 'reader gap', '.3f'),
    ('style_drift_from_reference', 'drift from base', '.2f'),
    ('heldout_diffusion_loss', 'held-out diffusion loss', '.4f'),
    ('diversity', 'diversity', '.2f'),
    ('patch_grid_energy', 'patch-grid energy', '.3f'),
    ('colour_spread', 'colour spread', '.2f'),
)


def welch_interval(a, b, confidence=0.95):
  """(mean(a) - mean(b), half-width of Welch's two-sided t interval); half-width nan if either has
  fewer than two values."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  diff = float(a.mean() - b.mean())
  if a.size < 2 or b.size < 2:
    return diff, float('nan')
  va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
  se = math.sqrt(va + vb)
  if se == 0:
    return diff, 0.0
  dof = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
  return diff, float(stats.t.ppf(0.5 + confidence / 2, dof) * se)


def contrasts(rows, reference='ddrl'):
  """Markdown: `reference` minus every other trained method at the pair's last common iteration, mean
  difference ± Welch 95% half-width over seeds per key (no interval where a side has one seed), and the
  reference's Tesseract gain over the base as a share of the method's."""
  cells = by_cell(rows)
  if reference not in cells or 'base' not in cells:
    return ''
  base = cells['base'][0][0]
  head = ['method', 'iteration', 'seeds (DDRL, method)', 'DDRL gain / method gain (Tesseract)'] + [
      f'DDRL - method: {title}' for _, title, _ in CONTRAST_KEYS]
  lines = markdown_head(head)
  for method, seeds in cells.items():
    if method in ('base', reference):
      continue
    both = list(cells[reference].values()) + list(seeds.values())
    common = set.intersection(*(set(evals) for evals in both))
    if not common:
      continue
    it = max(common)
    ref_rows = [evals[it] for evals in cells[reference].values()]
    rows_m = [evals[it] for evals in seeds.values()]
    gain_ref = np.mean([r['ocr_heldout'] for r in ref_rows]) - base['ocr_heldout']
    gain_m = np.mean([r['ocr_heldout'] for r in rows_m]) - base['ocr_heldout']
    share = f'{gain_ref / gain_m:.0%}' if gain_m > 0 else f'(method gain {gain_m:+.3f})'
    texts = []
    for key, _, fmt in CONTRAST_KEYS:
      a = [r[key] for r in ref_rows if key in r]
      b = [r[key] for r in rows_m if key in r]
      if not (a and b):
        texts.append('-')
        continue
      diff, half = welch_interval(a, b)
      texts.append(f'{diff:+{fmt}}' + (f' ± {half:{fmt}}' if np.isfinite(half) else ''))
    lines.append(f'| {LABELS.get(method, method)} | {it} | {len(ref_rows)}, {len(rows_m)} | {share} | ' +
                 ' | '.join(texts) + ' |')
  return '\n'.join(lines)


def curves(rows, key):
  """{method: (iterations, means over seeds)} of `key` at the iterations every seed reached."""
  out = {}
  for method, seeds in by_cell(rows).items():
    if method == 'base':
      continue
    common = sorted(set.intersection(*(set(evals) for evals in seeds.values())))
    pts = [(it, np.mean([evals[it][key] for evals in seeds.values()])) for it in common
           if all(key in evals[it] for evals in seeds.values())]
    if pts:
      out[method] = tuple(np.array(v) for v in zip(*pts))
  return out


def at_matched_reward(rows, reference='ddrl'):
  """Markdown: every method at the first evaluation where its seed-mean Tesseract OCR reached the
  reference's at the reference's last common iteration (the paper compares regularization at comparable
  reward), mean ± 95% t half-width over seeds of the CONTRAST_KEYS; a method that never reached it is
  listed at its best evaluation, marked as such."""
  cells = by_cell(rows)
  ocr = curves(rows, 'ocr_heldout')
  ref = ocr.get(reference)
  if ref is None:
    return ''
  target = float(ref[1][-1])
  head = ['method', 'iteration', 'seeds'] + [title for _, title, _ in CONTRAST_KEYS]
  lines = [f'(reward level: {LABELS.get(reference, reference)} at iteration {int(ref[0][-1])}, '
           f'Tesseract {target:.3f})', ''] + markdown_head(head)
  for method, (its, means) in ocr.items():
    reached = np.flatnonzero(means >= target - 1e-12)
    k = int(reached[0]) if reached.size else int(np.argmax(means))
    it = int(its[k])
    at = [evals[it] for evals in cells[method].values()]
    texts = [cell_text(t_interval([r[key] for r in at]), fmt) if all(key in r for r in at) else '-'
             for key, _, fmt in CONTRAST_KEYS]
    label = LABELS.get(method, method) + ('' if reached.size else ' (never reached; its best)')
    lines.append(f'| {label} | {it} | {len(at)} | ' + ' | '.join(texts) + ' |')
  return '\n'.join(lines)


def plot(rows, path):
  """Two panels over training (seed means): held-out OCR against style drift from the base, and the
  training reader's OCR against the held-out reader's (below the diagonal: Tesseract-specific gains)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  panels = [('style_drift_from_reference', 'ocr_heldout', 'style drift from the base model',
             'held-out OCR (Tesseract)'),
            ('ocr_heldout', 'ocr_heldout_rapid', 'held-out OCR, Tesseract (training reader)',
             'held-out OCR, RapidOCR (second reader)')]
  panels = [p for p in panels if any(p[0] in r and p[1] in r for r in rows)]
  if not panels:
    return
  fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
  for ax, (xk, yk, xl, yl) in zip(axes[0], panels):
    xs, ys = curves(rows, xk), curves(rows, yk)
    for method in xs:
      if method in ys and len(xs[method][0]) == len(ys[method][0]):
        ax.plot(xs[method][1], ys[method][1], 'o-', ms=3, label=LABELS.get(method, method))
        ax.annotate(str(int(xs[method][0][-1])), (xs[method][1][-1], ys[method][1][-1]), fontsize=7)
    if xk == 'ocr_heldout':
      lo, hi = ax.get_xlim()
      ax.plot([lo, hi], [lo, hi], 'k:', lw=0.8)
    ax.set_xlabel(xl)
    ax.set_ylabel(yl)
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def report(rows, out):
  with open(os.path.join(out, 'ocr_methods.jsonl'), 'w', encoding='utf-8') as f:
    for r in rows:
      f.write(json.dumps(r) + '\n')
  plot(rows, os.path.join(out, 'ocr_methods.png'))
  print(table(rows))
  print()
  print(contrasts(rows))
  print()
  print(at_matched_reward(rows))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--iterations', type=int, default=200)
  p.add_argument('--eval_every', type=int, default=25)
  p.add_argument('--cells', default=DEFAULT_CELLS, help='method:seed,seed;... (presets of ocr_tiny)')
  p.add_argument('--workdir', default=os.path.join(REPO, 'workdir_ocr_table'),
                 help='checkpoints and evaluations.jsonl (keep it between sittings)')
  p.add_argument('--budget_minutes', type=float, default=0, help='stop after about this long (0: no limit)')
  p.add_argument('--prompts', type=int, default=64)
  p.add_argument('--per_prompt', type=int, default=4)
  p.add_argument('--out', default=HERE)
  p.add_argument('--report', action='store_true', help='only write the outputs from the recorded rows')
  args = p.parse_args(argv)
  if args.eval_every < 1 or args.iterations < 1:
    p.error('--iterations and --eval_every must be >= 1')
  return args


def main(argv=None):
  xla_flags.apply()                    # the CLIs' XLA:CPU defaults (ddrl_jax/xla_flags.py)
  args = parse_args(argv)
  cells = parse_cells(args.cells)
  meta = dict(date=time.strftime('%Y-%m-%d'), machine=f'{platform.machine()} {os.cpu_count()} cores',
              command=' '.join(['python'] + sys.argv))
  runner = Runner(args, meta)
  if not args.report:
    runner.run(cells)
  wanted = set(cells) | {('base', 0)}
  report([r for r in runner.rows if (r['method'], r['seed']) in wanted], args.out)


if __name__ == '__main__':
  main()
