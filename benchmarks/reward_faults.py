"""The reward service under injected faults (issue 44 item 5): is every fault counted by the right failure
kind, is any iteration lost, and how long does anyone wait without a log line about it?

  python benchmarks/reward_faults.py                        # 100 trials of each client-level kind, ...
  python benchmarks/reward_faults.py --trials=3 --trainer_trials=1 --out=/tmp/quick.jsonl
  python benchmarks/reward_faults.py --kinds=redis/worker_crash,local/nan --trials=10
  python benchmarks/reward_faults.py --report               # the table of what benchmarks/reward_faults.jsonl holds

Everything runs on loopback: one redis-server (empty on every restart: no persistence, the worst case) and
two `python -m ddrl_jax.rewards.serve` processes (--workers=2 --chunk_timeout=5 --lease=1.5, so that a
trial takes seconds), plus a second Redis with two servers on the serve.py defaults (chunk_timeout 120 s,
lease 30 s) for the `redis_defaults/*` kinds, which show the silent waits a deployment with the defaults
has (few trials: they take minutes).

Kinds (`--kinds`, default all):
  redis/<fault>, local/<fault>  client level: one batch of 8 samples, chunk_size 2 (4 chunks), one reward;
      <fault> in worker_crash (debug_crash: os._exit), worker_hang (debug_sleep 60 s past the 5 s chunk
      timeout), garbage (debug_garbage cycling shape/strings/nested/bool/inf/huge/huge64), nan
      (debug_garbage nan). The trigger prompt is on the 2 samples of one chunk (which one cycles with the
      trial); the trial checks that exactly those 2 entries are NaN and counted as the expected kind,
      nothing else is counted, and the other 6 scores are right.
  redis/server_kill9  kill -9 of the server holding an in-flight task (debug_sleep 1 s per chunk, 4 chunks
      over 2 workers) while the second server is alive: the task must be requeued and rescored in full
      (attempts = 2).
      The killed server is restarted before the next trial.
  redis/redis_restart_1s, redis/redis_restart_30s  redis-server killed (-9) while a server scores the task
      (debug_sleep 1 s per chunk, about 2 s) and started again empty after 1 s / 30 s: the batch must be
      scored in full.
  redis/wrong_token  a client with another token: RewardServiceError naming the bearer token, no hang.
  redis_defaults/worker_hang, redis_defaults/server_kill9  as above, on the serve.py defaults.
  trainer/<fault>  toy2d over the Redis service for 4 iterations (batch 32 groups x 8 rollouts = 256 samples,
      chunk_size 8), the fault armed at iteration 2 from the trainer's event hooks: worker faults through
      the trigger prompt on group 0 (its 8 samples = one chunk; reward fns linear + the debug reward), the
      infrastructure faults (server_kill9, redis_restart_1s/30s: reward linear + debug_sleep 0.25 s per
      chunk of 64, so the task is in flight) from a thread started by the 'rewards_submitted' hook;
      wrong_token: the trainer must stop at start with the RewardServiceError.

Per trial (one JSON line in --out, appended as it finishes; a rerun skips the (kind, trial) pairs there, so
the benchmark spans sessions):
  injected: samples the fault hit (worker faults: the trigger chunk's 2 / 8 samples; server kill, Redis
    restart, wrong token: the batch's samples).
  counted: samples accounted for correctly: counted under the expected failure kind (entries / rewards
    failed) for worker faults; scored in full after the recovery for kill -9 and Redis restarts; the batch
    rejected with a RewardServiceError naming the token for wrong_token. miscount: counted != injected, or
    any other failure kind counted, or a score outside the fault wrong.
  iterations_lost (trainer): iterations without a metrics row, or with every sample's reward NaN
    (failed_rewards = 256), or a run that did not end; a client-level trial whose wait never ends (120 s
    past the expected duration) counts 1.
  silent_max_s: the fault lasts from the injection (the submission for trigger faults, the kill for kill -9
    and Redis restarts) to the end of the wait (the client's result, or the trainer's 'rewards_ready'); the
    WARNING lines logged meanwhile by the trainer/client side (a logging handler on 'ddrl_jax') and by the
    servers (their stderr, time-stamped on arrival) cut that interval; silent_max_s is its longest piece,
    first_log_s the time from the injection to the first line (null: none before the wait ended).
"""
import argparse
import collections
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

