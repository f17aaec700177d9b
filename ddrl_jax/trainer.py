"""The rollout -> reward -> update loop around the pure update of `ddrl_jax.update`.

One iteration: B conditions -> N rollouts each (jitted, scan over T, one batched network call per step) ->
decoded samples submitted to the reward service -> the diffusion-loss gradient, computed while the rewards
are pending -> the policy gradient once they arrive, added to it in the jitted update -> AdamW -> power
EMA. Shardings come from the run's `parallel.ShardingPlan` (config.mesh, config.sharding).

Throughput: every metrics row has the iteration's model FLOPs (`flops_per_iteration`, ddrl_jax/flops.py)
and, after the first iteration (which compiles), `achieved_flops_per_s` over `time_compute` (rollout +
data gradient + update, without the reward wait) and, where the chips' peak is known, `mfu`.

Fault tolerance: SIGTERM/SIGINT stop after the current iteration with a checkpoint (ddrl_jax.preemption);
a resume restores the newest checkpoint that passes its integrity record and whose config matches
(ddrl_jax.checkpoints), moving damaged ones aside, and re-runs the lost steps exactly (every key derives
from the root key and the step). Setting DDRL_EVENT_LOG=<file> appends each iteration event there
(benchmarks/fault_tolerance.py uses it to kill the process at chosen moments).
"""
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from ddrl_jax import checkpoints as checkpoints_lib
from ddrl_jax import cli
from ddrl_jax import config as config_lib
from ddrl_jax import console
from ddrl_jax import distributed
from ddrl_jax import flops as flops_lib
from ddrl_jax import image_grid
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import optim
from ddrl_jax import parallel
from ddrl_jax import preemption
from ddrl_jax import preflight
from ddrl_jax import program as program_lib
from ddrl_jax import rewards as rewards_lib
from ddrl_jax import resume
from ddrl_jax import rl as rl_lib
from ddrl_jax import storage
from ddrl_jax import tasks
from ddrl_jax import video_io
from ddrl_jax.data import pipeline as data_pipeline
from ddrl_jax.data import records as data_records
from ddrl_jax.data import synthesis
from ddrl_jax.models import lora as lora_lib
from ddrl_jax.parallel import hosts
from ddrl_jax.parallel import rules as rules_lib
# The pure update lives in ddrl_jax/update.py; its names stay importable from here.
from ddrl_jax.update import (  # pylint: disable=unused-import
    TrainState, RolloutBatch, flat_rollout_batch, group_rollout_batch, DataBatch,
    compute_advantages, make_sampler, make_eval_sampler, init_train_state, make_update_fns, combine_metrics,
    make_train_step, jit_train_step, make_sample_fn, StepFns, uses_data_grads, build_step_fns, place_data,
    rollout_params, model_params)

logger = logging.getLogger(__name__)
# tqdm's rate and ETA would count the first iteration (compile); the pace is in the postfix instead.
BAR_FORMAT = '{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]'


class MemoryCheckError(cli.UsageError):
  """The train state does not fit the devices (a user's mistake about the hardware: one line)."""


def state_bytes_per_device(abstract, shardings):
  """Bytes one device holds of an abstract tree under `shardings` (its largest shard of each leaf)."""
  def nbytes(leaf, sh):
    shape = sh.shard_shape(leaf.shape) if hasattr(sh, 'shard_shape') else leaf.shape
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  return sum(jax.tree.leaves(jax.tree.map(nbytes, abstract, shardings)))


def host_available_bytes():
  """The host's available memory (MemAvailable), or None where it cannot be read."""
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def device_memory_bytes(device):
  """An accelerator's memory limit (memory_stats' bytes_limit), or None where the runtime does not say."""
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    return None
  return stats.get('bytes_limit')


def _event_logger(path):
  """A hook appending '{"event": name, "time": t, **info}' lines to `path`, flushed at once."""
  f = open(path, 'a', buffering=1)

  def hook(name, info):
    f.write(json.dumps({'event': name, 'time': time.time(), 'pid': os.getpid(), **info},
                       default=str) + '\n')
    f.flush()

  return hook


def _state_to_tree(state, rng, rng_value=None, base_print=None):
  """The checkpointed dict of a TrainState (None fields left out) and the root key's data (or
  `rng_value` in its place, e.g. its sharding). LoRA's frozen base is not saved: `base_print` (its
  `lora.fingerprint`, or that value's sharding/shape) identifies it instead."""
  tree = {k: v for k, v in state._asdict().items() if v is not None and k != 'frozen'}
  tree['rng'] = jax.random.key_data(rng) if rng_value is None else rng_value
  if base_print is not None:
    tree['base_fingerprint'] = base_print
  return tree


def _throughput_postfix(avg):
  """Progress-bar fields of averaged metrics: achieved GFLOP/s and MFU (%) when they were logged."""
  out = {}
  if 'achieved_flops_per_s' in avg:
    out['GFLOP/s'] = f"{avg['achieved_flops_per_s'] / 1e9:.4g}"
  if 'mfu' in avg:
    out['mfu'] = f"{100 * avg['mfu']:.1f}%"
  return out


def _bar_postfix(pace, shown):
  """The progress bar's postfix: the pace (console.Pace.text) and the averaged metrics `shown`."""
  return ', '.join(([pace.text()] if pace.text() else []) + [f'{k}={v}' for k, v in shown.items()])


def _log_above(bar, level, msg, *args):
  """Logs a line above the progress bar instead of through it."""
  with bar.external_write_mode():
    logger.log(level, msg, *args)


