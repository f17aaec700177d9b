"""benchmarks/aot_fit.py: a compiler crash is its own outcome (not a fit, not an out-of-memory verdict)
and the sweep goes on; the bisection finds the largest fitting micro-batch; rows are reused on resume."""
import json
import os
import subprocess
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks'))
import aot_fit  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_outcomes_tell_a_crash_from_an_oom_from_a_fit(monkeypatch):
  monkeypatch.setattr(aot_fit, 'mesh_overrides', lambda recipe, topology: [])
  answers = iter([types.SimpleNamespace(returncode=-11, stdout='', stderr=''),
                  types.SimpleNamespace(returncode=0, stderr='', stdout=json.dumps(dict(
                      fn='update', fits=False, error='RESOURCE_EXHAUSTED: Ran out of memory')) + '\n'),
                  types.SimpleNamespace(returncode=0, stderr='', stdout=json.dumps(dict(
                      fn='update', fits=True, peak_bytes=5, spare_fraction=0.5)) + '\n')])
  monkeypatch.setattr(subprocess, 'run', lambda *a, **k: next(answers))
  crash, oom, fit = (aot_fit.compile_one('r', 'v5p-8', 'update', 0, 0.0, 10) for _ in range(3))
  assert crash['outcome'] == 'libtpu_crash' and crash['fits'] is None and 'signal 11' in crash['error']
  assert oom['outcome'] == 'oom' and fit['outcome'] == 'fits'
  assert aot_fit.outcome_of(dict(fits=False, peak_bytes=10)) == 'over'


def _sweep(tmp_path, monkeypatch, fits_at_or_below, crash_above=None):
  """A Sweep whose compiles fit for micro-batches <= fits_at_or_below (0, the whole batch, counts as
  the largest), crash above crash_above; returns (sweep, the compiles it ran)."""
  ran = []

  def compile_one(recipe, topology, fn, micro, hbm_gib, timeout_s):
    ran.append((micro, fn))
    size = 1 << 20 if micro == 0 else micro
    if crash_above is not None and size > crash_above:
      return dict(fn=fn, topology=topology, fits=None, outcome='libtpu_crash', error='signal 11')
    ok = size <= fits_at_or_below
    return dict(fn=fn, topology=topology, fits=ok, peak_bytes=size, spare_fraction=0.5 if ok else -1.0,
                outcome='fits' if ok else 'over')
  monkeypatch.setattr(aot_fit, 'compile_one', compile_one)
  monkeypatch.setattr(aot_fit, 'candidates', lambda recipe, topology: [144, 72, 48, 36, 24, 18, 16, 12, 9, 8,
                                                                       6, 4, 3, 2, 1])
  args = types.SimpleNamespace(out=str(tmp_path / 'rows.jsonl'), hbm_gib=0.0, margin=0.1, timeout_s=1)
  return aot_fit.Sweep(args), ran, args


def test_bisection_finds_the_largest_fitting_micro_batch_and_a_crash_does_not_stop_it(tmp_path, monkeypatch):
  sweep, ran, _ = _sweep(tmp_path, monkeypatch, fits_at_or_below=16, crash_above=36)
  assert sweep.best_micro_batch('r', 'v5p-8') == 16
  assert len({m for m, _ in ran}) <= 6     # the whole batch, the smallest, a bisection of the 13 between
  assert any(r['outcome'] == 'libtpu_crash' for r in sweep.rows)
  report = aot_fit.report(sweep.rows, 0.1)
  assert '| r | v5p-8 | HBM | 16 |' in report and 'libtpu_crash' in report


def test_a_resumed_sweep_compiles_nothing_twice(tmp_path, monkeypatch):
  sweep, ran, args = _sweep(tmp_path, monkeypatch, fits_at_or_below=4)
  assert sweep.best_micro_batch('r', 'v5p-8') == 4
  first = len(ran)
  again = aot_fit.Sweep(args)
  assert again.best_micro_batch('r', 'v5p-8') == 4 and len(ran) == first


def test_nothing_fits_gives_none_after_the_whole_batch_and_the_smallest_chunk(tmp_path, monkeypatch):
  sweep, ran, _ = _sweep(tmp_path, monkeypatch, fits_at_or_below=0)
  assert sweep.best_micro_batch('r', 'v5p-8') is None
  assert [m for m, _ in ran] == [0, 1]                     # one compile each: the first function fails


def test_a_function_that_failed_before_compiles_first(tmp_path, monkeypatch):
  sweep, ran, _ = _sweep(tmp_path, monkeypatch, fits_at_or_below=16)
  fail_update_only = aot_fit.compile_one

  def compile_one(recipe, topology, fn, micro, hbm_gib, timeout_s):
    row = fail_update_only(recipe, topology, fn, micro, hbm_gib, timeout_s)
    if fn != 'update':                                    # only the update's memory depends on micro
      row = dict(row, fits=True, spare_fraction=0.5, outcome='fits')
    return row
  monkeypatch.setattr(aot_fit, 'compile_one', compile_one)
  assert sweep.best_micro_batch('r', 'v5p-8') == 16
  assert ran[:3] == [(0, 'rollout'), (0, 'data_grads'), (0, 'update')]
  by_micro = {}
  for m, fn in ran[3:]:
    by_micro.setdefault(m, []).append(fn)
  too_big = [m for m in by_micro if m > 16]
  assert too_big and all(by_micro[m] == ['update'] for m in too_big)   # one compile per failing candidate
  assert sorted(by_micro[16]) == ['data_grads', 'rollout', 'update']   # the answer has all three peaks


