"""The Wan2.1 causal video VAE in Flax NNX, shared by the families that use it: Wan2.1 ('wan',
models/wan/family.py) and Cosmos-Predict2.5 ('cosmos', whose tokenizer it is; models/cosmos/family.py).
It lives here rather than in a family's folder because families import no other family's folder.
`video_vae_convert` reads its weights (diffusers `AutoencoderKLWan`, or the original `Wan2.1_VAE.pth` /
Cosmos `tokenizer.pth` names).

Public layout follows diffusers `AutoencoderKLWan`: video (B, 3, F, H, W) in [-1, 1] with F = 1 + 4k,
latent (B, Z, 1 + k, H/8, W/8) with Z = 16 for the released weights. Internally every tensor is
channels-last (B, T, H, W, C); conv kernels are (kt, kh, kw, Cin, Cout).

Causality: a k3 causal conv sees 2 past frames (zeros before frame 0) and none from the future.
Instead of padding, each causal conv concatenates a "previous context" of 2 frames in front of its
input. That context is either zeros (start of the video) or the last 2 input frames of the previous
chunk, held in a `FeatCache` (one entry per cached conv, in call order, like diffusers' feat_cache).

Chunked processing (the reference's memory-bounded path, `chunked=True`, the default):
- encode: frame 0 alone, then chunks of `chunk_frames` (4) frames -> one latent frame per 4 frames;
- decode: latent frame 0 alone (-> 1 frame), then one latent frame at a time (-> 4 frames each).
The first chunk runs as plain Python (its cache is built from scratch); after it every cache entry has
a fixed shape, so the remaining chunks run under `jax.lax.scan` with the cache as the carry: compile
cost is two chunk traces whatever the video length, and activations are bounded by one chunk.
`chunked=False` runs the whole sequence at once; it is mathematically identical (see tests).

Special temporal cases (mirroring the reference):
- downsample3d: the first frame passes through; later outputs k use frames (2k-2, 2k-1, 2k).
- upsample3d: the first frame is not time-upsampled and is not context; the rest doubles (T -> 1+2(T-1)).
"""
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

WAN21_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
  """Hyper-parameters of the Wan2.1 VAE (diffusers `AutoencoderKLWan` names).

  temperal_downsample: one flag per downsampling stage (len(dim_mult) - 1); the decoder upsamples
    with the reversed flags. dtype: compute dtype of convs/attention (norms always run in float32).
  """
  base_dim: int = 96
  z_dim: int = 16
  dim_mult: tuple[int, ...] = (1, 2, 4, 4)
  num_res_blocks: int = 2
  temperal_downsample: tuple[bool, ...] = (False, True, True)
  latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
  latents_std: tuple[float, ...] = WAN21_LATENTS_STD
  in_channels: int = 3
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @property
  def spatial_factor(self):
    return 2 ** (len(self.dim_mult) - 1)

  @property
  def temporal_factor(self):
    return 2 ** sum(bool(f) for f in self.temperal_downsample)


def wan21(**overrides):
  """The released Wan2.1 VAE (about 127M parameters)."""
  return WanVAEConfig(**overrides)


def tiny(**overrides):
  """A tiny test config with the same 8x8 spatial / 4x temporal compression."""
  kw = dict(base_dim=8, z_dim=4, dim_mult=(1, 2, 2, 2), num_res_blocks=1,
            latents_mean=WAN21_LATENTS_MEAN[:4], latents_std=WAN21_LATENTS_STD[:4])
  kw.update(overrides)
  return WanVAEConfig(**kw)


class FeatCache:
  """Past-frame context of every cached causal conv, consumed and refilled in call order.

  prev: list of (B, n, H, W, C) arrays from the previous chunk, or None (start of the video: zeros).
  """

  def __init__(self, prev=None):
    self.prev = prev
    self.new = []

  def get(self):
    return None if self.prev is None else self.prev[len(self.new)]

  def put(self, value):
    self.new.append(value)


def _uniform(rngs, shape, fan_in, dtype):
  bound = 1.0 / math.sqrt(fan_in)
  return jax.random.uniform(rngs.params(), shape, dtype, -bound, bound)


