"""Local attention kernels (models.attention) and context-parallel attention (parallel.context).

Splash runs in Pallas interpret mode on CPU; the context-parallel tests use the 8 fake CPU devices of
conftest. References are the unsharded 'xla' kernel on the global tensors.
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddrl_jax.models import attention
from ddrl_jax.parallel import context

XLA = attention.AttentionConfig()
SPLASH = attention.AttentionConfig(kernel='splash', block_q=128, block_kv=128, block_kv_compute=128,
                                   min_flash_len=128, interpret=True)
TOL = dict(rtol=1e-5, atol=1e-5)


def _qkv(b, s, n, hd, l=None, seed=0):
  """q (b, s, n, hd), k, v (b, l, n, hd) and an output weight w (b, s, n, hd), float32."""
  l = s if l is None else l
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, s, n, hd))
  k, v = (jax.random.normal(key, (b, l, n, hd)) for key in keys[1:3])
  return q, k, v, jax.random.normal(keys[3], (b, s, n, hd))


def _value_and_grads(f, w):
  """jit(q, k, v -> (f(q, k, v), d/d(q, k, v) sum(w * f(q, k, v))))."""
  def loss(q, k, v):
    out = f(q, k, v)
    return jnp.sum(w * out), out
  grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
  return jax.jit(lambda q, k, v: grad(q, k, v)[::-1])


def _assert_close(got, want, **tol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), **(tol or TOL))


def _mesh(shape):
  devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return jax.sharding.Mesh(devices, ('data', 'fsdp', 'context', 'tensor'),
                           axis_types=(jax.sharding.AxisType.Auto,) * 4)


def _ref(q, k, v):
  return attention.attend(q, k, v, XLA)


def _computations(hlo):
  """{computation name: body text} of an HLO module's text."""
  return {m.group(1): m.group(2)
          for m in re.finditer(r'^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}', hlo, re.M | re.S)}


def _loops_with_permutes(hlo):
  """How many while loops have a collective-permute in their body computation."""
  comps = _computations(hlo)
  bodies = re.findall(r' while\(.*?body=%?([\w.\-]+)', hlo)
  return sum('collective-permute' in comps.get(body, '') for body in bodies)


def test_registry():
  assert attention.KERNELS == ('xla', 'cudnn', 'splash')
  assert [attention.default_kernel(p) for p in ('tpu', 'gpu', 'cuda', 'cpu')] == [
      'splash', 'cudnn', 'cudnn', 'xla']
  assert attention.resolve('', 'tpu') == 'splash'
  assert attention.resolve('auto', 'gpu') == 'cudnn'
  assert attention.resolve('xla', 'tpu') == 'xla'
  with pytest.raises(ValueError, match='splash'):
    attention.resolve('flash', 'tpu')
  with pytest.raises(ValueError, match='unknown attention kernel'):
    attention.AttentionConfig(kernel='flash')
  hash(SPLASH)

  # Below min_flash_len (in either S or L) every kernel runs 'xla': no pallas_call, and cuDNN, which
  # would raise on CPU, is never reached.
  q, k, v, _ = _qkv(1, 256, 2, 64, l=64)
  want = _ref(q, k, v)
  for cfg in (attention.AttentionConfig(kernel='splash', interpret=True),
              attention.AttentionConfig(kernel='splash', min_flash_len=128, interpret=True),
              attention.AttentionConfig(kernel='cudnn', min_flash_len=128)):
    assert 'pallas_call' not in str(jax.make_jaxpr(lambda q, k, v: attention.attend(q, k, v, cfg))(q, k, v))
    _assert_close(attention.attend(q, k, v, cfg), want)


@pytest.mark.parametrize('s', [256, 200])   # 200: not a multiple of the 128 blocks (padding path)
def test_splash_matches_xla(s):
  q, k, v, w = _qkv(2, s, 2, 64)
  got = _value_and_grads(lambda q, k, v: attention.attend(q, k, v, SPLASH), w)(q, k, v)
  jaxpr = str(jax.make_jaxpr(lambda q, k, v: attention.attend(q, k, v, SPLASH))(q, k, v))
  assert 'pallas_call' in jaxpr
  _assert_close(got, _value_and_grads(_ref, w)(q, k, v))


