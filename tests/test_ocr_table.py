"""benchmarks/ocr_table.py: the cell plan, the intervals, the table, and a resumable two-interval run."""
import json
import os
import sys
import time
import types

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks'))

import ocr_table  # pylint: disable=wrong-import-position
from configs import ocr_tiny  # pylint: disable=wrong-import-position
from ddrl_jax import metrics as metrics_lib  # pylint: disable=wrong-import-position


def test_cells_are_seed_major_and_checked():
  assert ocr_table.parse_cells('ddrl:0,1;dance_grpo:0;ddrl:1') == [
      ('ddrl', 0), ('dance_grpo', 0), ('ddrl', 1)]
  cells = ocr_table.parse_cells(ocr_table.DEFAULT_CELLS)
  assert len(cells) == 17 and cells[:7] == [(m, 0) for m in (
      'ddrl', 'flow_grpo', 'dance_grpo', 'diffusion_nft', 'ddrl_reduced', 'ddrl_synthetic',
      'flow_grpo_exact_kl')]
  with pytest.raises(ValueError, match='method:seed'):
    ocr_table.parse_cells('ddrl')
  with pytest.raises(ValueError, match='preset'):
    ocr_table.parse_cells('ppo:0')


def test_t_interval_matches_the_closed_form():
  mean, half = ocr_table.t_interval([1.0, 2.0, 3.0])
  # t(0.975, 2) = 4.302653; sem = 1 / sqrt(3)
  assert mean == 2.0 and half == pytest.approx(4.302653 / np.sqrt(3), rel=1e-6)
  assert np.isnan(ocr_table.t_interval([0.5])[1])


def _row(method, seed, iteration, ocr, **extra):
  return dict(method=method, seed=seed, iteration=iteration, ocr_heldout=ocr, train_seconds=60.0 * iteration,
              passes_rollout=80, passes_train=240, **extra)


def test_summary_uses_the_last_iteration_every_seed_reached():
  rows = [_row('base', 0, 0, 0.25, style_drift=21.0, data_style_drift=0.6)]
  rows += [_row('ddrl', s, it, 0.25 + 0.001 * it + 0.01 * s) for s in range(3) for it in (0, 25, 50)]
  rows += [_row('ddrl', 0, 75, 0.9)]                   # seed 0 ran ahead: not in the table yet
  summ = ocr_table.summary(rows)
  it, n, stats = summ['ddrl']
  assert (it, n) == (50, 3)
  np.testing.assert_allclose(stats['ocr_heldout'][0], 0.31)
  text = ocr_table.table(rows)
  assert '| DDRL | 50 | 3 | 0.310 ± 0.025 |' in text
  assert '(data 0.60)' in text and text.count('\n') == 3


class _FakeTrainer:
  """What ocr_table.Runner uses of a Trainer, without a model: a checkpoint is a file holding the step,
  and every build / trained iteration / evaluation goes to `calls` (kept across Runners, as across
  processes), so the plan, resume and budget logic is checked in seconds."""
  calls = []

  def __init__(self, config, workdir):
    self.config, self.workdir = config, str(workdir)
    self.apply_fn = self.task = None
    self.state = types.SimpleNamespace(params=None, frozen=None)   # frozen: a LoRA base (none here)
    self.ckpt = types.SimpleNamespace(wait_until_finished=lambda: None)
    parts = self.workdir.split(os.sep)
    self.name = '/'.join(parts[-1:] if parts[-1] == 'base' else parts[-2:])   # base, METHOD/seedS

  def _set_step(self, step):
    self.step = step
    self.state.params = (self.name, step)     # what _fake_evaluate sees of the model

  def restore_or_init(self):
    path = os.path.join(self.workdir, 'step')
    self._set_step(int(open(path).read()) if os.path.exists(path) else 0)
    return self.step

  def _build(self):
    self.calls.append(('build', self.name))

  def train_iteration(self, i):
    assert i == self.step, (i, self.step)
    self.calls.append(('train', self.name, i))
    time.sleep(0.01)                           # measurable train_seconds
    self._set_step(i + 1)
    return {'loss': 1.0 / (i + 1), 'reward_mean': 0.1 * i}

  def save(self):
    os.makedirs(self.workdir, exist_ok=True)
    with open(os.path.join(self.workdir, 'step'), 'w') as f:
      f.write(str(self.step))

  def close_rewards(self):
    pass


def _fake_evaluate(config, apply_fn, params, task, prompts, per_prompt, reference_stats=None,
                   return_stats=False, judges=None, samples_path=None):
  del apply_fn, task, return_stats
  _FakeTrainer.calls.append(('eval',) + params)
  time.sleep(0.01)                             # longer than the 6 ms budget below
  name, step = params
  metrics = dict(ocr_heldout=0.25 + 0.01 * step, style_drift=float(len(name)))
  if reference_stats is not None:
    metrics['style_drift_from_reference'] = 0.5 * step
  m = prompts * per_prompt
  images = np.full((m, 4, 4, 3), step, np.uint8)
  metrics.update({n: judge(images) for n, judge in (judges or {}).items()})
  metrics['data_beta'] = config.rl.data_beta              # what the cell's config was
  if samples_path:
    ocr_table.ocr_eval.save_samples(samples_path, images, ['T'] * m)
  return metrics, images, np.zeros((m, 12))


@pytest.fixture
def fake_cells(monkeypatch):
  monkeypatch.setattr(ocr_table, 'trainer_lib', types.SimpleNamespace(Trainer=_FakeTrainer))
  monkeypatch.setattr(ocr_table.ocr_eval, 'evaluate_ocr', _fake_evaluate)
  _FakeTrainer.calls = []
  return _FakeTrainer.calls


def _keys(work):
  return [(r['method'], r['seed'], r['iteration'])
          for r in ocr_table.read_rows(os.path.join(work, 'evaluations.jsonl'))]


def test_a_budgeted_run_resumes_without_repeating_work_stub(tmp_path, fake_cells):
  """The slow test below with the cell's training and evaluation stubbed: every iteration is trained
  and every checkpoint evaluated exactly once over a budgeted run and two reruns."""
  work, out = tmp_path / 'work', tmp_path / 'out'
  out.mkdir()
  argv = ['--cells=ddrl:0', '--iterations=2', '--eval_every=1', '--prompts=2', '--per_prompt=2',
          f'--workdir={work}', f'--out={out}', '--no_judges']
  args = ocr_table.parse_args(argv + ['--budget_minutes=0.0001'])
  assert ocr_table.Runner(args, {}).run(ocr_table.parse_cells(args.cells)) is False
  assert fake_cells == [('eval', 'base', 0), ('build', 'ddrl/seed0'), ('eval', 'ddrl/seed0', 0)]
  assert _keys(work) == [('base', 0, 0), ('ddrl', 0, 0)]
  del fake_cells[:]
  ocr_table.main(argv)
  assert fake_cells == [('build', 'ddrl/seed0'), ('train', 'ddrl/seed0', 0), ('eval', 'ddrl/seed0', 1),
                        ('train', 'ddrl/seed0', 1), ('eval', 'ddrl/seed0', 2)]
  rows = ocr_table.read_rows(os.path.join(work, 'evaluations.jsonl'))
  assert _keys(work) == [('base', 0, 0), ('ddrl', 0, 0), ('ddrl', 0, 1), ('ddrl', 0, 2)]
  assert [r['train_seconds'] for r in rows[1:2]] == [0.0]
  assert rows[-1]['train_seconds'] > rows[-2]['train_seconds'] >= 0.01
  assert [r['ocr_heldout'] for r in rows] == pytest.approx([0.25, 0.25, 0.26, 0.27])
  assert 'style_drift_from_reference' in rows[-1]
  rollout, train = ocr_table.passes_per_condition(ocr_tiny.get_config('ddrl'))
  assert rows[-1]['passes_rollout'] == rollout > 0 and rows[-1]['passes_train'] == train > 0
  assert rows[0]['passes_rollout'] == rows[0]['passes_train'] == 0
  curves = [r for r in metrics_lib.read_metrics(work / 'ddrl' / 'seed0') if 'loss' in r]
  assert [(r['step'], r['loss']) for r in curves] == [(1, 1.0), (2, 0.5)]
  with open(out / 'ocr_methods.jsonl', encoding='utf-8') as f:
    assert len([json.loads(line) for line in f]) == 4
  assert (out / 'ocr_methods_ddrl.png').exists() and (out / 'ocr_methods_base.png').exists()
  del fake_cells[:]
  ocr_table.main(argv)                                  # finished: nothing trains or evaluates again
  assert fake_cells == [] and len(_keys(work)) == 4


