"""Train state, the jitted DDRL/GRPO update, and the rollout -> reward -> update loop.

One iteration: B conditions -> N rollouts each (jitted, scan over T, vmap over N) -> decoded samples
submitted to the reward service -> the diffusion-loss gradient, computed while the rewards are pending ->
the policy gradient once they arrive, added to it in the jitted update -> AdamW -> power EMA.

Fault tolerance: SIGTERM/SIGINT stop after the current iteration with a checkpoint (ddrl_jax.preemption);
a resume restores the newest checkpoint that passes its integrity record and whose config matches
(ddrl_jax.checkpoints), moving damaged ones aside, and re-runs the lost steps exactly (every key derives
from the root key and the step). Setting DDRL_EVENT_LOG=<file> appends each iteration event there
(benchmarks/fault_tolerance.py uses it to kill the process at chosen moments).
"""
import json
import logging
import os
import shutil
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm

from ddrl_jax import checkpoints as checkpoints_lib
from ddrl_jax import config as config_lib
from ddrl_jax import image_grid
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import optim
from ddrl_jax import parallel
from ddrl_jax import preemption
from ddrl_jax import rewards as rewards_lib
from ddrl_jax import rl as rl_lib
from ddrl_jax import sampling
from ddrl_jax import tasks
from ddrl_jax.data import pipeline as data_pipeline
from ddrl_jax.data import records as data_records
from ddrl_jax.parallel import rules as rules_lib


class TrainState(NamedTuple):
  step: Any            # () int32: optimizer steps taken
  params: Any          # fp32 master parameters
  opt_state: Any
  ema_params: Any      # power EMA of params (None if disabled)
  ref_params: Any      # frozen reference (flow_grpo with kl_beta > 0 only; None otherwise)


class RolloutBatch(NamedTuple):
  """Rollouts as the trainer shards them: one rollout per slot, B*N slots over (data, fsdp).

  cosmos-rl runs one rollout per data-parallel instance (16 groups x 8 = 128 instances), so the slot
  axis, not the group axis, is what must divide the mesh. Slot b*N + n is rollout n of group b.
  """
  traj: sampling.Trajectory   # (B*N, 1, ...)
  rewards: Any                # (B*N, R) float32, one column per reward; NaN/Inf = failed sample
  cond: Any                   # pytree of (B*N, ...): each group's condition repeated N times


def flat_rollout_batch(traj, rewards, cond):
  """A `RolloutBatch` from group-layout rollouts: traj (B, N, ...), rewards (B, N[, R]), cond (B, ...)."""
  b, n = rewards.shape[:2]
  flat = lambda a: a.reshape((b * n, 1) + a.shape[2:])
  return RolloutBatch(traj=jax.tree.map(flat, traj), rewards=jnp.reshape(rewards, (b * n, -1)),
                      cond=rl_lib.repeat_groups(cond, n))


