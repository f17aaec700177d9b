"""Saving and resuming one run's orbax checkpoints: the train state, the record loader and the config.

`RunCheckpoints` owns <workdir>/checkpoints. A save is synchronous: orbax's collective multi-process save,
then the integrity record of ddrl_jax.checkpoints. A resume tries the newest checkpoint first. For each one it:
- verifies the files against the integrity record;
- checks the saved config against the run's (`checkpoints.check_compatible`);
- checks that the record loader's saved position belongs to this process and shard;
- restores onto the run's own shardings, whatever mesh wrote it.

Every process moves on to an older checkpoint together when any of them cannot read one, so the
processes never resume different steps. Damaged checkpoints are moved aside once an older one restores.
"""
import logging
import os
import shutil
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from ddrl_jax import checkpoints as checkpoints_lib
from ddrl_jax import console
from ddrl_jax import storage
from ddrl_jax.data import pipeline as data_pipeline
from ddrl_jax.parallel import hosts

OK, DAMAGED, INCOMPATIBLE = 0, 1, 2
# orbax's warning, twice per saved item, when the items of a checkpoint are listed (item_metadata) before
# any handler is registered; nothing is wrong: each item is then restored with explicit args.
ORBAX_UNREGISTERED_ITEM = 'Item "%s" was found in the checkpoint, but could not'

logger = logging.getLogger(__name__)


