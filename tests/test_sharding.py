"""Sharding: logical rules at the paper's meshes, sharded init, gradients accumulated per trained step
(equal to the gradient of the scan, memory flat in K), and the sharded DDRL update on FSDP x context
meshes of 8 fake CPU devices equal to one device."""
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from configs import cosmos14b
from configs import cosmos2b
from ddrl_jax import config as config_lib
from ddrl_jax import optim
from ddrl_jax import parallel
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.models.cosmos import dit as cosmos_dit
from ddrl_jax.parallel import rules as rules_lib
from ddrl_jax.rl import algorithms
from ddrl_jax.tasks import video

AXES = ('data', 'fsdp', 'context', 'tensor')


def _abstract_mesh(shape):
  return AbstractMesh(shape, AXES, axis_types=(AxisType.Auto,) * 4)


def _leaf(tree, *keys):
  for k in keys:
    tree = tree[k]
  return tree


# ------------------------------------------------------------------------------------ rules as data
@pytest.mark.parametrize('module,mesh,fsdp,total_gib', [
    (cosmos2b, (16, 8, 2, 1), 8, 7.671), (cosmos14b, (4, 32, 8, 1), 32, 53.525)])
def test_paper_meshes_shard_parameters_and_optimizer_state(module, mesh, fsdp, total_gib):
  config = module.get_config()
  plan = parallel.ShardingPlan.from_config(config, _abstract_mesh(mesh))
  task = video.CosmosVideo(config)
  _, abstract = task.abstract_params(jax.random.key(0))
  shardings = plan.params(abstract)
  report = plan.check_params(abstract, shardings)
  assert report['total_bytes'] / 2**30 == pytest.approx(total_gib, rel=1e-3)
  assert report['replicated_fraction'] < 1e-4          # only the per-head q/k norm scales
  assert report['per_device_bytes'] == pytest.approx(report['total_bytes'] / fsdp, rel=1e-3)
  spec = lambda *k: _leaf(shardings, *k).spec
  assert spec('blocks', 'mlp', 'layer1', 'kernel') == P(None, 'fsdp')          # (L, D, 4D); tensor = 1
  assert spec('blocks', 'self_attn', 'output_proj', 'kernel') == P(None, None, 'fsdp')
  assert spec('crossattn_proj', 'kernel') == P('fsdp')                         # (100352, 1024)
  assert spec('blocks', 'self_attn', 'q_norm', 'scale') == P()
  # The optimizer's moments follow the parameters; its counters are replicated.
  optimizer = optim.make_optimizer(config.optim)
  abstract_state = jax.eval_shape(lambda p: trainer_lib.init_train_state(p, config, optimizer), abstract)
  state_sh = plan.state(abstract_state, optimizer)
  opt = rules_lib.sharding_report(abstract_state.opt_state, state_sh.opt_state)
  assert opt['per_device_bytes'] == pytest.approx(2 * report['per_device_bytes'], rel=1e-3)
  assert jax.tree.leaves(state_sh.ema_params) == jax.tree.leaves(shardings)
  # FSDP over (fsdp, context), maxdiffusion's embed -> [context, fsdp]: 16 / 256 shards.
  config.sharding.fsdp_axes = 'fsdp,context'
  wide = parallel.ShardingPlan.from_config(config, _abstract_mesh(mesh)).params(abstract)
  assert _leaf(wide, 'blocks', 'mlp', 'layer1', 'kernel').spec == P(None, ('fsdp', 'context'))
  wide_report = rules_lib.sharding_report(abstract, wide)
  assert wide_report['per_device_bytes'] == pytest.approx(
      report['total_bytes'] / (fsdp * mesh[2]), rel=1e-3)


