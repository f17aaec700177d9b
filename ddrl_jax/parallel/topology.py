"""Devices of a named TPU slice, for ahead-of-time (AOT) compiles on a CPU host, and of fake CPU meshes.

`topology_devices('v5p-512')` gives the 256 compile-only devices of that slice (libtpu builds them without
any TPU attached; install it with `pip install -e '.[aot]'`). A jit lowered with shardings on a Mesh of
them compiles for that slice, and `compiled.memory_analysis()` then reports per-device (per-chip) HBM
bytes, as MaxText's train_compile.py does. 'cpu-N' names the first N local CPU devices instead.

The table follows MaxText's accelerator_to_spec_map.py. In 'v4-N' and 'v5p-N' the N counts TensorCores:
two per chip, one JAX device per chip (megacore), so 'v5p-512' is 256 chips; in 'v5e-N' and 'v6e-N' it
counts chips. HBM is per chip in GiB (Google's v5p page: 'HBM capacity per chip (GiB) 95'); libtpu 0.0.42
lets a program use slightly more before it fails to compile (95.74 GiB on v5p, 31.75 on v4, 15.75 on
v5e, 31.25 on v6e), so a program that fits `hbm_bytes` fits the chip.
"""
import dataclasses
import os
import re

import jax
from jax.experimental import topologies

GIB = 2**30
_CPU_NAME = re.compile(r'cpu-([1-9][0-9]*)')


@dataclasses.dataclass(frozen=True)
class Topology:
  """One slice: the arguments of `jax.experimental.topologies.get_topology_desc` and its chips."""
  topology_name: str              # 'v5:4x8x8': libtpu's chip generation and chip grid
  chip_config_name: str           # 'megacore' (v5p), 'megacore_dense' (v4) or 'default' (v5e, v6e)
  chips_per_host_bounds: tuple    # the chip grid of one host
  wrap: tuple                     # torus wrap-around links in each grid dimension
  num_chips: int                  # = JAX devices of one slice
  hbm_bytes: int                  # per chip
  peak_bf16_flops: float          # per chip, per second

  @property
  def dims(self):
    """The chip grid as a tuple of ints: 'v5:4x8x8' -> (4, 8, 8)."""
    return tuple(int(d) for d in self.topology_name.split(':')[1].split('x'))


def _v5p(dims, wrap):
  return Topology(f'v5:{dims}', 'megacore', (2, 2, 1), (wrap,) * 3, _chips(dims), 95 * GIB, 459e12)


def _v4(dims, wrap):
  return Topology(f'v4:{dims}', 'megacore_dense', (2, 2, 1), (wrap,) * 3, _chips(dims), 32 * GIB, 275e12)


def _v5e(dims, wrap):
  return Topology(f'v5e:{dims}', 'default', (2, 2, 1), wrap, _chips(dims), 16 * GIB, 197e12)


def _v6e(dims, wrap):
  return Topology(f'v6e:{dims}', 'default', (2, 2, 1), wrap, _chips(dims), 32 * GIB, 918e12)


def _chips(dims):
  n = 1
  for d in dims.split('x'):
    n *= int(d)
  return n


_NO_WRAP_2D = (False, False, False)
TOPOLOGIES = {
    'v5p-8': _v5p('2x2x1', False),
    'v5p-16': _v5p('2x2x2', False),
    'v5p-32': _v5p('2x2x4', False),
    'v5p-64': _v5p('2x4x4', False),
    'v5p-128': _v5p('4x4x4', True),
    'v5p-256': _v5p('4x4x8', True),
    'v5p-512': _v5p('4x8x8', True),
    'v5p-1024': _v5p('8x8x8', True),
    'v5p-2048': _v5p('8x8x16', True),
    'v4-8': _v4('2x2x1', False),
    'v4-16': _v4('2x2x2', False),
    'v4-32': _v4('2x2x4', False),
    'v5e-4': _v5e('2x2', _NO_WRAP_2D),
    'v5e-8': _v5e('2x4', _NO_WRAP_2D),
    'v5e-16': _v5e('4x4', _NO_WRAP_2D),
    'v5e-32': _v5e('4x8', _NO_WRAP_2D),
    'v5e-64': _v5e('8x8', _NO_WRAP_2D),
    'v5e-128': _v5e('8x16', (False, True, False)),
    'v5e-256': _v5e('16x16', (True, True, False)),
    'v6e-4': _v6e('2x2', _NO_WRAP_2D),
    'v6e-8': _v6e('2x4', _NO_WRAP_2D),
    'v6e-16': _v6e('4x4', _NO_WRAP_2D),
    'v6e-32': _v6e('4x8', _NO_WRAP_2D),
    'v6e-64': _v6e('8x8', _NO_WRAP_2D),
    'v6e-128': _v6e('8x16', (False, True, False)),
    'v6e-256': _v6e('16x16', (True, True, False)),
}


