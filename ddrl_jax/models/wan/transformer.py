"""Wan2.1 text-to-video DiT (diffusers' `WanTransformer3DModel`, 1.3B and 14B) in Flax NNX.

Shapes: B batch, C=16 latent channels, T latent frames, H x W latent pixels, (pt, ph, pw) the patch,
T' = T/pt, H' = H/ph, W' = W/pw, S = T'*H'*W' tokens (frame-major), D = N*Hd model width, N heads,
Hd head dim, L text tokens (the pipeline zero-pads UMT5 outputs to 512 and the DiT attends to all of them).

The network takes the timestep on diffusers' 0..1000 scale, one per sample, and returns what the
diffusers model returns (the flow-matching velocity). Text-to-video only: no image embedder, no added
k/v projections (the I2V and Wan2.2 TI2V variants are not ported).

Precision (diffusers' `_keep_in_fp32_modules`): the sinusoid and `time_embedder`, the six/two-way
modulations (`scale_shift_table` + timestep projection), norm1/norm2/norm3/norm_out, the q/k RMSNorms and
RoPE run in float32. Beyond diffusers, and like cosmos_dit: `time_proj` and `proj_out` also run in
float32 and the residual stream stays float32 between sublayers (diffusers rounds it to the model dtype
after each sublayer); at float32 the two are identical. Matmuls of attention, the FFN, the patch and
text embeddings run in `config.dtype`.

Blocks are created stacked (`nnx.vmap`, leading 'layers' axis) and run under `nnx.scan` with `nnx.remat`
(REMAT_POLICIES), so compile time does not grow with depth. Parameters carry logical axis names (the
cosmos_dit ones; Wan's q/k RMSNorm scale spans all heads, so it is named 'heads') and activations are
constrained by logical names; ddrl_jax/parallel maps them to a mesh.

Parameter names follow diffusers ('.' -> '/'), except: Linear `weight` -> `kernel` (transposed), norm
`weight` -> `scale`, `attn*.to_out.0` -> `to_out`, `ffn.net.0.proj` -> `ffn/net_0`, `ffn.net.2` ->
`ffn/net_2`, the Conv3d `patch_embedding` -> a dense kernel over the `layers.patchify` features, and
`scale_shift_table` (1, k, D) -> (k, D). See transformer_convert.py.
"""
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddrl_jax.models import attention as attention_lib
from ddrl_jax.models import layers
from ddrl_jax.models.layers import RMSNorm
from ddrl_jax.models.layers import apply_rope_interleaved
from ddrl_jax.models.layers import compute_cast_fn  # noqa: F401  pylint: disable=unused-import
from ddrl_jax.models.layers import layer_norm
from ddrl_jax.models.layers import patchify
from ddrl_jax.models.layers import timestep_sinusoid
from ddrl_jax.parallel.plan import constrain
from ddrl_jax.parallel.plan import self_attention

# Logical names of activations (ddrl_jax/parallel/rules.py maps them to mesh axes; no-ops without a plan).
RESIDUAL_NAMES = ('act_batch', 'act_frames', None, 'act_embed')     # (B, T', H'W', D)
# Logical names beyond the shared ones (parallel/rules.py): latent frames split over context like the
# tokens (the sequence is frame-major, so whole frames shard).
LOGICAL_RULES = {'act_frames': 'context'}
SEQUENCE_NAMES = ('act_frames', 'act_seq')
QKV_NAMES = ('act_batch', 'act_seq', 'act_heads', 'act_kv')         # (B, S, N, Hd)
KV_TEXT_NAMES = ('act_batch', 'act_text', 'act_heads', 'act_kv')    # (B, L, N, Hd)
TEXT_NAMES = ('act_batch', 'act_text', 'act_embed')                 # (B, L, D)


