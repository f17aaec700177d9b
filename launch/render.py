"""The hardware a config's mesh needs, for the launch scripts: devices, TPU slice, hosts, GPU nodes.

  python launch/render.py --config=configs/cosmos2b.py                 # JSON, every field
  python launch/render.py --config=configs/cosmos14b.py --field=accelerator   # v5p-2048
  python launch/render.py --config=configs/cosmos2b.py --format=shell  # KEY=value lines for `eval`
  python launch/render.py --config=configs/cosmos2b.py -- --config.mesh.data=8   # train overrides
  python launch/render.py --config=configs/cosmos2b.py --rewards -- --config.reward.fns=...  # reward pool

The device count is the product of `config.mesh` resolved by `ddrl_jax.parallel.mesh_shape`. A mesh
with a -1 axis fills whatever it is given, so then the hardware must be named (--accelerator, --nodes or
--devices). The TPU slice is the entry of `ddrl_jax.parallel.topology.TOPOLOGIES` (the AOT tool's table)
of the --tpu_family with exactly that many chips (v5p: 'v5p-512' = 256 chips, 4 chips per host); a
named --accelerator must be in that table and have that many chips. GPU nodes = devices /
--gpus_per_node (8: H100/H200 nodes). Arguments after `--` are the train command's extra flags; the
`--config.mesh.<axis>=N` among them change the mesh here as they will in training.

Any inconsistency (mesh vs. slice vs. nodes) exits 2 with one line saying what does not fit, so a
launch script stops before it asks for hardware. Nothing here touches an accelerator or the network.

--rewards prints what a GPU reward pool (launch/gpu/reward_pool.sbatch, launch/tpu/gcloud_reward_pool.sh)
needs of the config instead: config.reward after every `--config.*` override of the train command (the
reward servers build exactly the rewards, with exactly the kwargs, that the trainer sends with each task),
checked as the trainer checks it, and where each reward model runs. Each pool server sees one GPU
(CUDA_VISIBLE_DEVICES), so a reward that takes a torch `device` must be given 'cuda' (or 'cuda:0');
'cpu' (the factories' default) or another index exits 2 naming the key.
"""
import argparse
import json
import math
import os
import re
import shlex
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')     # a login node with libtpu must not take its lock
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)                        # configs/*.py import `configs` and `ddrl_jax`

from ddrl_jax import cli                            # pylint: disable=g-import-not-at-top,wrong-import-position
from ddrl_jax.parallel import mesh as mesh_lib      # pylint: disable=g-import-not-at-top,wrong-import-position
from ddrl_jax.parallel import topology as topology_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

FIELDS = ('config', 'config_path', 'name', 'mesh', 'mesh_desc', 'devices', 'accelerator', 'chips',
          'tpu_hosts', 'gpus_per_node', 'gpu_nodes')
REWARD_FIELDS = ('config', 'name', 'reward_fns', 'reward_imports', 'reward_gpu', 'reward_cpu',
                 'reward_backend')
# The rewards whose factories take a torch `device` (the vbench_<dimension> ones pass it on by **kwargs).
TORCH_REWARD_MODULES = ('ddrl_jax.rewards.videoalign', 'ddrl_jax.rewards.vbench',
                        'ddrl_jax.rewards.cosmos_reason1')
_MESH_OVERRIDE = re.compile(r'--config\.mesh\.([a-z]+)=(-?[0-9]+)')


class RenderError(ValueError):
  pass


def load_config(spec):
  """get_config(arg) of a 'path[:arg]' spec (path relative to the cwd or the repository)."""
  path, _, arg = spec.partition(':')
  if not os.path.exists(path) and os.path.exists(os.path.join(REPO, path)):
    path = os.path.join(REPO, path)
  if not os.path.isfile(path):
    raise RenderError(f'config file {path!r} not found')
  return cli.load_config(f'{path}:{arg}' if arg else path), path, arg


def repo_relative(spec):
  """The config spec as the train command on another machine (cwd = repository root) names it."""
  path, sep, arg = spec.partition(':')
  full = os.path.abspath(path if os.path.exists(path) else os.path.join(REPO, path))
  rel = os.path.relpath(full, REPO)
  if rel.startswith('..'):
    raise RenderError(f'config {path!r} is outside the repository {REPO}; the remote hosts only get '
                      'the repository')
  return rel + sep + arg


def apply_mesh_overrides(mesh, overrides):
  mesh = {a: int(mesh[a]) for a in mesh_lib.AXES}
  for arg in overrides:
    m = _MESH_OVERRIDE.fullmatch(arg)
    if m:
      if m.group(1) not in mesh:
        raise RenderError(f'{arg}: config.mesh has no axis {m.group(1)!r} (axes: {mesh_lib.AXES})')
      mesh[m.group(1)] = int(m.group(2))
    elif arg.startswith('--config.mesh'):
      raise RenderError(f'{arg}: write mesh overrides as --config.mesh.<axis>=<int>')
  return mesh