def test_attend_with_lse():
  # S 256 queries, L 200 keys: the splash case pads the keys only.
  q, k, v, _ = _qkv(2, 256, 2, 64, l=200)
  logits = jnp.einsum('bsnh,blnh->bnsl', q, k) / np.sqrt(64)
  want_lse = jax.nn.logsumexp(logits, axis=-1)
  want = _ref(q, k, v)
  for cfg in (XLA, SPLASH):
    out, lse = jax.jit(lambda q, k, v: attention.attend_with_lse(q, k, v, cfg))(q, k, v)
    assert lse.shape == (2, 2, 256) and lse.dtype == jnp.float32
    _assert_close((out, lse), (want, want_lse))


def test_splash_holds_no_full_logits():
  """An (S, S) f32 buffer for S = 512 shows up in the 'xla' HLO and not in the splash one."""
  q, k, v, _ = _qkv(1, 512, 1, 64)
  full = re.compile(r'f32\[(\d+,)*512,512\]')
  hlo = {name: jax.jit(lambda q, k, v: attention.attend(q, k, v, cfg)).lower(q, k, v).compile().as_text()
         for name, cfg in (('xla', XLA), ('splash', SPLASH))}
  assert full.search(hlo['xla'])
  assert not full.search(hlo['splash'])


@pytest.mark.parametrize('impl', ['ulysses', 'ring'])
def test_context_parallel_matches_unsharded(impl):
  """Forward and gradients against unsharded attention for cp 2, 4, 8 and data x context x tensor meshes;
  the compiled HLO communicates by all-to-all (Ulysses) or a collective-permute in a loop (ring)."""
  q, k, v, w = _qkv(2, 64, 8, 16)
  want = _value_and_grads(_ref, w)(q, k, v)
  for shape in ((1, 1, 2, 1), (1, 1, 4, 1), (1, 1, 8, 1), (2, 1, 2, 2)):
    mesh = _mesh(shape)
    f = lambda q, k, v, mesh=mesh: context.context_attention(q, k, v, mesh, XLA, impl)
    fwd = jax.jit(f).lower(q, k, v).compile()
    both = _value_and_grads(f, w).lower(q, k, v).compile()
    _assert_close(fwd(q, k, v), want[0])
    _assert_close(both(q, k, v), want)
    for hlo, loops in ((fwd.as_text(), 1), (both.as_text(), 2)):   # the gradient: forward and backward ring
      assert 'all-gather' not in hlo, (impl, shape)
      if impl == 'ulysses':
        assert 'all-to-all' in hlo, shape
      elif shape[2] > 2:   # with cp = 2 the single-trip loop is unrolled away
        assert _loops_with_permutes(hlo) == loops, shape


@pytest.mark.parametrize('impl', ['ulysses', 'ring'])
def test_context_parallel_under_jit_vmap(impl):
  """Called per sample (B = 1) under jit(vmap): the batch falls back to replicated over data = 2."""
  q, k, v, w = _qkv(2, 64, 8, 16)
  mesh = _mesh((2, 1, 4, 1))
  per_sample = lambda q, k, v: context.context_attention(q[None], k[None], v[None], mesh, XLA, impl)[0]
  got = _value_and_grads(jax.vmap(per_sample), w)(q, k, v)
  _assert_close(got, _value_and_grads(_ref, w)(q, k, v))


def test_context_parallel_with_splash():
  """The local kernel is splash (interpret mode) inside shard_map: Ulysses and ring over context 2 x
  tensor 2, with local blocks of 128 tokens."""
  q, k, v, w = _qkv(1, 256, 4, 64)
  mesh = _mesh((1, 1, 2, 2))
  want = _value_and_grads(_ref, w)(q, k, v)
  for impl in ('ulysses', 'ring'):
    f = lambda q, k, v, impl=impl: context.context_attention(q, k, v, mesh, SPLASH, impl)
    assert 'pallas_call' in str(jax.make_jaxpr(f)(q, k, v))
    _assert_close(_value_and_grads(f, w)(q, k, v), want)


