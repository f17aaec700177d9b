"""The paper's image table at CPU scale: DDRL against faithful FlowGRPO, DanceGRPO and DiffusionNFT, several
seeds per method, with confidence intervals, two OCR readers and the hacking statistics.

  python benchmarks/ocr_table.py                        # the full plan; resumes wherever it stopped
  python benchmarks/ocr_table.py --budget_minutes=120   # stop cleanly after ~2 hours (rerun to go on)
  python benchmarks/ocr_table.py --report               # only the table and plot from the recorded rows
                                                        # (every recorded cell; --cells narrows it)
  python benchmarks/ocr_table.py --cells='ddrl:0;dance_grpo:0' --iterations=40 --eval_every=20
  python benchmarks/ocr_table.py --cells='ddrl:0;ddrl+lora4:0;ddrl+lora16:0' --iterations=80 --eval_every=40 \
      --workdir=workdir_ocr_lora --out=benchmarks/ocr_lora        # LoRA against full fine-tuning

A method '<preset>+lora<r>' is the preset with LoRA adapters of rank r, alpha 2r, on the default targets
(the DiT blocks' attention projections), at LORA_LEARNING_RATE. A method may be a named arm (ARMS: the
controls) and may carry config overrides, '<method>@<key>=<value>@...' (values as Python literals, else
strings), e.g. 'ddrl@rl.data_beta=0.03' or 'flow_grpo_exact_kl@rl.kl_beta=0.1'; its workdir is named after
the whole string. --base=<key>=<value>@... overrides the base model's config (a shifted base) for the
'base' row and every cell.

The Pareto sweeps (issue 28) and the shifted-base table, each in its own workdir:
  python benchmarks/ocr_table.py --name=ocr_pareto --workdir=workdir_ocr_pareto \
      --cells="$(python benchmarks/ocr_table.py --print_plan=pareto)" --budget_minutes=N
  python benchmarks/ocr_table.py --name=ocr_shifted --workdir=workdir_ocr_shifted \
      --base=ocr.base_checkpoint=checkpoints/ocr_tiny_base_dark --cells=... --budget_minutes=N

Judges (ddrl_jax/tasks/ocr_judges.py) score every evaluation when they are available: `typicality` (an
independent model's denoising error; needs checkpoints/ocr_tiny_judge) and `fd_recognizer` (Frechet
distance to real renders in RapidOCR's recognizer features). Every evaluation's held-out samples are
kept (<workdir>/<method>/seed<s>/samples/it<iteration>.npz, the base's in <workdir>/base/), so
--rejudge adds a judge to rows recorded before it existed. Rows carry the machine's boot id and its
arithmetic (`numerics`: a fingerprint of the base's evaluation, which each machine instance makes once;
machines whose XLA:CPU kernels use another vector ISA sample slightly different images from the same
parameters and seed). Gains over the base are taken against the base of the row's own arithmetic, and
the report lists the cells of each arithmetic.

Every cell (method, seed) starts from configs/ocr_tiny.py's shipped base model and runs the same
iterations of 8 prompts x 8 rollouts with the same SDE sampler (methods differ in their objective; the
presets in configs/common.py cite the code each follows). The seed changes the RL randomness (prompts,
rollout noise, steps); the base model and the evaluation (prompts, seeds) are the same for every cell.
Each cell's training metrics go to its workdir's metrics.jsonl (and TensorBoard events), as the trainer's
own loop writes them. Every --eval_every iterations a cell is checkpointed and evaluated by ddrl_jax.tasks.ocr_eval.evaluate_ocr:
held-out OCR by the training reader (Tesseract) and by a second reader (RapidOCR / PP-OCR), style drift to
the data and from the base's own samples, diversity, the texture and colour statistics, held-out diffusion
loss. Rows are appended to <workdir>/evaluations.jsonl as they are made, so a killed or budgeted run
loses at most one interval and the next run continues from the cells' checkpoints (a kill between a
checkpoint and its evaluation row re-evaluates that checkpoint, and its interval's training time is
not counted). An evaluation this machine already made of the same parameters and evaluation settings
(every cell's iteration 0 is the base's) is copied, naming its source in `evaluation_of`.

Outputs in --out (benchmarks/): ocr_methods.jsonl (every evaluation, with command, date and machine),
ocr_methods.png (held-out OCR against drift from the base, and Tesseract against RapidOCR, over
training; means over seeds), ocr_methods_<method>.png (samples of the first seed at its last evaluation),
ocr_methods_arms.png (the base and every method side by side: one sample of each of 8 held-out strings,
first seed, last evaluation up to --iterations, from the samples kept in the workdir),
and on stdout three markdown tables: mean and 95% t-interval over seeds at each method's last common
iteration (seeds still short of --iterations are left out, and listed, once another seed of the method
reached it); DDRL minus every other method (Welch 95% intervals) with DDRL's share of its OCR gain; and
every method at the first evaluation where it reached DDRL's final OCR (regularization at equal reward).
(ocr_table.jsonl / ocr_table*.png are the earlier 80-iteration, one-seed table of RESULTS.md.)
"""
import argparse
import collections
import hashlib
import re
import json
import math
import os
import platform
import shutil
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from configs import ocr_tiny
from ddrl_jax import config_overrides
from ddrl_jax import flops as flops_lib
from ddrl_jax import image_grid
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import trainer as trainer_lib
from ddrl_jax import xla_flags
from ddrl_jax.models import lora
from ddrl_jax.tasks import ocr_eval
from ddrl_jax.tasks import ocr_judges
from ddrl_jax.tasks import ocr_metrics

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# The plan of issue 14: 3 seeds for the main methods, one for the variants; FlowGRPO with the exact KL got
# 3 seeds too, because its one seed matched DDRL's reward at lower drift (RESULTS.md).
DEFAULT_CELLS = ('ddrl:0,1,2;flow_grpo:0,1,2;dance_grpo:0,1,2;diffusion_nft:0,1,2;'
                 'ddrl_reduced:0;ddrl_synthetic:0;flow_grpo_exact_kl:0,1,2')
LABELS = {'base': 'base', 'ddrl': 'DDRL', 'flow_grpo': 'FlowGRPO', 'dance_grpo': 'DanceGRPO',
          'diffusion_nft': 'DiffusionNFT', 'ddrl_reduced': 'DDRL reduced (first step)',
          'ddrl_reduced_random': 'DDRL reduced (random step)', 'ddrl_synthetic': 'DDRL, synthetic data',
          'flow_grpo_exact_kl': 'FlowGRPO, exact KL (stronger)',
          'ddrl_dark_synthetic': "DDRL, the shifted base's synthetic data"}
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