OUT = os.path.join(ROOT, 'benchmarks', 'reward_faults.jsonl')
TOKEN = 'fault-bench-token'
TOKEN_ENV = 'DDRL_FAULT_BENCH_TOKEN'
IMAGES = np.random.RandomState(44).randint(0, 255, (8, 6, 6, 3), dtype=np.uint8)
EXPECTED = IMAGES.reshape(8, -1).astype(np.float32).mean(-1) / 255
SHORT = dict(workers=2, chunk_timeout=5, lease=1.5)      # server flags of the main environment
DEFAULTS = dict(workers=2)                               # serve.py defaults otherwise
GARBAGE = [('shape', 'wrong_length'), ('strings', 'non_numeric'), ('nested', 'wrong_length'),
           ('bool', 'bool'), ('inf', 'inf'), ('huge', 'out_of_range'), ('huge64', 'out_of_range')]
WORKER_FAULTS = ('worker_crash', 'worker_hang', 'garbage', 'nan')
KINDS = ([f'redis/{f}' for f in WORKER_FAULTS] + ['redis/server_kill9', 'redis/redis_restart_1s',
                                                  'redis/redis_restart_30s', 'redis/wrong_token']
         + [f'local/{f}' for f in WORKER_FAULTS]
         + ['redis_defaults/worker_hang', 'redis_defaults/server_kill9']
         + [f'trainer/{f}' for f in WORKER_FAULTS]
         + ['trainer/server_kill9', 'trainer/redis_restart_1s', 'trainer/redis_restart_30s',
            'trainer/wrong_token'])
TRAINER_RUN_LIMIT_S = 1200.0   # a trainer/* run still going after this is 'hung' (an iteration lost)
DEFAULTS_TRIALS = 3          # cap of the redis_defaults/* kinds (minutes each)

logger = logging.getLogger('reward_faults')


# ---------------------------------------------------------------------------------------------- logs
class Captured(logging.Handler):
  """WARNING+ records of the trainer/client side ('ddrl_jax' loggers) with their wall-clock times."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.lines = []            # (time.time(), source, text)
    self.mu = threading.Lock()   # not self.lock: Handler.handle holds that around emit

  def emit(self, record):
    with self.mu:
      self.lines.append((record.created, 'client', record.getMessage()[:300]))

  def add(self, t, source, text):
    with self.mu:
      self.lines.append((t, source, text))

  def between(self, t0, t1):
    with self.mu:
      return sorted(l for l in self.lines if t0 < l[0] <= t1)


CAPTURE = Captured()


def silence(t_inj, t_end, lines):
  """(longest interval of [t_inj, t_end] without a line, time to the first line or None)."""
  times = [t for t, _, _ in lines if t_inj < t <= t_end]
  edges = [t_inj] + times + [max(t_end, t_inj)]
  gaps = [b - a for a, b in zip(edges, edges[1:])]
  return round(max(gaps), 3), (round(times[0] - t_inj, 3) if times else None)


# ------------------------------------------------------------------------------------- infrastructure
class Redis:
  """redis-server on a loopback port, killed (-9) and started again empty."""

  def __init__(self):
    import portpicker  # pylint: disable=g-import-not-at-top
    self.binary = shutil.which('redis-server')
    if not self.binary:
      raise SystemExit('redis-server is not installed')
    self.port = portpicker.pick_unused_port()
    self.url = f'redis://127.0.0.1:{self.port}/0'
    self.proc = None
    self.start()

  def start(self):
    from ddrl_jax.rewards import redis_backend  # pylint: disable=g-import-not-at-top
    self.proc = subprocess.Popen([self.binary, '--port', str(self.port), '--save', '', '--appendonly',
                                  'no', '--bind', '127.0.0.1'], stdout=subprocess.DEVNULL)
    client = redis_backend.connect(self.url)
    for _ in range(400):
      try:
        client.ping()
        client.close()
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


class Env:
  """A Redis and two reward servers (s0, s1) whose stderr lines are captured with arrival times."""

  def __init__(self, name, flags, logdir):
    from ddrl_jax.rewards import redis_backend  # pylint: disable=g-import-not-at-top
    self.name, self.flags, self.logdir = name, flags, logdir
    self.redis = Redis()
    self.r = redis_backend.connect(self.redis.url)
    self.keys = redis_backend.Keys()
    self.servers = {}
    for s in ('s0', 's1'):
      self.start_server(s)
    self.wait_live(2)

  def start_server(self, name):
    cmd = [sys.executable, '-m', 'ddrl_jax.rewards.serve', f'--redis={self.redis.url}', f'--token={TOKEN}',
           f'--name={self.name}-{name}'] + [f'--{k}={v}' for k, v in self.flags.items()]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    log = open(os.path.join(self.logdir, f'{self.name}-{name}.log'), 'a')

    def read():
      for line in proc.stdout:
        t = time.time()
        log.write(f'{t:.3f} {line}')
        log.flush()
        if line[:1] in 'WEF' and line[1:2].isdigit():        # absl: W1206 hh:mm:ss.micros pid file:line]
          CAPTURE.add(t, f'{self.name}-{name}', line.split('] ', 1)[-1].strip()[:300])
    threading.Thread(target=read, daemon=True).start()
    self.servers[name] = proc

  def live(self):
    try:
      return [k.decode() for k in self.r.scan_iter(match=self.keys.server('*'))]
    except Exception:  # pylint: disable=broad-except
      return []

  def wait_live(self, n, timeout=60):
    deadline = time.monotonic() + timeout
    while len(self.live()) < n:
      if time.monotonic() > deadline:
        raise RuntimeError(f'{self.name}: only {self.live()} live servers after {timeout} s')
      time.sleep(0.1)

  def ensure(self):
    """Both servers running (a killed one restarted) and seen live; Redis up."""
    if self.redis.proc.poll() is not None:
      self.redis.start()
    for name, proc in list(self.servers.items()):
      if proc.poll() is not None:
        self.start_server(name)
    self.wait_live(2)

  def holder(self, task_id, timeout=30):
    """Name of the server holding `task_id`'s lease (waits until one takes it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      v = self.r.get(self.keys.lease(task_id))
      if v:
        return v.decode()
      time.sleep(0.01)
    return None

  def close(self):
    for p in self.servers.values():
      if p.poll() is None:
        p.kill()
      p.wait()
    self.redis.kill()


