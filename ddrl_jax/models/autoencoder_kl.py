"""diffusers' `AutoencoderKL` (the 2-D image VAE of SD3 / SD3.5 and FLUX.1) in Flax NNX, shared by the families.

One class for every family that decodes with an `AutoencoderKL`: the families differ only in the numbers
of its config.json, so those live here as named presets of `AutoencoderKLConfig` (`sd35`, `flux1`, the test
size `tiny`) rather than in each family's folder; a family picks a preset (its `VAE_PRESETS`) and its
converter name. `autoencoder_kl_convert` reads the diffusers weights.

Public layout is channel-first like diffusers and the rest of ddrl_jax: images (B, 3, H, W) in [-1, 1],
latents (B, Z, H/8, W/8) (Z = latent_channels, 16 for SD3 and FLUX.1). Inside, every tensor is
channels-last (B, H, W, C) and conv kernels are (kh, kw, Cin, Cout) (`nnx.Conv`).

Architecture (diffusers 0.39 `Encoder` / `Decoder` of `models/autoencoders/vae.py`):
- encoder: conv_in k3 -> down_blocks[i] (layers_per_block ResNets, then, except the last block, a
  downsampler: zero-pad right/bottom by 1, conv k3 stride 2) -> mid_block (ResNet, attention, ResNet)
  -> GroupNorm, SiLU, conv_out k3 -> 2 * latent channels (posterior mean, log-variance);
- decoder: conv_in k3 -> mid_block -> up_blocks[i] (layers_per_block + 1 ResNets on the reversed
  widths, then, except the last block, nearest x2 and conv k3) -> GroupNorm, SiLU, conv_out k3.
- ResNet: GroupNorm, SiLU, conv k3, GroupNorm, SiLU, conv k3, plus a 1x1 `conv_shortcut` when the width
  changes. Every GroupNorm has eps 1e-6 and runs in float32.
- mid-block attention: one head over the H*W pixels: GroupNorm, `to_q/to_k/to_v/to_out` Dense layers
  (`layers.Dense`, so LoRA could attach), scale 1/sqrt(C), plus the residual.
SD3.5 and FLUX.1 have no quant_conv / post_quant_conv (1x1 convs around the latent); both switches exist
for the other AutoencoderKL users. The decoder output is not clipped (as diffusers).

Latent convention of the SD3 and FLUX pipelines: z = (mean - shift_factor) * scaling_factor into the
transformer, and latents / scaling_factor + shift_factor back into the decoder (`normalize_latents`,
`denormalize_latents`).

Logical axis names of the parameters (no rule in `parallel.rules.DEFAULT_RULES` yet):
- conv kernels (kh, kw, Cin, Cout): (None, None, 'conv_in', 'conv_out'); conv biases ('conv_out',);
- attention Dense kernels (Cin, Cout): ('conv_in', 'conv_out'); their biases ('conv_out',);
- GroupNorm scale and bias (C,): ('norm',).
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ddrl_jax.models import layers

SD35_SCALING_FACTOR = 1.5305   # stabilityai/stable-diffusion-3.5-* vae/config.json
SD35_SHIFT_FACTOR = 0.0609
FLUX1_SCALING_FACTOR = 0.3611  # black-forest-labs/FLUX.1-dev (and -schnell) vae/config.json
FLUX1_SHIFT_FACTOR = 0.1159
GROUP_NORM_EPS = 1e-6
LOGVAR_RANGE = (-30.0, 20.0)     # diffusers DiagonalGaussianDistribution clamps the log-variance


@dataclasses.dataclass(frozen=True)
class AutoencoderKLConfig:
  """Hyper-parameters of the VAE (diffusers `AutoencoderKL` config names).

  The defaults are the layout SD3.5 and FLUX.1 share (16 latent channels, widths 128-256-512-512, no quant
  convs, mid attention) with SD3.5's latent scaling; the presets below name each released config, and
  `autoencoder_kl_convert.config_from_diffusers` reads any other config.json (with diffusers' own defaults).
  block_out_channels: width of each encoder down block (the decoder uses them reversed); there are
    len(block_out_channels) - 1 down/up samplings, so 8x for 4 blocks.
  dtype: compute dtype of the convs and attention; the GroupNorms always run in float32.
  """
  in_channels: int = 3
  out_channels: int = 3
  latent_channels: int = 16
  block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
  layers_per_block: int = 2
  norm_num_groups: int = 32
  scaling_factor: float = SD35_SCALING_FACTOR
  shift_factor: float = SD35_SHIFT_FACTOR
  use_quant_conv: bool = False
  use_post_quant_conv: bool = False
  mid_block_add_attention: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @property
  def spatial_factor(self):
    return 2 ** (len(self.block_out_channels) - 1)


def sd35(**overrides):
  """The released SD3 / SD3.5 VAE (`stabilityai/stable-diffusion-3.5-*`, vae/config.json): 83.65M parameters."""
  return AutoencoderKLConfig(**overrides)


def flux1(**overrides):
  """The released FLUX.1 VAE (`black-forest-labs/FLUX.1-dev` / `-schnell`, vae/config.json): SD3.5's layout
  and size with FLUX's latent scaling (scaling_factor 0.3611, shift_factor 0.1159)."""
  kw = dict(scaling_factor=FLUX1_SCALING_FACTOR, shift_factor=FLUX1_SHIFT_FACTOR)
  kw.update(overrides)
  return AutoencoderKLConfig(**kw)


def tiny(**overrides):
  """A tiny test config with the SD3 / FLUX switches (16 latent channels, no quant convs, mid attention), 8x,
  and SD3.5's latent scaling."""
  kw = dict(block_out_channels=(8, 16, 32, 32), layers_per_block=1, norm_num_groups=4)
  kw.update(overrides)
  return AutoencoderKLConfig(**kw)


def _conv(cin, cout, k, *, stride=1, padding=None, dtype, param_dtype, rngs):
  """nnx.Conv (B, H, W, Cin) -> (B, H', W', Cout) with a kernel (k, k, Cin, Cout) and torch-style padding."""
  if padding is None:
    padding = ((k // 2, k // 2), (k // 2, k // 2))
  return nnx.Conv(
      cin, cout, (k, k), strides=(stride, stride), padding=padding, dtype=dtype, param_dtype=param_dtype,
      rngs=rngs,
      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None, 'conv_in', 'conv_out'),
                                        eager_sharding=False),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ('conv_out',), eager_sharding=False))


