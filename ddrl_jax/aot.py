"""CLI: ahead-of-time compile of one DDRL iteration for a TPU slice, from any host (MaxText's train_compile).

    python -m ddrl_jax.aot --config=configs/cosmos2b.py --topology=v5p-512 [--out=FILE]
    python -m ddrl_jax.aot --config=configs/cosmos14b.py --topology=v5p-2048
    python -m ddrl_jax.aot --config=configs/cosmos2b.py:smoke --topology=cpu-8       (the CI path)
    python -m ddrl_jax.aot --config=configs/wan14b.py:ddrl --topology=v5p-16 --lower_only  (kernels only)

Builds the run's mesh from the slice's compile-only devices (libtpu, `pip install -e '.[aot]'`; 'cpu-N' uses
N local CPU devices), the train state's shardings from config.sharding, and lowers and compiles the
trainer's own jitted `rollout`, `data_grads` and `update` (trainer.build_step_fns) on abstract inputs at the
config's shapes: nothing is allocated and no weights are needed. For each function it prints one JSON line:

  fn, topology, mesh, per_chip_bytes = argument + output - alias + temp (memory_analysis), the four parts,
  resident_bytes (what the trainer holds on each chip while the function runs: the whole train state,
  rollouts, data, gradient; XLA's arguments leave out inputs a function does not read), peak_bytes =
  max(per_chip_bytes, resident + output - alias + temp), hbm_bytes, fits and spare_fraction (by
  peak_bytes), flops (cost_analysis: XLA counts a scan body once, so this is far below the real count),
  analytic_flops (the model family's forward_flops x the function's network passes, per chip), compile_s.

A task that runs a text encoder on the training devices says so (the 'device_text_encoder' ability: its
`device_text_encoder()`, e.g. the Cosmos task's Cosmos-Reason1-7B encoder, models.reason1_text.DeviceEncoder,
bf16 and FSDP-sharded like the DiT): then a fourth function, 'text_encoder' (the encoder's sharded forward
on one call's prompts), is compiled by default, with resident_bytes = the train state + the encoder's
parameters + the ids, and every row carries `text_encoder_bytes`, the encoder's parameter bytes per chip,
which stay on the chips while the step functions run and are added to their resident_bytes and peak_bytes.

Each row's `attention` lists the attention kernels the lowered program really contains
(models.attention.program_kernels: 'splash', 'cudnn', 'xla', and 'xla_short' for sequences under
min_flash_len) and `attention_family` the kernel the model family names for the target platform; a
function whose long-sequence attention is anything else stops the run before its compile (exit 1).

`--search_micro_batch` compiles the step at each micro-batch (config.micro_batch: rollout slots per device
per chunk, the divisors of the slots per device from the largest down) until every function fits with
`--margin` to spare, printing each candidate's rows (with `micro_batch`) and then one summary line
{"micro_batch": the largest that fits, or null}; exits 1 when none does.

Exits 1 when a function's peak does not fit the chip's HBM (or `--margin` of it). The compile options of
LIBTPU_INIT_ARGS apply as in a real run (set the variable before starting).
"""
import json
import math
import sys
import time

import jax
from absl import app
from absl import flags
from ml_collections import config_flags

from ddrl_jax import cli
from ddrl_jax import config as config_lib
from ddrl_jax import console
from ddrl_jax import distributed
from ddrl_jax import program as program_lib
from ddrl_jax import parallel
from ddrl_jax import tasks
from ddrl_jax import trainer as trainer_lib
from ddrl_jax import xla_flags
from ddrl_jax.models import attention as attention_lib
from ddrl_jax.models import lora as lora_lib
from ddrl_jax.rl import algorithms
from ddrl_jax.parallel import rules as rules_lib
from ddrl_jax.parallel import topology as topology_lib

FUNCTIONS = ('rollout', 'data_grads', 'update')     # the trainer's step functions
TEXT_ENCODER = 'text_encoder'                        # the task's on-device text encoder, when it has one
ALL_FUNCTIONS = FUNCTIONS + (TEXT_ENCODER,)
DEVICE_TEXT_ENCODER = 'device_text_encoder'          # the task ability (tasks/base.py `capabilities`)


class KernelMismatch(ValueError):
  """A lowered function's attention is not the kernel its family names for the target platform."""