@dataclasses.dataclass(frozen=True)
class WanDiTConfig:
  """Hyper-parameters of the Wan2.1 T2V DiT; the first fields mirror diffusers' config.json.

  remat_policy: one of REMAT_POLICIES ('none' disables rematerialisation of the block body).
  attention: the local attention kernel (models/attention.py); self-attention becomes context-parallel
    under a sharding plan with a context axis (parallel/plan.self_attention), cross-attention to the
    short text stays local.
  """
  patch_size: tuple[int, int, int] = (1, 2, 2)
  num_attention_heads: int = 40
  attention_head_dim: int = 128
  in_channels: int = 16
  out_channels: int = 16
  text_dim: int = 4096
  freq_dim: int = 256
  ffn_dim: int = 13824
  num_layers: int = 40
  cross_attn_norm: bool = True
  qk_norm: str | None = 'rms_norm_across_heads'
  eps: float = 1e-6
  rope_max_seq_len: int = 1024
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat_policy: str = 'full'
  attention: attention_lib.AttentionConfig = attention_lib.AttentionConfig()

  def __post_init__(self):
    if self.qk_norm not in ('rms_norm_across_heads',):
      raise ValueError(f"qk_norm={self.qk_norm!r}: only 'rms_norm_across_heads' (every Wan2.1 checkpoint) "
                       'is implemented')
    rope_dims(self.attention_head_dim)

  @property
  def dim(self):
    return self.num_attention_heads * self.attention_head_dim

  @property
  def patch_in_features(self):
    return self.in_channels * math.prod(self.patch_size)

  @property
  def patch_out_features(self):
    return self.out_channels * math.prod(self.patch_size)


def wan1_3b(**overrides):
  """Wan2.1-T2V-1.3B: D 1536 = 12 heads x 128, FFN 8960, 30 layers."""
  kw = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30)
  kw.update(overrides)
  return WanDiTConfig(**kw)


def wan14b(**overrides):
  """Wan2.1-T2V-14B: D 5120 = 40 heads x 128, FFN 13824, 40 layers."""
  kw = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40)
  kw.update(overrides)
  return WanDiTConfig(**kw)


def tiny(**overrides):
  """A 2-layer, 2-head (head dim 16) model with narrow text and time widths, for tests."""
  kw = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=48, num_layers=2, text_dim=24,
            freq_dim=32)
  kw.update(overrides)
  return WanDiTConfig(**kw)


# ----------------------------------------------------------------------------------------------- pure fns