def test_mesh_spec_drops_indivisible_axes_and_rejects_unknown_names():
  rules = rules_lib.resolve_rules({'embed': 'fsdp,context', 'heads': 'tensor', 'mlp': 'fsdp'})
  sizes = {'data': 2, 'fsdp': 4, 'context': 2, 'tensor': 1}
  assert rules_lib.mesh_spec(('embed', 'heads'), (16, 8), rules, sizes) == P(('fsdp', 'context'))
  assert rules_lib.mesh_spec(('embed',), (12,), rules, sizes) == P('fsdp')      # 12 % 8: context dropped
  assert rules_lib.mesh_spec(('embed',), (6,), rules, sizes) == P()             # 6 % 4: replicated
  assert rules_lib.mesh_spec(('embed', 'mlp'), (8, 8), rules, sizes) == P(('fsdp', 'context'))  # fsdp used
  with pytest.raises(ValueError, match="no rule for the logical axis 'nope'"):
    rules_lib.mesh_spec(('nope',), (8,), rules, sizes, 'w')
  with pytest.raises(ValueError, match=r'config.sharding.rules.embed=.*unknown mesh axes \[.pod.\]'):
    rules_lib.resolve_rules({'embed': 'pod'}, mesh_axes=AXES)
  assert rules_lib.resolve_rules({'embed': 'fsdp', 'act_batch': 'data,fsdp'}, 'fsdp,context') == {
      'embed': ('fsdp', 'context'), 'act_batch': ('data', 'fsdp')}    # activations keep fsdp


def test_replicated_parameters_are_refused_on_an_fsdp_mesh():
  config = cosmos2b.get_config('smoke')
  config.mesh.data, config.mesh.fsdp = 4, 2
  mesh = parallel.make_mesh(config.mesh, jax.devices())
  plan = parallel.ShardingPlan.from_config(config, mesh)
  plain = {'w': jax.ShapeDtypeStruct((64, 64), jnp.float32)}    # no logical names: replicated
  with pytest.raises(ValueError, match='100.0% of the parameter bytes are replicated.*'
                                       'max_replicated_fraction'):
    plan.check_params(plain, plan.params(plain))


def test_validation_names_context_keys():
  config = cosmos2b.get_config('smoke')
  config.mesh.data, config.mesh.context = -1, 4        # 2 latent frames over 4
  with pytest.raises(config_lib.ConfigError, match='config.cosmos.latent_shape.*2 latent frames'):
    config_lib.validate(config, 8)
  config = cosmos2b.get_config('smoke')
  config.cosmos.latent_shape = (4, 4, 4)
  config.mesh.data, config.mesh.context = -1, 4        # tiny DiT: 2 heads over 4
  with pytest.raises(config_lib.ConfigError, match='config.mesh.context.*Ulysses.*2 heads'):
    config_lib.validate(config, 8)
  config.sharding.context_impl = 'ring'                # ring does not split heads
  config_lib.validate(config, 8)
  config.sharding.rules.embed = 'fsdp,pod'
  with pytest.raises(config_lib.ConfigError, match='sharding.rules.embed'):
    config_lib.validate(config, 8)


# --------------------------------------------------------------------------------- sharded from birth
def test_sharded_init_equals_single_device_init():
  config = cosmos2b.get_config('smoke')
  config.mesh.data, config.mesh.fsdp = 2, 4
  task = video.CosmosVideo(config)
  key = jax.random.key(3)
  _, abstract = task.abstract_params(key)
  results = {}
  for devices in (jax.devices()[:1], jax.devices()):
    config.mesh.data = 2 if len(devices) == 8 else 1
    config.mesh.fsdp = 4 if len(devices) == 8 else 1
    plan = parallel.ShardingPlan.from_config(config, parallel.make_mesh(config.mesh, devices))
    shardings = plan.params(abstract)
    params = task.init_params_sharded(key, shardings)
    kernel = _leaf(params, 'blocks', 'mlp', 'layer1', 'kernel')
    if len(devices) == 8:     # (L, 64, 256) over fsdp 4: each device holds a quarter
      assert {s.data.shape for s in kernel.get_value().addressable_shards} == {(2, 16, 256)}
    results[len(devices)] = jax.device_get(nnx.to_pure_dict(params))
  chex.assert_trees_all_equal(results[1], results[8])