def test_cells_run_seed_major_and_resume_where_they_stopped(tmp_path, fake_cells):
  """Stubbed cells: every method's seed 0 before any seed 1; a budget cut between cells resumes with
  the next cell; the sample grid is the first seed's."""
  work, out = tmp_path / 'work', tmp_path / 'out'
  out.mkdir()
  argv = ['--cells=ddrl:0,1;dance_grpo:0', '--iterations=2', '--eval_every=2', '--prompts=1',
          '--per_prompt=2', f'--workdir={work}', f'--out={out}', '--no_judges']
  ocr_table.main(argv + ['--budget_minutes=0.0001'])    # one cell (no budget check before the first)
  assert _keys(work) == [('base', 0, 0), ('ddrl', 0, 0)]
  ocr_table.main(argv)
  assert _keys(work) == [('base', 0, 0), ('ddrl', 0, 0), ('ddrl', 0, 2), ('dance_grpo', 0, 0),
                         ('dance_grpo', 0, 2), ('ddrl', 1, 0), ('ddrl', 1, 2)]
  trained = [c[1:] for c in fake_cells if c[0] == 'train']
  assert trained == [('ddrl/seed0', 0), ('ddrl/seed0', 1), ('dance_grpo/seed0', 0),
                     ('dance_grpo/seed0', 1), ('ddrl/seed1', 0), ('ddrl/seed1', 1)]
  assert sorted(p.name for p in out.glob('*.png')) == [
      'ocr_methods.png', 'ocr_methods_arms.png', 'ocr_methods_base.png', 'ocr_methods_dance_grpo.png',
      'ocr_methods_ddrl.png']


def test_a_new_machine_starts_from_the_committed_rows(tmp_path, fake_cells, capsys):
  """A workdir lost with its machine: the rerun starts from the report's rows in --out, skips the
  finished cell, and restarts the unfinished one from scratch, dropping its rows past iteration 0."""
  out = tmp_path / 'out'
  out.mkdir()
  argv = ['--cells=ddrl:0,1', '--iterations=2', '--eval_every=1', '--prompts=1', '--per_prompt=2',
          f'--out={out}', '--no_judges']
  ocr_table.main(argv + [f'--workdir={tmp_path / "lost"}'])
  committed = ocr_table.read_rows(str(out / 'ocr_methods.jsonl'))
  # the machine was lost while seed 1 was between its evaluations at iterations 1 and 2
  ocr_table.write_rows(str(out / 'ocr_methods.jsonl'),
                       [r for r in committed if (r['method'], r['seed'], r['iteration']) != ('ddrl', 1, 2)])
  del fake_cells[:]
  work = tmp_path / 'new'
  ocr_table.main(argv + [f'--workdir={work}'])
  assert 'started from the 6 rows' in capsys.readouterr().out
  assert fake_cells == [('eval', 'base', 0), ('build', 'ddrl/seed1'), ('train', 'ddrl/seed1', 0),
                        ('eval', 'ddrl/seed1', 1), ('train', 'ddrl/seed1', 1), ('eval', 'ddrl/seed1', 2)]
  keys = _keys(work)
  assert sorted(set(keys)) == sorted({(r['method'], r['seed'], r['iteration']) for r in committed})
  assert keys.count(('ddrl', 1, 1)) == 1      # the stale row was dropped, not duplicated


@pytest.mark.slow
def test_a_budgeted_run_resumes_without_repeating_work(tmp_path):
  """Two 1-iteration intervals of one real cell (training and evaluation; the stubbed test above
  checks the same plan in seconds), the second in a new process-like Runner: the first run is
  cut by its budget after one interval, the second trains only the remaining one."""
  work, out = tmp_path / 'work', tmp_path / 'out'
  out.mkdir()
  # Real judges on 32 real renders (the experiments' 1024 cost minutes per process on one core).
  argv = ['--cells=ddrl:0', '--iterations=2', '--eval_every=1', '--prompts=2', '--per_prompt=2',
          f'--workdir={work}', f'--out={out}', '--judge_renders=32']
  args = ocr_table.parse_args(argv + ['--budget_minutes=0.0001'])
  runner = ocr_table.Runner(args, {})
  assert runner.run(ocr_table.parse_cells(args.cells)) is False
  first = ocr_table.read_rows(os.path.join(work, 'evaluations.jsonl'))
  assert [(r['method'], r['iteration']) for r in first] == [('base', 0), ('ddrl', 0)]
  ocr_table.main(argv)
  rows = ocr_table.read_rows(os.path.join(work, 'evaluations.jsonl'))
  keys = [(r['method'], r['seed'], r['iteration']) for r in rows]
  assert keys == [('base', 0, 0), ('ddrl', 0, 0), ('ddrl', 0, 1), ('ddrl', 0, 2)]
  assert rows[-1]['train_seconds'] > rows[-2]['train_seconds'] > 0
  assert all(np.isfinite(r['ocr_heldout']) for r in rows)
  # The cell starts from the base's parameters, so its iteration 0 is the base's evaluation, copied.
  assert rows[1]['evaluation_of'] == 'base:0:0' and 'evaluation_of' not in rows[2]
  assert rows[1]['ocr_heldout'] == rows[0]['ocr_heldout'] and rows[1]['typicality'] == rows[0]['typicality']
  assert abs(rows[1]['style_drift_from_reference']) < 1e-6    # 4 samples: sqrtm's noise on a singular fit
  assert 'style_drift_from_reference' in rows[-1]
  assert all(np.isfinite(r[k]) for r in rows for k in ('fd_recognizer', 'typicality', 'typicality_outside'))
  assert np.load(work / 'recognizer_reference.npy').shape[0] == 32
  curves = [r for r in metrics_lib.read_metrics(work / 'ddrl' / 'seed0') if 'loss' in r]
  assert [r['step'] for r in curves] == [1, 2] and all(np.isfinite(r['reward_mean']) for r in curves)
  with open(out / 'ocr_methods.jsonl', encoding='utf-8') as f:
    assert len([json.loads(line) for line in f]) == 4
  assert (out / 'ocr_methods_ddrl.png').exists() and (out / 'ocr_methods_base.png').exists()
  ocr_table.main(argv)                                  # finished: nothing trains or evaluates again
  assert len(ocr_table.read_rows(os.path.join(work, 'evaluations.jsonl'))) == 4


def test_welch_interval_matches_scipy():
  from scipy import stats  # pylint: disable=g-import-not-at-top
  a, b = [0.42, 0.39, 0.47], [0.64, 0.55, 0.61, 0.70]
  diff, half = ocr_table.welch_interval(a, b)
  low, high = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
  np.testing.assert_allclose([diff - half, diff + half], [low, high], rtol=1e-10)
  assert np.isnan(ocr_table.welch_interval([0.4], b)[1])


def test_contrasts_against_ddrl():
  rows = [_row('base', 0, 0, 0.25)]
  rows += [_row('ddrl', s, it, 0.25 + 0.1 * (it > 0) + 0.01 * s, style_drift_from_reference=5.0 + s)
           for s in range(3) for it in (0, 200)]
  rows += [_row('flow_grpo', s, it, 0.25 + 0.2 * (it > 0) + 0.01 * s, style_drift_from_reference=20.0 + s)
           for s in range(3) for it in (0, 200)]
  rows += [_row('dance_grpo', 0, it, 0.2) for it in (0, 100)]      # one seed, stopped early, OCR fell
  text = ocr_table.contrasts(rows)
  lines = text.splitlines()
  assert len(lines) == 4
  # gains 0.11 and 0.21; both sides have sd 0.01 over 3 seeds: se = 0.01 sqrt(2/3), Welch dof 4,
  # t(0.975, 4) = 2.776445, so the half-width is 0.0227 (OCR) and 2.27 (drift, sd 1)
  assert lines[2].startswith('| FlowGRPO | 200 | 3, 3 | 52% | -0.100 ± 0.023 | - | - | -15.00 ± 2.27 |')
  # DanceGRPO's one seed stopped at 100, DDRL's rows are at 0 and 200: compared at 0, no interval
  assert lines[3].startswith('| DanceGRPO | 0 | 3, 1 | (method gain -0.050) | +0.060 | - |')
  assert ocr_table.contrasts([r for r in rows if r['method'] != 'ddrl']) == ''