def test_context_parallel_errors():
  q, k, v, _ = _qkv(2, 64, 6, 16)
  mesh = _mesh((1, 1, 4, 1))
  with pytest.raises(ValueError, match=r"N=6 heads must be divisible by 4.*'context': 4, 'tensor': 1"):
    context.ulysses_attention(q, k, v, mesh, XLA)
  with pytest.raises(ValueError, match=r"N=6 heads must be divisible by 4.*'tensor': 4"):
    context.ring_attention(q, k, v, _mesh((1, 1, 2, 4)), XLA)
  q, k, v, _ = _qkv(2, 60, 8, 16)
  for fn in (context.ulysses_attention, context.ring_attention):
    with pytest.raises(ValueError, match='S=60.*size 8'):
      fn(q, k, v, _mesh((1, 1, 8, 1)), XLA)
  with pytest.raises(ValueError, match='unknown context-parallel attention'):
    context.context_attention(q, k, v, mesh, XLA, 'tree')
  _assert_close(context.context_attention(q, k, v, None, XLA, 'none'), _ref(q, k, v))


def test_program_kernels_name_what_the_lowered_program_runs():
  """The kernel labels survive jit, scan, remat, grad and the ring's custom VJP into the lowered module's
  locations; check_program accepts the family's kernel and names any other one."""
  q, k, v, w = _qkv(1, 256, 2, 64)
  text_k = k[:, :64]                                  # a short cross-attention: 'xla_short'
  mesh = _mesh((1, 1, 2, 1))

  def loss(q, k, v):
    def body(x, _):
      x = attention.attend(x, k, v, SPLASH) + attention.attend(x, text_k, text_k, SPLASH)
      x = x + context.context_attention(x, k, v, mesh, SPLASH, 'ring')
      return x, None
    out, _ = jax.lax.scan(jax.checkpoint(body), q, None, length=2)
    return jnp.sum(w * out)

  text = jax.jit(jax.grad(loss)).lower(q, k, v).as_text(debug_info=True)
  assert attention.program_kernels(text) == ['splash', 'xla_short']
  assert attention.check_program(text, 'splash', 'cpu') == []
  assert attention.check_program(text, 'xla', 'cpu') == [
      "long-sequence attention runs ['splash'] where the family names 'xla' for cpu"]
  # Interpret-mode splash lowers to plain HLO: on a TPU target that is not the Pallas kernel.
  assert attention.check_program(text, 'splash', 'tpu') == [
      "'splash' is scoped but the program has no tpu_custom_call call"]
  xla_text = jax.jit(lambda q: attention.attend(q, k, v, XLA)).lower(q).as_text(debug_info=True)
  assert attention.program_kernels(xla_text) == ['xla_short']     # S = 256 < the default 4096
  long_xla = dataclasses.replace(XLA, min_flash_len=128)
  xla_text = jax.jit(lambda q: attention.attend(q, k, v, long_xla)).lower(q).as_text(debug_info=True)
  assert attention.program_kernels(xla_text) == ['xla']
  assert attention.check_program(xla_text, 'splash', 'tpu') == [
      "long-sequence attention runs ['xla'] where the family names 'splash' for tpu"]


def test_auto_kernel_resolves_for_the_target_platform():
  """'' resolves for `target_platform` (the plan's mesh platform in a traced step), else this backend."""
  auto = attention.AttentionConfig(kernel='', min_flash_len=128)
  q, k, v, _ = _qkv(1, 256, 2, 64)
  assert attention.current_platform() == jax.default_backend() == 'cpu'
  assert 'pallas_call' not in str(jax.make_jaxpr(lambda q: attention.attend(q, k, v, auto))(q))
  with attention.target_platform('tpu'):
    assert attention.current_platform() == 'tpu'
    assert 'pallas_call' in str(jax.make_jaxpr(lambda q: attention.attend(q, k, v, auto))(q))
  assert attention.current_platform() == 'cpu'
