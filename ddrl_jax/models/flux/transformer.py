"""The FLUX.1 transformer (diffusers' `FluxTransformer2DModel`, [dev] and [schnell]) in Flax NNX.

Shapes: B batch, C latent channels (16), H x W latent pixels (even), S = (H/2)(W/2) image tokens
(row-major over the 2 x 2-packed latent), L text tokens (T5), D = num_attention_heads * attention_head_dim
model width (3072), N heads (24), Hd head dim (128).

Inputs and output. `FluxTransformer.__call__(x, t, encoder_hidden_states, pooled_projections, guidance)`
takes the latents x (B, C, H, W) and returns the velocity (B, C, H, W) (FLUX's target is noise - x0, the
library's convention with t = sigma). The 2 x 2 packing of diffusers' pipeline (`pack_latents`: token
(i, j), feature c*4 + 2p + q = latent[c, 2i + p, 2j + q]) and the image position ids (0, i, j) are done
inside, so the model sits on the same (C, H, W) samples, VAE and sharding of image tokens as SD3's MMDiT;
the packed form loses the grid the position ids need. `forward_packed` is the packed entry
((B, S, 4C) tokens plus the grid) for callers that hold packed latents. t (B,) is sigma in [0, 1] and
guidance (B,) the distilled guidance scale (e.g. 3.5, [dev] only); both are multiplied by 1000 inside, as
diffusers' model does (its pipeline passes timestep / 1000). encoder_hidden_states (B, L, 4096) is T5's
sequence, pooled_projections (B, 768) CLIP-L's pooler output.

Blocks. `transformer_blocks` (19 double-stream blocks): image and text keep their own weights (adaLN-Zero
modulation, q/k/v with per-head RMSNorm, output projections, tanh-GELU MLPs) and meet in one joint
attention over [text, image]. `single_transformer_blocks` (38): one set of weights for both streams,
adaLN-Zero-single modulation (shift, scale, gate), the attention's q/k/v (no output projection) beside an
MLP input projection, `proj_out` over the concatenation [attention, GELU(mlp)] (5D -> D) and a gated
residual. diffusers concatenates [text, image] into one sequence for the single blocks; here the two
streams stay separate tensors through the whole network (every op but attention is token-wise, and
attention does not depend on the order of its keys), so the image tokens can be sharded over 'context'
while the text tokens stay replicated (`parallel.plan.joint_attention`, as SD3). Each stack is created
stacked (`nnx.vmap`, leading 'layers' axis) and run by `nnx.scan` under `nnx.remat` (REMAT_POLICIES).

RoPE. Per head, rotary embedding over three axes of (16, 56, 56) dims (`axes_dims_rope`), theta 1e4, on
q and k after the q/k RMSNorm, pairs (x[2j], x[2j+1]) rotated (diffusers' repeat-interleaved cos/sin).
Image token (i, j) has ids (0, i, j); text tokens have ids 0 (FLUX.1's pipelines), where the rotation is
the identity, so it is skipped for them. Angles are computed on the host in float64 as diffusers does
(`rope_cos_sin`).

Precision (as sd3/mmdit.py): the matmuls of attention, MLPs, x_embedder and context_embedder run in
`config.dtype`; the timestep/guidance/pooled embedding, every adaLN modulation, the LayerNorms, the q/k
RMSNorms, RoPE, norm_out + proj_out and both residual streams are float32.

Sharding: parameters carry logical axis names (SD3's vocabulary; LOGICAL_RULES), activations are
constrained by logical names ('act_seq' image tokens, 'act_text' text tokens).

Parameter names follow diffusers' modules ('.' -> '/'): the stacks are `transformer_blocks/<rest>` and
`single_transformer_blocks/<rest>` with a leading layers axis, `to_out.0` -> `to_out`, `ff.net.0.proj` ->
`ff/proj_in`, `ff.net.2` -> `ff/proj_out` (also under `ff_context`), a Linear's `weight` -> `kernel`
(transposed), a norm's `weight` -> `scale` (flux/convert.py).
"""
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddrl_jax.models import attention as attention_lib
from ddrl_jax.models import layers
from ddrl_jax.models.layers import IMAGE_NAMES
from ddrl_jax.models.layers import IMAGE_QKV_NAMES
from ddrl_jax.models.layers import JOINT_DIT_LOGICAL_RULES
from ddrl_jax.models.layers import TEXT_NAMES
from ddrl_jax.models.layers import TEXT_QKV_NAMES
from ddrl_jax.models.layers import TIME_FREQ_DIM
from ddrl_jax.models.layers import AdaLNModulation
from ddrl_jax.models.layers import FeedForward
from ddrl_jax.models.layers import RMSNorm
from ddrl_jax.models.layers import TextProjection
from ddrl_jax.models.layers import TimestepEmbedding
from ddrl_jax.models.layers import apply_rope_interleaved
from ddrl_jax.models.layers import gelu_tanh
from ddrl_jax.models.layers import layer_norm
from ddrl_jax.parallel.plan import constrain
from ddrl_jax.parallel.plan import joint_attention as plan_joint_attention

