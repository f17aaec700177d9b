"""Preemption and crashes through the real CLI: SIGKILL at fixed moments then resume, SIGTERM saves and exits
0, a second signal exits at once; damaged checkpoints fall back; non-finite training stops."""
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from test_bad_inputs import _state_file  # tests/test_bad_inputs.py
from test_trainer import small_config  # tests/test_trainer.py

from ddrl_jax import checkpoints as checkpoints_lib
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import trainer as trainer_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location('fault_tolerance',
                                               os.path.join(ROOT, 'benchmarks', 'fault_tolerance.py'))
ft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ft)

# A small toy2d run through the CLI: 6 iterations, checkpoints at 2, 4, 6, evaluations at 0, 3, 6.
ft.CONFIGS['toy2d_test'] = [
    '--config=configs/toy2d.py', '--config.num_iterations=6', '--config.checkpoint_every=2',
    '--config.eval_every=3', '--config.eval_samples=64', '--config.toy2d.pretrain_steps=50',
    '--config.toy2d.width=32', '--config.reward.workers=1']


def _cli(workdir, kill_at=None):
  os.makedirs(workdir, exist_ok=True)
  events, log = os.path.join(workdir, 'events.jsonl'), os.path.join(workdir, 'log.txt')
  code, killed, children = ft.run('toy2d_test', str(workdir), events, log, kill_at, timeout=400)
  return code, killed, children, ft.read_events(events), open(log).read()


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('reference')
  code, _, _, _, log = _cli(workdir)
  assert code == 0, log[-3000:]
  assert f'summary of {workdir}:' in log and f'{workdir}/checkpoints/6' in log
  assert sorted(int(s) for s in os.listdir(workdir / 'checkpoints')) == [2, 4, 6]   # max_checkpoints 3
  assert any(f.startswith('events') for f in os.listdir(workdir / 'tensorboard'))
  rows = ft.read_rows(workdir)
  assert [r['step'] for r in rows if 'loss' in r] == [1, 2, 3, 4, 5, 6]
  assert [r['step'] for r in rows if 'eval/reward' in r] == [0, 3, 6]
  return rows


def _assert_identical(workdir, reference):
  got, dups = ft.comparable(ft.read_rows(workdir))
  want, _ = ft.comparable(reference)
  assert not dups, f'steps written twice: {dups}'
  assert sorted(got) == sorted(want)
  for k in want:
    assert got[k] == want[k], (k, {m for m in want[k] if want[k][m] != got[k].get(m)})


def _kill_on(event, it):
  return lambda e: 0.0 if e['event'] == event and e.get('it') == it else None


@pytest.mark.slow
def test_two_sigkills_then_resume_match_the_uninterrupted_run(tmp_path, reference):
  workdir = tmp_path / 'run'
  # Kill 1: in the update of iteration 3 (checkpoint 2 is the newest).
  code, killed, children, events, _ = _cli(workdir, _kill_on('rewards_ready', 3))
  assert killed and code == -signal.SIGKILL
  # The SIGKILL follows the event from another process: on busy cores the trainer may finish iteration 3's
  # update first, but it never reaches another checkpoint (checkpoint 2 stays the newest).
  seen = [(e['event'], e.get('it')) for e in events]
  after = seen[seen.index(('rewards_ready', 3)) + 1:]
  assert {name for name, _ in after} <= {'data_grad_done', 'update_done', 'iteration_start', 'rollout_done'}
  assert ('update_done', 4) not in after
  time.sleep(1.0)
  assert not ft.alive(children), 'a reward worker outlived its killed trainer'
  # Kill 2: the resumed run, in the middle of saving checkpoint 4.
  code, killed, _, events, _ = _cli(workdir, _kill_on('checkpoint_start', 3))
  assert killed and code == -signal.SIGKILL
  restored = [e for e in events if e['event'] == 'restored']
  assert [e['step'] for e in restored] == [0, 2]
  code, _, _, events, log = _cli(workdir)
  assert code == 0, log[-3000:]
  assert [e['step'] for e in events if e['event'] == 'restored'][-1] == 2
  _assert_identical(workdir, reference)