def test_contrasts_against_a_named_cell_with_the_judges(tmp_path, capsys):
  """--contrast_reference names the cell the contrasts subtract from (the shifted-base arms have no plain
  'ddrl'); the judges (drift to data, typicality, FD) are contrasted too."""
  ref, other = 'ddrl@rl.data_beta=0.1', 'flow_grpo_exact_kl@rl.kl_beta=0.01'
  rows = [_row('base', 0, 0, 0.75, style_drift=9.8, typicality=0.036, fd_recognizer=8.0)]
  rows += [_row(ref, s, 200, 0.1 + 0.01 * s, style_drift=120.0 + s, typicality=0.06, fd_recognizer=50.0)
           for s in range(3)]
  rows += [_row(other, s, 200, 0.8 + 0.01 * s, style_drift=10.0 + s, typicality=0.036, fd_recognizer=8.5)
           for s in range(3)]
  work, out = tmp_path / 'work', tmp_path / 'out'
  work.mkdir()
  out.mkdir()
  ocr_table.write_rows(str(work / 'evaluations.jsonl'), rows)
  ocr_table.main(['--report', f'--workdir={work}', f'--out={out}', f'--cells={ref}:0,1,2;{other}:0,1,2',
                  f'--contrast_reference={ref}', f'--matched_reference={ref}'])
  lines = capsys.readouterr().out.splitlines()
  head = next(l for l in lines if l.startswith('| method | iteration | seeds ('))
  assert f'{ref} - method: drift to data' in head and f'{ref} - method: FD recognizer' in head
  cells = lambda line: [c.strip() for c in line.strip('|').split('|')]
  row, titles = cells(next(l for l in lines if l.startswith(f'| {other} | 200 | 3, 3 |'))), cells(head)
  # equal spreads on both sides: the differences are exact, Welch's half-width that of sd 1 (drift)
  assert row[titles.index(f'{ref} - method: Tesseract')] == '-0.700 ± 0.023'
  assert row[titles.index(f'{ref} - method: drift to data')] == '+110.00 ± 2.27'
  assert row[titles.index(f'{ref} - method: typicality')] == '+0.0240 ± 0.0000'
  assert row[titles.index(f'{ref} - method: FD recognizer')].startswith('+41.50')
  # the other cell's OCR rose from the base's 0.75 by 0.06 and DDRL's fell: no share, DDRL's gain
  assert row[titles.index(f'{ref} gain / method gain (Tesseract)')] == f'({ref} gain -0.640)'
  with pytest.raises(SystemExit, match='not one of the --cells'):          # a typo is not an empty table
    ocr_table.main(['--report', f'--workdir={work}', f'--out={out}', f'--cells={ref}:0,1,2',
                    '--contrast_reference=ddrl@rl.data_beta=0.01'])


def test_methods_are_compared_where_they_reach_ddrls_reward():
  rows = [_row('base', 0, 0, 0.25, style_drift_from_reference=0.0)]
  for s in range(2):
    rows += [_row('ddrl', s, it, ocr, style_drift_from_reference=d + s)
             for it, ocr, d in ((0, 0.25, 0.0), (25, 0.30, 2.0), (50, 0.35, 4.0))]
    rows += [_row('flow_grpo', s, it, ocr, style_drift_from_reference=d + s)   # passes 0.35 at 25
             for it, ocr, d in ((0, 0.25, 0.0), (25, 0.36, 9.0), (50, 0.50, 20.0))]
    rows += [_row('dance_grpo', s, it, ocr, style_drift_from_reference=1.0)    # never gets there
             for it, ocr in ((0, 0.25), (25, 0.31), (50, 0.28))]
  lines = ocr_table.at_matched_reward(rows).splitlines()
  assert lines[0] == '(reward level: DDRL at iteration 50, Tesseract 0.350)'
  # two seeds: half-width t(0.975, 1) x sd / sqrt 2 = 12.706205 x 0.5 for the drift
  assert lines[4].startswith('| DDRL | 50 | 2 | 0.350 ± 0.000 |') and '| 4.50 ± 6.35 |' in lines[4]
  assert lines[5].startswith('| FlowGRPO | 25 | 2 | 0.360 ± 0.000 |') and '| 9.50 ± 6.35 |' in lines[5]
  assert lines[6].startswith('| DanceGRPO (never reached; its best) | 25 | 2 | 0.310 ± 0.000 |')


# ------------------------------------------------------------------- issue 28: overrides, judges, frontiers
def test_overrides_arms_and_plans_build_the_configs_they_name():
  c = ocr_table.make_config('ddrl@rl.data_beta=0.03')
  assert c.algorithm == 'ddrl' and c.rl.data_beta == 0.03
  c = ocr_table.make_config('flow_grpo_exact_kl@rl.kl_beta=0.1@ocr.base_checkpoint=checkpoints/x')
  assert (c.rl.kl_beta, c.rl.kl_form, c.ocr.base_checkpoint) == (0.1, 'exact', 'checkpoints/x')
  data_only = ocr_table.make_config('ddrl_data_only')
  assert data_only.rl.pg_weight == 0.0 and data_only.rl.data_beta == 0.01
  # The tables' cells keep the data term they were recorded with (cosmos-rl's weighting at 0.01), whatever
  # the preset's default became; Theorem 3.1's preset keeps its own.
  table, preset = ocr_table.make_config('ddrl'), ocr_tiny.get_config('ddrl')
  assert (table.rl.data_weighting, table.rl.data_beta) == ('cosmos_rl', 0.01)
  assert (preset.rl.data_weighting, preset.rl.data_beta) == ('path_kl', 0.03)
  assert ocr_table.make_config('flow_grpo_exact_kl').rl.data_weighting == 'cosmos_rl'
  exact = ocr_table.make_config('ddrl_exact')
  assert (exact.rl.data_weighting, exact.rl.data_beta) == ('path_kl', 1.0)
  path_kl = ocr_table.make_config('ddrl@rl.data_weighting=path_kl@rl.data_beta=0.1')
  assert (path_kl.rl.data_weighting, path_kl.rl.data_beta) == ('path_kl', 0.1)
  recipe = ocr_table.make_config('flow_grpo_ddrl_recipe')
  ddrl = ocr_table.make_config('ddrl')           # the table's DDRL, as the control was recorded against
  differs = {k for k, v in recipe.rl.items() if ddrl.rl[k] != v}
  # Only the regularizer differs; train_steps spells out what DDRL's None (its algorithm's default) means.
  from ddrl_jax import rl  # pylint: disable=g-import-not-at-top
  assert recipe.algorithm == 'flow_grpo' and differs == {'kl_beta', 'train_steps'}
  assert tuple(recipe.rl.train_steps) == rl.ALGORITHMS['ddrl'].default_train_steps(ddrl.sampler.num_steps)
  assert recipe.rl.kl_form == 'exact'
  lora = ocr_table.make_config('ddrl+lora4@rl.data_beta=0.1')
  assert lora.lora.rank == 4 and lora.rl.data_beta == 0.1
  assert ocr_table.cell_dirname('ddrl@rl.data_beta=0.03') == 'ddrl__rl.data_beta=0.03'
  with pytest.raises(ValueError, match='no key'):
    ocr_table.make_config('ddrl@rl.data_bta=0.03')
  with pytest.raises(ValueError, match='not <config.key>=<value>'):
    ocr_table.make_config('ddrl@rl.data_beta')
  cells = ocr_table.parse_cells(ocr_table.PLANS['pareto'])
  assert len(cells) == 30 and cells[0] == ('ddrl@rl.data_beta=0.003', 0)
  assert {ocr_table.make_config(m).rl.kl_beta for m, _ in cells if m.startswith('flow')} == set(
      ocr_table.KL_BETAS)