def _define_flags():
  global _CONFIG, _TOPOLOGY, _NUM_SLICES, _OUT, _FNS, _MARGIN, _LOWER_ONLY, _SEARCH, _HBM_GIB
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file (get_config(arg)).',
                                            lock_config=True)
  _TOPOLOGY = flags.DEFINE_string('topology', None, "A TPU slice (e.g. v5p-512) or 'cpu-N'.")
  _NUM_SLICES = flags.DEFINE_integer('num_slices', 1, 'Slices (multislice over DCN).')
  _OUT = flags.DEFINE_string('out', '', 'Also append the JSON lines to this file.')
  _FNS = flags.DEFINE_list('fns', [], f'Functions to compile, of {ALL_FUNCTIONS}; default: {FUNCTIONS}, '
                           f'and {TEXT_ENCODER!r} when the task runs a text encoder on the devices.')
  _MARGIN = flags.DEFINE_float('margin', 0.0, 'Fail unless this fraction of HBM stays free.')
  _HBM_GIB = flags.DEFINE_float('hbm_gib', 0.0, 'Judge fits against this many GiB per chip instead of '
                                'the slice\'s HBM (a proxy: e.g. 72 for an 80 GB H100 on v5p-16\'s 8 chips).')
  _SEARCH = flags.DEFINE_bool('search_micro_batch', False, 'Find the largest config.micro_batch whose '
                              'step fits with --margin to spare (module docstring).')
  _LOWER_ONLY = flags.DEFINE_bool('lower_only', False, 'Only lower each function and report the attention '
                                  'kernels its program holds (seconds instead of minutes; no memory).')
  distributed.define_flags()


def _with_sharding(abstract, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                      shardings)


def abstract_inputs(config, plan, task, fns, state_shardings, abstract_state):
  """Abstract (ShapeDtypeStruct, sharded) arguments of each function at the config's shapes."""
  slots = config.batch_size * config.num_rollouts
  batch = plan.batch()
  rep = plan.replicated()
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=rep)
  slot_cond = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=batch),
                           task.abstract_conditions(slots))
  state = _with_sharding(abstract_state, state_shardings)
  params = trainer_lib.model_params(state)      # the adapters with the frozen base under LoRA
  traj = jax.eval_shape(fns.rollout, params, slot_cond, key)
  num_rewards = len(config.reward.fns)
  rollout = trainer_lib.RolloutBatch(
      traj=jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=batch), traj),
      rewards=jax.ShapeDtypeStruct((slots, num_rewards), jax.numpy.float32, sharding=batch),
      cond=slot_cond)
  group_cond = task.abstract_conditions(config.batch_size)
  data = trainer_lib.DataBatch(
      x0=jax.ShapeDtypeStruct((config.batch_size,) + tuple(task.sample_shape), jax.numpy.float32),
      cond=group_cond)
  data = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=plan.sharding(('act_batch',), a.shape, 'data')), data)
  grads = jax.eval_shape(fns.data_grads, params, rollout, data, key)[0]
  if grads is not None:
    grads = _with_sharding(grads, state_shardings.params)
  return dict(rollout=(params, slot_cond, key), data_grads=(params, rollout, data, key),
              update=(state, rollout, grads, key))


def device_text_encoder(task):
  """The text encoder the task runs on the training devices, or None. Asked of tasks that declare the
  DEVICE_TEXT_ENCODER ability; their `device_text_encoder()` returns None (not in this config) or an object
  like models.reason1_text.DeviceEncoder: forward(plan) -> a ShardedForward (fn, params / input_ids
  shardings), abstract_inputs(forward), forward_flops() of one call, attention_kernel, describe()."""
  return task.device_text_encoder() if DEVICE_TEXT_ENCODER in task.capabilities else None


def per_device_bytes(tree):
  """Bytes one device holds of an abstract tree of sharded ShapeDtypeStructs (largest shard)."""
  total = 0
  for a in jax.tree.leaves(tree):
    shape = a.sharding.shard_shape(a.shape) if getattr(a, 'sharding', None) is not None else a.shape
    total += math.prod(shape) * a.dtype.itemsize
  return total


def resident_inputs(name, args):
  """What the trainer holds on device while `name` runs (its arguments, and for the rollout the state
  besides the parameters): rollout -> state + slot conditions; data_grads -> state + rollout + data;
  update -> state + rollout + data + data gradient; text_encoder -> state + the encoder's params + ids
  (the task encodes prompts between iterations)."""
  if name == TEXT_ENCODER:
    return (args['update'][0],) + args[TEXT_ENCODER]
  if name == 'rollout':
    return (args['update'][0], args['rollout'][1])
  if name == 'data_grads':
    return (args['update'][0],) + args['data_grads'][1:3]
  return args['update'][:3] + (args['data_grads'][2],)