class Bench:
  def __init__(self, logdir):
    self.logdir = logdir
    self.envs = {}
    self.clients = {}
    self.local = {}

  def env(self, name):
    if name not in self.envs:
      self.envs[name] = Env(name, SHORT if name == 'main' else DEFAULTS, self.logdir)
    e = self.envs[name]
    e.ensure()
    return e

  def client(self, env, fns, kwargs, token=TOKEN, timeout_s=120.0):
    key = (env.name, json.dumps([fns, kwargs], sort_keys=True), token, timeout_s)
    if key not in self.clients:
      from ddrl_jax import rewards  # pylint: disable=g-import-not-at-top
      os.environ[TOKEN_ENV] = token
      self.clients[key] = rewards.make_reward_service(reward_config(fns, kwargs, 'redis', env.redis.url,
                                                                    timeout_s=timeout_s))
      os.environ[TOKEN_ENV] = TOKEN
    return self.clients[key]

  def local_service(self, fns, kwargs):
    key = json.dumps([fns, kwargs], sort_keys=True)
    if key not in self.local:
      from ddrl_jax import rewards  # pylint: disable=g-import-not-at-top
      self.local[key] = rewards.make_reward_service(reward_config(fns, kwargs, 'local'))
    return self.local[key]

  def close(self):
    for s in list(self.local.values()) + list(self.clients.values()):
      try:
        s.close()
      except Exception:  # pylint: disable=broad-except
        pass
    for e in self.envs.values():
      e.close()


def reward_config(fns, kwargs, backend, url='', timeout_s=120.0, chunk_size=2):
  import ml_collections  # pylint: disable=g-import-not-at-top
  return ml_collections.ConfigDict(dict(
      fns=fns, kwargs=kwargs, combine='advantage_mean', imports=(), backend=backend, workers=2,
      chunk_size=chunk_size, chunk_timeout_s=5.0, timeout_s=timeout_s, redis_url=url, token_env=TOKEN_ENV,
      retries=2, task_ttl_s=600, max_failed_batches=3, no_server_grace_s=60.0))


def in_thread(fn, timeout):
  """fn() in a thread: ('ok', value) / ('raised', exception) / ('hung', None) after `timeout` s."""
  got = {}

  def run():
    try:
      got['value'] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      got['error'] = e
    got['t'] = time.time()
  th = threading.Thread(target=run, daemon=True)
  th.start()
  th.join(timeout)
  if th.is_alive():
    return 'hung', None, time.time()
  if 'error' in got:
    return 'raised', got['error'], got['t']
  return 'ok', got['value'], got['t']


