"""LoRA (ddrl_jax/models/lora.py, layers.Dense): exactness against independent forms, the adapter-sized
train state, resume, the frozen base's identity, and bad input."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_ocr_pipeline import tiny_config  # tests/test_ocr_pipeline.py

from ddrl_jax import checkpoints as checkpoints_lib
from ddrl_jax import config as config_lib
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.models.cosmos import dit as cosmos_dit
from ddrl_jax.models import lora

ATTENTION = r'blocks\.(self_attn|cross_attn)\.(q_proj|k_proj|v_proj|output_proj)'


def _model_and_inputs(seed=0):
  cfg = cosmos_dit.tiny()
  model = cosmos_dit.CosmosDiT(cfg, rngs=nnx.Rngs(seed))
  k = jax.random.split(jax.random.key(seed + 100), 3)
  x = jax.random.normal(k[0], (2, cfg.in_channels, 2, 8, 8))
  t = jax.random.uniform(k[1], (2, 2))
  ctx = jax.random.normal(k[2], (2, 5, cfg.crossattn_in or cfg.context_dim))
  return model, (x, t, ctx)


@pytest.mark.parametrize('init', lora.INITS)
def test_fresh_adapters_leave_the_model_bit_for_bit_unchanged(init):
  model, inputs = _model_and_inputs()
  before = model(*inputs)
  spec = lora.LoRAConfig(rank=4, alpha=8.0, targets=(ATTENTION, r'blocks\.mlp\.layer2'), init=init)
  paths = lora.attach(model, spec, jax.random.key(1))
  assert len(paths) == 9
  trainable, _ = lora.split(nnx.state(model), spec)
  a = [l for p, l in jax.tree_util.tree_flatten_with_path(trainable)[0] if 'lora_a' in jax.tree_util.keystr(p)]
  b = [l for p, l in jax.tree_util.tree_flatten_with_path(trainable)[0] if 'lora_b' in jax.tree_util.keystr(p)]
  assert len(a) == len(b) == 9 and all(np.all(np.asarray(x) == 0) for x in b)
  assert all(np.std(np.asarray(x)) > 0 for x in a)
  np.testing.assert_array_equal(np.asarray(model(*inputs)), np.asarray(before))


def test_lora_scale_is_alpha_over_rank_in_numbers():
  """The forward scale pinned to numbers, not read back from the same field the model uses: rank 4,
  alpha 8 is 2; alpha 0 means alpha = rank (scale 1). A Dense with W = 0, A = 1 and B = 1 maps x = 1
  (din 3) to 2 * (din * r) = 24 in every output."""
  assert lora.LoRAConfig(rank=4, alpha=8.0).scale == 2.0
  assert lora.LoRAConfig(rank=4, alpha=0.0).scale == 1.0
  assert lora.LoRAConfig(rank=16, alpha=4.0).scale == 0.25
  dense = lora.layers.Dense(3, 5, use_bias=False, rngs=nnx.Rngs(0))
  dense.kernel[...] = jnp.zeros((3, 5))
  lora.attach(dense, lora.LoRAConfig(rank=4, alpha=8.0, targets=('.*',)), jax.random.key(0))
  dense.lora_a[...] = jnp.ones((3, 4))
  dense.lora_b[...] = jnp.ones((4, 5))
  np.testing.assert_array_equal(np.asarray(dense(jnp.ones((2, 3)))), np.full((2, 5), 24.0))


def test_initializations_follow_peft():
  """kaiming: U(-1/sqrt(din), 1/sqrt(din)) (peft's kaiming_uniform with a = sqrt 5); gaussian: N(0, 1/r)."""
  model, _ = _model_and_inputs()
  lora.attach(model, lora.LoRAConfig(rank=8, targets=(r'blocks\.mlp\.layer1',)), jax.random.key(0))
  a = np.asarray(model.blocks.mlp.layer1.lora_a[...])
  din = a.shape[-2]
  assert np.abs(a).max() <= 1 / np.sqrt(din) and np.abs(a).max() > 0.9 / np.sqrt(din)
  model, _ = _model_and_inputs()
  lora.attach(model, lora.LoRAConfig(rank=8, targets=(r'blocks\.mlp\.layer2',), init='gaussian'),
              jax.random.key(0))
  a = np.asarray(model.blocks.mlp.layer2.lora_a[...])
  assert abs(a.std() - 1 / 8) < 0.15 / 8 and abs(a.mean()) < 0.02


def test_lora_forward_and_gradients_equal_the_explicit_merged_kernel():
  """With random A and B the adapted model equals the plain model whose targeted kernels are
  W + (alpha/r) A B, and jax.grad through lora.bind (the frozen base closed over, as the trainer
  takes it) equals autodiff of that explicit form with respect to A and B."""
  model, inputs = _model_and_inputs(seed=3)
  graphdef_plain, base_state = nnx.split(model)
  spec = lora.LoRAConfig(rank=3, alpha=5.0, targets=(ATTENTION,))
  lora.attach(model, spec, jax.random.key(4))
  graphdef, state = nnx.split(model)
  trainable, frozen = lora.split(state, spec)
  # Random (not zero) B so the adapters matter.
  leaves, treedef = jax.tree.flatten(trainable)
  keys = jax.random.split(jax.random.key(5), len(leaves))
  trainable = jax.tree.unflatten(treedef, [0.3 * jax.random.normal(k, l.shape) for k, l in zip(keys, leaves)])

  def apply(state, x, t, c):
    return nnx.merge(graphdef, jax.tree.map(lambda a: a, state))(x, t, c)

  def loss_lora(tr):
    out = lora.bind(apply, frozen)(tr, *inputs)
    return jnp.sum(out ** 2), out

  def merged(tr):
    """The base state with each targeted kernel replaced by W + s A B (an independent, dense form)."""
    pure = nnx.to_pure_dict(base_state)
    ad = nnx.to_pure_dict(tr)
    for attn in ('self_attn', 'cross_attn'):
      for proj in ('q_proj', 'k_proj', 'v_proj', 'output_proj'):
        a, b = ad['blocks'][attn][proj]['lora_a'], ad['blocks'][attn][proj]['lora_b']
        w = pure['blocks'][attn][proj]['kernel']
        pure['blocks'][attn][proj]['kernel'] = w + spec.scale * jnp.einsum('lir,lro->lio', a, b)
    st = jax.tree.map(lambda x: x, base_state)
    nnx.replace_by_pure_dict(st, pure)
    return st

  def loss_explicit(tr):
    out = nnx.merge(graphdef_plain, jax.tree.map(lambda a: a, merged(tr)))(*inputs)
    return jnp.sum(out ** 2), out

  (v1, out1), g1 = jax.jit(jax.value_and_grad(loss_lora, has_aux=True))(trainable)
  (v2, out2), g2 = jax.jit(jax.value_and_grad(loss_explicit, has_aux=True))(trainable)
  np.testing.assert_allclose(np.asarray(out1), np.asarray(out2), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5)
  assert float(optax_norm(g1)) > 0
  # float32 sums in another order: elementwise within 1e-4 relative, or 1e-5 of the leaf's largest entry.
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5 * float(np.abs(y).max())), g1, g2)


