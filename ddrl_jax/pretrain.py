"""Pretrain a task's base model with the diffusion loss alone: ``python -m ddrl_jax.pretrain --config=...``.

  python -m ddrl_jax.pretrain --config=configs/ocr_tiny.py --workdir=/tmp/ocr_pretrain

The task supplies `init_untrained` (random weights; else `init_model`) and
`pretrain_batch(step, B) -> (x0 (B, *S), cond)`, a deterministic stream, so a resumed run sees the same
batches as an uninterrupted one. Loss: the velocity MSE (rl.diffusion_loss.velocity_loss) at
t ~ U(0, 1) (config.pretrain.t_dist='uniform') or sigmoid(N(0, 1)) ('logit_normal', as SD3), with unit weight (config.pretrain.loss='v') or weight
max(t, min_t)^2 ('x0': the x0 MSE of an x-predicting model), the condition dropped with probability
config.pretrain.cond_dropout. AdamW with warmup and cosine decay, an EMA of the weights, orbax
checkpoints of the full state every `checkpoint_every` steps (resumed automatically), and a params-only
export of the EMA weights (`export`, what config.ocr.base_checkpoint loads) next to them. Every
`eval_every` steps the task evaluates EMA samples (deterministic sampler) and an image grid is written.
SIGTERM / SIGINT finish the running step, save the checkpoint and export, and exit 0 (a second signal
exits at once); rerunning the same command resumes, and metrics.jsonl drops the rows of re-run steps.
config.pretrain.init_from (a params export) starts from trained weights instead: fine-tuning, e.g. the
supervised fine-tuning of a shifted base on the target renders (benchmarks/ocr_table.py).
"""
import logging
import os
import queue
import threading
import time

from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm

from ddrl_jax import cli
from ddrl_jax import config as config_lib
from ddrl_jax import console
from ddrl_jax import distributed
from ddrl_jax import image_grid
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import params_io
from ddrl_jax import parallel
from ddrl_jax import preemption
from ddrl_jax import storage
from ddrl_jax import tasks
from ddrl_jax import trainer as trainer_lib
from ddrl_jax import xla_flags
from ddrl_jax.parallel import hosts
from ddrl_jax.rl import diffusion_loss

logger = logging.getLogger('ddrl_jax.pretrain')   # not __name__: it is '__main__' under python -m
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # relative init_from paths