def test_a_run_with_overrides_a_shifted_base_and_judges_then_rejudges(tmp_path, fake_cells, monkeypatch):
  """Stubbed cells: a cell's overrides and --base reach its config; every evaluation's samples are kept;
  the judges score each evaluation; --rejudge adds a judge that did not exist when the rows were made."""
  work, out = tmp_path / 'work', tmp_path / 'out'
  out.mkdir()
  judges = {'fd_recognizer': lambda images: float(images.mean())}
  monkeypatch.setattr(ocr_table.Runner, 'judges', lambda self, config: judges)
  argv = ['--cells=ddrl@rl.data_beta=0.3:0', '--iterations=2', '--eval_every=2', '--prompts=1',
          '--per_prompt=2', f'--workdir={work}', f'--out={out}', '--name=pareto',
          '--base=ocr.base_checkpoint=checkpoints/shifted@rl.data_beta=0.02']
  ocr_table.main(argv)
  rows = ocr_table.read_rows(os.path.join(work, 'evaluations.jsonl'))
  assert _keys(work) == [('base', 0, 0), ('ddrl@rl.data_beta=0.3', 0, 0), ('ddrl@rl.data_beta=0.3', 0, 2)]
  assert [r['data_beta'] for r in rows] == [0.02, 0.3, 0.3]      # --base under, the cell's own on top
  assert [r['fd_recognizer'] for r in rows] == [0.0, 0.0, 2.0]
  assert all(r['boot_id'] for r in rows)
  saved = work / 'ddrl__rl.data_beta=0.3' / 'seed0' / 'samples' / 'it0002.npz'
  images, texts = ocr_table.ocr_eval.load_samples(str(saved))
  assert images.shape == (2, 4, 4, 3) and texts == ['T', 'T']
  assert (work / 'base' / 'samples' / 'it0000.npz').exists()
  assert (out / 'pareto.jsonl').exists() and (out / 'pareto_ddrl__rl.data_beta=0.3.png').exists()
  from PIL import Image  # pylint: disable=g-import-not-at-top
  arms = np.asarray(Image.open(out / 'pareto_arms.png'))     # base, then the cell at iteration 2
  assert arms.shape == (2 * (14 + 4 + 2), 4 + 2, 3)
  assert (arms[14:18, :4] == 0).all() and (arms[20 + 14:20 + 18, :4] == 2).all()
  judges['typicality'] = lambda images: float(images.max()) + 1.0
  ocr_table.main(argv + ['--rejudge'])
  rows = ocr_table.read_rows(os.path.join(work, 'evaluations.jsonl'))
  assert [r['typicality'] for r in rows] == [1.0, 1.0, 3.0]
  assert [r['fd_recognizer'] for r in rows] == [0.0, 0.0, 2.0]   # kept, not recomputed


def test_an_evaluation_of_the_same_model_is_copied_not_repeated(tmp_path, fake_cells, monkeypatch):
  """Stubbed cells that all start from the same parameters: a cell's iteration 0 copies the base's row
  and samples (and computes its drift from the base from them), unless its evaluation settings differ
  or the row was made on another machine; parameters that differ are evaluated."""
  monkeypatch.setattr(_FakeTrainer, '_set_step', lambda self, step: (
      setattr(self, 'step', step), setattr(self.state, 'params', ('model', step))))
  work, out = tmp_path / 'work', tmp_path / 'out'
  out.mkdir()
  argv = ['--iterations=1', '--eval_every=1', '--prompts=1', '--per_prompt=2', f'--workdir={work}',
          f'--out={out}', '--no_judges']
  ocr_table.main(argv + ['--cells=ddrl:0;ddrl@sampler.num_steps=3:0'])
  evaluated = [c[1:] for c in fake_cells if c[0] == 'eval']
  assert evaluated == [('model', 0), ('model', 1), ('model', 0), ('model', 1)]
  rows = {(r['method'], r['iteration']): r for r in ocr_table.read_rows(work / 'evaluations.jsonl')}
  base, copied = rows[('base', 0)], rows[('ddrl', 0)]
  assert copied['evaluation_of'] == 'base:0:0' and copied['evaluation_key'] == base['evaluation_key']
  assert copied['ocr_heldout'] == base['ocr_heldout'] and copied['style_drift'] == base['style_drift']
  assert 'evaluation_of' not in rows[('ddrl@sampler.num_steps=3', 0)]        # another sampler
  assert rows[('ddrl@sampler.num_steps=3', 0)]['evaluation_key'] != base['evaluation_key']
  assert 'evaluation_of' not in rows[('ddrl', 1)]
  source, target = (work / 'base' / 'samples' / 'it0000.npz', work / 'ddrl' / 'seed0' / 'samples' / 'it0000.npz')
  assert target.read_bytes() == source.read_bytes()
  images, _ = ocr_table.ocr_eval.load_samples(str(target))
  reference = np.load(work / 'base_stats.npy')
  expected = ocr_table.ocr_metrics.style_drift(ocr_table.ocr_metrics.batch_stats(images), reference)
  assert copied['style_drift_from_reference'] == pytest.approx(expected)
  del fake_cells[:]
  ocr_table.main(argv + ['--cells=ddrl:1'])    # (the stub's iteration 1 is the same model in every cell)
  assert [c for c in fake_cells if c[0] == 'eval'] == []
  later = ocr_table.read_rows(work / 'evaluations.jsonl')[-2:]
  assert [r['evaluation_of'] for r in later] == ['base:0:0', 'ddrl:0:1']   # a copy of a copy: the first
  del fake_cells[:]
  monkeypatch.setattr(ocr_table, 'boot_id', lambda: 'another machine')
  ocr_table.main(argv + ['--cells=ddrl:2'])               # rows of another machine are not copied
  assert [c[1:] for c in fake_cells if c[0] == 'eval'] == [('model', 0), ('model', 1)]



def _sweep_rows(rng):
  """Two sweeps of 3 settings x 3 seeds at iteration 200: OCR falls and the judge falls with strength."""
  rows = [_row('base', 0, 0, 0.24, typicality=0.05)]
  for name, key, values, judge0 in (('ddrl', 'rl.data_beta', (0.01, 0.1, 1.0), 0.08),
                                    ('flow_grpo_exact_kl', 'rl.kl_beta', (0.01, 0.1, 1.0), 0.10)):
    for i, v in enumerate(values):
      for seed in range(3):
        rows.append(_row(f'{name}@{key}={v}', seed, 200, 0.6 - 0.1 * i + 0.01 * (seed - 1),
                         typicality=judge0 - 0.01 * i + 0.001 * rng.standard_normal()))
  return rows


def test_sweeps_frontiers_and_the_matched_comparison(tmp_path):
  rows = _sweep_rows(np.random.default_rng(0))
  fams = ocr_table.sweeps(list(ocr_table.by_cell(rows)))
  assert list(fams) == ['ddrl@rl.data_beta', 'flow_grpo_exact_kl@rl.kl_beta']
  assert [v for v, _ in fams['ddrl@rl.data_beta']] == [0.01, 0.1, 1.0]
  # OCR 0.55 lies halfway between the first two settings (seed means 0.6 and 0.5).
  methods = [m for _, m in fams['ddrl@rl.data_beta']]
  value, low, high, boot = ocr_table.matched_judge(rows, methods, 0.55, 'typicality')
  cells = ocr_table.by_cell(rows)
  mean = lambda m: np.mean([cells[m][s][200]['typicality'] for s in range(3)])
  assert value == pytest.approx(0.5 * (mean(methods[0]) + mean(methods[1])))
  assert low <= value <= high and boot.shape == (2000,)
  assert ocr_table.matched_judge(rows, methods, 0.9, 'typicality') is None       # never reached
  text = ocr_table.matched_table(rows, levels=(0.55,))
  line = [l for l in text.splitlines() if 'typicality' in l][0]
  assert 'ddrl@rl.data_beta - flow_grpo_exact_kl@rl.kl_beta' in text
  other = ocr_table.matched_judge(rows, [m for _, m in fams['flow_grpo_exact_kl@rl.kl_beta']], 0.55, 'typicality')
  assert f'{value - other[0]:+.4f} [' in line and -0.025 < value - other[0] < -0.015   # ~0.08 - 0.10
  assert 'not reached' in ocr_table.matched_table(rows, levels=(0.95,))
  # Gains over the base 0.24: 0.36, 0.26, 0.16 (seed means) -> half of 0.36 keeps the first two.
  index, gains = ocr_table.knee(rows, methods)
  assert index == 1 and gains[methods[2]] == pytest.approx(0.16)
  assert ocr_table.knee(rows, methods, share=0.8)[0] == 0 and ocr_table.knee(rows, methods, share=0.4)[0] == 2
  assert ocr_table.knee(rows, methods + ['ddrl@rl.data_beta=9.0']) is None      # a setting without rows
  assert '- ddrl@rl.data_beta: knee 0.1 (' in ocr_table.knee_text(rows)
  running = [r for r in rows if not (r['method'] == methods[0] and r['iteration'] == 200)]
  running += [dict(r, iteration=100) for r in rows if r['method'] == methods[0]]
  assert ocr_table.knee(running, methods) is None                  # gains at iterations 100 and 200
  table = ocr_table.frontier_table(rows)
  assert len([l for l in table.splitlines() if l.startswith('| ddrl@')]) == 3
  ocr_table.plot_frontiers(rows, str(tmp_path / 'f.png'))
  assert (tmp_path / 'f.png').stat().st_size > 1000


