"""Per-host batch rows (parallel/hosts.py) and multi-process start-up (distributed.py), in one process.

The multi-process runs themselves are in test_multihost.py; here: row sets of real pod layouts (the
compile-only v5p devices carry their host's process index), the errors, the local data-parallel decode,
and cluster detection from environment variables.
"""
import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import cosmos14b
from configs import cosmos2b
from ddrl_jax import distributed
from ddrl_jax import parallel
from ddrl_jax.parallel import hosts

try:
  import libtpu  # pylint: disable=g-import-not-at-top,unused-import
  HAVE_LIBTPU = True
except ImportError:
  HAVE_LIBTPU = False


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  process_index: int


class FakeSharding:
  """devices_indices_map of a leading axis split into equal blocks, block i on fake device i."""

  def __init__(self, processes_of_blocks):
    self.blocks = processes_of_blocks

  def devices_indices_map(self, shape):
    n, k = shape[0], len(self.blocks)
    return {FakeDevice(i, p): (slice(i * n // k, (i + 1) * n // k),) for i, p in enumerate(self.blocks)}


def test_row_split_groups_replica_processes_and_picks_leads():
  # 4 blocks of 4 rows on processes 0, 1, 0, 1: each process holds two blocks and leads its own set.
  split = hosts.row_split(FakeSharding([0, 1, 0, 1]), 16, process=1)
  assert split.of_process[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
  assert split.mine.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
  assert split.leads == [0, 1] and split.is_lead


def test_row_split_rejects_partially_overlapping_processes():
  class Overlap(FakeSharding):
    def devices_indices_map(self, shape):
      return {FakeDevice(0, 0): (slice(0, 4),), FakeDevice(1, 1): (slice(2, 6),),
              FakeDevice(2, 1): (slice(6, 8),)}

  with pytest.raises(ValueError, match='partially overlapping'):
    hosts.row_split(Overlap([]), 8)


def test_one_process_layout_is_the_whole_batch():
  mesh = parallel.make_mesh(dict(data=2, fsdp=2, context=2, tensor=1), jax.devices()[:8])
  plan = parallel.ShardingPlan.from_config(cosmos2b.get_config('smoke'), mesh)
  lay = hosts.batch_layout(plan.batch(), plan.sharding(('act_batch',), (8,), 'data'), 8, 2)
  assert lay.slots.mine.tolist() == list(range(16)) and lay.groups.tolist() == list(range(8))
  assert (lay.shard_index, lay.shard_count) == (0, 1) and lay.slots.is_lead
  cond = np.arange(8) * 10
  assert lay.slots_from_groups(cond).tolist() == np.repeat(cond, 2).tolist()
  assert lay.list_from_groups(list('abcdefgh')) == [c for c in 'abcdefgh' for _ in range(2)]
  x = hosts.assemble(np.arange(16.0), plan.batch(), 16)
  assert x.sharding.is_equivalent_to(plan.batch(), 1)
  np.testing.assert_array_equal(hosts.local_values(x, lay.slots.mine), np.arange(16.0))
  np.testing.assert_array_equal(hosts.exchange(np.arange(16.0), lay.slots), np.arange(16.0))
  assert hosts.mean_over_leads({'a': 2.0}, 16, lay.slots) == {'a': 2.0}


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu not installed (pip install -e '.[aot]')")
@pytest.mark.parametrize('config_module,topology_name,expected_shards,replicas_span_hosts', [
    (cosmos2b, 'v5p-512', 16, False),      # context 2 inside a 4-chip host
    (cosmos14b, 'v5p-2048', 4, True)])     # context 8 over two hosts
def test_pod_layouts_share_rows_only_between_context_replicas(config_module, topology_name,
                                                              expected_shards, replicas_span_hosts):
  """The full configs on their slices (compile-only devices, 4 chips per host): every slot row has one
  lead, hosts share rows exactly when they hold the same (data, fsdp) coordinates, and the loader's
  shards are the distinct group sets."""
  from ddrl_jax.parallel import topology  # pylint: disable=g-import-not-at-top
  config = config_module.get_config()
  devices = topology.topology_devices(topology_name)
  mesh = parallel.make_mesh(config.mesh, devices)
  plan = parallel.ShardingPlan.from_config(config, mesh)
  b, n = config.batch_size, config.num_rollouts
  data_sharding = plan.sharding(('act_batch',), (b,), 'data')
  layouts = {p: hosts.batch_layout(plan.batch(), data_sharding, b, n, process=p)
             for p in sorted({d.process_index for d in devices})}
  split = layouts[0].slots
  # (data, fsdp) coordinates of each process's devices.
  coords = {}
  for idx in np.ndindex(mesh.devices.shape):
    coords.setdefault(mesh.devices[idx].process_index, set()).add(idx[:2])
  for p in layouts:
    for q in layouts:
      same_rows = split.of_process[p].tolist() == split.of_process[q].tolist()
      assert same_rows == (coords[p] == coords[q]), (p, q)
  covered = np.concatenate([split.of_process[p] for p in split.leads])
  assert sorted(covered.tolist()) == list(range(b * n))          # each slot scored exactly once
  assert (len(split.leads) < len(layouts)) == replicas_span_hosts
  assert {lay.shard_count for lay in layouts.values()} == {expected_shards}
  by_shard = {}
  for lay in layouts.values():
    by_shard.setdefault(lay.shard_index, set()).add(tuple(lay.groups.tolist()))
  assert all(len(v) == 1 for v in by_shard.values())             # one shard = one group set
  groups = [g for v in by_shard.values() for g in next(iter(v))]
  assert sorted(groups) == list(range(b))                        # disjoint and covering


def test_local_data_parallel_matches_plain_jit_with_padding():
  fn = lambda s, x: (jnp.tanh(x @ s['w']), (x > 0).all(-1))
  state = {'w': jnp.asarray(np.random.default_rng(0).normal(size=(3, 5)), jnp.float32)}
  call = hosts.local_data_parallel(fn)
  assert call.num_devices == jax.local_device_count()
  x = np.random.default_rng(1).normal(size=(11, 3)).astype(np.float32)     # 11: not a multiple of 8
  got = call(call.place(state), x)
  want = jax.jit(fn)(state, x)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  np.testing.assert_array_equal(got[1], want[1])
  assert got[0].shape == (11, 5)


@pytest.mark.parametrize('env,expected', [
    ({}, None),
    ({'JAX_COORDINATOR_ADDRESS': '10.0.0.1:1234'}, 'explicit'),
    ({'TPU_WORKER_HOSTNAMES': 'w0,w1,w2,w3'}, 'cloud_tpu'),
    ({'TPU_WORKER_HOSTNAMES': 'localhost'}, None),                       # a single-host TPU VM
    ({'MEGASCALE_COORDINATOR_ADDRESS': 'w0'}, 'cloud_tpu'),
    (dict(SLURM_JOB_ID='7', SLURM_STEP_NODELIST='n[1-4]', SLURM_NTASKS='32', SLURM_PROCID='3',
          SLURM_LOCALID='3'), 'slurm'),
    (dict(SLURM_JOB_ID='7', SLURM_STEP_NODELIST='n1', SLURM_NTASKS='1', SLURM_PROCID='0',
          SLURM_LOCALID='0'), None),                                     # one srun task
    ({'SLURM_JOB_ID': '7'}, None),                                       # sbatch script, outside srun
    ({'OMPI_MCA_orte_hnp_uri': '1.0;tcp://10.0.0.1:1'}, 'open_mpi'),
    # JAX's Kubernetes bootstrap needs the kubernetes package; without it this is one process.
    ({'KUBERNETES_SERVICE_HOST': '10.0.0.1', 'JOB_COMPLETION_INDEX': '2'},
     'kubernetes' if importlib.util.find_spec('kubernetes') else None),
])
def test_detect_cluster_from_environment(env, expected):
  assert distributed.detect_cluster(env) == expected


def test_initialize_is_a_noop_for_one_process_and_sets_the_cache(tmp_path):
  before = jax.config.jax_compilation_cache_dir
  try:
    info = distributed.initialize(distributed.Options(compilation_cache_dir=str(tmp_path)), environ={})
    assert info == dict(initialized=False, cluster=None, process_index=0, process_count=1)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    info = distributed.initialize(distributed.Options(num_processes=1), environ={'SLURM_JOB_ID': '1'})
    assert not info['initialized']
  finally:
    jax.config.update('jax_compilation_cache_dir', before)


def test_start_up_flags_parse_into_options():
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FlagValues()
  distributed.define_flags(fv)
  fv(['prog', '--coordinator_address=10.0.0.1:8476', '--num_processes=4', '--process_id=2',
      '--local_device_ids=0,1', '--compilation_cache_dir=/tmp/cache'])
  options = distributed.options_from_flags(fv)
  assert options == distributed.Options(coordinator_address='10.0.0.1:8476', num_processes=4,
                                        process_id=2, local_device_ids=[0, 1],
                                        compilation_cache_dir='/tmp/cache')
  assert options.explicit


def test_bucket_workdirs_stay_urls_and_metrics_are_rewritten_whole(tmp_path, monkeypatch):
  """A gs:// workdir is not made into a local path, and (as a bucket cannot append) MetricWriter then
  rewrites metrics.jsonl whole through etils.epath; resuming drops the re-run steps as locally."""
  from ddrl_jax import image_grid  # pylint: disable=g-import-not-at-top
  from ddrl_jax import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  from ddrl_jax import storage  # pylint: disable=g-import-not-at-top
  assert storage.absolute('gs://bucket/run') == 'gs://bucket/run'
  assert storage.absolute('run') == str(tmp_path.cwd() / 'run')
  monkeypatch.setattr(storage, 'is_remote', lambda path: True)   # epath also serves local paths
  writer = metrics_lib.MetricWriter(tmp_path, resume_step=0)
  assert writer.remote and writer._file is None
  for step in (1, 2, 3):
    writer.write(step, {'loss': float(step)})
  writer.close()
  resumed = metrics_lib.MetricWriter(tmp_path, resume_step=2)
  resumed.write(3, {'loss': 30.0})
  resumed.close()
  assert [(r['step'], r['loss']) for r in metrics_lib.read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0),
                                                                                 (3, 30.0)]
  image_grid.write_grid(str(tmp_path / 'samples' / 'grid.png'), np.zeros((2, 4, 4, 3), np.uint8), 2)
  assert (tmp_path / 'samples' / 'grid.png').read_bytes()[:4] == b'\x89PNG'