# ------------------------------------------------------------------------------------ worker faults
def worker_fault(fault, trial):
  """(reward name, kwargs, expected failure kind, trigger, detail) of a worker fault."""
  if fault == 'worker_crash':
    return 'debug_crash', {'trigger': 'CRASH'}, 'crash', 'CRASH', 'os._exit(13)'
  if fault == 'worker_hang':
    return 'debug_sleep', {'seconds': 300.0, 'trigger': 'HANG'}, 'timeout', 'HANG', 'sleep 300 s'
  if fault == 'garbage':
    g, kind = GARBAGE[trial % len(GARBAGE)]
    return 'debug_garbage', {'kind': g, 'trigger': 'GARB'}, kind, 'GARB', f'garbage {g}'
  if fault == 'nan':
    return 'debug_garbage', {'kind': 'nan', 'trigger': 'GARB'}, 'nan', 'GARB', 'garbage nan'
  raise ValueError(fault)


def judge(result, name, expected_kind, bad, num_rewards=1):
  """Counts of a worker-fault result: (counted samples, miscount reasons)."""
  problems = []
  failures = {k: v for k, v in result.failures.items() if v}
  counted = failures.get(expected_kind, 0) / num_rewards
  others = {k: v for k, v in failures.items() if k != expected_kind}
  if others:
    problems.append(f'other kinds counted: {others}')
  scores = result.scores[name]
  good = np.setdiff1d(np.arange(len(scores)), bad)
  if not np.isnan(scores[bad]).all():
    problems.append(f'fault samples not NaN: {scores[bad].tolist()}')
  if not np.allclose(scores[good], EXPECTED[good], rtol=1e-5):
    problems.append(f'other samples wrong: {scores[good].tolist()}')
  if counted != len(bad):
    problems.append(f'counted {counted} of {len(bad)} under {expected_kind}: {failures}')
  return counted, problems


def client_worker_trial(bench, backend, fault, trial, env_name='main'):
  name, kw, expected_kind, trigger, detail = worker_fault(fault, trial)
  chunk = trial % 4
  bad = np.array([2 * chunk, 2 * chunk + 1])
  prompts = [trigger if i in bad else 'ok' for i in range(8)]
  if backend == 'local':
    svc = bench.local_service({name: 1.0}, {name: kw})
    wait_limit = 130.0
  else:
    env = bench.env(env_name)
    timeout_s = 600.0 if env_name != 'main' else 120.0
    svc = bench.client(env, {name: 1.0}, {name: kw}, timeout_s=timeout_s)
    wait_limit = timeout_s + 60.0
  t_inj = time.time()
  status, result, t_end = in_thread(lambda: svc.submit(IMAGES, prompts).result(), wait_limit)
  lines = CAPTURE.between(t_inj, t_end)
  rec = dict(detail=detail, expected_kind=expected_kind, injected=len(bad), duration_s=round(t_end - t_inj, 3))
  if status != 'ok':
    rec.update(counted=0, iterations_lost=1, miscount=True,
               problems=[f'{status}: {type(result).__name__}: {result}' if result else status])
  else:
    counted, problems = judge(result, name, expected_kind, bad)
    rec.update(counted=counted, iterations_lost=int(np.isnan(result.scores[name]).all()),
               miscount=bool(problems), problems=problems,
               failures={k: v for k, v in result.failures.items() if v})
  rec['silent_max_s'], rec['first_log_s'] = silence(t_inj, t_end, lines)
  rec['lines'] = [f'+{t - t_inj:.2f}s {src}: {txt[:160]}' for t, src, txt in lines[:8]]
  return rec


