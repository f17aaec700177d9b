"""FLUX transformer context parallelism: Ulysses joint attention over 8 fake CPU devices equals one device.

The image tokens are sharded over 'context' (act_seq), the L text tokens are replicated over it (act_text):
both the double blocks' joint attention and the single blocks' attention over [text, image] go through
`parallel.plan.joint_attention` (parallel/context.py `joint_ulysses_attention`). Checked here: the tiny
model's forward and parameter gradients with FSDP-sharded parameters on data=1, fsdp=2, context=4 (S = 16
image tokens, L = 7 text tokens, which do not divide the context size), all-to-all ops in the compiled HLO,
and converted diffusers-layout weights placed shard by shard on the shardings of the model's eval_shape.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from ddrl_jax.models.flux import convert
from ddrl_jax.models.flux import transformer as ft
from ddrl_jax.parallel import plan as plan_lib
from ddrl_jax.parallel import rules as rules_lib

AXES = ('data', 'fsdp', 'context', 'tensor')
# 1 double + 1 single block, 4 heads of 8 (D = 32): both kinds of joint attention at the least compile time.
CFG = ft.tiny(num_layers=1, num_single_layers=1, num_attention_heads=4, attention_head_dim=8,
              axes_dims_rope=(2, 2, 4), remat_policy='none')
B, L, HW = 2, 7, (8, 8)     # S = 4 x 4 = 16 image tokens


def _need_devices():
  if len(jax.devices()) < 8:
    pytest.skip('needs the 8 fake CPU devices of tests/conftest.py')


def _plan(shape, impl='ulysses'):
  mesh = jax.make_mesh(shape, AXES, devices=jax.devices()[:8], axis_types=(AxisType.Auto,) * 4)
  rules = rules_lib.resolve_rules(dict(rules_lib.DEFAULT_RULES, **ft.LOGICAL_RULES), 'fsdp', AXES)
  return plan_lib.ShardingPlan(mesh=mesh, rules=rules, context_impl=impl)


def _inputs(cfg, seed=0):
  rng = np.random.default_rng(seed)
  f32 = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
  return (f32(B, cfg.latent_channels, *HW), jnp.asarray(rng.uniform(0, 1, (B,)).astype(np.float32)),
          f32(B, L, cfg.joint_attention_dim), f32(B, cfg.pooled_projection_dim),
          jnp.asarray(rng.uniform(1, 5, (B,)).astype(np.float32)))


def _random_pure(cfg, seed=1):
  """A pure dict of host parameters (kernels N(0, 1/fan_in), biases N(0, 0.1^2), norm scales
  1 + N(0, 0.1^2)): no init to compile, and no gradient or path trivially zero (biases init to 0)."""
  shapes = nnx.to_pure_dict(nnx.state(ft.abstract_model(cfg), nnx.Param))
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    if name.endswith("['kernel']"):
      return noise / np.sqrt(leaf.shape[-2])
    if name.endswith("['scale']"):
      return 1 + 0.1 * noise
    return 0.1 * noise

  return jax.tree_util.tree_map_with_path(lambda p, x: draw(p, x).astype(np.float32), shapes)


@pytest.fixture(scope='module')
def model_case():
  """(graphdef, state, inputs, forward, loss, one-device output and gradients)."""
  graphdef, state = nnx.split(convert.model_from_pure(_random_pure(CFG), CFG))
  args = _inputs(CFG)
  w = jnp.asarray(np.random.default_rng(2).standard_normal((B, CFG.latent_channels, *HW)).astype(np.float32))
  fwd = lambda s, *a: nnx.merge(graphdef, s)(*a)
  loss = lambda s, *a: jnp.sum(fwd(s, *a) * w)
  ref = np.asarray(jax.jit(fwd)(state, *args))
  ref_grads = jax.jit(jax.grad(loss))(state, *args)
  return graphdef, state, args, fwd, loss, ref, ref_grads


@pytest.fixture(scope='module')
def sharded(model_case):
  """The plan (data=1, fsdp=2, context=4, tensor=1), the placed state and the compiled forward."""
  _need_devices()
  graphdef, state, args, fwd, _, _, _ = model_case
  plan = _plan((1, 2, 4, 1))
  state = jax.device_put(state, plan.params(state))
  compiled = jax.jit(plan.scope(fwd)).lower(state, *args).compile()
  return plan, state, compiled


def test_sharded_forward_equals_one_device(model_case, sharded):
  ref = model_case[5]
  _, state, compiled = sharded
  out = np.asarray(compiled(state, *model_case[2]))
  err = float(np.abs(out - ref).max())
  print(f'FLUX forward, context=4 Ulysses vs one device: max|ref| {np.abs(ref).max():.3f}, '
        f'max abs diff {err:.2e}')
  assert float(np.abs(ref).std()) > 0.1
  assert err <= 1e-5 * float(np.abs(ref).max())


def test_sharded_forward_hlo_runs_ulysses(sharded):
  hlo = sharded[2].as_text()
  # q, k, v and the image output of the double and the single block's joint attention: >= 8.
  assert hlo.count('all-to-all') >= 8, hlo.count('all-to-all')
  assert 'all-gather' in hlo


def test_sharded_gradients_equal_one_device(model_case, sharded):
  _, _, args, _, loss, _, ref_grads = model_case
  plan, state, _ = sharded
  grads = jax.jit(plan.scope(jax.grad(loss)))(state, *args)
  errs = jax.tree.map(lambda g, r: float(jnp.abs(g - r).max()), grads, ref_grads)
  worst = max(jax.tree.leaves(errs))
  scale = max(float(jnp.abs(r).max()) for r in jax.tree.leaves(ref_grads))
  print(f'FLUX parameter gradients: max|ref| {scale:.3f}, max abs diff {worst:.2e}')
  flat_g, flat_r = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
  assert len(flat_g) == len(flat_r) > 50
  # Each leaf to float32 round-off of its own scale (the gradients reach ~30 here; summation orders differ).
  rel = max(float(jnp.abs(g - r).max()) / max(float(jnp.abs(r).max()), 1e-3) for g, r in zip(flat_g, flat_r))
  print(f'worst leaf: max abs diff / its max|ref| = {rel:.2e}')
  assert rel <= 1e-5
  g = nnx.to_pure_dict(grads)
  # The text stream's weights get gradients (the text tokens take part in every joint attention).
  assert float(jnp.abs(g['transformer_blocks']['attn']['add_k_proj']['kernel']).max()) > 0
  assert float(jnp.abs(g['single_transformer_blocks']['attn']['to_k']['kernel']).max()) > 0


def test_converted_weights_place_on_the_eval_shape_shardings():
  """diffusers-layout weights -> our pure dict -> placed shard by shard (plan.place) on the shardings the
  plan gives the model's eval_shape; the FSDP-sharded kernels really are split."""
  _need_devices()
  plan = _plan((1, 2, 4, 1))
  pure = _random_pure(CFG)
  sd = convert.to_diffusers_state_dict(pure, CFG)
  state = nnx.state(ft.abstract_model(CFG), nnx.Param)
  shardings = plan.params(state)
  nnx.replace_by_pure_dict(state, convert.from_diffusers_state_dict(sd, CFG))
  placed = plan_lib.place(state, shardings)
  for p, s, want in zip(jax.tree.leaves(placed), jax.tree.leaves(shardings), jax.tree.leaves(pure)):
    assert p.sharding.is_equivalent_to(s, p.ndim)
    np.testing.assert_array_equal(np.asarray(p), want)
  kernel = nnx.to_pure_dict(placed)['single_transformer_blocks']['proj_mlp']['kernel']
  assert kernel.sharding.spec[1] == 'fsdp'               # ('layers', 'embed', 'mlp') -> (None, fsdp, None)
  assert kernel.addressable_shards[0].data.shape == (1, 16, 128)