class CausalConv3d(nnx.Module):
  """Conv over (T, H, W) with `context` past frames of time padding and symmetric spatial padding.

  kernel (kt, kh, kw, Cin, Cout), bias (Cout,). x (B, T, H, W, Cin) -> (B, T', H', W', Cout).
  """

  def __init__(self, cin, cout, kernel, *, stride=(1, 1, 1), padding=(0, 0, 0), dtype=jnp.float32,
               param_dtype=jnp.float32, rngs):
    kernel = (kernel,) * 3 if isinstance(kernel, int) else tuple(kernel)
    padding = (padding,) * 3 if isinstance(padding, int) else tuple(padding)
    fan_in = cin * math.prod(kernel)
    self.kernel = nnx.Param(_uniform(rngs, (*kernel, cin, cout), fan_in, param_dtype))
    self.bias = nnx.Param(_uniform(rngs, (cout,), fan_in, param_dtype))
    self.stride = tuple(stride)
    self.spatial_pad = padding[1:]
    self.context = 2 * padding[0]
    self.dtype = dtype

  def conv(self, x):
    """Valid in time (the caller supplies the past context), padded in space."""
    pad = [(0, 0)] + [(p, p) for p in self.spatial_pad]
    y = jax.lax.conv_general_dilated(
        x.astype(self.dtype), self.kernel[...].astype(self.dtype), self.stride, pad,
        dimension_numbers=('NDHWC', 'DHWIO', 'NDHWC'))
    return y + self.bias[...].astype(self.dtype)

  def __call__(self, x, cache=None):
    """x (B, T, H, W, C). With a cache, prepends the cached context and stores the new one."""
    if self.context == 0:
      return self.conv(x)
    prev = cache.get() if cache is not None else None
    if prev is None:
      prev = jnp.zeros((x.shape[0], self.context, *x.shape[2:]), x.dtype)
    xp = jnp.concatenate([prev.astype(x.dtype), x], axis=1)
    if cache is not None:
      cache.put(xp[:, -self.context:])
    return self.conv(xp)


class SpatialConv(nnx.Module):
  """Per-frame 2-D conv. kernel (kh, kw, Cin, Cout). x (N, H, W, Cin) -> (N, H', W', Cout)."""

  def __init__(self, cin, cout, k, *, stride=1, padding=((0, 0), (0, 0)), dtype=jnp.float32,
               param_dtype=jnp.float32, rngs):
    self.kernel = nnx.Param(_uniform(rngs, (k, k, cin, cout), cin * k * k, param_dtype))
    self.bias = nnx.Param(_uniform(rngs, (cout,), cin * k * k, param_dtype))
    self.stride, self.padding, self.dtype = (stride, stride), padding, dtype

  def __call__(self, x):
    y = jax.lax.conv_general_dilated(
        x.astype(self.dtype), self.kernel[...].astype(self.dtype), self.stride, self.padding,
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    return y + self.bias[...].astype(self.dtype)


class RMSNorm(nnx.Module):
  """x / max(||x||_C, 1e-12) * sqrt(C) * gamma over the channel axis (last), in float32."""

  def __init__(self, dim, param_dtype=jnp.float32):
    self.gamma = nnx.Param(jnp.ones((dim,), param_dtype))
    self.scale = dim ** 0.5

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True))
    y = xf / jnp.maximum(norm, 1e-12) * self.scale * self.gamma[...].astype(jnp.float32)
    return y.astype(x.dtype)


class Linear(nnx.Module):
  """1x1 conv as a dense layer: kernel (Cin, Cout), bias (Cout,)."""

  def __init__(self, cin, cout, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs):
    self.kernel = nnx.Param(_uniform(rngs, (cin, cout), cin, param_dtype))
    self.bias = nnx.Param(_uniform(rngs, (cout,), cin, param_dtype))
    self.dtype = dtype

  def __call__(self, x):
    return x.astype(self.dtype) @ self.kernel[...].astype(self.dtype) + self.bias[...].astype(self.dtype)