# ----------------------------------------------------------------------------- infrastructure faults
def server_kill_trial(bench, trial, env_name='main'):
  env = bench.env(env_name)
  chunk_s = 1.0
  svc = bench.client(env, {'debug_sleep': 1.0}, {'debug_sleep': {'seconds': chunk_s}},
                     timeout_s=600.0)
  # chunk_size 2 in the client config: 4 chunks over 2 workers = about 2 s of scoring.
  pending = svc.submit(IMAGES, ['x'] * 8)
  holder = env.holder(pending.id)
  time.sleep(0.3)
  victim = holder.rsplit('-', 1)[-1] if holder else None
  t_inj = time.time()
  if victim in env.servers:
    env.servers[victim].send_signal(signal.SIGKILL)
    env.servers[victim].wait()
  status, result, t_end = in_thread(pending.result, 660.0)
  lines = CAPTURE.between(t_inj, t_end)
  rec = dict(detail=f'kill -9 {holder} 0.3 s after it took the task', injected=8,
             duration_s=round(t_end - t_inj, 3))
  problems = []
  if victim not in env.servers:
    problems.append(f'no holder seen ({holder})')
  if status != 'ok':
    rec.update(counted=0, iterations_lost=1, miscount=True, problems=problems + [f'{status}: {result}'])
  else:
    scores = result.scores['debug_sleep']
    finite = np.isfinite(scores)
    if not np.allclose(scores, EXPECTED, rtol=1e-5):
      problems.append(f'scores wrong: {scores.tolist()} failures {result.failures}')
    attempts = env.r.get(f'{env.keys.ns}:attempts:{pending.id}')
    from ddrl_jax.rewards import wire  # pylint: disable=g-import-not-at-top
    raw = env.r.get(env.keys.result(pending.id))
    by = wire.unpack(raw).get('server') if raw else None
    if by == holder:
      problems.append(f'answered by the killed server {by}?')
    if attempts is None or int(attempts) < 2:
      problems.append(f'attempts {attempts}: not requeued')
    requeued = any('requeued' in txt for _, _, txt in lines)
    if not requeued:
      problems.append('no server logged the requeue')
    rec.update(counted=int(finite.sum()) if not problems else 0,
               iterations_lost=int(not finite.any()), miscount=bool(problems), problems=problems,
               attempts=int(attempts or 0), answered_by=by,
               failures={k: v for k, v in result.failures.items() if v})
  rec['silent_max_s'], rec['first_log_s'] = silence(t_inj, t_end, lines)
  rec['lines'] = [f'+{t - t_inj:.2f}s {src}: {txt[:160]}' for t, src, txt in lines[:8]]
  env.ensure()          # the killed server back before the next trial
  return rec


def redis_restart_trial(bench, trial, down_s):
  env = bench.env('main')
  svc = bench.client(env, {'debug_sleep': 1.0}, {'debug_sleep': {'seconds': 1.0}}, timeout_s=600.0)
  pending = svc.submit(IMAGES, ['x'] * 8)
  holder = env.holder(pending.id)
  got = {}
  waiter = threading.Thread(target=lambda: got.update(r=pending.result(), t=time.time()), daemon=True)
  waiter.start()
  time.sleep(0.3)
  t_inj = time.time()
  env.redis.restart(down_s)
  waiter.join(down_s + 120.0)
  t_end = got.get('t', time.time())
  lines = CAPTURE.between(t_inj, t_end)
  rec = dict(detail=f'redis-server kill -9, started empty after {down_s} s; task held by {holder}',
             injected=8, duration_s=round(t_end - t_inj, 3), down_s=down_s)
  problems = []
  if 'r' not in got:
    rec.update(counted=0, iterations_lost=1, miscount=True, problems=['the wait did not end'])
  else:
    scores = got['r'].scores['debug_sleep']
    if not np.allclose(scores, EXPECTED, rtol=1e-5):
      problems.append(f'scores wrong: {scores.tolist()} failures {got["r"].failures}')
    rec.update(counted=int(np.isfinite(scores).sum()) if not problems else 0,
               iterations_lost=int(not np.isfinite(scores).any()), miscount=bool(problems),
               problems=problems, failures={k: v for k, v in got['r'].failures.items() if v},
               client_stats=dict(svc.stats))
  rec['silent_max_s'], rec['first_log_s'] = silence(t_inj, t_end, lines)
  rec['lines'] = [f'+{t - t_inj:.2f}s {src}: {txt[:160]}' for t, src, txt in lines[:8]]
  return rec


def wrong_token_trial(bench, trial):
  env = bench.env('main')
  svc = bench.client(env, {'mean_intensity': 1.0}, {}, token='not-the-token', timeout_s=120.0)
  t_inj = time.time()
  status, err, t_end = in_thread(lambda: svc.submit(IMAGES, ['x'] * 8).result(), 180.0)
  lines = CAPTURE.between(t_inj, t_end)
  clear = status == 'raised' and 'bearer token' in str(err) and type(err).__name__ == 'RewardServiceError'
  rec = dict(detail='client token differs from the servers\'', injected=8, counted=8 if clear else 0,
             duration_s=round(t_end - t_inj, 3), iterations_lost=int(status == 'hung'),
             miscount=not clear, problems=[] if clear else [f'{status}: {err}'], error=str(err)[:200])
  rec['silent_max_s'], rec['first_log_s'] = silence(t_inj, t_end, lines)
  rec['lines'] = [f'+{t - t_inj:.2f}s {src}: {txt[:160]}' for t, src, txt in lines[:8]]
  return rec