# Named arms: (ocr_tiny preset, overrides). The controls of issue 28: the data term alone (no policy
# gradient), and FlowGRPO's exact KL with everything else DDRL's (cosmos-rl advantages, DDRL's 5 trained
# steps 0, 2, ..., 8 instead of 9, no zero-advantage dropping).
ARMS = {
    'ddrl_data_only': ('ddrl', {'rl.pg_weight': 0.0}),
    'flow_grpo_ddrl_recipe': ('flow_grpo_exact_kl', {'rl.adv_normalization': 'cosmos_rl',
                                                     'rl.drop_zero_advantages': False,
                                                     'rl.train_steps': (0, 2, 4, 6, 8)}),
    # DDRL regularized by the shifted base's own samples (Table 4's setting on the shifted base).
    'ddrl_dark_synthetic': ('ddrl', {'data.path': os.path.join(REPO, 'checkpoints', 'ocr_tiny_dark_synthetic')}),
}
# The Pareto sweeps (issue 28, item 2): DDRL's data_beta and exact-KL FlowGRPO's kl_beta, 3 seeds each,
# and the controls (the data-term-only control runs 50 iterations: --iterations applies to all cells, so
# it gets its own command, see RESULTS.md).
DATA_BETAS = (0.003, 0.01, 0.03, 0.1, 0.3)
KL_BETAS = (0.004, 0.01, 0.04, 0.1, 0.3)
# The shifted base of issue 28, item 3 (pretrained on dark text only; configs/ocr_tiny.py pretrain_style),
# and its supervised fine-tuning on the full renders (the first stage of the two-stage pipeline).
DARK_BASE = 'checkpoints/ocr_tiny_base_dark'
DARK_SFT = 'checkpoints/ocr_tiny_dark_sft'
SHIFTED_BASE = f'ocr.base_checkpoint={DARK_BASE}'
SHIFTED_LORA_RANK = 16          # rank 16 followed full fine-tuning closely at 80 iterations (RESULTS.md)
PLANS = {
    'pareto': ';'.join([f'ddrl@rl.data_beta={b}:0,1,2' for b in DATA_BETAS] +
                       [f'flow_grpo_exact_kl@rl.kl_beta={b}:0,1,2' for b in KL_BETAS]),
    'controls': 'flow_grpo_ddrl_recipe:0,1,2',
    'data_only': 'ddrl_data_only:0,1,2',
    # Issue 45's deciding experiment on the full-data base (pre-registered in RESULTS.md): path-KL DDRL
    # against exact-KL FlowGRPO, 3 seeds, --iterations=600 --eval_every=50.
    'decide': ';'.join([f'ddrl@rl.data_beta={b}@rl.data_weighting=path_kl:0,1,2' for b in (0.03, 0.1, 0.3)] +
                       [f'flow_grpo_exact_kl@rl.kl_beta={b}:0,1,2' for b in (0.004, 0.01)]),
    # Issue 45 on the shifted base (--base=SHIFTED_BASE): the weighting's shape against its strength
    # (cosmos-rl's at 0.03 ~ the total weight of path-KL at 0.1; path-KL at 0.3), the paper's eps-MSE, and
    # SFT-then-DDRL against DDRL alone (the paper's Figure 5 comparison) with the decided default data
    # term (path-KL; DDRL alone at path-KL 0.1 is issue 28's `ocr_shifted_path_kl` arm, 3 seeds).
    'weighting': ';'.join(['ddrl@rl.data_beta=0.03:0,1,2',
                           'ddrl@rl.data_beta=0.3@rl.data_weighting=path_kl:0,1,2',
                           'ddrl@rl.data_beta=0.1@rl.data_weighting=eps_mse:0,1,2',
                           'ddrl@rl.data_beta=0.1:0,1,2',
                           f'ddrl@rl.data_beta=0.1@rl.data_weighting=path_kl@ocr.base_checkpoint={DARK_SFT}:0,1,2']),
}


def shifted_plan(data_beta, kl_beta, seeds='0,1,2'):
  """The --cells of the shifted-base arms (run with --base=SHIFTED_BASE) at the knees `data_beta` (DDRL)
  and `kl_beta` (exact-KL FlowGRPO): DDRL with the full renders; FlowGRPO anchored to the shifted base;
  FlowGRPO after SFT (its base and KL reference are the SFT model, a cell override that --base does not
  undo); DDRL with the shifted base's synthetic samples, in full and with LoRA."""
  d, k = f'rl.data_beta={data_beta:g}', f'rl.kl_beta={kl_beta:g}'
  arms = [f'ddrl@{d}', f'flow_grpo_exact_kl@{k}', f'flow_grpo_exact_kl@{k}@ocr.base_checkpoint={DARK_SFT}',
          f'ddrl_dark_synthetic@{d}', f'ddrl_dark_synthetic+lora{SHIFTED_LORA_RANK}@{d}']
  return ';'.join(f'{arm}:{seeds}' for arm in arms)


# 'rl.data_beta=0.03@rl.kl_form=exact' -> {'rl.data_beta': 0.03, 'rl.kl_form': 'exact'}, and its setter
parse_overrides = config_overrides.parse
apply_overrides = config_overrides.apply


# Every cell of these tables (issues 14 to 45) was recorded while the presets' data term was cosmos-rl's
# weighting at data_beta 0.01 (the library's default until issue 45 chose 'path_kl'); a method string
# keeps the meaning it was recorded with, so the tables' presets start from that data term.
RECORDED_DATA_TERM = {'rl.data_weighting': 'cosmos_rl', 'rl.data_beta': 0.01}


def make_config(method):
  """The config of `method`: '<preset or arm>[+lora<r>][@key=value...]' (module docstring)."""
  name, _, overrides = method.partition('@')
  preset, _, rank = name.partition('+lora')
  preset, arm = ARMS.get(preset, (preset, {}))
  config = ocr_tiny.get_config(preset)
  if preset != 'ddrl_exact':            # Theorem 3.1's preset sets its own (path-KL, beta 1)
    apply_overrides(config, RECORDED_DATA_TERM, method)
  apply_overrides(config, arm, method)
  if rank:
    config.lora.update(rank=int(rank), alpha=2.0 * int(rank))
    config.optim.learning_rate = LORA_LEARNING_RATE
  return apply_overrides(config, parse_overrides(overrides), method)


def cell_dirname(method):
  """A directory name for a method string (overrides included)."""
  return re.sub(r'[^\w.+=-]', '_', method.replace('@', '__'))


def boot_id():
  """This machine instance's boot id (Linux), else the host name."""
  try:
    with open('/proc/sys/kernel/random/boot_id', encoding='utf-8') as f:
      return f.read().strip()
  except OSError:
    return platform.node()


def parse_cells(text):
  """'ddrl:0,1;dance_grpo:0' -> [('ddrl', 0), ('dance_grpo', 0), ('ddrl', 1)]: seed-major, so a partial run
  has every method at seed 0 before any method at seed 1."""
  cells = []
  for part in filter(None, (p.strip() for p in text.split(';'))):
    method, _, seeds = part.rpartition(':')
    if not (method and seeds):
      raise ValueError(f'--cells entry {part!r} is not method:seed[,seed...]')
    cells += [(method.strip(), int(s)) for s in seeds.split(',')]
  for method, _ in cells:
    make_config(method)                    # an unknown preset raises here, before anything runs
  order = {m: i for i, m in enumerate(dict.fromkeys(m for m, _ in cells))}
  return sorted(dict.fromkeys(cells), key=lambda c: (c[1], order[c[0]]))


def read_rows(path):
  """The rows of a rows file ([] where there is none). Rows of the first, one-seed version of this script
  (ocr_table.jsonl, --methods=...) carry no 'seed': they ran the config's seed 0, and are read as such."""
  if not os.path.exists(path):
    return []
  with open(path, encoding='utf-8') as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r if 'seed' in r or 'method' not in r else dict(r, seed=0) for r in rows]


def recorded_cells(rows):
  """[(method, seed)] of every cell `rows` record (the base's included), in order of first appearance:
  what --report and --rejudge read when --cells is not given, whatever plan the rows were made with."""
  return list(dict.fromkeys((r['method'], r.get('seed')) for r in rows if r.get('method') is not None))


def write_rows(path, rows):
  """Rewrites a rows file atomically (a crash leaves the old file or the new one)."""
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    for r in rows:
      f.write(json.dumps(r) + '\n')
  os.replace(tmp, path)


