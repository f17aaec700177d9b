"""CLIP image rewards in JAX: PickScore, CLIPScore and the LAION aesthetic predictor on the training devices.

The same rewards as `clip_rewards` (PyTorch; read its docstring for the references and scales), computed by a
Flax NNX CLIP (`ClipModel`) whose weights are read from the same local Hugging Face `CLIPModel` folder, with
the image preprocessing on the device, so that they run where there is no GPU for a PyTorch reward pool
(TPU pods), in process or inside a jitted training step:

  pickscore_jax            PickScoreJax: exp(logit_scale) x cos / 26, the processor's PIL-bicubic pixels.
  clipscore_jax            CLIPScoreJax: logits / 100 (the cosine), the tensor antialiased-bilinear pixels.
  clipscore_flowgrpo_jax   CLIPScoreFlowGRPOJax: the same logits / 30.
  laion_aesthetic_jax      LAIONAestheticJax: the aesthetic MLP on the L2-normalised image features of the
                           processor's PIL-bicubic pixels (prompts unused).

Each reward is `reward(samples, prompts) -> (M,) float32 numpy` on host numpy (M, H, W, 3) uint8 images and
M prompt strings (NaN where a score is not finite or an image could not be scored), and exposes the pure
function `reward.scores(params, pixels_uint8, input_ids) -> (M,) float32` with `reward.params` (the placed
parameters) and `reward.tokenize(prompts) -> (M, 77) int32` (the host tokenizer), for use inside a jitted
step: `jax.jit(reward.scores)(reward.params, images, reward.tokenize(prompts))`.

Model (`ClipModel`, NNX; parameter names are transformers' with `weight` -> `kernel` / `scale` /
`embedding`, each encoder's layers stacked on a leading 'layers' axis and run under `nnx.scan`):
  text    token + position embeddings, pre-norm encoder layers under the causal mask, final LayerNorm, the
          row of the end token (transformers 4.57's CLIPTextTransformer: the argmax of input_ids when the
          config's eos_token_id is 2, the original OpenAI configs; else the first position of eos_token_id),
          text_projection.
  vision  patch embedding (the stride-p conv as one matmul over (c, i, j)-ordered patches), class token,
          position embeddings, pre_layrnorm, encoder, post_layernorm of the class row, visual_projection.
  MLP activation by the config's hidden_act (quick_gelu, gelu, gelu_new / gelu_pytorch_tanh). LayerNorms,
  the softmax and the residual stream run in float32; matmuls in `dtype`. Prompts are always padded to 77
  tokens: behind the causal mask the end token's row never reads the padding, so the features equal those
  of the references' shorter padding (PickScore pads to the batch's longest) and one shape compiles.
  Weights: model.safetensors (or its index's shards) or pytorch_model.bin (or its shards, read with torch),
  checked against `nnx.eval_shape` of the model: every parameter filled with its shape, else one line naming
  the missing, unexpected and mis-shaped keys.

Pixels on the device (`device_pixels`, from the folder's CLIPImageProcessor settings; static shapes):
  tensor (CLIPScore)  x / 255, the short side resized by antialiased bilinear (torch's interpolate with
      antialias=True: PIL's triangle filter, its weights built on the host in torch's own float32
      arithmetic and applied as float32 matmuls at HIGHEST precision, width then height), torchvision's
      CenterCrop (offsets rounded half to even), mean / std. Equal to `clip_rewards.tensor_pixels` within
      ~2e-7 of a [0, 1] pixel (< 1e-6 after mean / std; the tests assert 1e-5). jax.image.resize('linear',
      antialias=True) is close but not as close (up to ~3.5e-6 of a pixel when upscaling); the same formula
      in float64 differs from torch by up to ~3e-5 on large downscales (torch's float32 weights).
  pil (PickScore, aesthetic)  PIL's Image.resize(BICUBIC) as the CLIPImageProcessor calls it, reproduced
      bit for bit: PIL's resampling coefficients (Keys a = -0.5, support widened by the downscale factor,
      renormalised at the borders) in its 22-bit fixed point, the horizontal pass then the vertical one,
      each rounded and clipped to uint8 as PIL does, in int32 arithmetic (gathers and integer adds, exact
      on every backend); then the processor's centre crop (offsets floored), rescale and mean / std. The
      tests find the pixels identical to the processor's (0 of every uint8 value differs, random and smooth
      images, down- and upscaling), so the JAX PickScore and aesthetic scores match the torch ones to the
      model's float32 round-off (< 1e-5 relative in the tests) -- this is not an approximation.
      `jax.image.resize(..., 'cubic', antialias=True)` (also Keys a = -0.5) is NOT a substitute: it keeps
      float values and the overshoot that PIL clips after its first pass, differing from PIL by up to
      ~43 / 255 on random images (~1 / 255 on smooth ones) and moving a tiny random CLIP's PickScore by
      1e-3 to 7e-3 relative (2e-4 to 4e-3 absolute on the /26 scale) on random and smooth images at 32 and
      224 pixels (test_jax_image_resize_cubic_is_only_an_approximation prints its numbers, ~1.5e-3).
  `preprocess='host'` (PickScore, aesthetic) runs the CLIPImageProcessor on the host instead and ships
  float pixels (for checks; the device path gives the same pixels).

Sharding: `mesh=` a jax.sharding.Mesh runs the reward on it: the batch split over `data_axis` (a mesh axis
name or a tuple of them; chunks are padded to a multiple of its size) and the parameters replicated, or with
`fsdp_axis=` FSDP-sharded on their model width (logical name 'embed'; a width the axis does not divide
stays replicated). The result equals the one-device result to float round-off (1e-6 in the tests).

Precision: `dtype` 'float32' (default) or 'bfloat16' (parameters and matmuls). With float32 the matmuls are
traced under jax.default_matmul_precision('highest') (`matmul_precision`, default 'highest' for float32,
None: the platform's default, which on TPU multiplies float32 in bfloat16 passes).

jax, flax, numpy, transformers (tokenizer, image-processor settings, config) and safetensors on the host;
torch only for pytorch_model.bin weights and the aesthetic head (.pth); PIL only for preprocess='host'.
"""
import dataclasses
import functools
import json
import logging
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ddrl_jax.models import layers
from ddrl_jax.parallel import plan as plan_lib
from ddrl_jax.parallel import rules as rules_lib
from ddrl_jax.rewards import clip_rewards as cr
from ddrl_jax.rewards import video_common

logger = logging.getLogger(__name__)

MAX_TOKENS = cr.MAX_TOKENS
BASE_NAMES = {'pickscore_jax': 'pickscore', 'clipscore_jax': 'clipscore',
              'clipscore_flowgrpo_jax': 'clipscore_flowgrpo', 'laion_aesthetic_jax': 'laion_aesthetic'}
