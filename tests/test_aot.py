"""`python -m ddrl_jax.aot`: the trainer's jitted functions compiled ahead of time with memory_analysis, on
8 fake CPU devices (the CI path) and, where libtpu is installed, for a real TPU topology (compile only)."""
import importlib.util

import jax
import ml_collections
import pytest

from configs import cosmos2b
from ddrl_jax import aot
from ddrl_jax import config as config_lib
from ddrl_jax import parallel
from ddrl_jax import tasks
from ddrl_jax.models import attention
from ddrl_jax.models import family as family_lib
from ddrl_jax.parallel import topology

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                                  reason="needs libtpu for compile-only TPU devices: pip install -e '.[aot]'")


def _config(mesh, long_attention=False):
  config = cosmos2b.get_config('smoke')
  config.mesh.update(mesh)
  if long_attention:
    # The smoke video has 8 tokens: from 8 tokens on, self-attention takes the configured kernel, while
    # the 4 text tokens of the cross-attention stay on 'xla' (as the 512 of the real model do).
    config.cosmos.attention.min_flash_len = 8
    config.cosmos.text_length = 4
  return config


def _rows(mesh, topology='cpu-8', fns=('update',), long_attention=False):
  return {r['fn']: r for r in aot.compile_report(_config(mesh, long_attention), topology, fns=fns)}


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


def test_rows_name_the_kernels_their_programs_contain():
  """On cpu-8 the configs' '' kernel is 'xla': the self-attention runs it, the text cross-attention its
  short-sequence fallback; the smoke's default min_flash_len leaves only the fallback."""
  long = _rows(dict(data=2, fsdp=2, context=2), fns=('rollout',), long_attention=True)['rollout']
  assert long['attention'] == ['xla', 'xla_short'] and long['attention_family'] == 'xla'
  config = _config(dict(data=2, fsdp=2, context=2))
  lowered = {r['fn']: r for r in aot.compile_report(config, 'cpu-8', lower_only=True)}   # --lower_only
  assert set(lowered) == set(aot.FUNCTIONS)
  for row in lowered.values():
    assert row['attention'] == ['xla_short'] and row['lower_s'] > 0 and 'peak_bytes' not in row


def test_a_program_without_the_family_kernel_is_refused_before_compiling(monkeypatch):
  """A family that names 'splash' where the traced program runs 'xla' stops the report (no row)."""
  monkeypatch.setattr(family_lib.SectionFamily, 'attention_kernel', lambda self, platform: 'splash')
  with pytest.raises(aot.KernelMismatch, match=r"rollout lowered for cpu-8: long-sequence attention runs "
                     r"\['xla'\] where the family names 'splash' for cpu"):
    _rows(dict(data=2, fsdp=2, context=2), fns=('rollout',), long_attention=True)


# The smoke DiT takes 32-wide text: a Reason1 encoder of 2 layers x 16 (reason1_text.save_tiny's shapes).
TINY_ENCODER = dict(vocab_size=300, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=32)


def _reason1_config(mesh, **overrides):
  config = _config(mesh)
  config.cosmos.text = 'reason1'
  config.cosmos.text_encoder_overrides = ml_collections.ConfigDict(dict(TINY_ENCODER, **overrides))
  return config


def test_text_encoder_row_holds_fsdp_sharded_params_resident_beside_the_iteration():
  """config.cosmos.text='reason1': the 'text_encoder' row compiles the encoder's sharded forward with its
  parameters FSDP over one host's devices (all 8 of cpu-8, whatever the run's mesh: each process encodes
  its own prompts; per-chip arguments below the parameter bytes), and the step functions' rows count
  those bytes as resident (text_encoder_bytes) on top of what they held without the encoder."""
  mesh = dict(data=2, fsdp=4, context=1)
  rows = {r['fn']: r for r in aot.compile_report(_reason1_config(mesh), 'cpu-8',
                                                  fns=('rollout', 'text_encoder'))}
  enc, rollout = rows['text_encoder'], rows['rollout']
  total = enc['text_encoder']['total_param_bytes']
  assert enc['text_encoder']['num_layers'] == 2 and enc['text_encoder']['param_dtype'] == 'float32'
  assert enc['argument_bytes'] < total and enc['param_bytes_per_chip'] < 0.3 * total
  assert enc['text_encoder_bytes'] == enc['param_bytes_per_chip'] and enc['replicated_param_fraction'] < 0.02
  assert enc['text_encoder']['input_ids_spec'] == 'P()'       # 4 prompts do not divide over 8 chips
  assert enc['param_bytes_per_chip'] <= total / 8 * 1.05
  assert enc['attention'] == ['xla_short'] and enc['attention_family'] == 'xla'
  assert enc['per_chip_bytes'] > 0 and enc['resident_bytes'] > enc['argument_bytes'] and enc['compile_s'] > 0
  without = _rows(mesh, fns=('rollout',))['rollout']
  assert 'text_encoder_bytes' not in without
  assert rollout['text_encoder_bytes'] == enc['text_encoder_bytes']
  assert rollout['resident_bytes'] == without['resident_bytes'] + rollout['text_encoder_bytes']
  assert rollout['peak_bytes'] == without['peak_bytes'] + rollout['text_encoder_bytes']


