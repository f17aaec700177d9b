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

Request: {id, auth: 'Bearer <token>', names, kwargs, imports, bounds, samples, prompts, chunk_size,
         created}.
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
  """All samples failed with one cause (num x len(names) entries of `kind`)."""
  return pool_lib.RewardResult(
      scores={n: np.full((num,), np.nan, np.float32) for n in names},
      failures={k: (num * len(names) if k == kind else 0) for k in pool_lib.FAILURE_KINDS},
      errors=[f'samples 0:{num} {kind}: {message}'])


def decode_reply(raw, names, num, bounds=None):
  """A server's reply bytes -> RewardResult, every score judged again here where it arrives (its NaN
  were counted by the server); RewardServiceError for a rejected token."""
  try:
    reply = wire.unpack(raw, required=('id',))
  except wire.WireError as e:
    return nan_result(names, num, 'garbage', f'undecodable reply: {e}')
  if 'error' in reply:
    if reply.get('code') == 401:
      raise pool_lib.RewardServiceError(f'reward server rejected the bearer token: {reply["error"]}')
    return nan_result(names, num, 'error', f'reward server: {reply["error"]}')
  job = pool_lib.RewardJob(names, num, [slice(0, num)], bounds)
  pool_lib.apply_reply(job, slice(0, num), {'scores': reply.get('scores'), 'errors': {}}, num,
                       count_nan=False)
  job.chunk_done(slice(0, num))
  result = job.result(0)
  for k, v in (reply.get('failures') or {}).items():
    if k in result.failures and isinstance(v, int):
      result.failures[k] += v
  result.errors.extend(str(e) for e in reply.get('errors') or [])
  return result


