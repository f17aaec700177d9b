"""The MMDiT of Stable Diffusion 3 / 3.5 (diffusers' `SD3Transformer2DModel`) in Flax NNX.

Shapes: B batch, C latent channels (16), H x W latent pixels, p the patch (2), H' = H/p, W' = W/p,
S = H'W' image tokens (row-major), L text tokens, D = num_attention_heads * attention_head_dim model width,
N heads, Hd head dim.

The network takes diffusers' inputs: latents x (B, C, H, W), `timestep` (B,) on diffusers' 0..1000 scale
(the SD3 pipelines pass sigma * 1000, sigma in [0, 1] the rectified-flow time), the text sequence
(B, L, joint_attention_dim) and the pooled text embedding (B, pooled_projection_dim), and returns the
velocity prediction (B, out_channels, H, W) (SD3's target is noise - x0).

Blocks. Every block is a joint (MM-DiT) block: image and text tokens keep their own weights and are
mixed by one attention over the concatenated [image, text] sequence (`joint_attention`). SD3.5-Medium's
first blocks (`dual_attention_layers`) add a second, image-only self-attention (`attn2`); the last block
is "context-pre-only" (its text stream has no output). The blocks run as three pieces: the dual blocks as
one stacked, scanned module (`dual_blocks`), the remaining blocks but the last as a second one
(`joint_blocks`), and the last block on its own (`last_block`). This needs the dual layers (other than
the last) to be a prefix 0..k-1 of the blocks, as in every released checkpoint; diffusers itself would
accept any set, and `MMDiTConfig` raises a ValueError for one that is not a prefix.

Precision (as models/cosmos_dit.py): matmuls of the attention, MLPs, patch and context embeddings run in
`config.dtype`; the timestep/pooled embedding, every adaLN modulation, the LayerNorms, the q/k RMSNorms,
the final layer and both residual streams are float32.

Sharding: parameters carry logical axis names and activations are constrained by logical names; every
name used is listed in LOGICAL_RULES (with its default mesh axes) for ddrl_jax/parallel/rules.py. Image
tokens are 'act_seq' (sharded over context under context parallelism), text tokens 'act_text' (replicated
over context: L = 333 need not divide it); the joint attention is made context-parallel (Ulysses) by
`ddrl_jax.parallel.plan.joint_attention`, attn2 by `ddrl_jax.parallel.plan.self_attention`.

Parameter names follow diffusers' modules so that a key maps by a short table (sd3/convert.py):
`transformer_blocks.{i}.<rest>` lives in `dual_blocks/<rest>` [i], `joint_blocks/<rest>` [i - k] or
`last_block/<rest>`, with `to_out.0` -> `to_out`, `ff.net.0.proj` -> `ff/proj_in`, `ff.net.2` ->
`ff/proj_out`, `.weight` of a Linear -> `/kernel` (transposed), of a norm -> `/scale`.
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
from ddrl_jax.models.layers import layer_norm
from ddrl_jax.models.layers import patchify
from ddrl_jax.models.layers import unpatchify
from ddrl_jax.parallel.plan import constrain
from ddrl_jax.parallel.plan import joint_attention as plan_joint_attention
from ddrl_jax.parallel.plan import self_attention

# Every logical name this module uses -> mesh axes (the format of parallel/rules.DEFAULT_RULES): the
# two-stream DiTs' vocabulary (layers.JOINT_DIT_LOGICAL_RULES), which SD3's names define.
LOGICAL_RULES = dict(JOINT_DIT_LOGICAL_RULES)

NORM_EPS = 1e-6         # every LayerNorm and q/k RMSNorm of the SD3 transformer
QK_NORMS = (None, 'rms_norm')


@dataclasses.dataclass(frozen=True)
class MMDiTConfig:
  """Hyper-parameters of `SD3Transformer2DModel` (diffusers' config field names), plus ours.

  sample_size: latent height/width of training; only sets the positional table's base size
    (sample_size // patch_size grid units span the table's coordinate range 0..base).
  pos_embed_max_size: side (in patches) of the fixed 2-D sin-cos table; the model uses the centre crop
    of the token grid's size. Must be set (every SD3/3.5 checkpoint sets it).
  caption_projection_dim: context_embedder's output width; must equal the model width D.
  dual_attention_layers: blocks with the extra image self-attention `attn2` (SD3.5-M: 0..12); apart from
    the last block they must be a prefix 0..k-1.
  qk_norm: None or 'rms_norm' (per-head RMSNorm of q and k, eps 1e-6).
  remat_policy: one of REMAT_POLICIES ('none' disables rematerialisation of the block body).
  attention: the local attention kernel (models/attention.py).
  """
  sample_size: int = 128
  patch_size: int = 2
  in_channels: int = 16
  num_layers: int = 24
  attention_head_dim: int = 64
  num_attention_heads: int = 24
  joint_attention_dim: int = 4096
  caption_projection_dim: int = 1536
  pooled_projection_dim: int = 2048
  out_channels: int = 16
  pos_embed_max_size: int = 384
  dual_attention_layers: tuple[int, ...] = tuple(range(13))
  qk_norm: str | None = 'rms_norm'
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat_policy: str = 'full'
  attention: attention_lib.AttentionConfig = attention_lib.AttentionConfig()

  def __post_init__(self):
    object.__setattr__(self, 'dual_attention_layers', tuple(sorted({int(i) for i in self.dual_attention_layers})))
    if self.num_layers < 1:
      raise ValueError(f'num_layers={self.num_layers}: need at least one block')
    if self.qk_norm not in QK_NORMS:
      raise ValueError(f'qk_norm={self.qk_norm!r}: supported are {QK_NORMS}')
    if self.caption_projection_dim != self.inner_dim:
      raise ValueError(f'caption_projection_dim={self.caption_projection_dim} must equal the model width '
                       f'num_attention_heads * attention_head_dim = {self.inner_dim} (joint attention)')
    if self.pos_embed_max_size is None:
      raise ValueError('pos_embed_max_size=None (an uncropped, interpolated table) is not supported')
    if self.inner_dim % 4:
      raise ValueError(f'model width {self.inner_dim}: the 2-D sin-cos table needs a multiple of 4')
    layers.check_remat_policy(self.remat_policy)
    bad = [i for i in self.dual_attention_layers if not 0 <= i < self.num_layers]
    if bad:
      raise ValueError(f'dual_attention_layers {bad} outside 0..{self.num_layers - 1}')
    stacked = [i for i in self.dual_attention_layers if i != self.num_layers - 1]
    if stacked != list(range(len(stacked))):
      raise ValueError(f'dual_attention_layers={self.dual_attention_layers}: the dual-attention blocks (other '
                       f'than the last) must be a prefix 0..k-1 of the blocks, so they scan as one stack')

  @property
  def inner_dim(self):
    """Model width D."""
    return self.num_attention_heads * self.attention_head_dim

  @property
  def num_dual(self):
    """Blocks in the `dual_blocks` stack (diffusers' blocks 0..num_dual-1)."""
    return len([i for i in self.dual_attention_layers if i != self.num_layers - 1])

  @property
  def num_joint(self):
    """Blocks in the `joint_blocks` stack (diffusers' blocks num_dual..num_layers-2)."""
    return self.num_layers - 1 - self.num_dual

  @property
  def last_dual(self):
    """Whether the last (context-pre-only) block has `attn2` too."""
    return self.num_layers - 1 in self.dual_attention_layers

  @property
  def base_size(self):
    return self.sample_size // self.patch_size


def sd35_medium(**overrides):
  """stabilityai/stable-diffusion-3.5-medium: D 1536, 24 blocks (0..12 dual), 24 heads of 64, table 384."""
  kw = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)), qk_norm='rms_norm')
  kw.update(overrides)
  return MMDiTConfig(**kw)