def optax_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(l)) for l in jax.tree.leaves(tree)))


def test_adapters_carry_their_kernels_logical_axes():
  model, _ = _model_and_inputs()
  lora.attach(model, lora.LoRAConfig(rank=2, targets=(r'blocks\.self_attn\.(q_proj|output_proj)',)),
              jax.random.key(0))
  q = model.blocks.self_attn.q_proj
  names = lambda v: tuple(nnx.spmd.get_var_pspec(v))
  assert names(q.kernel) == ('layers', 'embed', 'heads')
  assert names(q.lora_a) == ('layers', 'embed', None) and names(q.lora_b) == ('layers', None, 'heads')
  o = model.blocks.self_attn.output_proj
  assert names(o.lora_a) == ('layers', 'heads', None) and names(o.lora_b) == ('layers', None, 'embed')
  assert q.lora_a.shape == (model.config.num_blocks, model.config.model_channels, 2)


def test_fingerprint_sees_one_changed_element():
  tree = {'a': jnp.arange(12.0).reshape(3, 4), 'b': jnp.ones((5,))}
  base = np.asarray(lora.fingerprint(tree))
  assert np.array_equal(base, np.asarray(lora.fingerprint(jax.tree.map(jnp.copy, tree))))
  for changed in ({'a': tree['a'].at[2, 3].add(1e-6), 'b': tree['b']},
                  {'a': tree['a'], 'b': tree['b'].at[0].set(-1.0)},
                  {'a': tree['a'].T.reshape(3, 4), 'b': tree['b']}):
    assert not np.array_equal(base, np.asarray(lora.fingerprint(changed)))