# Every logical name this module uses -> mesh axes (the format of parallel/rules.DEFAULT_RULES): the
# two-stream DiTs' (layers.JOINT_DIT_LOGICAL_RULES, SD3's vocabulary) plus 'attn_mlp', the 5D input axis of
# a single block's proj_out, which concatenates the attention output ('heads') and the MLP hidden ('mlp'): a
# contiguous split of it would not line up with either, so it is not sharded (FSDP shards the kernel's
# output axis, 'embed').
LOGICAL_RULES = dict(JOINT_DIT_LOGICAL_RULES, attn_mlp='')

NORM_EPS = 1e-6                       # every LayerNorm and q/k RMSNorm of the FLUX transformer
ROPE_THETA = 10000.0                  # FluxPosEmbed(theta=10000)
TIME_SCALE = 1000.0                   # the model multiplies timestep and guidance by 1000


@dataclasses.dataclass(frozen=True)
class FluxConfig:
  """Hyper-parameters of `FluxTransformer2DModel` (diffusers' config field names), plus ours.

  patch_size: must be 1 (every FLUX.1 checkpoint; the 2 x 2 packing is the pipeline's, `pack_latents`).
  in_channels: packed token width, 4 x the latent channels (64 for 16-channel latents).
  out_channels: None = in_channels.
  num_layers / num_single_layers: double-stream / single-stream blocks.
  guidance_embeds: [dev]'s guidance embedder (True) or [schnell] (False).
  axes_dims_rope: RoPE dims of the (0, row, column) position axes; they must sum to attention_head_dim.
  remat_policy: one of REMAT_POLICIES ('none' disables rematerialisation of the block body).
  attention: the local attention kernel (models/attention.py).
  """
  patch_size: int = 1
  in_channels: int = 64
  out_channels: int | None = None
  num_layers: int = 19
  num_single_layers: int = 38
  attention_head_dim: int = 128
  num_attention_heads: int = 24
  joint_attention_dim: int = 4096
  pooled_projection_dim: int = 768
  guidance_embeds: bool = True
  axes_dims_rope: tuple[int, ...] = (16, 56, 56)
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat_policy: str = 'full'
  attention: attention_lib.AttentionConfig = attention_lib.AttentionConfig()

  def __post_init__(self):
    object.__setattr__(self, 'axes_dims_rope', tuple(int(d) for d in self.axes_dims_rope))
    if self.patch_size != 1:
      raise ValueError(f'patch_size={self.patch_size}: only 1 is supported (every FLUX.1 checkpoint; the '
                       f'pipeline packs 2 x 2 latent patches into in_channels)')
    if self.in_channels % 4 or self.out_ch % 4:
      raise ValueError(f'in_channels={self.in_channels}, out_channels={self.out_ch}: must be 4 x the latent '
                       f'channels (2 x 2 packing)')
    if self.num_layers < 1 or self.num_single_layers < 1:
      raise ValueError(f'num_layers={self.num_layers}, num_single_layers={self.num_single_layers}: need at '
                       f'least one block of each kind')
    if sum(self.axes_dims_rope) != self.attention_head_dim or any(d % 2 for d in self.axes_dims_rope) \
        or len(self.axes_dims_rope) != 3:
      raise ValueError(f'axes_dims_rope={self.axes_dims_rope}: need 3 even dims summing to '
                       f'attention_head_dim={self.attention_head_dim}')
    layers.check_remat_policy(self.remat_policy)

  @property
  def inner_dim(self):
    """Model width D."""
    return self.num_attention_heads * self.attention_head_dim

  @property
  def out_ch(self):
    """Packed output width (out_channels, or in_channels when None)."""
    return self.out_channels or self.in_channels

  @property
  def latent_channels(self):
    """Channels C of the (B, C, H, W) latents the model takes (in_channels / 4)."""
    return self.in_channels // 4


