"""Reward tasks over Redis: the trainer-side client and the queue protocol the servers (serve.py) share.

Keys (prefix `ns`, default 'ddrl:reward'):
  {ns}:queue            list of task ids; clients LPUSH, servers take from the right
  {ns}:processing       ids taken by some server and not yet answered
  {ns}:task:{id}        the request (msgpack, arrays as .npy bytes; expires after task_ttl_s)
  {ns}:lease:{id}       held by the server working on the task, renewed while it works
  {ns}:attempts:{id}    how many times a server has taken the task
  {ns}:result:{id}      the reply (msgpack), and {ns}:done:{id} a list the client BLPOPs on
  {ns}:server:{name}    heartbeat of each running server (expires when it stops)

A server that dies (kill -9, host lost) stops renewing its leases; any server's reaper then moves the
task back to the queue, so a restarted or surviving server scores it. After `max_attempts` takes a task
is answered with NaN scores instead of being retried forever.

Request: {id, auth: 'Bearer <token>', names, kwargs, imports, samples, prompts, chunk_size, created}.
Reply:   {id, scores: {name: (M,) float32}, failures: {cause: n}, errors: [...], server} or
         {id, error, code} (401: bad token; 400: malformed request; 500: server-side failure).
"""
import logging
import time
import uuid

import numpy as np

from ddrl_jax.rewards import pool as pool_lib
from ddrl_jax.rewards import wire

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = 'ddrl:reward'

# Atomically take the next task: move its id to processing, lease it, count the attempt.
TAKE_LUA = """
local id = redis.call('RPOPLPUSH', KEYS[1], KEYS[2])
if not id then return nil end
redis.call('SET', ARGV[1] .. ':lease:' .. id, ARGV[2], 'PX', ARGV[3])
local n = redis.call('INCR', ARGV[1] .. ':attempts:' .. id)
redis.call('EXPIRE', ARGV[1] .. ':attempts:' .. id, ARGV[4])
return {id, n}
"""

# Requeue processing ids whose lease expired (their server died); forget answered ones.
REAP_LUA = """
local ids = redis.call('LRANGE', KEYS[2], 0, -1)
local moved = 0
for _, id in ipairs(ids) do
  if redis.call('EXISTS', ARGV[1] .. ':result:' .. id) == 1 then
    redis.call('LREM', KEYS[2], 0, id)
  elseif redis.call('EXISTS', ARGV[1] .. ':lease:' .. id) == 0 then
    redis.call('LREM', KEYS[2], 0, id)
    redis.call('RPUSH', KEYS[1], id)
    moved = moved + 1
  end
end
return moved
"""


class Keys:
  def __init__(self, ns=DEFAULT_NAMESPACE):
    self.ns = ns
    self.queue, self.processing = f'{ns}:queue', f'{ns}:processing'

  def task(self, i):
    return f'{self.ns}:task:{i}'

  def lease(self, i):
    return f'{self.ns}:lease:{i}'

  def result(self, i):
    return f'{self.ns}:result:{i}'

  def done(self, i):
    return f'{self.ns}:done:{i}'

  def server(self, name):
    return f'{self.ns}:server:{name}'


def connect(url, socket_timeout=30.0):
  import redis  # pylint: disable=g-import-not-at-top
  return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=10.0)


def nan_result(names, num, kind, message):
  """All samples failed with one cause."""
  return pool_lib.RewardResult(
      scores={n: np.full((num,), np.nan, np.float32) for n in names},
      failures={k: (len(names) if k == kind else 0) for k in pool_lib.FAILURE_KINDS},
      errors=[message])


def decode_reply(raw, names, num):
  """A server's reply bytes -> RewardResult; RewardServiceError for a rejected token."""
  try:
    reply = wire.unpack(raw, required=('id',))
  except wire.WireError as e:
    return nan_result(names, num, 'garbage', f'undecodable reply: {e}')
  if 'error' in reply:
    if reply.get('code') == 401:
      raise pool_lib.RewardServiceError(f'reward server rejected the bearer token: {reply["error"]}')
    return nan_result(names, num, 'error', f'reward server: {reply["error"]}')
  job = pool_lib.RewardJob(names, num, [slice(0, num)])
  pool_lib.apply_reply(job, slice(0, num), {'scores': reply.get('scores'), 'errors': {}}, num)
  job.chunk_done()
  result = job.result(0)
  for k, v in (reply.get('failures') or {}).items():
    if k in result.failures and isinstance(v, int):
      result.failures[k] += v
  result.errors.extend(str(e) for e in reply.get('errors') or [])
  return result