# -------------------------------------------------------------------------------- bad input
def test_a_target_that_matches_nothing_is_an_error_naming_the_layers():
  model, _ = _model_and_inputs()
  with pytest.raises(ValueError, match=r"\['blocks\\\\.attn1\\\\.to_q'\] match no dense layer.*blocks.self_attn.q_proj"):
    lora.attach(model, lora.LoRAConfig(rank=2, targets=(r'blocks\.attn1\.to_q',)), jax.random.key(0))


@pytest.mark.parametrize('key,value,message', [
    ('rank', -1, 'must be >= 0'), ('init', 'xavier', "one of ('kaiming', 'gaussian')"),
    ('targets', (), 'targets is empty'), ('targets', ('(',), 'is not a regex'),
    ('alpha', -2.0, 'must be >= 0')])
def test_bad_lora_config_names_the_key(key, value, message):
  c = tiny_config()
  c.lora.rank = 4
  c.lora[key] = value
  with pytest.raises(config_lib.ConfigError, match=re.escape(message)) as e:
    config_lib.validate(c, 1)
  assert f'lora.{key}' in str(e.value)


def test_lora_on_a_task_without_dense_layers_is_an_error(tmp_path):
  from test_trainer import small_config  # pylint: disable=g-import-not-at-top
  c = small_config('ddrl', num_iterations=1)
  c.lora.rank = 4
  with pytest.raises(config_lib.ConfigError, match='has no LoRA adapters'):
    trainer_lib.Trainer(c, tmp_path / 'w', devices=jax.devices()[:1]).restore_or_init()


# ------------------------------------------------------------------------------ the trainer
def lora_config(num_iterations=2, algorithm=None, **lora_kw):
  c = tiny_config()
  if algorithm:
    from configs import common  # pylint: disable=g-import-not-at-top
    common.apply_algorithm_preset(c, algorithm)
    c.sampler.num_steps, c.rl.train_steps = 4, (0, 2)
  c.num_iterations = num_iterations
  c.lora.update(dict(rank=4, alpha=8.0, **lora_kw))
  c.optim.learning_rate = 1e-3
  c.optim.ema_power_s = 0.1
  return c


def _sizes(tree):
  return sum(int(np.prod(l.shape)) for l in jax.tree.leaves(tree))


@pytest.fixture(scope='module')
def lora_runs(tmp_path_factory):
  """A tiny OCR DDRL run with LoRA r4: 3 iterations straight, and 2 then resumed to 3."""
  root = tmp_path_factory.mktemp('lora')
  straight = trainer_lib.Trainer(lora_config(3), root / 'straight', devices=jax.devices()[:1])
  straight.train(progress=False)
  trainer_lib.Trainer(lora_config(2), root / 'resumed', devices=jax.devices()[:1]).train(progress=False)
  resumed = trainer_lib.Trainer(lora_config(3), root / 'resumed', devices=jax.devices()[:1])
  resumed.train(progress=False)
  return root, straight, resumed


