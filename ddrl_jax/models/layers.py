"""Layers and pure functions every model family shares: the dense layer (with optional LoRA adapters), RMSNorm,
the remat policies, RoPE's rotation, timestep sinusoids, video patchify, exact GELU, LayerNorm, and the
compute-dtype cast of a model's parameters.

`Dense` is the one linear layer of ddrl_jax's models. It is `nnx.Linear` (same parameters `kernel` (din,
dout) and `bias` (dout,), same result) applied to (..., din) as one (prod(...), din) matrix, and it
carries the low-rank adapters that `ddrl_jax.models.lora.attach` gives it: `lora_a` (din, r) and
`lora_b` (r, dout), `nnx.LoRAParam`s, added as y + (alpha / r) (x A) B (peft's form, x A B with A = peft's
lora_A^T). Adapters are created after the model is built (`lora.attach`), so stacked, scanned blocks get
stacked adapters too, and a model without them has exactly the parameters it always had.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddrl_jax.parallel.plan import tokens_mergeable


class Dense(nnx.Linear):
  """nnx.Linear applied to (..., din) as one (prod(...), din) matrix: (..., din) -> (..., dout), plus
  LoRA adapters when `lora.attach` gave it some.

  Flattening the leading axes first makes the kernel's gradient a single-axis contraction x^T dy;
  contracting several leading axes at once made XLA:CPU transpose both operands (and re-run the fused
  producers) before the matmul: the DiT's forward+backward at width 128 went from 0.81 s to 0.48 s
  (benchmarks/RESULTS.md, issue 13). Under a plan that splits the tokens (context parallelism,
  `parallel.plan.tokens_mergeable`) the layer runs unflattened.
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.lora_a = nnx.data(None)        # (din, r) nnx.LoRAParam, set by lora.attach
    self.lora_b = nnx.data(None)        # (r, dout)
    self.lora_scale = 0.0               # alpha / r

  def _apply(self, x):
    y = super().__call__(x)
    if self.lora_a is None:
      return y
    dtype = y.dtype
    low = jnp.dot(x.astype(dtype), self.lora_a[...].astype(dtype))
    return y + (self.lora_scale * jnp.dot(low, self.lora_b[...].astype(dtype))).astype(dtype)

  def __call__(self, x):
    if x.ndim <= 2 or not tokens_mergeable():   # context-parallel plans keep the token axes
      return self._apply(x)
    lead = x.shape[:-1]
    y = self._apply(x.reshape(-1, x.shape[-1]))
    return y.reshape(lead + y.shape[-1:])


def dense(din, dout, names, rngs, *, dtype, param_dtype, bias=False):
  """A Dense layer whose kernel (din, dout) and bias (dout,) carry logical axis `names`."""
  return Dense(
      din, dout, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names, eager_sharding=False),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), names[1:], eager_sharding=False))


REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.checkpoint_dots,
    'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    'save_all': jax.checkpoint_policies.everything_saveable,
}


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis (dim,) with a learnable `scale`, computed in float32."""

  def __init__(self, dim, name, eps, param_dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=(name,), eager_sharding=False)

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + self.eps)
    return (xf * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def timestep_frequencies(dim):
  """(dim/2,) float32 f_j = exp(-ln(1e4) j / (dim/2)): the exponent in float32 as diffusers computes it,
  its exp correctly rounded (a host constant). XLA's and torch's float32 exp are an ulp off on some j, and
  at t ~ 1000 an ulp of a frequency moves the sinusoid by ~3e-5."""
  exponent = -math.log(10000.0) * np.arange(dim // 2, dtype=np.float32) / np.float32(dim // 2)
  return np.exp(exponent.astype(np.float32).astype(np.float64)).astype(np.float32)


def timestep_sinusoid(t, dim):
  """t (...,) float -> (..., dim) float32 embedding [cos(t f), sin(t f)], f_j = 1e4^(-j/(dim/2))
  (`timestep_frequencies`): every family's timestep sinusoid (diffusers' Timesteps(dim,
  flip_sin_to_cos=True, downscale_freq_shift=0))."""
  arg = t.astype(jnp.float32)[..., None] * jnp.asarray(timestep_frequencies(dim))
  return jnp.concatenate([jnp.cos(arg), jnp.sin(arg)], axis=-1)


def apply_rope(x, cos, sin):
  """x (B, S, N, Hd), cos/sin (S, Hd) -> x*cos + rotate_half(x)*sin in float32, cast back to x.dtype."""
  xf = x.astype(jnp.float32)
  a, b = jnp.split(xf, 2, axis=-1)
  rotated = jnp.concatenate([-b, a], axis=-1)
  return (xf * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


def patchify(x, patch):
  """(B, C, T, H, W) -> (B, T', H', W', C*pt*ph*pw), feature index c*pt*ph*pw + r*ph*pw + m*pw + n."""
  b, c, t, h, w = x.shape
  pt, ph, pw = patch
  x = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
  return x.transpose(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, t // pt, h // ph, w // pw, -1)


def unpatchify(y, patch, channels):
  """(B, T', H', W', ph*pw*pt*C) -> (B, C, T, H, W); note the (ph, pw, pt, C) feature order."""
  b, t, h, w, _ = y.shape
  pt, ph, pw = patch
  y = y.reshape(b, t, h, w, ph, pw, pt, channels)
  y = y.transpose(0, 7, 1, 6, 2, 4, 3, 5)
  return y.reshape(b, channels, t * pt, h * ph, w * pw)


def gelu(x):
  """Exact GELU x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), torch's formula (nn.GELU()).

  jax.nn.gelu(approximate=False) writes it with erfc, which XLA:CPU expands into exponentials and
  branches; erf is a polynomial there, and the two agree to float32 round-off."""
  xf = x.astype(jnp.float32)     # in bf16, 1 + erf(x / sqrt 2) cancels for x < 0
  return (0.5 * xf * (1.0 + jax.lax.erf(xf * math.sqrt(0.5)))).astype(x.dtype)


def layer_norm(x, eps):
  """Affine-free LayerNorm over the last axis in float32."""
  x = x.astype(jnp.float32)
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps)


def compute_cast_fn(model):
  """A function params -> params with the kernels and biases of every Linear that computes in a lower
  dtype than it stores (bf16 matmuls on fp32 masters) cast to that dtype, the fp32 islands untouched.

  Cast once at the top of a jitted step, the FSDP all-gathers inside the layer scan then move bf16 (half
  the bytes), and the gradient with respect to the cast copy equals the gradient through the per-use cast
  that nnx.Linear does itself. `model` may be abstract (nnx.eval_shape)."""
  cast = {}        # parameter path -> compute dtype
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Linear) and node.dtype is not None and \
        jnp.dtype(node.dtype) != jnp.dtype(node.param_dtype):
      cast.update({(*path, name): node.dtype for name in ('kernel', 'bias')})
  if not cast:
    return lambda params: params

  def leaf(path, a):
    keys = tuple(getattr(k, 'key', getattr(k, 'name', k)) for k in path)
    keys = keys[:-1] if keys[-1:] == ('value',) else keys      # a Variable's value inside an nnx.State
    return a.astype(cast[keys]) if keys in cast else a

  return lambda params: jax.tree_util.tree_map_with_path(leaf, params)