def tpu_slice_for(chips, family):
  """The table's `family` slice with exactly `chips` chips."""
  names = [n for n, t in topology_lib.TOPOLOGIES.items()
           if n.startswith(family + '-') and t.num_chips == chips]
  if not names:
    sizes = ', '.join(f'{n} ({t.num_chips} chips)' for n, t in topology_lib.TOPOLOGIES.items()
                      if n.startswith(family + '-'))
    raise RenderError(f'no {family} slice has {chips} chips; known: {sizes or "none"}')
  return names[0]


def render(config_spec, accelerator=None, tpu_family='v5p', gpus_per_node=8, nodes=None, devices=None,
           overrides=(), require=None):
  """Every field of FIELDS for one config; RenderError when mesh and hardware disagree.

  require='tpu': the mesh must fill a slice of the table (else accelerator is '' and chips 0);
  require='gpu': it must fill whole nodes of `gpus_per_node` GPUs (else gpu_nodes is 0)."""
  config, path, arg = load_config(config_spec)
  mesh = apply_mesh_overrides(config.mesh, overrides)
  if accelerator:
    if accelerator not in topology_lib.TOPOLOGIES:
      raise RenderError(f'unknown accelerator {accelerator!r}; known: '
                        f'{", ".join(topology_lib.known_topologies())}')
  given = {}
  if devices:
    given['--devices'] = int(devices)
  if accelerator:
    given[f'--accelerator={accelerator}'] = topology_lib.TOPOLOGIES[accelerator].num_chips
  if nodes:
    given[f'--nodes={nodes} x {gpus_per_node} GPUs'] = int(nodes) * int(gpus_per_node)
  if -1 in mesh.values():
    if not given:
      raise RenderError(f'config.mesh {mesh} has a -1 axis: name the hardware (--accelerator, --nodes '
                        'or --devices)')
    n = next(iter(given.values()))
  else:
    n = math.prod(mesh.values())
  for what, count in given.items():
    if count != n:
      raise RenderError(f'{what} is {count} devices but config.mesh {mesh} needs {n}')
  try:
    shape = mesh_lib.mesh_shape(mesh, n)
  except ValueError as e:
    raise RenderError(str(e)) from e
  resolved = dict(zip(mesh_lib.AXES, shape))
  if not accelerator:
    try:
      accelerator = tpu_slice_for(n, tpu_family)
    except RenderError:
      if require == 'tpu':
        raise
      accelerator = ''
  spec = topology_lib.TOPOLOGIES.get(accelerator)
  if n % gpus_per_node:
    if require == 'gpu':
      raise RenderError(f'{n} devices are not whole nodes of {gpus_per_node} GPUs')
    gpu_nodes = 0
  else:
    gpu_nodes = n // gpus_per_node
  name = os.path.splitext(os.path.basename(path))[0] + (f'-{arg}' if arg else '')
  return dict(
      config=repo_relative(config_spec),
      config_path=path,
      name=re.sub(r'[^a-z0-9-]', '-', name.lower()),
      mesh=','.join(f'{a}={s}' for a, s in resolved.items()),
      mesh_desc=' x '.join(f'{a}{s}' for a, s in resolved.items()),
      devices=n,
      accelerator=accelerator,
      chips=spec.num_chips if spec else 0,
      tpu_hosts=spec.num_chips // math.prod(spec.chips_per_host_bounds) if spec else 0,
      gpus_per_node=gpus_per_node,
      gpu_nodes=gpu_nodes,
  )


def config_with_overrides(config_spec, overrides=()):
  """The config as ddrl_jax.train builds it: get_config(arg), then the `--config.*` overrides among the
  train command's flags (ml_collections' config_flags, locked: an unknown key is an error)."""
  from absl import flags                       # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags      # pylint: disable=g-import-not-at-top
  _, path, arg = load_config(config_spec)      # a missing file or preset: RenderError / the config's own
  argv, rest = [], list(overrides)
  while rest:
    a = rest.pop(0)
    if a.startswith('--config.'):
      argv.append(a)
      if '=' not in a and rest:                 # --config.key VALUE
        argv.append(rest.pop(0))
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'config file', flag_values=fv, lock_config=True)
  try:
    fv(['render', f'--config={os.path.abspath(path)}' + (f':{arg}' if arg else ''), *argv])
    return fv.config
  except (KeyError, AttributeError) as e:      # ml_collections: a key the config lacks
    key = str(e.args[0] if e.args else e).strip('"\'')
    raise RenderError(f'{" ".join(argv)}: the config has no key {key!r}') from e
  except (flags.Error, ValueError, TypeError) as e:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise RenderError(f'the train flags do not apply: {text}') from e


