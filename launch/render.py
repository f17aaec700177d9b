"""The hardware a config's mesh needs, for the launch scripts: devices, TPU slice, hosts, GPU nodes.

  python launch/render.py --config=configs/cosmos2b.py                 # JSON, every field
  python launch/render.py --config=configs/cosmos14b.py --field=accelerator   # v5p-2048
  python launch/render.py --config=configs/cosmos2b.py --format=shell  # KEY=value lines for `eval`
  python launch/render.py --config=configs/cosmos2b.py -- --config.mesh.data=8   # train overrides

The device count is the product of `config.mesh` resolved by `ddrl_jax.parallel.mesh_shape`. A mesh
with a -1 axis fills whatever it is given, so then the hardware must be named (--accelerator, --nodes or
--devices). The TPU slice is the entry of `ddrl_jax.parallel.topology.TOPOLOGIES` (the AOT tool's table)
of the --tpu_family with exactly that many chips (v5p: 'v5p-512' = 256 chips, 4 chips per host); a
named --accelerator must be in that table and have that many chips. GPU nodes = devices /
--gpus_per_node (8: H100/H200 nodes). Arguments after `--` are the train command's extra flags; the
`--config.mesh.<axis>=N` among them change the mesh here as they will in training.

Any inconsistency (mesh vs. slice vs. nodes) exits 2 with one line saying what does not fit, so a
launch script stops before it asks for hardware. Nothing here touches an accelerator or the network.
"""
import argparse
import importlib.util
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

from ddrl_jax.parallel import mesh as mesh_lib      # pylint: disable=g-import-not-at-top,wrong-import-position
from ddrl_jax.parallel import topology as topology_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

FIELDS = ('config', 'config_path', 'name', 'mesh', 'mesh_desc', 'devices', 'accelerator', 'chips',
          'tpu_hosts', 'gpus_per_node', 'gpu_nodes')
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
  module_spec = importlib.util.spec_from_file_location('_ddrl_launch_config', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return (module.get_config(arg) if arg else module.get_config()), path, arg


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
  p.add_argument('--field', choices=FIELDS, default=None, help='print this field alone')
  p.add_argument('--format', choices=('json', 'shell'), default='json')
  p.add_argument('overrides', nargs='*', help='the train command flags after --')
  args = p.parse_args(argv)
  try:
    info = render(args.config, args.accelerator, args.tpu_family, args.gpus_per_node, args.nodes,
                  args.devices, args.overrides, args.require)
  except RenderError as e:
    print(f'render.py: error: {args.config}: {e}', file=sys.stderr)
    return 2
  if args.field:
    print(info[args.field])
  elif args.format == 'shell':
    for k in FIELDS:
      print(f'R_{k.upper()}={shlex.quote(str(info[k]))}')
  else:
    print(json.dumps(info, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
