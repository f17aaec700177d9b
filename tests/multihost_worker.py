"""One process of a multi-process run on this machine (tests/test_multihost.py starts 1, 2 or 4 of them).

  python tests/multihost_worker.py '<json spec>' PROCESS_ID NUM_PROCESSES PORT

The parent sets JAX_PLATFORMS=cpu, JAX_NUM_CPU_DEVICES (devices per process) and
JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo. The spec names the task ('toy2d' or 'cosmos_smoke'), config
overrides, the workdir, an output directory, whether the mesh's context axis should span processes,
and the scenario:
  'layout': write this process's BatchLayout and, with config.data.path, the record keys of its first
            two loader batches (no compile);
  'train':  run Trainer.train, capturing the global rollout conditions, data batch and reward matrix
            of the first iteration, the parameters before the first update and the final ones
            (process 0 writes them as .npz), and
            write which files each process created ('skip_evaluation': without the evaluation
            the trainer runs at the end).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(spec):
  from configs import cosmos2b  # pylint: disable=g-import-not-at-top
  from configs import toy2d  # pylint: disable=g-import-not-at-top
  if spec['task'] == 'toy2d':
    c = toy2d.get_config('ddrl')
    c.toy2d.width, c.toy2d.depth = 32, 2
    c.toy2d.pretrain_steps, c.toy2d.pretrain_batch = 100, 256
    c.sampler.num_steps = 4
    c.rl.train_steps = (0, 1, 2)
    c.batch_size, c.num_rollouts = 8, 4
    c.num_iterations, c.eval_every, c.eval_samples = 2, -1, 32
    c.checkpoint_every = 1
    c.sharding.max_replicated_fraction = 1.0   # the MLP has no logical axis names: replicated
  else:
    c = cosmos2b.get_config('smoke')
    c.num_iterations, c.checkpoint_every = 1, 1
  c.reward.workers = 0
  c.mesh.data, c.mesh.fsdp, c.mesh.context, c.mesh.tensor = 2, 2, 2, 1
  for key, value in spec.get('overrides', {}).items():
    node = c
    *path, last = key.split('.')
    for part in path:
      node = node[part]
    node[last] = tuple(value) if isinstance(value, list) else value
  return c


def _devices(jax, context_across_processes):
  """Every device; with context_across_processes the list is ordered so that the innermost mesh axes
  (context, then tensor) step across processes (device i of every process, then device i + 1, ...),
  the layout of a 14B run whose context group of 8 spans two 4-chip hosts."""
  devices = jax.devices()
  if context_across_processes:
    local_index = {d: i for p in {d.process_index for d in devices}
                   for i, d in enumerate(sorted((e for e in devices if e.process_index == p),
                                                key=lambda e: e.id))}
    devices = sorted(devices, key=lambda d: (local_index[d], d.process_index))
  return devices


def main():
  from ddrl_jax import distributed  # pylint: disable=g-import-not-at-top
  with distributed.fail_fast():     # as ddrl_jax.train: one failing process ends all of them
    run(json.loads(sys.argv[1]))


def run(spec):
  pid, nproc, port = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
  from ddrl_jax import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(distributed.Options(
      coordinator_address=f'127.0.0.1:{port}' if nproc > 1 else None,
      num_processes=nproc, process_id=pid, initialization_timeout=120,
      heartbeat_timeout=spec.get('heartbeat_timeout', 30),
      shutdown_timeout=60))
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from ddrl_jax import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  from ddrl_jax.parallel import hosts  # pylint: disable=g-import-not-at-top

  out = spec['out']
  os.makedirs(out, exist_ok=True)
  config = _config(spec)
  trainer = trainer_lib.Trainer(config, spec['workdir'],
                                devices=_devices(jax, spec.get('context_across_processes', False)))
  lay = trainer.layout
  report = dict(process_index=jax.process_index(), process_count=jax.process_count(),
                device_count=jax.device_count(), slot_rows=lay.slots.mine.tolist(),
                data_rows=lay.data.mine.tolist(), groups=lay.groups.tolist(),
                shard_index=lay.shard_index, shard_count=lay.shard_count, lead=lay.slots.is_lead)
  if spec['scenario'] == 'layout':
    if trainer.loader is not None:   # records are identified by their (2-D point) samples
      batches = [next(trainer.loader) for _ in range(2)]
      report['records'] = [np.asarray(b['sample']).round(6).tolist() for b in batches]
    _write_json(os.path.join(out, f'report_{pid}.json'), report)
    return

  captured, initial = {}, {}
  collect, update = trainer.collect, None

  def capture_collect(it):
    if spec.get('fail_on_process') == jax.process_index():
      raise RuntimeError(f'injected failure on process {jax.process_index()}')
    rollout, pending, valid, data = collect(it)
    if it == trainer_first_step[0]:
      captured['slot_cond'] = jax.tree.map(hosts.gather_global, rollout.cond)
      captured['data'] = jax.tree.map(hosts.gather_global, data._asdict())
    return rollout, pending, valid, data

  trainer_first_step = [None]
  trainer.collect = capture_collect
  build = trainer._build

  def capture_build():
    build()
    inner = trainer._update

    def capture_update(state, rollout, grads, key):
      if 'rewards' not in captured:
        captured['rewards'] = hosts.gather_global(rollout.rewards)
        initial.update(_flat(jax.tree.map(hosts.gather_global, state.params)))   # before the first step
      return inner(state, rollout, grads, key)

    trainer._update = capture_update

  trainer._build = capture_build
  if spec.get('skip_evaluation'):   # the end-of-run evaluation compiles its own sampler and decode
    trainer._evaluate_and_write = lambda writer, step: None
  start = int(trainer.ckpt.latest_step() or 0)
  if trainer.loader is not None:
    report['loader_shard'] = list(trainer.loader.shard)
  trainer_first_step[0] = start
  try:
    metrics = trainer.train(progress=False)
  except Exception as e:  # pylint: disable=broad-except
    if not spec.get('expect_error'):
      raise
    report.update(error=f'{type(e).__name__}: {e}')
    _write_json(os.path.join(out, f'report_{pid}.json'), report)
    return
  flat = _flat(jax.tree.map(hosts.gather_global, trainer.state.params))
  report.update(start=start, final_step=int(trainer.state.step), stopped_by=trainer.stopped_by,
                loss=float(metrics.get('loss', float('nan'))))
  if jax.process_index() == 0:
    np.savez(os.path.join(out, 'params.npz'), **flat)
    np.savez(os.path.join(out, 'params_init.npz'), **initial)
    batch = {}
    for name, tree in captured.items():
      for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]:
        batch[name + jax.tree_util.keystr(k)] = np.asarray(v)
    np.savez(os.path.join(out, 'batch.npz'), **batch)
  _write_json(os.path.join(out, f'report_{pid}.json'), report)


def _flat(params):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def _write_json(path, obj):
  with open(path + '.tmp', 'w') as f:
    json.dump(obj, f)
  os.replace(path + '.tmp', path)


if __name__ == '__main__':
  main()