CheckpointError = cr.CheckpointError
ACTIVATIONS = ('quick_gelu', 'gelu', 'gelu_new', 'gelu_pytorch_tanh')
PRECISION_BITS = 22                          # PIL's 8-bit resampling fixed point (32 - 8 - 2)
PIL_FILTERS = {1: 'lanczos', 2: 'bilinear', 3: 'bicubic'}   # PIL.Image.Resampling values the processor may name


# ------------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class TowerConfig:
  """One CLIP transformer (text or vision): widths, depth, heads, LayerNorm eps, MLP activation."""
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  layer_norm_eps: float = 1e-5
  hidden_act: str = 'quick_gelu'
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @property
  def head_dim(self):
    return self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True)
class ClipConfig:
  """A CLIPModel: the two towers, the text vocabulary / positions / end token, the image and patch size and
  the shared projection width. with_text=False builds the vision tower alone (the aesthetic reward)."""
  text: TowerConfig
  vision: TowerConfig
  vocab_size: int
  max_positions: int
  eos_token_id: int
  image_size: int
  patch_size: int
  projection_dim: int
  num_channels: int = 3
  with_text: bool = True

  @property
  def num_patches(self):
    return (self.image_size // self.patch_size) ** 2


def config_from_hf(hf, source='config.json', dtype=jnp.float32, with_text=True):
  """ClipConfig of a transformers CLIPConfig dict (defaults of the installed transformers filled in).
  ValueError (one line naming `source`) for what this module does not implement."""
  import transformers  # pylint: disable=g-import-not-at-top
  if hf.get('model_type') != 'clip':
    raise ValueError(f"{source}: model_type {hf.get('model_type')!r}, not 'clip'")
  cfg = transformers.CLIPConfig.from_dict(hf)
  t, v = cfg.text_config, cfg.vision_config

  def tower(c, what):
    if c.hidden_act not in ACTIVATIONS:
      raise ValueError(f'{source}: {what} hidden_act {c.hidden_act!r}; implemented: {ACTIVATIONS}')
    if c.hidden_size % c.num_attention_heads:
      raise ValueError(f'{source}: {what} hidden_size {c.hidden_size} is not a multiple of '
                       f'num_attention_heads {c.num_attention_heads}')
    return TowerConfig(int(c.hidden_size), int(c.intermediate_size), int(c.num_hidden_layers),
                       int(c.num_attention_heads), float(c.layer_norm_eps), c.hidden_act, dtype, dtype)

  if v.image_size % v.patch_size:
    raise ValueError(f'{source}: image_size {v.image_size} is not a multiple of patch_size {v.patch_size}')
  return ClipConfig(tower(t, 'text_config'), tower(v, 'vision_config'), int(t.vocab_size),
                    int(t.max_position_embeddings), int(t.eos_token_id), int(v.image_size),
                    int(v.patch_size), int(cfg.projection_dim), int(v.num_channels), with_text)


# ------------------------------------------------------------------------------------------ model
def _param(value, names):
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def activation(name):
  """transformers' ACT2FN[name] for the CLIP activations, in float32."""
  if name == 'quick_gelu':
    return lambda x: x * jax.nn.sigmoid(1.702 * x)
  if name == 'gelu':
    return layers.gelu
  return lambda x: jax.nn.gelu(x, approximate=True)


class LayerNorm(nnx.Module):
  """torch.nn.LayerNorm over the last axis (scale, bias), computed in float32 (two-pass variance)."""

  def __init__(self, dim, eps, param_dtype):
    self.eps = eps
    self.scale = _param(jnp.ones((dim,), param_dtype), ('embed',))
    self.bias = _param(jnp.zeros((dim,), param_dtype), ('embed',))

  def __call__(self, x):
    return layers.layer_norm(x, self.eps) * self.scale[...].astype(jnp.float32) + \
        self.bias[...].astype(jnp.float32)


class Attention(nnx.Module):
  """CLIPAttention: q, k, v, out_proj with biases; softmax(q k^T / sqrt(Hd)) in float32, causal or full."""

  def __init__(self, cfg, rngs):
    d = cfg.hidden_size
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, bias=True)
    self.cfg = cfg
    self.q_proj = layers.dense(d, d, ('embed', 'heads'), rngs, **kw)
    self.k_proj = layers.dense(d, d, ('embed', 'heads'), rngs, **kw)
    self.v_proj = layers.dense(d, d, ('embed', 'heads'), rngs, **kw)
    self.out_proj = layers.dense(d, d, ('heads', 'embed'), rngs, **kw)

  def __call__(self, x, causal):
    b, l, _ = x.shape
    n, hd = self.cfg.num_heads, self.cfg.head_dim
    q, k, v = (p(x).reshape(b, l, n, hd) for p in (self.q_proj, self.k_proj, self.v_proj))
    logits = jnp.einsum('bqnd,bknd->bnqk', q, k, preferred_element_type=jnp.float32) * hd ** -0.5
    if causal:
      logits = jnp.where(jnp.tril(jnp.ones((l, l), bool)), logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum('bnqk,bknd->bqnd', probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return self.out_proj(out.reshape(b, l, n * hd).astype(x.dtype))


class MLP(nnx.Module):
  """fc2(act(fc1(x))), the activation in float32."""

  def __init__(self, cfg, rngs):
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, bias=True)
    self.act = cfg.hidden_act
    self.fc1 = layers.dense(cfg.hidden_size, cfg.intermediate_size, ('embed', 'mlp'), rngs, **kw)
    self.fc2 = layers.dense(cfg.intermediate_size, cfg.hidden_size, ('mlp', 'embed'), rngs, **kw)

  def __call__(self, x):
    h = activation(self.act)(self.fc1(x).astype(jnp.float32))
    return self.fc2(h.astype(x.dtype))


class EncoderLayer(nnx.Module):
  """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x)); x the float32 residual (B, L, D)."""

  def __init__(self, cfg, rngs):
    self.cfg = cfg
    self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, cfg.param_dtype)
    self.self_attn = Attention(cfg, rngs)
    self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, cfg.param_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, causal):
    dtype = self.cfg.dtype
    x = x + self.self_attn(self.layer_norm1(x).astype(dtype), causal).astype(jnp.float32)
    return x + self.mlp(self.layer_norm2(x).astype(dtype)).astype(jnp.float32)


class Encoder(nnx.Module):
  """cfg.num_layers EncoderLayers stacked on a leading 'layers' axis, run under nnx.scan."""

  def __init__(self, cfg, rngs):
    self.layers = layers.stacked(lambda r: EncoderLayer(cfg, r), cfg.num_layers, rngs)

  def __call__(self, x, causal):
    return layers.scan_blocks(lambda layer, carry: layer(carry, causal), self.layers, x, 'none')