def network_passes(config, fn, remat):
  """Forward-equivalents of the network per rollout slot: the rollout's T calls (+1: the cosmos_2ab
  sampler's final clean call); per trained step a gradient costs 3 (forward + backward), 4 with full remat; the data term too."""
  if fn == 'rollout':
    return config.sampler.num_steps + (1 if config_lib.sampler_kind(config) == 'cosmos_2ab' else 0)
  pool = config_lib.train_steps(config)
  random = algorithms.get_algorithm(config.algorithm).step_selection == 'random'
  k = max(1, int(len(pool) * config.rl.train_fraction)) if random else len(pool)
  grad = 3 + (1 if remat == 'full' else 0)
  if fn == 'data_grads':
    return grad * k if config.rl.data_loss_steps == 'full' else grad
  return grad * k


def compile_report(config, topology, num_slices=1, fns=None, compiler_options=None, lower_only=False,
                   devices=None, memory_bytes=None, hbm_bytes=None):
  """Compiles `fns` for `topology`; yields one dict per function (see the module docstring). fns: of
  ALL_FUNCTIONS; None: FUNCTIONS, and TEXT_ENCODER when the task runs a text encoder on the devices. With
  `lower_only`, stops after lowering: fn, topology, mesh, attention, attention_family, lower_s.
  devices: compile for these (attached) devices instead of `topology` (the trainer's step-memory check),
  each with `memory_bytes` of memory (None: unknown, no `fits`). hbm_bytes: judge `fits` against this
  instead of the topology's HBM (a proxy for another chip: the compile is still the topology's)."""
  # The config and the task are checked before libtpu loads: a mistake is one line, found in a second.
  task = tasks.get_task(config)
  task.require('aot')
  if devices is None:
    config_lib.validate(config, topology_lib.num_devices(topology, num_slices))
    devices = topology_lib.topology_devices(topology, num_slices)
    hbm = hbm_bytes or topology_lib.hbm_bytes(topology)
  else:
    config_lib.validate(config, len(devices))
    topology = topology or f'{devices[0].platform}-{len(devices)}'
    hbm = memory_bytes
  platform = devices[0].platform
  mesh = parallel.make_mesh(config.mesh, devices)
  family = task.family
  program = program_lib.assemble(config, task, mesh, jax.random.key(0))     # what the trainer runs
  plan, abstract_state, state_sh = program.plan, program.abstract_state, program.state_shardings
  params_report = plan.check_params(lora_lib.combine(abstract_state.params, abstract_state.frozen),
                                    lora_lib.combine(state_sh.params, state_sh.frozen))
  step_fns = program.step_fns()
  args = abstract_inputs(config, plan, task, step_fns, state_sh, abstract_state)
  text_encoder = device_text_encoder(task)
  fns = tuple(fns) if fns is not None else FUNCTIONS + ((TEXT_ENCODER,) if text_encoder else ())
  unknown = [f for f in fns if f not in ALL_FUNCTIONS]
  if unknown:
    raise ValueError(f'unknown functions {unknown}; known: {ALL_FUNCTIONS}')
  fn_of = {name: getattr(step_fns, name) for name in FUNCTIONS}
  kernel_of = {}
  text_bytes = 0          # the encoder's parameters, resident on every chip beside the train state
  if text_encoder is not None:
    # Each process encodes its own prompts on its own chips (tasks' on-device encoders: ShardingPlan.for_host),
    # so the encoder is compiled for one host's devices, FSDP over them.
    host = [d for d in devices if d.process_index == devices[0].process_index]
    encoder = text_encoder.forward(parallel.ShardingPlan.for_host(config, host, family))
    args[TEXT_ENCODER] = text_encoder.abstract_inputs(encoder)
    fn_of[TEXT_ENCODER] = encoder.fn
    kernel_of[TEXT_ENCODER] = text_encoder.attention_kernel
    enc_params = args[TEXT_ENCODER][0]
    text_bytes = per_device_bytes(enc_params)
    enc_report = (rules_lib.assert_sufficiently_sharded(enc_params, encoder.params,
                                                        plan.max_replicated_fraction)
                  if plan.shards_params() else rules_lib.sharding_report(enc_params, encoder.params))
  elif TEXT_ENCODER in fns:
    raise config_lib.ConfigError(f'--fns={TEXT_ENCODER}: task {config.task!r} runs no text encoder on the '
                                 f'training devices with this config (none declared by its '
                                 f'{DEVICE_TEXT_ENCODER}())')
  fwd = task.forward_flops_per_sample()
  slots = config.batch_size * config.num_rollouts
  remat = family.remat_policy
  kernel = family.attention_kernel(platform)
  for name in fns:
    t0 = time.perf_counter()
    lowered = fn_of[name].lower(*args[name])
    text = lowered.as_text(debug_info=True)
    expected = kernel_of.get(name, kernel)   # the encoder's causal attention is its own (XLA) kernel
    problems = attention_lib.check_program(text, expected, platform)
    if problems:
      raise KernelMismatch(f'{name} lowered for {topology}: ' + '; '.join(problems))
    found = attention_lib.program_kernels(text)
    del text
    if lower_only:
      yield dict(fn=name, topology=topology, num_slices=num_slices, mesh=dict(mesh.shape), attention=found,
                 attention_family=expected, context_impl=plan.context_impl,
                 lower_s=round(time.perf_counter() - t0, 2))
      continue
    try:
      compiled = lowered.compile(compiler_options or None)
    except jax.errors.JaxRuntimeError as e:
      if 'RESOURCE_EXHAUSTED' not in str(e):
        raise
      # The compiler's out-of-memory verdict for the target (MaxText's is_oom): a result, not a crash.
      yield dict(fn=name, topology=topology, num_slices=num_slices, mesh=dict(mesh.shape), hbm_bytes=hbm,
                 attention=found, attention_family=expected,
                 fits=False, error=str(e).splitlines()[0][:500],
                 compile_s=round(time.perf_counter() - t0, 2))
      continue
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    per_chip = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                + mem.temp_size_in_bytes)
    # XLA's arguments omit inputs the function does not read (e.g. trajectory fields); the trainer still
    # holds them, and the rest of the train state, while it runs. `resident` counts them unpadded, XLA's
    # argument bytes count the TPU's tile padding: the peak takes the larger of the two totals.
    # The encoder's parameters stay on the chips while the step functions run (not their arguments).
    resident = per_device_bytes(resident_inputs(name, args)) + (text_bytes if name != TEXT_ENCODER else 0)
    peak = max(per_chip + (text_bytes if name != TEXT_ENCODER else 0),
               resident + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    if name == TEXT_ENCODER:
      analytic = text_encoder.forward_flops() / len(devices)
      param_bytes, replicated = enc_report['per_device_bytes'], enc_report['replicated_fraction']
    else:
      analytic = fwd * slots * network_passes(config, name, remat) / len(devices) if fwd else None
      param_bytes, replicated = params_report['per_device_bytes'], params_report['replicated_fraction']
    row = dict(fn=name, topology=topology, num_slices=num_slices, mesh=dict(mesh.shape),
               attention=found, attention_family=expected,
               context_impl=plan.context_impl,
               per_chip_bytes=int(per_chip), resident_bytes=int(resident), peak_bytes=int(peak),
               argument_bytes=int(mem.argument_size_in_bytes),
               output_bytes=int(mem.output_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes),
               temp_bytes=int(mem.temp_size_in_bytes),
               generated_code_bytes=int(mem.generated_code_size_in_bytes), hbm_bytes=hbm,
               flops=float(cost.get('flops', -1.0)) if cost else None,
               analytic_flops=analytic,
               param_bytes_per_chip=int(param_bytes),
               replicated_param_fraction=replicated,
               compile_s=round(compile_s, 2))
    if text_encoder is not None:
      row.update(text_encoder_bytes=int(text_bytes))
      if name == TEXT_ENCODER:
        row.update(text_encoder=dict(text_encoder.describe(),
                                     total_param_bytes=int(enc_report['total_bytes']),
                                     input_ids_spec=str(encoder.input_ids.spec)))
    if hbm:
      row.update(fits=peak <= hbm, spare_fraction=round(1 - peak / hbm, 4))
    yield row


def micro_batch_candidates(config, num_devices):
  """The micro-batches to try, largest first: the divisors of the rollout slots per data-parallel position
  (the largest, the whole batch, is config.micro_batch = 0)."""
  shape = dict(zip(parallel.AXES, config_lib.validate(config, num_devices)))
  per_shard = config.batch_size * config.num_rollouts // (shape['data'] * shape['fsdp'])
  return [m for m in range(per_shard, 0, -1) if per_shard % m == 0]


def fits_with_margin(rows, margin):
  """Whether every compiled function's peak leaves `margin` of the chip's memory free."""
  return bool(rows) and all(r.get('hbm_bytes') and r.get('fits') and
                            r['peak_bytes'] <= (1 - margin) * r['hbm_bytes'] for r in rows)


def search_micro_batch(config, topology, num_slices=1, margin=0.1, fns=None, **compile_kwargs):
  """Yields (micro_batch, rows of `compile_report`) for each candidate (`micro_batch_candidates`, largest
  first) until one fits with `margin` to spare (`fits_with_margin`); the last one yielded is the answer
  when it fits. micro_batch 0 stands for the whole batch."""
  num_devices = (len(compile_kwargs['devices']) if compile_kwargs.get('devices') is not None
                 else topology_lib.num_devices(topology, num_slices))
  candidates = micro_batch_candidates(config, num_devices)
  for micro in candidates:
    trial = config.copy_and_resolve_references()
    trial.micro_batch = 0 if micro == candidates[0] else micro
    rows = [dict(row, micro_batch=trial.micro_batch) for row in
            compile_report(trial, topology, num_slices, fns, **compile_kwargs)]
    yield trial.micro_batch, rows
    if fits_with_margin(rows, margin):
      return


def _search_main():
  """--search_micro_batch: every candidate's rows, then {"micro_batch": the answer or null}."""
  best, out = None, open(_OUT.value, 'a') if _OUT.value else None
  for micro, rows in search_micro_batch(_CONFIG.value, _TOPOLOGY.value, _NUM_SLICES.value, _MARGIN.value,
                                        _FNS.value or None, hbm_bytes=_hbm_override()):
    for row in rows:
      print(json.dumps(row), flush=True)
      if out:
        out.write(json.dumps(row) + '\n')
    best = micro if fits_with_margin(rows, _MARGIN.value) else None
  summary = json.dumps(dict(topology=_TOPOLOGY.value, margin=_MARGIN.value, micro_batch=best))
  print(summary, flush=True)
  if out:
    out.write(summary + '\n')
    out.close()
  if best is None:
    sys.exit(1)


def _hbm_override():
  return int(_HBM_GIB.value * 2**30) if _HBM_GIB.value else None


def main(argv):
  console.setup()
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]} (flags are --name=value)')
  bad = [f for f in _FNS.value if f not in ALL_FUNCTIONS]
  if bad:
    raise app.UsageError(f'--fns: unknown {bad}; known: {ALL_FUNCTIONS}')
  try:
    topology_lib.num_devices(_TOPOLOGY.value, _NUM_SLICES.value)
  except ValueError as e:
    raise app.UsageError(f'--topology={_TOPOLOGY.value}: {e}') from e
  distributed.initialize(distributed.options_from_flags())   # the compilation cache; a no-op alone
  if _SEARCH.value:
    _search_main()
    return
  failed = []
  out = open(_OUT.value, 'a') if _OUT.value else None
  try:
    for row in compile_report(_CONFIG.value, _TOPOLOGY.value, _NUM_SLICES.value, _FNS.value or None,
                              lower_only=_LOWER_ONLY.value, hbm_bytes=_hbm_override()):
      line = json.dumps(row)
      print(line, flush=True)
      if out:
        out.write(line + '\n')
        out.flush()
      hbm = row.get('hbm_bytes')
      if hbm and (not row['fits'] or row['peak_bytes'] > (1 - _MARGIN.value) * hbm):
        failed.append(row['fn'])
  except KernelMismatch as e:     # a wrong memory figure is worse than none: no row, exit 1
    print(f'error: {e}', file=sys.stderr)
    sys.exit(1)
  if failed:
    print(f'does not fit {_TOPOLOGY.value} (HBM {row["hbm_bytes"] / 2**30:.1f} GiB per chip, margin '
          f'{_MARGIN.value}): {failed}', file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  xla_flags.apply()       # before any JAX backend starts
  _define_flags()
  cli.run(main, required=('config', 'topology'))
