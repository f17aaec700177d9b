"""Graceful stops: SIGTERM / SIGINT finish the current iteration, save, and exit; a second signal exits at once.

Preemption notices arrive as SIGTERM (Cloud TPU maintenance events, SLURM time limits with
`--signal`, spot VMs, Kubernetes). One process: `PreemptionGuard` catches SIGTERM and SIGINT and
`should_stop(step)` turns true after the iteration that was running. Several processes (after
`jax.distributed.initialize`): JAX's preemption service owns SIGTERM and
`multihost_utils.reached_preemption_sync_point(step)` makes every host stop at the same step, so all of
them save the same checkpoint; a SIGINT on any host is shared with a tiny all-gather at each step.
"""
import logging
import os
import signal
import threading

import jax
import numpy as np

logger = logging.getLogger(__name__)


class PreemptionGuard:
  """Context manager: installs the handlers on entry (main thread only) and restores them on exit."""

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
    self.signals = tuple(signals)
    self.received = None          # name of the first signal received, e.g. 'SIGTERM'
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self                 # signal handlers can only be installed from the main thread
    multi = jax.process_count() > 1
    for sig in self.signals:
      if multi and sig == signal.SIGTERM:
        continue                  # JAX's preemption notifier handles SIGTERM on every host
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.received is not None:
      logger.error('second signal (%s) while stopping: exiting now without saving', name)
      os._exit(128 + signum)      # skip cleanup that may itself be what hangs
    self.received = name
    logger.info('%s received: finishing the current iteration, then saving a checkpoint and exiting '
                '(send it again to exit at once)', name)

  def should_stop(self, step):
    """True when the run should save and stop after `step` (the same answer on every host)."""
    if jax.process_count() == 1:
      return self.received is not None
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    preempted = multihost_utils.reached_preemption_sync_point(step)
    interrupted = multihost_utils.process_allgather(np.int32(self.received is not None)).any()
    if interrupted and self.received is None:
      self.received = 'SIGINT (another host)'
    elif preempted and self.received is None:
      self.received = 'preemption notice'
    return bool(preempted or interrupted)