def known_topologies():
  """The TPU names of the table ('cpu-N' for any N is accepted too)."""
  return tuple(TOPOLOGIES)


def topology(name):
  """The table's entry for a TPU name; ValueError naming the known ones for any other name."""
  if name not in TOPOLOGIES:
    raise ValueError(f'unknown topology {name!r}: use cpu-N (N local CPU devices) or one of '
                     f'{", ".join(TOPOLOGIES)}')
  return TOPOLOGIES[name]


def num_devices(name, num_slices=1):
  """JAX devices of `num_slices` slices of `name` ('cpu-N': N), without loading libtpu."""
  match = _CPU_NAME.fullmatch(name)
  return int(match.group(1)) if match else topology(name).num_chips * num_slices


def hbm_bytes(name):
  """HBM bytes per chip (= per JAX device) of a TPU name; None for 'cpu-N'."""
  if _CPU_NAME.fullmatch(name):
    return None
  return topology(name).hbm_bytes


def topology_devices(name, num_slices=1):
  """The devices of `name`: 'cpu-N' -> the first N local CPU devices; a TPU name -> compile-only devices.

  TPU devices come from libtpu without any chip attached (`num_slices` > 1: multislice, with
  `slice_index` set); they can lower and compile, not run. Their order is libtpu's; pass them through
  `jax.experimental.mesh_utils.create_device_mesh(shape, devices)` for a physically ordered mesh.
  """
  if num_slices < 1:
    raise ValueError(f'num_slices={num_slices} must be >= 1')
  match = _CPU_NAME.fullmatch(name)
  if match:
    return _cpu_devices(int(match.group(1)), num_slices)
  spec = topology(name)
  _allow_shared_libtpu(name)
  try:
    desc = topologies.get_topology_desc(
        platform='tpu', topology_name=spec.topology_name, chip_config_name=spec.chip_config_name,
        chips_per_host_bounds=spec.chips_per_host_bounds, num_slices=num_slices, wrap=spec.wrap)
  except RuntimeError as e:
    if 'not installed' in str(e):
      raise RuntimeError(f'topology {name!r} needs libtpu for compile-only TPU devices: '
                         "pip install -e '.[aot]'") from e
    if 'lockfile' in str(e):
      raise RuntimeError(f'topology {name!r}: another process holds /tmp/libtpu_lockfile and '
                         'ALLOW_MULTIPLE_LIBTPU_LOAD is not 1') from e
    raise
  return list(desc.devices)


def _cpu_devices(n, num_slices):
  """The first n local CPU devices; ValueError saying how to get more."""
  if num_slices != 1:
    raise ValueError(f'cpu-{n}: num_slices={num_slices}, but CPU devices have no slices '
                     f'(use cpu-{n * num_slices})')
  devices = jax.devices('cpu')
  if len(devices) < n:
    raise ValueError(f'cpu-{n} needs {n} CPU devices, JAX has {len(devices)}: call '
                     f"jax.config.update('jax_num_cpu_devices', {n}) (or set "
                     f'XLA_FLAGS=--xla_force_host_platform_device_count={n}) before JAX starts')
  return devices[:n]


def _allow_shared_libtpu(accelerator_type):
  """On a host without TPU chips, lets libtpu load while another process holds its lockfile (and
  quietly: see below).

  With libtpu installed every JAX process whose platforms include 'tpu' (the default) takes
  /tmp/libtpu_lockfile for its lifetime, even where TPU init then fails; without this a compile-only
  topology fails with 'ABORTED: Internal error when accessing libtpu multi-process lockfile' whenever any
  other JAX process runs. On a TPU host the lock guards the chips, so it is left alone there.
  """
  if _host_has_tpu_chips():
    return
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  # Without a TPU VM's metadata libtpu cannot tell the accelerator type or worker names and prints
  # five lines of INVALID_ARGUMENT noise before the first compile; naming them (the compile-only
  # topology is passed explicitly anyway) keeps a CPU host's aot output to its own lines.
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', accelerator_type)
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')


def _host_has_tpu_chips():
  """Whether this host has TPU chips on its PCI bus (True when that cannot be told)."""
  try:
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
  except Exception:  # pylint: disable=broad-except
    return True