def _embed(num, dim, names, param_dtype, rngs):
  init = nnx.with_partitioning(nnx.initializers.normal(0.02), names, eager_sharding=False)
  return nnx.Embed(num, dim, dtype=jnp.float32, param_dtype=param_dtype, embedding_init=init, rngs=rngs)


class TextEmbeddings(nnx.Module):
  def __init__(self, cfg, rngs):
    d, pdt = cfg.text.hidden_size, cfg.text.param_dtype
    self.token_embedding = _embed(cfg.vocab_size, d, ('vocab', 'embed'), pdt, rngs)
    self.position_embedding = _embed(cfg.max_positions, d, (None, 'embed'), pdt, rngs)


class TextTransformer(nnx.Module):
  """CLIPTextTransformer: (B, L) ids -> (B, D) pooled rows (final LayerNorm, the end token's row)."""

  def __init__(self, cfg, rngs):
    self.eos_token_id = cfg.eos_token_id
    self.embeddings = TextEmbeddings(cfg, rngs)
    self.encoder = Encoder(cfg.text, rngs)
    self.final_layer_norm = LayerNorm(cfg.text.hidden_size, cfg.text.layer_norm_eps, cfg.text.param_dtype)

  def __call__(self, input_ids):
    ids = input_ids.astype(jnp.int32)
    e = self.embeddings
    x = e.token_embedding(ids) + e.position_embedding.embedding[...][:ids.shape[1]].astype(jnp.float32)
    x = self.final_layer_norm(self.encoder(x, causal=True))
    if self.eos_token_id == 2:        # transformers: the configs from before its PR #24773
      pos = jnp.argmax(ids, axis=-1)
    else:
      pos = jnp.argmax((ids == self.eos_token_id).astype(jnp.int32), axis=-1)
    return jnp.take_along_axis(x, pos[:, None, None], axis=1)[:, 0]


