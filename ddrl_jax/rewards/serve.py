"""A reward server: ``python -m ddrl_jax.rewards.serve --redis=redis://HOST:6379/0``.

Start any number of them, on any hosts that reach the Redis server; they share the task queue (see
redis_backend.py for the protocol). Each one scores in its own `pool.WorkerPool`, so a reward worker
that crashes, hangs or returns garbage costs NaN scores for its chunk, never the server. The bearer
token comes from --token or the environment variable DDRL_REWARD_TOKEN and is checked on every task.
A server restarted after a crash resumes the queue, and tasks it held are requeued when their leases
expire. A Redis outage of any length does not stop a server: it logs one line when Redis becomes
unreachable and one when it is back, retries with backoff (up to 5 s apart) meanwhile, and keeps its
loaded reward models and the tasks it is scoring; their replies are sent once Redis answers again.
"""
import collections
import hmac
import json
import logging
import os
import socket
import time

from absl import flags
import numpy as np

from ddrl_jax import cli
from ddrl_jax import console
from ddrl_jax.rewards import pool as pool_lib
from ddrl_jax.rewards import redis_backend
from ddrl_jax.rewards import registry
from ddrl_jax.rewards import wire

logger = logging.getLogger('ddrl_jax.rewards.serve')   # not __name__: '__main__' under python -m

_REDIS = flags.DEFINE_string('redis', 'redis://localhost:6379/0', 'Redis URL of the task queue.')
_TOKEN = flags.DEFINE_string('token', None, 'Bearer token; default: $DDRL_REWARD_TOKEN.')
_WORKERS = flags.DEFINE_integer('workers', 2, 'Reward worker processes per reward spec.')
_CHUNK_TIMEOUT = flags.DEFINE_float('chunk_timeout', 120.0, 'Seconds a worker may take per chunk.')
_LEASE = flags.DEFINE_float('lease', 30.0, 'Seconds before an unrenewed task is requeued.')
_MAX_ATTEMPTS = flags.DEFINE_integer('max_attempts', 3, 'Takes of one task before it gets NaN.')
_MAX_INFLIGHT = flags.DEFINE_integer('max_inflight', 4, 'Tasks scored at once by this server.')
_NAME = flags.DEFINE_string('name', None, 'Server name (default: host:pid).')
_IMPORTS = flags.DEFINE_list('imports', [], 'Modules registering custom rewards tasks may use.')
_NAMESPACE = flags.DEFINE_string('namespace', redis_backend.DEFAULT_NAMESPACE, 'Redis key prefix.')
_MAX_TASKS = flags.DEFINE_integer('max_tasks', 0, 'Exit after this many tasks (0: never; tests).')


MIN_BACKOFF_S, MAX_BACKOFF_S = 0.25, 5.0


