"""Score batches in reward worker processes, asynchronously, with a deadline per chunk.

`WorkerPool.submit(samples, prompts)` splits the M samples into chunks, returns a `RewardJob` at once
and scores the chunks in `num_workers` processes (`worker.py`) from a scheduler thread. Whatever a
worker does, the job finishes: a worker that dies (segfault, OOM kill, os._exit), runs past
`chunk_timeout_s` (killed), or replies with garbage (undecodable, wrong shape, not numbers) gives NaN
for that chunk's samples, a count in `RewardResult.failures`, and a fresh worker. Only a reward that
cannot be built at all (unknown name, missing package) is a `RewardServiceError`: retrying cannot fix
configuration.

`InlinePool` (num_workers=0) scores in a thread of the calling process: no process start-up, no
isolation (a crash takes the caller down, a hang is abandoned at the deadline but keeps its thread).
"""
import collections
import dataclasses
import logging
import os
import re
import subprocess
import sys
import threading
import time
from multiprocessing import connection
from typing import Dict, List

import numpy as np

from ddrl_jax.rewards import registry
from ddrl_jax.rewards import wire
from ddrl_jax.rewards import worker as worker_lib

logger = logging.getLogger(__name__)
# A chunk still being scored is reported this often, so a hung worker is never silent for its whole
# chunk timeout (120 s by default).
WAIT_LOG_S = 10.0

# Why a score entry (one sample's score of one reward) failed. The first four are about the worker (its
# whole chunk fails); the rest judge each value where it arrives (`judge_scores`): a value that is not a
# finite number in the reward's bound is never trained on as a score.
FAILURE_KINDS = ('timeout', 'crash', 'garbage', 'error', 'no_server',
                 'nan', 'inf', 'bool', 'non_numeric', 'wrong_length', 'out_of_range')
ERROR_PREFIX = re.compile(r'^samples \d+:\d+ (\w+): ')


def judge_scores(value, num, bound, count_nan=True):
  """A reply's value for one reward -> ((num,) float32 with NaN where invalid, {kind: entries}).

  A bool, non-numeric or wrongly shaped value fails all `num` entries ('bool', 'non_numeric',
  'wrong_length'); numbers are judged in float64, before any cast: NaN ('nan', unless count_nan is
  False: a Redis reply's NaN were counted by its server), +-Inf ('inf'), and finite values outside
  `bound` = (low, high) ('out_of_range', e.g. 1e30, or 1e300 that float32 would turn into inf).
  """
  a = value if isinstance(value, np.ndarray) else np.asarray(value) if isinstance(
      value, (list, tuple, int, float, np.generic)) and not isinstance(value, bool) else None
  nan = np.full((num,), np.nan, np.float32)
  if isinstance(value, bool) or (a is not None and a.dtype.kind == 'b'):
    return nan, {'bool': num}
  if a is None or a.dtype.kind not in 'iuf':
    return nan, {'non_numeric': num}
  if a.shape != (num,):
    return nan, {'wrong_length': num}
  a = a.astype(np.float64)
  is_nan, is_inf = np.isnan(a), np.isinf(a)
  low, high = bound
  out = ~is_nan & ~is_inf & ((a < low) | (a > high))
  counts = {'nan': int(is_nan.sum()) if count_nan else 0, 'inf': int(is_inf.sum()),
            'out_of_range': int(out.sum())}
  a[is_inf | out] = np.nan
  return a.astype(np.float32), {k: v for k, v in counts.items() if v}


def errors_by_kind(errors):
  """{kind: first message} of a RewardResult's errors ('samples a:b <kind>: ...'; others: 'other')."""
  out = {}
  for message in errors:
    m = ERROR_PREFIX.match(message)
    out.setdefault(m.group(1) if m else 'other', message)
  return out


class RewardServiceError(RuntimeError):
  """A reward problem that retrying cannot fix (configuration, authentication, missing package)."""


@dataclasses.dataclass
class RewardResult:
  """Scores of one submitted batch.

  scores: reward name -> (M,) float32; NaN where that reward failed for the sample.
  failures: cause (FAILURE_KINDS) -> number of failed score entries (sample x reward): with one reward,
    samples, so they add up to the trainer's failed_rewards.
  errors: human-readable messages 'samples a:b <kind>: ...', one per failed chunk and kind.
  """
  scores: Dict[str, np.ndarray]
  failures: Dict[str, int]
  errors: List[str]

  def matrix(self, names):
    """(M, R) float32 in the order of `names`."""
    return np.stack([self.scores[n] for n in names], axis=1)

  @property
  def num_failed(self):
    """Samples with at least one non-finite score."""
    return int((~np.isfinite(self.matrix(list(self.scores)))).any(axis=1).sum()) if self.scores else 0