class VisionEmbeddings(nnx.Module):
  def __init__(self, cfg, rngs):
    v = cfg.vision
    d, pdt = v.hidden_size, v.param_dtype
    self.patch = cfg.patch_size
    self.class_embedding = _param(jnp.zeros((d,), pdt), ('embed',))
    self.patch_embedding = layers.dense(cfg.num_channels * cfg.patch_size ** 2, d, (None, 'embed'), rngs,
                                        dtype=v.dtype, param_dtype=pdt)
    self.position_embedding = _embed(cfg.num_patches + 1, d, (None, 'embed'), pdt, rngs)

  def __call__(self, pixels):
    """pixels (B, S, S, C) -> (B, 1 + (S / p)^2, D) float32."""
    b, h, w, c = pixels.shape
    p = self.patch
    x = pixels.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 2, 4)   # (c, i, j): torch's conv
    x = self.patch_embedding(x.reshape(b, (h // p) * (w // p), c * p * p).astype(self.patch_embedding.dtype))
    cls = jnp.broadcast_to(self.class_embedding[...].astype(jnp.float32), (b, 1, x.shape[-1]))
    x = jnp.concatenate([cls, x.astype(jnp.float32)], axis=1)
    return x + self.position_embedding.embedding[...].astype(jnp.float32)


class VisionTransformer(nnx.Module):
  """CLIPVisionTransformer: (B, S, S, 3) normalised pixels -> (B, D) post_layernorm of the class row."""

  def __init__(self, cfg, rngs):
    v = cfg.vision
    self.embeddings = VisionEmbeddings(cfg, rngs)
    self.pre_layrnorm = LayerNorm(v.hidden_size, v.layer_norm_eps, v.param_dtype)   # transformers' name
    self.encoder = Encoder(v, rngs)
    self.post_layernorm = LayerNorm(v.hidden_size, v.layer_norm_eps, v.param_dtype)

  def __call__(self, pixels):
    x = self.encoder(self.pre_layrnorm(self.embeddings(pixels)), causal=False)
    return self.post_layernorm(x[:, 0])


class ClipModel(nnx.Module):
  """transformers' CLIPModel in NNX: `image_features`, `text_features` (its get_*_features) and
  `pair_logits` (the diagonal of logits_per_image). Without config.with_text, the vision tower alone."""

  def __init__(self, config, *, rngs):
    self.config = config
    self.vision_model = VisionTransformer(config, rngs)
    self.visual_projection = layers.dense(config.vision.hidden_size, config.projection_dim,
                                          ('embed', None), rngs, dtype=config.vision.dtype,
                                          param_dtype=config.vision.param_dtype)
    if config.with_text:
      self.text_model = TextTransformer(config, rngs)
      self.text_projection = layers.dense(config.text.hidden_size, config.projection_dim, ('embed', None),
                                          rngs, dtype=config.text.dtype, param_dtype=config.text.param_dtype)
      self.logit_scale = nnx.Param(jnp.asarray(math.log(100.0), jnp.float32))

  def image_features(self, pixels):
    """(B, S, S, 3) normalised float pixels -> (B, projection_dim) float32."""
    s = self.config.image_size
    if tuple(pixels.shape[1:]) != (s, s, self.config.num_channels):
      raise ValueError(f'CLIP vision model takes (B, {s}, {s}, {self.config.num_channels}) pixels, got '
                       f'{tuple(pixels.shape)}')
    pooled = self.vision_model(pixels.astype(self.config.vision.dtype))
    return self.visual_projection(pooled.astype(self.config.vision.dtype)).astype(jnp.float32)

  def text_features(self, input_ids):
    """(B, L <= max_positions) int ids -> (B, projection_dim) float32."""
    pooled = self.text_model(input_ids)
    return self.text_projection(pooled.astype(self.config.text.dtype)).astype(jnp.float32)

  def pair_logits(self, pixels, input_ids):
    """(B,) exp(logit_scale) * cos(image feature i, text feature i), float32."""
    scale = jnp.exp(self.logit_scale[...].astype(jnp.float32))
    return scale * jnp.sum(unit(self.image_features(pixels)) * unit(self.text_features(input_ids)), axis=-1)


def unit(x):
  """(B, D) float32 rows divided by their L2 norms."""
  x = x.astype(jnp.float32)
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def abstract_state(config):
  """(graphdef, abstract nnx.State) of ClipModel(config); nothing allocated."""
  return nnx.split(nnx.eval_shape(lambda: ClipModel(config, rngs=nnx.Rngs(0))))


def flat_shapes(config):
  """{NNX path tuple: ShapeDtypeStruct} of every parameter of ClipModel(config)."""
  _, state = abstract_state(config)
  return {tuple(str(p) for p in path): v.get_value() for path, v in nnx.to_flat_state(state)}


# ------------------------------------------------------------------------------------------ loading
_SKIPPED = re.compile(r'.*position_ids')                                      # buffers of older files
_TEXT_KEYS = re.compile(r'(text_model\.|text_projection\.|logit_scale$).*')   # skipped without the text tower
_LAYER = re.compile(r'(.*\.encoder\.layers)\.(\d+)\.(.*)')


def _classify(key, expected):
  """A checkpoint key -> (NNX path, layer index or None, transform) or None when the model has no such
  parameter. transform: 'T' (Linear weight -> kernel), 'conv' (patch conv -> kernel), None (as is)."""
  idx = None
  m = _LAYER.fullmatch(key)
  if m:
    key, idx = f'{m.group(1)}.{m.group(3)}', int(m.group(2))
  parts = tuple(key.split('.'))
  if parts in expected:                         # biases, class_embedding, logit_scale: as they are
    return parts, idx, None
  head = parts[:-1]
  if parts[-1] == 'weight':
    for leaf, transform in (('kernel', 'T'), ('scale', None), ('embedding', None)):
      if head + (leaf,) in expected:
        return head + (leaf,), idx, ('conv' if head[-1] == 'patch_embedding' else transform)
  return None


def _short(items, limit=3):
  items = list(items)
  more = f', +{len(items) - limit} more' if len(items) > limit else ''
  return f'{len(items)} [{", ".join(items[:limit])}{more}]'


def _hf_name(path, idx):
  leaf = {'kernel': 'weight', 'scale': 'weight', 'embedding': 'weight'}.get(path[-1], path[-1])
  name = '.'.join(path[:-1] + (leaf,)) if path[-1] in ('kernel', 'scale', 'embedding') else '.'.join(path)
  return name.replace('encoder.layers.', f'encoder.layers.{idx}.') if idx is not None else name


def weight_tensors(folder):
  """Yields (file, key, loader) of every tensor in a transformers folder's weights: the safetensors index's
  shards, model.safetensors, the pytorch_model.bin index's shards or pytorch_model.bin (torch.load with
  weights_only). loader() -> float32 numpy. FileNotFoundError / ValueError in one line."""
  def shards(index):
    with open(index) as f:
      names = sorted(set(json.load(f)['weight_map'].values()))
    files = [os.path.join(folder, n) for n in names]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
      raise FileNotFoundError(f'{missing[0]}: shard listed in {index} is missing')
    return files

  st_index, pt_index = (os.path.join(folder, n) for n in ('model.safetensors.index.json',
                                                          'pytorch_model.bin.index.json'))
  if os.path.isfile(st_index) or os.path.isfile(os.path.join(folder, 'model.safetensors')):
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    for file in shards(st_index) if os.path.isfile(st_index) else [os.path.join(folder, 'model.safetensors')]:
      try:
        with safe_open(file, framework='np') as f:
          for key in f.keys():
            yield file, key, functools.partial(_st_tensor, file, key, f)
      except (OSError, ValueError, TypeError) as e:
        raise ValueError(f'{file}: cannot read safetensors ({video_common.describe(e)})') from None
    return
  files = shards(pt_index) if os.path.isfile(pt_index) else [os.path.join(folder, 'pytorch_model.bin')]
  import torch  # pylint: disable=g-import-not-at-top
  for file in files:
    state = torch.load(file, map_location='cpu', weights_only=True)
    for key, value in state.items():
      yield file, key, functools.partial(lambda v: v.float().numpy(), value)


def _st_tensor(file, key, handle):
  try:
    return np.asarray(handle.get_tensor(key), np.float32)
  except (TypeError, ValueError):            # bfloat16 and other dtypes numpy lacks: through torch
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    with safe_open(file, framework='pt') as f:
      return f.get_tensor(key).float().numpy()


def load_params(folder, config):
  """{NNX path: numpy in the config's param dtype} of ClipModel(config) from a transformers CLIPModel folder.

  Linear weights are transposed to (in, out) kernels, the patch conv flattened to a (C p p, D) kernel, the
  encoder layers stacked. ValueError in one line listing the missing, unexpected and mis-shaped keys."""
  expected = flat_shapes(config)
  dtype = np.dtype(config.vision.param_dtype)
  out = {path: np.zeros(spec.shape, dtype) for path, spec in expected.items()}
  filled = {path: set() for path in expected}
  unexpected, misshaped = [], []
  for file, key, load in weight_tensors(folder):
    if _SKIPPED.fullmatch(key) or (not config.with_text and _TEXT_KEYS.fullmatch(key)):
      continue
    hit = _classify(key, expected)
    if hit is None:
      unexpected.append(key)
      continue
    path, idx, transform = hit
    want = tuple(expected[path].shape[1:] if idx is not None else expected[path].shape)
    if idx is not None and idx >= expected[path].shape[0]:
      unexpected.append(key)
      continue
    value = load()
    shape = tuple(value.shape)
    if transform == 'conv':
      value = value.reshape(value.shape[0], -1) if value.ndim == 4 else value
    if transform in ('T', 'conv') and value.ndim == 2:
      value = value.T
    if tuple(value.shape) != want:
      if transform == 'conv':
        p = config.patch_size
        want = (want[1], config.num_channels, p, p)
      elif transform == 'T':
        want = want[::-1]
      misshaped.append(f'{key} in {os.path.basename(file)}: {shape}, the config wants {want}')
      filled[path].add(idx)               # reported as mis-shaped, not also as missing
      continue
    if idx is None:
      out[path][...] = value
    else:
      out[path][idx] = value
    filled[path].add(idx)
  missing = []
  for path, spec in expected.items():
    wanted = set(range(spec.shape[0])) if 'layers' in path else {None}
    missing += [_hf_name(path, i) for i in sorted(wanted - filled[path], key=lambda i: -1 if i is None else i)]
  if missing or unexpected or misshaped:
    parts = [f'{what} {_short(items)}' for what, items in
             (('missing', missing), ('unexpected', unexpected), ('mis-shaped', misshaped)) if items]
    raise ValueError(f'does not match its CLIPModel config ({config.text.num_layers} text / '
                     f'{config.vision.num_layers} vision layers, widths {config.text.hidden_size} / '
                     f'{config.vision.hidden_size}): {"; ".join(parts)}')
  return out


def param_shardings(config, mesh, fsdp_axis=None):
  """nnx.State of NamedShardings of ClipModel(config)'s parameters on `mesh`: replicated, or with fsdp_axis
  (a mesh axis or tuple of them) every model width ('embed') split over it where it divides."""
  axes = () if fsdp_axis is None else ((fsdp_axis,) if isinstance(fsdp_axis, str) else tuple(fsdp_axis))
  bad = [a for a in axes if a not in mesh.axis_names]
  if bad:
    raise ValueError(f'fsdp_axis {fsdp_axis!r}: no mesh axis {bad[0]!r} (the mesh has {mesh.axis_names})')
  rules = {'layers': (), 'embed': axes, 'heads': (), 'mlp': (), 'vocab': ()}
  _, state = abstract_state(config)
  return rules_lib.param_shardings(state, mesh, rules)


def place_state(config, params, shardings=None):
  """nnx.State of ClipModel(config) holding `params` ({NNX path: numpy}) on `shardings` (each device gets
  only its slices), or on the default device."""
  _, state = abstract_state(config)
  for path, variable in nnx.to_flat_state(state):
    variable.set_value(np.asarray(params[tuple(str(p) for p in path)], variable.get_value().dtype))
  return jax.device_put(state) if shardings is None else plan_lib.place(state, shardings)


def load_model(folder, dtype=jnp.float32, with_text=True):
  """(ClipModel, config) of a transformers CLIPModel folder on the default device (tests, tools)."""
  with open(os.path.join(folder, 'config.json')) as f:
    config = config_from_hf(json.load(f), os.path.join(folder, 'config.json'), dtype, with_text)
  graphdef, _ = abstract_state(config)
  return nnx.merge(graphdef, place_state(config, load_params(folder, config))), config


# ------------------------------------------------------------------------------------------ pixels
def _filter(kind):
  """(PIL's filter function of float64 numpy distances, its support) for 'bilinear', 'bicubic', 'lanczos'."""
  def triangle(x):
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)

  def cubic(x, a=-0.5):
    x = np.abs(x)
    return np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1,
                    np.where(x < 2.0, (((x - 5) * x + 8) * x - 4) * a, 0.0))

  def lanczos(x):
    return np.where((-3.0 <= x) & (x < 3.0), np.sinc(x) * np.sinc(x / 3.0), 0.0)

  return {'bilinear': (triangle, 1.0), 'bicubic': (cubic, 2.0), 'lanczos': (lanczos, 3.0)}[kind]


def resample_taps(in_size, out_size, kind):
  """(index (out, K) int32, weight (out, K) float64): PIL's precompute_coeffs (Resample.c) for resizing
  in_size -> out_size samples. Output sample o is centred at (o + 0.5) s (s = in / out), reads inputs
  within support x max(s, 1) of it, weighted by filter(distance / max(s, 1)) normalised over the inputs
  inside the image (torch's interpolate(antialias=True) evaluates the same formula in float32:
  `torch_aa_matrix`). Unused taps carry weight 0."""
  fn, support = _filter(kind)
  scale = in_size / out_size
  filterscale = max(scale, 1.0)
  support = support * filterscale
  ksize = int(math.ceil(support)) * 2 + 1
  center = (np.arange(out_size) + 0.5) * scale
  xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
  xmax = np.minimum(np.trunc(center + support + 0.5), in_size).astype(np.int64) - xmin
  j = np.arange(ksize)[None]
  w = fn(((j + xmin[:, None]).astype(np.float64) - center[:, None] + 0.5) * (1.0 / filterscale))
  w = np.where(j < xmax[:, None], w, 0.0)
  total = w.sum(-1, keepdims=True)
  w = np.where(total != 0, w / np.where(total != 0, total, 1.0), w)
  index = np.minimum(xmin[:, None] + j, in_size - 1).astype(np.int32)
  return index, w


def torch_aa_matrix(in_size, out_size, kind='bilinear'):
  """(out, in) float64 matrix holding the float32 weights of torch's interpolate(mode=kind,
  align_corners=False, antialias=True) on float32 tensors (ATen's _compute_indices_min_size_weights_aa):
  PIL's triangle-filter formula (`resample_taps`), but evaluated in torch's float32 arithmetic, operation for
  operation (scale in float32, the centres rounded to float32, the weights summed and divided in float32).
  The float64 weights of the same formula differ from torch's by up to ~3e-5 of a [0, 1] pixel on large
  downscales (e.g. 1000 -> 224); these match it to float32 round-off.

  kind 'bicubic': PIL's Keys cubic (a = -0.5, support 2 x the downscale factor), the filter polynomial
  evaluated with fused multiply-adds as the FMA (AVX2 / AVX-512) builds of torch's CPU kernel compile it:
  bit-identical to torch 2.13's weights here (a build without FMA differs in the last bit)."""
  f32, f64 = np.float32, np.float64
  if kind not in ('bilinear', 'bicubic'):
    raise ValueError(f"torch_aa_matrix: kind {kind!r}; known: ['bicubic', 'bilinear']")
  half = 1.0 if kind == 'bilinear' else 2.0                # interp_size * 0.5: interp_size 2 / 4
  scale = f32(in_size) / f32(out_size)
  aa = scale >= 1.0
  support = f32(half * f64(scale)) if aa else f32(half)    # (interp_size * 0.5) * scale
  invscale = f32(1.0 / f64(scale)) if aa else f32(1.0)
  ksize = int(math.ceil(support)) * 2 + 1
  center = (f64(scale) * (np.arange(out_size) + 0.5)).astype(f32)
  xmin = np.maximum(np.trunc((center - support).astype(f64) + 0.5), 0).astype(np.int64)
  xsize = np.clip(np.minimum(np.trunc((center + support).astype(f64) + 0.5), in_size).astype(np.int64) - xmin,
                  0, ksize)
  j = np.arange(ksize)[None]
  arg = np.abs(((((j + xmin[:, None]).astype(f32) - center[:, None]).astype(f64) + 0.5)
                * f64(invscale)).astype(f32))
  if kind == 'bilinear':
    w = np.where((arg < 1.0) & (j < xsize[:, None]), (1.0 - arg.astype(f64)).astype(f32), f32(0)).astype(f32)
  else:
    def fma(a, b, c):    # float32 a * b + c rounded once (the float64 product of two float32 is exact)
      return (np.asarray(a, f64) * np.asarray(b, f64) + np.asarray(c, f64)).astype(f32)
    a = f32(-0.5)        # ATen's cubic_convolution1 / 2 at a = -0.5
    near = fma(fma(a + f32(2), arg, -(a + f32(3))) * arg, arg, f32(1))
    far = fma(fma(fma(a, arg, -(f32(5) * a)), arg, f32(8) * a), arg, -(f32(4) * a))
    w = np.where(arg < 1.0, near, np.where(arg < 2.0, far, f32(0)))
    w = np.where(j < xsize[:, None], w, f32(0)).astype(f32)
  total = np.zeros(out_size, f32)
  for t in range(ksize):                                   # torch's sequential float32 sum
    total = (total + w[:, t]).astype(f32)
  w = np.where(total[:, None] != 0, (w / np.where(total != 0, total, f32(1))[:, None]).astype(f32), w)
  index = np.minimum(xmin[:, None] + j, in_size - 1)
  m = np.zeros((out_size, in_size))
  np.add.at(m, (np.repeat(np.arange(out_size), ksize), index.reshape(-1)), w.reshape(-1).astype(f64))
  return m


def resize_float(x, size, kind='bilinear'):
  """(B, H, W, C) float32 -> (B, h, w, C): torch's interpolate(mode=kind ('bilinear' or 'bicubic'),
  align_corners=False, antialias=True) (`torch_aa_matrix`), the width pass then the height pass as torch
  does, each a float32 matmul at HIGHEST precision; unchanged when already that size (no clamping)."""
  h, w = size
  hp = jax.lax.Precision.HIGHEST
  if x.shape[2] != w:
    x = jnp.einsum('ow,bhwc->bhoc', jnp.asarray(torch_aa_matrix(x.shape[2], w, kind), jnp.float32), x,
                   precision=hp)
  if x.shape[1] != h:
    x = jnp.einsum('oh,bhwc->bowc', jnp.asarray(torch_aa_matrix(x.shape[1], h, kind), jnp.float32), x,
                   precision=hp)
  return x


def _pil_pass(x, axis, out_size, kind):
  """One PIL 8-bit resampling pass along `axis` of int32 x: the coefficients in 22-bit fixed point,
  sum + 2^21, arithmetic shift, clipped to 0..255 (PIL's clip8)."""
  index, w = resample_taps(x.shape[axis], out_size, kind)
  k = np.where(w < 0, np.trunc(-0.5 + w * (1 << PRECISION_BITS)),
               np.trunc(0.5 + w * (1 << PRECISION_BITS))).astype(np.int32)
  shape = [1] * x.ndim
  shape[axis] = out_size
  acc = jnp.full((), 1 << (PRECISION_BITS - 1), jnp.int32)
  for t in range(index.shape[1]):
    if not k[:, t].any():
      continue
    acc = acc + jnp.take(x, jnp.asarray(index[:, t]), axis=axis) * jnp.asarray(k[:, t]).reshape(shape)
  return jnp.clip(jnp.right_shift(acc, PRECISION_BITS), 0, 255)


def resize_pil(x, size, kind='bicubic'):
  """(B, H, W, C) uint8 -> (B, h, w, C) uint8 values (int32): PIL's Image.resize(size, resample) of 8-bit
  images, bit for bit (horizontal pass, then vertical, each only where that side changes), in int32."""
  h, w = size
  x = x.astype(jnp.int32)
  if x.shape[2] != w:
    x = _pil_pass(x, 2, w, kind)
  if x.shape[1] != h:
    x = _pil_pass(x, 1, h, kind)
  return x


def center_crop(x, size, rounding):
  """(B, H, W, C) -> (B, h, w, C). rounding 'torchvision': CenterCrop's offsets int(round(excess / 2))
  (half to even), zero padding with the odd pixel after; 'hf': the image processor's (excess // 2), zero
  padding with the odd pixel before."""
  h, w = size
  H, W = x.shape[1:3]
  if h > H or w > W:
    ph, pw = max(h - H, 0), max(w - W, 0)
    before = (lambda d: d // 2) if rounding == 'torchvision' else (lambda d: (d + 1) // 2)
    x = jnp.pad(x, ((0, 0), (before(ph), ph - before(ph)), (before(pw), pw - before(pw)), (0, 0)))
    H, W = x.shape[1:3]
  if rounding == 'torchvision':
    top, left = int(round((H - h) / 2.0)), int(round((W - w) / 2.0))
  else:
    top, left = (H - h) // 2, (W - w) // 2
  return x[:, top:top + h, left:left + w]


@dataclasses.dataclass(frozen=True)
class PixelSpec:
  """How uint8 images become the model's pixels (from a CLIPImageProcessor's settings; hashable).

  path: 'tensor' (clip_rewards.tensor_pixels: x / 255, antialiased bilinear resize, torchvision crop) or
    'pil' (the processor: PIL resize of the uint8 image with `resample`, its crop, x * rescale).
  size: the resize target (an int short side, or (h, w)), None without resizing; crop: (h, w) or None.
  """
  path: str
  size: Any
  crop: Any
  resample: str
  rescale: Any
  mean: Any
  std: Any


def pixel_spec(image_processor, path):
  """PixelSpec of a CLIPImageProcessor for `path` ('tensor' or 'pil'); ValueError for a resample filter
  this module does not reproduce."""
  cfg = image_processor.to_dict()
  size = cr.processor_size(cfg['size']) if cfg.get('do_resize') else None
  crop = cr.processor_size(cfg['crop_size']) if cfg.get('do_center_crop') else None
  resample = int(cfg.get('resample', 3))
  if path == 'pil' and size is not None and resample not in PIL_FILTERS:
    raise ValueError(f'image processor resample={resample}: only {sorted(PIL_FILTERS)} (PIL '
                     f'{sorted(PIL_FILTERS.values())}) are reproduced')
  if path == 'tensor':
    rescale = 1.0 / 255.0
  else:
    rescale = float(cfg.get('rescale_factor', 1 / 255)) if cfg.get('do_rescale', True) else None
  norm = cfg.get('do_normalize')
  return PixelSpec(path, size, crop, PIL_FILTERS.get(resample, 'bicubic'), rescale,
                   tuple(float(v) for v in cfg['image_mean']) if norm else None,
                   tuple(float(v) for v in cfg['image_std']) if norm else None)


def device_pixels(images, spec):
  """(M, H, W, 3) uint8 -> (M, h, w, 3) float32 model pixels by `spec` (PixelSpec), jittable."""
  x = images
  if spec.path == 'tensor':
    x = x.astype(jnp.float32) / 255.0
    if spec.size is not None:
      x = resize_float(x, cr.resize_size(x.shape[1], x.shape[2], spec.size))
    if spec.crop is not None:
      x = center_crop(x, spec.crop, 'torchvision')
  else:
    if spec.size is not None:
      x = resize_pil(x, cr.resize_size(x.shape[1], x.shape[2], spec.size), spec.resample)
    if spec.crop is not None:
      x = center_crop(x, spec.crop, 'hf')
    x = x.astype(jnp.float32)
    if spec.rescale is not None:
      x = x * np.float32(spec.rescale)
  if spec.mean is not None:
    x = (x - jnp.asarray(spec.mean, jnp.float32)) / jnp.asarray(spec.std, jnp.float32)
  return x


# ------------------------------------------------------------------------------------------ rewards
def problems(reward, kwargs, head=False):
  """clip_rewards.reward_input_problems of the JAX reward `reward` (its messages naming `reward`)."""
  base = BASE_NAMES[reward]
  out = [p.replace(f'kwargs.{base}.', f'kwargs.{reward}.') for p in cr.reward_input_problems(base, kwargs, head)]
  return [reward + p[len(base):] if p.startswith(base) else p for p in out]


def pickscore_jax_input_problems(kwargs):
  return problems('pickscore_jax', kwargs)


def clipscore_jax_input_problems(kwargs):
  return problems('clipscore_jax', kwargs)


def clipscore_flowgrpo_jax_input_problems(kwargs):
  return problems('clipscore_flowgrpo_jax', kwargs)


def aesthetic_jax_input_problems(kwargs):
  return problems('laion_aesthetic_jax', kwargs, head=True)


def _axes(value):
  return () if value is None else ((value,) if isinstance(value, str) else tuple(value))


class _ClipJaxReward:
  """Shared construction, placement and batching of the JAX CLIP rewards.

  Args:
    checkpoint: local Hugging Face CLIPModel folder (config.json, weights).
    processor: folder of the tokenizer and image processor (default: checkpoint).
    device: not used (kept so that the torch rewards' kwargs fit); must be None.
    dtype: 'float32' (default) or 'bfloat16': parameters and matmuls.
    batch_size: images per device call (rounded up to a multiple of the data axis' size); the last chunk
      is padded by repeating its last image, so one shape compiles.
    mesh: a jax.sharding.Mesh to run on (None: the default device).
    data_axis: the mesh axis (or tuple of axes) the batch is split over.
    fsdp_axis: None (parameters replicated) or the mesh axis (or tuple) their model width is split over.
    preprocess: 'device' (default) or 'host' (the CLIPImageProcessor on the host; the pil-path rewards).
    matmul_precision: jax.default_matmul_precision for the model's matmuls; default 'highest' for float32.
  """

  reward = 'clip_jax'
  pixel_path = 'pil'
  prompts_optional = False
  with_text = True
  divisor = 1.0

  def __init__(self, checkpoint, processor=None, device=None, dtype='float32', batch_size=32, mesh=None,
               data_axis='data', fsdp_axis=None, preprocess='device', matmul_precision='default'):
    import transformers  # pylint: disable=g-import-not-at-top
    if device is not None:
      raise ValueError(f'{self.reward}: device={device!r}; the JAX rewards run on JAX devices (mesh=)')
    if int(batch_size) < 1:
      raise ValueError(f'{self.reward}: batch_size {batch_size} < 1')
    if dtype not in ('float32', 'bfloat16'):
      raise ValueError(f"{self.reward}: dtype {dtype!r}; known: ['bfloat16', 'float32']")
    if preprocess not in ('device', 'host') or (preprocess == 'host' and self.pixel_path != 'pil'):
      raise ValueError(f'{self.reward}: preprocess {preprocess!r}; known: '
                       f"{['device', 'host'] if self.pixel_path == 'pil' else ['device']}")
    if not checkpoint:
      raise ValueError(f'{self.reward}: no checkpoint (a local CLIPModel folder of '
                       f'{cr.HINTS[BASE_NAMES[self.reward]]})')
    checkpoint = cr._path(checkpoint)  # pylint: disable=protected-access
    processor = cr._path(processor) or checkpoint  # pylint: disable=protected-access
    found = problems(self.reward, {'checkpoint': checkpoint, 'processor': processor})
    if found:
      raise CheckpointError(found[0])
    self.preprocess = preprocess
    self.matmul_precision = ('highest' if dtype == 'float32' else None) if matmul_precision == 'default' \
        else matmul_precision
    jdtype = jnp.float32 if dtype == 'float32' else jnp.bfloat16
    config_path = os.path.join(checkpoint, 'config.json')
    try:
      with open(config_path) as f:
        self.config = config_from_hf(json.load(f), config_path, jdtype, self.with_text)
    except (ValueError, KeyError, TypeError) as e:
      self._fail(checkpoint, f'cannot be read as a CLIPModel config ({video_common.describe(e)})')
    try:
      params = load_params(checkpoint, self.config)
    except (OSError, ValueError) as e:
      self._fail(checkpoint, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    try:
      self.tokenizer = transformers.AutoTokenizer.from_pretrained(processor, local_files_only=True)
      self.image_processor = transformers.CLIPImageProcessor.from_pretrained(processor, local_files_only=True)
    except Exception as e:  # pylint: disable=broad-except
      self._fail(processor, f'has no usable CLIP tokenizer / image processor ({video_common.describe(e)})')
    if self.with_text and len(self.tokenizer) > self.config.vocab_size:
      self._fail(processor, f'has a tokenizer of {len(self.tokenizer)} tokens for a text model of '
                 f'{self.config.vocab_size} ({checkpoint})')
    s = self.config.image_size
    if cr.output_size(self.image_processor) != (s, s):
      self._fail(processor, f'makes {cr.output_size(self.image_processor)} pixels; the vision model of '
                 f'{checkpoint} takes ({s}, {s})')
    try:
      self.spec = pixel_spec(self.image_processor, self.pixel_path)
    except ValueError as e:
      self._fail(processor, str(e))
    self.mesh = mesh
    self.data_axes = _axes(data_axis) if mesh is not None else ()
    if mesh is not None:
      bad = [a for a in self.data_axes if a not in mesh.axis_names]
      if bad:
        raise ValueError(f'{self.reward}: data_axis {data_axis!r}: no mesh axis {bad[0]!r} (the mesh has '
                         f'{mesh.axis_names})')
    self.data_size = math.prod(dict(mesh.shape)[a] for a in self.data_axes) if mesh is not None else 1
    self.batch_size = -(-int(batch_size) // self.data_size) * self.data_size
    self._graphdef, _ = abstract_state(self.config)
    extra = self._extra_params(checkpoint)
    if mesh is None:
      self.param_shardings = None
      self.params = {'clip': place_state(self.config, params), **jax.device_put(extra)}
    else:
      rep = NamedSharding(mesh, P())
      self.param_shardings = {'clip': param_shardings(self.config, mesh, fsdp_axis),
                              **jax.tree.map(lambda _: rep, extra)}
      self.params = {'clip': place_state(self.config, params, self.param_shardings['clip']),
                     **plan_lib.place(extra, {k: self.param_shardings[k] for k in extra})}
    self._jitted = {}

  def _fail(self, path, what):
    video_common.fail(self.reward, path, what, error=CheckpointError)

  def _extra_params(self, checkpoint):
    del checkpoint
    return {}

  # ---- pure functions
  def model(self, params):
    return nnx.merge(self._graphdef, params['clip'])

  def raw_from_pixels(self, params, pixels, input_ids):
    """(B,) raw scores of (B, S, S, 3) float model pixels and (B, L) ids (before the divisor)."""
    raise NotImplementedError

  def scores_from_pixels(self, params, pixels, input_ids):
    """(B,) float32 scores of float model pixels: jittable."""
    with jax.default_matmul_precision(self.matmul_precision):
      return self.raw_from_pixels(params, pixels, input_ids) / self.divisor

  def scores(self, params, pixels_uint8, input_ids):
    """(M,) float32 scores of (M, H, W, 3) uint8 images and (M, L) int token ids (`tokenize`; None for
    the aesthetic reward), the pixels made on the device (`device_pixels`): pure and jittable."""
    return self.scores_from_pixels(params, device_pixels(pixels_uint8, self.spec), input_ids)

  def tokenize(self, prompts):
    """(M, 77) int32 token ids of M prompts on the host: truncated at 77, padded to 77."""
    if not self.with_text:
      return None
    if not len(prompts):
      return np.zeros((0, MAX_TOKENS), np.int32)
    batch = self.tokenizer(list(prompts), padding='max_length', truncation=True, max_length=MAX_TOKENS,
                           return_tensors='np')
    return np.asarray(batch['input_ids'], np.int32)

  def host_pixels(self, samples):
    """(M, S, S, 3) float32 pixels of the CLIPImageProcessor on the host (PIL)."""
    from PIL import Image  # pylint: disable=g-import-not-at-top
    images = [Image.fromarray(np.ascontiguousarray(x)) for x in samples]
    out = self.image_processor(images=images, return_tensors='np')['pixel_values']
    return np.ascontiguousarray(np.asarray(out, np.float32).transpose(0, 2, 3, 1))

  # ---- host call
  def _fn(self, host):
    if host not in self._jitted:
      fn = self.scores_from_pixels if host else self.scores
      if self.mesh is None:
        self._jitted[host] = jax.jit(fn)
      else:
        batch = NamedSharding(self.mesh, P(self.data_axes or None))
        ids = None if not self.with_text else batch
        self._jitted[host] = jax.jit(fn, in_shardings=(self.param_shardings, batch, ids), out_shardings=batch)
    return self._jitted[host]

  def _score_chunk(self, images, ids):
    n = len(images)
    size = min(self.batch_size, -(-n // self.data_size) * self.data_size)
    pad = size - n
    if pad:
      images = np.concatenate([images, np.repeat(images[-1:], pad, axis=0)])
      ids = None if ids is None else np.concatenate([ids, np.repeat(ids[-1:], pad, axis=0)])
    host = self.preprocess == 'host'
    x = self.host_pixels(images) if host else images
    if self.mesh is not None:
      batch = NamedSharding(self.mesh, P(self.data_axes or None))
      x = plan_lib.place(x, batch)
      ids = None if ids is None else plan_lib.place(ids, batch)
    out = self._fn(host)(self.params, x, ids)
    if not out.is_fully_addressable:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      out = multihost_utils.process_allgather(out, tiled=True)
    return np.asarray(out, np.float64)[:n].reshape(-1, 1)

  def __call__(self, samples, prompts):
    samples = cr.check_images(samples, prompts, self.reward, self.prompts_optional)
    ids = self.tokenize(prompts) if self.with_text else None

    def score(which):
      which = list(which)
      return self._score_chunk(samples[which], None if ids is None else ids[which])

    def warn(i, e):
      logger.warning('%s: image %d could not be scored, its reward is NaN (%s)', self.reward, i,
                     video_common.describe(e))

    out = video_common.score_batches(samples.shape[0], self.batch_size, 1, score, warn)
    return cr.finite_or_nan(out[:, 0], self.reward)


class PickScoreJax(_ClipJaxReward):
  """PickScore / 26 in JAX (see the module docstring; the processor's PIL-bicubic pixels, reproduced on the
  device bit for bit). kwargs of _ClipJaxReward (checkpoint: PickScore_v1, processor:
  CLIP-ViT-H-14-laion2B's)."""

  reward = 'pickscore_jax'
  divisor = cr.PICKSCORE_DIVISOR

  def raw_from_pixels(self, params, pixels, input_ids):
    return self.model(params).pair_logits(pixels, input_ids)


class CLIPScoreJax(_ClipJaxReward):
  """CLIPScore in JAX on the cosine scale (logits / 100), on the tensor antialiased-bilinear pixels;
  kwargs of _ClipJaxReward (checkpoint: openai/clip-vit-large-patch14)."""

  reward = 'clipscore_jax'
  pixel_path = 'tensor'
  divisor = cr.CLIPSCORE_DIVISOR

  def raw_from_pixels(self, params, pixels, input_ids):
    return self.model(params).pair_logits(pixels, input_ids)


class CLIPScoreFlowGRPOJax(CLIPScoreJax):
  """CLIPScoreJax on flow_grpo's scale: logits / 30."""

  reward = 'clipscore_flowgrpo_jax'
  divisor = cr.CLIPSCORE_FLOWGRPO_DIVISOR


class LAIONAestheticJax(_ClipJaxReward):
  """The LAION aesthetic v2 score in JAX: the MLP (five Linear layers, no activations; float32) on the
  L2-normalised CLIP image features of the processor's PIL-bicubic pixels. Prompts unused (may be None).

  Args: those of _ClipJaxReward (checkpoint: openai/clip-vit-large-patch14), and head: the aesthetic MLP's
  state dict (sac+logos+ava1-l14-linearMSE.pth), its input width the CLIP's projection_dim. Only the vision
  tower is loaded.
  """

  reward = 'laion_aesthetic_jax'
  prompts_optional = True
  with_text = False

  def __init__(self, checkpoint, head, processor=None, **kwargs):
    if not head:
      raise ValueError(f'{self.reward}: no head (the aesthetic MLP file, sac+logos+ava1-l14-linearMSE.pth)')
    self.head_path = cr._path(head)  # pylint: disable=protected-access
    self._state = cr.read_aesthetic_head(self.head_path, self.reward)
    super().__init__(checkpoint, processor, **kwargs)

  def _extra_params(self, checkpoint):
    dim = self._state['layers.0.weight'].shape[-1]
    if dim != self.config.projection_dim:
      raise CheckpointError(f'{self.reward} head {self.head_path}: takes {dim}-dim features; the CLIP of '
                            f'{checkpoint} projects to {self.config.projection_dim}')
    head = [(self._state[f'layers.{i}.weight'].numpy().T.copy(), self._state[f'layers.{i}.bias'].numpy())
            for i in cr.AESTHETIC_LAYERS]
    return {'head': head}

  def raw_from_pixels(self, params, pixels, input_ids):
    del input_ids
    h = unit(self.model(params).image_features(pixels))
    for w, b in params['head']:
      h = jnp.dot(h, w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST) + b.astype(jnp.float32)
    return h[:, 0]
