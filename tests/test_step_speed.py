"""benchmarks/step_speed.py at a tiny size: the JAX and torch iterations and the public loss path run and
give finite times and losses, the analytic FLOPs agree with XLA's cost analysis, and the JSON lines carry
their keys."""
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))

import step_speed  # pylint: disable=wrong-import-position  # benchmarks/step_speed.py

SHAPE = step_speed.QUICK


def _has_torch_peer():
  try:
    import diffusers.models.transformers.transformer_cosmos  # pylint: disable=import-outside-toplevel,unused-import
    import torch  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    return False
  return True


@pytest.fixture(scope='module')
def run():
  """One tiny benchmark (1 timed run; no DiT-alone, compile sweep or OCR): (rows, summary). torch on one
  thread: at this size two threads only add synchronisation, which a busy machine makes slow."""
  return step_speed.benchmark(SHAPE, runs=1, torch_peer_on=_has_torch_peer(), compile_sweep=False,
                              dit_alone=False, peak_sizes=(128,), torch_threads=1, reference_path=True)


def _rows(rows, measurement, **match):
  return [r for r in rows if r['measurement'] == measurement and all(r.get(k) == v for k, v in match.items())]


def _finite_positive(*values):
  return all(math.isfinite(v) and v > 0 for v in values)


def test_jax_iteration_runs(run):
  rows, summary = run
  (row,) = _rows(rows, 'iteration', framework='jax')
  assert row['nfe'] == SHAPE.steps + 1                     # cosmos_2ab: T steps + the clean call
  assert _finite_positive(*row['median_s'].values())
  assert row['median_s']['iteration'] == pytest.approx(sum(row['median_s'][k] for k in
                                                           ('rollout', 'data_grads', 'update')))
  assert all(math.isfinite(row[k]) for k in ('loss', 'pg_loss', 'data_loss'))
  assert row['data_loss'] > 0 and row['param_change'] > 0 and row['x0_finite']
  flops = summary['flops']
  fwd = _rows(rows, 'flops_check')[0]['forward_flops_per_sample']
  k = len(SHAPE.trained_steps)
  assert flops['rollout'] == pytest.approx(SHAPE.samples * (SHAPE.steps + 1) * fwd)
  assert flops['iteration'] == pytest.approx(SHAPE.samples * (SHAPE.steps + 1 + 6 * k) * fwd)


def test_public_path_runs(run):
  """jax.value_and_grad of rl.ddrl_loss (and of rl_loss_reference) timed beside the trainer's train phase:
  the same loss and gradient as each other, a ratio to the train phase and a goal line for it."""
  rows, summary = run
  (train,) = _rows(rows, 'iteration', framework='jax')
  public, reference = (_rows(rows, 'public_path', form=f)[0] for f in ('public', 'reference'))
  for row in (public, reference):
    assert len(row['seconds']) == 1 and _finite_positive(row['median_s'], row['warmup_s'], row['grad_norm'])
    assert row['median_train_s'] == pytest.approx(train['median_s']['train'])
    assert row['ratio_to_train'] == pytest.approx(row['median_s'] / row['median_train_s'])
    assert math.isfinite(row['loss'])
  assert public['loss'] == pytest.approx(reference['loss'], rel=1e-6)
  assert public['grad_norm'] == pytest.approx(reference['grad_norm'], rel=1e-5)
  (goal,) = [g for g in summary['goals'] if g[0].startswith('value_and_grad(ddrl_loss)')]
  assert goal[1] == public['ratio_to_train'] and goal[2] == (goal[1] <= step_speed.GOAL_PUBLIC_RATIO)


def test_torch_iteration_runs(run):
  pytest.importorskip('torch')
  pytest.importorskip('diffusers')
  rows, _ = run
  (params,) = _rows(rows, 'params')
  assert params['jax'] == params['torch'] and params['parity'] < 1e-4
  (row,) = _rows(rows, 'iteration', framework='torch')
  assert row['nfe'] == SHAPE.steps + 1
  assert _finite_positive(*row['median_s'].values())
  assert all(math.isfinite(row[k]) for k in ('loss', 'pg_loss', 'data_loss'))
  assert row['data_loss'] > 0 and row['param_change'] > 0 and row['x0_finite']


def test_analytic_flops_match_xla(run):
  rows, _ = run
  (check,) = _rows(rows, 'flops_check')
  assert abs(check['rel_diff']) <= step_speed.XLA_TOLERANCE, check
  assert abs(check['one_block_rel_diff']) <= step_speed.XLA_TOLERANCE, check
  if check['scan_body_counted_once']:   # XLA's raw count misses blocks 2..n; the correction restores them
    assert check['xla_corrected'] > 1.5 * check['xla_raw']


def test_json_lines(run, tmp_path):
  rows, _ = run
  info = step_speed.machine_info()
  path = tmp_path / 'speed.jsonl'
  step_speed.write_jsonl(step_speed.json_rows(rows, 'python benchmarks/step_speed.py --quick', info, SHAPE),
                         path)
  lines = [json.loads(line) for line in path.read_text().splitlines()]
  assert len(lines) == len(rows)
  for line in lines:
    assert {'measurement', 'command', 'date', 'machine', 'shape'} <= set(line)
    assert {'cpu', 'cores', 'jax', 'torch', 'load_average'} <= set(line['machine'])
  kinds = {line['measurement'] for line in lines}
  assert {'matmul_peak', 'params', 'flops_check', 'iteration', 'public_path', 'goals'} <= kinds
  (peak,) = [line for line in lines if line['measurement'] == 'matmul_peak']
  assert peak['peak_gflops'] > 0
  (goal,) = [line for line in lines if line['measurement'] == 'goals']
  assert [g['goal'] for g in goal['goals']][0].startswith('iteration')