@pytest.mark.slow
def test_sigterm_saves_exits_0_and_the_rerun_resumes(tmp_path, reference):
  workdir = tmp_path / 'run'
  os.makedirs(workdir)
  events = tmp_path / 'events.jsonl'
  log = open(tmp_path / 'log.txt', 'w')
  proc = subprocess.Popen(ft.command('toy2d_test', str(workdir)), cwd=ROOT,
                          env=dict(os.environ, DDRL_EVENT_LOG=str(events)), stderr=log)
  tail, sent, deadline = ft.EventTail(str(events)), False, time.time() + 300
  while not sent and proc.poll() is None and time.time() < deadline:
    # SIGTERM during iteration 2's rollout: the run finishes that iteration and saves step 3.
    if any(e['event'] == 'rollout_done' and e.get('it') == 2 for e in tail.poll()):
      children = ft.child_pids(proc.pid)
      proc.send_signal(signal.SIGTERM)
      sent = True
    time.sleep(0.001)
  proc.wait(timeout=120)
  err = open(tmp_path / 'log.txt').read()
  assert sent and proc.returncode == 0, err[-3000:]
  assert 'stopped by SIGTERM after step 3 of 6' in err and 'Rerun the same command to resume' in err
  assert sorted(int(s) for s in os.listdir(workdir / 'checkpoints') if s.isdigit())[-1] == 3
  assert [r['step'] for r in ft.read_rows(workdir)][-1] == 3      # flushed up to the saved step
  assert not ft.alive(children), 'reward workers must be stopped before exiting'
  code, _, _, events, log = _cli(workdir)
  assert code == 0, log[-3000:]
  assert [e['step'] for e in events if e['event'] == 'restored'][-1] == 3
  _assert_identical(workdir, reference)


@pytest.mark.slow
def test_a_second_signal_exits_at_once(tmp_path):
  workdir = tmp_path / 'run'
  os.makedirs(workdir)
  events = tmp_path / 'events.jsonl'
  args = ft.command('toy2d_test', str(workdir)) + ['--config.num_iterations=100000']
  log = open(tmp_path / 'log.txt', 'w')
  proc = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, DDRL_EVENT_LOG=str(events)), stderr=log)
  tail = ft.EventTail(str(events))
  deadline = time.time() + 300
  # The first signal arrives as iteration 0 starts (its rollout compiles for seconds); the second
  # once the first has been acknowledged (identical pending signals would merge into one).
  while not any(e['event'] == 'iteration_start' for e in tail.poll()) and time.time() < deadline:
    time.sleep(0.001)
  proc.send_signal(signal.SIGINT)
  while 'SIGINT received' not in open(tmp_path / 'log.txt').read() and time.time() < deadline:
    time.sleep(0.001)
  t0 = time.time()
  proc.send_signal(signal.SIGINT)
  proc.wait(timeout=60)
  err = open(tmp_path / 'log.txt').read()
  assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
  assert time.time() - t0 < 5
  assert not any(e['event'] == 'update_done' for e in tail.poll())
  assert 'second signal (SIGINT) while stopping: exiting now without saving' in err


# ------------------------------------------------------------------------- in-process checkpoints
def _copy(src, tmp_path):
  dst = tmp_path / 'copy'
  shutil.copytree(src, dst)
  return dst


def test_damaged_latest_checkpoint_falls_back_and_reruns_its_steps_exactly(trained, tmp_path,
                                                                           caplog):
  workdir = _copy(trained, tmp_path)
  path = _state_file(workdir / 'checkpoints' / '4')
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)
  trainer = trainer_lib.Trainer(small_config('ddrl', num_iterations=4), workdir,
                                devices=jax.devices()[:1])
  with caplog.at_level(logging.WARNING):
    trainer.train(progress=False)
  assert f'checkpoint {workdir}/checkpoints/4 is damaged' in caplog.text
  assert 'truncated' in caplog.text
  assert os.listdir(workdir / 'checkpoints_damaged')[0].startswith('4_')
  rows = metrics_lib.read_metrics(workdir)
  raw = [json.loads(l)['step'] for l in open(workdir / 'metrics.jsonl')]
  assert raw == sorted(raw) and len(raw) == len(set(
      (r['step'], any(k.startswith('eval') for k in r)) for r in rows))    # each step once
  want = {r['step']: r for r in metrics_lib.read_metrics(trained) if 'loss' in r}
  got = {r['step']: r for r in rows if 'loss' in r}
  assert sorted(got) == [1, 2, 3, 4]
  for step in (3, 4):
    for k, v in want[step].items():
      if not metrics_lib.is_wall_clock(k):
        assert got[step][k] == v, (step, k)
  assert checkpoints_lib.verify(str(workdir / 'checkpoints' / '4'))      # rewritten, recorded again