def rope_dims(head_dim):
  """Split of the head dim into (t, h, w) RoPE parts: h = w = 2*(head_dim//6), t = the rest (44/42/42)."""
  dh = 2 * (head_dim // 6)
  dt = head_dim - 2 * dh
  if dh < 2 or dt < 2 or dt % 2:
    raise ValueError(f'attention_head_dim={head_dim}: the 3D RoPE split needs an even head dim >= 6')
  return dt, dh, dh


def rope_cos_sin(config, t, h, w):
  """(cos, sin), each (t*h*w, Hd/2) float32, for a (t, h, w) token grid in frame-major order.

  Per axis of width d the angles are pos * 1e4^(-2j/d), j < d/2 (diffusers' get_1d_rotary_pos_embed);
  computed in float64 on the host (static shapes) like diffusers' float64 tables, then rounded.
  """
  if max(t, h, w) > config.rope_max_seq_len:
    raise ValueError(f'token grid {(t, h, w)} exceeds rope_max_seq_len={config.rope_max_seq_len}')
  parts = []
  for n, d in zip((t, h, w), rope_dims(config.attention_head_dim)):
    freqs = 1.0 / 10000.0 ** (np.arange(0, d, 2, dtype=np.float64)[:d // 2] / d)
    parts.append(np.arange(n, dtype=np.float64)[:, None] * freqs)
  at, ah, aw = parts
  grid = np.concatenate([
      np.broadcast_to(at[:, None, None], (t, h, w, at.shape[-1])),
      np.broadcast_to(ah[None, :, None], (t, h, w, ah.shape[-1])),
      np.broadcast_to(aw[None, None, :], (t, h, w, aw.shape[-1])),
  ], axis=-1).reshape(t * h * w, -1)
  return jnp.asarray(np.cos(grid), jnp.float32), jnp.asarray(np.sin(grid), jnp.float32)


def unpatchify_thwc(y, patch, channels):
  """(B, T', H', W', pt*ph*pw*C) with features in (pt, ph, pw, C) order -> (B, C, T, H, W)."""
  b, t, h, w, _ = y.shape
  pt, ph, pw = patch
  y = y.reshape(b, t, h, w, pt, ph, pw, channels).transpose(0, 7, 1, 4, 2, 5, 3, 6)
  return y.reshape(b, channels, t * pt, h * ph, w * pw)


def gelu_tanh(x):
  """tanh-approximated GELU (torch approximate='tanh') computed in float32, cast back."""
  return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


# ----------------------------------------------------------------------------------------------- modules

_linear = layers.dense


class LayerNorm(nnx.Module):
  """float32 LayerNorm over D with `scale` and `bias` (diffusers' FP32LayerNorm, elementwise_affine)."""

  def __init__(self, dim, eps, param_dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=('embed',), eager_sharding=False)
    self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), out_sharding=('embed',), eager_sharding=False)

  def __call__(self, x):
    return (layer_norm(x, self.eps) * self.scale[...].astype(jnp.float32)
            + self.bias[...].astype(jnp.float32))


class Attention(nnx.Module):
  """WanAttention: q/k/v/o with biases, RMSNorm over all of D on q and k (before the head split),
  interleaved 3D RoPE on q and k for self-attention."""

  def __init__(self, cfg, rngs):
    d = cfg.dim
    self.cfg = cfg
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, bias=True)
    self.to_q = _linear(d, d, ('embed', 'heads'), rngs, **kw)
    self.to_k = _linear(d, d, ('embed', 'heads'), rngs, **kw)
    self.to_v = _linear(d, d, ('embed', 'heads'), rngs, **kw)
    self.to_out = _linear(d, d, ('heads', 'embed'), rngs, **kw)
    self.norm_q = RMSNorm(d, 'heads', cfg.eps, cfg.param_dtype)
    self.norm_k = RMSNorm(d, 'heads', cfg.eps, cfg.param_dtype)

  def __call__(self, x, context, rope=None):
    """x (B, S, D), context (B, L, D) -> (B, S, D) in cfg.dtype."""
    b, s, _ = x.shape
    lk = context.shape[1]
    n, hd = self.cfg.num_attention_heads, self.cfg.attention_head_dim
    kv_names = QKV_NAMES if rope is not None else KV_TEXT_NAMES
    q = constrain(self.norm_q(self.to_q(x)).reshape(b, s, n, hd), QKV_NAMES)
    k = constrain(self.norm_k(self.to_k(context)).reshape(b, lk, n, hd), kv_names)
    v = constrain(self.to_v(context).reshape(b, lk, n, hd), kv_names)
    if rope is not None:   # self-attention: context-parallel under a plan with a context axis
      q, k = apply_rope_interleaved(q, *rope), apply_rope_interleaved(k, *rope)
      out = self_attention(q, k, v, self.cfg.attention)
    else:
      out = attention_lib.attend(q, k, v, self.cfg.attention)
    return self.to_out(out.reshape(b, s, n * hd))


class FeedForward(nnx.Module):
  """diffusers FeedForward('gelu-approximate'): Linear(D->F) -> tanh-GELU -> Linear(F->D), with biases."""

  def __init__(self, cfg, rngs):
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, bias=True)
    self.net_0 = _linear(cfg.dim, cfg.ffn_dim, ('embed', 'mlp'), rngs, **kw)
    self.net_2 = _linear(cfg.ffn_dim, cfg.dim, ('mlp', 'embed'), rngs, **kw)

  def __call__(self, x):
    hidden = constrain(self.net_0(x), ('act_batch', 'act_seq', 'act_mlp'))
    return self.net_2(gelu_tanh(hidden))