class RewardServer:
  """The serving loop; `step()` does one round (take, check finished, renew, reap, heartbeat)."""

  def __init__(self, redis_client, token, *, workers=2, chunk_timeout_s=120.0, lease_s=30.0,
               max_attempts=3, max_inflight=4, name=None, imports=(),
               namespace=redis_backend.DEFAULT_NAMESPACE, max_pools=4, url=''):
    if not token:
      raise ValueError('the reward server needs a bearer token (--token or $DDRL_REWARD_TOKEN)')
    self.r, self.token = redis_client, token
    self.keys = redis_backend.Keys(namespace)
    self.workers, self.chunk_timeout_s = workers, chunk_timeout_s
    self.lease_ms = int(lease_s * 1000)
    self.max_attempts, self.max_inflight, self.max_pools = max_attempts, max_inflight, max_pools
    self.name = name or f'{socket.gethostname()}:{os.getpid()}'
    self.imports = list(imports)
    registry.import_modules(self.imports)
    self.take = self.r.register_script(redis_backend.TAKE_LUA)
    self.reap = self.r.register_script(redis_backend.REAP_LUA)
    self.pools = collections.OrderedDict()     # reward spec JSON -> WorkerPool (LRU)
    self.inflight = {}                         # task id -> RewardJob
    self.outbox = {}                           # task id -> reply not yet delivered (Redis was down)
    self.url = url
    self.counts = collections.Counter()
    self._last_renew = self._last_reap = self._last_beat = 0.0

  # -------------------------------------------------------------------------------- replies
  def reply(self, task_id, message):
    pipe = self.r.pipeline()
    pipe.set(self.keys.result(task_id), wire.pack(dict(message, id=task_id, server=self.name)),
             ex=3600)
    pipe.lpush(self.keys.done(task_id), 1)
    pipe.expire(self.keys.done(task_id), 3600)
    pipe.lrem(self.keys.processing, 0, task_id)
    pipe.delete(self.keys.lease(task_id), self.keys.task(task_id))
    pipe.execute()

  def reject(self, task_id, code, error):
    self.counts[f'rejected_{code}'] += 1
    logger.warning('task %s rejected (%d): %s', task_id, code, error)
    self.reply(task_id, {'error': error, 'code': code})

  # ----------------------------------------------------------------------------------- tasks
  def pool_for(self, kwargs):
    key = json.dumps(kwargs, sort_keys=True)
    if key not in self.pools:
      if len(self.pools) >= self.max_pools:
        self.pools.popitem(last=False)[1].close()
      self.pools[key] = pool_lib.WorkerPool(kwargs, self.workers, chunk_timeout_s=self.chunk_timeout_s,
                                            imports=self.imports)
    self.pools.move_to_end(key)
    return self.pools[key]

  def start(self, task_id, attempts):
    """Checks and starts one taken task, or answers it at once when it cannot be scored."""
    if task_id in self.inflight or self.r.exists(self.keys.result(task_id)):
      # A client resubmitted a task this server is scoring, or one already answered (after a Redis
      # restart lost its queue entry): the id is the task's identity, so it is scored once.
      self.r.lrem(self.keys.processing, 0, task_id)
      self.counts['skipped_duplicate'] += 1
      return
    raw = self.r.get(self.keys.task(task_id))
    if raw is None:                     # cancelled by its client, or expired
      self.r.lrem(self.keys.processing, 0, task_id)
      self.r.delete(self.keys.lease(task_id))
      self.counts['skipped_cancelled'] += 1
      return
    try:
      task = wire.unpack(raw, required=('auth', 'names', 'kwargs', 'samples', 'prompts'))
    except wire.WireError as e:
      self.reject(task_id, 400, f'malformed request: {e}')
      return
    if not isinstance(task['auth'], str) or not hmac.compare_digest(
        task['auth'].encode(), f'Bearer {self.token}'.encode()):
      self.reject(task_id, 401, 'invalid bearer token')
      return
    names, samples, prompts = task['names'], task['samples'], task['prompts']
    problem = self.validate(task)
    if problem:
      self.reject(task_id, 400, f'malformed request: {problem}')
      return
    if attempts > self.max_attempts:
      self.counts['gave_up'] += 1
      msg = (f'samples 0:{len(prompts)} crash: gave up after {attempts - 1} attempts (the servers '
             'scoring it died)')
      self.reply(task_id, {'scores': {n: np.full(len(prompts), np.nan, np.float32) for n in names},
                           'failures': {'crash': len(prompts) * len(names)}, 'errors': [msg]})
      return
    try:
      job = self.pool_for(task['kwargs']).submit(samples, prompts, names,
                                                 int(task.get('chunk_size') or 16), task.get('bounds'))
    except Exception as e:  # e.g. an unknown reward name in kwargs
      self.reject(task_id, 400, f'cannot score: {type(e).__name__}: {e}')
      return
    self.inflight[task_id] = job

  def validate(self, task):
    names, kwargs, samples, prompts = task['names'], task['kwargs'], task['samples'], task['prompts']
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not names:
      return 'names must be a non-empty list of reward names'
    if not isinstance(kwargs, dict) or set(names) - set(kwargs):
      return 'kwargs must map every requested reward name to its arguments'
    unknown = [n for n in names if n not in registry.known_rewards()]
    if unknown:
      return f'unknown rewards {unknown}; this server knows {registry.known_rewards()}'
    missing = sorted(set(task.get('imports') or []) - set(self.imports))
    if missing:
      return f'this server does not import {missing} (start it with --imports)'
    if not isinstance(samples, np.ndarray) or samples.ndim < 1:
      return 'samples must be an .npy array with a batch axis'
    if not isinstance(prompts, list) or len(prompts) != samples.shape[0]:
      return f'need one prompt per sample ({samples.shape[0]})'
    return None

  def finish(self):
    """Replies for every finished task; a reply Redis did not take stays in the outbox (and the task in
    flight) for the next round."""
    for task_id, job in list(self.inflight.items()):
      if not job.done():
        continue
      if task_id not in self.outbox:
        try:
          result = job.result(0)
          self.outbox[task_id] = {'scores': result.scores, 'failures': result.failures,
                                  'errors': result.errors}
        except pool_lib.RewardServiceError as e:
          self.outbox[task_id] = {'error': str(e), 'code': 500}
      self.reply(task_id, self.outbox[task_id])
      del self.inflight[task_id], self.outbox[task_id]
      self.counts['answered'] += 1

  # ------------------------------------------------------------------------------------ loop
  def step(self, idle_sleep=0.02):
    now = time.monotonic()
    if now - self._last_beat > 2.0:
      self.r.set(self.keys.server(self.name), json.dumps(dict(self.counts)), ex=10)
      self._last_beat = now
    if now - self._last_renew > self.lease_ms / 3000.0:
      for task_id in self.inflight:
        self.r.pexpire(self.keys.lease(task_id), self.lease_ms)
      self._last_renew = now
    if now - self._last_reap > 1.0:
      moved = self.reap(keys=[self.keys.queue, self.keys.processing], args=[self.keys.ns])
      if moved:
        logger.warning('requeued %d task(s) whose server stopped renewing its lease', moved)
        self.counts['requeued'] += moved
      self._last_reap = now
    took = False
    if len(self.inflight) < self.max_inflight:
      taken = self.take(keys=[self.keys.queue, self.keys.processing],
                        args=[self.keys.ns, self.name, self.lease_ms, 86400])
      if taken:
        took = True
        self.start(taken[0].decode(), int(taken[1]))
    self.finish()
    if not took:
      time.sleep(idle_sleep)

  def serve(self, max_tasks=0):
    logger.info('reward server %s serving %s', self.name, self.keys.ns)
    import redis  # pylint: disable=g-import-not-at-top
    outage, delay = None, MIN_BACKOFF_S
    try:
      while not max_tasks or self.counts['answered'] + sum(
          v for k, v in self.counts.items() if k.startswith('rejected')) < max_tasks:
        try:
          self.step()
        except (redis.ConnectionError, redis.TimeoutError) as e:
          if outage is None:
            outage = time.monotonic()
            self.counts['redis_outages'] += 1
            logger.warning('redis %s unreachable (%s); keeping %d loaded reward pool(s) and %d task(s) '
                           'in flight, retrying until it is back', self.url or self.keys.ns,
                           type(e).__name__, len(self.pools), len(self.inflight))
          time.sleep(delay)
          delay = min(2 * delay, MAX_BACKOFF_S)
          continue
        if outage is not None:
          logger.warning('redis %s reachable again after %.1f s; %d task(s) in flight, %d reply(ies) '
                         'to deliver', self.url or self.keys.ns, time.monotonic() - outage,
                         len(self.inflight), len(self.outbox))
          outage, delay = None, MIN_BACKOFF_S
    finally:
      self.close()

  def close(self):
    for p in self.pools.values():
      p.close()
    try:
      self.r.delete(self.keys.server(self.name))
    except Exception:  # pylint: disable=broad-except  (Redis gone: the heartbeat expires by itself)
      pass


def main(argv):
  del argv
  console.setup()
  token = _TOKEN.value or os.environ.get('DDRL_REWARD_TOKEN', '')
  server = RewardServer(redis_backend.connect(_REDIS.value), token, workers=_WORKERS.value,
                        chunk_timeout_s=_CHUNK_TIMEOUT.value, lease_s=_LEASE.value,
                        max_attempts=_MAX_ATTEMPTS.value, max_inflight=_MAX_INFLIGHT.value,
                        name=_NAME.value, imports=_IMPORTS.value, namespace=_NAMESPACE.value,
                        url=_REDIS.value)
  server.serve(_MAX_TASKS.value)


if __name__ == '__main__':
  cli.run(main)