def append_row(path, row):
  with open(path, 'a', encoding='utf-8') as f:
    f.write(json.dumps(row) + '\n')
    f.flush()
    os.fsync(f.fileno())


def passes_per_condition(config):
  """(rollout, training) network passes per condition and iteration (a backward counts as 2 passes):
  N times `ddrl_jax.flops.iteration_passes`, with classifier-free guidance doubling every call."""
  p = flops_lib.iteration_passes(config)
  n, g = config.num_rollouts, ocr_eval.guidance_factor(config)
  return int(round(n * p.rollout * g)), int(round(n * (p.total - p.rollout) * g))


# The config sections ddrl_jax.tasks.ocr_eval.evaluate_ocr and the judges read (the sampler, the readers, the
# model's task and layout); the RL sections (rl, optim, data, seed, ...) do not change an evaluation.
EVALUATION_CONFIG = ('sampler', 'ocr', 'reward', 'mesh', 'sharding', 'model_family', 'task')


def params_digest(params):
  """sha256 hex digest of a parameter tree: every leaf's shape, dtype and bytes, in tree order."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    value = np.asarray(leaf)
    digest.update(f'{value.shape}{value.dtype}'.encode())
    digest.update(value.tobytes())
  return digest.hexdigest()


def evaluation_key(config, params, args, judges):
  """A digest of everything an evaluation's numbers depend on besides the machine: the parameters, the
  EVALUATION_CONFIG sections, the evaluation's size and the judges."""
  sections = {k: config[k].to_dict() if hasattr(config[k], 'to_dict') else config[k]
              for k in EVALUATION_CONFIG if k in config}
  spec = dict(config=sections, prompts=args.prompts, per_prompt=args.per_prompt,
              judges=sorted(judges), judge_renders=args.judge_renders)
  text = params_digest(params) + json.dumps(spec, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:32]