def torch_device_default(name, factory):
  """The default `device` of a reward factory, or None when it takes no torch device."""
  import inspect                               # pylint: disable=g-import-not-at-top
  try:
    param = inspect.signature(factory).parameters.get('device')
  except (TypeError, ValueError):
    param = None
  if param is not None:
    return param.default if param.default is not inspect.Parameter.empty else None
  from ddrl_jax.rewards import registry        # pylint: disable=g-import-not-at-top
  if registry.BUILTIN.get(name, '').split(':')[0] in TORCH_REWARD_MODULES:
    return 'cpu'                               # vbench_<dimension>: VBenchReward's default
  return None


def reward_info(config_spec, overrides=()):
  """REWARD_FIELDS of a config for a GPU reward pool whose every server sees one GPU.

  RenderError when config.reward does not pass the trainer's own check (service.RewardSpec.from_config:
  unknown reward, bad weight, stray kwargs, an import that fails) or when a torch reward would not run on
  the server's GPU (device 'cpu', the factories' default, or an index other than 0)."""
  from ddrl_jax.rewards import registry        # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import service         # pylint: disable=g-import-not-at-top
  config = config_with_overrides(config_spec, overrides)
  try:
    spec = service.RewardSpec.from_config(config.reward)
  except (ValueError, ImportError) as e:
    raise RenderError(str(e)) from e
  gpu, cpu = [], []
  for name in spec.names:
    try:
      default = torch_device_default(name, registry.get_factory(name))
    except (ValueError, ImportError) as e:
      raise RenderError(f'config.reward.fns.{name}: {e}') from e
    if default is None:
      cpu.append(name)
      continue
    device = str(spec.kwargs[name].get('device', default))
    if device not in ('cuda', 'cuda:0'):
      why = (f"{device!r} (the factory's default)" if 'device' not in spec.kwargs[name] else repr(device))
      raise RenderError(
          f'config.reward.kwargs.{name}.device is {why}, but each reward server of the pool sees one GPU '
          f"(CUDA_VISIBLE_DEVICES) as 'cuda' = 'cuda:0': give the trainer and the pool "
          f"--config.reward.kwargs=\"{{'{name}': {{..., 'device': 'cuda'}}}}\"")
    gpu.append(name)
  path = config_spec.partition(':')[0]
  arg = config_spec.partition(':')[2]
  name = os.path.splitext(os.path.basename(path))[0] + (f'-{arg}' if arg else '')
  return dict(config=repo_relative(config_spec), name=re.sub(r'[^a-z0-9-]', '-', name.lower()),
              reward_fns=','.join(spec.names), reward_imports=','.join(spec.imports),
              reward_gpu=','.join(gpu), reward_cpu=','.join(cpu), reward_backend=config.reward.backend)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--config', required=True, help="config file, 'path[:arg]'")
  p.add_argument('--accelerator', default=None, help='a TPU slice name of the AOT table, e.g. v5p-512')
  p.add_argument('--tpu_family', '--tpu-family', default='v5p', help='slice family for the default')
  p.add_argument('--gpus_per_node', '--gpus-per-node', type=int, default=8)
  p.add_argument('--nodes', type=int, default=None, help='GPU nodes (checked against the mesh)')
  p.add_argument('--devices', type=int, default=None, help='device count (for a -1 mesh axis)')
  p.add_argument('--require', choices=('tpu', 'gpu'), default=None,
                 help='fail unless the mesh fills a TPU slice / whole GPU nodes')
  p.add_argument('--rewards', action='store_true',
                 help='print the reward fields (REWARD_FIELDS) for a GPU reward pool instead')
  p.add_argument('--field', choices=sorted(set(FIELDS) | set(REWARD_FIELDS)), default=None,
                 help='print this field alone')
  p.add_argument('--format', choices=('json', 'shell'), default='json')
  p.add_argument('overrides', nargs='*', help='the train command flags after --')
  args = p.parse_args(argv)
  fields = REWARD_FIELDS if args.rewards else FIELDS
  if args.field and args.field not in fields:
    p.error(f'--field={args.field} is not a field of {"--rewards" if args.rewards else "the mesh"}')
  try:
    if args.rewards:
      info = reward_info(args.config, args.overrides)
    else:
      info = render(args.config, args.accelerator, args.tpu_family, args.gpus_per_node, args.nodes,
                    args.devices, args.overrides, args.require)
  except RenderError as e:
    print(f'render.py: error: {args.config}: {e}', file=sys.stderr)
    return 2
  if args.field:
    print(info[args.field])
  elif args.format == 'shell':
    for k in fields:
      print(f'R_{k.upper()}={shlex.quote(str(info[k]))}')
  else:
    print(json.dumps(info, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