def test_compute_cast_makes_bf16_matmul_weights_and_keeps_results():
  """The bf16 compute copy: matmul kernels of the bf16 layers cast, fp32 islands kept, and the forward
  and gradient equal to those of the fp32 masters (nnx.Linear casts them at use anyway)."""
  config = cosmos2b.get_config('smoke')
  config.cosmos.dtype = 'bfloat16'
  task = video.CosmosVideo(config)
  apply_fn, abstract = task.abstract_params(jax.random.key(0))
  params = task.init_params_sharded(jax.random.key(0), jax.tree.map(
      lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract))
  cast = task.cast_params(params)
  dtype = lambda tree, *k: _leaf(tree, *k).get_value().dtype
  # Every leaf, by name: the kernels and biases of the attention projections, the MLP, crossattn_proj and
  # x_embedder compute in bf16; the adaLN, t_embedder and final layers and the norm scales stay fp32.
  def computes_in_bf16(path):
    keys = [getattr(k, 'key', getattr(k, 'name', None)) for k in path]
    keys = keys[:-1] if keys[-1] == 'value' else keys             # a Variable's value in an nnx.State
    return keys[-1] in ('kernel', 'bias') and (keys[0] in ('crossattn_proj', 'x_embedder') or (
        keys[0] == 'blocks' and keys[1] in ('self_attn', 'cross_attn', 'mlp')))
  flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
  assert 0 < sum(computes_in_bf16(p) for p, _ in flat_params) < len(flat_params)
  for (path, _), c in zip(flat_params, jax.tree.leaves(cast)):
    assert c.dtype == (jnp.bfloat16 if computes_in_bf16(path) else jnp.float32), jax.tree_util.keystr(path)
  assert dtype(cast, 'blocks', 'mlp', 'layer1', 'kernel') == jnp.bfloat16
  assert dtype(cast, 'crossattn_proj', 'bias') == jnp.bfloat16
  for fp32 in (('blocks', 'adaln_modulation_mlp', 'linear_1', 'kernel'), ('final_layer', 'linear', 'kernel'),
               ('t_embedder', 'linear_1', 'kernel'), ('blocks', 'self_attn', 'q_norm', 'scale')):
    assert dtype(cast, *fp32) == jnp.float32, fp32
  rng = np.random.RandomState(0)
  c, t, h, w = task.sample_shape
  x = jnp.asarray(rng.randn(2, c, t, h, w), jnp.float32)
  cond = dict(text=jnp.asarray(rng.randn(2, config.cosmos.text_length, task.text_dim), jnp.float32))
  loss = jax.jit(lambda p, f: jnp.mean(apply_fn(f(p), x, jnp.full((2,), 0.5), cond) ** 2), static_argnums=1)
  grad = jax.jit(jax.grad(lambda p, f: jnp.mean(apply_fn(f(p), x, jnp.full((2,), 0.5), cond) ** 2)),
                 static_argnums=1)
  # The reference keeps fp32 masters whose values are already bf16-exact: XLA:CPU is allowed excess
  # precision (xla_allow_excess_precision) and may drop an f32 -> bf16 -> f32 round trip of a weight.
  # It rounds the leaves named above itself (not through cast_params, the function under test).
  rounded = lambda p: jax.tree_util.tree_map_with_path(
      lambda path, a: a.astype(jnp.bfloat16).astype(a.dtype) if computes_in_bf16(path) else a, p)
  np.testing.assert_allclose(loss(params, task.cast_params), loss(params, rounded), rtol=1e-6)
  chex.assert_trees_all_close(grad(params, task.cast_params), grad(params, rounded), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------- gradients per trained step
def _tiny_dit_batch(config, b=4, n=2, seed=0):
  """apply_fn, params, sampler, group rollouts (traj (B, N), cond (B, ...)), data x0 of the video task."""
  task = video.CosmosVideo(config)
  key = jax.random.key(seed)
  apply_fn, abstract = task.abstract_params(key)
  params = task.init_params_sharded(key, jax.tree.map(
      lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract))
  rng = np.random.RandomState(seed)
  c, t, h, w = task.sample_shape
  cond = dict(text=jnp.asarray(rng.randn(b, config.cosmos.text_length, task.text_dim), jnp.float32),
              first_frame=jnp.asarray(rng.randn(b, c, 1, h, w), jnp.float32),
              num_cond=jnp.asarray([0, 1] * (b // 2), jnp.int32), index=jnp.arange(b, dtype=jnp.int32))
  sampler = trainer_lib.make_sampler(config)
  traj = jax.jit(lambda p, c, k: sampler.rollout(apply_fn, p, c, k, num_rollouts=n,
                                                 sample_shape=task.sample_shape))(
      params, cond, jax.random.key(seed + 1))
  x0 = jnp.asarray(rng.randn(b, *task.sample_shape), jnp.float32)
  return task, apply_fn, params, sampler, traj, cond, x0


@pytest.mark.parametrize('what', ['ddrl_full', 'ddrl_reduced', 'flow_grpo_kl'])
def test_per_step_gradients_equal_the_gradient_of_the_scan(what, tiny_mlp):
  """Toy MLP and the tiny DiT: rl_loss_and_grad (the trainer's form) against jax.grad of
  rl_loss_reference (the plain scan)."""
  config = cosmos2b.get_config('smoke')
  cases = []
  if what == 'ddrl_full':       # the DiT once (compiles dominate on 2 cores), the MLP for every form
    _, dit_fn, dit_params, sampler, traj, cond, x0 = _tiny_dit_batch(config)
    cases.append((dit_fn, dit_params, traj, cond, x0))
  sampler = trainer_lib.make_sampler(config)
  mlp_traj = sampler.rollout(tiny_mlp.apply_fn, tiny_mlp.params, jnp.ones((4, 1)), jax.random.key(5),
                             num_rollouts=2, sample_shape=(2,))
  cases.append((tiny_mlp.apply_fn, tiny_mlp.params, mlp_traj, jnp.ones((4, 1)), jnp.ones((4, 2))))
  for apply_fn, params, trj, cnd, data_x0 in cases:
    b, n = trj.x0.shape[:2]
    adv = jnp.asarray(np.random.RandomState(1).randn(b, n), jnp.float32)
    steps = jnp.broadcast_to(jnp.asarray([0, 2], jnp.int32), (b, n, 2))
    kw = dict(clip_range=0.2, log_ratio_form='cosmos', loss_scale=10.0)
    if what.startswith('ddrl'):
      kw['data'] = algorithms.DataTerm(x0=data_x0, cond=cnd, beta=0.5,
                                       steps='reduced' if what == 'ddrl_reduced' else 'full')
    else:
      ref = jax.tree.map(lambda a: a * 0.9, params)
      kw.update(ref_params=ref, kl_beta=0.3, log_ratio_form='gaussian')
    key = jax.random.key(11)
    ref_fn = jax.jit(jax.value_and_grad(
        lambda p: algorithms.rl_loss_reference(apply_fn, p, sampler, trj, adv, steps, cnd, key, **kw),
        has_aux=True))
    (loss0, metrics0), grads0 = ref_fn(params)
    loss1, metrics1, grads1 = jax.jit(lambda p: algorithms.rl_loss_and_grad(
        apply_fn, p, sampler, trj, adv, steps, cnd, key, **kw))(params)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    # atol: ratio_max_dev (~1e-5) is the round-off between the rollout's and this program's means.
    chex.assert_trees_all_close(metrics1, metrics0, rtol=1e-6, atol=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads0))
    # rtol: float32 summation order (the dense layers contract flattened tokens, issue 13).
    chex.assert_trees_all_close(grads1, grads0, rtol=1e-5, atol=1e-6 * scale)
    assert scale > 0


def test_per_step_gradient_memory_is_flat_in_k():
  """compiled.memory_analysis() temp bytes at K = 2 and K = 8: within 15% for the per-step form and for
  jax.grad of the public rl_loss (its custom VJP runs the per-step form), while the gradient of the plain
  scan keeps every step's residuals."""
  config = cosmos2b.get_config('smoke')
  config.sampler.num_steps = 10
  config.cosmos.dit_overrides = dict(num_blocks=1)
  _, apply_fn, params, sampler, traj, cond, x0 = _tiny_dit_batch(config, b=4, n=2)
  b, n = traj.x0.shape[:2]
  adv = jnp.ones((b, n), jnp.float32)
  data = algorithms.DataTerm(x0=x0, cond=cond, beta=0.5)
  temp = {}
  for k in (2, 8):
    steps = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, n, k))
    args = (params, traj, adv, steps, cond, jax.random.key(0))
    kw = dict(clip_range=0.2, log_ratio_form='cosmos', data=data)
    per_step = lambda p, t, a, s, c, key: algorithms.rl_loss_and_grad(
        apply_fn, p, sampler, t, a, s, c, key, **kw)[2]
    grad_of = lambda loss: lambda p, t, a, s, c, key: jax.grad(lambda q: loss(
        apply_fn, q, sampler, t, a, s, c, key, **kw)[0])(p)
    for name, fn in (('per_step', per_step), ('public', grad_of(algorithms.rl_loss)),
                     ('of_scan', grad_of(algorithms.rl_loss_reference))):
      temp[name, k] = jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
  assert temp['per_step', 8] < 1.15 * temp['per_step', 2], temp
  assert temp['public', 8] < 1.15 * temp['public', 2], temp
  assert temp['of_scan', 8] > 1.5 * temp['of_scan', 2], temp   # the check can fail: the old form grows


# --------------------------------------------------------------------------- the sharded DDRL update
def _device_bytes(tree, device):
  """Bytes of a tree's arrays held on `device` (their addressable shards there)."""
  return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)


