"""SD3 MMDiT context parallelism: Ulysses joint attention over 8 fake CPU devices equals one device.

The image tokens are sharded over 'context' (act_seq), the L text tokens are replicated over it
(act_text); `parallel.plan.joint_attention` all-to-alls the image q/k/v to a head slice and slices the
same heads of the text q/k/v locally (parallel/context.py `joint_ulysses_attention`). Checked here: the
attention alone (forward and gradients, with and without a tensor axis), the tiny MMDiT's forward and
parameter gradients with FSDP-sharded parameters on data=1, fsdp=2, context=4 (S = 16 image tokens, L = 7
text tokens, which do not divide the context size), all-to-all ops in the compiled HLO, and the errors.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from ddrl_jax.models import attention as attention_lib
from ddrl_jax.models.sd3 import mmdit
from ddrl_jax.parallel import plan as plan_lib
from ddrl_jax.parallel import rules as rules_lib

AXES = ('data', 'fsdp', 'context', 'tensor')
ATTN = attention_lib.AttentionConfig()
# 2 blocks (a dual stack of 1: joint attention + attn2; the context-pre-only last block), 4 heads of 8
# (D = 32): every kind of joint attention (text out used or not) at the least compile time.
CFG = mmdit.tiny(num_layers=2, dual_attention_layers=(0,), num_attention_heads=4, attention_head_dim=8,
                 remat_policy='none')
B, L, HW = 2, 7, (8, 8)     # S = 4 x 4 = 16 image tokens


def _need_devices():
  if len(jax.devices()) < 8:
    pytest.skip('needs the 8 fake CPU devices of tests/conftest.py')


def _plan(shape, impl='ulysses'):
  mesh = jax.make_mesh(shape, AXES, devices=jax.devices()[:8], axis_types=(AxisType.Auto,) * 4)
  rules = rules_lib.resolve_rules(dict(rules_lib.DEFAULT_RULES, **mmdit.LOGICAL_RULES), 'fsdp', AXES)
  return plan_lib.ShardingPlan(mesh=mesh, rules=rules, context_impl=impl)


def _qkv(n, s=16, l=L, hd=8, seed=0):
  keys = jax.random.split(jax.random.key(seed), 6)
  return tuple(jax.random.normal(k, (B, t, n, hd), jnp.float32) for k, t in zip(keys, (s,) * 3 + (l,) * 3))


def _attention_loss(qkv):
  out_img, out_txt = plan_lib.joint_attention(*qkv, ATTN)
  w = jnp.cos(jnp.arange(out_img.size + out_txt.size, dtype=jnp.float32))
  return jnp.sum(jnp.concatenate([out_img.ravel(), out_txt.ravel()]) * w)


@pytest.mark.parametrize('shape', [(2, 1, 4, 1), (1, 1, 4, 2)])
def test_joint_attention_alone_equals_the_local_kernel(shape):
  _need_devices()
  n = 4 * shape[3]
  qkv = _qkv(n)
  # Without a plan: the local kernel over the concatenation (today's mmdit.joint_attention).
  ref_img, ref_txt = jax.jit(lambda *a: plan_lib.joint_attention(*a, ATTN))(*qkv)
  full = attention_lib.attend(*(jnp.concatenate([qkv[i], qkv[i + 3]], axis=1) for i in range(3)), ATTN)
  np.testing.assert_array_equal(np.asarray(ref_img), np.asarray(full[:, :16]))
  np.testing.assert_array_equal(np.asarray(ref_txt), np.asarray(full[:, 16:]))
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(_attention_loss))(qkv)

  plan = _plan(shape)
  img_sh = plan.sharding(mmdit.IMAGE_QKV_NAMES, qkv[0].shape, 'activation')
  txt_sh = plan.sharding(mmdit.TEXT_QKV_NAMES, qkv[3].shape, 'activation')
  pad = lambda spec: tuple(spec) + (None,) * (4 - len(spec))
  assert pad(img_sh.spec)[1] == 'context'           # image tokens over context
  assert pad(txt_sh.spec)[1] is None                # text tokens replicated over context
  placed = tuple(jax.device_put(x, img_sh if i < 3 else txt_sh) for i, x in enumerate(qkv))
  fn = jax.jit(plan.scope(lambda *a: plan_lib.joint_attention(*a, ATTN)))
  out_img, out_txt = fn(*placed)
  assert 'all-to-all' in fn.lower(*placed).compile().as_text()
  err_f = max(float(jnp.abs(out_img - ref_img).max()), float(jnp.abs(out_txt - ref_txt).max()))
  loss, grads = jax.jit(plan.scope(jax.value_and_grad(_attention_loss)))(placed)
  err_g = max(float(jnp.abs(g - r).max()) for g, r in zip(grads, ref_grads))
  print(f'mesh {shape}: forward max abs diff {err_f:.2e}, q/k/v gradient max abs diff {err_g:.2e}')
  assert err_f <= 1e-5
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-5)   # a sum of ~2k terms
  for g, r in zip(grads, ref_grads):
    assert float(jnp.abs(r).max()) > 0.1
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_joint_attention_none_and_context_one_are_the_local_kernel():
  _need_devices()
  qkv = _qkv(4)
  ref = plan_lib.joint_attention(*qkv, ATTN)
  for shape, impl in (((2, 1, 4, 1), 'none'), ((2, 4, 1, 1), 'ulysses')):
    plan = _plan(shape, impl)
    out = jax.jit(plan.scope(lambda *a: plan_lib.joint_attention(*a, ATTN)))(*qkv)
    assert 'all-to-all' not in jax.jit(plan.scope(lambda *a: plan_lib.joint_attention(*a, ATTN))).lower(
        *qkv).compile().as_text()
    for o, r in zip(out, ref):
      np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-6, atol=1e-6)


def test_errors_name_the_mesh_and_the_impl():
  _need_devices()
  plan = _plan((2, 1, 4, 1))
  with pytest.raises(ValueError, match=r'N=2 heads over mesh.context x mesh.tensor = 4 x 1'):
    jax.eval_shape(plan.scope(lambda *a: plan_lib.joint_attention(*a, ATTN)), *_qkv(2))
  with pytest.raises(ValueError, match=r'S=10 image tokens must be divisible by mesh.context = 4'):
    jax.eval_shape(plan.scope(lambda *a: plan_lib.joint_attention(*a, ATTN)), *_qkv(4, s=10))
  with pytest.raises(ValueError, match=r"context_impl='ulysses' only; got 'ring'"):
    jax.eval_shape(_plan((2, 1, 4, 1), 'ring').scope(lambda *a: plan_lib.joint_attention(*a, ATTN)),
                   *_qkv(4))
  bad = plan_lib.ShardingPlan(mesh=plan.mesh, context_impl='ulysses',
                              rules=dict(plan.rules, act_text=('context',)))
  with pytest.raises(ValueError, match='act_text'):
    jax.eval_shape(bad.scope(lambda *a: plan_lib.joint_attention(*a, ATTN)), *_qkv(4))
  # The model with 2 heads (mmdit.tiny) on context = 4: the same error from its first joint attention.
  cfg = mmdit.tiny(remat_policy='none')
  model = mmdit.abstract_model(cfg)
  graphdef, state = nnx.split(model)
  x, t, text, pooled = _inputs(cfg)
  with pytest.raises(ValueError, match='mesh.context'):
    jax.eval_shape(plan.scope(lambda s: nnx.merge(graphdef, s)(x, t, text, pooled)), state)


# ----------------------------------------------------------------------------------------------- the model


def _inputs(cfg, seed=0):
  rng = np.random.default_rng(seed)
  f32 = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
  return (f32(B, cfg.in_channels, *HW), jnp.asarray(rng.uniform(0, 1000, (B,)).astype(np.float32)),
          f32(B, L, cfg.joint_attention_dim), f32(B, cfg.pooled_projection_dim))


def _randomized_state(cfg, seed=1):
  """(graphdef, state) of the model with every parameter drawn on the host (kernels N(0, 1/fan_in), biases
  N(0, 0.1^2), norm scales 1 + N(0, 0.1^2)): no init to compile, and no gradient or path trivially zero
  (adaLN and biases init to 0)."""
  graphdef, state = nnx.split(mmdit.abstract_model(cfg))
  shapes = nnx.to_pure_dict(state)
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    if name.endswith("['kernel']"):
      return jnp.asarray(noise / np.sqrt(leaf.shape[-2]))
    if name.endswith("['scale']"):
      return jnp.asarray(1 + 0.1 * noise)
    return jnp.asarray(0.1 * noise)

  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, shapes))
  return graphdef, state


@pytest.fixture(scope='module')
def model_case():
  """(graphdef, state, inputs, loss weights, one-device output and gradients)."""
  graphdef, state = _randomized_state(CFG)
  args = _inputs(CFG)
  w = jnp.asarray(np.random.default_rng(2).standard_normal((B, CFG.out_channels, *HW)).astype(np.float32))
  fwd = lambda s, *a: nnx.merge(graphdef, s)(*a)
  loss = lambda s, *a: jnp.sum(fwd(s, *a) * w)
  ref = np.asarray(jax.jit(fwd)(state, *args))
  ref_grads = jax.jit(jax.grad(loss))(state, *args)
  return graphdef, state, args, fwd, loss, ref, ref_grads


@pytest.fixture(scope='module')
def sharded(model_case):
  """The plan (data=1, fsdp=2, context=4, tensor=1), the placed state and the compiled forward."""
  _need_devices()
  graphdef, state, args, fwd, loss, _, _ = model_case
  plan = _plan((1, 2, 4, 1))
  state = jax.device_put(state, plan.params(state))
  compiled = jax.jit(plan.scope(fwd)).lower(state, *args).compile()
  return plan, state, compiled


def test_sharded_forward_equals_one_device(model_case, sharded):
  ref = model_case[5]
  _, state, compiled = sharded
  out = np.asarray(compiled(state, *model_case[2]))
  err = float(np.abs(out - ref).max())
  print(f'MMDiT forward, context=4 Ulysses vs one device: max|ref| {np.abs(ref).max():.3f}, '
        f'max abs diff {err:.2e}')
  assert float(np.abs(ref).std()) > 0.1
  assert err <= 1e-5


def test_sharded_forward_hlo_runs_ulysses(sharded):
  hlo = sharded[2].as_text()
  # q, k, v and the image output of each of the 2 joint attentions (and of attn2's Ulysses): >= 8.
  assert hlo.count('all-to-all') >= 8, hlo.count('all-to-all')
  assert 'all-gather' in hlo


def test_sharded_gradients_equal_one_device(model_case, sharded):
  _, _, args, _, loss, _, ref_grads = model_case
  plan, state, _ = sharded
  grads = jax.jit(plan.scope(jax.grad(loss)))(state, *args)
  errs = jax.tree.map(lambda g, r: float(jnp.abs(g - r).max()), grads, ref_grads)
  worst = max(jax.tree.leaves(errs))
  scale = max(float(jnp.abs(r).max()) for r in jax.tree.leaves(ref_grads))
  print(f'MMDiT parameter gradients: max|ref| {scale:.3f}, max abs diff {worst:.2e}')
  flat_g, flat_r = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
  assert len(flat_g) == len(flat_r) > 50
  for g, r in zip(flat_g, flat_r):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
  # The text stream's weights get gradients (the text tokens take part in every joint attention).
  g = nnx.to_pure_dict(grads)
  assert float(jnp.abs(g['dual_blocks']['attn']['add_k_proj']['kernel']).max()) > 0