def test_text_encoder_is_in_the_default_functions_only_when_the_task_runs_one():
  mesh = dict(data=2, fsdp=2, context=2)
  lowered = {r['fn']: r for r in aot.compile_report(_reason1_config(mesh), 'cpu-8', lower_only=True)}
  assert tuple(lowered) == aot.ALL_FUNCTIONS
  assert lowered['text_encoder']['attention'] == ['xla_short']
  with pytest.raises(config_lib.ConfigError, match="--fns=text_encoder: task 'video' runs no text "
                     "encoder on the training devices"):
    list(aot.compile_report(_config(mesh), 'cpu-8', fns=('text_encoder',), lower_only=True))
  with pytest.raises(ValueError, match='3 layers x 16 = 48-wide embeddings; the DiT takes 32'):
    list(aot.compile_report(_reason1_config(mesh, num_layers=3), 'cpu-8', lower_only=True))


@needs_libtpu
def test_tpu_rows_hold_the_target_kernel_whatever_traced_first():
  """Issue 42: for a TPU slice the configs' '' kernel is splash in every compiled function, although
  `abstract_inputs` traces the rollout and data_grads with `eval_shape` on this CPU host first (jit
  caches that trace). Smoke shapes with long self-attention, v5p-8, FSDP 2 x context 2 (Ulysses)."""
  rows = _rows(dict(data=1, fsdp=2, context=2), topology='v5p-8', fns=aot.FUNCTIONS, long_attention=True)
  assert set(rows) == set(aot.FUNCTIONS)
  for row in rows.values():
    assert row['attention'] == ['splash', 'xla_short'], row['fn']
    assert row['attention_family'] == 'splash' and row['context_impl'] == 'ulysses'
    assert row['fits'] and 0 < row['peak_bytes'] < 2**30


@needs_libtpu
def test_plan_scope_resolves_for_the_mesh_platform():
  config = _config(dict(data=1, fsdp=2, context=2))
  mesh = parallel.make_mesh(config.mesh, topology.topology_devices('v5p-8'))
  tpu = parallel.ShardingPlan.for_model(config, mesh, tasks.get_family(config))
  assert tpu.platform == 'tpu'
  assert tpu.scope(attention.current_platform)() == 'tpu'
  assert attention.current_platform() == jax.default_backend()


@pytest.mark.slow
@needs_libtpu
def test_tpu_topology_compile_of_the_smoke_iteration():
  """The smoke iteration for v5p-8 (4 chips), FSDP 2 x context 2 with Ulysses; its 8-token sequences are
  under min_flash_len, so the program holds only XLA attention although the family names splash."""
  rows = _rows(dict(data=1, fsdp=2, context=2), topology='v5p-8', fns=('rollout', 'update'))
  for row in rows.values():
    assert row['fits'] and row['hbm_bytes'] == 95 * 2**30
    assert row['attention'] == ['xla_short'] and row['attention_family'] == 'splash'
    assert row['context_impl'] == 'ulysses'
    assert 0 < row['per_chip_bytes'] < 2**30


@pytest.mark.slow
@needs_libtpu
def test_cosmos2b_rollout_fits_its_paper_slice():
  """Issue 42's guard: the paper's Cosmos 2B rollout (86,400 tokens) for v5p-512 compiles with splash and
  fits; with XLA attention its (S, S) logits need about 230 GB per chip and it would not."""
  row, = aot.compile_report(cosmos2b.get_config(), 'v5p-512', fns=('rollout',))
  assert row['attention'] == ['splash', 'xla_short'] and row['attention_family'] == 'splash'
  assert row['fits'] and row['peak_bytes'] < 20e9, row