@pytest.mark.parametrize('mesh,micro', [(dict(data=2, fsdp=2, context=2), 0), (dict(data=1, fsdp=4, context=2), 0),
                                        (dict(data=2, fsdp=2, context=2), 1)])
def test_sharded_ddrl_update_equals_one_device(mesh, micro):
  """One fused DDRL step of the tiny DiT (FSDP parameters, Ulysses self-attention over 2 context
  devices, sequence-sharded activations) equals the same step on one device: the parameter update, the
  Adam moments and the metrics, with each FSDP device holding 1/fsdp of the parameters. With micro = 1
  the sharded step runs its 8 slots as 2 micro-batches of one slot per data-parallel position (the one
  device's step runs them at once)."""
  config = cosmos2b.get_config('smoke')
  config.sharding.context_impl = 'ulysses'
  # A full learning rate from the first step (no warmup) and Adam's eps near the gradients' size, so the
  # first update lr * g / (|g| + eps) follows the gradient's magnitude, not only its sign; a clip range
  # that the ratios of a policy 1e-3 away from the rollout's stay inside (pg_loss ~1e-3, not round-off).
  config.optim.update(warmup_steps=0, learning_rate=1e-2, eps=1e-2)
  config.rl.clip_range = 0.2
  task, apply_fn, params, sampler, traj, cond, x0 = _tiny_dit_batch(config, b=4, n=2)
  rng = np.random.RandomState(3)
  params = jax.tree.map(lambda p: p * (1 + 1e-3 * jnp.asarray(rng.randn(*p.shape), jnp.float32)), params)
  b, n = traj.x0.shape[:2]
  config.batch_size, config.num_rollouts = b, n
  rewards = jnp.asarray(np.random.RandomState(2).rand(b, n), jnp.float32)
  flat = trainer_lib.flat_rollout_batch(traj, rewards, cond)
  data = trainer_lib.DataBatch(x0=x0, cond=cond)
  optimizer = optim.make_optimizer(config.optim)
  key = jax.random.key(7)
  results, texts = {}, {}
  for devices, sizes in ((jax.devices()[:1], dict(data=1, fsdp=1, context=1)), (jax.devices(), mesh)):
    config.mesh.update(sizes)
    config.micro_batch = micro if len(devices) == 8 else 0
    plan = parallel.ShardingPlan.from_config(config, parallel.make_mesh(config.mesh, devices))
    step_fn = trainer_lib.make_train_step(apply_fn, sampler, config, optimizer, task.cast_params,
                                          batch_shards=parallel.data_parallel_size(plan.mesh))
    state = trainer_lib.init_train_state(jax.tree.map(jnp.copy, params), config, optimizer)
    state_sh = plan.state(jax.eval_shape(lambda s: s, state), optimizer)
    fn = trainer_lib.jit_train_step(step_fn, plan, state_sh)
    args = (parallel.place(state, state_sh), parallel.place(flat, jax.tree.map(lambda _: plan.batch(), flat)),
            trainer_lib.place_data(plan, data), key)
    texts[len(devices)] = fn.lower(*args).compile().as_text()
    new_state, metrics = fn(*args)
    mu, nu = (optax.tree_utils.tree_get(new_state.opt_state, k) for k in ('mu', 'nu'))
    if len(devices) == 8:
      kernel = _leaf(new_state.params, 'blocks', 'mlp', 'layer1', 'kernel').get_value()
      assert len({str(s.index) for s in kernel.addressable_shards}) == sizes['fsdp']
      # Per-device bytes: only the per-head q/k norm scales are replicated, the rest is split fsdp ways.
      leaves = jax.tree_util.tree_flatten_with_path(new_state.params)[0]
      total = sum(a.nbytes for _, a in leaves)
      kv = sum(a.nbytes for p, a in leaves if re.search(r"\['[qk]_norm'\]", jax.tree_util.keystr(p)))
      assert 0 < kv < 0.01 * total
      per_device = _device_bytes(new_state.params, devices[0])
      assert per_device == (total - kv) // sizes['fsdp'] + kv, (per_device, total, kv)
      for tree in (mu, nu, new_state.ema_params):
        assert _device_bytes(tree, devices[0]) == per_device
    results[len(devices)] = jax.device_get((nnx.to_pure_dict(new_state.params), metrics,
                                            nnx.to_pure_dict(mu)))
  (p1, m1, mu1), (p8, m8, mu8) = results[1], results[8]
  p0 = jax.device_get(nnx.to_pure_dict(params))
  chex.assert_trees_all_close(p8, p1, rtol=1e-5, atol=1e-6)
  # The update and Adam's first moment (0.1 x the clipped gradient) of every parameter; rtol for the
  # order of float32 sums, atol for entries that are round-off themselves.
  du1, du8 = (jax.tree.map(np.subtract, p, p0) for p in (p1, p8))
  for got, want in ((du8, du1), (mu8, mu1)):
    scale = max(float(np.abs(a).max()) for a in jax.tree.leaves(want))
    assert scale > 0 and min(float(np.abs(a).max()) for a in jax.tree.leaves(want)) > 1e-3 * scale
    chex.assert_trees_all_close(got, want, rtol=1e-3, atol=1e-4 * scale)
  for k in ('loss', 'pg_loss', 'data_loss', 'grad_norm', 'reward_mean'):
    np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-5, err_msg=k)
  assert abs(m1['pg_loss']) > 1e-4 and m1['clipfrac'] == 0, m1
  np.testing.assert_allclose(m8['pg_loss'], m1['pg_loss'], rtol=1e-3)
  assert 'all-to-all' in texts[8] and 'all-to-all' not in texts[1]     # Ulysses
  assert 'all-gather' in texts[8] and ('reduce-scatter' in texts[8] or 'all-reduce' in texts[8])
  assert 'all-gather' not in texts[1]


