"""A reward worker process (`main`), started by `pool.WorkerPool` with two pipe descriptors.

Protocol over two pipes (msgpack + .npy, see wire.py):
  parent -> worker: {'specs': {name: kwargs}, 'imports': [...]} once, then chunks
                    {'samples': array (m, ...), 'prompts': [m strings], 'names': [reward names]};
  worker -> parent: {'kind': 'ready'} after building every reward, or {'kind': 'fatal', 'error'} if
                    one cannot be built; then one {'kind': 'scores', 'scores': {name: value},
                    'errors': {name: message}} per chunk, in order.
A reward that raises is reported in 'errors'; the parent checks every value (garbage -> NaN). The
worker imports neither JAX nor the trainer, so it starts in well under a second.

Lifetime belongs to the parent: SIGINT and SIGTERM sent to the whole process group (Ctrl-C, SLURM,
Kubernetes) are ignored so that the trainer can finish its iteration and save, and on Linux the worker
is killed when its parent dies (even by SIGKILL), so none outlives the trainer.
"""
import argparse
import ctypes
import os
import signal
import sys
import traceback
from multiprocessing import connection

import numpy as np

from ddrl_jax.rewards import registry
from ddrl_jax.rewards import wire


def _describe(e):
  tb = traceback.extract_tb(e.__traceback__)
  where = f' at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}' if tb else ''
  return f'{type(e).__name__}: {e}{where}'


def build_rewards(specs, imports):
  registry.import_modules(imports)
  return {name: registry.make_reward(name, **(kwargs or {})) for name, kwargs in specs.items()}


def score_chunk(rewards, message):
  """One chunk request -> the reply map (never raises for a reward's own failure)."""
  samples, prompts = message['samples'], list(message['prompts'])
  scores, errors = {}, {}
  for name in message['names']:
    try:
      scores[name] = _transportable(rewards[name](samples, prompts))
    except Exception as e:  # a reward model's failure is data for the parent, not a worker crash
      errors[name] = _describe(e)
  return {'kind': 'scores', 'scores': scores, 'errors': errors}


def _transportable(value):
  """A reward's return value as something msgpack carries; the parent decides whether it is valid."""
  if isinstance(value, np.ndarray) and not value.dtype.hasobject:
    return value
  try:
    a = np.asarray(value)
    if a.dtype.kind in 'biuf':
      return a
  except Exception:  # ragged or exotic values are sent as their repr and rejected by the parent
    pass
  return repr(value)[:200]


def _belong_to_parent():
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  if sys.platform.startswith('linux'):
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:       # the parent died before prctl took effect
      os._exit(1)


def main(argv=None):
  _belong_to_parent()
  parser = argparse.ArgumentParser()
  parser.add_argument('--read_fd', type=int, required=True)
  parser.add_argument('--write_fd', type=int, required=True)
  args = parser.parse_args(argv)
  inbox = connection.Connection(args.read_fd, writable=False)
  outbox = connection.Connection(args.write_fd, readable=False)
  try:
    setup = wire.unpack(inbox.recv_bytes(), required=('specs', 'imports'))
    rewards = build_rewards(setup['specs'], setup['imports'])
  except Exception as e:
    outbox.send_bytes(wire.pack({'kind': 'fatal', 'error': _describe(e)}))
    return 1
  try:
    outbox.send_bytes(wire.pack({'kind': 'ready', 'pid': os.getpid()}))
    while True:
      raw = inbox.recv_bytes()
      try:
        reply = wire.pack(score_chunk(rewards, wire.unpack(raw, required=('samples', 'prompts', 'names'))))
      except Exception as e:
        reply = wire.pack({'kind': 'scores', 'scores': {}, 'errors': {'*': _describe(e)}})
      outbox.send_bytes(reply)
  except (EOFError, OSError):   # the parent closed the pipes or went away: nothing left to do
    return 0


if __name__ == '__main__':
  sys.exit(main())