class GroupNorm(nnx.Module):
  """torch.nn.GroupNorm(groups, C, eps, affine=True) on channels-last (B, ..., C), computed in float32."""

  def __init__(self, channels, groups, *, eps=GROUP_NORM_EPS, param_dtype=jnp.float32):
    if channels % groups:
      raise ValueError(f'GroupNorm: {channels} channels do not split into {groups} groups')
    meta = dict(out_sharding=('norm',), eager_sharding=False)
    self.scale = nnx.Param(jnp.ones((channels,), param_dtype), **meta)
    self.bias = nnx.Param(jnp.zeros((channels,), param_dtype), **meta)
    self.groups, self.eps = groups, eps

  def __call__(self, x):
    b, c = x.shape[0], x.shape[-1]
    xf = x.astype(jnp.float32).reshape(b, -1, self.groups, c // self.groups)
    mean = jnp.mean(xf, axis=(1, 3), keepdims=True)
    centered = xf - mean
    var = jnp.mean(jnp.square(centered), axis=(1, 3), keepdims=True)
    y = (centered * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
    y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(x.dtype)


class ResnetBlock(nnx.Module):
  """diffusers ResnetBlock2D without a time embedding: (B, H, W, Cin) -> (B, H, W, Cout)."""

  def __init__(self, cin, cout, groups, *, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm1 = GroupNorm(cin, groups, param_dtype=param_dtype)
    self.conv1 = _conv(cin, cout, 3, **kw)
    self.norm2 = GroupNorm(cout, groups, param_dtype=param_dtype)
    self.conv2 = _conv(cout, cout, 3, **kw)
    self.conv_shortcut = _conv(cin, cout, 1, **kw) if cin != cout else None

  def __call__(self, x):
    h = self.conv1(jax.nn.silu(self.norm1(x)))
    h = self.conv2(jax.nn.silu(self.norm2(h)))
    skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
    return skip.astype(h.dtype) + h


class Attention(nnx.Module):
  """Single-head self-attention over the pixels with GroupNorm in front and a residual: (B, H, W, C) -> same."""

  def __init__(self, dim, groups, *, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, bias=True)
    names = ('conv_in', 'conv_out')
    self.group_norm = GroupNorm(dim, groups, param_dtype=param_dtype)
    self.to_q = layers.dense(dim, dim, names, rngs, **kw)
    self.to_k = layers.dense(dim, dim, names, rngs, **kw)
    self.to_v = layers.dense(dim, dim, names, rngs, **kw)
    self.to_out = layers.dense(dim, dim, names, rngs, **kw)

  def __call__(self, x):
    b, h, w, c = x.shape
    seq = self.group_norm(x).reshape(b, h * w, c)
    q, k, v = (proj(seq).reshape(b, h * w, 1, c) for proj in (self.to_q, self.to_k, self.to_v))
    y = jax.nn.dot_product_attention(q, k, v).reshape(b, h * w, c)
    y = self.to_out(y).reshape(b, h, w, c)
    return y + x.astype(y.dtype)


class MidBlock(nnx.Module):
  """diffusers UNetMidBlock2D of the VAE: ResNet, [attention], ResNet at constant width."""

  def __init__(self, dim, groups, add_attention, *, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.resnets = nnx.List([ResnetBlock(dim, dim, groups, **kw), ResnetBlock(dim, dim, groups, **kw)])
    self.attentions = nnx.List([Attention(dim, groups, **kw)] if add_attention else [])

  def __call__(self, x):
    x = self.resnets[0](x)
    for attn in self.attentions:
      x = attn(x)
    return self.resnets[1](x)


class DownBlock(nnx.Module):
  """diffusers DownEncoderBlock2D: `num_layers` ResNets, then optionally pad (0, 1, 0, 1) + conv k3 s2."""

  def __init__(self, cin, cout, num_layers, groups, add_downsample, *, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.resnets = nnx.List([ResnetBlock(cin if i == 0 else cout, cout, groups, **kw)
                             for i in range(num_layers)])
    self.downsampler = (_conv(cout, cout, 3, stride=2, padding=((0, 1), (0, 1)), **kw)
                        if add_downsample else None)

  def __call__(self, x):
    for resnet in self.resnets:
      x = resnet(x)
    return x if self.downsampler is None else self.downsampler(x)


class UpBlock(nnx.Module):
  """diffusers UpDecoderBlock2D: `num_layers` ResNets, then optionally nearest x2 + conv k3."""

  def __init__(self, cin, cout, num_layers, groups, add_upsample, *, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.resnets = nnx.List([ResnetBlock(cin if i == 0 else cout, cout, groups, **kw)
                             for i in range(num_layers)])
    self.upsampler = _conv(cout, cout, 3, **kw) if add_upsample else None

  def __call__(self, x):
    for resnet in self.resnets:
      x = resnet(x)
    if self.upsampler is None:
      return x
    return self.upsampler(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))


class Encoder(nnx.Module):
  """(B, H, W, in_channels) -> (B, H/s, W/s, 2 * latent_channels): posterior mean and log-variance."""

  def __init__(self, cfg: AutoencoderKLConfig, *, rngs):
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    widths, groups = cfg.block_out_channels, cfg.norm_num_groups
    self.conv_in = _conv(cfg.in_channels, widths[0], 3, **kw)
    self.down_blocks = nnx.List([
        DownBlock(widths[max(i - 1, 0)], w, cfg.layers_per_block, groups, i < len(widths) - 1, **kw)
        for i, w in enumerate(widths)])
    self.mid_block = MidBlock(widths[-1], groups, cfg.mid_block_add_attention, **kw)
    self.conv_norm_out = GroupNorm(widths[-1], groups, param_dtype=cfg.param_dtype)
    self.conv_out = _conv(widths[-1], 2 * cfg.latent_channels, 3, **kw)

  def __call__(self, x):
    x = self.conv_in(x)
    for block in self.down_blocks:
      x = block(x)
    x = self.mid_block(x)
    return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class Decoder(nnx.Module):
  """(B, h, w, latent_channels) -> (B, h*s, w*s, out_channels)."""

  def __init__(self, cfg: AutoencoderKLConfig, *, rngs):
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    widths, groups = tuple(reversed(cfg.block_out_channels)), cfg.norm_num_groups
    self.conv_in = _conv(cfg.latent_channels, widths[0], 3, **kw)
    self.mid_block = MidBlock(widths[0], groups, cfg.mid_block_add_attention, **kw)
    self.up_blocks = nnx.List([
        UpBlock(widths[max(i - 1, 0)], w, cfg.layers_per_block + 1, groups, i < len(widths) - 1, **kw)
        for i, w in enumerate(widths)])
    self.conv_norm_out = GroupNorm(widths[-1], groups, param_dtype=cfg.param_dtype)
    self.conv_out = _conv(widths[-1], cfg.out_channels, 3, **kw)

  def __call__(self, z):
    x = self.mid_block(self.conv_in(z))
    for block in self.up_blocks:
      x = block(x)
    return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


def _to_channels_last(x):
  return jnp.moveaxis(x, 1, -1)


def _to_channels_first(x):
  return jnp.moveaxis(x, -1, 1)


class AutoencoderKL(nnx.Module):
  """diffusers' AutoencoderKL: encoder, [quant_conv 1x1 2Z -> 2Z], [post_quant_conv 1x1 Z -> Z], decoder."""

  def __init__(self, config: AutoencoderKLConfig, *, rngs: nnx.Rngs):
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    z = config.latent_channels
    self.config = config
    self.encoder = Encoder(config, rngs=rngs)
    self.decoder = Decoder(config, rngs=rngs)
    self.quant_conv = _conv(2 * z, 2 * z, 1, **kw) if config.use_quant_conv else None
    self.post_quant_conv = _conv(z, z, 1, **kw) if config.use_post_quant_conv else None

  def posterior(self, images):
    """images (B, C, H, W) in [-1, 1] -> (mean, logvar), each (B, Z, H/s, W/s); logvar clipped to [-30, 20]."""
    s = self.config.spatial_factor
    if images.ndim != 4 or images.shape[2] % s or images.shape[3] % s:
      raise ValueError(f'need images (B, {self.config.in_channels}, H, W) with H, W multiples of {s}, '
                       f'got {images.shape}')
    moments = self.encoder(_to_channels_last(images))
    if self.quant_conv is not None:
      moments = self.quant_conv(moments)
    mean, logvar = jnp.split(_to_channels_first(moments), 2, axis=1)
    return mean, jnp.clip(logvar, *LOGVAR_RANGE)

  def encode(self, images, key=None):
    """images (B, C, H, W) in [-1, 1] -> latents (B, Z, H/s, W/s): the posterior mean, or with a PRNG `key`
    a sample mean + exp(logvar / 2) * N(0, 1) (diffusers `latent_dist.mode()` / `.sample()`)."""
    mean, logvar = self.posterior(images)
    if key is None:
      return mean
    return sample_posterior(mean, logvar, key)

  def decode(self, latents):
    """latents (B, Z, h, w) (un-normalized, i.e. after `denormalize_latents`) -> images (B, C, s*h, s*w),
    unclipped."""
    z = _to_channels_last(latents)
    if self.post_quant_conv is not None:
      z = self.post_quant_conv(z)
    return _to_channels_first(self.decoder(z))

  def normalize_latents(self, z):
    """(z - shift_factor) * scaling_factor: the VAE latent as the transformer sees it."""
    c = self.config
    return ((z - c.shift_factor) * c.scaling_factor).astype(z.dtype)

  def denormalize_latents(self, z):
    """z / scaling_factor + shift_factor, the inverse of normalize_latents (before `decode`)."""
    c = self.config
    return (z / c.scaling_factor + c.shift_factor).astype(z.dtype)


def sample_posterior(mean, logvar, key):
  """mean + exp(logvar / 2) * eps with eps ~ N(0, 1) drawn in float32 from `key`."""
  eps = jax.random.normal(key, mean.shape, jnp.float32)
  return (mean.astype(jnp.float32) + jnp.exp(0.5 * logvar.astype(jnp.float32)) * eps).astype(mean.dtype)


def abstract_model(config):
  """AutoencoderKL(config) from nnx.eval_shape: shapes and logical names, no weights allocated."""
  return nnx.eval_shape(lambda: AutoencoderKL(config, rngs=nnx.Rngs(0)))


def num_params(config):
  """Number of parameters of AutoencoderKL(config), counted on the abstract model."""
  state = nnx.state(abstract_model(config), nnx.Param)
  return sum(int(v.get_value().size) for _, v in nnx.to_flat_state(state))