class RedisRewardClient:
  """Submits reward tasks to Redis and collects the replies (same interface as LocalRewardService).

  Connection errors are retried `retries` times with exponential backoff; a reply that does not come
  within `timeout_s` of the submission yields NaN scores (counted as timeouts) and cancels the task.
  """

  def __init__(self, url, token, spec, *, chunk_size=16, timeout_s=600.0, retries=3,
               task_ttl_s=3600, namespace=DEFAULT_NAMESPACE):
    self.url, self.token, self.spec = url, token, spec
    self.chunk_size, self.timeout_s, self.retries = chunk_size, timeout_s, retries
    self.task_ttl_s = int(task_ttl_s)
    self.keys = Keys(namespace)
    self.redis = connect(url)
    self.stats = {'retries': 0}

  def _retry(self, fn):
    import redis  # pylint: disable=g-import-not-at-top
    delay = 0.5
    for attempt in range(self.retries + 1):
      try:
        return fn()
      except (redis.ConnectionError, redis.TimeoutError) as e:
        if attempt == self.retries:
          raise
        self.stats['retries'] += 1
        logger.warning('redis %s: %s; retry %d/%d in %.1f s', self.url, e, attempt + 1,
                       self.retries, delay)
        time.sleep(delay)
        delay *= 2

  def request(self, samples, prompts, task_id=None):
    """The request bytes of one batch (also used by tests to craft variants)."""
    return wire.pack({
        'id': task_id or uuid.uuid4().hex, 'auth': f'Bearer {self.token}', 'names': self.spec.names,
        'kwargs': self.spec.kwargs, 'imports': list(self.spec.imports),
        'samples': np.ascontiguousarray(samples), 'prompts': [str(p) for p in prompts],
        'chunk_size': self.chunk_size, 'created': time.time()})

  def push(self, task_id, payload):
    def go():
      pipe = self.redis.pipeline()
      pipe.set(self.keys.task(task_id), payload, ex=self.task_ttl_s)
      pipe.lpush(self.keys.queue, task_id)
      pipe.execute()
    self._retry(go)

  def submit(self, samples, prompts):
    samples = np.asarray(samples)
    if len(prompts) != samples.shape[0]:
      raise ValueError(f'{len(prompts)} prompts for {samples.shape[0]} samples')
    task_id = uuid.uuid4().hex
    pending = _RedisPending(self, task_id, samples.shape[0], time.monotonic() + self.timeout_s)
    try:
      self.push(task_id, self.request(samples, prompts, task_id))
    except Exception as e:  # Redis unreachable after the retries: this batch fails, training goes on
      pending.failed = nan_result(self.spec.names, samples.shape[0], 'error',
                                  f'could not submit to {self.url}: {type(e).__name__}: {e}')
    return pending

  def live_servers(self):
    return [k.decode() for k in self.redis.scan_iter(match=self.keys.server('*'))]

  def check(self, timeout_s=30.0):
    """Raises RewardServiceError unless a server answers an empty task with this token in time."""
    pending = self.submit(np.zeros((0,), np.float32), [])
    pending.deadline = time.monotonic() + timeout_s
    result = pending.result()
    if result.failures['timeout']:
      raise pool_lib.RewardServiceError(
          f'no reward server answered on {self.url} within {timeout_s} s (live servers: '
          f'{self.live_servers()}); start one with python -m ddrl_jax.rewards.serve --redis={self.url}')
    if result.errors:
      raise pool_lib.RewardServiceError(f'reward server check failed: {result.errors}')

  def close(self):
    self.redis.close()


class _RedisPending:
  def __init__(self, client, task_id, num, deadline):
    self.client, self.id, self.num, self.deadline = client, task_id, num, deadline
    self.failed = None
    self._result = None

  def done(self):
    if self.failed is not None or self._result is not None:
      return True
    return bool(self.client._retry(lambda: self.client.redis.exists(self.client.keys.result(self.id))))

  def result(self):
    if self.failed is not None:
      return self.failed
    if self._result is not None:
      return self._result
    c, names = self.client, self.client.spec.names
    try:
      while True:
        left = self.deadline - time.monotonic()
        if left <= 0:
          c._retry(lambda: c.redis.delete(c.keys.task(self.id)))   # cancel: servers skip it
          self._result = nan_result(names, self.num, 'timeout',
                                    f'no reply for task {self.id} within {c.timeout_s} s')
          return self._result
        if c._retry(lambda: c.redis.blpop([c.keys.done(self.id)], timeout=max(1, min(5, int(left))))):
          raw = c._retry(lambda: c.redis.get(c.keys.result(self.id)))
          if raw is None:
            self._result = nan_result(names, self.num, 'error', f'result of {self.id} expired')
          else:
            self._result = decode_reply(raw, names, self.num)
          return self._result
    except pool_lib.RewardServiceError:
      raise
    except Exception as e:  # Redis gone mid-wait after the retries: NaN for this batch
      self._result = nan_result(names, self.num, 'error', f'{type(e).__name__}: {e}')
      return self._result