def test_lora_state_is_adapter_sized_and_the_base_stays_frozen(lora_runs):
  root, straight, _ = lora_runs
  s = straight.state
  base = _sizes(s.frozen)
  adapters = _sizes(s.params)
  assert 0 < adapters < 0.2 * base
  assert all('lora_' in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(s.params)[0])
  assert _sizes(s.ema_params) == adapters and s.ref_params is None
  moments = [l for l in jax.tree.leaves(s.opt_state) if np.ndim(l) > 0]
  assert sum(int(np.prod(np.shape(l))) for l in moments) == 2 * adapters      # AdamW mu, nu
  # The base after training is the base the task builds (random here: base_checkpoint '').
  _, params = straight.task.init_model(jax.random.fold_in(jax.random.key(0), 0x6D6F64))
  _, want = lora.split(params, lora.from_config(straight.config))
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), s.frozen, want)
  # B moved off zero: the adapters trained.
  assert any(float(jnp.abs(l).max()) > 0 for p, l in jax.tree_util.tree_flatten_with_path(s.params)[0]
             if 'lora_b' in jax.tree_util.keystr(p))
  # The checkpoint holds the adapters and the base's fingerprint, not the base.
  import json  # pylint: disable=g-import-not-at-top
  meta = json.load(open(root / 'straight' / 'checkpoints' / '3' / 'state' / '_METADATA'))
  paths = list(meta['tree_metadata'])
  assert "('base_fingerprint',)" in paths and not any('frozen' in p for p in paths)
  assert not any("'kernel'" in p or "'bias'" in p for p in paths), paths


def test_lora_resume_equals_the_uninterrupted_run(lora_runs):
  _, straight, resumed = lora_runs
  assert int(resumed.state.step) == int(straight.state.step) == 3
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               straight.state.params, resumed.state.params)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               straight.state.opt_state, resumed.state.opt_state)


def test_resume_on_another_base_is_refused(lora_runs, tmp_path):
  root, _, _ = lora_runs
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.copytree(root / 'straight', tmp_path / 'run')
  c = lora_config(4)
  c.ocr.width = 32
  c.seed = 0
  trainer = trainer_lib.Trainer(c, tmp_path / 'run', devices=jax.devices()[:1])
  # Another base: the same shapes, other values (ocr.base_checkpoint may change between runs, so only
  # the fingerprint can tell).
  init = trainer.task.init_params_sharded      # how the trainer builds (or loads) the base
  trainer.task.init_params_sharded = lambda key, shardings: init(jax.random.fold_in(key, 1), shardings)
  with pytest.raises(checkpoints_lib.IncompatibleCheckpoint, match='another base model'):
    trainer.restore_or_init()


def test_flow_grpo_reference_is_the_base_without_a_copy(tmp_path):
  """FlowGRPO's KL reference under LoRA is the frozen base (adapters at zero): no reference copy is
  kept; at the first update, where the adapters are still zero, the policy is the base, so the KL is 0
  (to float rounding); once the adapters have moved the KL to the base is positive (a reference that followed
  the policy would keep it at 0)."""
  c = lora_config(3, 'flow_grpo')
  c.rl.kl_beta = 0.04
  c.reward.fns = {'mean_intensity': 1.0}     # rewards that differ within a group, so the adapters move
  trainer = trainer_lib.Trainer(c, tmp_path / 'w', devices=jax.devices()[:1])
  trainer.train(progress=False)
  assert trainer.state.ref_params is None and trainer.state.frozen is not None
  from ddrl_jax import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  rows = [r for r in metrics_lib.read_metrics(tmp_path / 'w') if 'kl' in r]
  assert [r['step'] for r in rows] == [1, 2, 3], rows
  assert rows[0]['kl'] < 1e-12, rows
  adapters = [np.asarray(l) for p, l in jax.tree_util.tree_flatten_with_path(trainer.state.params)[0]
              if 'lora_b' in jax.tree_util.keystr(p)]
  assert adapters and any(np.abs(b).max() > 0 for b in adapters)
  assert rows[2]['kl'] > 1e-9, rows