def test_rows_from_another_machine_arithmetic_are_compared_to_their_own_base(tmp_path):
  """Seed 2 of each setting ran on a machine whose base reads 0.02 higher: the gains (knee, contrasts)
  subtract each row's own machine's base, the table shows both bases, and the note names the cells."""
  rows = _sweep_rows(np.random.default_rng(0))
  for r in rows:
    r['boot_id'] = 'old' if r['seed'] < 2 else 'new'
  shifted = dict(_row('base', 0, 0, 0.26, typicality=0.05), boot_id='new', heldout_diffusion_loss=0.5)
  rows.insert(1, shifted)
  rows = ocr_table.with_numerics(rows)
  old_kind, new_kind = ocr_table.numerics_of(rows[0]), ocr_table.numerics_of(shifted)
  assert old_kind != new_kind
  assert {r['numerics'] for r in rows if r['seed'] == 2} == {new_kind}
  assert {r['numerics'] for r in rows if r['seed'] < 2 and r['method'] != 'base'} == {old_kind}
  assert list(ocr_table.bases_by_numerics(rows)) == [old_kind, new_kind]
  fams = ocr_table.sweeps(list(ocr_table.by_cell(rows)))
  methods = [m for _, m in fams['ddrl@rl.data_beta']]
  _, gains = ocr_table.knee(rows, methods)
  # OCR 0.6 - 0.1 i + 0.01 (seed - 1); seeds 0-1 over 0.24, seed 2 over 0.26: mean gain 0.36 - 0.02 / 3
  assert gains[methods[0]] == pytest.approx(0.36 - 0.02 / 3)
  one_base = [{k: v for k, v in r.items() if k != 'numerics'} for r in rows if r is not rows[1]]
  assert ocr_table.knee(one_base, methods)[1][methods[0]] == pytest.approx(0.36)
  table = ocr_table.table(rows)
  assert f'| base (arithmetic {old_kind}) | 0 | - | 0.240' in table
  assert f'| base (arithmetic {new_kind}) | 0 | - | 0.260' in table
  assert '| base | 0 |' in ocr_table.table(one_base)
  note = ocr_table.numerics_note(rows)
  assert f'{new_kind} (base Tesseract 0.2600): ddrl@rl.data_beta=0.01:2' in note
  assert 'flow_grpo_exact_kl@rl.kl_beta=1.0:2' in note and ':1' not in note.split(new_kind)[-1]
  assert ocr_table.numerics_note(one_base) == ''
  assert ocr_table.with_numerics(one_base)[-1]['numerics'] == old_kind      # no base of its own: the one


def test_each_machine_instance_evaluates_the_base_once_and_rows_record_its_arithmetic(
    tmp_path, fake_cells, monkeypatch):
  """A workdir moved to another machine instance: its base is evaluated again there (its row is kept
  beside the first machine's), the rows made there record that machine's arithmetic, and a cell that
  restarts from scratch there re-makes its iteration-0 row where the arithmetic differs."""
  work, out = tmp_path / 'work', tmp_path / 'out'
  out.mkdir()
  argv = ['--iterations=1', '--eval_every=1', '--prompts=1', '--per_prompt=2', f'--workdir={work}',
          f'--out={out}', '--no_judges']
  ocr_table.main(argv + ['--cells=ddrl:0'])
  del fake_cells[:]
  ocr_table.main(argv + ['--cells=ddrl:0,1'])
  assert [c for c in fake_cells if c[0] == 'eval' and c[1] == 'base'] == []     # same instance: once
  del fake_cells[:]
  args = ocr_table.parse_args(argv + ['--cells=ddrl:3', '--budget_minutes=0.0001'])
  ocr_table.Runner(args, {}).run(ocr_table.parse_cells(args.cells))   # cut after its iteration-0 row
  monkeypatch.setattr(ocr_table, 'boot_id', lambda: 'another machine')
  ocr_table.main(argv + ['--cells=ddrl:0,1,2'])      # the same arithmetic: nothing is made again
  assert [c[1] for c in fake_cells if c[0] == 'eval'] == ['ddrl/seed3', 'base', 'ddrl/seed2', 'ddrl/seed2']
  rows = ocr_table.read_rows(work / 'evaluations.jsonl')
  bases = [r for r in rows if r['method'] == 'base']
  assert [r['boot_id'] == 'another machine' for r in bases] == [False, True]
  kind = ocr_table.numerics_of(bases[-1])
  assert [r['numerics'] for r in rows if r['seed'] == 2] == [kind, kind]
  assert all('numerics' in r for r in rows if r['method'] != 'base')
  evaluate = ocr_table.ocr_eval.evaluate_ocr                   # a third machine, other arithmetic
  monkeypatch.setattr(ocr_table.ocr_eval, 'evaluate_ocr', lambda *a, **k: (
      lambda m, g, st: (dict(m, ocr_heldout=m['ocr_heldout'] + 1e-3), g, st))(*evaluate(*a, **k)))
  monkeypatch.setattr(ocr_table, 'boot_id', lambda: 'a third machine')
  del fake_cells[:]
  ocr_table.main(argv + ['--cells=ddrl:3'])
  assert [c[1:] for c in fake_cells if c[0] == 'eval'] == [('base', 0), ('ddrl/seed3', 0), ('ddrl/seed3', 1)]
  seed3 = [r for r in ocr_table.read_rows(work / 'evaluations.jsonl') if r['seed'] == 3]
  assert [(r['iteration'], r['boot_id']) for r in seed3] == [(0, 'a third machine'), (1, 'a third machine')]
  assert ocr_table.numerics_note(ocr_table.read_rows(work / 'evaluations.jsonl')).count('ddrl:3') == 1


def test_cells_can_be_read_as_the_mean_of_their_last_evaluations(tmp_path, capsys):
  """--average_last=N: every cell's row at --iterations holds the mean of its last N evaluations in the
  tables and knees (a seed with fewer keeps its own); the base and earlier rows are untouched."""
  rows = _sweep_rows(np.random.default_rng(0))
  earlier = [dict(r, iteration=175, ocr_heldout=r['ocr_heldout'] - 0.1, typicality=0.0)
             for r in rows if r['method'] != 'base']
  rows += earlier
  averaged = ocr_table.average_last(rows, 200, 2)
  assert ocr_table.average_last(rows, 200, 1) is rows
  by = {(r['method'], r['seed'], r['iteration']): r for r in averaged}
  for r in rows:
    a = by[(r['method'], r['seed'], r['iteration'])]
    if r['iteration'] == 200:
      assert a['ocr_heldout'] == pytest.approx(r['ocr_heldout'] - 0.05)
      assert a['typicality'] == pytest.approx(r['typicality'] / 2) and a['averaged_over'] == [175, 200]
      assert a['train_seconds'] == r['train_seconds']
    else:
      assert a is r
  assert len(ocr_table.average_last(rows, 200, 3)) == len(rows)          # too few evaluations: kept
  assert ocr_table.average_last(rows, 200, 3)[-1] is rows[-1]
  methods = [m for m in dict.fromkeys(r['method'] for r in rows) if m.startswith('ddrl@')]
  assert ocr_table.knee(averaged, methods)[1][methods[0]] == pytest.approx(0.36 - 0.05)
  work, out = tmp_path / 'work', tmp_path / 'out'
  work.mkdir()
  out.mkdir()
  ocr_table.write_rows(str(work / 'evaluations.jsonl'), rows)
  cells = ';'.join(f'{m}:0,1,2' for m in sorted({r['method'] for r in rows if r['method'] != 'base'}))
  ocr_table.main(['--report', f'--workdir={work}', f'--out={out}', f'--cells={cells}', '--average_last=2'])
  text = capsys.readouterr().out
  assert '(cells read at iteration 200 as the mean of their last 2 evaluations)' in text
  assert f'- ddrl@rl.data_beta: knee' in text and '0.01: +0.310' in text
  assert (out / 'ocr_methods_frontiers_last2.png').exists()
  with pytest.raises(SystemExit):
    ocr_table.parse_args(['--average_last=0'])


