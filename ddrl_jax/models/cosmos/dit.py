"""Cosmos-Predict2.5 video DiT (`MiniTrainDIT` / `MinimalV1LVGDiT`) in Flax NNX.

Shapes: B batch, C=16 latent channels, T latent frames, H x W latent pixels, (pt, ph, pw) the patch,
T' = T/pt, H' = H/ph, W' = W/pw, S = T'*H'*W' tokens, D model channels, N heads, Hd = D/N head dim,
L context tokens.

The network takes the rectified-flow time t in [0, 1] per latent frame (the original net receives 1000*t
and multiplies it by `timestep_scale=0.001`; here the caller passes t and `timestep_scale` defaults to 1)
and returns the velocity v = eps - x0. Blocks are created stacked (`nnx.vmap`, leading 'layers' axis) and
run under `nnx.scan` with `nnx.remat`, so compile time does not grow with depth.

Precision: matmuls run in `config.dtype`; the timestep embedding, every adaLN modulation, the
LayerNorms, RoPE and the final layer run in float32, and the residual stream is kept in float32
(the "wan fp32 strategy" of the reference). `compute_cast_fn` casts the parameters of the
`config.dtype` layers once, so an FSDP all-gather moves them in that dtype.

Sharding: parameters carry logical axis names and activations are constrained by logical names
(RESIDUAL_NAMES at every block boundary, QKV_NAMES, the MLP hidden); ddrl_jax/parallel maps the names to
mesh axes, and the model knows nothing of meshes.
"""
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ddrl_jax.models import attention as attention_lib
from ddrl_jax.models import layers
from ddrl_jax.models.layers import REMAT_POLICIES  # noqa: F401  pylint: disable=unused-import
from ddrl_jax.models.layers import RMSNorm
from ddrl_jax.models.layers import apply_rope
from ddrl_jax.models.layers import compute_cast_fn  # noqa: F401  pylint: disable=unused-import
from ddrl_jax.models.layers import gelu
from ddrl_jax.models.layers import layer_norm
from ddrl_jax.models.layers import patchify
from ddrl_jax.models.layers import timestep_sinusoid
from ddrl_jax.models.layers import unpatchify
from ddrl_jax.parallel.plan import constrain
from ddrl_jax.parallel.plan import self_attention


# Logical names of activations (ddrl_jax/parallel/rules.py maps them to mesh axes; no-ops without a plan).
RESIDUAL_NAMES = ('act_batch', 'act_frames', None, 'act_embed')     # (B, T', H'W', D)
QKV_NAMES = ('act_batch', 'act_seq', 'act_heads', 'act_kv')         # (B, S, N, Hd)


@dataclasses.dataclass(frozen=True)
class CosmosDiTConfig:
  """Hyper-parameters of the Cosmos DiT (see cosmos_predict25_architecture.md section 1.1).

  crossattn_in: width of the raw text embedding (100352 = 28 Qwen layers x 3584); None means the
    context is already `context_dim` wide and there is no `crossattn_proj`.
  remat_policy: one of REMAT_POLICIES ('none' disables rematerialisation of the block body).
  attention: the local attention kernel and its tiling (models/attention.py); self-attention becomes
    context-parallel under a sharding plan with a context axis (parallel/plan.self_attention), and the
    short cross-attention stays on 'xla' (min_flash_len).
  """
  in_channels: int = 16
  model_channels: int = 2048
  num_blocks: int = 28
  num_heads: int = 16
  mlp_ratio: int = 4
  adaln_lora_dim: int = 256
  patch: tuple[int, int, int] = (1, 2, 2)
  crossattn_in: int | None = 100352
  context_dim: int = 1024
  rope_t_ratio: float = 1.0
  rope_h_ratio: float = 3.0
  rope_w_ratio: float = 3.0
  concat_padding_mask: bool = True
  timestep_scale: float = 1.0
  norm_eps: float = 1e-6
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat_policy: str = 'full'
  attention: attention_lib.AttentionConfig = attention_lib.AttentionConfig()
  # Cosmos' `extra_per_block_abs_pos_emb` (off in Predict2.5-2B/14B): learned per-axis absolute positions,
  # summed, RMS-normalized and added to the residual at the start of every block; tables of
  # extra_pos_max_size = (T', H', W') tokens. RoPE alone gives attention only relative positions.
  extra_pos_embed: bool = False
  extra_pos_max_size: tuple[int, int, int] = (128, 128, 128)

  @property
  def head_dim(self):
    return self.model_channels // self.num_heads

  @property
  def patch_in_features(self):
    """(16 latent + 1 cond mask [+ 1 padding mask]) * pt*ph*pw, e.g. 72."""
    return (self.in_channels + 1 + int(self.concat_padding_mask)) * math.prod(self.patch)

  @property
  def patch_out_features(self):
    return self.in_channels * math.prod(self.patch)


