"""`python -m ddrl_jax.aot`: the trainer's jitted functions compiled ahead of time with memory_analysis, on
8 fake CPU devices (the CI path) and, where libtpu is installed, for a real TPU topology (compile only)."""
import importlib.util

import pytest

from configs import cosmos2b
from ddrl_jax import aot


def _rows(mesh, topology='cpu-8', fns=('update',)):
  config = cosmos2b.get_config('smoke')
  config.mesh.update(mesh)
  return {r['fn']: r for r in aot.compile_report(config, topology, fns=fns)}


def test_cpu_compile_reports_memory_and_fsdp_shrinks_the_state():
  replicated = _rows(dict(data=8, fsdp=1, context=1), fns=('rollout',))
  sharded = _rows(dict(data=2, fsdp=4, context=1), fns=('rollout', 'update'))
  for row in (replicated['rollout'], *sharded.values()):
    assert row['per_chip_bytes'] == (row['argument_bytes'] + row['output_bytes'] - row['alias_bytes']
                                     + row['temp_bytes']) > 0
    assert row['peak_bytes'] >= row['per_chip_bytes'] - row['argument_bytes'] + row['resident_bytes']
    assert row['resident_bytes'] >= row['argument_bytes']
    assert row['flops'] > 0 and row['analytic_flops'] > 0 and row['compile_s'] > 0
    assert row['hbm_bytes'] is None and 'fits' not in row
  assert sharded['update']['alias_bytes'] > 0              # the donated state is updated in place
  # Parameters (and with them Adam's moments and the EMA) over fsdp = 4: about 4x fewer bytes per device.
  rep, shd = replicated['rollout'], sharded['rollout']
  assert rep['param_bytes_per_chip'] == pytest.approx(4 * shd['param_bytes_per_chip'], rel=0.02)
  assert shd['resident_bytes'] < 0.4 * rep['resident_bytes']
  assert rep['replicated_param_fraction'] == 1.0 and shd['replicated_param_fraction'] < 0.02


def test_network_passes_count_the_iteration():
  c = cosmos2b.get_config()
  assert aot.network_passes(c, 'rollout', 'full') == 21        # 20 steps + cosmos' final clean call
  assert aot.network_passes(c, 'update', 'full') == 40         # 10 trained steps x (fwd + bwd + remat)
  assert aot.network_passes(c, 'data_grads', 'none') == 30
  c.rl.data_loss_steps = 'reduced'
  assert aot.network_passes(c, 'data_grads', 'full') == 4


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason="needs libtpu for compile-only TPU devices: pip install -e '.[aot]'")
def test_tpu_topology_compile_of_the_smoke_iteration():
  """The smoke iteration for v5p-8 (4 chips), FSDP 2 x context 2 with Ulysses and the splash kernel."""
  rows = _rows(dict(data=1, fsdp=2, context=2), topology='v5p-8', fns=('rollout', 'update'))
  for row in rows.values():
    assert row['fits'] and row['hbm_bytes'] == 95 * 2**30
    assert row['attention'] == 'splash' and row['context_impl'] == 'ulysses'
    assert 0 < row['per_chip_bytes'] < 2**30