def sd35_large(**overrides):
  """stabilityai/stable-diffusion-3.5-large: D 2432, 38 blocks, 38 heads of 64, table 192, no dual blocks."""
  kw = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
            num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, dual_attention_layers=(),
            qk_norm='rms_norm')
  kw.update(overrides)
  return MMDiTConfig(**kw)


def tiny(**overrides):
  """5 blocks (0, 1 dual; 2, 3 plain; 4 context-pre-only), 2 heads of 16, qk RMSNorm, 4 latent channels,
  a 24 x 24 positional table (base 16) that any latent up to 48 x 48 crops."""
  kw = dict(sample_size=32, patch_size=2, in_channels=4, num_layers=5, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=20,
            out_channels=4, pos_embed_max_size=24, dual_attention_layers=(0, 1), qk_norm='rms_norm')
  kw.update(overrides)
  return MMDiTConfig(**kw)


# ----------------------------------------------------------------------------------------------- pure fns


def _sincos_1d(dim, pos):
  """pos (M,) float64 -> (M, dim) [sin(pos w), cos(pos w)], w_j = 1e4^(-j/(dim/2)) (float64)."""
  omega = 1.0 / 10000.0 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
  out = np.outer(pos, omega)
  return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def _grid_coords(max_size, base_size, start, count):
  """Table coordinates of grid rows (or columns) start..start+count-1: float32 i / (max / base), as
  diffusers computes them (float32 arange divided by a float32 scalar)."""
  coords = np.arange(max_size, dtype=np.float32) / np.float32(max_size / base_size)
  return coords[start:start + count].astype(np.float64)