class NonFiniteTrainingError(RuntimeError):
  """The loss or the parameters stayed non-finite for config.max_nonfinite_steps updates in a row."""


class Trainer:
  """Owns the mesh, task, jitted functions, checkpoints and metrics of one workdir."""

  def __init__(self, config, workdir, devices=None):
    devices = jax.devices() if devices is None else list(devices)
    # Missing weights, data or reward models stop here, in one line, before anything is built. A config
    # the task cannot even be built from is reported by `validate` (a ConfigError naming the key) first.
    try:
      task = tasks.get_task(config)
      preflight.check(config, task, cli.config_spec(sys.argv) or 'the config')
    except preflight.MissingInputs:
      raise
    except Exception:  # pylint: disable=broad-except
      config_lib.validate(config, len(devices))
      raise
    config_lib.validate(config, len(devices))
    self.config = config
    self.workdir = storage.absolute(workdir)   # a local path or a bucket URL (gs://...)
    if not jax.config.jax_threefry_partitionable:
      raise ValueError('jax_threefry_partitionable is off: sharded random draws would differ from '
                       'unsharded ones (and between meshes); leave it at its default (True)')
    self.mesh = parallel.make_mesh(config.mesh, devices)
    self.task = task
    self.plan = parallel.ShardingPlan.for_model(config, self.mesh, self.task.family)
    # Which rows of each batch this process holds (all of them with one process).
    self.layout = hosts.batch_layout(self.plan.batch(), self._data_sharding(config.batch_size),
                                     config.batch_size, config.num_rollouts)
    self.state_shardings = None    # set by restore_or_init
    self.cast_params = None        # the task's compute-dtype copy of the parameters, if any
    self.lora = lora_lib.from_config(config)
    self.sampler = make_sampler(config)
    self.optimizer = optim.make_optimizer(config.optim)
    self.rng = jax.random.key(config.seed)
    self.base_samples_dir = self._base_samples_dir()
    self.loader = self.make_loader()
    self._new_workdir = not storage.exists(self.workdir)   # remove_new_workdir() may undo it
    self.checkpoints = resume.RunCheckpoints(self.workdir, config, self.loader,
                                             safe_keys=self.task.family.resume_safe_keys)
    self.ckpt_dir = self.checkpoints.dir
    self.apply_fn = None
    self.state = None
    self.rewards = None            # the reward service, started by _build
    self._failed_batches = 0       # consecutive batches without one scored sample
    self.events = []               # (name, time, info) of the current iteration
    self.event_hooks = []          # callables (name, info), called at each event
    self.iteration = None          # the iteration running now (events carry it)
    self._compiled = False         # set after the first iteration of the built functions (compiles)
    self.stopped_by = None         # the signal that stopped the last train() early, if any
    self.pace = None               # console.Pace of the last train(): seconds per iteration after the first
    self.last_evaluation = None    # the last evaluation's metrics row ({'step': s, 'eval/...': v})
    self.last_samples = None       # the path of the last sample grid written
    self.last_videos = None        # the pattern of the last evaluation MP4s written (video tasks)
    self.eval_videos = {}          # {tensorboard tag: uint8 (F, H, W, 3)} of the running evaluation
    self._warned_mp4 = False
    if os.environ.get('DDRL_EVENT_LOG'):
      self.event_hooks.append(_event_logger(os.environ['DDRL_EVENT_LOG']))

  def _data_sharding(self, batch):
    return self.plan.sharding(('act_batch',), (batch,), 'data')

  def remove_new_workdir(self):
    """Removes the workdir this Trainer created if nothing was written into it but empty folders (a run
    stopped by a user's mistake leaves no files behind). Local workdirs only."""
    if not self._new_workdir or storage.is_remote(self.workdir) or not os.path.isdir(self.workdir):
      return
    for _, _, files in os.walk(self.workdir):
      if files:
        return
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(self.workdir, ignore_errors=True)

  @property
  def ckpt(self):
    """The orbax CheckpointManager of the workdir (resume.RunCheckpoints.manager)."""
    return self.checkpoints.manager

  def _base_samples_dir(self):
    """Where this run keeps the base model's own samples (config.data.base_samples > 0, no data.path,
    an algorithm with a data term), or None."""
    d, c = self.config.data, self.config
    if d.path or d.get('base_samples', 0) <= 0 or not uses_data_grads(c):
      return None
    path = d.get('base_samples_dir', '') or os.path.join(self.workdir, 'base_samples')
    if storage.is_remote(path):
      raise config_lib.ConfigError(
          f'config.data.base_samples_dir: the base samples are written as ArrayRecord files, which need a '
          f'local or mounted filesystem, not {path}; set data.base_samples_dir to one (shared by the hosts)',
          'data.base_samples_dir')
    return path

  def _data_path(self):
    """The records this run trains its data term on: config.data.path, else the finished base samples."""
    if self.config.data.path:
      return self.config.data.path
    if self.base_samples_dir and synthesis.is_complete(self.base_samples_dir):
      return self.base_samples_dir
    return None

  def make_loader(self):
    """The record loader of config.data.path (or of the base samples), or None: per iteration one record
    per group this process holds (all B with one process), from the shard of its row set
    (`hosts.BatchLayout`)."""
    d = self.config.data
    path = self._data_path()
    if not path:
      return None
    try:
      data_records.list_shards(path)
    except ValueError as e:
      raise config_lib.ConfigError(f'config.data.path={path!r}: {e}'.replace(f': {path!r}: ', ': '),
                                   'data.path') from e
    manifest = os.path.join(path, 'manifest.json') if os.path.isdir(path) else None
    expected = data_records.expected_from_manifest(path) if manifest and os.path.exists(
        manifest) else None
    # One record per group this process holds; processes holding the same groups (context/tensor
    # replicas on other hosts) share a shard and read identical records.
    lay = self.layout
    return data_pipeline.RecordLoader(path, len(lay.groups), seed=self.config.seed,
                                      shuffle=d.shuffle, expected=expected, skip_bad=d.skip_bad,
                                      worker_count=d.worker_count, shard_index=lay.shard_index,
                                      shard_count=lay.shard_count)

  def synthesize_base_samples(self, start, progress=True):
    """Samples config.data.base_samples records of the initial (base) model over the task's training
    prompts into `base_samples_dir` with the evaluation sampler (resuming a killed run's shards), then
    opens the loader on them. Only before the first update: the model must still be the base."""
    c = self.config
    out = self.base_samples_dir
    if start > 0:
      raise cli.UsageError(f'{out}: the base samples this run trains on are incomplete or gone (no '
                           f'manifest.json), and the model at step {start} is no longer the base',
                           'restore them, or set config.data.path to a copy, or start a new workdir')
    self.task.require('records')
    sampler = make_eval_sampler(c)
    sample_fn = make_sample_fn(sampler, self.apply_fn, self.task.sample_shape, self.mesh,
                               model_params(self.state_shardings), self.plan, self.cast_params)
    todo = synthesis.prompts_round_robin(self.task.prompt_set(), int(c.data.base_samples))
    logger.info('base samples: %d samples of the base model over %d training prompts (%d-step %s '
                'sampler) into %s, for the data term', len(todo), len(set(todo)), sampler.num_steps,
                'deterministic' if sampler.noise == 0 else 'stochastic', out)
    described = dict(task=c.task, sampler='eval', steps=int(sampler.num_steps), model='initial')
    summary = synthesis.write_samples(
        self.task, sample_fn, model_params(self.state), self.mesh, out, todo, seed=c.seed,
        batch=c.batch_size * c.num_rollouts, described=described,
        extra=dict(source='trainer base samples', config_task=c.task), progress=progress,
        desc='base samples')
    logger.info('base samples: %d records in %s (%d non-finite skipped)', summary['num_records'], out,
                summary['skipped_nonfinite'])
    self.loader = self.make_loader()
    self.checkpoints.loader = self.loader
    return summary

  # ------------------------------------------------------------------------------------- state
  def restore_or_init(self, read_only=False):
    """Restores the newest usable checkpoint of the workdir, or builds the initial state. Returns its step.

    Newest first, a checkpoint is skipped (with a warning naming it) when its files fail their
    integrity record or orbax cannot read it (on any process), and the damaged ones are moved to
    `checkpoints_damaged/` once an older one restores (`resume.RunCheckpoints`). A checkpoint written
    with another config raises `checkpoints.IncompatibleCheckpoint`; if every checkpoint is damaged
    the run stops with `checkpoints.DamagedCheckpoint` rather than start again from step 0.

    read_only: for readers of a workdir (evaluation, sampling): config differences are logged, not
    refused (the model's shapes must still match), and nothing is moved.
    """
    model_key = jax.random.fold_in(self.rng, 0x6D6F64)
    self.program = program_lib.assemble(self.config, self.task, self.mesh, model_key, plan=self.plan)
    self.apply_fn, self.optimizer = self.program.apply_fn, self.program.optimizer
    abstract_state = self._plan_state(self.program)
    if (not read_only and self.mesh.devices.flat[0].platform != 'cpu'
        and not self.config.get('skip_memory_check', False)):
      self.check_step_memory()
    rep = self.plan.replicated()
    lora_on = self.lora.enabled
    # Restore onto this run's mesh and rules, whatever topology wrote the checkpoint (e.g. 8 devices -> 1):
    # orbax reads each device's own slices.
    shardings = _state_to_tree(self.state_shardings, None, rep, rep if lora_on else None)
    print_shape = jax.ShapeDtypeStruct((2,), jnp.uint32) if lora_on else None
    target = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                          _state_to_tree(abstract_state, self.rng, None, print_shape), shardings)
    restored = self.checkpoints.restore_newest(target, read_only=read_only)
    # Under LoRA the base is built (or loaded) again in either case; only the adapters are restored.
    trained, frozen = lora_lib.split(
        self._initial_params(model_key) if restored is None or lora_on else None, self.lora)
    sh = self.state_shardings
    if restored is None:
      # Fresh buffers: the donating update never frees the task's arrays.
      self.state = self.program.init_state(trained, frozen)
    else:
      self.rng = jax.random.wrap_key_data(restored.pop('rng'))
      if frozen is not None:
        frozen = jax.jit(self.program.keep_frozen, in_shardings=(sh.frozen,), out_shardings=sh.frozen)(frozen)
      if lora_on:
        self._check_base(restored.pop('base_fingerprint'), frozen)
      self.state = TrainState(**{f: restored.get(f) for f in TrainState._fields if f != 'frozen'},
                              frozen=frozen)
      logger.info('resuming %s from step %d', self.workdir, int(self.state.step))
    return int(self.state.step)

  def _base_fingerprint(self, frozen):
    return jax.jit(lora_lib.fingerprint, out_shardings=self.plan.replicated())(frozen)

  def _check_base(self, saved, frozen):
    """Refuses adapters trained on another base than the one this run built or loaded."""
    now = np.asarray(self._base_fingerprint(frozen))
    if not np.array_equal(np.asarray(saved), now):
      raise checkpoints_lib.IncompatibleCheckpoint(
          f'{self.workdir}: the LoRA adapters of this checkpoint were trained on another base model '
          f'(content hash {np.asarray(saved).tolist()}, this run\'s base {now.tolist()}); start from the '
          'base the run was trained from (the checkpoint\'s config names it) or a new workdir')

  def _plan_state(self, program):
    """The program's train-state shardings, checked and logged (per-device bytes of the trained
    parameters and, under LoRA, of the frozen base with them). Returns the abstract train state."""
    abstract_state = program.abstract_state
    sh = self.state_shardings = program.state_shardings
    report = self.plan.check_params(lora_lib.combine(abstract_state.params, abstract_state.frozen),
                                    lora_lib.combine(sh.params, sh.frozen))
    opt = rules_lib.sharding_report(abstract_state.opt_state, self.state_shardings.opt_state)
    trained = ''
    if abstract_state.frozen is not None:
      adapters = rules_lib.sharding_report(abstract_state.params, sh.params)
      trained = (f' (LoRA adapters: {adapters["total_bytes"] / 2**20:.2f} MiB trained, the base frozen)')
    first = self.mesh.devices.flat[0]
    logger.info('sharding: %d %s device(s) (%s); mesh %s; parameters %.3f GiB per device of %.3f GiB '
                '(%.2f%% replicated)%s, optimizer state %.3f GiB per device', self.mesh.size,
                first.platform, first.device_kind, dict(self.mesh.shape),
                report['per_device_bytes'] / 2**30, report['total_bytes'] / 2**30,
                100 * report['replicated_fraction'], trained, opt['per_device_bytes'] / 2**30)
    self.sharding_report = dict(params=report, opt_state=opt)
    self.cast_params = program.cast_params
    self._check_memory(abstract_state, sh)
    return abstract_state

  def _check_memory(self, abstract_state, shardings):
    """Refuses, in one line and before anything is allocated, a train state (parameters, optimizer
    moments, EMA, reference, frozen base) that does not fit its devices: per device against the device's
    memory limit; on CPU, every local device's share against the host's available memory. A lower bound:
    activations and the step's temporaries come on top (`python -m ddrl_jax.aot` measures those).
    config.skip_memory_check turns it off."""
    if self.config.get('skip_memory_check', False):
      return
    per_device = state_bytes_per_device(abstract_state, shardings)
    local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
    if local[0].platform == 'cpu':
      need, have, where = per_device * len(local), host_available_bytes(), 'host memory available'
    else:
      need, have, where = per_device, device_memory_bytes(local[0]), f'{local[0].device_kind} memory'
    if have and need > have:
      raise MemoryCheckError(
          f'the train state alone needs {need / 2**30:.1f} GiB ({per_device / 2**30:.2f} GiB per device x '
          f'{len(local) if local[0].platform == "cpu" else 1}) but this host has {have / 2**30:.1f} GiB of '
          f'{where} (mesh {dict(self.mesh.shape)})',
          'use more devices (a larger mesh.fsdp), LoRA (--config.lora.rank=...), a :smoke preset, or '
          '--config.skip_memory_check=True')

  def check_step_memory(self, memory_bytes=None):
    """Refuses, in one line and before anything is allocated, a config whose step functions do not fit
    the devices: each is compiled for this run's devices (`ddrl_jax.aot.compile_report`: the same
    programs the loop runs) and its peak (XLA's memory analysis: arguments, outputs and temporaries, plus
    the state the trainer holds beside it) is set against the device's memory limit. Automatic on
    accelerators (config.skip_memory_check turns it off); the result is kept in
    <workdir>/memory_check.json per config, so a resumed run does not compile twice. Returns the rows."""
    from ddrl_jax import aot  # pylint: disable=g-import-not-at-top  (aot imports this module)
    local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
    have = memory_bytes or device_memory_bytes(local[0])
    if not have:
      logger.info('memory check: %s reports no memory limit; the step functions are not checked',
                  local[0].device_kind)
      return []
    record = os.path.join(self.workdir, 'memory_check.json')
    import hashlib  # pylint: disable=g-import-not-at-top
    key = hashlib.sha256(json.dumps(self.config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
    key += f'/{self.mesh.size}/{have}'
    if storage.exists(record):
      saved = json.loads(storage.read_text(record))
      if saved.get('key') == key:
        return saved['rows']
    t0 = time.perf_counter()
    logger.info('memory check: compiling the step functions for the %d %s devices '
                '(--config.skip_memory_check=True skips it)', self.mesh.size, local[0].device_kind)
    rows = list(aot.compile_report(self.config, None, fns=aot.FUNCTIONS, devices=list(self.mesh.devices.flat),
                                   memory_bytes=have))
    over = [r for r in rows if not r.get('fits', True)]
    if over:
      worst = max(over, key=lambda r: r.get('peak_bytes', float('inf')))
      need = ', '.join(f"{r['fn']} {r['peak_bytes'] / 2**30:.1f} GiB" if 'peak_bytes' in r else
                       f"{r['fn']} out of memory ({r.get('error', '')[:80]})" for r in over)
      raise MemoryCheckError(
          f'the step does not fit: per device {need}, against {have / 2**30:.1f} GiB of '
          f'{local[0].device_kind} memory (mesh {dict(self.mesh.shape)}; {worst["fn"]} is the largest)',
          'use more devices (a larger mesh.fsdp or mesh.context), LoRA (--config.lora.rank=...), a smaller '
          'batch_size or num_rollouts, a :smoke preset, or --config.skip_memory_check=True')
    logger.info('memory check: peak %s per device of %.1f GiB (%.0f s)',
                ', '.join(f"{r['fn']} {r['peak_bytes'] / 2**30:.2f} GiB" for r in rows), have / 2**30,
                time.perf_counter() - t0)
    if distributed.is_main_process():
      storage.write_text(record, json.dumps(dict(key=key, rows=rows), indent=1))
    return rows

  def _initial_params(self, key):
    """Initial parameters placed shard by shard (`Task.init_params_sharded`: random weights drawn under
    jit with out_shardings, base weights from host memory, each device receiving its own slices)."""
    shardings = lora_lib.combine(self.state_shardings.params, self.state_shardings.frozen)
    return self.task.init_params_sharded(key, shardings)

  def _step_dir(self, step):
    return self.checkpoints.step_dir(step)

  def save(self):
    """Saves the state (and loader and config) at its step, waits for the commit, then records the
    files' integrity. Synchronous, so a stop or kill after it returns never loses this step."""
    step = int(self.state.step)
    self.event('checkpoint_start', step=step)
    # The root key as a replicated global array: orbax cannot save one process's local array on a pod.
    rng = parallel.place(np.asarray(jax.random.key_data(self.rng)), self.plan.replicated())
    base = None if self.state.frozen is None else self._base_fingerprint(self.state.frozen)
    self.checkpoints.save(step, _state_to_tree(self.state, self.rng, rng, base))
    self.event('checkpoint_done', step=step)

  # --------------------------------------------------------------------------------------- loop
  def _build(self):
    fns = self.program.step_fns()
    self._rollout, self._sample = fns.rollout, fns.sample
    self._data_grads, self._update = fns.data_grads, fns.update
    self._compiled = False
    self.forward_flops = float(self.task.forward_flops_per_sample())
    dtype = self.task.compute_dtype
    self.peak_flops = flops_lib.devices_peak_flops(self.mesh.devices.flat, dtype)
    logger.info('throughput: %s FLOPs per forward of one sample; peak of the %d %s devices for %s '
                'compute: %s', self.forward_flops, self.mesh.size,
                self.mesh.devices.flat[0].device_kind, dtype,
                f'{self.peak_flops:.4g} FLOP/s' if self.peak_flops else 'unknown (no mfu metric)')
    if self.rewards is None and self.layout.slots.is_lead:   # replica hosts' rows are scored by their lead
      self.rewards = rewards_lib.make_reward_service(self.config.reward, mesh=self.reward_mesh())
      if hasattr(self.rewards, 'check'):
        self.rewards.check()

  def reward_mesh(self):
    """The mesh in-process JAX rewards run on: this process's devices on one 'data' axis (each row set's
    lead scores its own rows, so a reward must not need the other processes)."""
    local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
    return jax.sharding.Mesh(np.asarray(local), ('data',))

  def event(self, name, **info):
    """Records a named point of the current iteration (and calls the hooks, e.g. a test's)."""
    if self.iteration is not None:
      info.setdefault('it', self.iteration)
    self.events.append((name, time.perf_counter(), info))
    for hook in self.event_hooks:
      hook(name, info)

  def iteration_keys(self, it):
    """Keys of iteration `it`: derived from the root key and the step only (resume-exact)."""
    return jax.random.split(jax.random.fold_in(self.rng, it), 4)

  def collect(self, it):
    """Rollouts of iteration `it`, their rewards submitted (not awaited), and the paired data.

    Each process builds only the rows its devices hold (`self.layout`) and the global arrays are
    assembled from them; the lead of each row set decodes and scores that set's rollouts.
    Returns (rollout without rewards, pending rewards of this process's slot rows, their validity,
    data batch).
    """
    c = self.config
    lay = self.layout
    b, n = c.batch_size, c.num_rollouts
    k_cond, k_roll, k_data, _ = self.iteration_keys(it)
    if self.loader is None:   # every process draws the same B conditions and keeps its own groups
      global_cond = self.task.conditions(k_cond, b)
      cond, x0 = lay.my_groups(global_cond), None      # x0 is made while the rewards are scored
      prompts = self.task.prompts(cond)
    else:   # one record per group: its condition and clean sample, used by every trained step
      records = next(self.loader)
      if lay.shard_count > 1:   # per-group draws (e.g. T2V/I2V) differ between the shards' groups
        k_cond = jax.random.fold_in(k_cond, lay.shard_index)
      cond, x0 = self.task.from_records(records, k_cond)
      prompts = list(records['prompt'])
    self._cond_metrics = self.task.batch_metrics(cond)
    local_slots = lay.slots_from_groups(cond)
    slots = hosts.assemble(local_slots, self.plan.batch(), b * n)
    traj = jax.block_until_ready(self._rollout(rollout_params(self.state), slots, k_roll))
    self.event('rollout_done')
    final = traj.x0[:, 0]          # a computation on global arrays: every process runs it
    if lay.slots.is_lead:
      samples = hosts.local_values(final, lay.slots.mine)
      media, valid = self.task.reward_inputs(samples, local_slots)
      slot_prompts = lay.list_from_groups(prompts)
      pending = self.rewards.submit(media, slot_prompts)
    else:     # a context/tensor replica host: its lead scores these rows
      slot_prompts, valid = [], np.ones(len(lay.slots.mine), bool)
      pending = rewards_lib.ScoredElsewhere(list(c.reward.fns), len(lay.slots.mine))
    self.event('rewards_submitted', num=len(slot_prompts))
    if x0 is None:
      x0 = lay.my_groups(self.task.data(k_data, global_cond))
    data = DataBatch(x0=lay.data_from_groups(x0), cond=lay.data_from_groups(cond))
    data = hosts.assemble(data, self._data_sharding(b), b)
    return RolloutBatch(traj=traj, rewards=None, cond=slots), pending, valid, data

  def await_rewards(self, pending, valid):
    """(B*N, R) float32 rewards of all slots (on every process); NaN for failed or invalid samples.

    Each lead's scores of its rows are exchanged between processes (a small all-gather), as are the
    failure counts, so every process sees the same matrix and counts."""
    result = pending.result()
    names = list(self.config.reward.fns)
    mine = result.matrix(names)
    mine[~np.asarray(valid, bool)] = np.nan
    first = rewards_lib.errors_by_kind(result.errors)
    for kind, count in sorted(result.failures.items()):   # one line per kind per iteration
      if count:
        logger.warning('reward failures (%s): %d score(s) this iteration, NaN and not trained on; '
                       'first: %s', kind, count, first.get(kind, first.get('other', '')))
    kinds = sorted(result.failures)
    split = self.layout.slots
    rewards = hosts.exchange(mine, split)
    failures = split.lead_entries(hosts.allgather(np.asarray([result.failures[k] for k in kinds],
                                                             np.int64)))
    failures = dict(zip(kinds, failures.sum(axis=0).tolist()))
    if np.isfinite(rewards).all(axis=1).any():
      self._failed_batches = 0
    else:
      self._failed_batches += 1
      if self._failed_batches >= self.config.reward.max_failed_batches:
        raise rewards_lib.RewardServiceError(
            f'{self._failed_batches} reward batches in a row failed completely '
            f'(config.reward.max_failed_batches); last errors: {result.errors[:3]}')
    counts = {f'reward_failures/{k}': float(v) for k, v in failures.items()}
    return rewards, counts

  def train_iteration(self, it):
    """One iteration: rollouts -> rewards submitted -> data gradient -> rewards -> update."""
    c = self.config
    self.events = []
    t0 = time.perf_counter()
    rollout, pending, valid, data = self.collect(it)
    t1 = time.perf_counter()
    key = self.iteration_keys(it)[3]
    grads, data_metrics = jax.block_until_ready(
        self._data_grads(model_params(self.state), rollout, data, key))
    overlapped = not pending.done()
    self.event('data_grad_done', rewards_pending=overlapped)
    t2 = time.perf_counter()
    rewards, counts = self.await_rewards(pending, valid)
    self.event('rewards_ready')
    t3 = time.perf_counter()
    mine = rewards[self.layout.slots.mine]
    rollout = rollout._replace(rewards=hosts.assemble(mine, self.plan.batch(), rewards.shape[0]))
    self.state, metrics = self._update(self.state, rollout, grads, key)
    metrics = combine_metrics(metrics, data_metrics, c)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    self.event('update_done')
    t4 = time.perf_counter()
    if self.loader is not None:
      seen, skipped = self._records_counted()
      counts.update(data_records_seen=seen, data_records_skipped=skipped)
    t_rollout = next(t for name, t, _ in self.events if name == 'rollout_done') - t0
    metrics.update(counts, **self._cond_metrics, time_rollout_and_submit=t1 - t0, time_data_grad=t2 - t1,
                   time_reward_wait=t3 - t2, time_update=t4 - t3, time_reward_overlap=float(overlapped),
                   time_rollout=t_rollout)
    metrics.update(self._flops_metrics(metrics, t_rollout + (t2 - t1) + (t4 - t3)))
    return metrics

  def _flops_metrics(self, metrics, compute_s):
    """flops_per_iteration (model FLOPs, `ddrl_jax.flops`, with the rollout's measured nfe) and, from
    the second iteration of the built functions on (the first compiles them), achieved_flops_per_s and
    mfu (when the chips' peak is known).

    compute_s, the time divided by, is the network's part of the iteration: the rollout (to its
    results), the data gradient and the update. It leaves out the reward wait and the decode and
    submission of the samples, whose work the FLOPs do not count (time_reward_wait shows the wait)."""
    first, self._compiled = not self._compiled, True
    if self.forward_flops is None:
      return {}
    total = flops_lib.iteration_flops(self.config, self.forward_flops, metrics['nfe_rollout']).total
    out = {'flops_per_iteration': total, 'time_compute': compute_s}
    if not first:
      out.update(flops_lib.throughput_metrics(total, compute_s, self.peak_flops))
    return out

  def _records_counted(self):
    """(records read, records skipped) over all loader shards (each shard counted once)."""
    lay = self.layout
    table = hosts.allgather(np.asarray([lay.shard_index, self.loader.records_seen,
                                        self.loader.num_skipped], np.int64))
    first = {}
    for shard, seen, skipped in table.tolist():
      first.setdefault(shard, (seen, skipped))
    return float(sum(v[0] for v in first.values())), float(sum(v[1] for v in first.values()))

  def evaluate(self, it, judges=None):
    """Metrics of samples of the fixed evaluation conditions, the same on every process.

    judges: {name: reward(media, prompts) -> (M,)} scoring the decoded samples with their prompts on each
    row set's lead (`judge/<name>`, `judge/<name>_failed`; tasks with images or videos).

    Tasks whose metrics are means over samples (OCR, video) are evaluated per row set, each by its
    lead process on its own rows, and the metrics averaged across processes weighted by rows; tasks
    with `eval_needs_all_samples` (toy2d's sliced Wasserstein distances) gather the samples to every
    process instead. Process 0 writes the grid of the first samples."""
    c = self.config
    dp = parallel.data_parallel_size(self.mesh)
    slots = max(dp, c.eval_samples // dp * dp)
    groups = slots // c.num_rollouts if slots % c.num_rollouts == 0 else slots
    root = jax.random.fold_in(self.rng, 0xE7A1)
    key = jax.random.fold_in(root, it)
    # The same evaluation conditions at every evaluation (held-out ones when the task has them).
    make_cond = self.task.eval_conditions
    host_cond = jax.device_get(rl_lib.repeat_groups(make_cond(root, groups), slots // groups))
    split = hosts.row_split(self.plan.batch(), slots)
    my_cond = jax.tree.map(lambda a: np.asarray(a)[split.mine], host_cond)
    cond = hosts.assemble(my_cond, self.plan.batch(), slots)
    gather_all = self.task.eval_needs_all_samples
    out = {}
    for name, params in (('eval', self.state.params), ('eval_ema', self.state.ema_params)):
      if params is None:
        continue
      samples = self._sample(model_params(self.state, params), cond, key)
      if gather_all:
        host = hosts.gather_global(samples).reshape((-1,) + self.task.sample_shape)
        metrics = self.task.evaluate(host, key, cond=host_cond)
      else:
        mine = split.is_lead and hosts.local_values(samples, split.mine).reshape(
            (-1,) + self.task.sample_shape)
        kwargs = dict(score=self._reward_scorer()) if getattr(
            self.task, 'eval_scores_with_rewards', False) and split.is_lead else {}
        metrics = self.task.evaluate(mine, key, cond=my_cond, **kwargs) if split.is_lead else None
        if judges and split.is_lead:
          media, _ = self.task.reward_inputs(mine, my_cond)
          prompts = self.task.prompts(my_cond)
          metrics.update(rewards_lib.registry.judge_columns(judges, media, prompts))
        metrics = hosts.mean_over_leads(metrics, len(split.mine), split)
      out.update({f'{name}/{k}': v for k, v in metrics.items()})
      self.write_samples(name, it, samples, host_cond)
    return out

  def _reward_scorer(self):
    """fn(media, prompts) -> {reward name: (M,) scores}: the run's rewards (config.reward.fns) through its
    reward service, NaN where a sample could not be scored (for tasks with `eval_scores_with_rewards`)."""
    if self.rewards is None:
      self.rewards = rewards_lib.make_reward_service(self.config.reward, mesh=self.reward_mesh())
    names = list(self.config.reward.fns)

    def score(media, prompts):
      result = self.rewards.submit(media, list(prompts)).result()
      for message in result.errors[:5]:
        logger.warning('evaluation reward: %s', message)
      return dict(zip(names, result.matrix(names).T))
    return score

  def write_samples(self, name, it, samples, cond, max_samples=32):
    """An image grid of the first evaluation samples (same conditions and seed at every evaluation),
    written by process 0, for tasks whose reward inputs are images (M, H, W, 3) or videos
    (M, F, H, W, 3: one row of frames each). `samples` may be a global jax.Array.

    Videos also give one MP4 per sample for the first `config.eval_videos` samples,
    samples/<name>_<step:06d>_<i>.mp4 at `config.eval_video_fps` (video_io.write_mp4), and, side by
    side in one animated GIF, the TensorBoard image `<name>/videos` (kept in `self.eval_videos` for
    _evaluate_and_write's writer)."""
    first = samples[:max_samples]
    first = hosts.gather_global(first) if isinstance(first, jax.Array) else np.asarray(first)
    if not distributed.is_main_process():
      return
    first = first.reshape((-1,) + self.task.sample_shape)
    media, _ = self.task.reward_inputs(first, jax.tree.map(lambda a: a[:max_samples], cond))
    media = np.asarray(media)
    if media.dtype != np.uint8 or media.ndim not in (4, 5) or media.shape[-1] != 3:
      return
    columns = 8
    if media.ndim == 5:            # videos: sample i's frames on row i
      self.write_videos(name, it, media)
      columns = media.shape[1]
      media = media[:8].reshape((-1,) + media.shape[2:])
    self.last_samples = os.path.join(self.workdir, 'samples', f'{name}_{it:06d}.png')
    image_grid.write_grid(self.last_samples, media, columns)

  def write_videos(self, name, it, videos):
    """The first config.eval_videos of uint8 videos (M, F, H, W, 3) as MP4s under samples/ (process 0;
    without imageio-ffmpeg a warning once instead) and as the TensorBoard video `<name>/videos`."""
    c = self.config
    count = min(c.eval_videos, videos.shape[0])
    if count <= 0:
      return
    fps = c.eval_video_fps
    paths = [os.path.join(self.workdir, 'samples', f'{name}_{it:06d}_{i}.mp4') for i in range(count)]
    try:
      for path, video in zip(paths, videos[:count]):
        video_io.write_mp4(path, video, fps)
      self.last_videos = os.path.join(self.workdir, 'samples', f'{name}_{it:06d}_*.mp4')
    except ImportError as e:
      if not self._warned_mp4:
        logging.warning('no MP4s of the evaluation videos: %s', e)
        self._warned_mp4 = True
    self.eval_videos[f'{name}/videos'] = video_io.tile_videos(videos[:count])

  def train(self, progress=True):
    """Runs (or resumes) to config.num_iterations; returns the last logged metrics.

    A SIGTERM or SIGINT (or, on several hosts, JAX's preemption sync point) ends the loop after the
    running iteration with a checkpoint of it; `self.stopped_by` then names the signal.
    The first iteration (it compiles) and the step-0 evaluation are timed in one INFO line; the
    progress bar's s/it and time left (`self.pace`) count the iterations after the first.
    """
    c = self.config
    start = self.restore_or_init()
    if self.base_samples_dir and self.loader is None:
      self.synthesize_base_samples(start, progress=progress)
    self.event('restored', step=start)
    self._build()
    main = distributed.is_main_process()       # process 0 alone writes metrics and shows the bar
    writer = (metrics_lib.MetricWriter(self.workdir, resume_step=start) if main else
              metrics_lib.NullWriter())
    last = {}
    window = []
    bad_streak = 0                 # consecutive updates whose loss or parameters are non-finite
    self.stopped_by = None
    self.pace = console.Pace(c.num_iterations - start)
    shown = {}                     # the progress bar's averaged metrics
    bar = tqdm.tqdm(total=c.num_iterations, initial=start, disable=not (progress and main), desc=c.algorithm,
                    dynamic_ncols=True, bar_format=BAR_FORMAT)
    try:
      with preemption.PreemptionGuard() as guard:
        eval_s = None
        if start == 0 and c.eval_every >= 0:
          t0 = time.perf_counter()
          self._evaluate_and_write(writer, 0)
          eval_s = time.perf_counter() - t0
        for it in range(start, c.num_iterations):
          self.iteration = it
          self.event('iteration_start')
          t0 = time.perf_counter()
          metrics = self.train_iteration(it)
          self.pace.done(t0, time.perf_counter())
          if it == start:
            _log_above(bar, logging.INFO, console.startup_line(self.pace.first_s, eval_s))
          step = it + 1
          writer.write(step, metrics)
          window.append(metrics)
          last = metrics
          finite = bool(np.isfinite(metrics['loss'])) and metrics['params_finite'] == 1.0
          bad_streak = 0 if finite else bad_streak + 1
          if bad_streak:
            self._check_nonfinite(step, bad_streak, metrics)
          if step % c.log_every == 0 or step == c.num_iterations:
            avg = metrics_lib.average_metrics(window)
            window = []
            shown = dict(reward=f"{avg['reward_mean']:.3f}", loss=f"{avg['loss']:.4g}",
                         **_throughput_postfix(avg))
          bar.set_postfix_str(_bar_postfix(self.pace, shown), refresh=False)
          bar.update(1)
          if not bad_streak and (c.eval_every > 0 and step % c.eval_every == 0 or
                                 step == c.num_iterations):
            self._evaluate_and_write(writer, step)
          stop = guard.should_stop(step)
          if not bad_streak and (step % c.checkpoint_every == 0 or step == c.num_iterations or stop):
            self.save()
          if stop:
            self.stopped_by = guard.received
            writer.flush()
            where = (f'checkpoint {self._step_dir(step)}' if not bad_streak else
                     f'the last finite checkpoint (step {self.ckpt.latest_step()})')
            _log_above(bar, logging.INFO, 'stopped by %s after step %d of %d; saved %s. Rerun the same '
                       'command to resume.', guard.received, step, c.num_iterations, where)
            break
    finally:
      self.iteration = None
      bar.close()
      self.ckpt.wait_until_finished()
      writer.close()
      self.close_rewards()
    return last

  def _evaluate_and_write(self, writer, step):
    """Evaluates at `step`, writes the row and keeps it as `last_evaluation`."""
    self.eval_videos = {}
    metrics = self.evaluate(step)
    writer.write(step, metrics)
    writer.write_videos(step, self.eval_videos, self.config.eval_video_fps)
    self.eval_videos = {}
    self.last_evaluation = dict(step=step, **metrics)

  def run_summary(self):
    """What `console.summary_table` shows of the last train() besides its final metrics."""
    latest = self.ckpt.latest_step()
    pace = self.pace or console.Pace(0)
    return dict(evaluation=self.last_evaluation, seconds_per_iteration=pace.seconds_per_iteration,
                first_iteration_s=pace.first_s, samples=self.last_samples, videos=self.last_videos,
                checkpoint=None if latest is None else self._step_dir(latest))

  def _check_nonfinite(self, step, streak, metrics):
    """Logs a non-finite update; raises NonFiniteTrainingError after config.max_nonfinite_steps."""
    what = ', '.join(k for k, bad in (('loss', not np.isfinite(metrics['loss'])),
                                      ('parameters', metrics['params_finite'] != 1.0)) if bad)
    logger.warning('step %d: non-finite %s (%d in a row; %d non-finite gradient entries zeroed); '
                   'not checkpointed', step, what, streak, int(metrics['nonfinite_grads']))
    if streak >= self.config.max_nonfinite_steps:
      latest = self.ckpt.latest_step()
      kept = (f'the last good checkpoint, step {latest}, is kept in {self.ckpt_dir}'
              if latest is not None else 'no checkpoint was written before it')
      raise NonFiniteTrainingError(
          f'non-finite {what} for {streak} updates in a row (config.max_nonfinite_steps = '
          f'{self.config.max_nonfinite_steps}), up to step {step}; {kept}. Lower '
          f'config.optim.learning_rate or check the rewards and data.')

  def close_rewards(self):
    if self.rewards is not None:
      self.rewards.close()
      self.rewards = None
