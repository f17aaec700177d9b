"""The Redis reward service end to end, against a real redis-server and real server processes.

Each test starts its own redis-server on a free port (the binary comes from Debian's redis-server
package, which .ci/run installs) and `python -m ddrl_jax.rewards.serve` subprocesses.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import ml_collections
import msgpack
import numpy as np
import pytest
from rendering import render  # tests/rendering.py

from ddrl_jax import rewards
from ddrl_jax.rewards import redis_backend
from ddrl_jax.rewards import wire

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = 'test-token-0123'
IMAGES = np.random.RandomState(1).randint(0, 255, (8, 6, 6, 3), dtype=np.uint8)
EXPECTED = IMAGES.reshape(8, -1).astype(np.float32).mean(-1) / 255


@pytest.fixture
def redis_url():
  binary = shutil.which('redis-server')
  if binary is None:
    if os.environ.get('DDRL_REQUIRE_REDIS'):
      pytest.fail('redis-server is not installed (.ci/run installs Debian\'s redis-server)')
    pytest.skip('redis-server is not installed')
  import portpicker  # pylint: disable=g-import-not-at-top
  port = portpicker.pick_unused_port()
  proc = subprocess.Popen([binary, '--port', str(port), '--save', '', '--appendonly', 'no',
                           '--bind', '127.0.0.1'], stdout=subprocess.DEVNULL)
  url = f'redis://127.0.0.1:{port}/0'
  client = redis_backend.connect(url)
  for _ in range(100):
    try:
      client.ping()
      break
    except Exception:  # not up yet
      time.sleep(0.05)
  yield url
  proc.kill()
  proc.wait()


@pytest.fixture
def servers(redis_url):
  """start(**flags) -> a `python -m ddrl_jax.rewards.serve` process; all killed at the end."""
  procs = []

  def start(token=TOKEN, **flags):
    args = dict(workers=1, chunk_timeout=10, lease=1.5, max_attempts=3) | flags
    cmd = [sys.executable, '-m', 'ddrl_jax.rewards.serve', f'--redis={redis_url}', f'--token={token}']
    cmd += [f'--{k}={v}' for k, v in args.items()]
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT)))
    return procs[-1]

  yield start
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()


def client(url, fns, kwargs=None, token=TOKEN, timeout_s=60.0, chunk_size=4):
  c = ml_collections.ConfigDict(dict(
      fns=fns, kwargs=kwargs or {}, combine='advantage_mean', imports=(), backend='redis', workers=0,
      chunk_size=chunk_size, chunk_timeout_s=10.0, timeout_s=timeout_s, redis_url=url,
      token_env='DDRL_TEST_REWARD_TOKEN', retries=2, task_ttl_s=600, max_failed_batches=3))
  os.environ['DDRL_TEST_REWARD_TOKEN'] = token
  return rewards.make_reward_service(c)


def test_scores_match_direct_computation_including_real_ocr(redis_url, servers):
  servers(workers=2)
  svc = client(redis_url, {'mean_intensity': 1.0, 'ocr': 2.0})
  svc.check()
  images = np.stack([render('hello 42'), render('help'), render('jax')])
  prompts = ['"hello 42"', '"hello"', 'say "jax"']
  result = svc.submit(images, prompts).result()
  np.testing.assert_allclose(result.scores['ocr'], [1.0, 0.6, 1.0])
  np.testing.assert_allclose(result.scores['mean_intensity'],
                             rewards.make_reward('mean_intensity')(images, prompts))
  assert sum(result.failures.values()) == 0
  np.testing.assert_allclose(result.matrix(['ocr', 'mean_intensity'])[:, 0], [1.0, 0.6, 1.0])


@pytest.mark.slow
def test_killed_worker_and_hung_worker_give_nan_for_their_chunk_only(redis_url, servers):
  servers(workers=2, chunk_timeout=2)
  svc = client(redis_url, {'mean_intensity': 1.0, 'debug_crash': 1.0, 'debug_sleep': 1.0},
               {'debug_crash': {'trigger': 'boom'}, 'debug_sleep': {'seconds': 30, 'trigger': 'slow'}},
               chunk_size=2)
  prompts = ['a', 'a', 'boom', 'boom', 'slow', 'slow', 'b', 'b']
  result = svc.submit(IMAGES, prompts).result()
  got = result.scores['mean_intensity']
  assert np.isnan(got[2:6]).all()
  np.testing.assert_allclose(got[[0, 1, 6, 7]], EXPECTED[[0, 1, 6, 7]], rtol=1e-6)
  assert result.failures['crash'] == 6 and result.failures['timeout'] == 6    # 2 samples x 3 rewards
  # The server lives on and scores the next batch completely.
  again = svc.submit(IMAGES, ['ok'] * 8).result()
  np.testing.assert_allclose(again.scores['debug_crash'], EXPECTED, rtol=1e-6)


def test_wrong_token_is_rejected_with_a_clear_error(redis_url, servers):
  servers()
  bad = client(redis_url, {'mean_intensity': 1.0}, token='not-the-token')
  with pytest.raises(rewards.RewardServiceError, match='bearer token'):
    bad.check()
  pending = bad.submit(IMAGES, ['x'] * 8)
  with pytest.raises(rewards.RewardServiceError, match='bearer token'):
    pending.result()
  good = client(redis_url, {'mean_intensity': 1.0})
  np.testing.assert_allclose(good.submit(IMAGES, ['x'] * 8).result().scores['mean_intensity'],
                             EXPECTED, rtol=1e-6)


def test_malformed_payloads_are_answered_and_the_server_survives(redis_url, servers):
  servers()
  svc = client(redis_url, {'mean_intensity': 1.0})
  keys, r = svc.keys, svc.redis
  pickled = msgpack.packb({'auth': f'Bearer {TOKEN}', 'names': ['mean_intensity'],
                           'kwargs': {'mean_intensity': {}}, 'prompts': ['x'],
                           'samples': msgpack.ExtType(1, b'\x80\x04pickle-not-npy')})
  wrong_shape = svc.request(IMAGES, ['only one prompt'], 'short')
  unknown = wire.pack({'auth': f'Bearer {TOKEN}', 'names': ['rm_rf'], 'kwargs': {'rm_rf': {}},
                       'samples': IMAGES, 'prompts': ['x'] * 8})
  for task_id, payload in (('junk', b'\xc1\xc1 not msgpack'), ('pickled', pickled),
                           ('short', wrong_shape), ('unknown', unknown)):
    svc.push(task_id, payload)
  replies = {}
  for task_id in ('junk', 'pickled', 'short', 'unknown'):
    assert r.blpop([keys.done(task_id)], timeout=30), task_id
    replies[task_id] = wire.unpack(r.get(keys.result(task_id)))
  assert all(rep['code'] == 400 for rep in replies.values()), replies
  assert 'not a msgpack message' in replies['junk']['error']
  assert 'npy' in replies['pickled']['error']
  assert 'one prompt per sample' in replies['short']['error']
  assert 'unknown rewards' in replies['unknown']['error']
  # A client whose request the server rejects gets NaN and the reason, not an exception.
  decoded = redis_backend.decode_reply(r.get(keys.result('short')), ['mean_intensity'], 8)
  assert np.isnan(decoded.scores['mean_intensity']).all() and decoded.failures['error'] == 8
  r.lpush(keys.queue, 'no-such-task')                     # an id without a payload is skipped
  np.testing.assert_allclose(svc.submit(IMAGES, ['x'] * 8).result().scores['mean_intensity'],
                             EXPECTED, rtol=1e-6)


def test_no_server_times_out_without_hanging(redis_url):
  svc = client(redis_url, {'mean_intensity': 1.0}, timeout_s=2.0)
  t0 = time.monotonic()
  result = svc.submit(IMAGES, ['x'] * 8).result()
  assert time.monotonic() - t0 < 10
  assert np.isnan(result.scores['mean_intensity']).all() and result.failures['timeout'] == 8
  with pytest.raises(rewards.RewardServiceError, match='no reward server answered'):
    svc.check(timeout_s=1.0)


def test_unreachable_redis_fails_the_batch_after_bounded_retries():
  import portpicker  # pylint: disable=g-import-not-at-top
  url = f'redis://127.0.0.1:{portpicker.pick_unused_port()}/0'
  svc = client(url, {'mean_intensity': 1.0}, timeout_s=5.0)
  t0 = time.monotonic()
  result = svc.submit(IMAGES, ['x'] * 8).result()
  assert time.monotonic() - t0 < 20
  assert np.isnan(result.scores['mean_intensity']).all() and result.failures['error'] == 8
  assert svc.stats['retries'] >= 2 and 'could not submit' in result.errors[0]


@pytest.mark.slow
def test_queued_tasks_wait_for_a_server_and_a_killed_server_s_task_is_rescored(redis_url, servers):
  svc = client(redis_url, {'debug_sleep': 1.0}, {'debug_sleep': {'seconds': 3.0}})
  early = svc.submit(IMAGES[:2], ['x', 'y'])              # no server yet: stays queued
  time.sleep(0.5)
  assert not early.done()
  first = servers(name='first')
  deadline = time.monotonic() + 30
  while not svc.redis.llen(svc.keys.processing) and time.monotonic() < deadline:
    time.sleep(0.05)                                       # wait until `first` holds the task
  first.send_signal(signal.SIGKILL)                        # dies mid-task: lease stops renewing
  first.wait()
  second = servers(name='second')
  result = early.result()
  np.testing.assert_allclose(result.scores['debug_sleep'], EXPECTED[:2], rtol=1e-6)
  assert int(svc.redis.get(f'{svc.keys.ns}:attempts:{early.id}')) == 2
  reply = wire.unpack(svc.redis.get(svc.keys.result(early.id)))
  assert reply['server'] == 'second'
  second.send_signal(signal.SIGTERM)


@pytest.mark.slow
def test_task_that_kills_every_server_is_given_up(redis_url, servers):
  svc = client(redis_url, {'debug_sleep': 1.0}, {'debug_sleep': {'seconds': 30.0}})
  pending = svc.submit(IMAGES[:1], ['x'])
  for _ in range(2):                                       # max_attempts=1: the second take gives up
    proc = servers(max_attempts=1)
    while not svc.redis.llen(svc.keys.processing):
      time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if pending.done():
      break
  servers(max_attempts=1)
  result = pending.result()
  assert np.isnan(result.scores['debug_sleep']).all()
  assert any('gave up' in e for e in result.errors)


@pytest.mark.slow
def test_two_servers_share_the_queue(redis_url, servers):
  servers(name='s1', max_inflight=1)
  servers(name='s2', max_inflight=1)
  svc = client(redis_url, {'debug_sleep': 1.0}, {'debug_sleep': {'seconds': 0.5}})
  svc.check()
  pendings = [svc.submit(IMAGES[:1], ['x']) for _ in range(8)]
  results = [p.result() for p in pendings]
  assert all(np.isfinite(r.scores['debug_sleep']).all() for r in results)
  by = [wire.unpack(svc.redis.get(svc.keys.result(p.id)))['server'] for p in pendings]
  assert set(by) == {'s1', 's2'}, by
  beats = {k: json.loads(svc.redis.get(k)) for k in svc.live_servers()}
  assert len(beats) == 2