class Runner:
  """Trains and evaluates cells, recording one row per evaluation in <workdir>/evaluations.jsonl."""

  def __init__(self, args, meta):
    self.args, self.meta = args, meta
    os.makedirs(args.workdir, exist_ok=True)
    self.rows_path = os.path.join(args.workdir, 'evaluations.jsonl')
    committed = os.path.join(args.out, f'{args.name}.jsonl')
    if not os.path.exists(self.rows_path) and os.path.exists(committed):
      # A new machine: the checkpoints are gone but the report's rows were committed. Finished cells
      # are not trained again; unfinished ones restart (their later rows are dropped in `cell`).
      rows = read_rows(committed)
      write_rows(self.rows_path, rows)
      print(f'{self.rows_path}: started from the {len(rows)} rows of {committed}', flush=True)
    self.rows = read_rows(self.rows_path)
    self.deadline = time.monotonic() + 60 * args.budget_minutes if args.budget_minutes > 0 else None
    self.reference = None
    self._base_params = None
    self._base_key = None
    self.cells = []
    self._judges = None

  def base_config(self, method='ddrl'):
    """make_config(method) with --base's overrides (the model every cell starts from)."""
    return apply_overrides(make_config(method), parse_overrides(self.args.base), '--base')

  def judges(self, config):
    """{name: judge} of the judges available here (built once; module docstring)."""
    if self._judges is None:
      self._judges = {}
      if not self.args.no_judges:
        num = self.args.judge_renders
        cache = os.path.join(self.args.workdir, 'recognizer_reference.npy')
        cached = np.load(cache) if os.path.exists(cache) else None
        if cached is not None and len(cached) != num:    # made with another --judge_renders
          cached = None
        fd = ocr_judges.FrechetJudge(reference=ocr_judges.reference_renders(num) if cached is None else None,
                                     reference_features=cached)
        np.save(cache, fd.reference)
        self._judges['fd_recognizer'] = fd
        try:
          typicality = ocr_judges.TypicalityJudge(config, range_renders=num)
          self._judges['typicality'] = typicality
          self._judges['typicality_outside'] = typicality.outside_fraction
        except FileNotFoundError as e:
          print(f'no typicality judge: {e}', flush=True)
    return self._judges

  def samples_path(self, method, seed, iteration):
    where = 'base' if method == 'base' else os.path.join(cell_dirname(method), f'seed{seed}')
    return os.path.join(self.args.workdir, where, 'samples', f'it{iteration:04d}.npz')

  def out_of_time(self):
    return self.deadline is not None and time.monotonic() > self.deadline

  def recorded(self, method, seed, iteration):
    return any(r['method'] == method and r['seed'] == seed and r['iteration'] == iteration
               for r in self.rows)

  def evaluate(self, config, trainer, method, seed, iteration, train_seconds, reuse=True):
    """Evaluates the trainer's params, appends the row; returns the (P, K) grid and image statistics.

    With `reuse`, an evaluation this machine already made of the same parameters under the same
    evaluation settings (`evaluation_key`) is copied instead of recomputed (every cell's iteration 0 is
    the base's; on one machine the evaluation is deterministic, RESULTS.md): the row names its source in
    `evaluation_of`, its samples file is copied, and the drift from the base, the grid and the statistics
    are computed from those samples as evaluate_ocr computes them.
    """
    a = self.args
    params = lora.combine(trainer.state.params, trainer.state.frozen)
    judges = self.judges(config)
    key = evaluation_key(config, params, a, judges)
    rollout, train = passes_per_condition(config) if method != 'base' else (0, 0)
    row = dict(self.meta, method=method, seed=seed, iteration=iteration, train_seconds=train_seconds,
               passes_rollout=rollout, passes_train=train, boot_id=boot_id(), evaluation_key=key)
    source = self.same_evaluation(key) if reuse else None
    if source is not None:
      target = self.samples_path(method, seed, iteration)
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.copyfile(self.samples_path(source['method'], source['seed'], source['iteration']), target)
      row['evaluation_of'] = source.get(
          'evaluation_of', f"{source['method']}:{source['seed']}:{source['iteration']}")
      row.update({k: v for k, v in source.items() if k not in row})
      images, _ = ocr_eval.load_samples(target)      # what evaluate_ocr computed its statistics on
      stats = ocr_metrics.batch_stats(images)
      if self.reference is not None:
        row['style_drift_from_reference'] = ocr_metrics.style_drift(stats, self.reference)
      grid = ocr_eval.sample_grid(images, a.prompts, a.per_prompt)
    else:
      metrics, grid, stats = ocr_eval.evaluate_ocr(
          config, trainer.apply_fn, params, trainer.task, prompts=a.prompts,
          per_prompt=a.per_prompt, reference_stats=self.reference, return_stats=True,
          judges=judges, samples_path=self.samples_path(method, seed, iteration))
      row.update(metrics)
    self.rows.append(row)
    append_row(self.rows_path, row)
    shown = {k: round(row[k], 4) for k, _, _ in COLUMNS if k in row}
    print(json.dumps(dict(method=method, seed=seed, iteration=iteration, **shown,
                          **({'evaluation_of': row['evaluation_of']} if source else {}))), flush=True)
    return grid, stats

  def same_evaluation(self, key):
    """The last row this machine recorded with evaluation key `key` and its samples on disk, else None
    (the base's row, recorded before rows carried keys, matches the key of the parameters `base` loaded)."""
    if self._base_key is None and self._base_params is not None:
      config = self.base_config()
      self._base_key = evaluation_key(config, self._base_params, self.args, self.judges(config))
    for r in reversed(self.rows):
      matches = r.get('evaluation_key', self._base_key if r['method'] == 'base' else None) == key
      if (matches and r.get('boot_id') == boot_id()
          and os.path.exists(self.samples_path(r['method'], r['seed'], r['iteration']))):
        return r
    return None

  def base(self):
    """The base model's evaluation (once per machine instance: its values fingerprint the machine's
    arithmetic, `numerics_of`, which every later row records) and its image statistics, the reference
    of 'drift from base'."""
    stats_path = os.path.join(self.args.workdir, 'base_stats.npy')
    config = self.base_config()
    trainer = trainer_lib.Trainer(config, os.path.join(self.args.workdir, 'base'))
    trainer.restore_or_init()
    here = lambda: [r for r in self.rows if r['method'] == 'base' and r.get('boot_id') == boot_id()]
    if not here() or not os.path.exists(stats_path):
      grid, stats = self.evaluate(config, trainer, 'base', 0, 0, 0.0, reuse=False)
      np.save(stats_path, stats)
      image_grid.write_grid(os.path.join(self.args.out, f'{self.args.name}_base.png'), grid,
                            columns=self.args.per_prompt * 2)
    self._base_params = lora.combine(trainer.state.params, trainer.state.frozen)   # keyed when first needed
    trainer.close_rewards()
    self.reference = np.load(stats_path)
    self.meta['numerics'] = numerics_of(here()[-1])

  def cell_config(self, method, seed):
    """The config a cell trains: its preset or arm, then --base, then the cell's own overrides."""
    config = self.base_config(method.partition('@')[0])
    apply_overrides(config, parse_overrides(method.partition('@')[2]), method)
    config.seed = seed
    config.num_iterations = self.args.iterations
    config.checkpoint_every = self.args.eval_every
    config.eval_every = -1
    return config

  def cell(self, method, seed):
    """Trains one cell from its latest checkpoint to --iterations, evaluating every --eval_every."""
    a = self.args
    if self.recorded(method, seed, a.iterations):   # finished, with or without its checkpoints
      return True
    config = self.cell_config(method, seed)
    trainer = trainer_lib.Trainer(config, os.path.join(a.workdir, cell_dirname(method), f'seed{seed}'))
    start = trainer.restore_or_init()

    def stale(rows):   # evaluations past the checkpoint it resumes from, or at it in another arithmetic
      return [r['method'] == method and r['seed'] == seed and (
          r['iteration'] > start or (r['iteration'] == start and k['numerics'] != self.meta['numerics']))
              for r, k in zip(rows, with_numerics(rows))]
    if any(stale(self.rows)):          # made again
      # re-read first: another process may share the workdir (one cell list per core)
      rows = read_rows(self.rows_path)
      drop = stale(rows)
      print(f'{method} seed {seed}: resumes at {start}; dropping its rows at '
            f'{sorted(r["iteration"] for r, d in zip(rows, drop) if d)}', flush=True)
      self.rows = [r for r, d in zip(rows, drop) if not d]
      write_rows(self.rows_path, self.rows)
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
      image_grid.write_grid(os.path.join(a.out, f'{a.name}_{cell_dirname(method)}.png'), grid,
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
  bases = bases_by_numerics(rows)
  for kind, base in bases.items():
    cells = []
    for key, _, fmt in present:
      text = f'{base[key]:{fmt}}' if key in base else '-'
      ref = DATA_REFERENCE.get(key)
      if ref and ref in base:
        text += f' (data {base[ref]:{fmt}})'
      cells.append(text)
    label = 'base' if len(bases) == 1 else f'base (arithmetic {kind})'
    lines.append(f'| {label} | 0 | - | ' + ' | '.join(cells) + ' | - | - |')
  for method, (it, n, stats) in summ.items():
    if method == 'base':
      continue
    cells = [cell_text(stats[k], fmt) if k in stats else '-' for k, _, fmt in present]
    cost = (f"{stats['passes_rollout'][0]:.0f} + {stats['passes_train'][0]:.0f}"
            if 'passes_rollout' in stats and 'passes_train' in stats else '-')   # the first table counted NFE
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
    ('style_drift', 'drift to data', '.2f'),
    ('typicality', 'typicality', '.4f'),
    ('typicality_outside', 'outside typical range', '.2f'),
    ('fd_recognizer', 'FD recognizer', '.2f'),
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
  cells, bases = by_cell(rows), bases_by_numerics(rows)
  if reference not in cells or not bases:
    return ''
  name = LABELS.get(reference, reference)
  head = ['method', 'iteration', f'seeds ({name}, method)', f'{name} gain / method gain (Tesseract)'] + [
      f'{name} - method: {title}' for _, title, _ in CONTRAST_KEYS]
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
    gain_ref = np.mean([gain(bases, r) for r in ref_rows])
    gain_m = np.mean([gain(bases, r) for r in rows_m])
    if gain_m <= 0:
      share = f'(method gain {gain_m:+.3f})'
    elif gain_ref <= 0:
      share = f'({name} gain {gain_ref:+.3f})'
    else:
      share = f'{gain_ref / gain_m:.0%}'
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


# ------------------------------------------------------------------------------- Pareto frontiers
READERS = (('ocr_heldout', 'Tesseract'), ('ocr_heldout_rapid', 'RapidOCR'))
# (key, title, format): the judges a frontier is drawn against (lower = closer to the data or the base).
JUDGES = (('typicality', 'typicality (judge x0 MSE)', '.4f'),
          ('typicality_outside', 'outside real renders\' typicality range', '.3f'),
          ('fd_recognizer', 'FD, recognizer features', '.2f'),
          ('style_drift_from_reference', 'drift from base', '.2f'),
          ('heldout_diffusion_loss', 'held-out diffusion loss', '.4f'))
# The matched-reward table reads every judge, these two included (higher = nearer the data's variety), so
# no verdict rests on a subset chosen after the fact.
MATCHED_JUDGES = JUDGES + (('colour_spread', 'colour spread (higher = the data\'s variety)', '.3f'),
                           ('diversity', 'diversity (higher = more varied)', '.3f'))


def sweeps(methods):
  """{sweep name: [(value, method), ...] sorted by value}: methods of one preset whose overrides differ in
  exactly one numeric key (a sweep needs two or more settings). The name is '<preset>@<key>' for methods
  with that one override, and '<preset>@<fixed key>=<value>...@<key>' when other overrides are held fixed
  (e.g. 'ddrl@rl.data_weighting=path_kl@rl.data_beta'). Values ascend from weak to strong regularization
  (data_beta, kl_beta)."""
  out = collections.defaultdict(list)
  for m in methods:
    name, _, text = m.partition('@')
    overrides = parse_overrides(text)
    for key, value in overrides.items():
      if not isinstance(value, (int, float)) or isinstance(value, bool):
        continue
      fixed = ''.join(f'@{k}={v}' for k, v in sorted(overrides.items()) if k != key)
      out[f'{name}{fixed}@{key}'].append((float(value), m))
  return {k: sorted(v) for k, v in out.items() if len(v) >= 2}


def _last_rows(cells, method, iteration=None):
  """(iteration, rows of every seed) at `iteration` or the method's last common one; (None, [])."""
  seeds = cells.get(method)
  if not seeds:
    return None, []
  common = set.intersection(*(set(evals) for evals in seeds.values()))
  if not common:
    return None, []
  it = iteration if iteration is not None else max(common)
  return it, [evals[it] for evals in seeds.values() if it in evals]


def frontier_table(rows, iteration=None):
  """Markdown: every setting of every sweep at its last common iteration, mean ± 95% t over seeds."""
  cells = by_cell(rows)
  keys = [(k, t, '.3f') for k, t in READERS] + list(JUDGES) + [('colour_spread', 'colour spread', '.2f'),
                                                               ('diversity', 'diversity', '.2f')]
  lines = markdown_head(['sweep', 'value', 'iteration', 'seeds'] + [t for _, t, _ in keys])
  for sweep, members in sweeps(list(cells)).items():
    for value, method in members:
      it, at = _last_rows(cells, method, iteration)
      if not at:
        continue
      texts = [cell_text(t_interval([r[k] for r in at]), fmt) if all(k in r for r in at) else '-'
               for k, _, fmt in keys]
      lines.append(f'| {sweep} | {value:g} | {it} | {len(at)} | ' + ' | '.join(texts) + ' |')
  return '\n'.join(lines)


def _interpolate_at(level, ys, xs):
  """x where the piecewise-linear curve through (ys[i], xs[i]) first reaches y = `level`, walking the
  frontier from its strongest regularization (the last point: settings ascend from weak to strong)
  toward weaker: the most regularized point at that reward. None if no segment reaches it. (A frontier
  that crosses the level twice gives the crossing nearer the strong end, whatever the judge's values.)"""
  points = list(zip(ys, xs))[::-1]
  for (y0, x0), (y1, x1) in zip(points, points[1:]):
    if min(y0, y1) <= level <= max(y0, y1):
      return x0 if y1 == y0 else x0 + (level - y0) * (x1 - x0) / (y1 - y0)
  return None


def bootstrap_stream(name):
  """The random stream of one sweep's bootstrap: independent experiments get independent resamples (a
  shared seed would give two sweeps with the same seed layout identical picks, correlating them)."""
  return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)