class ResidualBlock(nnx.Module):
  """RMS, SiLU, causal conv k3, RMS, SiLU, causal conv k3, plus a 1x1x1 shortcut if Cin != Cout."""

  def __init__(self, cin, cout, *, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm1 = RMSNorm(cin, param_dtype)
    self.conv1 = CausalConv3d(cin, cout, 3, padding=1, **kw)
    self.norm2 = RMSNorm(cout, param_dtype)
    self.conv2 = CausalConv3d(cout, cout, 3, padding=1, **kw)
    self.conv_shortcut = CausalConv3d(cin, cout, 1, **kw) if cin != cout else None

  def __call__(self, x, cache=None):
    """x (B, T, H, W, Cin) -> (B, T, H, W, Cout)."""
    h = x if self.conv_shortcut is None else self.conv_shortcut(x)
    x = self.conv1(jax.nn.silu(self.norm1(x)), cache)
    x = self.conv2(jax.nn.silu(self.norm2(x)), cache)
    return x + h


class AttentionBlock(nnx.Module):
  """Single-head self-attention over the H*W pixels of each frame, with a residual."""

  def __init__(self, dim, *, dtype, param_dtype, rngs):
    self.norm = RMSNorm(dim, param_dtype)
    self.to_qkv = Linear(dim, 3 * dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.proj = Linear(dim, dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x):
    """x (B, T, H, W, C) -> same."""
    b, t, h, w, c = x.shape
    qkv = self.to_qkv(self.norm(x)).reshape(b * t, h * w, 1, 3 * c)
    q, k, v = jnp.split(qkv, 3, axis=-1)
    y = jax.nn.dot_product_attention(q, k, v).reshape(b, t, h, w, c)
    return self.proj(y) + x


class MidBlock(nnx.Module):
  """Res, Attn, Res at constant width."""

  def __init__(self, dim, *, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.resnets = nnx.List([ResidualBlock(dim, dim, **kw), ResidualBlock(dim, dim, **kw)])
    self.attentions = nnx.List([AttentionBlock(dim, **kw)])

  def __call__(self, x, cache=None):
    x = self.resnets[0](x, cache)
    return self.resnets[1](self.attentions[0](x), cache)


class Resample(nnx.Module):
  """Spatial (and optionally temporal) 2x down/up-sampling. mode in {up,down}sample{2,3}d.

  downsample: zero-pad right/bottom 1, conv k3 s2 (C -> C); 3d adds a causal time conv (3,1,1) s2.
  upsample: nearest x2, conv k3 (C -> out_dim); 3d first doubles frames with a time conv C -> 2C.
  """

  def __init__(self, dim, mode, out_dim=None, *, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.mode = mode
    if mode.startswith('up'):
      self.resample = SpatialConv(dim, out_dim or dim // 2, 3, padding=((1, 1), (1, 1)), **kw)
    else:
      self.resample = SpatialConv(dim, dim, 3, stride=2, padding=((0, 1), (0, 1)), **kw)
    time_conv = None
    if mode == 'upsample3d':
      time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0), **kw)
    elif mode == 'downsample3d':
      time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1), **kw)
    self.time_conv = nnx.data(time_conv)

  def _time_up(self, x, cache):
    """x (B, T, H, W, C) -> (B, 2T, H, W, C): channels [0:C] -> frame 2i, [C:2C] -> frame 2i+1."""
    b, t, h, w, c = x.shape
    y = self.time_conv(x, cache).reshape(b, t, h, w, 2, c)
    return jnp.moveaxis(y, 4, 2).reshape(b, 2 * t, h, w, c)

  def _up3d(self, x, cache, first):
    if not first:
      return self._time_up(x, cache)
    if x.shape[1] > 1:  # whole-sequence path: frame 0 passes through, the rest with zero context
      return jnp.concatenate([x[:, :1], self._time_up(x[:, 1:], cache)], axis=1)
    if cache is not None:  # first chunk: no context consumed, store zero context for the next chunk
      cache.put(jnp.zeros((x.shape[0], 2, *x.shape[2:]), x.dtype))
    return x

  def _down3d(self, x, cache, first):
    prev = cache.get() if (cache is not None and not first) else None
    if cache is not None:
      cache.put(x[:, -1:])
    if first:  # frame 0 passes through; later output k uses frames (2k-2, 2k-1, 2k)
      rest = self.time_conv.conv(x) if x.shape[1] >= 3 else x[:, :0]
      return jnp.concatenate([x[:, :1], rest], axis=1)
    return self.time_conv.conv(jnp.concatenate([prev.astype(x.dtype), x], axis=1))

  def _spatial(self, x):
    b, t = x.shape[:2]
    y = x.reshape(b * t, *x.shape[2:])
    if self.mode.startswith('up'):
      y = jnp.repeat(jnp.repeat(y, 2, axis=1), 2, axis=2)
    y = self.resample(y)
    return y.reshape(b, t, *y.shape[1:])

  def __call__(self, x, cache=None, first=True):
    """x (B, T, H, W, C). first: this call contains frame 0 of the video."""
    if self.mode == 'upsample3d':
      x = self._up3d(x, cache, first)
    x = self._spatial(x)
    if self.mode == 'downsample3d':
      x = self._down3d(x, cache, first)
    return x


def _blocks_call(blocks, x, cache, first):
  for blk in blocks:
    x = blk(x, cache, first) if isinstance(blk, Resample) else blk(x, cache)
  return x


class Encoder3d(nnx.Module):
  """(B, T, H, W, 3) -> (B, T', H/s, W/s, 2Z): conv_in, down_blocks, mid_block, norm_out, conv_out."""

  def __init__(self, cfg: WanVAEConfig, *, rngs):
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
    self.conv_in = CausalConv3d(cfg.in_channels, dims[0], 3, padding=1, **kw)
    blocks = []
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
      for _ in range(cfg.num_res_blocks):
        blocks.append(ResidualBlock(cin, cout, **kw))
        cin = cout
      if i != len(cfg.dim_mult) - 1:
        mode = 'downsample3d' if cfg.temperal_downsample[i] else 'downsample2d'
        blocks.append(Resample(cout, mode, **kw))
    self.down_blocks = nnx.List(blocks)
    self.mid_block = MidBlock(dims[-1], **kw)
    self.norm_out = RMSNorm(dims[-1], cfg.param_dtype)
    self.conv_out = CausalConv3d(dims[-1], 2 * cfg.z_dim, 3, padding=1, **kw)

  def __call__(self, x, cache=None, first=True):
    x = self.conv_in(x, cache)
    x = _blocks_call(self.down_blocks, x, cache, first)
    x = self.mid_block(x, cache)
    return self.conv_out(jax.nn.silu(self.norm_out(x)), cache)


class UpBlock(nnx.Module):
  """num_res_blocks + 1 residual blocks, then an optional Resample (halving the channels)."""

  def __init__(self, cin, cout, num_res_blocks, mode, *, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.resnets = nnx.List([ResidualBlock(cin if j == 0 else cout, cout, **kw)
                             for j in range(num_res_blocks + 1)])
    self.upsampler = Resample(cout, mode, **kw) if mode else None

  def __call__(self, x, cache=None, first=True):
    for blk in self.resnets:
      x = blk(x, cache)
    return x if self.upsampler is None else self.upsampler(x, cache, first)


class Decoder3d(nnx.Module):
  """(B, T, h, w, Z) -> (B, T'', h*s, w*s, 3): conv_in, mid_block, up_blocks, norm_out, conv_out."""

  def __init__(self, cfg: WanVAEConfig, *, rngs):
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    mult = cfg.dim_mult
    dims = [cfg.base_dim * u for u in (mult[-1], *mult[::-1])]
    temperal_upsample = tuple(cfg.temperal_downsample)[::-1]
    self.conv_in = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1, **kw)
    self.mid_block = MidBlock(dims[0], **kw)
    blocks = []
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
      cin = cin // 2 if i > 0 else cin
      mode = None
      if i != len(mult) - 1:
        mode = 'upsample3d' if temperal_upsample[i] else 'upsample2d'
      blocks.append(UpBlock(cin, cout, cfg.num_res_blocks, mode, **kw))
    self.up_blocks = nnx.List(blocks)
    self.norm_out = RMSNorm(dims[-1], cfg.param_dtype)
    self.conv_out = CausalConv3d(dims[-1], cfg.in_channels, 3, padding=1, **kw)

  def __call__(self, x, cache=None, first=True):
    x = self.mid_block(self.conv_in(x, cache), cache)
    for blk in self.up_blocks:
      x = blk(x, cache, first)
    return self.conv_out(jax.nn.silu(self.norm_out(x)), cache)


def _run_chunked(fn, x, first_len, chunk):
  """Runs fn(x_chunk, cache, first) over time chunks of x (B, T, ...): first_len frames, then `chunk`.

  The first chunk builds the cache; the rest run under lax.scan with the cache as carry.
  Returns the per-chunk outputs concatenated along time.
  """
  cache = FeatCache(None)
  y0 = fn(x[:, :first_len], cache, True)
  rest = x[:, first_len:]
  if rest.shape[1] == 0:
    return y0
  n = rest.shape[1] // chunk
  xs = jnp.moveaxis(rest.reshape(rest.shape[0], n, chunk, *rest.shape[2:]), 1, 0)

  def body(prev, xc):
    c = FeatCache(prev)
    y = fn(xc, c, False)
    return c.new, y

  _, ys = jax.lax.scan(body, cache.new, xs)  # ys (n, B, t, ...)
  ys = jnp.moveaxis(ys, 0, 1)
  ys = ys.reshape(ys.shape[0], -1, *ys.shape[3:])
  return jnp.concatenate([y0, ys.astype(y0.dtype)], axis=1)


class WanVAE(nnx.Module):
  """Wan2.1 VAE: encoder, quant_conv (1x1x1, 2Z -> 2Z), post_quant_conv (1x1x1, Z -> Z), decoder."""

  def __init__(self, config: WanVAEConfig, *, rngs: nnx.Rngs):
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    self.config = config
    self.encoder = Encoder3d(config, rngs=rngs)
    self.quant_conv = CausalConv3d(2 * config.z_dim, 2 * config.z_dim, 1, **kw)
    self.post_quant_conv = CausalConv3d(config.z_dim, config.z_dim, 1, **kw)
    self.decoder = Decoder3d(config, rngs=rngs)

  def encode(self, video, *, chunked=True, chunk_frames=4):
    """video (B, 3, F, H, W) in [-1, 1], F = 1 + chunk_frames*k -> posterior mean (B, Z, 1+F//4', H/8, W/8).

    chunk_frames must be a multiple of the temporal factor (4); the reference uses 4, Cosmos 16.
    """
    f, tf = video.shape[2], self.config.temporal_factor
    if (f - 1) % chunk_frames or chunk_frames % tf:
      raise ValueError(f'need F = 1 + {chunk_frames}k frames (chunk a multiple of {tf}), got F={f}')
    x = jnp.transpose(video, (0, 2, 3, 4, 1))
    if chunked:
      h = _run_chunked(self.encoder, x, 1, chunk_frames)
    else:
      h = self.encoder(x)
    mean = self.quant_conv(h)[..., :self.config.z_dim]
    return jnp.transpose(mean, (0, 4, 1, 2, 3))

  def decode(self, latent, *, chunked=True):
    """latent (B, Z, T, h, w) -> video (B, 3, 1 + 4(T-1), 8h, 8w) clipped to [-1, 1]."""
    z = self.post_quant_conv(jnp.transpose(latent, (0, 2, 3, 4, 1)))
    if chunked:
      x = _run_chunked(self.decoder, z, 1, 1)
    else:
      x = self.decoder(z)
    return jnp.transpose(jnp.clip(x, -1.0, 1.0), (0, 4, 1, 2, 3))

  def _stats(self, ndim):
    shape = (1, -1) + (1,) * (ndim - 2)
    mean = jnp.asarray(self.config.latents_mean, jnp.float32).reshape(shape)
    std = jnp.asarray(self.config.latents_std, jnp.float32).reshape(shape)
    return mean, std

  def normalize_latents(self, mu):
    """(mu - mean_c) / std_c on the channel axis 1 of (B, Z, T, h, w)."""
    mean, std = self._stats(mu.ndim)
    return ((mu - mean) / std).astype(mu.dtype)

  def denormalize_latents(self, z):
    """z * std_c + mean_c, the inverse of normalize_latents."""
    mean, std = self._stats(z.ndim)
    return (z * std + mean).astype(z.dtype)