# ------------------------------------------------------------------------------------------ trainer
def trainer_trial(bench, fault, trial):
  """toy2d over the Redis service, 4 iterations, the fault armed at iteration 2."""
  import jax  # pylint: disable=g-import-not-at-top
  from configs import toy2d  # pylint: disable=g-import-not-at-top
  from ddrl_jax import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  env = bench.env('main')
  inject_it, iters, b, n = 2, 4, 32, 8
  config = toy2d.get_config()
  config.num_iterations = iters
  config.eval_every = -1
  config.checkpoint_every = 1000
  config.toy2d.pretrain_steps = 300
  r = config.reward
  r.backend, r.redis_url, r.token_env, r.timeout_s = 'redis', env.redis.url, TOKEN_ENV, 600.0
  r.chunk_timeout_s = 5.0
  worker = fault in WORKER_FAULTS
  if worker:
    name, kw, expected_kind, trigger, detail = worker_fault(fault, trial)
    r.chunk_size = 8
  else:
    name, kw, expected_kind, trigger = 'debug_sleep', {'seconds': 0.25}, None, None
    detail = fault
    r.chunk_size = 64
  r.fns = {'linear': 1.0, name: 1e-3}        # weighted_sum: toy2d's exact tilt transform takes one reward
  r.combine = 'weighted_sum'
  r.kwargs = {'linear': {'w': config.toy2d.reward_w}, name: kw}
  workdir = os.path.join(bench.logdir, f'trainer_{fault}_{trial}_{int(time.time())}')
  state = dict(it=None, t_inj=None, t_end=None, error=None)
  trainer = trainer_lib.Trainer(config, workdir)

  def prompts(cond):
    out = ['ok'] * cond.shape[0]
    if worker and state['it'] == inject_it:
      out[0] = trigger                 # group 0: slots 0..7, one chunk of 8
    return out
  trainer.task.prompts = prompts

  def inject():
    try:
      holder = None
      deadline = time.monotonic() + 30
      while holder is None and time.monotonic() < deadline:
        ids = env.r.lrange(env.keys.processing, 0, -1)
        for i in ids:
          v = env.r.get(env.keys.lease(i.decode()))
          if v:
            holder = v.decode()
            break
        time.sleep(0.005)
      state['detail'] = f'{fault} (task held by {holder})'
      state['t_inj'] = time.time()
      if fault == 'server_kill9':
        victim = holder.rsplit('-', 1)[-1]
        env.servers[victim].send_signal(signal.SIGKILL)
        env.servers[victim].wait()
      else:
        env.redis.restart(1.0 if fault == 'redis_restart_1s' else 30.0)
    except Exception as e:  # pylint: disable=broad-except
      state['error'] = f'{type(e).__name__}: {e}'

  def hook(event, info):
    if event == 'iteration_start':
      state['it'] = info.get('it')
    if info.get('it') != inject_it:
      return
    if event == 'rewards_submitted':
      if worker:
        state['t_inj'] = time.time()
      elif fault != 'wrong_token':
        threading.Thread(target=inject, daemon=True).start()
    if event == 'rewards_ready':
      state['t_end'] = time.time()
  trainer.event_hooks.append(hook)
  os.environ[TOKEN_ENV] = 'not-the-token' if fault == 'wrong_token' else TOKEN   # read by train()'s build
  from ddrl_jax.rewards import redis_backend  # pylint: disable=g-import-not-at-top
  check = redis_backend.RedisRewardClient.check

  def timed_check(self, *a, **kw):     # wrong_token: the fault meets the servers at the start-up check
    state['t_check'] = time.time()
    return check(self, *a, **kw)
  redis_backend.RedisRewardClient.check = timed_check
  t0 = time.time()
  try:
    # A hang is a run that never ends; 4 iterations take 20-55 s on an idle 2-core VM and took up to 410 s
    # while CI shared its cores (load average 20), so the limit leaves room for that.
    status, err, t_done = in_thread(lambda: trainer.train(progress=False), TRAINER_RUN_LIMIT_S)
  finally:
    os.environ[TOKEN_ENV] = TOKEN
    redis_backend.RedisRewardClient.check = check
  rec = dict(detail=state.get('detail', detail), expected_kind=expected_kind, duration_s=round(t_done - t0, 3))
  path = os.path.join(workdir, 'metrics.jsonl')
  rows = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
  train = {row['step']: row for row in rows if 'loss' in row}
  if fault == 'wrong_token':
    clear = status == 'raised' and 'bearer token' in str(err)
    t_inj = state.get('t_check') or t0
    lines = CAPTURE.between(t_inj, t_done)
    rec['detail'] = 'trainer started with a token the servers do not have'
    rec['build_to_error_s'] = round(t_done - t0, 3)
    rec['duration_s'] = round(t_done - t_inj, 3)
    rec.update(injected=1, counted=int(clear), iterations_lost=0, miscount=not clear,
               problems=[] if clear else [f'{status}: {err}'], error=str(err)[:200],
               iterations_run=len(train))
    rec['silent_max_s'], rec['first_log_s'] = silence(t_inj, t_done, lines)
    rec['lines'] = [f'+{t - t_inj:.2f}s {src}: {txt[:160]}' for t, src, txt in lines[:8]]
    env.ensure()
    return rec
  problems = []
  if status != 'ok':
    problems.append(f'train {status}: {type(err).__name__ if err else ""}: {err}')
  if state['error']:
    problems.append(f'injection: {state["error"]}')
  lost = 0
  for step in range(1, iters + 1):
    row = train.get(step)
    if row is None or row.get('failed_rewards', 0) >= b * n:
      lost += 1
  fails = collections.Counter()
  for row in train.values():
    for k, v in row.items():
      if k.startswith('reward_failures/') and v:
        fails[k.split('/', 1)[1]] += v
  failed_samples = sum(row.get('failed_rewards', 0) for row in train.values())
  if worker:
    injected = 8
    counted = fails.get(expected_kind, 0) / (2 if fault in ('worker_crash', 'worker_hang') else 1)
    others = {k: v for k, v in fails.items() if k != expected_kind}
    if others:
      problems.append(f'other kinds counted: {others}')
    if counted != injected:
      problems.append(f'counted {counted} of {injected} under {expected_kind}: {dict(fails)}')
    if failed_samples != injected:
      problems.append(f'failed_rewards {failed_samples} != {injected}')
  else:
    injected = b * n
    counted = b * n if (not fails and failed_samples == 0 and len(train) == iters) else 0
    if fails or failed_samples:
      problems.append(f'failures {dict(fails)}, failed_rewards {failed_samples}')
  t_inj = state['t_inj'] or t0
  t_end = state['t_end'] or t_done
  lines = CAPTURE.between(t_inj, t_end)
  rec.update(injected=injected, counted=counted, iterations_lost=lost,
             iterations_run=len(train), miscount=bool(problems), problems=problems,
             failures=dict(fails), failed_rewards=failed_samples,
             reward_wait_s={s: round(row.get('time_reward_wait', 0), 3) for s, row in sorted(train.items())})
  rec['silent_max_s'], rec['first_log_s'] = silence(t_inj, t_end, lines)
  rec['lines'] = [f'+{t - t_inj:.2f}s {src}: {txt[:160]}' for t, src, txt in lines[:8]]
  jax.clear_caches()
  env.ensure()
  return rec


