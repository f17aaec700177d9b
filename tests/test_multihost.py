"""Several processes on this machine (CPU devices, gloo collectives, coordinator on 127.0.0.1) against one
process with the same 8 devices: the multi-host trainer of issue 12.

Each run starts tests/multihost_worker.py once per process. The mesh is data 2 x fsdp 2 x context 2;
with `context_across_processes` the device order makes the context axis step across processes (as a
14B run's context group of 8 spans two 4-chip hosts), so both processes hold the same batch rows, one
scores them and the other receives the scores; without it each process holds its own rows.
"""
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import portpicker
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, 'tests', 'multihost_worker.py')
TIMEOUT_S = 400


def start(num_processes, spec, devices_per_process=None):
  """Starts the worker in `num_processes` processes (8 devices in all); returns [(Popen, log file)]."""
  devices_per_process = devices_per_process or 8 // num_processes
  port = portpicker.pick_unused_port()
  env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_NUM_CPU_DEVICES=str(devices_per_process),
             JAX_CPU_COLLECTIVES_IMPLEMENTATION='gloo', PYTHONPATH=ROOT)
  env.pop('XLA_FLAGS', None)
  if num_processes > 1:
    # Not the suite's persistent compilation cache (tests/conftest.py): a multi-process job whose
    # executables come from it fails its first Gloo collective (context initialization times out).
    env.pop('JAX_COMPILATION_CACHE_DIR', None)
  os.makedirs(spec['out'], exist_ok=True)
  procs = []
  for i in range(num_processes):
    log = open(os.path.join(spec['out'], f'log_{i}.txt'), 'w')
    procs.append((subprocess.Popen([sys.executable, WORKER, json.dumps(spec), str(i), str(num_processes),
                                    str(port)], env=env, stdout=log, stderr=subprocess.STDOUT), log))
  return procs


def wait(procs, spec, timeout_s=TIMEOUT_S):
  """Waits up to `timeout_s` in all for every process (killing all on a timeout); returns their
  reports, or fails with logs."""
  failed = []
  deadline = time.monotonic() + timeout_s
  for i, (p, log) in enumerate(procs):
    try:
      rc = p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
      for q, _ in procs:
        q.kill()
      rc = 'timeout'
    log.close()
    if rc != 0:
      with open(os.path.join(spec['out'], f'log_{i}.txt')) as f:
        failed.append(f'process {i}: rc {rc}\n' + f.read()[-3000:])
  assert not failed, '\n'.join(failed)
  reports = []
  for i in range(len(procs)):
    with open(os.path.join(spec['out'], f'report_{i}.json')) as f:
      reports.append(json.load(f))
  return reports


def run(num_processes, spec, devices_per_process=None, timeout_s=TIMEOUT_S):
  return wait(start(num_processes, spec, devices_per_process), spec, timeout_s)


def load(out, name):
  with np.load(os.path.join(out, name)) as f:
    return {k: f[k] for k in f}


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  assert sorted(a) == sorted(b)
  for k in a:
    np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


def spec(tmp_path, name, **kw):
  return {'task': 'toy2d', 'scenario': 'train', 'workdir': str(tmp_path / name / 'work'),
          'out': str(tmp_path / name / 'out'), **kw}


@pytest.fixture(scope='module')
def toy_runs(tmp_path_factory):
  """toy2d, 2 DDRL iterations (checkpoint every step): 1 process x 8 devices, and 2 processes x 4
  devices with the context axis across the processes."""
  tmp = tmp_path_factory.mktemp('toy')
  one, two = spec(tmp, 'one'), spec(tmp, 'two', context_across_processes=True)
  return dict(one=(one, run(1, one)), two=(two, run(2, two)))


def test_two_processes_hold_the_same_rows_when_context_spans_them(toy_runs):
  _, reports = toy_runs['two']
  assert [r['process_count'] for r in reports] == [2, 2]
  assert [r['device_count'] for r in reports] == [8, 8]
  # Context replicas on different hosts: the same rows and loader shard; only process 0 scores.
  assert reports[0]['slot_rows'] == reports[1]['slot_rows'] == list(range(32))
  assert reports[0]['shard_index'] == reports[1]['shard_index'] == 0
  assert reports[0]['shard_count'] == 1
  assert [r['lead'] for r in reports] == [True, False]


