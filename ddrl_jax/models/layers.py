"""Layers and pure functions every model family shares: the dense layer (with optional LoRA adapters), RMSNorm,
the remat policies and the stacked blocks run under nnx.scan (`remat`, `stacked`, `scan_blocks`), RoPE's
rotations (half-split and interleaved pairs), timestep sinusoids, video patchify, exact and tanh GELU,
LayerNorm, the compute-dtype cast of a model's parameters, and the parts of the two-stream (image, text) DiTs
(SD3's MMDiT, FLUX): the activation logical names and rules, adaLN modulation,
the tanh-GELU feed-forward, and the timestep and pooled-text embedders.

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

from ddrl_jax.parallel.plan import constrain
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


def check_remat_policy(policy):
  """Raises ValueError unless `policy` is a REMAT_POLICIES key."""
  if policy not in REMAT_POLICIES:
    raise ValueError(f'remat_policy={policy!r} not in {sorted(REMAT_POLICIES)}')


def remat(fn, policy):
  """`fn` under nnx.remat with REMAT_POLICIES[policy] (prevent_cse=False: it runs inside a scan), or `fn`
  itself for 'none'; ValueError for an unknown policy."""
  check_remat_policy(policy)
  if policy == 'none':
    return fn
  return nnx.remat(fn, policy=REMAT_POLICIES[policy], prevent_cse=False)


def stacked(make_block, n, rngs):
  """n modules `make_block(rngs)` with every parameter stacked on a leading 'layers' axis (nnx.vmap over
  n split rng streams): the form `scan_blocks` runs."""

  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
  def make(r):
    return make_block(r)

  return make(rngs)


def scan_blocks(body, blocks, carry, policy, out_axes=nnx.Carry):
  """`body(block, carry)` run over a `stacked` module's blocks with nnx.scan, under `remat(body, policy)`, so
  compile time does not grow with depth. out_axes as nnx.scan's (nnx.Carry: body returns the next carry;
  (nnx.Carry, 0): it returns (carry, per-block output), stacked on a leading axis)."""
  scan = nnx.scan(remat(body, policy), in_axes=(0, nnx.Carry), out_axes=out_axes,
                  transform_metadata={nnx.PARTITION_NAME: 'layers'})
  return scan(blocks, carry)


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


def apply_rope_interleaved(x, cos, sin):
  """x (B, S, N, Hd), cos/sin (S, Hd/2): rotates the pairs (x[2j], x[2j+1]) by angle j, in float32."""
  xf = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
  x1, x2 = xf[..., 0], xf[..., 1]
  # cos/sin broadcast over batch and heads
  c, s = cos[:, None], sin[:, None]
  out = jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
  return out.reshape(x.shape).astype(x.dtype)


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


def gelu_tanh(x):
  """torch's GELU(approximate='tanh'), 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in float32."""
  xf = x.astype(jnp.float32)
  inner = math.sqrt(2.0 / math.pi) * (xf + 0.044715 * xf * xf * xf)
  return (0.5 * xf * (1.0 + jnp.tanh(inner))).astype(x.dtype)


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


# ------------------------------------------------------------ the two-stream (image, text) DiTs' shared parts
# SD3's MMDiT (sd3/mmdit.py) and FLUX.1's transformer (flux/transformer.py) keep image and text tokens in
# separate residual streams; these are the pieces both build from. Shapes: B batch, S image tokens, L text
# tokens, D = cfg.inner_dim model width, N heads, Hd head dim. `cfg` is the family's config: it provides
# inner_dim, dtype, param_dtype and (TextProjection) pooled_projection_dim.

# Logical names of activations (no-ops without a sharding plan).
IMAGE_NAMES = ('act_batch', 'act_seq', 'act_embed')                  # (B, S, D) image residual
TEXT_NAMES = ('act_batch', 'act_text', 'act_embed')                  # (B, L, D) text residual
IMAGE_QKV_NAMES = ('act_batch', 'act_seq', 'act_heads', 'act_kv')    # (B, S, N, Hd)
TEXT_QKV_NAMES = ('act_batch', 'act_text', 'act_heads', 'act_kv')    # (B, L, N, Hd)

