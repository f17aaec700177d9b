"""The Redis reward service through its own infrastructure's faults, on loopback: a Redis restart under a
live server (which keeps serving) and a live trainer (which loses no task), no live server (the trainer
says so within a poll and fails the batch after its grace, instead of waiting out the timeout), a task
lost by a restart without persistence (resubmitted under its id and scored once)."""
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import ml_collections
import numpy as np
import pytest

from ddrl_jax import rewards
from ddrl_jax.rewards import redis_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = 'outage-token-42'
IMAGES = np.random.RandomState(2).randint(0, 255, (8, 6, 6, 3), dtype=np.uint8)
EXPECTED = IMAGES.reshape(8, -1).astype(np.float32).mean(-1) / 255


class Redis:
  """A redis-server on a fixed loopback port that can be killed and started again (empty: no
  persistence, the worst case a restart can be)."""

  def __init__(self):
    binary = shutil.which('redis-server')
    if binary is None:
      if os.environ.get('DDRL_REQUIRE_REDIS'):
        pytest.fail("redis-server is not installed (.ci/run installs Debian's redis-server)")
      pytest.skip('redis-server is not installed')
    import portpicker  # pylint: disable=g-import-not-at-top
    self.binary, self.port = binary, portpicker.pick_unused_port()
    self.url = f'redis://127.0.0.1:{self.port}/0'
    self.proc = None
    self.start()

  def start(self):
    self.proc = subprocess.Popen([self.binary, '--port', str(self.port), '--save', '', '--appendonly',
                                  'no', '--bind', '127.0.0.1'], stdout=subprocess.DEVNULL)
    client = redis_backend.connect(self.url)
    for _ in range(200):
      try:
        client.ping()
        return
      except Exception:  # pylint: disable=broad-except  (not up yet)
        time.sleep(0.05)
    raise RuntimeError('redis-server did not start')

  def kill(self):
    self.proc.kill()
    self.proc.wait()

  def restart(self, down_s):
    self.kill()
    time.sleep(down_s)
    self.start()


@pytest.fixture
def redis_server():
  r = Redis()
  yield r
  r.kill()


@pytest.fixture
def servers(redis_server, tmp_path):
  """start(**flags) -> a reward server process logging to a file; `log(proc)` reads it."""
  procs = []

  def start(**flags):
    args = dict(workers=1, chunk_timeout=30, lease=1.5) | flags
    cmd = [sys.executable, '-m', 'ddrl_jax.rewards.serve', f'--redis={redis_server.url}',
           f'--token={TOKEN}'] + [f'--{k}={v}' for k, v in args.items()]
    log = open(tmp_path / f'server{len(procs)}.log', 'w')
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stderr=log, stdout=log)
    proc.log_path = log.name
    procs.append(proc)
    return proc

  yield start
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()


def reward_config(url, fns, kwargs=None, timeout_s=60.0, grace_s=60.0):
  return ml_collections.ConfigDict(dict(
      fns=fns, kwargs=kwargs or {}, combine='advantage_mean', imports=(), backend='redis', workers=0,
      chunk_size=4, chunk_timeout_s=30.0, timeout_s=timeout_s, redis_url=url,
      token_env='DDRL_TEST_REWARD_TOKEN', retries=2, task_ttl_s=600, max_failed_batches=3,
      no_server_grace_s=grace_s))


def client(url, fns, kwargs=None, **kw):
  os.environ['DDRL_TEST_REWARD_TOKEN'] = TOKEN
  return rewards.make_reward_service(reward_config(url, fns, kwargs, **kw))


def wait_for_server(svc, timeout=60):
  deadline = time.monotonic() + timeout
  while not svc.live_servers():
    assert time.monotonic() < deadline, 'the reward server did not start'
    time.sleep(0.1)


def test_server_and_client_ride_out_a_redis_restart_with_a_task_in_flight(redis_server, servers, caplog):
  """Redis dies (losing everything) while the server scores a task and the client waits on it: the
  server keeps its pool and its task and answers once Redis is back, the client waits and gets the
  scores, and the server goes on serving; each side logs one line when Redis goes and one when it is back."""
  caplog.set_level(logging.WARNING)
  server = servers()
  svc = client(redis_server.url, {'debug_sleep': 1.0}, {'debug_sleep': {'seconds': 3.0}})
  wait_for_server(svc)
  pending = svc.submit(IMAGES, ['x'] * 8)
  got = {}
  waiter = threading.Thread(target=lambda: got.setdefault('result', pending.result()))
  waiter.start()
  time.sleep(1.0)                                   # the server has taken the task and scores it
  redis_server.restart(down_s=2.0)
  waiter.join(60)
  result = got['result']
  np.testing.assert_allclose(result.scores['debug_sleep'], EXPECTED, rtol=1e-6)
  assert sum(result.failures.values()) == 0 and server.poll() is None
  again = svc.submit(IMAGES, ['y'] * 8).result()    # the same server, its pool still loaded
  np.testing.assert_allclose(again.scores['debug_sleep'], EXPECTED, rtol=1e-6)
  log = open(server.log_path).read()
  assert log.count('unreachable') == 1 and log.count('reachable again') == 1, log
  assert 'Traceback' not in log
  assert 'unreachable' in caplog.text and svc.stats['redis_outages'] == 1