def test_global_batch_rewards_and_parameters_equal_one_process(toy_runs):
  one, _ = toy_runs['one']
  two, _ = toy_runs['two']
  # The global conditions, data and the exchanged (B*N, R) rewards of iteration 0 are the same arrays.
  batch_1, batch_2 = load(one['out'], 'batch.npz'), load(two['out'], 'batch.npz')
  assert {'slot_cond', "data['x0']", "data['cond']", 'rewards'} <= set(batch_1)
  for k in batch_1:
    np.testing.assert_array_equal(batch_1[k], batch_2[k], err_msg=k)
  assert np.isfinite(batch_2['rewards']).all() and batch_2['rewards'].shape == (32, 1)
  assert_trees_close(load(one['out'], 'params.npz'), load(two['out'], 'params.npz'))


def test_only_process_0_writes_metrics(toy_runs):
  two, _ = toy_runs['two']
  with open(os.path.join(two['workdir'], 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  train_steps = [r['step'] for r in rows if 'loss' in r]
  assert train_steps == [1, 2]           # one writer: each step once
  assert sorted(os.listdir(os.path.join(two['workdir'], 'checkpoints'))) == ['1', '2']


@pytest.mark.parametrize('resume_processes', [1, 2])
def test_save_in_two_processes_resume_in_one_or_two(toy_runs, tmp_path, resume_processes):
  one, _ = toy_runs['one']
  two, _ = toy_runs['two']
  resumed = spec(tmp_path, f'resume{resume_processes}', context_across_processes=True)
  shutil.copytree(two['workdir'], resumed['workdir'])
  shutil.rmtree(os.path.join(resumed['workdir'], 'checkpoints', '2'))     # as if killed after step 1
  reports = run(resume_processes, resumed)
  assert reports[0]['start'] == 1 and reports[0]['final_step'] == 2
  assert_trees_close(load(one['out'], 'params.npz'), load(resumed['out'], 'params.npz'))


def test_four_processes_with_their_own_rows_equal_one_process(toy_runs, tmp_path):
  one, _ = toy_runs['one']
  four = spec(tmp_path, 'four')
  reports = run(4, four)
  # Each process holds one (data, fsdp) coordinate: 8 disjoint slot rows, its own loader shard.
  assert [r['slot_rows'] for r in reports] == [list(range(8 * i, 8 * i + 8)) for i in range(4)]
  assert [r['shard_index'] for r in reports] == [0, 1, 2, 3]
  assert all(r['lead'] for r in reports)
  batch_1, batch_4 = load(one['out'], 'batch.npz'), load(four['out'], 'batch.npz')
  for k in batch_1:
    np.testing.assert_array_equal(batch_1[k], batch_4[k], err_msg=k)
  assert_trees_close(load(one['out'], 'params.npz'), load(four['out'], 'params.npz'))


@pytest.fixture(scope='module')
def toy_records(tmp_path_factory):
  from ddrl_jax.data import records   # pylint: disable=g-import-not-at-top
  out = str(tmp_path_factory.mktemp('records'))
  rng = np.random.default_rng(0)
  records.write_shards([dict(prompt='', sample=rng.normal(size=2).astype(np.float32))
                        for _ in range(64)], out, records_per_shard=16)
  return out


@pytest.mark.parametrize('across', [True, False])
def test_loader_shards_follow_the_row_sets(tmp_path, toy_records, across):
  s = spec(tmp_path, f'layout{across}', context_across_processes=across, scenario='layout',
           overrides={'data.path': toy_records, 'data.shuffle': False})
  reports = run(2, s)
  first = [[tuple(x) for batch in r['records'] for x in batch] for r in reports]
  if across:     # context replicas: identical records, batch of all 8 groups each
    assert first[0] == first[1] and len(first[0]) == 16
  else:          # disjoint row sets: disjoint records, 4 groups each
    assert len(first[0]) == len(first[1]) == 8 and not set(first[0]) & set(first[1])
    assert [r['shard_index'] for r in reports] == [0, 1] and reports[0]['shard_count'] == 2


def test_loader_state_is_saved_per_process_and_needs_the_same_processes(tmp_path, toy_records):
  """2 processes with their own row sets read records from shards 0 and 1 of 2; each saves its loader
  position in the checkpoint; resuming it in 1 process is refused with a message, not a silent restart."""
  overrides = {'data.path': toy_records, 'num_iterations': 1}
  two = spec(tmp_path, 'records2', overrides=overrides)
  reports = run(2, two)
  assert [r['loader_shard'] for r in reports] == [[0, 2], [1, 2]]
  saved = sorted(f for f in os.listdir(os.path.join(two['workdir'], 'checkpoints', '1', 'data'))
                 if f.endswith('.json'))
  assert saved == ['process_0-of-2.json', 'process_1-of-2.json']
  one = spec(tmp_path, 'records1', overrides=overrides, expect_error=True)
  shutil.copytree(two['workdir'], one['workdir'])
  (report,) = run(1, one)
  assert 'IncompatibleCheckpoint' in report['error'] and 'another number of processes' in report['error']