def test_print_plan(capsys):
  ocr_table.main(['--print_plan=controls'])
  assert capsys.readouterr().out.strip() == 'flow_grpo_ddrl_recipe:0,1,2'


def test_shifted_plan_cells_keep_their_own_base_under_the_shifted_one(tmp_path, capsys):
  ocr_table.main(['--print_plan=shifted', '--knees=0.03,0.04'])
  plan = capsys.readouterr().out.strip()
  assert plan == ocr_table.shifted_plan(0.03, 0.04)
  cells = ocr_table.parse_cells(plan)
  assert len(cells) == 15 and {s for _, s in cells} == {0, 1, 2}
  args = ocr_table.parse_args([f'--workdir={tmp_path}', f'--base={ocr_table.SHIFTED_BASE}'])
  runner = ocr_table.Runner(args, {})
  configs = {m: runner.cell_config(m, 1) for m, s in cells if s == 1}
  assert all(c.seed == 1 and c.num_iterations == 200 for c in configs.values())
  bases = [c.ocr.base_checkpoint for c in configs.values()]
  assert bases.count(ocr_table.DARK_BASE) == 4 and bases.count(ocr_table.DARK_SFT) == 1
  ddrl, flow, sft, synthetic, lora = configs.values()
  assert ddrl.data.path == '' and ddrl.rl.data_beta == 0.03
  assert flow.rl.kl_beta == sft.rl.kl_beta == 0.04 and flow.rl.kl_form == sft.rl.kl_form == 'exact'
  assert synthetic.data.path.endswith('checkpoints/ocr_tiny_dark_synthetic') and synthetic.rl.data_beta == 0.03
  assert lora.lora.rank == ocr_table.SHIFTED_LORA_RANK and lora.data.path == synthetic.data.path
  for bad in ([], ['--knees=0.03'], ['--knees=0.03,x'], ['--knees=0,0.04']):
    with pytest.raises(SystemExit):
      ocr_table.parse_args(['--print_plan=shifted'] + bad)


def test_report_levels_and_matched_reference(tmp_path, capsys):
  """--levels picks the matched comparison's OCR levels; --matched_reference the along-training match."""
  rows = _sweep_rows(np.random.default_rng(0))
  rows.append(_row('ddrl@rl.data_beta=3.0', 0, 100, 0.3, typicality=0.05))   # still running
  work, out = tmp_path / 'work', tmp_path / 'out'
  work.mkdir()
  out.mkdir()
  ocr_table.write_rows(str(work / 'evaluations.jsonl'), rows)
  cells = ';'.join(f'{m}:0,1,2' for m in sorted({r['method'] for r in rows if r['method'] != 'base'}))
  reference = 'ddrl@rl.data_beta=0.1'
  ocr_table.main(['--report', f'--workdir={work}', f'--out={out}', f'--cells={cells}', '--levels=0.52',
                  f'--matched_reference={reference}'])
  text = capsys.readouterr().out
  matched = [l for l in text.splitlines() if l.startswith('| 0.')]
  assert matched and all(l.startswith('| 0.52 |') for l in matched)
  assert f'(reward level: {reference} at iteration 200, Tesseract 0.500)' in text
  frontier = [l for l in text.splitlines() if l.startswith('| ddrl@rl.data_beta |')]
  assert [l.split(' | ')[1] for l in frontier] == ['0.01', '0.1', '1']    # the running setting is not drawn
  assert '- ddrl@rl.data_beta: no knee yet' in text
  assert '| ddrl@rl.data_beta | 3 | 100 |' in ocr_table.frontier_table(rows)   # without the iteration
  # A seed just started beside finished ones is left out and listed, not read at its iteration 0.
  assert f'| {reference} | 200 | 3 |' in text
  rows += [_row(reference, 3, 0, 0.24, typicality=0.05), _row(reference, 4, 0, 0.24), _row(reference, 4, 25, 0.3)]
  ocr_table.write_rows(str(work / 'evaluations.jsonl'), rows)
  ocr_table.main(['--report', f'--workdir={work}', f'--out={out}', f'--cells={cells};{reference}:3,4'])
  text = capsys.readouterr().out
  assert f'| {reference} | 200 | 3 |' in text and f'(reward level: DDRL' not in text
  # 3.0's only seed stops at 100: no seed of it finished, so it is kept (and not listed).
  assert [l for l in text.splitlines() if l.startswith('still running')] == [
      f'still running (left out until they reach iteration 200): {reference} seed 3 at 0, '
      f'{reference} seed 4 at 25']
  assert len(ocr_table.read_rows(str(out / 'ocr_methods.jsonl'))) == len(rows)   # the record keeps them
  with pytest.raises(SystemExit):
    ocr_table.parse_args(['--levels=0.4,x'])
  with pytest.raises(SystemExit):
    ocr_table.parse_args(['--judge_renders=1'])
  assert ocr_table.parse_args([]).judge_renders == 1024      # the recorded experiments' references


def test_a_report_without_cells_reads_every_recorded_cell(tmp_path, capsys):
  """A committed rows file of a sweep plan (as benchmarks/ocr_pareto.jsonl: '<preset>@<key>=<value>'
  methods and an arm, recorded under another --cells) reported with --report and no --cells: every
  recorded cell is tabled and the sweeps compared, and the rewritten record keeps every row (the default
  plan's cells used to select the base row alone, and the record was rewritten with that row only)."""
  rows = _sweep_rows(np.random.default_rng(0))
  rows += [_row('ddrl_data_only', s, 50, 0.3, typicality=0.06) for s in range(2)]
  out = tmp_path / 'out'
  out.mkdir()
  ocr_table.write_rows(str(out / 'sweep.jsonl'), rows)
  ocr_table.main(['--report', '--name=sweep', f'--out={out}', f'--workdir={tmp_path / "work"}',
                  '--levels=0.55'])
  text = capsys.readouterr().out
  assert '| ddrl@rl.data_beta=0.1 | 200 | 3 | 0.500 ± 0.025 |' in text
  assert '| ddrl_data_only | 50 | 2 | 0.300 ± 0.000 |' in text
  assert len([l for l in text.splitlines() if l.startswith('| ddrl@rl.data_beta | ')]) == 3
  matched = [l for l in text.splitlines() if l.startswith('| 0.55 | typicality')]
  assert len(matched) == 1 and 'not reached' not in matched[0] and matched[0].count('[') == 3
  assert len(ocr_table.read_rows(str(out / 'sweep.jsonl'))) == len(rows)
  assert ocr_table.parse_args([]).cells == ocr_table.DEFAULT_CELLS       # a run still has its plan
  with pytest.raises(SystemExit, match='recorded'):
    ocr_table.main(['--report', '--name=sweep', f'--out={out}', f'--workdir={tmp_path / "work"}',
                    '--contrast_reference=ddrl'])