def test_two_sweeps_sharing_rows_compile_nothing_twice(tmp_path, monkeypatch):
  first, ran, args = _sweep(tmp_path, monkeypatch, fits_at_or_below=4)
  second = aot_fit.Sweep(args)                 # made before the first one compiles anything
  assert first.best_micro_batch('r', 'v5p-8') == 4
  done = len(ran)
  assert second.best_micro_batch('r', 'v5p-8') == 4 and len(ran) == done


def test_a_recipe_carries_config_overrides_to_the_compile_and_the_candidates(monkeypatch):
  assert aot_fit.split_recipe('configs/cosmos2b.py@mesh.context=1@mesh.fsdp=8') == (
      'configs/cosmos2b.py', {'mesh.context': '1', 'mesh.fsdp': '8'})
  with pytest.raises(ValueError, match='not <config.key>=<value>'):
    aot_fit.split_recipe('configs/cosmos2b.py@mesh.context')
  config = aot_fit._load('configs/cosmos2b.py@mesh.context=1')
  assert config.mesh.context == 1 and config.mesh.fsdp == 8
  with pytest.raises(ValueError, match="no key 'mesh.contxt'"):
    aot_fit._load('configs/cosmos2b.py@mesh.contxt=1')
  # The preset's model axes (fsdp 8 x context 2) need 16 chips; with context 1 they fit v5p-16's 8.
  with pytest.raises(ValueError):
    aot_fit.candidates('configs/cosmos2b.py', 'v5p-16')
  assert aot_fit.candidates('configs/cosmos2b.py@mesh.context=1', 'v5p-16')[-1] == 1
  commands = []
  monkeypatch.setattr(subprocess, 'run', lambda cmd, **k: commands.append(cmd) or types.SimpleNamespace(
      returncode=0, stderr='', stdout=json.dumps(dict(fn='update', fits=True, spare_fraction=0.5)) + '\n'))
  aot_fit.compile_one('configs/cosmos2b.py@mesh.context=1', 'v5p-16', 'update', 4, 72.0, 10)
  cmd = commands[0]
  assert '--config=configs/cosmos2b.py' in cmd and '--config.mesh.context=1' in cmd
  assert '--config.mesh.data=-1' in cmd and '--config.micro_batch=4' in cmd
  assert cmd.index('--config.mesh.context=1') < cmd.index('--config.mesh.data=-1')


def test_a_compile_under_another_ceiling_is_rejudged_not_compiled_again(tmp_path, monkeypatch):
  sweep, ran, args = _sweep(tmp_path, monkeypatch, fits_at_or_below=16)
  gib = 2**30
  monkeypatch.setattr(aot_fit, 'candidates', lambda recipe, topology: [4, 2, 1])
  peaks = {0: 90 * gib, 2: 60 * gib, 1: 30 * gib}
  with open(args.out, 'w') as f:             # compiled against the chip's HBM (hbm_gib 0)
    for micro, peak in peaks.items():
      for fn in aot_fit.FUNCTIONS:
        f.write(json.dumps(dict(recipe='r', topology='v5p-16', hbm_gib=0.0, micro_batch=micro, fn=fn,
                                outcome='fits', fits=True, peak_bytes=peak,
                                spare_fraction=round(1 - peak / (95.74 * gib), 4))) + '\n')
  args.hbm_gib = 72.0
  proxy = aot_fit.Sweep(args)
  assert proxy.best_micro_batch('r', 'v5p-16') == 2 and not ran          # 90 GiB is over 72; 60 keeps 17%
  rows = {(r['micro_batch'], r['fn']): r for r in aot_fit.read_rows(args.out) if r['hbm_gib'] == 72.0}
  assert rows[(0, 'rollout')]['outcome'] == 'over' and rows[(0, 'rollout')]['rejudged_from_hbm_gib'] == 0.0
  assert rows[(2, 'update')]['spare_fraction'] == round(1 - 60 / 72, 4)
  # An outcome without a peak carries over; rejudged rows are not rejudged again.
  assert aot_fit.rejudge(dict(outcome='oom', fits=False, hbm_gib=0.0), 'v5p-16', 72.0)['outcome'] == 'oom'
  again = aot_fit.Sweep(args)
  assert again.best_micro_batch('r', 'v5p-16') == 2 and not ran


def test_the_family_sweep_records_a_crash_as_a_crash_and_compiles_the_whole_batch(monkeypatch):
  """benchmarks/aot_sd3.py compiles through aot_fit.compile_one: the preset's whole batch (micro_batch
  0), and a compiler that dies is 'libtpu_crash' with fits None (it used to be recorded as fits False)."""
  import aot_sd3  # pylint: disable=g-import-not-at-top
  commands = []
  monkeypatch.setattr(aot_fit, 'mesh_overrides', lambda recipe, topology: [])
  monkeypatch.setattr(subprocess, 'run', lambda cmd, **k: commands.append(cmd) or types.SimpleNamespace(
      returncode=-11, stdout='', stderr=''))
  row = aot_sd3.compile_one('configs/sd35m.py', 'flow_grpo', 'v5p-8', 'rollout', 10)
  assert row['outcome'] == 'libtpu_crash' and row['fits'] is None and 'signal 11' in row['error']
  assert '--config=configs/sd35m.py:flow_grpo' in commands[0] and '--config.micro_batch=0' in commands[0]