# --------------------------------------------------------------------------------------------- run
def run_trial(bench, kind, trial):
  group, fault = kind.split('/')
  if group in ('redis', 'local') and fault in WORKER_FAULTS:
    return client_worker_trial(bench, group, fault, trial)
  if group == 'redis_defaults':
    if fault == 'worker_hang':
      return client_worker_trial(bench, 'redis', fault, trial, env_name='defaults')
    return server_kill_trial(bench, trial, env_name='defaults')
  if group == 'redis':
    if fault == 'server_kill9':
      return server_kill_trial(bench, trial)
    if fault.startswith('redis_restart_'):
      return redis_restart_trial(bench, trial, float(fault.split('_')[-1].rstrip('s')))
    if fault == 'wrong_token':
      return wrong_token_trial(bench, trial)
  if group == 'trainer':
    return trainer_trial(bench, fault, trial)
  raise ValueError(kind)


def load(path):
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except ValueError:
        pass          # a line torn by a kill
  return out


def trials_of(kind, args):
  if kind.startswith('trainer/'):
    return args.trainer_trials
  if kind.startswith('redis_defaults/'):
    return min(args.trials, args.defaults_trials)
  return args.trials


def run(args):
  kinds = args.kinds.split(',') if args.kinds else KINDS
  unknown = set(kinds) - set(KINDS)
  if unknown:
    raise SystemExit(f'unknown kinds {sorted(unknown)}; known: {KINDS}')
  done = {(r['kind'], r['trial']) for r in load(args.out)}
  logdir = args.logdir or os.path.join('/tmp', f'reward_faults_logs_{os.getpid()}')
  os.makedirs(logdir, exist_ok=True)
  logger.info('logs of the servers and trainer runs: %s', logdir)
  bench = Bench(logdir)
  rounds = max(trials_of(k, args) for k in kinds)
  try:
    for trial in range(rounds):          # round robin: every kind progresses together
      for kind in kinds:
        if trial >= trials_of(kind, args) or (kind, trial) in done:
          continue
        t0 = time.time()
        try:
          rec = run_trial(bench, kind, trial)
        except Exception:  # pylint: disable=broad-except  (the benchmark's failure, not a result: not recorded)
          logger.exception('%s trial %d failed in the benchmark itself; not recorded', kind, trial)
          continue
        rec = dict(kind=kind, trial=trial, time=time.strftime('%Y-%m-%dT%H:%M:%S'),
                   wall_s=round(time.time() - t0, 2), **rec)
        with open(args.out, 'a') as f:
          f.write(json.dumps(rec) + '\n')
        logger.info('%s #%d: injected %s counted %s lost %s silent %.1f s%s', kind, trial, rec['injected'],
                    rec['counted'], rec['iterations_lost'], rec['silent_max_s'] or -1,
                    f' PROBLEMS {rec["problems"]}' if rec.get('problems') else '')
  finally:
    bench.close()