def cosmos2b(**overrides):
  """Cosmos-Predict2.5-2B: D 2048, 28 blocks, 16 heads of 128."""
  return CosmosDiTConfig(model_channels=2048, num_blocks=28, num_heads=16, **overrides)


def cosmos14b(**overrides):
  """Cosmos-Predict2.5-14B: D 5120, 36 blocks, 40 heads of 128."""
  return CosmosDiTConfig(model_channels=5120, num_blocks=36, num_heads=40, **overrides)


def tiny(**overrides):
  """A 2-block, 2-head (head_dim 32) model with small adaLN-LoRA and text widths, for tests."""
  kw = dict(model_channels=64, num_blocks=2, num_heads=2, adaln_lora_dim=8, crossattn_in=32,
            context_dim=16)
  kw.update(overrides)
  return CosmosDiTConfig(**kw)


# ----------------------------------------------------------------------------------------------- pure fns


def rope_dims(head_dim):
  """Split of the head dim into (t, h, w) RoPE parts: h = w = head_dim//6*2, t = the rest."""
  dh = head_dim // 6 * 2
  if dh < 4 or head_dim % 2:
    raise ValueError(f'head_dim={head_dim}: the 3D RoPE split needs an even head_dim >= 12')
  return head_dim - 2 * dh, dh, dh