class RewardJob:
  """Future of one batch: `done()`, `result(timeout)`. Filled in by a pool's scheduler."""

  def __init__(self, names, num, chunks, bounds=None):
    self.names = list(names)
    self.num = num
    self.bounds = {n: registry.score_bound(n, bounds) for n in self.names}
    self._unscored = num                       # samples of chunks not done yet
    self._scores = {n: np.full((num,), np.nan, np.float32) for n in self.names}
    self._failures = collections.Counter()
    self._errors = []
    self._left = len(chunks)
    self._lock = threading.Lock()
    self._event = threading.Event()
    self.cancelled = False
    self.fatal = None
    self.chunks = chunks                        # list of slices into the batch
    if not chunks:
      self._event.set()

  def set_scores(self, sl, name, values):
    with self._lock:
      self._scores[name][sl] = values

  def fail(self, sl, names, kind, message, entries=None):
    """NaN for `names` on chunk `sl`, counted as `entries` failed entries of `kind` (default: all)."""
    with self._lock:
      for n in names:
        self._scores[n][sl] = np.nan
      self._failures[kind] += (sl.stop - sl.start) * len(names) if entries is None else entries
      self._errors.append(f'samples {sl.start}:{sl.stop} {kind}: {message}')

  def count(self, sl, kind, entries, message):
    """Counts `entries` failed entries of `kind` in chunk `sl` whose scores are already NaN."""
    with self._lock:
      self._failures[kind] += entries
      self._errors.append(f'samples {sl.start}:{sl.stop} {kind}: {message}')

  def chunk_done(self, sl=None):
    with self._lock:
      self._left -= 1
      self._unscored -= 0 if sl is None else sl.stop - sl.start
      if self._left <= 0:
        self._event.set()

  def abort(self, error):
    """Configuration failure: `result()` raises `RewardServiceError(error)`."""
    self.fatal = error
    self._event.set()

  def done(self):
    return self._event.is_set()

  def result(self, timeout=None):
    """Waits up to `timeout` s (None: forever); chunks still unscored then are NaN and count as timeouts."""
    finished = self._event.wait(timeout)
    if self.fatal is not None:
      raise RewardServiceError(self.fatal)
    with self._lock:
      failures, errors = collections.Counter(self._failures), list(self._errors)
      if not finished:
        self.cancelled = True
        failures['timeout'] += max(self._unscored, self._left) * len(self.names)
        errors.append(f'{self._left} chunk(s) still unscored after {timeout} s')
        for n in self.names:   # chunks in flight must not change the result after we return it
          self._scores[n] = self._scores[n].copy()
      scores = {n: v.copy() for n, v in self._scores.items()}
    return RewardResult(scores=scores, failures={k: failures.get(k, 0) for k in FAILURE_KINDS},
                        errors=errors)


def new_job(specs, samples, prompts, names, chunk_size, bounds=None):
  """A `RewardJob` over (M, ...) `samples` and M `prompts` (kept on the job), in chunks."""
  samples = np.asarray(samples)
  if len(prompts) != samples.shape[0]:
    raise ValueError(f'{len(prompts)} prompts for {samples.shape[0]} samples')
  names = list(specs) if names is None else list(names)
  job = RewardJob(names, samples.shape[0], split_chunks(samples.shape[0], chunk_size), bounds)
  job.samples, job.prompts = samples, [str(p) for p in prompts]
  return job


def split_chunks(num, chunk_size):
  return [slice(s, min(s + chunk_size, num)) for s in range(0, num, max(1, chunk_size))]


def apply_reply(job, sl, reply, num, count_nan=True):
  """Records a worker's reply map for chunk `sl` of `job`, judging every value (`judge_scores`: anything
  but finite numbers in the reward's bound is NaN and counted by kind)."""
  errors, scores = reply.get('errors') or {}, reply.get('scores') or {}
  if not isinstance(errors, dict) or not isinstance(scores, dict):
    job.fail(sl, job.names, 'garbage', f'reply is not a map of scores: {str(reply)[:120]}')
    return
  for name in job.names:
    if name in errors or '*' in errors:
      job.fail(sl, [name], 'error', f'{name}: {errors.get(name, errors.get("*"))}')
      continue
    values, bad = judge_scores(scores.get(name), num, job.bounds[name], count_nan)
    job.set_scores(sl, name, values)
    for kind, entries in bad.items():
      job.count(sl, kind, entries, f'{name}: {entries} of {num} scores {KIND_WORDS[kind]} '
                                   f'(bound {job.bounds[name]})' if kind == 'out_of_range' else
                f'{name}: {entries} of {num} scores {KIND_WORDS[kind]}')