def make_step(apply_fn, optimizer, c):
  """Jitted (params, opt_state, ema, x0, cond, key, step) -> (params, opt_state, ema, loss)."""

  def loss_fn(params, x0, cond, key):
    k_t, k_n, k_d = jax.random.split(key, 3)
    if c.t_dist == 'uniform':       # every noise level alike, incl. t > 0.85 where only the text helps
      t = jax.random.uniform(k_t, (x0.shape[0],), minval=1e-3, maxval=1.0)
    else:                           # 'logit_normal' (SD3): t > 0.85 only ~4% of the time
      t = jax.nn.sigmoid(jax.random.normal(k_t, (x0.shape[0],)))
    noise = jax.random.normal(k_n, x0.shape, x0.dtype)
    cond = diffusion_loss.drop_condition(cond, k_d, c.cond_dropout)
    # Weight t^2 turns the velocity MSE into the x0 MSE for an x-predicting model: every noise level
    # counts alike. Unit weight (the v-loss) puts ~100x more weight on t ~ 0.1 than on t ~ 0.9, where
    # the text decides the image, and the small OCR model then learned to ignore its text.
    weight = jnp.maximum(t, c.min_t)**2 if c.loss == 'x0' else jnp.ones_like(t)
    return diffusion_loss.velocity_loss(apply_fn, params, x0, noise, t, cond, weight).mean()

  @jax.jit
  def step(params, opt_state, ema, x0, cond, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, x0, cond, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    ema = jax.tree.map(lambda e, p: c.ema_decay * e + (1 - c.ema_decay) * p, ema, params)
    return params, opt_state, ema, loss

  return step


def _prefetch(task, start, batch, depth=3):
  """Batches start, start+1, ... of task.pretrain_batch, produced on a host thread."""
  q = queue.Queue(maxsize=depth)

  def produce():
    s = start
    while True:
      q.put((s, task.pretrain_batch(s, batch)))
      s += 1

  threading.Thread(target=produce, daemon=True).start()
  while True:
    yield q.get()


def evaluate(task, apply_fn, params, sampler, num, key, mesh):
  """Task metrics and (num, H, W, 3) uint8 images of EMA samples on held-out conditions."""
  cond = task.eval_conditions(jax.random.fold_in(key, 0), num)
  sample = trainer_lib.make_sample_fn(sampler, apply_fn, task.sample_shape, mesh,
                                      plan=parallel.ShardingPlan.for_model(task.config, mesh, task.family))
  cond = np.asarray(cond)
  sharding = parallel.batch_sharding(mesh)
  placed = hosts.assemble(cond[hosts.row_split(sharding, num).mine], sharding, num)
  samples = hosts.gather_global(sample(params, placed, jax.random.fold_in(key, 1))).reshape(
      (num,) + task.sample_shape)
  images, _ = task.reward_inputs(samples, cond)
  return task.evaluate(samples, key, cond=cond), images


def pretrain(config, workdir, progress=True):
  """Runs (or resumes) pretraining to config.pretrain.steps; returns the EMA parameters.

  Data parallel over every device of every process: the state is replicated, each process feeds its
  rows of each batch, and process 0 writes metrics, grids and the export's log."""
  task = tasks.get_task(config)
  task.require('pretrain')       # a task without pretraining (or a config without the section): one line
  config_lib.validate(config, jax.device_count())
  c = config.pretrain
  if not 0 <= c.warmup_steps < c.steps:
    raise cli.UsageError(
        f'config.pretrain.warmup_steps={c.warmup_steps} with config.pretrain.steps={c.steps}: the '
        'cosine decay needs 0 <= warmup_steps < steps', 'lower warmup_steps or raise steps')
  mesh = parallel.make_mesh(config.mesh, jax.devices())
  key = jax.random.key(c.seed)
  apply_fn, params = task.init_untrained(jax.random.fold_in(key, 0))   # never from the base it makes
  if c.get('init_from'):        # fine-tuning (e.g. supervised fine-tuning of a base on other data)
    path = c.init_from if os.path.isabs(c.init_from) else os.path.join(REPO_ROOT, c.init_from)
    if not os.path.exists(path):
      raise cli.UsageError(f'config.pretrain.init_from={c.init_from!r} does not exist',
                           'give a params export (a pretraining workdir\'s export/, or checkpoints/...)')
    params = params_io.load_params(path, params, 'config.pretrain.init_from')
    logger.info('pretraining starts from %s', path)
  schedule = optax.warmup_cosine_decay_schedule(0.0, c.learning_rate, c.warmup_steps, c.steps,
                                                end_value=c.learning_rate * 0.05)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(schedule, b2=0.99, weight_decay=c.weight_decay))
  state = dict(params=params, opt_state=optimizer.init(params), ema=jax.tree.map(jnp.copy, params))
  replicated = parallel.replicated(mesh)
  state = parallel.place(jax.device_get(state), jax.tree.map(lambda _: replicated, state))
  # The batch over the data-parallel axes (replicated when it does not divide them).
  batch_sharding = (parallel.batch_sharding(mesh) if c.batch % parallel.data_parallel_size(mesh) == 0
                    else replicated)
  rows = hosts.row_split(batch_sharding, c.batch).mine
  workdir = storage.absolute(workdir)       # a local path or a bucket URL (gs://...)
  mngr = ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'),
                               options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
  start = mngr.latest_step() or 0
  if start:
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), state)
    state = mngr.restore(start, args=ocp.args.StandardRestore(target))
    logger.info('resumed pretraining at step %d', start)
  step_fn = make_step(apply_fn, optimizer, c)
  sampler = trainer_lib.make_sampler(config).deterministic()
  main = distributed.is_main_process()
  writer = metrics_lib.MetricWriter(workdir, resume_step=start) if main else metrics_lib.NullWriter()
  bar = tqdm.tqdm(total=c.steps, initial=start, disable=not (progress and main), desc='pretrain',
                  dynamic_ncols=True)
  losses, t0 = [], time.perf_counter()
  p, o, e = state['params'], state['opt_state'], state['ema']
  try:
    with preemption.PreemptionGuard() as guard:
      for s, (x0, cond) in _prefetch(task, start, c.batch):
        if s >= c.steps:
          break
        x0, cond = hosts.assemble((np.asarray(x0)[rows], np.asarray(cond)[rows]), batch_sharding,
                                  c.batch)
        p, o, e, loss = step_fn(p, o, e, x0, cond, jax.random.fold_in(key, s))
        losses.append(loss)
        done = s + 1
        bar.update(1)
        if done % c.log_every == 0 or done == c.steps:
          mean = float(np.mean(jax.device_get(losses)))
          dt = time.perf_counter() - t0
          writer.write(done, dict(pretrain_loss=mean, time_per_step=dt / len(losses),
                                  learning_rate=float(schedule(done))))
          bar.set_postfix(loss=f'{mean:.4f}')
          losses, t0 = [], time.perf_counter()
        if done % c.eval_every == 0 or done == c.steps:
          metrics, images = evaluate(task, apply_fn, e, sampler, c.eval_samples,
                                     jax.random.fold_in(key, 0xE7A1), mesh)
          writer.write(done, {f'eval_ema/{k}': v for k, v in metrics.items()})
          if main:
            image_grid.write_grid(os.path.join(workdir, 'samples', f'step_{done:07d}.png'), images)
          logger.info('step %d: %s', done, metrics)
        stop = guard.should_stop(done)
        if done % c.checkpoint_every == 0 or done == c.steps or stop:
          mngr.save(done, args=ocp.args.StandardSave(dict(params=p, opt_state=o, ema=e)), force=True)
          mngr.wait_until_finished()
          params_io.save_params(os.path.join(workdir, 'export'), e)
        if stop:
          writer.flush()
          logger.info('stopped by %s after step %d of %d; saved checkpoint %d in %s. Rerun the same '
                      'command to resume.', guard.received, done, c.steps, done,
                      os.path.join(workdir, 'checkpoints'))
          break
  finally:
    bar.close()
    mngr.wait_until_finished()
    writer.close()
  return e


def _define_flags():
  """Defined only when run as a script, so importing this module adds no global absl flags."""
  global _CONFIG, _WORKDIR
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'Config with a `pretrain` section.')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'Checkpoints, metrics, sample grids, export/.')
  distributed.define_flags()


def main(argv):
  del argv
  console.setup()
  distributed.initialize(distributed.options_from_flags())      # before anything asks for devices
  with distributed.fail_fast():
    pretrain(_CONFIG.value, _WORKDIR.value)


if __name__ == '__main__':
  xla_flags.apply()       # before any JAX backend starts
  _define_flags()
  cli.run(main, required=('config', 'workdir'))