def test_sharded_lora_update_equals_one_device():
  """One LoRA update (DDRL: policy gradient + data term) on 8 fake devices, batch over data x fsdp and
  the frozen base FSDP-sharded by its own rules, equals the same update on one device."""
  from ddrl_jax import optim  # pylint: disable=g-import-not-at-top
  from ddrl_jax import parallel  # pylint: disable=g-import-not-at-top
  from ddrl_jax.tasks import ocr  # pylint: disable=g-import-not-at-top
  c = lora_config(1)
  c.optim.update(warmup_steps=0, learning_rate=1e-2, eps=1e-2)
  c.sharding.max_replicated_fraction = 1.0       # a 32-wide model: many small replicated leaves
  task = ocr.OCRTask(c)
  spec = lora.from_config(c)
  apply_fn, params = task.init_model(jax.random.key(0))
  trainable, frozen = lora.split(params, spec)
  # Nonzero B, so the base and the adapters both shape the gradients.
  trainable = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(9), a.shape), trainable)
  sampler = trainer_lib.make_sampler(c)
  key = jax.random.key(1)
  cond = task.conditions(key, c.batch_size)
  traj = sampler.rollout(lora.bind(apply_fn, frozen), trainable, cond, key, num_rollouts=c.num_rollouts,
                         sample_shape=task.sample_shape)
  rewards = jax.random.uniform(jax.random.key(2), (c.batch_size, c.num_rollouts))
  flat = trainer_lib.flat_rollout_batch(traj, rewards, cond)
  data = trainer_lib.DataBatch(x0=task.data(jax.random.key(3), cond), cond=cond)
  optimizer = optim.make_optimizer(c.optim)
  step_fn = trainer_lib.make_train_step(apply_fn, sampler, c, optimizer)
  results = {}
  for n, mesh in ((1, dict(data=1, fsdp=1)), (8, dict(data=2, fsdp=4))):
    c.mesh.update(mesh)
    m = parallel.make_mesh(c.mesh, jax.devices()[:n])
    plan = parallel.ShardingPlan.from_config(c, m)
    state = trainer_lib.init_train_state(jax.tree.map(jnp.copy, trainable), c, optimizer,
                                         jax.tree.map(jnp.copy, frozen))
    state_sh = plan.state(jax.eval_shape(lambda s: s, state), optimizer)
    if n == 8:   # the base's kernels are split over fsdp, and adapters follow their kernels' axes
      kernel = state_sh.frozen['dit']['blocks']['self_attn']['q_proj']['kernel']
      assert 'fsdp' in str(kernel.get_value().spec if hasattr(kernel, 'get_value') else kernel.spec)
    new_state, metrics = trainer_lib.jit_train_step(step_fn, plan, state_sh)(
        jax.device_put(state, state_sh), jax.device_put(flat, plan.batch()), trainer_lib.place_data(plan, data),
        jax.random.key(4))
    results[n] = jax.device_get((new_state.params, new_state.frozen, metrics['loss']))
  (p1, f1, l1), (p8, f8, l8) = results[1], results[8]
  np.testing.assert_allclose(float(l8), float(l1), rtol=1e-5)
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), p1, trainable)
  assert max(jax.tree.leaves(moved)) > 1e-3
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
               p8, p1)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), f8, frozen)