def matched_judge(rows, methods, level, judge, reward='ocr_heldout', iteration=None, draws=2000, seed=0):
  """A sweep's `judge` value at reward `level`: the seed means of every setting joined in sweep order and
  interpolated linearly at `level`, with a 95% bootstrap interval (seeds resampled within each setting).
  Returns (value, low, high, bootstrap values) or None where the frontier never reaches `level`
  (settings without rows at `iteration` are left out)."""
  cells = by_cell(rows)
  per = []
  for method in methods:
    _, at = _last_rows(cells, method, iteration)
    at = [r for r in at if reward in r and judge in r]
    if at:       # a setting without rows at `iteration` (still running) is not on the frontier
      per.append((np.array([r[reward] for r in at]), np.array([r[judge] for r in at])))
  value = _interpolate_at(level, [y.mean() for y, _ in per], [x.mean() for _, x in per])
  if value is None:
    return None
  rng = np.random.default_rng(seed)
  boot = []
  for _ in range(draws):
    picks = [rng.integers(0, len(y), len(y)) for y, _ in per]
    v = _interpolate_at(level, [y[i].mean() for (y, _), i in zip(per, picks)],
                        [x[i].mean() for (_, x), i in zip(per, picks)])
    boot.append(np.nan if v is None else v)
  boot = np.asarray(boot)
  low, high = np.nanpercentile(boot, [2.5, 97.5])
  return value, float(low), float(high), boot


def difference_text(a, b, fmt):
  """'value [low, high]' of a - b for two matched readings (value, low, high, bootstrap values, ...): the
  95% interval of the paired bootstrap differences where both resamples reach the level, and the share
  of resamples where one does not; '-' where either side never reaches it."""
  if a is None or b is None:
    return '-'
  diff = a[3] - b[3]
  ok = np.isfinite(diff)
  lo, hi = np.percentile(diff[ok], [2.5, 97.5]) if ok.any() else (np.nan, np.nan)
  missing = f'; {1 - ok.mean():.0%} of resamples miss the level' if ok.mean() < 1 else ''
  return f'{a[0] - b[0]:+{fmt}} [{lo:+{fmt}}, {hi:+{fmt}}]{missing}'


def matched_table(rows, levels=(0.45, 0.55), iteration=None):
  """Markdown: each sweep's judges at matched Tesseract OCR `levels`, and the difference of the first two
  sweeps (DDRL - FlowGRPO in the Pareto plan) with its bootstrap interval (resamples where both reach
  the level; the share of resamples where one does not is shown)."""
  cells = by_cell(rows)
  fams = sweeps(list(cells))
  if not fams:
    return ''
  names = list(fams)
  head = ['Tesseract OCR', 'judge'] + [f'{n} (95% bootstrap)' for n in names]
  if len(names) >= 2:
    head.append(f'{names[0]} - {names[1]}')
  lines = markdown_head(head)
  for level in levels:
    for judge, title, fmt in MATCHED_JUDGES:
      found = [matched_judge(rows, [m for _, m in fams[n]], level, judge, iteration=iteration,
                             seed=bootstrap_stream(n)) for n in names]
      texts = [('not reached' if f is None else f'{f[0]:{fmt}} [{f[1]:{fmt}}, {f[2]:{fmt}}]') for f in found]
      if len(names) >= 2:
        texts.append(difference_text(found[0], found[1], fmt))
      lines.append(f'| {level:.2f} | {title} | ' + ' | '.join(texts) + ' |')
  return '\n'.join(lines)


def _seed_curves(rows, method, keys, iteration=None):
  """(iterations, {key: (seeds, iterations) array}) of `method` at the iterations every seed reached (up
  to `iteration`) and where every seed's row has every key; (None, None) without such iterations."""
  seeds = by_cell(rows).get(method)
  if not seeds:
    return None, None
  common = sorted(it for it in set.intersection(*(set(evals) for evals in seeds.values()))
                  if (iteration is None or it <= iteration)
                  and all(k in evals[it] for evals in seeds.values() for k in keys))
  if not common:
    return None, None
  return np.array(common), {k: np.array([[evals[it][k] for it in common] for evals in seeds.values()])
                            for k in keys}


def matched_along_training(rows, method, level, judge, reward='ocr_heldout', iteration=None, draws=2000,
                           seed=0):
  """One arm's `judge` at reward `level` along its training: the seed-mean curves of reward and judge over
  iterations 0..`iteration`, interpolated linearly at the first iteration where the mean reward reaches
  `level` (the arm's frontier when it has one setting: fewer iterations are the stronger regularization,
  so this is the same first-crossing rule as `_interpolate_at`'s). A 95% bootstrap interval resamples whole
  seeds (a seed's curve stays together). Returns (value, low, high, bootstrap values, crossing iteration)
  or None where the mean curve never reaches `level`."""
  its, arrays = _seed_curves(rows, method, (reward, judge), iteration)
  if its is None:
    return None
  y, x = arrays[reward], arrays[judge]

  def at(picks):   # _interpolate_at walks its points from the last one: give them latest-first
    return _interpolate_at(level, y[picks].mean(0)[::-1], x[picks].mean(0)[::-1])

  everyone = np.arange(len(y))
  value = at(everyone)
  if value is None:
    return None
  crossing = _interpolate_at(level, y.mean(0)[::-1], its[::-1].astype(float))
  rng = np.random.default_rng(seed)
  boot = np.array([np.nan if (v := at(rng.integers(0, len(y), len(y)))) is None else v
                   for _ in range(draws)])
  low, high = np.nanpercentile(boot, [2.5, 97.5])
  return value, float(low), float(high), boot, crossing