def test_a_report_of_some_cells_keeps_every_recorded_row(tmp_path, capsys):
  """--cells names the cells a run trains and tables; the committed record is every row of the workdir,
  the other cells' included, and rows another process appended to the shared workdir after this one
  started. (A queue split over two commands used to rewrite benchmarks/ocr_decide.jsonl with its own
  cells only, and the other cells' rows were lost with the workdir.)"""
  ref, other = 'ddrl@rl.data_beta=0.1', 'flow_grpo_exact_kl@rl.kl_beta=0.01'
  rows = [_row('base', 0, 0, 0.25)] + [_row(ref, s, it, 0.3 + 0.01 * s) for s in range(3) for it in (0, 50)]
  rows += [_row(other, 0, it, 0.4) for it in (0, 50)]
  work, out = tmp_path / 'work', tmp_path / 'out'
  work.mkdir()
  out.mkdir()
  ocr_table.write_rows(str(work / 'evaluations.jsonl'), rows)
  ocr_table.main(['--report', '--name=split', f'--workdir={work}', f'--out={out}', f'--cells={other}:0'])
  text = capsys.readouterr().out
  assert f'| {ref} |' not in text                                   # tables: the named cells only
  kept = ocr_table.read_rows(str(out / 'split.jsonl'))
  assert len(kept) == len(rows)
  assert sorted((r['method'], r['seed'], r['iteration']) for r in kept) == sorted(
      (r['method'], r['seed'], r['iteration']) for r in rows)


def test_rows_of_the_first_one_seed_table_are_read_as_seed_0(tmp_path, capsys):
  """benchmarks/ocr_table.jsonl's rows (the first version, --methods=...) carry no seed and count NFE, not
  passes: they are read as the config's seed 0, and the table leaves their cost column empty."""
  rows = [{k: v for k, v in _row(m, 0, it, ocr).items() if k not in ('seed', 'passes_rollout', 'passes_train')}
          for m, it, ocr in (('base', 0, 0.24), ('ddrl', 0, 0.24), ('ddrl', 80, 0.38), ('flow_grpo', 0, 0.24),
                             ('flow_grpo', 80, 0.39))]
  assert [r['seed'] for r in ocr_table.read_rows(_write(tmp_path / 'out' / 'old.jsonl', rows))] == [0] * 5
  ocr_table.main(['--report', '--name=old', f'--out={tmp_path / "out"}', f'--workdir={tmp_path / "work"}'])
  text = capsys.readouterr().out
  assert '| DDRL | 80 | 1 | 0.380 |' in text and text.count('| - | 80.0 |') == 2
  assert '| FlowGRPO | 80 | 1, 1 | 93% | -0.010 |' in text     # gains 0.14 / 0.15


