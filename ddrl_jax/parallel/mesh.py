"""The device mesh (data, fsdp, context, tensor).

Batches split their leading slot axis over (data, fsdp); parameters follow the logical rules of
`rules.py` (FSDP over fsdp, replicated over data); the sequence of a video splits over context
(`plan.py`, `context.py`).
"""
import logging
import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

logger = logging.getLogger(__name__)

AXES = ('data', 'fsdp', 'context', 'tensor')
BATCH_AXES = ('data', 'fsdp')


def mesh_shape(mesh_config, num_devices):
  """Resolves the config's axis sizes (one may be -1: the remaining devices) to a tuple.

  Raises ValueError naming `config.mesh.<axis>` when the sizes cannot fill `num_devices` exactly.
  """
  sizes = [int(mesh_config[a]) for a in AXES]
  fill = [a for a, s in zip(AXES, sizes) if s == -1]
  if len(fill) > 1:
    raise ValueError(f'config.mesh: at most one axis may be -1, got {fill}')
  for a, s in zip(AXES, sizes):
    if s == 0 or s < -1:
      raise ValueError(f'config.mesh.{a}={s} must be a positive size or -1')
  known = math.prod(s for s in sizes if s != -1)
  if fill:
    if num_devices % known:
      raise ValueError(f'config.mesh.{fill[0]}=-1: {num_devices} devices are not divisible by the other '
                       f'axes ({known})')
    sizes[AXES.index(fill[0])] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f'config.mesh {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices, '
                     f'have {num_devices}: set --config.mesh.data, .fsdp, .context and .tensor to sizes whose '
                     f'product is {num_devices} (-1 fills one of them), run on the hardware the config '
                     "names, or try its ':smoke' preset")
  return tuple(sizes)


def make_mesh(mesh_config, devices=None):
  """A 4-axis Mesh with Auto axis types (sharding by jit in/out shardings and logical rules).

  Accelerator devices are arranged by `mesh_utils.create_device_mesh` (the physical torus / NVLink
  order, so the innermost axes, context and tensor, get the nearest chips); CPU devices in order."""
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(mesh_config, len(devices))
  grid = np.asarray(devices).reshape(shape)
  if devices[0].platform != 'cpu':
    try:
      grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError) as e:
      logger.warning('mesh %s: no physical device order (%s); using the device list order', shape, e)
  return jax.sharding.Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def data_parallel_size(mesh):
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def replicated(mesh):
  return NamedSharding(mesh, P())


def batch_sharding(mesh):
  """Leading axis over (data, fsdp), the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))