def arms_matched_table(rows, methods, levels=(0.45, 0.55), iteration=None):
  """Markdown: two or more single-setting arms (no sweep) at matched Tesseract OCR `levels`, each along its
  own training (`matched_along_training`), and the first arm minus the second with the bootstrap interval
  of the difference (independent seed resamples per arm, `bootstrap_stream`)."""
  arms = [m for m in methods if m != 'base']
  if len(arms) < 2:
    return ''
  head = ['Tesseract OCR', 'judge'] + [f'{LABELS.get(m, m)} (95% bootstrap; iteration)' for m in arms]
  head.append(f'{LABELS.get(arms[0], arms[0])} - {LABELS.get(arms[1], arms[1])}')
  lines = markdown_head(head)
  for level in levels:
    for judge, title, fmt in MATCHED_JUDGES:
      found = [matched_along_training(rows, m, level, judge, iteration=iteration,
                                      seed=bootstrap_stream(m)) for m in arms]
      texts = [('not reached' if f is None else f'{f[0]:{fmt}} [{f[1]:{fmt}}, {f[2]:{fmt}}]; it {f[4]:.0f}')
               for f in found]
      texts.append(difference_text(found[0], found[1], fmt))
      lines.append(f'| {level:.2f} | {title} | ' + ' | '.join(texts) + ' |')
  return '\n'.join(lines)


def hacking_onset(rows, method, iteration=None, outside_points=0.10, spread_share=0.5, level=0.45):
  """The pre-registered E3 reading of one arm, on its seed-mean curves over iterations 0..`iteration`:
  (onset, OCR at onset, first iteration at mean OCR >= `level`), where onset is the first evaluation at
  which the outside share exceeds the base's by `outside_points` or the colour spread falls below
  `spread_share` of the base's (each against the base of the rows' machine arithmetic); None for an
  iteration the curves never reach. None where the arm has no rows or no base is recorded."""
  bases = bases_by_numerics(rows)
  its, arrays = _seed_curves(rows, method, ('ocr_heldout', 'typicality_outside', 'colour_spread'), iteration)
  if its is None or not bases:
    return None
  first_row = next(iter(by_cell(rows)[method].values()))[int(its[0])]
  base = base_for(bases, first_row)
  ocr, outside, spread = (arrays[k].mean(0) for k in ('ocr_heldout', 'typicality_outside', 'colour_spread'))
  hacked = (outside > base['typicality_outside'] + outside_points) | (spread < spread_share * base['colour_spread'])
  onset = int(its[np.argmax(hacked)]) if hacked.any() else None
  reached = ocr >= level
  return (onset, float(ocr[np.argmax(hacked)]) if hacked.any() else None,
          int(its[np.argmax(reached)]) if reached.any() else None)


def onset_table(rows, methods, iteration=None, level=0.45):
  """Markdown: `hacking_onset` of every arm (E3's pre-registered reading), with the seeds and the last
  iteration the curves cover."""
  lines = markdown_head(['arm', 'seeds', 'iterations read', 'onset (outside share > base + 10 points or '
                         'colour spread < half the base\'s)', 'OCR at onset', f'first iteration at OCR >= {level}'])
  for m in methods:
    if m == 'base':
      continue
    found = hacking_onset(rows, m, iteration, level=level)
    if found is None:
      continue
    its, _ = _seed_curves(rows, m, ('ocr_heldout', 'typicality_outside', 'colour_spread'), iteration)
    onset, ocr, first = found
    lines.append(f'| {LABELS.get(m, m)} | {len(by_cell(rows)[m])} | 0-{int(its[-1])} | '
                 f'{"none" if onset is None else onset} | {"-" if ocr is None else f"{ocr:.3f}"} | '
                 f'{"not reached" if first is None else first} |')
  return '\n'.join(lines)


def knee(rows, methods, reward='ocr_heldout', share=0.5, iteration=None):
  """The knee of a sweep whose `methods` run from weak to strong regularization: the strongest setting
  whose mean `reward` gain over the base (`gain`: the base of each row's own machine arithmetic) keeps
  at least `share` of the sweep's largest mean gain. Judge-free on purpose (the shifted-base arms are
  then compared by the judges without having been picked by them).
  Returns (index into methods, {method: mean gain}), or None before every setting has rows at one iteration."""
  cells, bases = by_cell(rows), bases_by_numerics(rows)
  if not bases:
    return None
  gains, reached = {}, set()
  for method in methods:
    it, at = _last_rows(cells, method, iteration)
    if not at:
      return None
    reached.add(it)
    gains[method] = float(np.mean([gain(bases, r, reward) for r in at]))
  if len(reached) > 1:          # a setting still running: gains at different iterations do not compare
    return None
  best = max(gains.values())
  if best <= 0:
    return None
  return max(i for i, m in enumerate(methods) if gains[m] >= share * best), gains


def knee_text(rows, iteration=None):
  """Markdown lines: each sweep's mean OCR gain per setting and its knee (`knee`)."""
  lines = []
  for sweep, members in sweeps(list(by_cell(rows))).items():
    found = knee(rows, [m for _, m in members], iteration=iteration)
    if found is None:
      lines.append(f'- {sweep}: no knee yet (a setting has no row or stops at another iteration, or none gained)')
      continue
    i, gains = found
    text = ', '.join(f'{v:g}: {gains[m]:+.3f}' for v, m in members)
    lines.append(f'- {sweep}: knee {members[i][0]:g} (mean Tesseract gain over the base by setting: {text})')
  return '\n'.join(lines)