def _write(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
  return str(path)


def test_spread_prompts_takes_the_first_sample_of_evenly_spread_strings():
  texts = ['a', 'a', 'b', 'b', 'c', 'c', 'd', 'd']
  assert ocr_table.spread_prompts(texts, 2) == [0, 6]
  assert ocr_table.spread_prompts(texts, 3) == [0, 4, 6]       # the strings at linspace(0, 3, 3).round()
  assert ocr_table.spread_prompts(texts, 8) == [0, 2, 4, 6]


def test_arms_samples_pick_the_first_seeds_last_evaluation_on_disk(tmp_path, capsys):
  """The base first, then the methods in the order given; the first seed with samples on disk, at its
  last evaluation at or before the iteration; the same strings in every row; a method with no samples
  on disk is named, not drawn."""
  def path(method, seed, iteration):
    return str(tmp_path / method / f'seed{seed}' / f'it{iteration:04d}.npz')

  texts = [t for t in 'abcd' for _ in range(2)]
  rows = [_row('base', 0, 0, 0.2)]
  saved = {('base', 0, 0), ('m', 1, 0), ('m', 1, 2), ('m', 1, 4), ('m', 2, 2)}
  for method, seed, iteration in saved:
    images = np.full((8, 2, 3, 3), 10 * seed + iteration, np.uint8)
    images[:, 0, 0, 0] = np.arange(8)                       # which sample it was
    ocr_table.ocr_eval.save_samples(path(method, seed, iteration), images, texts)
  for seed, iteration in ((0, 2), (1, 0), (1, 2), (1, 4), (2, 2)):   # seed 0's samples are not on disk
    rows.append(_row('m', seed, iteration, 0.3))
  rows.append(_row('n', 0, 2, 0.3))
  strips = ocr_table.arms_samples(rows, path, ['m', 'n'], iteration=3, columns=2)
  assert [label for label, _ in strips] == ['base (seed 0, iteration 0)', 'm (seed 1, iteration 2)']
  assert [s[:, 0, 0, 0].tolist() for _, s in strips] == [[0, 6], [0, 6]]      # strings a and d
  assert strips[1][1][0, 1, 1, 1] == 12
  assert 'no samples on disk for n' in capsys.readouterr().out


def test_labelled_rows_place_each_image_under_its_caption():
  from ddrl_jax import image_grid  # pylint: disable=g-import-not-at-top
  one = np.full((1, 4, 5, 3), 7, np.uint8)
  three = np.full((3, 4, 5, 3), 9, np.uint8)
  grid = image_grid.labelled_rows([('one', one), ('three', three)], caption_height=14)
  assert grid.shape == (2 * (14 + 4 + 2), 3 * (5 + 2), 3)
  assert (grid[14:18, :5] == 7).all() and (grid[14:18, 7:] == 255).all()    # the short row is padded
  assert all((grid[20 + 14:20 + 18, c * 7:c * 7 + 5] == 9).all() for c in range(3))
  assert (grid[:14] < 255).any()                                            # a caption was drawn
  with pytest.raises(ValueError, match='every row needs'):
    image_grid.labelled_rows([('a', one), ('b', np.zeros((1, 4, 6, 3), np.uint8))])



def _frontier_rows(ys_by_setting, judge_by_setting, name='ddrl', key='rl.data_beta', seeds=3, noise=0.01,
                   rng=None):
  """Rows of a sweep whose settings (ascending, weak -> strong) have the given mean OCR and judge."""
  rng = rng or np.random.default_rng(0)
  rows = []
  for i, (y, j) in enumerate(zip(ys_by_setting, judge_by_setting)):
    for seed in range(seeds):
      rows.append(_row(f'{name}@{key}={10.0 ** (i - 2)}', seed, 200, y + noise * rng.standard_normal(),
                       typicality=j + noise * rng.standard_normal()))
  return rows


def test_a_frontier_crossing_the_level_twice_is_read_at_the_crossing_nearest_strong_regularization():
  """Settings weak -> strong with OCR 0.6, 0.4, 0.6, 0.4: the level 0.5 is crossed three times; the rule
  walks from the strongest setting toward weaker ones and takes the first crossing (between the last two
  settings), not the smallest judge value and not the weak end's."""
  rows = _frontier_rows((0.6, 0.4, 0.6, 0.4), (0.30, 0.20, 0.10, 0.50), noise=0.0)
  methods = [m for _, m in ocr_table.sweeps(list(ocr_table.by_cell(rows)))['ddrl@rl.data_beta']]
  value, *_ = ocr_table.matched_judge(rows, methods, 0.5, 'typicality', draws=10)
  assert value == pytest.approx(0.30)          # halfway between 0.10 and 0.50; min rule: 0.15, weak end: 0.25
  assert ocr_table._interpolate_at(0.5, [0.6, 0.4], [1.0, 3.0]) == pytest.approx(2.0)


def test_sweeps_hold_other_overrides_fixed():
  methods = [f'ddrl@rl.data_beta={b}@rl.data_weighting=path_kl' for b in (0.03, 0.1, 0.3)] + [
      f'flow_grpo_exact_kl@rl.kl_beta={b}' for b in (0.004, 0.01)] + ['ddrl@rl.data_beta=0.1']
  fams = ocr_table.sweeps(methods)
  assert list(fams) == ['ddrl@rl.data_weighting=path_kl@rl.data_beta', 'flow_grpo_exact_kl@rl.kl_beta']
  assert [v for v, _ in fams['ddrl@rl.data_weighting=path_kl@rl.data_beta']] == [0.03, 0.1, 0.3]
  plan = ocr_table.parse_cells(ocr_table.PLANS['decide'])
  assert len(plan) == 15 and plan[0][1] == 0 and plan[-1][1] == 2


def test_matched_bootstrap_streams_are_independent_per_sweep_and_the_interval_is_95_percent(monkeypatch):
  """Two sweeps with the same seed layout: a shared stream would resample both identically (their
  bootstrap values perfectly rank-correlated); each sweep's own stream does not. The interval is the
  2.5 and 97.5 percentiles of the resamples, no other pair."""
  rng = np.random.default_rng(3)
  rows = (_frontier_rows((0.6, 0.5, 0.4), (0.1, 0.2, 0.3), rng=rng, noise=0.03) +
          _frontier_rows((0.6, 0.5, 0.4), (0.1, 0.2, 0.3), name='flow_grpo_exact_kl', key='rl.kl_beta',
                         rng=rng, noise=0.03))
  fams = ocr_table.sweeps(list(ocr_table.by_cell(rows)))
  a_name, b_name = list(fams)
  a_methods = [m for _, m in fams[a_name]]
  b_methods = [m for _, m in fams[b_name]]
  shared = [ocr_table.matched_judge(rows, ms, 0.5, 'typicality', seed=0)[3] for ms in (a_methods, b_methods)]
  picks_a = np.random.default_rng(0).integers(0, 3, 3)
  picks_b = np.random.default_rng(0).integers(0, 3, 3)
  assert (picks_a == picks_b).all()        # the old scheme: the same picks for both sweeps
  own = [ocr_table.matched_judge(rows, ms, 0.5, 'typicality', seed=ocr_table.bootstrap_stream(n))[3]
         for ms, n in ((a_methods, a_name), (b_methods, b_name))]
  assert ocr_table.bootstrap_stream(a_name) != ocr_table.bootstrap_stream(b_name)
  rank = lambda v: np.argsort(np.argsort(np.nan_to_num(v)))
  corr_shared = np.corrcoef(rank(shared[0]), rank(shared[1]))[0, 1]
  corr_own = np.corrcoef(rank(own[0]), rank(own[1]))[0, 1]
  assert corr_shared > 0.8 and abs(corr_own) < 0.1, (corr_shared, corr_own)
  value, low, high, boot = ocr_table.matched_judge(rows, a_methods, 0.5, 'typicality',
                                                   seed=ocr_table.bootstrap_stream(a_name))
  assert (low, high) == tuple(np.nanpercentile(boot, [2.5, 97.5]))
  assert low < np.nanpercentile(boot, 25) and high > np.nanpercentile(boot, 75)
  seeds = []
  judge = ocr_table.matched_judge
  monkeypatch.setattr(ocr_table, 'matched_judge', lambda *a, **k: seeds.append(k['seed']) or judge(*a, **k))
  text = ocr_table.matched_table(rows, levels=(0.5,))
  assert set(seeds) == {ocr_table.bootstrap_stream(a_name), ocr_table.bootstrap_stream(b_name)}
  for title in ('colour spread', 'diversity', 'typicality'):
    assert title in text


def _arm_rows(method, curves, its=(0, 50, 100, 150)):
  """Rows of one arm: curves[seed] = [(ocr, judge, outside, spread) per iteration]."""
  return [_row(method, s, it, ocr, typicality=j, typicality_outside=o, colour_spread=c)
          for s, curve in enumerate(curves) for it, (ocr, j, o, c) in zip(its, curve)]


def test_an_arm_is_matched_along_its_training_at_the_first_crossing_with_whole_seed_resamples():
  """One setting per arm (the cut deciding run): the seed-mean OCR curve over iterations is read at its
  first crossing of the level (fewest iterations: the strongest regularization), the judge interpolated
  there; a curve that crosses back and again is not read at the later crossing. The bootstrap resamples
  whole seeds: with two seeds the 2.5/97.5 percentiles are the two seeds' own values (each all-one-seed
  resample has probability 1/4), which 25/75 percentiles or per-iteration resampling would not give."""
  same = [(0.2, 1.0, 0, 0.5), (0.4, 2.0, 0, 0.5), (0.6, 3.0, 0, 0.5), (0.2, 9.0, 0, 0.5)]
  rows = _arm_rows('ddrl', [same, same])
  value, low, high, _, crossing = ocr_table.matched_along_training(rows, 'ddrl', 0.5, 'typicality')
  assert (value, low, high) == pytest.approx((2.5, 2.5, 2.5)) and crossing == pytest.approx(75.0)
  twice = [(0.2, 1.0, 0, 0.5), (0.6, 2.0, 0, 0.5), (0.3, 5.0, 0, 0.5), (0.7, 7.0, 0, 0.5)]
  value, *_, crossing = ocr_table.matched_along_training(_arm_rows('ddrl', [twice]), 'ddrl', 0.4, 'typicality')
  assert value == pytest.approx(1.5) and crossing == pytest.approx(25.0)      # not 6.0 at the third segment
  seed0 = [(0.2, 1.0, 0, 0.5), (0.6, 2.0, 0, 0.5)] * 2
  seed1 = [(0.2, 1.0, 0, 0.5), (0.6, 4.0, 0, 0.5)] * 2
  value, low, high, boot, _ = ocr_table.matched_along_training(
      _arm_rows('ddrl', [seed0, seed1], its=(0, 50)), 'ddrl', 0.4, 'typicality', seed=1)
  assert value == pytest.approx(2.0)                           # halfway: 1.0 -> (2 + 4) / 2
  assert (low, high) == pytest.approx((1.5, 2.5))              # seed 0 alone, seed 1 alone
  assert np.isclose(boot, 2.0).mean() == pytest.approx(0.5, abs=0.05)
  assert ocr_table.matched_along_training(rows, 'ddrl', 0.9, 'typicality') is None


def test_arms_are_compared_at_matched_reward_and_the_onset_of_hacking_is_read_by_the_registered_rule(
    tmp_path, capsys):
  """Two single-setting arms: the report prints each arm's judges at the level and the first minus the
  second (the --cells order); E3's onset is the first evaluation where the outside share exceeds the
  base's by 10 points or the colour spread falls below half the base's."""
  base = _row('base', 0, 0, 0.2, typicality=1.0, typicality_outside=0.05, colour_spread=0.5)
  ddrl = _arm_rows('ddrl@rl.data_beta=0.1', [[(0.2, 1.0, 0.05, 0.5), (0.4, 2.0, 0.10, 0.4),
                                              (0.6, 3.0, 0.12, 0.3), (0.7, 3.0, 0.20, 0.3)]] * 2)
  flow = _arm_rows('flow_grpo_exact_kl@rl.kl_beta=0.01', [[(0.2, 1.0, 0.05, 0.5), (0.6, 5.0, 0.05, 0.24),
                                                          (0.7, 6.0, 0.05, 0.2), (0.8, 6.0, 0.05, 0.2)]] * 2)
  rows = [base] + ddrl + flow
  assert ocr_table.hacking_onset(rows, 'ddrl@rl.data_beta=0.1') == (150, 0.7, 100)           # outside 0.20
  assert ocr_table.hacking_onset(rows, 'flow_grpo_exact_kl@rl.kl_beta=0.01') == (50, 0.6, 50)  # spread 0.24
  assert ocr_table.hacking_onset(rows, 'ddrl@rl.data_beta=0.1', iteration=100) == (None, None, 100)
  arms = ['ddrl@rl.data_beta=0.1', 'flow_grpo_exact_kl@rl.kl_beta=0.01']
  text = ocr_table.arms_matched_table(rows, arms, levels=(0.5,))
  line = next(l for l in text.splitlines() if l.startswith('| 0.50 | typicality (judge'))
  # DDRL reaches 0.5 at iteration 75 (judge 2.5), FlowGRPO at 37.5 (judge 1 + 0.75 * 4 = 4.0)
  assert '2.5000 [2.5000, 2.5000]; it 75' in line and '4.0000 [4.0000, 4.0000]; it 38' in line
  assert line.rstrip(' |').endswith('-1.5000 [-1.5000, -1.5000]')
  assert 'colour spread' in text and 'diversity' in text
  onsets = ocr_table.onset_table(rows, arms)
  assert '| 150 | 0.700 | 100 |' in onsets and '| 50 | 0.600 | 50 |' in onsets
  work = tmp_path / 'work'
  work.mkdir()
  ocr_table.write_rows(str(work / 'evaluations.jsonl'), rows)
  capsys.readouterr()
  ocr_table.main(['--report', '--name=arms', f'--workdir={work}', f'--out={tmp_path}', '--levels=0.5',
                  f'--cells={arms[1]}:0,1;{arms[0]}:0,1'])                  # FlowGRPO named first
  printed = capsys.readouterr().out
  assert f'| {arms[1]} - {arms[0]} |' in printed and '+1.5000 [+1.5000, +1.5000]' in printed
  assert '| 150 | 0.700 | 100 |' in printed