KIND_WORDS = {'nan': 'are NaN', 'inf': 'are infinite', 'bool': 'are booleans, not numbers',
              'non_numeric': 'are not numbers', 'wrong_length': 'do not have one value per sample',
              'out_of_range': 'are outside the reward\'s bound'}


@dataclasses.dataclass
class _Worker:
  proc: subprocess.Popen
  inbox: connection.Connection        # the parent reads replies here
  outbox: connection.Connection       # the parent writes chunks here
  state: str = 'starting'             # 'starting' | 'idle' | 'busy'
  deadline: float = 0.0
  task: tuple = None                  # (job, slice) while busy
  next_log: float = float('inf')      # when a busy worker's 'still scoring' line is due


class WorkerPool:
  """`num_workers` reward processes fed by a scheduler thread (see the module docstring)."""

  def __init__(self, specs, num_workers, *, chunk_timeout_s=120.0, start_timeout_s=120.0,
               imports=(), env=None):
    if num_workers < 1:
      raise ValueError(f'WorkerPool needs num_workers >= 1, got {num_workers} (use InlinePool)')
    self.specs = {n: dict(kw or {}) for n, kw in specs.items()}
    self.imports = list(imports)
    self.num_workers = num_workers
    self.chunk_timeout_s, self.start_timeout_s = chunk_timeout_s, start_timeout_s
    self.env = dict(os.environ, OMP_THREAD_LIMIT='1', **(env or {}))
    self.stats = collections.Counter()          # workers started / killed / crashed
    self.fatal = None
    self._queue = collections.deque()           # (job, slice) awaiting a worker
    self._workers = []
    self._lock = threading.Lock()
    self._wake_r, self._wake_w = connection.Pipe(duplex=False)
    self._stop = False
    self._thread = None
    self._start_failures = 0                    # consecutive workers that died before 'ready'

  # ---------------------------------------------------------------------------------- public
  def submit(self, samples, prompts, names=None, chunk_size=16, bounds=None):
    """Queues (M, ...) host `samples` with M `prompts`; returns a `RewardJob` immediately. `bounds`:
    {name: (low, high)} over the registry's score bounds."""
    job = new_job(self.specs, samples, prompts, names, chunk_size, bounds)
    if self.fatal:
      job.abort(self.fatal)
      return job
    with self._lock:
      self._queue.extend((job, sl) for sl in job.chunks)
      if self._thread is None:
        self._thread = threading.Thread(target=self._loop, name='reward-pool', daemon=True)
        self._thread.start()
    self._wake_w.send_bytes(b'.')
    return job

  def close(self):
    self._stop = True
    self._wake_w.send_bytes(b'.')
    if self._thread is not None:
      self._thread.join(timeout=10)
    for w in list(self._workers):
      self._kill(w)
    self._workers = []

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ------------------------------------------------------------------------------- scheduler
  def _spawn(self):
    parent_in, child_out = os.pipe()
    child_in, parent_out = os.pipe()
    cmd = [sys.executable, '-c', 'import sys; from ddrl_jax.rewards import worker; sys.exit(worker.main())',
           f'--read_fd={child_in}', f'--write_fd={child_out}']
    proc = subprocess.Popen(cmd, pass_fds=(child_in, child_out), env=self.env,
                            stdin=subprocess.DEVNULL)
    os.close(child_in)
    os.close(child_out)
    w = _Worker(proc=proc, inbox=connection.Connection(parent_in, writable=False),
                outbox=connection.Connection(parent_out, readable=False),
                deadline=time.monotonic() + self.start_timeout_s)
    w.outbox.send_bytes(wire.pack({'specs': self.specs, 'imports': self.imports}))
    self.stats['started'] += 1
    self._workers.append(w)

  def _kill(self, w):
    if w.proc.poll() is None:
      w.proc.kill()
    w.proc.wait()
    w.inbox.close()
    w.outbox.close()

  def _replace(self, w, kind, message):
    """Kills `w`, fails its chunk with `kind`, and lets the loop start a replacement."""
    self._kill(w)
    self._workers.remove(w)
    self.stats[kind] += 1
    if w.state == 'starting':
      self._start_failures += 1
      if self._start_failures >= 3:
        self._abort_all(f'3 reward workers in a row failed to start; last: {message}')
        return
    if w.task is not None:
      job, sl = w.task
      job.fail(sl, job.names, kind, message)
      job.chunk_done(sl)
    logger.warning('reward worker pid %d: %s', w.proc.pid, message)

  def _abort_all(self, error):
    self.fatal = error
    with self._lock:
      jobs = {id(j): j for j, _ in self._queue}
      self._queue.clear()
    jobs.update({id(w.task[0]): w.task[0] for w in self._workers if w.task})
    for job in jobs.values():
      job.abort(error)
    for w in list(self._workers):
      self._kill(w)
    self._workers = []

  def _dispatch(self):
    for w in self._workers:
      if w.state != 'idle':
        continue
      with self._lock:
        while self._queue and self._queue[0][0].cancelled:
          job, sl = self._queue.popleft()
          job.chunk_done(sl)
        if not self._queue:
          return
        job, sl = self._queue.popleft()
      try:
        w.outbox.send_bytes(wire.pack({'samples': job.samples[sl], 'prompts': job.prompts[sl],
                                       'names': job.names}))
      except (OSError, ValueError) as e:
        w.task = (job, sl)
        self._replace(w, 'crash', f'could not send a chunk: {e}')
        return
      w.state, w.task = 'busy', (job, sl)
      w.deadline = time.monotonic() + self.chunk_timeout_s
      w.next_log = time.monotonic() + WAIT_LOG_S

  def _receive(self, w):
    try:
      raw = w.inbox.recv_bytes()
    except (EOFError, OSError):
      code = w.proc.wait()
      what = 'while starting' if w.state == 'starting' else 'while scoring'
      self._replace(w, 'crash', f'exited with code {code} {what}')
      return
    try:
      reply = wire.unpack(raw, required=('kind',))
    except wire.WireError as e:
      self._replace(w, 'garbage', f'undecodable reply: {e}')
      return
    if reply['kind'] == 'fatal':
      self._abort_all(f'cannot build rewards {sorted(self.specs)}: {reply.get("error")}')
    elif reply['kind'] == 'ready':
      w.state = 'idle'
      self._start_failures = 0
    elif w.task is not None:
      job, sl = w.task
      apply_reply(job, sl, reply, sl.stop - sl.start)
      job.chunk_done(sl)
      w.state, w.task = 'idle', None

  def _loop(self):
    try:
      self._run()
    except Exception as e:  # a scheduler bug must fail the jobs, not leave them pending forever
      logger.exception('reward pool scheduler failed')
      self._abort_all(f'reward pool scheduler failed: {type(e).__name__}: {e}')

  def _run(self):
    while not self._stop:
      while len(self._workers) < self.num_workers and not self.fatal:
        self._spawn()
      self._dispatch()
      now = time.monotonic()
      busy = [w.deadline for w in self._workers if w.state != 'idle']
      busy += [w.next_log for w in self._workers if w.state == 'busy']
      timeout = max(0.0, min(busy) - now) if busy else None
      ready = connection.wait([self._wake_r] + [w.inbox for w in self._workers], timeout)
      for obj in ready:
        if obj is self._wake_r:
          while self._wake_r.poll():
            self._wake_r.recv_bytes()
          continue
        w = next((w for w in self._workers if w.inbox is obj), None)
        if w is not None:
          self._receive(w)
      now = time.monotonic()
      for w in [w for w in self._workers if w.state != 'idle' and w.deadline <= now]:
        limit = self.start_timeout_s if w.state == 'starting' else self.chunk_timeout_s
        self._replace(w, 'timeout', f'no reply within {limit} s (killed)')
      for w in [w for w in self._workers if w.state == 'busy' and w.next_log <= now]:
        started = w.deadline - self.chunk_timeout_s
        logger.warning('reward worker pid %d: still scoring a chunk of %d sample(s) after %.0f s (killed at '
                       '%.0f s, chunk_timeout_s)', w.proc.pid, len(w.task[0].samples[w.task[1]]),
                       now - started, self.chunk_timeout_s)
        w.next_log = now + WAIT_LOG_S


class InlinePool:
  """The WorkerPool interface scored in one background thread of this process (no isolation)."""

  def __init__(self, specs, *, imports=(), extra_kwargs=None):
    """extra_kwargs: {name: kwargs} added when building those rewards (objects a config cannot hold,
    e.g. the trainer's device mesh for in-process JAX rewards)."""
    self.specs = {n: dict(kw or {}) for n, kw in specs.items()}
    built = {n: dict(kw, **(extra_kwargs or {}).get(n, {})) for n, kw in self.specs.items()}
    self.rewards = worker_lib.build_rewards(built, list(imports))
    self.stats = collections.Counter()

  def submit(self, samples, prompts, names=None, chunk_size=16, bounds=None):
    job = new_job(self.specs, samples, prompts, names, chunk_size, bounds)

    def run():
      for sl in job.chunks:
        if job.cancelled:
          job.chunk_done(sl)
          continue
        message = {'samples': job.samples[sl], 'prompts': job.prompts[sl], 'names': job.names}
        apply_reply(job, sl, worker_lib.score_chunk(self.rewards, message), sl.stop - sl.start)
        job.chunk_done(sl)

    threading.Thread(target=run, name='reward-inline', daemon=True).start()
    return job

  def close(self):
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