def plot_frontiers(rows, path, iteration=None):
  """One panel per (reader, judge): each sweep's settings at their last common iteration, seed means with
  95% t error bars on both axes, joined in sweep order and labelled with the swept value."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  cells = by_cell(rows)
  fams = sweeps(list(cells))
  if not fams:
    return
  fig, axes = plt.subplots(len(READERS), len(JUDGES), figsize=(4.2 * len(JUDGES), 3.8 * len(READERS)),
                           squeeze=False)
  bases = list(bases_by_numerics(rows).values())
  for row_ax, (reward, reader) in zip(axes, READERS):
    for ax, (judge, title, _) in zip(row_ax, JUDGES):
      for name, members in fams.items():
        pts = []
        for value, method in members:
          _, at = _last_rows(cells, method, iteration)
          if at and all(reward in r and judge in r for r in at):
            (xm, xh), (ym, yh) = t_interval([r[judge] for r in at]), t_interval([r[reward] for r in at])
            pts.append((value, xm, np.nan_to_num(xh), ym, np.nan_to_num(yh)))
        if pts:
          _, xm, xh, ym, yh = map(np.array, zip(*pts))
          ax.errorbar(xm, ym, xerr=xh, yerr=yh, fmt='o-', ms=3, capsize=2, label=name)
          for value, x, _, y, _ in pts:
            ax.annotate(f'{value:g}', (x, y), fontsize=6)
      for i, base in enumerate(bases):   # one star per machine arithmetic (numerics_note)
        if judge in base and reward in base:
          ax.plot([base[judge]], [base[reward]], 'k*', ms=8, label='base' if i == 0 else None)
      ax.set_xlabel(title)
      ax.set_ylabel(f'held-out OCR ({reader})')
      ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# Fields of the base model's evaluation that fingerprint a machine's arithmetic (evaluate_ocr always
# computes them; XLA:CPU's kernels follow the host's vector ISA, so two machine kinds sample slightly
# different images from the same parameters and seed: RESULTS.md, issue 28).
NUMERICS_KEYS = ('ocr_heldout', 'ocr_heldout_rapid', 'heldout_diffusion_loss', 'style_drift', 'diversity',
                 'colour_spread')


def numerics_of(base_row):
  """A short id of the arithmetic of the machine that recorded `base_row` (the base model's evaluation):
  two machines reproduce each other's rows bit for bit only where they reproduce this evaluation, so rows
  with one id compare directly and rows with another are compared through their own machine's base."""
  fields = [repr(float(base_row[k])) for k in NUMERICS_KEYS if k in base_row]
  return hashlib.sha256(' '.join(fields).encode()).hexdigest()[:8]


def with_numerics(rows):
  """`rows`, each with 'numerics': a base row's own (`numerics_of`); a cell row's recorded one, else that
  of the base row its machine instance (boot id) recorded, else the one id every base row shares, else
  'unknown'."""
  by_boot = {r.get('boot_id'): numerics_of(r) for r in rows if r['method'] == 'base'}
  kinds = set(by_boot.values())
  shared = next(iter(kinds)) if len(kinds) == 1 else 'unknown'
  out = []
  for r in rows:
    if r['method'] == 'base':
      kind = numerics_of(r)
    else:
      kind = r.get('numerics') or by_boot.get(r.get('boot_id'), shared)
    out.append(r if r.get('numerics') == kind else dict(r, numerics=kind))
  return out


def bases_by_numerics(rows):
  """{numerics: the last base row recorded on machines of that arithmetic}, kinds in order of appearance."""
  out = {}
  for r in with_numerics([r for r in rows if r['method'] == 'base']):
    out[r['numerics']] = r
  return out


def base_for(bases, row):
  """The base row of `row`'s machine arithmetic (the first kind's where its own has none); `bases`
  (`bases_by_numerics`) must not be empty."""
  return bases.get(row.get('numerics'), next(iter(bases.values())))


def gain(bases, row, key='ocr_heldout'):
  """row[key] minus the same key of the base evaluated on a machine with the row's arithmetic."""
  return row[key] - base_for(bases, row)[key]


def numerics_note(rows):
  """Text naming, where rows come from machines of more than one arithmetic, each kind's base reading
  and its cells (method:seed, by the arithmetic of its last evaluation), and how they are compared."""
  rows = with_numerics(rows)
  bases = bases_by_numerics(rows)
  kinds = collections.defaultdict(set)
  for method, seeds in by_cell(rows).items():
    for seed, evals in seeds.items():
      if method != 'base':     # a cell counts where its last evaluation was made
        kinds[evals[max(evals)]['numerics']].add(f'{method}:{seed}')
  if len(set(kinds) | set(bases)) <= 1:
    return ''
  parts = []
  for kind in list(bases) + sorted(set(kinds) - set(bases)):
    b = bases.get(kind)
    reading = f"base Tesseract {b['ocr_heldout']:.4f}" if b else 'no base row'
    parts.append(f'{kind} ({reading}): ' + (', '.join(sorted(kinds[kind])) or 'the base only'))
  return ('rows by machine arithmetic (gains over the base are taken against the base of the same '
          'arithmetic): ' + '; '.join(parts))


def rejudge(runner):
  """Adds the available judges to recorded rows that lack them, from the saved samples; rewrites
  evaluations.jsonl (atomically). Returns the number of rows changed."""
  changed = 0
  judges = runner.judges(runner.base_config())
  for row in runner.rows:
    missing = [n for n in judges if n not in row]
    path = runner.samples_path(row['method'], row['seed'], row['iteration'])
    if missing and os.path.exists(path):
      images, _ = ocr_eval.load_samples(path)
      row.update({n: float(judges[n](images)) for n in missing})
      changed += 1
  if changed:
    write_rows(runner.rows_path, runner.rows)
  return changed


def finished_seeds(rows, iteration):
  """(rows without the seeds still short of `iteration` in methods where another seed reached it, the
  left-out (method, seed, last iteration) sorted). A method whose seeds all stop short keeps them all
  (it is then read at their last common iteration, e.g. a control run for fewer iterations)."""
  running = sorted((method, s, max(evals)) for method, seeds in by_cell(rows).items()
                   if any(iteration in evals for evals in seeds.values())
                   for s, evals in seeds.items() if iteration not in evals)
  left_out = {(method, s) for method, s, _ in running}
  return [r for r in rows if (r['method'], r['seed']) not in left_out], running


def average_last(rows, iteration, evaluations):
  """`rows` with each cell's row at `iteration` holding, in every float field (but train_seconds), the
  mean over that seed's last `evaluations` evaluations up to `iteration` (listed in `averaged_over`);
  a seed with fewer evaluations keeps its row. A sensitivity check of reading a cell at one iteration:
  DDRL's held-out OCR moves by 0.04-0.07 between evaluations 25 iterations apart (RESULTS.md)."""
  if evaluations <= 1:
    return rows
  cells = by_cell(rows)
  out = []
  for r in rows:
    evals = cells[r['method']][r['seed']]
    window = sorted(i for i in evals if i <= iteration)[-evaluations:]
    if r['method'] == 'base' or r['iteration'] != iteration or len(window) < evaluations:
      out.append(r)
      continue
    means = {k: float(np.mean([evals[i][k] for i in window])) for k, v in r.items()
             if isinstance(v, float) and k != 'train_seconds'
             and all(isinstance(evals[i].get(k), float) for i in window)}
    out.append(dict(r, **means, averaged_over=window))
  return out


def report(rows, out, name='ocr_methods', levels=(0.45, 0.55), reference='ddrl', iteration=None,
           evaluations=1, contrast_reference='ddrl', recorded=None, arms=None):
  """Writes <out>/<name>.jsonl and the plots; prints the tables of `rows`. `recorded`: the rows the
  record keeps (default `rows`); a report of some cells passes every row of the workdir, so the record
  never loses the cells it does not table; `arms`: the methods in the order of --cells (without a sweep,
  the first two are compared at matched reward along training, the first minus the second; default:
  the rows' order). `levels`: the matched-OCR
  levels of the sweeps' comparison; `reference`: the cell whose final OCR the along-training comparison
  matches; `iteration`: the planned last iteration. Where it is given, a seed still short of it is left
  out of every table and plot once another seed of its method reached it (so a cell just started does
  not pull its method back to iteration 0), and the left-out seeds are listed; a setting with no seed
  there is left out of the frontiers, so a running cell is not drawn as a point. `evaluations` > 1 reads
  every cell at `iteration` as the mean of its last that many evaluations (`average_last`) in the
  tables, frontiers and knees (the along-training plot and match keep every evaluation);
  `contrast_reference`: the cell the contrasts table subtracts every other cell from."""
  rows = with_numerics(rows)
  write_rows(os.path.join(out, f'{name}.jsonl'), rows if recorded is None else with_numerics(recorded))
  running = []
  if iteration is not None:
    rows, running = finished_seeds(rows, iteration)
  plot(rows, os.path.join(out, f'{name}.png'))
  at_end = rows
  if evaluations > 1 and iteration is not None:
    at_end = average_last(rows, iteration, evaluations)
    print(f'(cells read at iteration {iteration} as the mean of their last {evaluations} evaluations)')
    print()
  print(table(at_end))
  print()
  print(contrasts(at_end, contrast_reference))
  print()
  print(at_matched_reward(rows, reference))
  if sweeps(list(by_cell(rows))):
    suffix = '' if at_end is rows else f'_last{evaluations}'
    plot_frontiers(at_end, os.path.join(out, f'{name}_frontiers{suffix}.png'), iteration)
    print()
    print(frontier_table(at_end, iteration))
    print()
    print(matched_table(at_end, levels, iteration))
    print()
    print(knee_text(at_end, iteration))
  recorded_methods = [m for m in by_cell(rows) if m != 'base']
  arms = [m for m in (arms or recorded_methods) if m in recorded_methods]
  if not sweeps(recorded_methods) and len(arms) >= 2:    # single-setting arms: matched along training
    print()
    print(arms_matched_table(rows, arms, levels, iteration))
  onsets = onset_table(rows, arms, iteration)
  if onsets.count('\n') > 1:
    print()
    print(onsets)
  if running:
    print()
    print(f'still running (left out until they reach iteration {iteration}): ' +
          ', '.join(f'{m} seed {s} at {it}' for m, s, it in running))
  note = numerics_note(rows)
  if note:
    print()
    print(note)


def spread_prompts(texts, columns):
  """Indices of the first sample of `columns` distinct texts spread evenly over the distinct texts in
  their order (all of them when there are fewer)."""
  first = {}
  for i, text in enumerate(texts):
    first.setdefault(text, i)
  first = list(first.values())
  if len(first) <= columns:
    return first
  return [first[int(j)] for j in np.linspace(0, len(first) - 1, columns).round()]


def arms_samples(rows, samples_path, methods, iteration, columns=8):
  """[(label, (<=columns, H, W, 3) uint8)] for the base and each of `methods`, in that order: one sample
  of each of `columns` held-out strings (the same strings in every row), from the first seed's last
  evaluation at or before `iteration` whose samples `samples_path(method, seed, iteration)` holds. A
  method with none on disk is left out and named on stdout."""
  strips, missing = [], []
  for method in ['base'] + [m for m in methods if m != 'base']:
    kept = [r for r in rows if r['method'] == method and r['iteration'] <= iteration
            and os.path.exists(samples_path(method, r['seed'], r['iteration']))]
    if not kept:
      missing.append(method)
      continue
    shown = min(kept, key=lambda r: (r['seed'], -r['iteration']))   # first seed, its last evaluation
    seed, last = shown['seed'], shown['iteration']
    images, texts = ocr_eval.load_samples(samples_path(method, seed, last))
    strips.append((f'{method} (seed {seed}, iteration {last})', images[spread_prompts(texts, columns)]))
  if missing:
    print(f'arms grid: no samples on disk for {", ".join(missing)}')
  return strips


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--iterations', type=int, default=200)
  p.add_argument('--eval_every', type=int, default=25)
  p.add_argument('--cells', default=None,
                 help='method:seed,seed;... (presets of ocr_tiny); default: DEFAULT_CELLS for a run, and '
                      'with --report or --rejudge every cell the recorded rows hold')
  p.add_argument('--workdir', default=os.path.join(REPO, 'workdir_ocr_table'),
                 help='checkpoints and evaluations.jsonl (keep it between sittings)')
  p.add_argument('--budget_minutes', type=float, default=0, help='stop after about this long (0: no limit)')
  p.add_argument('--prompts', type=int, default=64)
  p.add_argument('--per_prompt', type=int, default=4)
  p.add_argument('--out', default=HERE)
  p.add_argument('--report', action='store_true', help='only write the outputs from the recorded rows')
  p.add_argument('--name', default='ocr_methods', help='prefix of the output files in --out')
  p.add_argument('--base', default='', help="config overrides of the base model, 'key=value@key=value'")
  p.add_argument('--rejudge', action='store_true',
                 help='add missing judges to recorded rows from their saved samples, then report')
  p.add_argument('--no_judges', action='store_true', help='evaluate without the judges (tests)')
  p.add_argument('--judge_renders', type=int, default=1024,
                 help="real renders behind the judges' references (FD statistics, typicality range)")
  p.add_argument('--print_plan', choices=sorted(PLANS) + ['shifted'], help='print a --cells plan and exit')
  p.add_argument('--levels', default='0.45,0.55',
                 help='Tesseract OCR levels of the matched comparison of the sweeps (comma-separated)')
  p.add_argument('--matched_reference', default='ddrl',
                 help='the cell whose last OCR every cell is compared at, along training')
  p.add_argument('--contrast_reference', default=None,
                 help="the cell the contrasts table compares every other cell with (reference - cell); "
                      "default 'ddrl' where it is one of the cells")
  p.add_argument('--knees', default='', help="the shifted plan's 'data_beta,kl_beta' (see shifted_plan)")
  p.add_argument('--average_last', type=int, default=1,
                 help="the report's tables read each cell at --iterations as the mean of its last N "
                      'evaluations (a sensitivity check; 1: that evaluation alone)')
  args = p.parse_args(argv)
  if args.eval_every < 1 or args.iterations < 1:
    p.error('--iterations and --eval_every must be >= 1')
  if args.average_last < 1:
    p.error('--average_last must be >= 1')
  if args.judge_renders < 2:
    p.error('--judge_renders must be >= 2 (a Frechet distance needs a covariance)')
  try:
    args.levels = tuple(float(v) for v in args.levels.split(','))
  except ValueError:
    p.error(f'--levels must be comma-separated numbers, not {args.levels!r}')
  if args.cells is None and not (args.report or args.rejudge):
    args.cells = DEFAULT_CELLS
  if args.print_plan == 'shifted':
    try:
      args.knees = tuple(float(v) for v in args.knees.split(','))
    except ValueError:
      args.knees = ()
    if len(args.knees) != 2 or min(args.knees) <= 0:
      p.error("--print_plan=shifted needs --knees=<data_beta>,<kl_beta> (two positive numbers)")
  return args


def main(argv=None):
  xla_flags.apply()                    # the CLIs' XLA:CPU defaults (ddrl_jax/xla_flags.py)
  args = parse_args(argv)
  if args.print_plan:
    print(shifted_plan(*args.knees) if args.print_plan == 'shifted' else PLANS[args.print_plan])
    return

  def checked(cells, what):
    methods = list(dict.fromkeys(m for m, _ in cells))   # in the order of the cells
    if args.contrast_reference is not None and args.contrast_reference not in methods:
      raise SystemExit(f'--contrast_reference={args.contrast_reference!r} is not one of the {what} '
                       f'methods: {methods}')
    return cells, methods

  # checked before the workdir is touched; a report without --cells reads every recorded cell
  cells, methods = checked(parse_cells(args.cells), '--cells') if args.cells is not None else (None, None)
  parse_overrides(args.base)
  meta = dict(date=time.strftime('%Y-%m-%d'), machine=f'{platform.machine()} {os.cpu_count()} cores',
              command=' '.join(['python'] + sys.argv))
  runner = Runner(args, meta)
  if cells is None:
    cells, methods = checked(recorded_cells(runner.rows), 'recorded')
  if args.rejudge:
    print(f'rejudged {rejudge(runner)} rows', flush=True)
  elif not args.report:
    runner.run(cells)
  wanted = set(cells) | {('base', 0)}
  # read again: another process may share the workdir (one cell list per core) and its rows are kept
  every = read_rows(runner.rows_path)
  report([r for r in every if (r['method'], r['seed']) in wanted], args.out, args.name,
         args.levels, args.matched_reference, args.iterations, args.average_last, args.contrast_reference or 'ddrl',
         recorded=every, arms=methods)
  strips = arms_samples(runner.rows, runner.samples_path, methods, args.iterations)
  if strips:
    image_grid.write_labelled_rows(os.path.join(args.out, f'{args.name}_arms.png'), strips)


if __name__ == '__main__':
  main()