def test_a_task_lost_with_redis_is_resubmitted_and_scored_once(redis_server, servers, caplog):
  """A Redis restart without persistence drops a queued task; the waiting client notices within a poll,
  resubmits it under the same id, and the server that starts afterwards scores it."""
  caplog.set_level(logging.WARNING)
  svc = client(redis_server.url, {'mean_intensity': 1.0}, grace_s=120.0)
  pending = svc.submit(IMAGES, ['x'] * 8)           # no server yet: it waits in the queue
  redis_server.restart(down_s=0.5)                  # ... and is gone
  got = {}
  waiter = threading.Thread(target=lambda: got.setdefault('result', pending.result()))
  waiter.start()
  time.sleep(7.0)                                    # the client's poll sees the loss
  server = servers()
  waiter.join(60)
  np.testing.assert_allclose(got['result'].scores['mean_intensity'], EXPECTED, rtol=1e-6)
  assert svc.stats['resubmitted'] >= 1 and 'resubmitted under the same id' in caplog.text
  assert server.poll() is None


def test_no_live_server_is_said_within_a_poll_and_fails_the_batch_after_the_grace(redis_server, caplog):
  caplog.set_level(logging.WARNING)
  svc = client(redis_server.url, {'mean_intensity': 1.0}, timeout_s=600.0, grace_s=3.0)
  t0 = time.monotonic()
  result = svc.submit(IMAGES, ['x'] * 8).result()
  took = time.monotonic() - t0
  assert took < 15, took                            # the grace, not the 600 s timeout
  assert np.isnan(result.scores['mean_intensity']).all()
  assert {k: v for k, v in result.failures.items() if v} == {'no_server': 8}
  assert caplog.text.count('no live reward server on') >= 1
  assert rewards.errors_by_kind(result.errors)['no_server'].startswith('samples 0:8 no_server: ')


def test_a_dead_server_is_noticed_and_a_new_one_finishes_the_task(redis_server, servers, caplog):
  """kill -9 of the only server mid-task: the client says no server is live within a poll; a server
  started before the grace runs out takes the task over after its lease and answers."""
  caplog.set_level(logging.WARNING)
  first = servers()
  svc = client(redis_server.url, {'debug_sleep': 1.0}, {'debug_sleep': {'seconds': 2.0}}, grace_s=60.0)
  wait_for_server(svc)
  pending = svc.submit(IMAGES, ['x'] * 8)
  got = {}
  waiter = threading.Thread(target=lambda: got.setdefault('result', pending.result()))
  waiter.start()
  time.sleep(1.0)
  first.kill()
  first.wait()
  deadline = time.monotonic() + 30
  while 'no live reward server' not in caplog.text:
    assert time.monotonic() < deadline, 'the client did not notice the dead server'
    time.sleep(0.2)
  servers()
  waiter.join(90)
  np.testing.assert_allclose(got['result'].scores['debug_sleep'], EXPECTED, rtol=1e-6)


def test_a_server_killed_mid_task_is_reported_while_another_rescores_it(redis_server, servers, caplog):
  """Two servers; the one scoring the task is killed -9: the waiting client says so once the task is
  taken again (lease 1.5 s), and the survivor's scores arrive."""
  caplog.set_level(logging.WARNING)
  a = servers(name='a', max_inflight=1)
  svc = client(redis_server.url, {'debug_sleep': 1.0}, {'debug_sleep': {'seconds': 4.0}})
  wait_for_server(svc)
  pending = svc.submit(IMAGES, ['x'] * 8)
  while not svc.redis.get(svc.keys.lease(pending.id)):
    time.sleep(0.05)
  servers(name='b', max_inflight=1)
  a.kill()
  a.wait()
  result = pending.result()
  np.testing.assert_allclose(result.scores['debug_sleep'], EXPECTED, rtol=1e-6)
  assert svc.stats['retaken'] == 1 and 'taken again (attempt 2)' in caplog.text


@pytest.mark.slow
def test_trainer_loses_no_iteration_to_a_redis_restart(redis_server, servers, tmp_path):
  """toy2d over the Redis service; Redis is killed (empty again) for 2 s right after iteration 2's
  rewards were submitted: every iteration is scored in full and the run ends normally."""
  from configs import toy2d  # pylint: disable=g-import-not-at-top
  from ddrl_jax import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  servers(workers=1)
  config = toy2d.get_config()
  config.num_iterations = 4
  config.eval_every = -1
  config.reward.backend = 'redis'
  config.reward.redis_url = redis_server.url
  config.reward.token_env = 'DDRL_TEST_REWARD_TOKEN'
  os.environ['DDRL_TEST_REWARD_TOKEN'] = TOKEN
  trainer = trainer_lib.Trainer(config, str(tmp_path / 'run'))

  def hook(name, info):
    if name == 'rewards_submitted' and info.get('it') == 2:
      redis_server.restart(down_s=2.0)
  trainer.event_hooks.append(hook)
  trainer.train(progress=False)
  rows = [json.loads(l) for l in open(tmp_path / 'run' / 'metrics.jsonl')]
  train = [r for r in rows if 'loss' in r]
  assert [r['step'] for r in train] == [1, 2, 3, 4]
  assert all(r['failed_rewards'] == 0 and np.isfinite(r['reward_mean']) for r in train), train


def test_periodic_wait_lines_are_never_more_than_their_interval_apart():
  """The wait loop wakes every <= LOOP_S seconds (BLPOP timeout, retries); `_due` writes a line early
  enough that consecutive lines are at most REDIS_DOWN_LOG_S apart, and at least the interval less a
  wake apart (not a line per wake)."""
  from ddrl_jax.rewards import redis_backend  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  every = redis_backend.REDIS_DOWN_LOG_S
  for _ in range(200):
    now, last, lines = 0.0, 0.0, [0.0]
    while now < 120:
      now += rng.uniform(0.01, redis_backend.LOOP_S)
      if redis_backend._due(now, last, every):   # pylint: disable=protected-access
        last = now
        lines.append(now)
    gaps = np.diff(lines + [now])
    assert gaps.max() <= every + 1e-9, gaps.max()
    assert np.diff(lines).min() >= every - redis_backend.LOOP_S