def group_rollout_batch(rollout, n):
  """Inverse of `flat_rollout_batch`: (traj (B, N, ...), rewards (B, N, R), cond (B, ...))."""
  group = lambda a: a.reshape((a.shape[0] // n, n) + a.shape[2:])
  cond = jax.tree.map(lambda a: a.reshape((a.shape[0] // n, n) + a.shape[1:])[:, 0], rollout.cond)
  rewards = None if rollout.rewards is None else rollout.rewards.reshape(
      (-1, n) + rollout.rewards.shape[1:])
  return jax.tree.map(group, rollout.traj), rewards, cond


class DataBatch(NamedTuple):
  """Clean data paired with the B group conditions (replicated: B need not divide the mesh)."""
  x0: Any                     # (B, *S)
  cond: Any                   # pytree of (B, ...)


def compute_advantages(rewards, config):
  """(B, N, R) rewards -> (B, N) advantages by config.rl's transform and config.reward's combination."""
  b, n, _ = rewards.shape
  rl = config.rl
  if rl.adv_transform == 'exact':
    single = lambda r: rl_lib.exact_tilt_advantages(r, n, rl.exact_beta, rl.exact_log_partition)
  else:
    single = lambda r: rl_lib.group_advantages(r, n, clip=rl.adv_clip, eps=rl.adv_eps,
                                               transform=rl.adv_transform or None)
  weights = list(config.reward.fns.values())
  adv = rl_lib.multi_reward_advantages(rewards.reshape(b * n, -1), weights, single,
                                       config.reward.combine)
  return adv.reshape(b, n)


def make_sampler(config):
  s = config.sampler
  return sampling.make_sampler(config_lib.sampler_kind(config), s.num_steps, sigma_min=s.sigma_min,
                               sigma_max=s.sigma_max, rho=s.rho, s_churn=s.s_churn,
                               s_noise=s.s_noise, shift=s.shift, noise_level=s.noise_level,
                               eta=s.eta)


def init_train_state(params, config, optimizer):
  algo = rl_lib.get_algorithm(config.algorithm)
  copy = lambda p: jax.tree.map(jnp.array, p)
  return TrainState(
      step=jnp.int32(0), params=params, opt_state=optimizer.init(params),
      ema_params=copy(params) if config.optim.ema_power_s else None,
      ref_params=copy(params) if algo.uses_reference and config.rl.kl_beta > 0 else None)


def make_update_fns(apply_fn, sampler, config, optimizer, cast_params=None):
  """The update in two pure halves, so the data term can run while rewards are pending.

    data_grads(params, rollout, data, key) -> (grads, metrics)      needs no rewards
    update(state, rollout, data, grads, key) -> (state, metrics)     adds the policy gradient

  `grads` is the float32 gradient of loss_scale * data_beta * the diffusion loss (None for algorithms
  without a data term). Both halves draw the trained steps and the loss noise from `key` exactly as
  `rl_loss` does, so update(state, .., data_grads(state.params, ..)[0], key) equals one fused step.
  Gradients are accumulated one trained step at a time (`rl.rl_loss_and_grad`), so memory does not grow
  with the number of trained steps. `cast_params` (e.g. the task's bf16 compute copy) is applied to the
  parameters once, before the step scan; gradients are taken with respect to that copy.
  """
  cast_params = cast_params or (lambda p: p)
  algo = rl_lib.get_algorithm(config.algorithm)
  rl = config.rl
  pool = config_lib.train_steps(config)
  gamma = optim.power_ema_gamma(config.optim.ema_power_s) if config.optim.ema_power_s else None
  lr_schedule = optim.learning_rate_schedule(config.optim)
  use_data = algo.uses_data and rl.data_beta > 0

  def prepare(rollout, key):
    k_steps, k_loss = jax.random.split(key)
    traj, rewards, cond = group_rollout_batch(rollout, config.num_rollouts)
    b, n = traj.x0.shape[:2]
    steps = algo.select_steps(k_steps, b, n, pool, rl.train_fraction)
    return traj, rewards, cond, steps, k_loss

  def data_term(data):
    return rl_lib.DataTerm(x0=data.x0, cond=data.cond, beta=rl.data_beta, steps=rl.data_loss_steps,
                           noise=rl.data_noise, cond_dropout=rl.cond_dropout,
                           weighting=rl.data_weighting)

  def data_grads(params, rollout, data, key):
    if not use_data:
      return None, {}
    traj, _, _, steps, k_loss = prepare(rollout, key)
    value, grads = rl_lib.data_loss_and_grad(apply_fn, cast_params(params), sampler, traj, steps,
                                             data_term(data), k_loss)
    scale = rl.loss_scale * rl.data_beta
    return jax.tree.map(lambda g: scale * g, grads), {'data_loss': value}

  def update(state, rollout, grads_data, key):
    traj, rewards, cond, steps, k_loss = prepare(rollout, key)
    advantages = compute_advantages(rewards, config)
    ref = None if state.ref_params is None else cast_params(state.ref_params)
    _, metrics, grads = algo.loss_and_grad(apply_fn, cast_params(state.params), ref, sampler, traj,
                                           advantages, steps, rollout.cond, None, k_loss, rl)
    if grads_data is not None:
      grads = jax.tree.map(jnp.add, grads, grads_data)
    grads, nonfinite = optim.zero_nonfinite(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    ema = state.ema_params
    if ema is not None:
      beta = optim.power_ema_beta(state.step, gamma)
      ema = optim.ema_update(ema, params, beta)
      metrics['ema_beta'] = beta
    failed = ~jnp.isfinite(rewards).all(-1)   # any non-finite reward = failed sample (advantage 0)
    valid = jnp.where(failed[..., None], 0.0, rewards)
    num_valid = jnp.maximum((~failed).sum(), 1)
    weights = jnp.asarray(list(config.reward.fns.values()), jnp.float32)
    for i, name in enumerate(config.reward.fns):
      metrics[f'reward/{name}'] = valid[..., i].sum() / num_valid
    params_finite = jnp.all(jnp.stack([jnp.isfinite(p).all() for p in jax.tree.leaves(params)]))
    metrics.update(
        reward_mean=(valid @ weights).sum() / num_valid,
        failed_rewards=failed.sum(), adv_mean=advantages.mean(), adv_abs_mean=jnp.abs(advantages).mean(),
        grad_norm=optax.tree.norm(grads), nonfinite_grads=nonfinite, params_finite=params_finite,
        learning_rate=lr_schedule(state.step), nfe_rollout=traj.nfe.mean())
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, ema_params=ema,
                           ref_params=state.ref_params)
    return new_state, metrics

  return data_grads, update


def combine_metrics(metrics, data_metrics, config):
  """Adds the data term's metrics to the update's; 'loss' becomes the total loss."""
  metrics = dict(metrics)
  if 'data_loss' in data_metrics:
    metrics['data_loss'] = data_metrics['data_loss']
    metrics['loss'] = metrics['loss'] + config.rl.loss_scale * config.rl.data_beta * \
        data_metrics['data_loss']
  return metrics


def make_train_step(apply_fn, sampler, config, optimizer, cast_params=None):
  """The fused pure update (state, rollout, data, key) -> (state, metrics); jit with `jit_train_step`."""
  data_grads, update = make_update_fns(apply_fn, sampler, config, optimizer, cast_params)

  def train_step(state, rollout, data, key):
    grads, data_metrics = data_grads(state.params, rollout, data, key)
    state, metrics = update(state, rollout, grads, key)
    return state, combine_metrics(metrics, data_metrics, config)

  return train_step


def jit_train_step(train_step, plan, state_shardings):
  """jit of the fused step with the plan's shardings: state by the logical rules (donated), rollouts split
  on B*N over (data, fsdp), the data batch as placed (`place_data`), metrics replicated."""
  rep = plan.replicated()
  return jax.jit(plan.scope(train_step), in_shardings=(state_shardings, plan.batch(), None, rep),
                 out_shardings=(state_shardings, rep), donate_argnums=(0,))


def make_sample_fn(sampler, apply_fn, sample_shape, mesh, param_shardings=None, plan=None,
                   cast_params=None):
  """jit of (params, cond (M, ...), key) -> (M, 1, *sample_shape) final samples, one per slot.

  Parameters are replicated unless `param_shardings` (with its `plan`) is given."""
  plan = plan or parallel.ShardingPlan.from_config({}, mesh)
  cast_params = cast_params or (lambda p: p)
  params_sh = param_shardings if param_shardings is not None else plan.replicated()
  fn = lambda p, cond, k: sampler.sample(apply_fn, cast_params(p), cond, k, num_rollouts=1,
                                         sample_shape=sample_shape)
  return jax.jit(plan.scope(fn), in_shardings=(params_sh, plan.batch(), plan.replicated()),
                 out_shardings=plan.batch())


def place_data(plan, data):
  """A DataBatch on the mesh: each leaf's leading B axis over as many batch axes as divide B."""
  return jax.tree.map(lambda a: parallel.place(a, plan.sharding(('act_batch',), np.shape(a), 'data')),
                      data)


def _event_logger(path):
  """A hook appending '{"event": name, "time": t, **info}' lines to `path`, flushed at once."""
  f = open(path, 'a', buffering=1)

  def hook(name, info):
    f.write(json.dumps({'event': name, 'time': time.time(), 'pid': os.getpid(), **info},
                       default=str) + '\n')
    f.flush()

  return hook


def _state_to_tree(state, rng, rng_value=None):
  """The checkpointed dict of a TrainState (None fields left out) and the root key's data (or
  `rng_value` in its place, e.g. its sharding)."""
  tree = {k: v for k, v in state._asdict().items() if v is not None}
  tree['rng'] = jax.random.key_data(rng) if rng_value is None else rng_value
  return tree


class NonFiniteTrainingError(RuntimeError):
  """The loss or the parameters stayed non-finite for config.max_nonfinite_steps updates in a row."""


class Trainer:
  """Owns the mesh, task, jitted functions, checkpoints and metrics of one workdir."""

  def __init__(self, config, workdir, devices=None):
    devices = jax.devices() if devices is None else list(devices)
    config_lib.validate(config, len(devices))
    self.config = config
    self.workdir = os.path.abspath(workdir)
    self.mesh = parallel.make_mesh(config.mesh, devices)
    self.plan = parallel.ShardingPlan.from_config(config, self.mesh)
    self.state_shardings = None    # set by restore_or_init
    self.cast_params = None        # the task's compute-dtype copy of the parameters, if any
    self.task = tasks.get_task(config)
    self.sampler = make_sampler(config)
    self.optimizer = optim.make_optimizer(config.optim)
    self.rng = jax.random.key(config.seed)
    self.ckpt_dir = os.path.join(self.workdir, 'checkpoints')
    self.ckpt = self._checkpoint_manager()
    self.loader = self.make_loader()
    self.apply_fn = None
    self.state = None
    self.rewards = None            # the reward service, started by _build
    self._failed_batches = 0       # consecutive batches without one scored sample
    self.events = []               # (name, time, info) of the current iteration
    self.event_hooks = []          # callables (name, info), called at each event
    self.iteration = None          # the iteration running now (events carry it)
    self.stopped_by = None         # the signal that stopped the last train() early, if any
    if os.environ.get('DDRL_EVENT_LOG'):
      self.event_hooks.append(_event_logger(os.environ['DDRL_EVENT_LOG']))

  def _checkpoint_manager(self):
    return ocp.CheckpointManager(
        self.ckpt_dir,
        options=ocp.CheckpointManagerOptions(max_to_keep=self.config.max_checkpoints, create=True))

  def make_loader(self):
    """The record loader of config.data.path (one batch of B records per iteration), or None."""
    d = self.config.data
    if not d.path:
      return None
    if jax.process_count() > 1:
      raise NotImplementedError('config.data.path with several processes: per-host batches are read, '
                                'but assembling them into global arrays is not implemented yet')
    manifest = os.path.join(d.path, 'manifest.json') if os.path.isdir(d.path) else None
    expected = data_records.expected_from_manifest(d.path) if manifest and os.path.exists(
        manifest) else None
    return data_pipeline.RecordLoader(d.path, self.config.batch_size, seed=self.config.seed,
                                      shuffle=d.shuffle, expected=expected, skip_bad=d.skip_bad,
                                      worker_count=d.worker_count)

  # ------------------------------------------------------------------------------------- state
  def restore_or_init(self, read_only=False):
    """Restores the newest usable checkpoint of the workdir, or builds the initial state. Returns its step.

    Newest first, a checkpoint is skipped (with a warning naming it) when its files fail their
    integrity record or orbax cannot read it, and the damaged ones are moved to
    `checkpoints_damaged/` once an older one restores. A checkpoint written with another config
    raises `checkpoints.IncompatibleCheckpoint`; if every checkpoint is damaged the run stops with
    `checkpoints.DamagedCheckpoint` rather than start again from step 0.

    read_only: for readers of a workdir (evaluation, sampling): config differences are logged, not
    refused (the model's shapes must still match), and nothing is moved.
    """
    model_key = jax.random.fold_in(self.rng, 0x6D6F64)
    steps = sorted(self.ckpt.all_steps(), reverse=True)
    self.apply_fn, abstract_params = self.task.abstract_params(model_key)
    self._plan_state(abstract_params)
    if not steps:
      params = self._initial_params(model_key)
      init = jax.jit(lambda p: init_train_state(p, self.config, self.optimizer),
                     in_shardings=(self.state_shardings.params,), out_shardings=self.state_shardings)
      self.state = init(params)      # fresh buffers: the donating update never frees the task's arrays
    else:
      damaged = []
      for step in steps:
        try:
          self._restore(step, abstract_params, strict=not read_only)
          break
        except checkpoints_lib.IncompatibleCheckpoint:
          raise
        except Exception as e:  # pylint: disable=broad-except  (any read failure = damaged)
          why = f'{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ""}'
          logging.warning('checkpoint %s is damaged (%s); trying an older one',
                          self._step_dir(step), why)
          damaged.append((step, why))
      else:
        listing = '; '.join(f'{self._step_dir(s)}: {why}' for s, why in damaged)
        raise checkpoints_lib.DamagedCheckpoint(
            f'every checkpoint in {self.ckpt_dir} is damaged ({listing}). Not starting again from '
            f'step 0: move {self.ckpt_dir} away to do that.')
      if damaged and not read_only:
        self._set_aside([s for s, _ in damaged])
      logging.warning('resuming %s from step %d', self.workdir, int(self.state.step))
    return int(self.state.step)

  def _plan_state(self, abstract_params):
    """Shardings of the train state by the logical rules, checked and logged (per-device bytes)."""
    abstract_state = jax.eval_shape(
        lambda p: init_train_state(p, self.config, self.optimizer), abstract_params)
    self.state_shardings = self.plan.state(abstract_state, self.optimizer)
    report = self.plan.check_params(abstract_state.params, self.state_shardings.params)
    opt = rules_lib.sharding_report(abstract_state.opt_state, self.state_shardings.opt_state)
    logging.info('mesh %s: parameters %.3f GiB per device of %.3f GiB (%.2f%% replicated), optimizer '
                 'state %.3f GiB per device', dict(self.mesh.shape), report['per_device_bytes'] / 2**30,
                 report['total_bytes'] / 2**30, 100 * report['replicated_fraction'],
                 opt['per_device_bytes'] / 2**30)
    self.sharding_report = dict(params=report, opt_state=opt)
    self.cast_params = getattr(self.task, 'cast_params', None)

  def _initial_params(self, key):
    """Initial parameters placed shard by shard: the task's sharded init when it has one (the Cosmos
    DiT: jit with out_shardings, or converted weights from host memory), else its init_model's result
    placed with make_array_from_callback (small models, e.g. after toy2d's pretraining)."""
    shardings = self.state_shardings.params
    if hasattr(self.task, 'init_params_sharded'):
      return self.task.init_params_sharded(key, shardings)
    _, params = self.task.init_model(key)
    return parallel.place(params, shardings)

  def _step_dir(self, step):
    return os.path.join(self.ckpt_dir, str(step))

  def _restore(self, step, abstract_params, strict=True):
    """Restores checkpoint `step` into self.state / self.rng (and the loader), after checking it."""
    path = self._step_dir(step)
    if checkpoints_lib.is_local(path):
      checkpoints_lib.verify(path)
    metadata = self.ckpt.item_metadata(step)
    if 'config' not in metadata:
      raise checkpoints_lib.DamagedCheckpoint(f'{path}: no config item')
    saved = self.ckpt.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
    if strict:
      changed = checkpoints_lib.check_compatible(saved, self.config.to_dict(), path)
    else:
      changed = sum(checkpoints_lib.config_differences(saved, self.config.to_dict()), [])
    for key, old, new in changed:
      logging.warning('resuming %s with %s changed: %r -> %r', path, key, old, new)
    abstract_state = jax.eval_shape(
        lambda p: init_train_state(p, self.config, self.optimizer), abstract_params)
    target = _state_to_tree(abstract_state, self.rng)
    # Restore onto this run's mesh and rules, whatever topology wrote the checkpoint (e.g. 8 devices -> 1):
    # orbax reads each device's own slices.
    shardings = _state_to_tree(self.state_shardings, None, self.plan.replicated())
    target = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), target,
                          shardings)
    items = dict(state=ocp.args.StandardRestore(target))
    if self.loader is not None:
      if 'data' not in metadata:
        raise checkpoints_lib.IncompatibleCheckpoint(
            f'{path} has no data-iterator state, but config.data.path is set: it was written by a '
            f'run without records')
      items['data'] = data_pipeline.restore_args(self.loader)   # restores the loader in place
    restored = self.ckpt.restore(step, args=ocp.args.Composite(**items))['state']
    rng = jax.random.wrap_key_data(restored.pop('rng'))
    state = TrainState(**{f: restored.get(f) for f in TrainState._fields})
    if int(state.step) != step:
      raise checkpoints_lib.DamagedCheckpoint(f'{path}: holds step {int(state.step)}, not {step}')
    self.rng, self.state = rng, state

  def _set_aside(self, steps):
    """Moves damaged step directories to <workdir>/checkpoints_damaged/ (a later save reuses the step)."""
    if jax.process_index() == 0:
      dest = os.path.join(self.workdir, 'checkpoints_damaged')
      os.makedirs(dest, exist_ok=True)
      for step in steps:
        target = os.path.join(dest, f'{step}_{time.strftime("%Y%m%d-%H%M%S")}')
        shutil.move(self._step_dir(step), target)
        logging.warning('moved damaged checkpoint %s to %s', self._step_dir(step), target)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices('ddrl_jax: damaged checkpoints set aside')
    self.ckpt.close()
    self.ckpt = self._checkpoint_manager()

  def save(self):
    """Saves the state (and loader and config) at its step, waits for the commit, then records the
    files' integrity. Synchronous, so a stop or kill after it returns never loses this step."""
    step = int(self.state.step)
    self.event('checkpoint_start', step=step)
    items = dict(state=ocp.args.StandardSave(_state_to_tree(self.state, self.rng)),
                 config=ocp.args.JsonSave(self.config.to_dict()))
    if self.loader is not None:
      items['data'] = data_pipeline.save_args(self.loader)
    self.ckpt.save(step, args=ocp.args.Composite(**items), force=True)
    self.ckpt.wait_until_finished()
    path = self._step_dir(step)
    if self.config.checkpoint_checksums and jax.process_index() == 0 and checkpoints_lib.is_local(path):
      checkpoints_lib.write_integrity(path)
    self.event('checkpoint_done', step=step)

  # --------------------------------------------------------------------------------------- loop
  def _build(self):
    c = self.config
    plan, sh = self.plan, self.state_shardings
    batch, rep = plan.batch(), plan.replicated()
    sampler, apply_fn, shape = self.sampler, self.apply_fn, self.task.sample_shape
    cast = self.cast_params or (lambda p: p)
    # Rollouts take slot conditions (B*N, ...) and make one rollout per slot.
    rollout = lambda p, cond, k: sampler.rollout(apply_fn, cast(p), cond, k, num_rollouts=1,
                                                 sample_shape=shape)
    self._rollout = jax.jit(plan.scope(rollout), in_shardings=(sh.params, batch, rep),
                            out_shardings=batch)
    self._sample = make_sample_fn(sampler, apply_fn, shape, self.mesh, sh.params, plan, cast)
    data_grads, update = make_update_fns(apply_fn, sampler, c, self.optimizer, cast)
    grads_sh = sh.params if self._uses_data_grads() else None
    self._data_grads = jax.jit(plan.scope(data_grads), in_shardings=(sh.params, batch, None, rep),
                               out_shardings=(grads_sh, rep))
    # The update replaces the state and consumes the data gradient: both are donated.
    self._update = jax.jit(plan.scope(update), in_shardings=(sh, batch, grads_sh, rep),
                           out_shardings=(sh, rep), donate_argnums=(0, 2))
    if self.rewards is None:
      self.rewards = rewards_lib.make_reward_service(c.reward)
      if hasattr(self.rewards, 'check'):
        self.rewards.check()

  def _uses_data_grads(self):
    algo = rl_lib.get_algorithm(self.config.algorithm)
    return algo.uses_data and self.config.rl.data_beta > 0

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

    Returns (rollout without rewards, pending rewards, sample validity (B*N,), data batch).
    """
    c = self.config
    k_cond, k_roll, k_data, _ = self.iteration_keys(it)
    batch = self.plan.batch()
    if self.loader is None:
      cond = self.task.conditions(k_cond, c.batch_size)
      x0, prompts = None, self.task.prompts(cond)     # x0 is made while the rewards are scored
    else:   # one record per group: its condition and clean sample, used by every trained step
      records = next(self.loader)
      cond, x0 = self.task.from_records(records, k_cond)
      prompts = list(records['prompt'])
    slots = jax.tree.map(lambda a: np.repeat(np.asarray(a), c.num_rollouts, axis=0), cond)
    slots = parallel.place(slots, jax.tree.map(lambda _: batch, slots))
    traj = jax.block_until_ready(self._rollout(self.state.params, slots, k_roll))
    self.event('rollout_done')
    media, valid = self.task.reward_inputs(traj.x0[:, 0], slots)
    slot_prompts = [p for p in prompts for _ in range(c.num_rollouts)]
    pending = self.rewards.submit(media, slot_prompts)
    self.event('rewards_submitted', num=len(slot_prompts))
    if x0 is None:
      x0 = self.task.data(k_data, cond)
    data = place_data(self.plan, DataBatch(x0=x0, cond=cond))
    return RolloutBatch(traj=traj, rewards=None, cond=slots), pending, valid, data

  def await_rewards(self, pending, valid):
    """(B*N, R) float32 rewards of a pending request; NaN for failed or invalid samples."""
    result = pending.result()
    names = list(self.config.reward.fns)
    rewards = result.matrix(names)
    rewards[~np.asarray(valid, bool)] = np.nan
    for message in result.errors[:5]:
      logging.warning('reward: %s', message)
    if np.isfinite(rewards).all(axis=1).any():
      self._failed_batches = 0
    else:
      self._failed_batches += 1
      if self._failed_batches >= self.config.reward.max_failed_batches:
        raise rewards_lib.RewardServiceError(
            f'{self._failed_batches} reward batches in a row failed completely '
            f'(config.reward.max_failed_batches); last errors: {result.errors[:3]}')
    counts = {f'reward_failures/{k}': float(v) for k, v in result.failures.items()}
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
        self._data_grads(self.state.params, rollout, data, key))
    overlapped = not pending.done()
    self.event('data_grad_done', rewards_pending=overlapped)
    t2 = time.perf_counter()
    rewards, counts = self.await_rewards(pending, valid)
    self.event('rewards_ready')
    t3 = time.perf_counter()
    rollout = rollout._replace(rewards=parallel.place(rewards, self.plan.batch()))
    self.state, metrics = self._update(self.state, rollout, grads, key)
    metrics = combine_metrics(metrics, data_metrics, c)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    self.event('update_done')
    t4 = time.perf_counter()
    if self.loader is not None:
      counts.update(data_records_seen=float(self.loader.records_seen),
                    data_records_skipped=float(self.loader.num_skipped))
    metrics.update(counts, time_rollout_and_submit=t1 - t0, time_data_grad=t2 - t1,
                   time_reward_wait=t3 - t2, time_update=t4 - t3, time_reward_overlap=float(overlapped))
    return metrics

  def evaluate(self, it):
    c = self.config
    dp = parallel.data_parallel_size(self.mesh)
    slots = max(dp, c.eval_samples // dp * dp)
    groups = slots // c.num_rollouts if slots % c.num_rollouts == 0 else slots
    root = jax.random.fold_in(self.rng, 0xE7A1)
    key = jax.random.fold_in(root, it)
    # The same evaluation conditions at every evaluation (held-out ones when the task has them).
    make_cond = getattr(self.task, 'eval_conditions', self.task.conditions)
    cond = rl_lib.repeat_groups(make_cond(root, groups), slots // groups)
    host_cond = jax.device_get(cond)
    cond = parallel.place(jax.device_get(cond), jax.tree.map(lambda _: self.plan.batch(), cond))
    out = {}
    for name, params in (('eval', self.state.params), ('eval_ema', self.state.ema_params)):
      if params is None:
        continue
      samples = np.asarray(self._sample(params, cond, key)).reshape((-1,) + self.task.sample_shape)
      metrics = self.task.evaluate(samples, key, cond=host_cond)
      out.update({f'{name}/{k}': v for k, v in metrics.items()})
      self.write_samples(name, it, samples, host_cond)
    return out

  def write_samples(self, name, it, samples, cond, max_samples=32):
    """An image grid of evaluation samples (same conditions and seed at every evaluation), for tasks
    whose reward inputs are images (M, H, W, 3) or videos (M, F, H, W, 3: one row of frames each)."""
    media, _ = self.task.reward_inputs(samples[:max_samples], jax.tree.map(lambda a: a[:max_samples], cond))
    media = np.asarray(media)
    if media.dtype != np.uint8 or media.ndim not in (4, 5) or media.shape[-1] != 3:
      return
    columns = 8
    if media.ndim == 5:            # videos: sample i's frames on row i
      columns = media.shape[1]
      media = media[:8].reshape((-1,) + media.shape[2:])
    image_grid.write_grid(os.path.join(self.workdir, 'samples', f'{name}_{it:06d}.png'), media, columns)

  def train(self, progress=True):
    """Runs (or resumes) to config.num_iterations; returns the last logged metrics.

    A SIGTERM or SIGINT (or, on several hosts, JAX's preemption sync point) ends the loop after the
    running iteration with a checkpoint of it; `self.stopped_by` then names the signal.
    """
    c = self.config
    start = self.restore_or_init()
    self.event('restored', step=start)
    self._build()
    writer = metrics_lib.MetricWriter(self.workdir, resume_step=start)
    last = {}
    window = []
    bad_streak = 0                 # consecutive updates whose loss or parameters are non-finite
    self.stopped_by = None
    bar = tqdm.tqdm(total=c.num_iterations, initial=start, disable=not progress, desc=c.algorithm,
                    dynamic_ncols=True)
    try:
      with preemption.PreemptionGuard() as guard:
        if start == 0 and c.eval_every >= 0:
          writer.write(0, self.evaluate(0))
        for it in range(start, c.num_iterations):
          self.iteration = it
          self.event('iteration_start')
          metrics = self.train_iteration(it)
          step = it + 1
          writer.write(step, metrics)
          window.append(metrics)
          last = metrics
          bar.update(1)
          finite = bool(np.isfinite(metrics['loss'])) and metrics['params_finite'] == 1.0
          bad_streak = 0 if finite else bad_streak + 1
          if bad_streak:
            self._check_nonfinite(step, bad_streak, metrics)
          if step % c.log_every == 0 or step == c.num_iterations:
            avg = metrics_lib.average_metrics(window)
            window = []
            bar.set_postfix(reward=f"{avg['reward_mean']:.3f}", loss=f"{avg['loss']:.4g}")
          if not bad_streak and (c.eval_every > 0 and step % c.eval_every == 0 or
                                 step == c.num_iterations):
            writer.write(step, self.evaluate(step))
          stop = guard.should_stop(step)
          if not bad_streak and (step % c.checkpoint_every == 0 or step == c.num_iterations or stop):
            self.save()
          if stop:
            self.stopped_by = guard.received
            writer.flush()
            where = (f'checkpoint {self._step_dir(step)}' if not bad_streak else
                     f'the last finite checkpoint (step {self.ckpt.latest_step()})')
            logging.warning('stopped by %s after step %d of %d; saved %s. Rerun the same command '
                            'to resume.', guard.received, step, c.num_iterations, where)
            break
    finally:
      self.iteration = None
      bar.close()
      self.ckpt.wait_until_finished()
      writer.close()
      self.close_rewards()
    return last

  def _check_nonfinite(self, step, streak, metrics):
    """Logs a non-finite update; raises NonFiniteTrainingError after config.max_nonfinite_steps."""
    what = ', '.join(k for k, bad in (('loss', not np.isfinite(metrics['loss'])),
                                      ('parameters', metrics['params_finite'] != 1.0)) if bad)
    logging.warning('step %d: non-finite %s (%d in a row; %d non-finite gradient entries zeroed); '
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