def test_export_cli_writes_adapters_and_merged_weights(lora_runs, tmp_path):
  """`python -m ddrl_jax.export_lora` on the OCR run: the adapter file under diffusers' Cosmos module
  names with the peft config, the merged DiT, export.json; a full fine-tuning config is refused."""
  import json  # pylint: disable=g-import-not-at-top
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  from ddrl_jax import cli  # pylint: disable=g-import-not-at-top
  from ddrl_jax import export_lora  # pylint: disable=g-import-not-at-top
  root, straight, _ = lora_runs
  info = export_lora.export(lora_config(3), root / 'straight', str(tmp_path / 'out'), merged=True)
  assert info['step'] == 3 and info['rank'] == 4 and info['alpha'] == 8.0
  depth = straight.config.ocr.depth
  assert info['modules'] == depth * 8          # q, k, v, out of attn1 and attn2 in each block
  with safe_open(info['adapters'], 'np') as f:
    keys = set(f.keys())
    meta = json.loads(f.metadata()['lora_adapter_metadata'])
    b = f.get_tensor('transformer.transformer_blocks.0.attn1.to_q.lora_B.weight')
  assert len(keys) == 2 * info['modules'] and meta['transformer.r'] == 4
  # lora_B carries alpha/r = 2: the trained B of block 0's self-attention q, transposed, times 2.
  want = np.asarray(straight.state.params['dit']['blocks']['self_attn']['q_proj']['lora_b'][...])[0].T * 2.0
  np.testing.assert_allclose(b, want, rtol=1e-6)
  with safe_open(info['merged'], 'np') as f:
    merged = set(f.keys())
  assert 'transformer_blocks.0.attn1.to_q.weight' in merged and not any('lora' in k for k in merged)
  assert json.load(open(tmp_path / 'out' / 'export.json'))['step'] == 3
  full = lora_config(3)
  full.lora.rank = 0                  # the LoRA run's workdir with a config lacking its --config.lora.* flags
  with pytest.raises(cli.UsageError) as e:
    export_lora.export(full, root / 'straight', str(tmp_path / 'x'))
  assert 'trained LoRA adapters (rank 4, alpha 8' in e.value.what and '--config.lora.rank=4' in e.value.fix
  assert not os.path.exists(tmp_path / 'x')
  os.makedirs(tmp_path / 'empty')     # no checkpoints at all: not a run (before anything is read)
  with pytest.raises(cli.UsageError, match='no training run there'):
    export_lora.export(full, tmp_path / 'empty', str(tmp_path / 'x'))


def test_frozen_base_is_kept_in_the_compute_dtype(tmp_path):
  """Cosmos smoke with LoRA: the frozen base is stored as the step's bf16 compute copy (bf16 kernels of
  the bf16 layers, float32 islands unchanged), the adapters in float32; the state and the shardings
  agree, and the start-up report counts both parts."""
  from configs import cosmos2b  # pylint: disable=g-import-not-at-top
  c = cosmos2b.get_config('smoke')
  c.cosmos.dtype = 'bfloat16'         # the smoke preset computes in float32; the full configs in bf16
  c.lora.update(rank=4, alpha=4.0)
  trainer = trainer_lib.Trainer(c, tmp_path / 'w', devices=jax.devices()[:1])
  trainer.restore_or_init()
  frozen = trainer.state.frozen
  assert frozen['blocks']['self_attn']['q_proj']['kernel'][...].dtype == jnp.bfloat16
  assert frozen['blocks']['adaln_modulation_mlp']['linear_1']['kernel'][...].dtype == jnp.float32
  assert all(l.dtype == jnp.float32 for l in jax.tree.leaves(trainer.state.params))
  want = trainer.task.cast_params(lora.split(trainer._initial_params(  # pylint: disable=protected-access
      jax.random.fold_in(jax.random.key(c.seed), 0x6D6F64)), lora.from_config(c))[1])
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), frozen, want)
  report = trainer.sharding_report['params']
  assert report['total_bytes'] == _bytes(frozen) + _bytes(trainer.state.params)


def _bytes(tree):
  return sum(l.size * l.dtype.itemsize for l in jax.tree.leaves(tree))