# Where a task stands, atomically: 'answered', 'lost' (no payload and no answer: a Redis restart without
# persistence, or a flush), 'queued', 'processing', or 'requeued' (payload there but the id in neither
# list, e.g. an AOF that kept the payload but not the list entry: the id is pushed again).
STATE_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 'answered' end
if redis.call('EXISTS', KEYS[1]) == 0 then return 'lost' end
if redis.call('LPOS', KEYS[3], ARGV[1]) then return 'queued' end
if redis.call('LPOS', KEYS[4], ARGV[1]) then return 'processing' end
redis.call('LPUSH', KEYS[3], ARGV[1])
return 'requeued'
"""

# The trainer blocks in a pending batch's result() only after its own work (the data gradient) is done, so
# every second there is idle time: no stretch of it goes unexplained for longer than these.
REDIS_DOWN_LOG_S = 10.0      # while Redis or every server is gone, say so again at least this often
WAIT_LOG_S = 10.0            # a wait with live servers is reported at least this often (where the task is)
# The wait loop wakes at least every 5 s (its BLPOP timeout, or a failing call's retries), so a line is
# due once this much less than the interval has passed: consecutive lines are never more than it apart.
LOOP_S = 5.0


def _due(now, last, every):
  """Whether a periodic line last written at `last` must be written now for lines <= `every` apart."""
  return now - last >= every - LOOP_S


class RedisRewardClient:
  """Submits reward tasks to Redis and collects the replies (same interface as LocalRewardService).

  While a batch is pending the client watches it (every poll, <= 5 s):
    * Redis unreachable: one line when it starts, one every 10 s, one when it is back; the wait goes on
      (bounded by `timeout_s`), and a batch Redis could not take at submission is pushed once it can;
    * no live reward server (no heartbeat for 10 s): one line within a poll, then every 10 s; after
      `no_server_grace_s` the batch fails as counted 'no_server' failures (NaN) and is cancelled,
      instead of waiting out `timeout_s`;
    * the task lost by a Redis restart (its payload gone, no answer): resubmitted under the same id, so
      a server that was scoring it and answers later completes it, and servers score an id once;
    * a wait with live servers: one line every 10 s saying where the task is (queued, processing, attempt).
  A reply that does not come within `timeout_s` of the submission yields NaN scores (counted as
  timeouts) and cancels the task. Short connection errors are retried `retries` times with backoff.
  """

  def __init__(self, url, token, spec, *, chunk_size=16, timeout_s=600.0, retries=3,
               task_ttl_s=3600, namespace=DEFAULT_NAMESPACE, no_server_grace_s=60.0):
    self.url, self.token, self.spec = url, token, spec
    self.chunk_size, self.timeout_s, self.retries = chunk_size, timeout_s, retries
    self.task_ttl_s = int(task_ttl_s)
    self.no_server_grace_s = float(no_server_grace_s)
    self.keys = Keys(namespace)
    self.redis = connect(url)
    self._state = self.redis.register_script(STATE_LUA)
    self.stats = {'retries': 0, 'resubmitted': 0, 'requeued': 0, 'retaken': 0, 'redis_outages': 0}

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
        'bounds': {k: list(v) for k, v in self.spec.bounds.items()},
        'samples': np.ascontiguousarray(samples), 'prompts': [str(p) for p in prompts],
        'chunk_size': self.chunk_size, 'created': time.time()})

  def push(self, task_id, payload):
    def go():
      pipe = self.redis.pipeline()
      pipe.set(self.keys.task(task_id), payload, ex=self.task_ttl_s)
      pipe.lpush(self.keys.queue, task_id)
      pipe.execute()
    self._retry(go)

  def task_state(self, task_id):
    """'answered', 'lost', 'queued', 'processing' or 'requeued' (see STATE_LUA); one Redis call."""
    state = self._state(keys=[self.keys.task(task_id), self.keys.result(task_id), self.keys.queue,
                              self.keys.processing], args=[task_id])
    return state.decode() if isinstance(state, bytes) else str(state)

  def submit(self, samples, prompts):
    samples = np.asarray(samples)
    if len(prompts) != samples.shape[0]:
      raise ValueError(f'{len(prompts)} prompts for {samples.shape[0]} samples')
    task_id = uuid.uuid4().hex
    pending = _RedisPending(self, task_id, samples.shape[0], time.monotonic() + self.timeout_s,
                            self.request(samples, prompts, task_id))
    try:
      self.push(task_id, pending.payload)
      pending.pushed = True
    except Exception as e:  # pylint: disable=broad-except  (Redis down: pushed while the batch waits)
      logger.warning('redis %s: could not submit reward task %s (%s: %s); it is pushed when Redis is '
                     'back, until the %s s timeout', self.url, task_id, type(e).__name__, e, self.timeout_s)
    return pending

  def live_servers(self):
    """Names of the servers whose heartbeat (every 2 s, expiring after 10 s) is current."""
    return [k.decode() for k in self.redis.scan_iter(match=self.keys.server('*'), count=1000)]

  def check(self, timeout_s=30.0):
    """Raises RewardServiceError unless a server answers an empty task with this token in time."""
    pending = self.submit(np.zeros((0,), np.float32), [])
    pending.deadline = time.monotonic() + timeout_s
    result = pending.result()
    kinds = pool_lib.errors_by_kind(result.errors)
    if 'timeout' in kinds or 'no_server' in kinds:
      raise pool_lib.RewardServiceError(
          f'no reward server answered on {self.url} within {timeout_s} s (live servers: '
          f'{self.live_servers()}); start one with python -m ddrl_jax.rewards.serve --redis={self.url}')
    if result.errors:
      raise pool_lib.RewardServiceError(f'reward server check failed: {result.errors}')

  def close(self):
    self.redis.close()


class _RedisPending:
  """One submitted batch: `done()`, and `result()`, which waits watching the task (see the client)."""

  def __init__(self, client, task_id, num, deadline, payload):
    self.client, self.id, self.num, self.deadline = client, task_id, num, deadline
    self.payload, self.pushed = payload, False
    self.failed = None
    self._result = None
    self.waited_s = 0.0           # how long result() waited

  def done(self):
    if self.failed is not None or self._result is not None:
      return True
    try:
      return bool(self.client.redis.exists(self.client.keys.result(self.id)))
    except Exception:  # pylint: disable=broad-except  (Redis down: not done; result() deals with it)
      return False

  def _finish(self, result):
    self._result = result
    self.payload = None
    return result

  def result(self):
    if self.failed is not None:
      return self.failed
    if self._result is not None:
      return self._result
    import redis  # pylint: disable=g-import-not-at-top
    c, names = self.client, self.client.spec.names
    start = time.monotonic()
    down_since = no_server_since = None
    last_attempts = 0
    last_down_log = last_no_server_log = last_wait_log = start
    while True:
      now = time.monotonic()
      self.waited_s = now - start
      left = self.deadline - now
      try:
        if left <= 0:
          try:
            c.redis.delete(c.keys.task(self.id))       # cancel: servers skip it
          except redis.RedisError:
            pass
          what = 'could not submit it to' if not self.pushed else 'no reply from'
          kind = 'error' if not self.pushed else 'timeout'
          return self._finish(nan_result(names, self.num, kind, f'{what} {c.url} for task {self.id} '
                                         f'within {c.timeout_s} s'))
        if not self.pushed:
          c.push(self.id, self.payload)
          self.pushed = True
        if c.redis.blpop([c.keys.done(self.id)], timeout=max(1, min(5, int(left)))):
          raw = c.redis.get(c.keys.result(self.id))
          if raw is None:
            return self._finish(nan_result(names, self.num, 'error', f'result of {self.id} expired'))
          return self._finish(decode_reply(raw, names, self.num, c.spec.bounds))
        if down_since is not None:
          logger.warning('redis %s reachable again after %.1f s; still waiting for task %s', c.url,
                         time.monotonic() - down_since, self.id)
          down_since = None
        state = c.task_state(self.id)
        if state == 'answered':              # answered, but its done signal was lost
          raw = c.redis.get(c.keys.result(self.id))
          if raw is not None:
            return self._finish(decode_reply(raw, names, self.num, c.spec.bounds))
        if state == 'lost':
          c.stats['resubmitted'] += 1
          logger.warning('reward task %s is no longer in redis %s (restarted without persistence?); '
                         'resubmitted under the same id', self.id, c.url)
          c.push(self.id, self.payload)
        elif state == 'requeued':
          c.stats['requeued'] += 1
          logger.warning('reward task %s was in no queue of redis %s; queued again', self.id, c.url)
        attempts = int(c.redis.get(f'{c.keys.ns}:attempts:{self.id}') or 0)
        if attempts > max(1, last_attempts):
          c.stats['retaken'] += 1
          logger.warning('reward task %s taken again (attempt %d): the server scoring it stopped '
                         'renewing its lease (killed?)', self.id, attempts)
        last_attempts = max(last_attempts, attempts)
        live = c.live_servers()
        now = time.monotonic()
        if live:
          no_server_since = None
          if _due(now, last_wait_log, WAIT_LOG_S):
            logger.warning('waiting %.0f s for the rewards of task %s (%s, attempt %d; %d live server(s))',
                           now - start, self.id, state, max(1, last_attempts), len(live))
            last_wait_log = now
        else:
          if no_server_since is None:
            no_server_since = last_no_server_log = now
            logger.warning('no live reward server on %s (task %s %s); start one with python -m '
                           'ddrl_jax.rewards.serve --redis=%s; this batch fails in %.0f s without one',
                           c.url, self.id, state, c.url, c.no_server_grace_s)
          elif _due(now, last_no_server_log, REDIS_DOWN_LOG_S):
            logger.warning('no live reward server on %s for %.0f s', c.url, now - no_server_since)
            last_no_server_log = now
          if now - no_server_since >= c.no_server_grace_s:
            c.redis.delete(c.keys.task(self.id))
            return self._finish(nan_result(
                names, self.num, 'no_server', f'no live reward server on {c.url} for '
                f'{now - no_server_since:.0f} s (config.reward.no_server_grace_s)'))
      except pool_lib.RewardServiceError:
        raise
      except (redis.ConnectionError, redis.TimeoutError) as e:
        now = time.monotonic()
        if down_since is None:
          down_since = last_down_log = now
          c.stats['redis_outages'] += 1
          logger.warning('redis %s unreachable (%s); waiting for it (task %s, %.0f s left)', c.url,
                         type(e).__name__, self.id, max(0.0, self.deadline - now))
        elif _due(now, last_down_log, REDIS_DOWN_LOG_S):
          logger.warning('redis %s unreachable for %.0f s', c.url, now - down_since)
          last_down_log = now
        no_server_since = None         # servers cannot be seen while Redis is down
        time.sleep(min(1.0, max(0.0, self.deadline - time.monotonic())))