# Every logical name the two-stream DiTs use -> mesh axes (the format of parallel/rules.DEFAULT_RULES); a
# family's LOGICAL_RULES starts from it. The names shared with the Cosmos DiT keep their DEFAULT_RULES
# values; 'modulation' and 'pooled' are new.
JOINT_DIT_LOGICAL_RULES = {
    'layers': '',              # the stacked-blocks axis (scanned over: never sharded)
    'embed': 'fsdp',           # model width D
    'cross_embed': 'fsdp',     # joint_attention_dim, the raw text-sequence width (4096) into context_embedder
    'pooled': 'fsdp',          # pooled_projection_dim (2048) into time_text_embed.text_embedder
    'heads': 'tensor',         # N * Hd of q/k/v/out (image and text projections)
    'mlp': 'tensor',           # MLP hidden (4D)
    'kv': '',                  # per-head q/k RMSNorm scales (Hd)
    'modulation': '',          # adaLN outputs: 6D / 9D (norm1), 6D / 2D (norm1_context), 2D (norm_out)
    'act_batch': 'data,fsdp',
    'act_seq': 'context',      # image tokens S (row-major)
    'act_text': '',            # text tokens L (replicated over context: parallel.plan.joint_attention)
    'act_embed': '',
    'act_heads': 'tensor',
    'act_kv': '',
    'act_mlp': 'tensor',
}

TIME_FREQ_DIM = 256     # diffusers' Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)


def _biased_dense(din, dout, names, rngs, dtype, cfg):
  """A biased Dense (every Linear of SD3 and FLUX has a bias) with logical names on kernel and bias."""
  return dense(din, dout, names, rngs, dtype=dtype, param_dtype=cfg.param_dtype, bias=True)


class AdaLNModulation(nnx.Module):
  """float32 Linear(D -> n*D) of SiLU(temb), split into n chunks (B, 1, D): the `linear` of diffusers'
  AdaLayerNormZero (n=6: shift, scale, gate, shift_mlp, scale_mlp, gate_mlp), SD35AdaLayerNormZeroX
  (n=9: ... then shift2, scale2, gate2) and AdaLayerNormContinuous (n=2: scale, shift)."""

  def __init__(self, cfg, n, rngs):
    self.n = n
    self.linear = _biased_dense(cfg.inner_dim, n * cfg.inner_dim, ('embed', 'modulation'), rngs, jnp.float32,
                                cfg)

  def __call__(self, temb_act):
    """temb_act (B, D) = SiLU(temb) -> n arrays (B, 1, D) float32."""
    mod = self.linear(temb_act.astype(jnp.float32))
    return [m[:, None] for m in jnp.split(mod, self.n, axis=-1)]


class FeedForward(nnx.Module):
  """diffusers' FeedForward('gelu-approximate'): proj_in (D -> 4D, `net.0.proj`), tanh-GELU, proj_out
  (4D -> D, `net.2`)."""

  def __init__(self, cfg, rngs):
    d = cfg.inner_dim
    self.proj_in = _biased_dense(d, 4 * d, ('embed', 'mlp'), rngs, cfg.dtype, cfg)
    self.proj_out = _biased_dense(4 * d, d, ('mlp', 'embed'), rngs, cfg.dtype, cfg)

  def __call__(self, x, seq_name):
    """x (B, T, D) -> (B, T, D); seq_name the logical name of the T tokens ('act_seq' or 'act_text')."""
    hidden = constrain(self.proj_in(x), ('act_batch', seq_name, 'act_mlp'))
    return self.proj_out(gelu_tanh(hidden))


class TimestepEmbedding(nnx.Module):
  """float32 linear_1 (256 -> D), SiLU, linear_2 (D -> D) on the timestep sinusoid."""

  def __init__(self, cfg, rngs):
    d = cfg.inner_dim
    self.linear_1 = _biased_dense(TIME_FREQ_DIM, d, (None, 'embed'), rngs, jnp.float32, cfg)
    self.linear_2 = _biased_dense(d, d, ('embed', None), rngs, jnp.float32, cfg)

  def __call__(self, x):
    """x (B, 256) sinusoid -> (B, D) float32."""
    return self.linear_2(jax.nn.silu(self.linear_1(x)))


class TextProjection(nnx.Module):
  """float32 linear_1 (pooled -> D), SiLU, linear_2 (D -> D) (diffusers' PixArtAlphaTextProjection)."""

  def __init__(self, cfg, rngs):
    d = cfg.inner_dim
    self.linear_1 = _biased_dense(cfg.pooled_projection_dim, d, ('pooled', 'embed'), rngs, jnp.float32, cfg)
    self.linear_2 = _biased_dense(d, d, ('embed', None), rngs, jnp.float32, cfg)

  def __call__(self, x):
    """x (B, pooled_projection_dim) float32 -> (B, D) float32."""
    return self.linear_2(jax.nn.silu(self.linear_1(x)))