class RunCheckpoints:
  """The checkpoints of a workdir (local or a bucket URL).

  config: the run's ConfigDict (saved with each step, compared on resume; max_checkpoints and
    checkpoint_checksums are read from it). loader: the run's data_pipeline.RecordLoader, or None.
  safe_keys: config keys besides checkpoints.SAFE_TO_CHANGE that a resume may change (the model family's
    `resume_safe_keys`: where its base weights came from).
  """

  def __init__(self, workdir, config, loader=None, safe_keys=()):
    self.workdir = storage.absolute(workdir)
    self.dir = os.path.join(self.workdir, 'checkpoints')
    self.config = config
    self.loader = loader
    self.safe_keys = tuple(safe_keys)
    self.manager = self._manager()

  def _manager(self):
    return ocp.CheckpointManager(
        self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=self.config.max_checkpoints,
                                                       create=True))

  def saved_config(self, step=None):
    """The config dict saved with checkpoint `step` (default: the newest), or None without checkpoints."""
    steps = self.steps()
    if not steps:
      return None
    step = steps[0] if step is None else step
    return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']

  def step_dir(self, step):
    return os.path.join(self.dir, str(step))

  def steps(self):
    """Saved steps, newest first."""
    return sorted(self.manager.all_steps(), reverse=True)

  # ------------------------------------------------------------------------------------------ save
  def save(self, step, tree):
    """Saves `tree` (a dict of global arrays), the loader position and the config as `step`; waits for
    the commit, then records the files' integrity (process 0, local workdirs)."""
    items = dict(state=ocp.args.StandardSave(tree), config=ocp.args.JsonSave(self.config.to_dict()))
    if self.loader is not None:
      items['data'] = data_pipeline.save_args(self.loader)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    self.manager.wait_until_finished()
    path = self.step_dir(step)
    if self.config.checkpoint_checksums and jax.process_index() == 0 and checkpoints_lib.is_local(path):
      checkpoints_lib.write_integrity(path)

  # --------------------------------------------------------------------------------------- restore
  def restore_newest(self, target, read_only=False):
    """The restored tree of the newest usable checkpoint (None when there is none).

    target: the tree of jax.ShapeDtypeStructs (with shardings) to restore into; it must hold 'step'.
    Raises IncompatibleCheckpoint (another config, loader shard or process count) or
    DamagedCheckpoint (every checkpoint damaged: the run does not silently start again from step 0).
    read_only: for readers of a workdir (evaluation, sampling). Config differences are logged, not refused,
    the loader position is not restored, and nothing is moved.
    """
    damaged = []
    for step in self.steps():
      error, restored = None, None
      try:
        restored = self._restore(step, target, strict=not read_only)
      except Exception as e:  # pylint: disable=broad-except  (any read failure = damaged)
        error = e
      status = hosts.allgather(np.int32(OK if error is None else INCOMPATIBLE if isinstance(
          error, checkpoints_lib.IncompatibleCheckpoint) else DAMAGED))
      if status.max() == OK:
        if damaged and not read_only:
          self._set_aside([s for s, _ in damaged])
        return restored
      if isinstance(error, checkpoints_lib.IncompatibleCheckpoint):
        raise error
      if status.max() == INCOMPATIBLE:
        raise checkpoints_lib.IncompatibleCheckpoint(
            f'{self.step_dir(step)}: another process found it incompatible (see its log)')
      if error is None:
        why = f'another process could not read it (processes {np.flatnonzero(status).tolist()})'
      else:
        why = f'{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ""}'
      logger.warning('checkpoint %s is damaged (%s); trying an older one', self.step_dir(step), why)
      damaged.append((step, why))
    if damaged:
      listing = '; '.join(f'{self.step_dir(s)}: {why}' for s, why in damaged)
      raise checkpoints_lib.DamagedCheckpoint(
          f'every checkpoint in {self.dir} is damaged ({listing}). Not starting again from step 0: '
          f'move {self.dir} away to do that.')
    return None

  def _restore(self, step, target, strict=True):
    """The tree of checkpoint `step` (and the loader's position, in place), after checking it."""
    path = self.step_dir(step)
    if checkpoints_lib.is_local(path):
      checkpoints_lib.verify(path)
    with console.hidden('absl', ORBAX_UNREGISTERED_ITEM):     # orbax logs through absl
      metadata = self.manager.item_metadata(step)
    if 'config' not in metadata:
      raise checkpoints_lib.DamagedCheckpoint(f'{path}: no config item')
    saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
    unsafe = []
    if strict:
      changed = checkpoints_lib.check_compatible(saved, self.config.to_dict(), path, self.safe_keys)
    else:
      safe, unsafe = checkpoints_lib.config_differences(saved, self.config.to_dict(), self.safe_keys)
      changed = safe + unsafe
    for key, old, new in changed:
      logger.info('%s %s with %s changed: %r -> %r', 'resuming' if strict else 'reading', path, key, old,
                  new)
    items = dict(state=ocp.args.StandardRestore(target))
    if self.loader is not None and strict:    # readers (read_only) do not continue the record stream
      self._check_loader_state(path, metadata)
      items['data'] = data_pipeline.restore_args(self.loader)   # restores the loader in place
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**items))['state']
    except Exception as e:  # pylint: disable=broad-except
      if not unsafe:
        raise
      # A reader given another config than the run's: its state has other shapes, which is not damage.
      raise checkpoints_lib.IncompatibleCheckpoint(
          f'{path} holds a run of another config, whose state does not fit this one: '
          f'{checkpoints_lib.describe_differences(unsafe)}; read it with the config it was trained '
          'with') from e
    if int(restored['step']) != step:
      raise checkpoints_lib.DamagedCheckpoint(f'{path}: holds step {int(restored["step"])}, not {step}')
    return restored

  def _check_loader_state(self, path, metadata):
    """Raises unless `path` holds this process's loader position for this loader's shard."""
    if 'data' not in metadata:
      raise checkpoints_lib.IncompatibleCheckpoint(
          f'{path} has no data-iterator state, but config.data.path is set: it was written by a run '
          'without records')
    saved = data_pipeline.saved_state(path)
    if saved is None and data_pipeline.saved_by_processes(path, jax.process_count()):
      raise checkpoints_lib.DamagedCheckpoint(
          f'{path}: the record-loader state of process {jax.process_index()} is missing')
    if saved is None:
      raise checkpoints_lib.IncompatibleCheckpoint(
          f'{path} holds no record-loader state for process {jax.process_index()} of '
          f'{jax.process_count()}: it was written by another number of processes, and the loader '
          'position cannot be carried over. Resume with the same number of processes.')
    try:
      data_pipeline.check_shard(saved, self.loader.shard, f'{path}: the loader state')
    except ValueError as e:
      raise checkpoints_lib.IncompatibleCheckpoint(str(e)) from None

  def _set_aside(self, steps):
    """Moves damaged step directories to <workdir>/checkpoints_damaged/ (a later save reuses the step)."""
    if jax.process_index() == 0 and storage.is_remote(self.dir):
      logger.warning('damaged checkpoints %s left in place (%s is a bucket); a later save of the same '
                     'step replaces them', steps, self.dir)
    elif jax.process_index() == 0:
      dest = os.path.join(self.workdir, 'checkpoints_damaged')
      os.makedirs(dest, exist_ok=True)
      for step in steps:
        target = os.path.join(dest, f'{step}_{time.strftime("%Y%m%d-%H%M%S")}')
        shutil.move(self.step_dir(step), target)
        logger.warning('moved damaged checkpoint %s to %s', self.step_dir(step), target)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices('ddrl_jax: damaged checkpoints set aside')
    self.manager.close()
    self.manager = self._manager()

  def wait_until_finished(self):
    self.manager.wait_until_finished()

  def latest_step(self):
    return self.manager.latest_step()
