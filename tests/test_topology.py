"""The TPU topology table, 'cpu-N' devices, and (with libtpu) compile-only TPU devices and an AOT compile."""
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import mesh_utils
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ddrl_jax.parallel import mesh as mesh_lib
from ddrl_jax.parallel import topology as topo

try:
  import libtpu  # pylint: disable=g-import-not-at-top,unused-import
  HAVE_LIBTPU = True
except ImportError:
  HAVE_LIBTPU = False
needs_libtpu = pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu not installed (pip install -e '.[aot]')")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V5P = ('v5p-8', 'v5p-16', 'v5p-32', 'v5p-64', 'v5p-128', 'v5p-256', 'v5p-512', 'v5p-1024', 'v5p-2048')
CHIP_CONFIG = {'v5p': 'megacore', 'v4': 'megacore_dense', 'v5e': 'default', 'v6e': 'default'}
LIBTPU_GENERATION = {'v5p': 'v5', 'v4': 'v4', 'v5e': 'v5e', 'v6e': 'v6e'}


def test_table_is_consistent():
  assert set(V5P) <= set(topo.known_topologies())
  for name in topo.known_topologies():
    spec = topo.topology(name)
    generation, count = re.fullmatch(r'(v\w+)-(\d+)', name).groups()
    assert spec.topology_name.split(':')[0] == LIBTPU_GENERATION[generation], name
    assert spec.chip_config_name == CHIP_CONFIG[generation], name
    assert spec.num_chips == math.prod(spec.dims), name
    # v4 and v5p names count TensorCores, two per chip (one megacore device); v5e and v6e count chips.
    assert int(count) == spec.num_chips * (2 if generation in ('v4', 'v5p') else 1), name
    assert len(spec.wrap) == 3 and len(spec.chips_per_host_bounds) == 3, name
    assert spec.num_chips % math.prod(spec.chips_per_host_bounds) == 0, name
    assert topo.hbm_bytes(name) == spec.hbm_bytes > 0 and spec.peak_bf16_flops > 0, name
  assert topo.hbm_bytes('v5p-512') == 95 * 2**30
  assert topo.topology('v5p-512').peak_bf16_flops == 459e12
  assert not any(topo.topology(n).wrap[0] for n in V5P[:4]) and all(topo.topology(n).wrap[0] for n in V5P[4:])


def test_cpu_devices():
  devices = topo.topology_devices('cpu-8')
  assert devices == jax.devices('cpu')[:8] and len(devices) == 8
  assert topo.topology_devices('cpu-2') == devices[:2]
  assert topo.hbm_bytes('cpu-8') is None
  with pytest.raises(ValueError, match=r"jax_num_cpu_devices', 9"):
    topo.topology_devices('cpu-9')
  with pytest.raises(ValueError, match='no slices'):
    topo.topology_devices('cpu-4', num_slices=2)


@pytest.mark.parametrize('name', ['v9-8', 'v5p-7', 'cpu-0', 'cpu', ''])
def test_unknown_name(name):
  with pytest.raises(ValueError, match=r'unknown topology .*cpu-N.*v5p-8, v5p-16'):
    topo.topology_devices(name)
  with pytest.raises(ValueError, match='unknown topology'):
    topo.hbm_bytes(name)


_WITHOUT_LIBTPU = '''
import re
import pytest
try:
  import libtpu
  raise SystemExit('libtpu is importable: not hidden')
except ImportError as e:
  assert 'hidden by tests/test_topology.py' in str(e), e
from ddrl_jax.parallel import topology
with pytest.raises(RuntimeError, match=re.escape("pip install -e '.[aot]'")):
  topology.topology_devices('v5p-8')
print('raised')
'''


def test_tpu_without_libtpu_says_how_to_install(tmp_path):
  """In a process where `import libtpu` fails (a module of that name first on PYTHONPATH raises
  ImportError), so the check runs whether or not libtpu is installed here."""
  (tmp_path / 'libtpu.py').write_text("raise ImportError('libtpu hidden by tests/test_topology.py')\n")
  env = {k: v for k, v in os.environ.items() if k not in ('TPU_LIBRARY_PATH', 'PYTHONPATH')}
  env.update(JAX_PLATFORMS='cpu', PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
  proc = subprocess.run([sys.executable, '-c', _WITHOUT_LIBTPU], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0 and proc.stdout.split() == ['raised'], proc.stdout + proc.stderr


@needs_libtpu
def test_tpu_device_counts():
  for name in topo.known_topologies():
    devices = topo.topology_devices(name)
    assert len(devices) == topo.topology(name).num_chips, name
  assert len(topo.topology_devices('v5p-8')) == 4
  assert len(topo.topology_devices('v5p-512')) == 256
  assert len(topo.topology_devices('v5p-2048')) == 1024
  two = topo.topology_devices('v5p-8', num_slices=2)
  assert len(two) == 8 and sorted({d.slice_index for d in two}) == [0, 1]


@needs_libtpu
def test_aot_compile_v5p_8():
  """A (data, fsdp, context, tensor) mesh of v5p-8's four chips; a sharded matmul compiles for it."""
  devices = topo.topology_devices('v5p-8')
  assert {d.platform for d in devices} == {'tpu'} and devices[0].device_kind == 'TPU v5'
  mesh = Mesh(mesh_utils.create_device_mesh((1, 2, 1, 2), devices), mesh_lib.AXES,
              axis_types=(AxisType.Auto,) * len(mesh_lib.AXES))
  x_sharding = NamedSharding(mesh, P(mesh_lib.BATCH_AXES, None))
  w_sharding = NamedSharding(mesh, P('fsdp', 'tensor'))
  y_sharding = NamedSharding(mesh, P(mesh_lib.BATCH_AXES, 'tensor'))
  step = jax.jit(lambda x, w: jnp.tanh(x @ w), in_shardings=(x_sharding, w_sharding),
                 out_shardings=y_sharding)
  compiled = step.lower(jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=x_sharding),
                        jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=w_sharding)).compile()
  memory = compiled.memory_analysis()
  assert memory is not None
  per_device_w = 256 * 512 * 2 // 4
  assert memory.argument_size_in_bytes >= per_device_w
  assert memory.output_size_in_bytes >= 64 * 512 * 2 // 4
  # Per chip: x split 2 ways on the batch, w 4 ways, y 4 ways; the contraction needs w's rows gathered
  # over fsdp (256 x 256 bf16 in temporaries, an all-gather).
  assert memory.argument_size_in_bytes == 64 * 256 * 2 // 2 + per_device_w
  assert memory.output_size_in_bytes == 64 * 512 * 2 // 4
  assert memory.alias_size_in_bytes == 0 and memory.temp_size_in_bytes >= 256 * 256 * 2
  assert 'all-gather' in compiled.as_text()
  assert memory.argument_size_in_bytes + memory.temp_size_in_bytes < topo.hbm_bytes('v5p-8')
  assert compiled.cost_analysis()['flops'] > 0
  assert compiled.cost_analysis()['flops'] == pytest.approx(2 * 32 * 256 * 256, rel=0.01)   # per chip