def flux1_dev(**overrides):
  """black-forest-labs/FLUX.1-dev: D 3072 = 24 heads x 128, 19 double + 38 single blocks, guidance
  embedder, T5-XXL (4096) text and CLIP-L (768) pooled conditioning. 11.9 B parameters."""
  kw = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
            pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
  kw.update(overrides)
  return FluxConfig(**kw)


def flux1_schnell(**overrides):
  """black-forest-labs/FLUX.1-schnell: [dev] without the guidance embedder."""
  return flux1_dev(**{'guidance_embeds': False, **overrides})


def tiny(**overrides):
  """2 double + 2 single blocks, 2 heads of 16 (D 32), RoPE dims (4, 6, 6), 16-channel latents (the tiny
  VAE's), narrow text (24) and pooled (20) widths, with the guidance embedder."""
  kw = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=2, num_single_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=20,
            guidance_embeds=True, axes_dims_rope=(4, 6, 6))
  kw.update(overrides)
  return FluxConfig(**kw)


# ----------------------------------------------------------------------------------------------- pure fns


def pack_latents(x):
  """(B, C, H, W) latents -> (B, (H/2)(W/2), 4C) tokens, row-major, feature c*4 + 2p + q = x[c, 2i+p,
  2j+q] (diffusers' FluxPipeline._pack_latents)."""
  b, c, h, w = x.shape
  if h % 2 or w % 2:
    raise ValueError(f'latent {h} x {w}: FLUX packs 2 x 2 patches, H and W must be even')
  x = x.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
  return x.reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack_latents(tokens, h, w):
  """(B, (H/2)(W/2), 4C) tokens -> (B, C, H, W) latents of H x W latent pixels: the inverse of
  `pack_latents` (diffusers' FluxPipeline._unpack_latents, which takes pixel sizes instead)."""
  b, s, f = tokens.shape
  if s != (h // 2) * (w // 2) or f % 4:
    raise ValueError(f'tokens {tokens.shape} do not pack a {h} x {w} latent')
  y = tokens.reshape(b, h // 2, w // 2, f // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
  return y.reshape(b, f // 4, h, w)


def image_ids(h, w):
  """(h*w, 3) float32 position ids (0, row, column) of an h x w token grid (the packed latent, H/2 x W/2),
  row-major (diffusers' FluxPipeline._prepare_latent_image_ids)."""
  ids = np.zeros((h, w, 3), np.float32)
  ids[..., 1] = np.arange(h, dtype=np.float32)[:, None]
  ids[..., 2] = np.arange(w, dtype=np.float32)[None, :]
  return ids.reshape(h * w, 3)


def text_ids(length):
  """(L, 3) float32 zeros: the text position ids of FLUX.1's pipelines (RoPE is the identity on them)."""
  return np.zeros((length, 3), np.float32)


def rope_cos_sin(axes_dims_rope, ids):
  """(cos, sin), each (M, Hd/2) float32 numpy, for position ids (M, 3) and the per-axis RoPE dims: per
  axis of d dims the angles pos * theta^(-2j/d), j < d/2, computed in float64 and rounded (diffusers'
  FluxPosEmbed), pairs (x[2j], x[2j+1]) in axis order (`layers.apply_rope_interleaved`'s layout)."""
  ids = np.asarray(ids, np.float32).astype(np.float64)
  parts = []
  for axis, d in enumerate(axes_dims_rope):
    freqs = 1.0 / ROPE_THETA ** (np.arange(0, d, 2, dtype=np.float64) / d)
    parts.append(np.outer(ids[:, axis], freqs))
  angles = np.concatenate(parts, axis=-1)
  return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@functools.lru_cache(maxsize=16)
def _image_rope(axes_dims_rope, h, w):
  tables = rope_cos_sin(axes_dims_rope, image_ids(h, w))
  for table in tables:
    table.setflags(write=False)
  return tables


def image_rope(cfg, h, w):
  """(cos, sin) (h*w, Hd/2) float32 of the image tokens of an h x w token grid (host tables cached per
  grid)."""
  cos, sin = _image_rope(cfg.axes_dims_rope, h, w)
  return jnp.asarray(cos), jnp.asarray(sin)


def time_sinusoid(t, dim=TIME_FREQ_DIM):
  """t (B,) on 0..1000 -> (B, dim) float32 [cos, sin]: `layers.timestep_sinusoid`, every family's one."""
  return layers.timestep_sinusoid(t, dim)


def joint_attention(q_img, k_img, v_img, q_txt, k_txt, v_txt, cfg):
  """FLUX's joint attention over [text, image] (q/k already normalized and rotated): image (B, S, N, Hd)
  and text (B, L, N, Hd) -> (out_img, out_txt). Full attention does not depend on the order of the
  tokens, so this is `parallel.plan.joint_attention` (SD3's, [image, text]): the local kernel without a
  plan, Ulysses over 'context' (image tokens sharded, text replicated) under one."""
  return plan_joint_attention(q_img, k_img, v_img, q_txt, k_txt, v_txt, cfg)


# ----------------------------------------------------------------------------------------------- modules


def _dense(din, dout, names, rngs, dtype, cfg):
  """A biased Dense (every Linear of FLUX has a bias) with logical names on kernel and bias."""
  return layers.dense(din, dout, names, rngs, dtype=dtype, param_dtype=cfg.param_dtype, bias=True)


def _qk_norm(cfg):
  return RMSNorm(cfg.attention_head_dim, 'kv', NORM_EPS, cfg.param_dtype)


class Attention(nnx.Module):
  """diffusers' `FluxAttention`. With `joint` (a double block's `attn`): image q/k/v (`to_q/k/v`) and
  text q/k/v (`add_q/k/v_proj`) with their own per-head RMSNorms (`norm_q/k`, `norm_added_q/k`), the
  joint attention, then `to_out` (image) and `to_add_out` (text). Without (a single block's `attn`,
  diffusers' pre_only): the same `to_q/k/v` and `norm_q/k` for both streams and no output projection."""

  def __init__(self, cfg, rngs, *, joint):
    d = cfg.inner_dim
    self.cfg = cfg
    lin = lambda din, dout, names: _dense(din, dout, names, rngs, cfg.dtype, cfg)
    self.to_q = lin(d, d, ('embed', 'heads'))
    self.to_k = lin(d, d, ('embed', 'heads'))
    self.to_v = lin(d, d, ('embed', 'heads'))
    self.norm_q = _qk_norm(cfg)
    self.norm_k = _qk_norm(cfg)
    self.to_out = self.add_q_proj = self.add_k_proj = self.add_v_proj = nnx.data(None)
    self.norm_added_q = self.norm_added_k = self.to_add_out = nnx.data(None)
    if joint:
      self.add_q_proj = lin(d, d, ('embed', 'heads'))
      self.add_k_proj = lin(d, d, ('embed', 'heads'))
      self.add_v_proj = lin(d, d, ('embed', 'heads'))
      self.norm_added_q = _qk_norm(cfg)
      self.norm_added_k = _qk_norm(cfg)
      self.to_out = lin(d, d, ('heads', 'embed'))
      self.to_add_out = lin(d, d, ('heads', 'embed'))

  def _heads(self, x, proj, norm, names, rope=None):
    """x (B, T, D) -> (B, T, N, Hd): projected, RMS-normalized per head, rotated when `rope` is given."""
    b, t, _ = x.shape
    y = norm(proj(x).reshape(b, t, self.cfg.num_attention_heads, self.cfg.attention_head_dim))
    if rope is not None:
      y = apply_rope_interleaved(y, *rope)
    return constrain(y, names)

  def __call__(self, x, c, rope):
    """x (B, S, D) image, c (B, L, D) text (both cfg.dtype), rope: the image (cos, sin) -> attention
    outputs (image (B, S, D), text (B, L, D)), projected by to_out / to_add_out when joint."""
    b, s, d = x.shape
    l = c.shape[1]
    q = self._heads(x, self.to_q, self.norm_q, IMAGE_QKV_NAMES, rope)
    k = self._heads(x, self.to_k, self.norm_k, IMAGE_QKV_NAMES, rope)
    v = constrain(self.to_v(x).reshape(q.shape), IMAGE_QKV_NAMES)
    if self.add_q_proj is not None:
      projs = (self.add_q_proj, self.norm_added_q), (self.add_k_proj, self.norm_added_k), self.add_v_proj
    else:
      projs = (self.to_q, self.norm_q), (self.to_k, self.norm_k), self.to_v
    # Text ids are 0: RoPE is the identity on the text tokens.
    cq = self._heads(c, *projs[0], TEXT_QKV_NAMES)
    ck = self._heads(c, *projs[1], TEXT_QKV_NAMES)
    cv = constrain(projs[2](c).reshape(b, l, *q.shape[2:]), TEXT_QKV_NAMES)
    out_img, out_txt = joint_attention(q, k, v, cq, ck, cv, self.cfg.attention)
    out_img, out_txt = out_img.reshape(b, s, d), out_txt.reshape(b, l, d)
    if self.to_out is None:
      return out_img, out_txt
    return self.to_out(out_img), self.to_add_out(out_txt)


def _modulate(x, shift, scale):
  """Affine-free LayerNorm (eps 1e-6) of the float32 residual, then x (1 + scale) + shift."""
  return layer_norm(x, NORM_EPS) * (1 + scale) + shift


class DoubleBlock(nnx.Module):
  """diffusers' FluxTransformerBlock: adaLN-Zero (norm1 / norm1_context: shift, scale, gate, shift_mlp,
  scale_mlp, gate_mlp) for each stream, the joint attention, tanh-GELU MLPs `ff` / `ff_context`."""

  def __init__(self, cfg, rngs):
    self.cfg = cfg
    self.norm1 = AdaLNModulation(cfg, 6, rngs)
    self.norm1_context = AdaLNModulation(cfg, 6, rngs)
    self.attn = Attention(cfg, rngs, joint=True)
    self.ff = FeedForward(cfg, rngs)
    self.ff_context = FeedForward(cfg, rngs)

  def __call__(self, x, c, temb_act, rope):
    """x (B, S, D), c (B, L, D) float32 residuals, temb_act (B, D) = SiLU(temb) -> (x, c)."""
    dt = self.cfg.dtype
    shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(temb_act)
    c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(temb_act)
    a_img, a_txt = self.attn(_modulate(x, shift, scale).astype(dt), _modulate(c, c_shift, c_scale).astype(dt),
                             rope)
    x = x + gate * a_img.astype(jnp.float32)
    h = _modulate(x, shift_mlp, scale_mlp).astype(dt)
    x = constrain(x + gate_mlp * self.ff(h, 'act_seq').astype(jnp.float32), IMAGE_NAMES)
    c = c + c_gate * a_txt.astype(jnp.float32)
    h = _modulate(c, c_shift_mlp, c_scale_mlp).astype(dt)
    c = constrain(c + c_gate_mlp * self.ff_context(h, 'act_text').astype(jnp.float32), TEXT_NAMES)
    return x, c


class SingleBlock(nnx.Module):
  """diffusers' FluxSingleTransformerBlock on the two streams (same weights): `norm` (shift, scale, gate),
  attention q/k/v (`attn`, no output projection) beside `proj_mlp` (D -> 4D, tanh-GELU), `proj_out`
  ([attention, mlp] 5D -> D) and the gated residual."""

  def __init__(self, cfg, rngs):
    d = cfg.inner_dim
    self.cfg = cfg
    self.norm = AdaLNModulation(cfg, 3, rngs)
    self.attn = Attention(cfg, rngs, joint=False)
    self.proj_mlp = _dense(d, 4 * d, ('embed', 'mlp'), rngs, cfg.dtype, cfg)
    self.proj_out = _dense(5 * d, d, ('attn_mlp', 'embed'), rngs, cfg.dtype, cfg)

  def __call__(self, x, c, temb_act, rope):
    """x (B, S, D), c (B, L, D) float32 residuals, temb_act (B, D) = SiLU(temb) -> (x, c)."""
    dt = self.cfg.dtype
    shift, scale, gate = self.norm(temb_act)
    xn = _modulate(x, shift, scale).astype(dt)
    cn = _modulate(c, shift, scale).astype(dt)
    a_img, a_txt = self.attn(xn, cn, rope)

    def out(a, h, seq_name):
      mlp = gelu_tanh(constrain(self.proj_mlp(h), ('act_batch', seq_name, 'act_mlp')))
      return gate * self.proj_out(jnp.concatenate([a, mlp], axis=-1)).astype(jnp.float32)

    x = constrain(x + out(a_img, xn, 'act_seq'), IMAGE_NAMES)
    c = constrain(c + out(a_txt, cn, 'act_text'), TEXT_NAMES)
    return x, c


class TimeTextEmbed(nnx.Module):
  """diffusers' CombinedTimestepGuidanceTextProjEmbeddings ([dev]) / CombinedTimestepTextProjEmbeddings
  ([schnell]), float32: temb = timestep_embedder(sinusoid(1000 t)) [+ guidance_embedder(sinusoid(1000 g))]
  + text_embedder(pooled)."""

  def __init__(self, cfg, rngs):
    self.timestep_embedder = TimestepEmbedding(cfg, rngs)
    self.guidance_embedder = TimestepEmbedding(cfg, rngs) if cfg.guidance_embeds else nnx.data(None)
    self.text_embedder = TextProjection(cfg, rngs)

  def __call__(self, t, guidance, pooled):
    temb = self.timestep_embedder(time_sinusoid(t.astype(jnp.float32) * TIME_SCALE))
    if self.guidance_embedder is not None:
      temb = temb + self.guidance_embedder(time_sinusoid(guidance.astype(jnp.float32) * TIME_SCALE))
    return temb + self.text_embedder(pooled.astype(jnp.float32))


class FluxTransformer(nnx.Module):
  """FLUX.1's `FluxTransformer2DModel`. Parameters named after diffusers' (module docstring)."""

  def __init__(self, config, *, rngs):
    cfg = self.config = config
    d = cfg.inner_dim
    self.time_text_embed = TimeTextEmbed(cfg, rngs)
    self.context_embedder = _dense(cfg.joint_attention_dim, d, ('cross_embed', 'embed'), rngs, cfg.dtype, cfg)
    self.x_embedder = _dense(cfg.in_channels, d, (None, 'embed'), rngs, cfg.dtype, cfg)
    self.transformer_blocks = layers.stacked(lambda r: DoubleBlock(cfg, r), cfg.num_layers, rngs)
    self.single_transformer_blocks = layers.stacked(lambda r: SingleBlock(cfg, r), cfg.num_single_layers, rngs)
    self.norm_out = AdaLNModulation(cfg, 2, rngs)
    self.proj_out = _dense(d, cfg.out_ch, ('embed', None), rngs, jnp.float32, cfg)

  def _scan(self, blocks, x, c, temb_act, rope):
    """Runs a stacked block module over the (image, text) residuals (`layers.scan_blocks`)."""

    def body(block, carry):
      return block(carry[0], carry[1], temb_act, rope)

    return layers.scan_blocks(body, blocks, (x, c), self.config.remat_policy)

  def _check_guidance(self, guidance):
    if self.config.guidance_embeds and guidance is None:
      raise ValueError('this FLUX config has the guidance embedder (guidance_embeds=True, [dev]): pass the '
                       'guidance scale (B,)')
    if not self.config.guidance_embeds and guidance is not None:
      raise ValueError('guidance given, but this FLUX config has no guidance embedder (guidance_embeds=False, '
                       '[schnell])')

  def forward_packed(self, tokens, grid_hw, t, encoder_hidden_states, pooled_projections, guidance=None):
    """The network on packed latents: tokens (B, S, in_channels) of an h x w token grid `grid_hw` (S =
    h*w, row-major) -> (B, S, out_channels) float32. t, guidance (B,) as in `__call__`."""
    cfg = self.config
    self._check_guidance(guidance)
    h, w = grid_hw
    if tokens.shape[1] != h * w or tokens.shape[2] != cfg.in_channels:
      raise ValueError(f'tokens {tokens.shape}: expected (B, {h * w}, {cfg.in_channels}) for a {h} x {w} grid')
    img = constrain(self.x_embedder(tokens.astype(cfg.dtype)).astype(jnp.float32), IMAGE_NAMES)
    temb_act = jax.nn.silu(self.time_text_embed(t, guidance, pooled_projections))
    txt = self.context_embedder(encoder_hidden_states.astype(cfg.dtype)).astype(jnp.float32)
    txt = constrain(txt, TEXT_NAMES)
    rope = image_rope(cfg, h, w)
    img, txt = self._scan(self.transformer_blocks, img, txt, temb_act, rope)
    img, _ = self._scan(self.single_transformer_blocks, img, txt, temb_act, rope)
    scale, shift = self.norm_out(temb_act)
    return self.proj_out(_modulate(img, shift, scale))

  def __call__(self, x, t, encoder_hidden_states, pooled_projections, guidance=None):
    """Velocity prediction of FLUX.1.

    x (B, C, H, W) latents (C = in_channels / 4, H and W even); t (B,) sigma in [0, 1] (the model
    multiplies it by 1000); encoder_hidden_states (B, L, joint_attention_dim); pooled_projections
    (B, pooled_projection_dim); guidance (B,) the distilled guidance scale (required with the guidance
    embedder, refused without). Returns (B, out_channels / 4, H, W) in x.dtype.
    """
    cfg = self.config
    _, c, h, w = x.shape
    if c != cfg.latent_channels:
      raise ValueError(f'x has {c} channels; this FLUX config takes {cfg.latent_channels} '
                       f'(in_channels={cfg.in_channels} packs 2 x 2)')
    out = self.forward_packed(pack_latents(x), (h // 2, w // 2), t, encoder_hidden_states, pooled_projections,
                              guidance)
    return unpack_latents(out, h, w).astype(x.dtype)


def forward_flops(cfg, latent_hw=(128, 128), text_tokens=512):
  """Analytic FLOPs (2 x multiply-accumulates) of one forward of one sample: (image tokens S, {part: FLOPs}).

  latent_hw: latent (H, W) (default 128 x 128, a 1024 px image); text_tokens: L (512, [dev]'s T5 length).
  Parts: 'linear': the token-wise projections of the blocks (double: image and text q/k/v/out and MLP,
  12 D^2 per token each; single: q/k/v, proj_mlp and proj_out, 12 D^2 per token of S + L); 'attention':
  q k^T and p v, 2 (S+L)^2 D per block; 'embed': x_embedder, context_embedder and proj_out; 'other': the
  adaLN modulations and the timestep/guidance/pooled embedders (per sample). Elementwise work is left out.
  """
  d = cfg.inner_dim
  s = (latent_hw[0] // 2) * (latent_hw[1] // 2)
  l = text_tokens
  n2, n1 = cfg.num_layers, cfg.num_single_layers
  linear = n2 * 12 * d * d * (s + l) + n1 * 12 * d * d * (s + l)
  attention = (n2 + n1) * 2 * (s + l) ** 2 * d
  embed = s * cfg.in_channels * d + l * cfg.joint_attention_dim * d + s * d * cfg.out_ch
  modulation = (n2 * 12 + n1 * 3 + 2) * d * d
  time = (TIME_FREQ_DIM * d + d * d) * (2 if cfg.guidance_embeds else 1)
  other = modulation + time + cfg.pooled_projection_dim * d + d * d
  return s, dict(linear=2 * linear, attention=2 * attention, embed=2 * embed, other=2 * other)


def abstract_model(cfg):
  """The model from nnx.eval_shape (ShapeDtypeStructs, nothing allocated)."""
  return nnx.eval_shape(lambda: FluxTransformer(cfg, rngs=nnx.Rngs(0)))


def num_params(cfg):
  """Number of parameters (nnx.Param elements) of FluxTransformer(cfg), counted on eval_shape shapes."""
  pure = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(pure))