class Block(nnx.Module):
  """WanTransformerBlock: modulated self-attn (RoPE, gated) -> norm2 + cross-attn -> modulated FFN (gated)."""

  def __init__(self, cfg, rngs):
    d = cfg.dim
    self.cfg = cfg
    self.attn1 = Attention(cfg, rngs)
    self.attn2 = Attention(cfg, rngs)
    self.norm2 = LayerNorm(d, cfg.eps, cfg.param_dtype) if cfg.cross_attn_norm else nnx.data(None)
    self.ffn = FeedForward(cfg, rngs)
    init = nnx.initializers.normal(1.0 / math.sqrt(d))
    self.scale_shift_table = nnx.Param(init(rngs.params(), (6, d), cfg.param_dtype),
                                       out_sharding=(None, 'embed'), eager_sharding=False)

  def __call__(self, x, context, timestep_proj, rope):
    """x (B, T', H'W', D) float32, context (B, L, D), timestep_proj (B, 6, D) float32 -> like x."""
    cfg = self.cfg
    b, t, hw, d = x.shape
    mod = self.scale_shift_table[...].astype(jnp.float32) + timestep_proj
    shift, scale, gate, c_shift, c_scale, c_gate = (mod[:, i, None, None] for i in range(6))
    tokens = lambda h: h.astype(cfg.dtype).reshape(b, t * hw, d)
    back = lambda o: o.reshape(b, t, hw, d).astype(jnp.float32)

    h = tokens(layer_norm(x, cfg.eps) * (1 + scale) + shift)
    x = x + back(self.attn1(h, h, rope)) * gate
    h = tokens(self.norm2(x) if self.norm2 is not None else x)
    x = x + back(self.attn2(h, context))
    h = tokens(layer_norm(x, cfg.eps) * (1 + c_scale) + c_shift)
    return x + back(self.ffn(h)) * c_gate


class TimestepEmbedding(nnx.Module):
  """float32 Linear(in->D) -> SiLU -> Linear(D->D) (diffusers' TimestepEmbedding)."""

  def __init__(self, cfg, rngs):
    kw = dict(dtype=jnp.float32, param_dtype=cfg.param_dtype, bias=True)
    self.linear_1 = _linear(cfg.freq_dim, cfg.dim, (None, 'embed'), rngs, **kw)
    self.linear_2 = _linear(cfg.dim, cfg.dim, ('embed', None), rngs, **kw)

  def __call__(self, s):
    return self.linear_2(jax.nn.silu(self.linear_1(s)))


class TextProjection(nnx.Module):
  """Linear(text_dim->D) -> tanh-GELU -> Linear(D->D) (diffusers' PixArtAlphaTextProjection)."""

  def __init__(self, cfg, rngs):
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, bias=True)
    self.linear_1 = _linear(cfg.text_dim, cfg.dim, ('cross_embed', 'embed'), rngs, **kw)
    self.linear_2 = _linear(cfg.dim, cfg.dim, ('embed', None), rngs, **kw)

  def __call__(self, x):
    return self.linear_2(gelu_tanh(self.linear_1(x)))


class ConditionEmbedder(nnx.Module):
  """WanTimeTextImageEmbedding without the image branch: (temb, timestep_proj, text context)."""

  def __init__(self, cfg, rngs):
    self.cfg = cfg
    self.time_embedder = TimestepEmbedding(cfg, rngs)
    self.time_proj = _linear(cfg.dim, 6 * cfg.dim, ('embed', None), rngs, dtype=jnp.float32,
                             param_dtype=cfg.param_dtype, bias=True)
    self.text_embedder = TextProjection(cfg, rngs)

  def __call__(self, timestep, text):
    """timestep (B,) on 0..1000, text (B, L, text_dim) -> temb (B, D) f32, (B, 6, D) f32, (B, L, D)."""
    temb = self.time_embedder(timestep_sinusoid(timestep, self.cfg.freq_dim))
    proj = self.time_proj(jax.nn.silu(temb)).reshape(temb.shape[0], 6, -1)
    return temb, proj, self.text_embedder(text.astype(self.cfg.dtype))