# ------------------------------------------------------------------------------------------ report
def report(path):
  recs = load(path)
  by = collections.OrderedDict((k, []) for k in KINDS)
  for r in recs:
    by.setdefault(r['kind'], []).append(r)
  lines = ['| kind | trials | injected (samples) | counted (samples) | miscounted trials | iterations lost | '
           'longest silent wait (s) | median silent wait (s) | first log line, median / max (s) | '
           'median duration (s) |',
           '|---|---|---|---|---|---|---|---|---|---|']
  fails = []
  for kind, rs in by.items():
    if not rs:
      continue
    sil = [r['silent_max_s'] for r in rs if r.get('silent_max_s') is not None]
    first = [r['first_log_s'] for r in rs if r.get('first_log_s') is not None]
    nolog = sum(1 for r in rs if r.get('first_log_s') is None)
    unit = ' (runs)' if kind == 'trainer/wrong_token' else ''
    planned = (5 if kind.startswith('trainer/') else DEFAULTS_TRIALS if kind.startswith('redis_defaults/')
               else 100)
    lines.append(
        f'| {kind} | {len(rs)} of {planned} | {sum(r["injected"] for r in rs):g}{unit} | {sum(r["counted"] for r in rs):g} | '
        f'{sum(bool(r["miscount"]) for r in rs)} | {sum(r["iterations_lost"] for r in rs)} | '
        f'{max(sil):.1f} | {np.median(sil):.1f} | '
        + (f'{np.median(first):.1f} / {max(first):.1f}' if first else '-')
        + (f' ({nolog} without)' if nolog else '') + ' | '
        f'{np.median([r.get("duration_s", 0) for r in rs]):.1f} |')
    for r in rs:
      why = list(r.get('problems') or [])
      if r['iterations_lost']:
        why.append(f'{r["iterations_lost"]} iteration(s) lost')
      if r.get('silent_max_s') is not None and r['silent_max_s'] >= 10:
        why.append(f'silent {r["silent_max_s"]:.1f} s')
      if why:
        fails.append(f'- {kind} #{r["trial"]}: ' + '; '.join(str(w)[:300] for w in why))
  print('\n'.join(lines))
  print(f'\n{len(recs)} trials in {os.path.relpath(path, ROOT)}. Trials that missed a target '
        f'(miscount, iteration lost, silent wait >= 10 s): {len(fails)}')
  shown = collections.Counter()
  for f in fails:
    kind = f.split(' #')[0]
    shown[kind] += 1
    if shown[kind] <= 3:
      print(f)
  for kind, n in shown.items():
    if n > 3:
      print(f'{kind}: {n - 3} more')


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--trials', type=int, default=100, help='trials of each client-level kind')
  p.add_argument('--trainer_trials', type=int, default=5, help='trials of each trainer/* kind')
  p.add_argument('--defaults_trials', type=int, default=DEFAULTS_TRIALS,
                 help='trials of each redis_defaults/* kind (minutes each)')
  p.add_argument('--kinds', default='', help=f'comma-separated subset of {",".join(KINDS)}')
  p.add_argument('--out', default=OUT)
  p.add_argument('--logdir', default='')
  p.add_argument('--report', action='store_true', help='print the table of --out and exit')
  args = p.parse_args()
  if args.report:
    report(args.out)
    return
  logging.basicConfig(level=logging.INFO, format='%(asctime)s %(name)s %(levelname).1s %(message)s',
                      stream=sys.stdout)
  for noisy in ('jax', 'absl', 'ddrl_jax'):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  logging.getLogger('ddrl_jax').addHandler(CAPTURE)
  run(args)


if __name__ == '__main__':
  main()