def test_nonfinite_training_stops_and_keeps_the_last_good_checkpoint(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  # learning_rate may change on resume; 1e39 overflows float32 and sends the parameters to inf.
  c = small_config('ddrl', num_iterations=8, max_nonfinite_steps=2, **{'optim.learning_rate': 1e39})
  trainer = trainer_lib.Trainer(c, workdir, devices=jax.devices()[:1])
  with pytest.raises(trainer_lib.NonFiniteTrainingError,
                     match=r'non-finite .* for 2 updates in a row \(config.max_nonfinite_steps = 2\), '
                           r'up to step 6; the last good checkpoint, step 4, is kept'):
    trainer.train(progress=False)
  rows = [r for r in metrics_lib.read_metrics(workdir) if 'loss' in r]
  assert [r['params_finite'] for r in rows[-2:]] == [0.0, 0.0]
  assert trainer.ckpt.latest_step() == 4
  again = trainer_lib.Trainer(small_config('ddrl', num_iterations=8), workdir, devices=jax.devices()[:1])
  assert again.restore_or_init() == 4
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(again.state.params))


@pytest.mark.slow
def test_pretrain_sigterm_saves_exits_0_and_resumes(tmp_path):
  workdir = tmp_path / 'pretrain'
  metrics = workdir / 'metrics.jsonl'
  args = [sys.executable, '-m', 'ddrl_jax.pretrain', '--config=configs/ocr_tiny.py',
          f'--workdir={workdir}', '--config.pretrain.batch=8', '--config.pretrain.log_every=1',
          '--config.pretrain.eval_every=100000', '--config.pretrain.checkpoint_every=100000']

  def run_then_sigterm(rows):
    """Runs the command until metrics.jsonl has `rows` rows, then SIGTERM; returns its stderr."""
    log = open(tmp_path / 'log.txt', 'w')
    proc = subprocess.Popen(args, cwd=ROOT, stderr=log)
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().count('\n') >= rows) and time.time() < deadline:
      time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    err = open(tmp_path / 'log.txt').read()
    assert proc.returncode == 0, err[-3000:]
    return err

  err = run_then_sigterm(2)
  saved = sorted(int(s) for s in os.listdir(workdir / 'checkpoints') if s.isdigit())
  assert len(saved) == 1 and saved[0] >= 2
  assert f'stopped by SIGTERM after step {saved[0]} of 7000' in err
  assert os.path.isdir(workdir / 'export')
  err = run_then_sigterm(saved[0] + 2)                    # the same command resumes
  assert f'resumed pretraining at step {saved[0]}' in err
  last = sorted(int(s) for s in os.listdir(workdir / 'checkpoints') if s.isdigit())[-1]
  assert last >= saved[0] + 2 and f'stopped by SIGTERM after step {last} of 7000' in err
  steps = [json.loads(l)['step'] for l in open(metrics)]
  assert steps == list(range(1, last + 1))                # each step once, none lost


_TWO_HOSTS = '''
import os, signal, sys, time
import jax
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
process, port, sig, sender = int(sys.argv[1]), sys.argv[2], getattr(signal, sys.argv[3]), int(sys.argv[4])
jax.distributed.initialize(f'localhost:{port}', 2, process)
from ddrl_jax import preemption
with preemption.PreemptionGuard() as guard:
  for step in range(300):
    time.sleep(0.02)
    if process == sender and step == 10:
      os.kill(os.getpid(), sig)          # one host gets the notice
    if guard.should_stop(step):
      print(f'stopped at {step} by {guard.received}', flush=True)
      break
'''


@pytest.mark.slow
@pytest.mark.parametrize('sig,sender,why', [('SIGTERM', 0, 'preemption notice'),
                                            ('SIGINT', 1, 'SIGINT (another host)')])
def test_two_processes_stop_at_the_same_step(sig, sender, why):
  """Two JAX processes (gloo CPU collectives): a SIGTERM to one host reaches JAX's preemption sync point
  on both, a SIGINT to one host is shared by an all-gather; either way both stop after the same step."""
  import portpicker  # pylint: disable=g-import-not-at-top
  port = str(portpicker.pick_unused_port())
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  env.pop('JAX_COMPILATION_CACHE_DIR', None)   # see test_multihost.start: gloo jobs skip the suite's cache
  procs = [subprocess.Popen([sys.executable, '-c', _TWO_HOSTS, str(i), port, sig, str(sender)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(2)]
  outs = [p.communicate(timeout=240) for p in procs]
  assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
  lines = [o[0].strip().splitlines()[-1] for o in outs]
  steps = {l.split()[2] for l in lines}
  assert len(steps) == 1, lines                       # the same step on both hosts
  assert any(why in l for l in lines), lines
