"""Deliberately misbehaving rewards, to test and demonstrate the reward service's fault handling.

Each scores like `basic.MeanIntensity` unless its fault triggers. Faults trigger only for samples whose
prompt contains ``trigger`` (default: every sample), so one chunk of a batch can fail while the others
succeed. They are registered as debug_* names, importable in every worker process.
"""
import os
import time

import numpy as np


def _score(samples):
  return samples.reshape(samples.shape[0], -1).astype(np.float32).mean(-1) / 255.0


def _triggered(prompts, trigger):
  return trigger is None or any(trigger in p for p in prompts)


class Sleep:
  """Sleeps `seconds` before answering (a hung or slow reward model)."""

  def __init__(self, seconds=1.0, trigger=None):
    self.seconds, self.trigger = float(seconds), trigger

  def __call__(self, samples, prompts):
    if _triggered(prompts, self.trigger):
      time.sleep(self.seconds)
    return _score(samples)


class Crash:
  """Kills its worker process without a reply (a segfault or OOM kill in a reward model)."""

  def __init__(self, trigger=None, exit_code=13):
    self.trigger, self.exit_code = trigger, int(exit_code)

  def __call__(self, samples, prompts):
    if _triggered(prompts, self.trigger):
      os._exit(self.exit_code)
    return _score(samples)


GARBAGE_KINDS = ('shape', 'strings', 'nested', 'nan', 'inf', 'bool', 'huge', 'huge64')


class Garbage:
  """Answers with a value that is not a valid score: 'shape' (one score too many), 'strings', 'nested'
  ((M, 2) numbers), 'nan', 'inf', 'bool' (M booleans), 'huge' (1e30 in float32) or 'huge64' (1e300 in
  float64, which a float32 cast would turn into inf)."""

  def __init__(self, kind='shape', trigger=None):
    if kind not in GARBAGE_KINDS:
      raise ValueError(f'debug_garbage: kind {kind!r}; known: {GARBAGE_KINDS}')
    self.kind, self.trigger = kind, trigger

  def __call__(self, samples, prompts):
    if not _triggered(prompts, self.trigger):
      return _score(samples)
    m = samples.shape[0]
    if self.kind == 'shape':
      return np.zeros(m + 1, np.float32)
    if self.kind == 'strings':
      return ['high'] * m
    if self.kind == 'nan':
      return np.full(m, np.nan, np.float32)
    if self.kind == 'inf':
      return np.full(m, np.inf, np.float32)
    if self.kind == 'bool':
      return np.ones(m, bool)
    if self.kind == 'huge':
      return np.full(m, 1e30, np.float32)
    if self.kind == 'huge64':
      return np.full(m, 1e300, np.float64)
    return [[1.0, 2.0]] * m


class Gate:
  """Waits (up to `max_wait` s) until the file `path` exists, then scores: lets a test hold a reward
  pending until it has observed what the trainer did meanwhile."""

  def __init__(self, path, max_wait=60.0):
    self.path, self.max_wait = path, float(max_wait)

  def __call__(self, samples, prompts):
    del prompts
    deadline = time.monotonic() + self.max_wait
    while not os.path.exists(self.path) and time.monotonic() < deadline:
      time.sleep(0.01)
    return _score(samples)