class WanDiT(nnx.Module):
  """The Wan2.1 text-to-video DiT (diffusers `WanTransformer3DModel`, T2V)."""

  def __init__(self, config, *, rngs):
    cfg = self.config = config
    d = cfg.dim
    layers.check_remat_policy(cfg.remat_policy)
    self.patch_embedding = _linear(cfg.patch_in_features, d, (None, 'embed'), rngs, dtype=cfg.dtype,
                                   param_dtype=cfg.param_dtype, bias=True)
    self.condition_embedder = ConditionEmbedder(cfg, rngs)
    self.blocks = layers.stacked(lambda r: Block(cfg, r), cfg.num_layers, rngs)
    self.proj_out = _linear(d, cfg.patch_out_features, ('embed', None), rngs, dtype=jnp.float32,
                            param_dtype=cfg.param_dtype, bias=True)
    init = nnx.initializers.normal(1.0 / math.sqrt(d))
    self.scale_shift_table = nnx.Param(init(rngs.params(), (2, d), cfg.param_dtype),
                                       out_sharding=(None, 'embed'), eager_sharding=False)

  def _run_blocks(self, x, context, timestep_proj, rope):
    """Scans the stacked blocks over the float32 residual x (B, T', H'W', D) (`layers.scan_blocks`)."""

    def body(block, carry):
      return constrain(block(carry, context, timestep_proj, rope), RESIDUAL_NAMES)

    return layers.scan_blocks(body, self.blocks, x, self.config.remat_policy)

  def __call__(self, x, timestep, encoder_hidden_states):
    """x (B, C, T, H, W) latents, timestep (B,) on 0..1000, encoder_hidden_states (B, L, text_dim)
    -> (B, out_channels, T, H, W) in x.dtype."""
    cfg = self.config
    b, c, t, h, w = x.shape
    if c != cfg.in_channels:
      raise ValueError(f'x has {c} channels, config.in_channels={cfg.in_channels}')
    pt, ph, pw = cfg.patch_size
    if t % pt or h % ph or w % pw:
      raise ValueError(f'latent (T, H, W)={(t, h, w)} is not divisible by patch_size={cfg.patch_size}')
    tt, hh, ww = t // pt, h // ph, w // pw
    tokens = self.patch_embedding(patchify(x.astype(cfg.dtype), cfg.patch_size))   # (B, T', H', W', D)
    tokens = constrain(tokens.reshape(b, tt, hh * ww, -1).astype(jnp.float32), RESIDUAL_NAMES)
    temb, timestep_proj, context = self.condition_embedder(jnp.broadcast_to(timestep, (b,)),
                                                           encoder_hidden_states)
    context = constrain(context, TEXT_NAMES)
    rope = rope_cos_sin(cfg, tt, hh, ww)
    hidden = self._run_blocks(tokens, context, timestep_proj, rope)
    mod = self.scale_shift_table[...].astype(jnp.float32) + temb[:, None]       # (B, 2, D)
    shift, scale = mod[:, 0, None, None], mod[:, 1, None, None]
    out = self.proj_out(layer_norm(hidden, cfg.eps) * (1 + scale) + shift)       # (B, T', H'W', P*C)
    return unpatchify_thwc(out.reshape(b, tt, hh, ww, -1), cfg.patch_size, cfg.out_channels).astype(x.dtype)


def forward_flops(cfg, latent_thw=(21, 60, 104), text_tokens=512):
  """Analytic FLOPs (2 x multiply-accumulates) of one forward of one sample: (tokens S, {part: FLOPs}).

  latent_thw: (T, H, W) latent (default: 81 frames at 480x832, 32,760 tokens). Per block and token the
  self-attention q/k/v/o, cross-attention q/o and the FFN; per block self-attention 2 S^2 D (QK^T and
  PV), cross-attention 2 S L D plus its k/v over the text tokens; other: patch embedding, proj_out, the
  text embedder and the time embedding/projection.
  """
  d, f, nl = cfg.dim, cfg.ffn_dim, cfg.num_layers
  pt, ph, pw = cfg.patch_size
  s = (latent_thw[0] // pt) * (latent_thw[1] // ph) * (latent_thw[2] // pw)
  lt = text_tokens
  linear_tok = (4 * d * d + 2 * d * d + 2 * d * f) * s * nl                      # MACs
  self_attn = 2 * s * s * d * nl
  cross_attn = 2 * s * lt * d * nl + 2 * lt * d * d * nl
  io = s * (cfg.patch_in_features * d + d * cfg.patch_out_features)
  text = lt * (cfg.text_dim * d + d * d)
  time = cfg.freq_dim * d + d * d + d * 6 * d
  parts = dict(linear=2 * linear_tok, self_attention=2 * self_attn, cross_attention=2 * cross_attn,
               other=2 * (io + text + time))
  return s, parts


def num_params(cfg):
  """Number of parameters of WanDiT(cfg), from jax.eval_shape (nothing allocated)."""
  abstract = nnx.eval_shape(lambda: WanDiT(cfg, rngs=nnx.Rngs(0)))
  return sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