def _axis_freqs(dim, ratio):
  """(dim/2,) inverse frequencies theta^(-2j/dim), theta = 1e4 * ratio^(dim/(dim-2)) (NTK scaling)."""
  theta = 10000.0 * ratio ** (dim / (dim - 2))
  return 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32)[:dim // 2] / dim)


def rope_cos_sin(config, t, h, w):
  """(cos, sin), each (t*h*w, head_dim) float32, for a (t, h, w) patch grid in row-major token order.

  Angles per token are [t*f_t, h*f_h, w*f_w] repeated twice (rotate-half convention).
  """
  dt, dh, dw = rope_dims(config.head_dim)
  at = jnp.arange(t, dtype=jnp.float32)[:, None] * _axis_freqs(dt, config.rope_t_ratio)
  ah = jnp.arange(h, dtype=jnp.float32)[:, None] * _axis_freqs(dh, config.rope_h_ratio)
  aw = jnp.arange(w, dtype=jnp.float32)[:, None] * _axis_freqs(dw, config.rope_w_ratio)
  grid = jnp.concatenate([
      jnp.broadcast_to(at[:, None, None], (t, h, w, at.shape[-1])),
      jnp.broadcast_to(ah[None, :, None], (t, h, w, ah.shape[-1])),
      jnp.broadcast_to(aw[None, None, :], (t, h, w, aw.shape[-1])),
  ], axis=-1).reshape(t * h * w, -1)
  angles = jnp.concatenate([grid, grid], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def resize_nearest(mask, h, w):
  """(B, 1, Hp, Wp) -> (B, 1, h, w) nearest resize, source index floor(i * Hp / h) (torch 'nearest')."""
  hp, wp = mask.shape[-2:]
  rows = (jnp.arange(h) * hp) // h
  cols = (jnp.arange(w) * wp) // w
  return mask[..., rows[:, None], cols[None, :]]


def frame_replace(x_t, gt_latent, num_cond_frames):
  """Image/video-to-world conditioning (section 1.4).

  x_t, gt_latent (B, C, T, H, W); num_cond_frames int or (B,) ints. Returns (x_in, cond_mask) with
  cond_mask (B, 1, T, H, W) = 1 on the first k latent frames and x_in = gt*mask + x_t*(1-mask).
  """
  b, _, t, h, w = x_t.shape
  k = jnp.broadcast_to(jnp.asarray(num_cond_frames), (b,))
  frame_on = (jnp.arange(t)[None, :] < k[:, None]).astype(x_t.dtype)
  cond_mask = jnp.broadcast_to(frame_on[:, None, :, None, None], (b, 1, t, h, w))
  return gt_latent * cond_mask + x_t * (1 - cond_mask), cond_mask


def replace_cond_velocity(v, noise, gt, cond_mask):
  """v (B, C, T, H, W) -> (noise - gt)*mask + v*(1-mask): exact velocity on conditioning frames."""
  return (noise - gt) * cond_mask + v * (1 - cond_mask)


# ----------------------------------------------------------------------------------------------- modules


# The shared layers (ddrl_jax/models/layers.py), under the names this module's callers use.
TokenLinear = layers.Dense
_linear = layers.dense


class AdaLNModulation(nnx.Module):
  """float32 adaLN-LoRA: chunk_n(Linear(lora->n*D)(Linear(D->lora)(SiLU(emb))) + lora_bias[..., :n*D])."""

  def __init__(self, cfg, n, rngs):
    d, r = cfg.model_channels, cfg.adaln_lora_dim
    self.n = n
    kw = dict(dtype=jnp.float32, param_dtype=cfg.param_dtype)
    self.linear_1 = _linear(d, r, ('embed', 'adaln'), rngs, **kw)
    self.linear_2 = _linear(r, n * d, ('adaln', 'embed'), rngs, **kw)

  def __call__(self, emb, lora_bias):
    """emb (B, T', D), lora_bias (B, T', 3D) -> n arrays (B, T', 1, D) float32."""
    mod = self.linear_2(self.linear_1(jax.nn.silu(emb))) + lora_bias[..., :self.n * emb.shape[-1]]
    return [m[:, :, None] for m in jnp.split(mod, self.n, axis=-1)]


class Attention(nnx.Module):
  """Multi-head attention with per-head q/k RMSNorm; RoPE on q and k when (cos, sin) is given."""

  def __init__(self, cfg, kv_dim, rngs):
    d = cfg.model_channels
    self.cfg = cfg
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    kv_name = 'embed' if kv_dim == d else 'cross_embed'
    self.q_proj = _linear(d, d, ('embed', 'heads'), rngs, **kw)
    self.k_proj = _linear(kv_dim, d, (kv_name, 'heads'), rngs, **kw)
    self.v_proj = _linear(kv_dim, d, (kv_name, 'heads'), rngs, **kw)
    self.output_proj = _linear(d, d, ('heads', 'embed'), rngs, **kw)
    self.q_norm = RMSNorm(cfg.head_dim, 'kv', cfg.norm_eps, cfg.param_dtype)
    self.k_norm = RMSNorm(cfg.head_dim, 'kv', cfg.norm_eps, cfg.param_dtype)

  def __call__(self, x, context, rope=None):
    """x (B, S, D), context (B, L, kv_dim) -> (B, S, D)."""
    b, s, _ = x.shape
    n, hd = self.cfg.num_heads, self.cfg.head_dim
    kv_seq = 'act_seq' if rope is not None else 'act_text'
    q = constrain(self.q_norm(self.q_proj(x).reshape(b, s, n, hd)), QKV_NAMES)
    k = self.k_norm(self.k_proj(context).reshape(b, context.shape[1], n, hd))
    v = self.v_proj(context).reshape(b, context.shape[1], n, hd)
    k = constrain(k, ('act_batch', kv_seq, 'act_heads', 'act_kv'))
    v = constrain(v, ('act_batch', kv_seq, 'act_heads', 'act_kv'))
    if rope is not None:   # self-attention: context-parallel under a plan with a context axis
      q, k = apply_rope(q, *rope), apply_rope(k, *rope)
      out = self_attention(q, k, v, self.cfg.attention)
    else:
      out = attention_lib.attend(q, k, v, self.cfg.attention)
    return self.output_proj(out.reshape(b, s, n * hd))


class MLP(nnx.Module):
  """Linear(D->r*D) -> exact GELU -> Linear(r*D->D), no biases."""

  def __init__(self, cfg, rngs):
    d, f = cfg.model_channels, cfg.mlp_ratio * cfg.model_channels
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    self.layer1 = _linear(d, f, ('embed', 'mlp'), rngs, **kw)
    self.layer2 = _linear(f, d, ('mlp', 'embed'), rngs, **kw)

  def __call__(self, x):
    hidden = constrain(self.layer1(x), ('act_batch', 'act_seq', 'act_mlp'))
    return self.layer2(gelu(hidden))


class Block(nnx.Module):
  """Self-attn (RoPE) -> cross-attn -> MLP, each with its own adaLN-LoRA shift/scale/gate."""

  def __init__(self, cfg, rngs):
    self.cfg = cfg
    self.self_attn = Attention(cfg, cfg.model_channels, rngs)
    self.cross_attn = Attention(cfg, cfg.context_dim, rngs)
    self.mlp = MLP(cfg, rngs)
    self.adaln_modulation_self_attn = AdaLNModulation(cfg, 3, rngs)
    self.adaln_modulation_cross_attn = AdaLNModulation(cfg, 3, rngs)
    self.adaln_modulation_mlp = AdaLNModulation(cfg, 3, rngs)

  def _sublayer(self, x, mod, fn):
    """x (B, T', HW, D) float32 residual; returns x + gate * fn(LN(x)*(1+scale)+shift)."""
    shift, scale, gate = mod
    b, t, hw, d = x.shape
    h = (layer_norm(x, self.cfg.norm_eps) * (1 + scale) + shift).astype(self.cfg.dtype)
    out = fn(h.reshape(b, t * hw, d)).reshape(b, t, hw, d)
    return x + gate * out.astype(jnp.float32)

  def __call__(self, x, context, emb, lora, rope, extra_pos=None):
    """x (B, T', H'W', D) float32, context (B, L, context_dim), emb/lora (B, T', D/3D) -> like x.

    extra_pos: None or (T', H'W', D) absolute positions added to x first (`LearnablePosEmbAxis`).
    """
    if extra_pos is not None:
      x = x + extra_pos
    x = self._sublayer(x, self.adaln_modulation_self_attn(emb, lora),
                       lambda h: self.self_attn(h, h, rope))
    x = self._sublayer(x, self.adaln_modulation_cross_attn(emb, lora),
                       lambda h: self.cross_attn(h, context))
    return self._sublayer(x, self.adaln_modulation_mlp(emb, lora), self.mlp)


class LearnablePosEmbAxis(nnx.Module):
  """pos_emb_t[t] + pos_emb_h[h] + pos_emb_w[w], RMS-normalized over D: (t, h, w) -> (t, h*w, D) float32.

  The normalization follows diffusers' CosmosLearnablePositionalEmbed (models/transformers/
  transformer_cosmos.py): emb / (eps + ||emb|| / sqrt(D)).
  """

  def __init__(self, cfg, rngs):
    init = nnx.initializers.truncated_normal(0.02)
    self.eps = cfg.norm_eps
    self.max_size = cfg.extra_pos_max_size
    mt, mh, mw = cfg.extra_pos_max_size
    d = cfg.model_channels
    self.pos_emb_t = nnx.Param(init(rngs.params(), (mt, d), cfg.param_dtype))
    self.pos_emb_h = nnx.Param(init(rngs.params(), (mh, d), cfg.param_dtype))
    self.pos_emb_w = nnx.Param(init(rngs.params(), (mw, d), cfg.param_dtype))

  def __call__(self, t, h, w):
    if t > self.max_size[0] or h > self.max_size[1] or w > self.max_size[2]:
      raise ValueError(f'token grid {(t, h, w)} exceeds extra_pos_max_size={self.max_size}')
    emb = (self.pos_emb_t[:t, None, None] + self.pos_emb_h[None, :h, None]
           + self.pos_emb_w[None, None, :w]).astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(jnp.square(emb), -1, keepdims=True))
    return (emb / (self.eps + rms)).reshape(t, h * w, -1)


class TimestepEmbedder(nnx.Module):
  """float32 MLP on the sinusoid: Linear(D->D) -> SiLU -> Linear(D->3D), the shared adaLN-LoRA bias."""

  def __init__(self, cfg, rngs):
    d = cfg.model_channels
    kw = dict(dtype=jnp.float32, param_dtype=cfg.param_dtype)
    self.linear_1 = _linear(d, d, (None, 'embed'), rngs, **kw)
    self.linear_2 = _linear(d, 3 * d, ('embed', None), rngs, **kw)

  def __call__(self, s):
    return self.linear_2(jax.nn.silu(self.linear_1(s)))


class FinalLayer(nnx.Module):
  """float32: LN(x)*(1+scale)+shift (adaLN-LoRA, 2 chunks) -> Linear(D -> pt*ph*pw*C)."""

  def __init__(self, cfg, rngs):
    self.cfg = cfg
    self.adaln_modulation = AdaLNModulation(cfg, 2, rngs)
    self.linear = _linear(cfg.model_channels, cfg.patch_out_features, ('embed', None), rngs,
                          dtype=jnp.float32, param_dtype=cfg.param_dtype)

  def __call__(self, x, emb, lora):
    """x (B, T', HW, D) -> (B, T', HW, pt*ph*pw*C) float32."""
    shift, scale = self.adaln_modulation(emb, lora)
    return self.linear(layer_norm(x, self.cfg.norm_eps) * (1 + scale) + shift)


class CosmosDiT(nnx.Module):
  """The Cosmos-Predict2.5 DiT. Parameter names follow the original `net.` checkpoint."""

  def __init__(self, config, *, rngs):
    cfg = self.config = config
    d = cfg.model_channels
    rope_dims(cfg.head_dim)
    if cfg.patch[0] != 1:
      raise ValueError(f'per-frame timesteps need patch t == 1, got patch={cfg.patch}')
    self.x_embedder = _linear(cfg.patch_in_features, d, (None, 'embed'), rngs, dtype=cfg.dtype,
                              param_dtype=cfg.param_dtype)
    self.t_embedder = TimestepEmbedder(cfg, rngs)
    self.t_embedding_norm = RMSNorm(d, 'embed', cfg.norm_eps, cfg.param_dtype)
    self.crossattn_proj = nnx.data(None)
    if cfg.crossattn_in is not None:
      self.crossattn_proj = _linear(cfg.crossattn_in, cfg.context_dim, ('crossattn_in', 'cross_embed'),
                                    rngs, dtype=cfg.dtype, param_dtype=cfg.param_dtype, bias=True)
    self.extra_pos_embedder = nnx.data(None)
    if cfg.extra_pos_embed:
      self.extra_pos_embedder = LearnablePosEmbAxis(cfg, rngs)
    self.blocks = layers.stacked(lambda r: Block(cfg, r), cfg.num_blocks, rngs)
    self.final_layer = FinalLayer(cfg, rngs)

  def _embed_input(self, x, cond_mask, padding_mask):
    """x (B, C, T, H, W) + masks -> tokens (B, T', H'W', D)."""
    b, _, t, h, w = x.shape
    if cond_mask is None:
      cond_mask = jnp.zeros((b, 1, t, h, w), x.dtype)
    parts = [x, jnp.broadcast_to(cond_mask, (b, 1, t, h, w)).astype(x.dtype)]
    if self.config.concat_padding_mask:
      pm = jnp.zeros((b, 1, h, w), x.dtype) if padding_mask is None else resize_nearest(padding_mask, h, w)
      parts.append(jnp.broadcast_to(pm[:, :, None].astype(x.dtype), (b, 1, t, h, w)))
    tokens = patchify(jnp.concatenate(parts, axis=1).astype(self.config.dtype), self.config.patch)
    bt, tt, hh, ww, _ = tokens.shape
    return self.x_embedder(tokens).reshape(bt, tt, hh * ww, -1)

  def _run_blocks(self, x, context, emb, lora, rope, extra_pos=None):
    """Scans the stacked blocks over the float32 residual x (B, T', H'W', D) (`layers.scan_blocks`)."""

    def body(block, carry):
      return constrain(block(carry, context, emb, lora, rope, extra_pos), RESIDUAL_NAMES)

    return layers.scan_blocks(body, self.blocks, x, self.config.remat_policy)

  def __call__(self, x, timesteps, context, cond_mask=None, padding_mask=None):
    """Velocity of the rectified flow.

    x (B, C, T, H, W) latents (conditioning frames already replaced, see `frame_replace`);
    timesteps (B, T) t in [0, 1] per latent frame; context (B, L, crossattn_in or context_dim);
    cond_mask (B, 1, T, H, W) or None (zeros); padding_mask (B or 1, 1, Hp, Wp) or None (zeros).
    Returns (B, C, T, H, W) in x.dtype.
    """
    cfg = self.config
    b, c, t, h, w = x.shape
    _, ph, pw = cfg.patch
    tokens = self._embed_input(x, cond_mask, padding_mask)
    sinusoid = timestep_sinusoid(timesteps * cfg.timestep_scale, cfg.model_channels)  # (B, T, D)
    lora = self.t_embedder(sinusoid)
    emb = self.t_embedding_norm(sinusoid)
    context = context.astype(cfg.dtype)
    if self.crossattn_proj is not None:
      context = gelu(self.crossattn_proj(context))
    rope = rope_cos_sin(cfg, t, h // ph, w // pw)
    extra_pos = None
    if self.extra_pos_embedder is not None:
      extra_pos = self.extra_pos_embedder(t, h // ph, w // pw)
    tokens = constrain(tokens.astype(jnp.float32), RESIDUAL_NAMES)
    hidden = self._run_blocks(tokens, context, emb, lora, rope, extra_pos)
    out = self.final_layer(hidden, emb, lora).reshape(b, t, h // ph, w // pw, -1)
    return unpatchify(out, cfg.patch, c).astype(x.dtype)


def forward_flops(cfg, latent=(24, 90, 160), text_tokens=512):
  """Analytic FLOPs (2 x multiply-accumulates) of one forward of one sample: (tokens S, {part: FLOPs}).

  latent: (T, H, W) latent (default: 93 frames at 720p); per block and token q/k/v/o, cross q/o and the
  MLP; per block and sample self-attention 4 S^2 D, cross-attention and its k/v over the text tokens;
  plus patch embedding, final layer, adaLN-LoRA and crossattn_proj (benchmarks/cosmos_size.py).
  """
  d, nl, ctx = cfg.model_channels, cfg.num_blocks, cfg.context_dim
  pt, ph, pw = cfg.patch
  frames = latent[0] // pt
  s = frames * (latent[1] // ph) * (latent[2] // pw)
  lt = text_tokens
  r = cfg.adaln_lora_dim
  linear_tok = (4 * d * d + 2 * d * d + 2 * cfg.mlp_ratio * d * d) * s * nl          # MACs
  cross_kv = 2 * lt * ctx * d * nl
  self_attn = 2 * s * s * d * nl
  cross_attn = 2 * s * lt * d * nl
  adaln = frames * nl * 3 * (d * r + r * 3 * d) + frames * (d * d + d * 3 * d + d * r + r * 2 * d)
  io = s * (cfg.patch_in_features * d + d * cfg.patch_out_features)
  proj = lt * cfg.crossattn_in * ctx if cfg.crossattn_in else 0
  parts = dict(linear=2 * linear_tok, self_attention=2 * self_attn,
               cross_attention=2 * (cross_attn + cross_kv), other=2 * (adaln + io + proj))
  return s, parts