def pos_embed_crop(cfg, h, w):
  """The (h*w, D) float32 centre crop of diffusers' fixed 2-D sin-cos table for an h x w patch grid.

  The table holds, for grid cell (i, j) of pos_embed_max_size^2, [sincos(x_j) (D/2), sincos(y_i) (D/2)]
  (the column coordinate first) with x_j = j / (max / base_size), computed in float64 and rounded to
  float32; the crop starts at row (max - h) // 2, column (max - w) // 2 (diffusers'
  `PatchEmbed.cropped_pos_embed`). Built here in numpy for just the crop (the full SD3.5-M table is 0.9 GB).
  """
  return _pos_embed_crop(cfg.inner_dim, cfg.pos_embed_max_size, cfg.base_size, h, w)


@functools.lru_cache(maxsize=16)
def _pos_embed_crop(dim, max_size, base_size, h, w):
  if h > max_size or w > max_size:
    raise ValueError(f'patch grid {h} x {w} exceeds pos_embed_max_size={max_size}')
  table = _sincos_table(dim, max_size, base_size, (max_size - h) // 2, h, (max_size - w) // 2, w)
  table.setflags(write=False)
  return table


def _sincos_table(dim, max_size, base_size, top, h, left, w):
  """(h*w, dim) float32 rows of the table for grid rows top.. and columns left.. (row-major)."""
  emb_y = _sincos_1d(dim // 2, _grid_coords(max_size, base_size, top, h)).astype(np.float32)   # (h, D/2)
  emb_x = _sincos_1d(dim // 2, _grid_coords(max_size, base_size, left, w)).astype(np.float32)  # (w, D/2)
  table = np.empty((h, w, dim), np.float32)
  table[..., :dim // 2] = emb_x[None]
  table[..., dim // 2:] = emb_y[:, None]
  return table.reshape(h * w, dim)


def pos_embed_table(cfg):
  """diffusers' whole persistent buffer `pos_embed.pos_embed`: (1, max^2, D) float32 numpy (0.9 GB for
  SD3.5-M)."""
  m = cfg.pos_embed_max_size
  return _sincos_table(cfg.inner_dim, m, cfg.base_size, 0, m, 0, m)[None]


def time_sinusoid(t, dim=TIME_FREQ_DIM):
  """t (B,) on 0..1000 -> (B, dim) float32 [cos(t f), sin(t f)]: `layers.timestep_sinusoid`, the one
  sinusoid of every family (its frequencies a correctly rounded constant)."""
  return layers.timestep_sinusoid(t, dim)


def joint_attention(q_img, k_img, v_img, q_txt, k_txt, v_txt, cfg):
  """SD3's joint attention: full attention over the concatenated [image, text] tokens.

  q/k/v_img (B, S, N, Hd), q/k/v_txt (B, L, N, Hd) (q and k already RMS-normalized) -> (out_img
  (B, S, N, Hd), out_txt (B, L, N, Hd)). `cfg` is a models.attention.AttentionConfig. Every joint
  attention of the model goes through this one function, which hands it to
  `ddrl_jax.parallel.plan.joint_attention`: the local kernel without a plan, Ulysses context parallelism
  under a plan with a context axis (image tokens 'act_seq', text tokens 'act_text', replicated over
  context).
  """
  return plan_joint_attention(q_img, k_img, v_img, q_txt, k_txt, v_txt, cfg)


# ----------------------------------------------------------------------------------------------- modules


def _dense(din, dout, names, rngs, dtype, cfg):
  """A biased Dense (every Linear of SD3 has a bias) with logical names on kernel and bias."""
  return layers.dense(din, dout, names, rngs, dtype=dtype, param_dtype=cfg.param_dtype, bias=True)


def _qk_norm(cfg):
  if cfg.qk_norm == 'rms_norm':
    return RMSNorm(cfg.attention_head_dim, 'kv', NORM_EPS, cfg.param_dtype)
  return nnx.data(None)


class Attention(nnx.Module):
  """diffusers' `Attention` as SD3 builds it. With `joint` (a block's `attn`): image q/k/v (`to_q/k/v`)
  and text q/k/v (`add_q/k/v_proj`), per-head RMSNorms (`norm_q/k`, `norm_added_q/k`), `joint_attention`,
  then `to_out` for the image part and, unless context-pre-only, `to_add_out` for the text part. Without
  (`attn2` of the dual blocks): image self-attention with its own to_q/k/v, norm_q/k and to_out."""

  def __init__(self, cfg, rngs, *, joint, context_out):
    d = cfg.inner_dim
    self.cfg = cfg
    lin = lambda din, dout, names: _dense(din, dout, names, rngs, cfg.dtype, cfg)
    self.to_q = lin(d, d, ('embed', 'heads'))
    self.to_k = lin(d, d, ('embed', 'heads'))
    self.to_v = lin(d, d, ('embed', 'heads'))
    self.norm_q = _qk_norm(cfg)
    self.norm_k = _qk_norm(cfg)
    self.to_out = lin(d, d, ('heads', 'embed'))
    self.add_q_proj = self.add_k_proj = self.add_v_proj = nnx.data(None)
    self.norm_added_q = self.norm_added_k = self.to_add_out = nnx.data(None)
    if joint:
      self.add_q_proj = lin(d, d, ('embed', 'heads'))
      self.add_k_proj = lin(d, d, ('embed', 'heads'))
      self.add_v_proj = lin(d, d, ('embed', 'heads'))
      self.norm_added_q = _qk_norm(cfg)
      self.norm_added_k = _qk_norm(cfg)
      if context_out:
        self.to_add_out = lin(d, d, ('heads', 'embed'))

  def _heads(self, x, proj, norm, names):
    """x (B, T, D) -> (B, T, N, Hd), normalized per head when `norm` is set."""
    b, t, _ = x.shape
    y = proj(x).reshape(b, t, self.cfg.num_attention_heads, self.cfg.attention_head_dim)
    if norm is not None:
      y = norm(y)
    return constrain(y, names)

  def __call__(self, x, context=None):
    """x (B, S, D), context (B, L, D) or None -> (image out (B, S, D), text out (B, L, D) or None)."""
    b, s, d = x.shape
    q = self._heads(x, self.to_q, self.norm_q, IMAGE_QKV_NAMES)
    k = self._heads(x, self.to_k, self.norm_k, IMAGE_QKV_NAMES)
    v = self._heads(x, self.to_v, None, IMAGE_QKV_NAMES)
    if context is None:
      # attn2: image-only self-attention (context-parallel under a plan with a context axis).
      return self.to_out(self_attention(q, k, v, self.cfg.attention).reshape(b, s, d)), None
    cq = self._heads(context, self.add_q_proj, self.norm_added_q, TEXT_QKV_NAMES)
    ck = self._heads(context, self.add_k_proj, self.norm_added_k, TEXT_QKV_NAMES)
    cv = self._heads(context, self.add_v_proj, None, TEXT_QKV_NAMES)
    out_img, out_txt = joint_attention(q, k, v, cq, ck, cv, self.cfg.attention)
    img = self.to_out(out_img.reshape(b, s, d))
    if self.to_add_out is None:
      return img, None
    return img, self.to_add_out(out_txt.reshape(b, context.shape[1], d))


class JointBlock(nnx.Module):
  """diffusers' JointTransformerBlock (`use_dual_attention` = dual, `context_pre_only`)."""

  def __init__(self, cfg, rngs, *, dual, context_pre_only):
    self.cfg = cfg
    self.dual = dual
    self.context_pre_only = context_pre_only
    self.norm1 = AdaLNModulation(cfg, 9 if dual else 6, rngs)
    self.norm1_context = AdaLNModulation(cfg, 2 if context_pre_only else 6, rngs)
    self.attn = Attention(cfg, rngs, joint=True, context_out=not context_pre_only)
    self.attn2 = Attention(cfg, rngs, joint=False, context_out=False) if dual else nnx.data(None)
    self.ff = FeedForward(cfg, rngs)
    self.ff_context = nnx.data(None) if context_pre_only else FeedForward(cfg, rngs)

  def __call__(self, x, c, temb_act):
    """x (B, S, D), c (B, L, D) float32 residuals, temb_act (B, D) = SiLU(temb) -> (x, c or None)."""
    dt = self.cfg.dtype
    mod = self.norm1(temb_act)
    shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = mod[:6]
    xn = layer_norm(x, NORM_EPS)
    cn = layer_norm(c, NORM_EPS)
    if self.context_pre_only:
      c_scale, c_shift = self.norm1_context(temb_act)
    else:
      c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(temb_act)
    a_img, a_txt = self.attn((xn * (1 + scale) + shift).astype(dt), (cn * (1 + c_scale) + c_shift).astype(dt))
    x = x + gate * a_img.astype(jnp.float32)
    if self.dual:
      shift2, scale2, gate2 = mod[6:]
      a2, _ = self.attn2((xn * (1 + scale2) + shift2).astype(dt))
      x = x + gate2 * a2.astype(jnp.float32)
    h = (layer_norm(x, NORM_EPS) * (1 + scale_mlp) + shift_mlp).astype(dt)
    x = constrain(x + gate_mlp * self.ff(h, 'act_seq').astype(jnp.float32), IMAGE_NAMES)
    if self.context_pre_only:
      return x, None
    c = c + c_gate * a_txt.astype(jnp.float32)
    h = (layer_norm(c, NORM_EPS) * (1 + c_scale_mlp) + c_shift_mlp).astype(dt)
    c = constrain(c + c_gate_mlp * self.ff_context(h, 'act_text').astype(jnp.float32), TEXT_NAMES)
    return x, c


class PatchEmbed(nnx.Module):
  """diffusers' PatchEmbed: the p x p stride-p Conv2d as a Dense on (c, ph, pw)-ordered patch features,
  plus the centre-cropped fixed sin-cos table (`pos_embed_crop`, not a parameter)."""

  def __init__(self, cfg, rngs):
    self.cfg = cfg
    p = cfg.patch_size
    self.proj = _dense(cfg.in_channels * p * p, cfg.inner_dim, (None, 'embed'), rngs, cfg.dtype, cfg)

  def __call__(self, x):
    """x (B, C, H, W) -> (B, S, D) float32."""
    b, _, h, w = x.shape
    p = self.cfg.patch_size
    tokens = patchify(x[:, :, None].astype(self.cfg.dtype), (1, p, p)).reshape(b, (h // p) * (w // p), -1)
    return self.proj(tokens).astype(jnp.float32) + jnp.asarray(pos_embed_crop(self.cfg, h // p, w // p))


class TimeTextEmbed(nnx.Module):
  """diffusers' CombinedTimestepTextProjEmbeddings: temb = timestep_embedder(sinusoid_256(t)) +
  text_embedder(pooled), float32. t on the 0..1000 scale; the sinusoid is [cos, sin] with frequencies
  exp(-ln(1e4) j / 128)."""

  def __init__(self, cfg, rngs):
    self.timestep_embedder = TimestepEmbedding(cfg, rngs)
    self.text_embedder = TextProjection(cfg, rngs)

  def __call__(self, timestep, pooled):
    t = self.timestep_embedder(time_sinusoid(timestep))
    return t + self.text_embedder(pooled.astype(jnp.float32))


def _stacked_blocks(cfg, n, rngs, *, dual):
  """n JointBlocks (not context-pre-only) with every parameter stacked on a leading 'layers' axis."""
  return layers.stacked(lambda r: JointBlock(cfg, r, dual=dual, context_pre_only=False), n, rngs)


class MMDiT(nnx.Module):
  """SD3 / SD3.5 `SD3Transformer2DModel`. Parameters named after diffusers' (module docstring)."""

  def __init__(self, config, *, rngs):
    cfg = self.config = config
    d = cfg.inner_dim
    self.pos_embed = PatchEmbed(cfg, rngs)
    self.time_text_embed = TimeTextEmbed(cfg, rngs)
    self.context_embedder = _dense(cfg.joint_attention_dim, cfg.caption_projection_dim, ('cross_embed', 'embed'),
                                   rngs, cfg.dtype, cfg)
    self.dual_blocks = nnx.data(None)
    if cfg.num_dual:
      self.dual_blocks = _stacked_blocks(cfg, cfg.num_dual, rngs, dual=True)
    self.joint_blocks = nnx.data(None)
    if cfg.num_joint:
      self.joint_blocks = _stacked_blocks(cfg, cfg.num_joint, rngs, dual=False)
    self.last_block = JointBlock(cfg, rngs, dual=cfg.last_dual, context_pre_only=True)
    self.norm_out = AdaLNModulation(cfg, 2, rngs)
    p = cfg.patch_size
    self.proj_out = _dense(d, p * p * cfg.out_channels, ('embed', None), rngs, jnp.float32, cfg)

  def _scan(self, blocks, x, c, temb_act):
    """Runs a stacked block module over the (image, text) residuals (`layers.scan_blocks`)."""
    if blocks is None:
      return x, c

    def body(block, carry):
      return block(carry[0], carry[1], temb_act)

    return layers.scan_blocks(body, blocks, (x, c), self.config.remat_policy)

  def __call__(self, x, timestep, encoder_hidden_states, pooled_projections):
    """Velocity prediction of SD3.

    x (B, C, H, W) latents (H, W multiples of patch_size, H/p and W/p <= pos_embed_max_size);
    timestep (B,) on diffusers' 0..1000 scale (sigma * 1000); encoder_hidden_states (B, L,
    joint_attention_dim); pooled_projections (B, pooled_projection_dim). Returns (B, out_channels, H, W)
    in x.dtype.
    """
    cfg = self.config
    b, _, h, w = x.shape
    p = cfg.patch_size
    if h % p or w % p:
      raise ValueError(f'latent {h} x {w} is not a multiple of patch_size={p}')
    img = constrain(self.pos_embed(x), IMAGE_NAMES)
    temb_act = jax.nn.silu(self.time_text_embed(timestep, pooled_projections))
    txt = self.context_embedder(encoder_hidden_states.astype(cfg.dtype)).astype(jnp.float32)
    txt = constrain(txt, TEXT_NAMES)
    img, txt = self._scan(self.dual_blocks, img, txt, temb_act)
    img, txt = self._scan(self.joint_blocks, img, txt, temb_act)
    img, _ = layers.remat(lambda block, a, c: block(a, c, temb_act), cfg.remat_policy)(self.last_block, img, txt)
    scale, shift = self.norm_out(temb_act)
    out = self.proj_out(layer_norm(img, NORM_EPS) * (1 + scale) + shift)     # (B, S, p*p*C) as (p, q, c)
    out = unpatchify(out.reshape(b, 1, h // p, w // p, -1), (1, p, p), cfg.out_channels)
    return out[:, :, 0].astype(x.dtype)


def forward_flops(cfg, latent_hw=(128, 128), text_tokens=333):
  """Analytic FLOPs (2 x multiply-accumulates) of one forward of one sample: (image tokens S, {part: FLOPs}).

  latent_hw: latent (H, W) (default 128 x 128, a 1024 px image); text_tokens: L (333 = 77 CLIP + 256 T5).
  Parts: 'linear': the token-wise projections of the blocks (image q/k/v/out and MLP 12 D^2 per token and
  block, plus 4 D^2 for attn2 in dual blocks; text add_q/k/v, to_add_out and MLP 12 D^2 per token, the
  last block's 3 D^2); 'attention': q k^T and p v, 2 (S+L)^2 D per block, plus 2 S^2 D per attn2;
  'embed': patch embedding, context_embedder and proj_out; 'other': the adaLN modulations and the
  timestep/pooled embedders (per sample, not per token). Elementwise work (norms, softmax) is left out.
  """
  d, p = cfg.inner_dim, cfg.patch_size
  s = (latent_hw[0] // p) * (latent_hw[1] // p)
  l = text_tokens
  dual = len(cfg.dual_attention_layers)
  n = cfg.num_layers
  linear = n * 12 * d * d * s + dual * 4 * d * d * s + (n - 1) * 12 * d * d * l + 3 * d * d * l
  attention = n * 2 * (s + l) ** 2 * d + dual * 2 * s * s * d
  embed = s * cfg.in_channels * p * p * d + l * cfg.joint_attention_dim * d + s * d * p * p * cfg.out_channels
  modulation = (n * 6 + dual * 3 + (n - 1) * 6 + 2 + 2) * d * d
  other = modulation + TIME_FREQ_DIM * d + d * d + cfg.pooled_projection_dim * d + d * d
  parts = dict(linear=2 * linear, attention=2 * attention, embed=2 * embed, other=2 * other)
  return s, parts


def abstract_model(cfg):
  """The model from nnx.eval_shape (ShapeDtypeStructs, nothing allocated)."""
  return nnx.eval_shape(lambda: MMDiT(cfg, rngs=nnx.Rngs(0)))


def num_params(cfg):
  """Number of parameters (nnx.Param elements) of MMDiT(cfg), counted on jax.eval_shape shapes."""
  pure = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(pure))