@pytest.mark.parametrize('axes, mergeable', [({'data': 8}, True), ({'data': 2, 'fsdp': 4}, True),
                                             ({'data': 4, 'context': 2}, False),
                                             ({'data': 2, 'fsdp': 2, 'context': 2}, False)])
def test_dense_layers_flatten_tokens_only_where_the_batch_alone_is_split(axes, mergeable):
  """TokenLinear merges (B, S) into one row axis without a plan or when only the batch is split; under
  context parallelism (S split too) it keeps the token axes: its jaxpr then has no 2-D dot."""
  config = cosmos2b.get_config('smoke')
  config.mesh.data, config.mesh.fsdp, config.mesh.context, config.mesh.tensor = (
      axes.get('data', 1), axes.get('fsdp', 1), axes.get('context', 1), 1)
  plan = parallel.ShardingPlan.from_config(config, parallel.make_mesh(config.mesh, jax.devices()))
  layer = cosmos_dit.TokenLinear(16, 8, rngs=nnx.Rngs(0))
  x = jnp.ones((8, 4, 16))
  with parallel.plan.active(plan):
    assert parallel.plan.tokens_mergeable() == mergeable
    jaxpr = str(jax.make_jaxpr(layer)(x))
  assert ('f32[32,8] = dot_general' in jaxpr) == mergeable, jaxpr
  assert parallel.plan.tokens_mergeable()           # no plan active
