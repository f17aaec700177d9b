"""HPSv2.1 in JAX: `hpsv21_jax`, the twin of the PyTorch `hpsv21` (hps.py; read its docstring for the
reference, the model, the pixels and the score), on the training devices.

reward(samples, prompts) -> (M,) float32 numpy: the cosine of the unit image and text features of the
HPSv2.1 fine-tune of open_clip's ViT-H-14, no logit scale, NaN where a score is not finite or an image could
not be scored. Like the other JAX rewards (clip_jax.py) it exposes the pure function
`reward.scores(params, pixels_uint8, input_ids) -> (M,) float32` with `reward.params` and
`reward.tokenize(prompts) -> (M, 77) int32`, for use inside a jitted step.

Weights: the very file `hpsv21` reads (HPS_v2.1_compressed.pt of xswu/HPSv2: a torch file whose
'state_dict' holds open_clip's CLIP state dict; a plain state dict file too; `hps.save_tiny`'s tiny files),
read with torch.load(weights_only=True) and mapped onto clip_jax's NNX `ClipModel` (no second transformer):
  visual.conv1.weight (W, 3, p, p)           vision_model.embeddings.patch_embedding.kernel ((c, i, j), W)
  visual.class_embedding / positional_embedding / ln_pre / ln_post
                                             vision_model.embeddings.class_embedding / position_embedding /
                                             pre_layrnorm / post_layernorm
  visual.proj, text_projection (x @ P)       visual_projection.kernel, text_projection.kernel (as they are)
  token_embedding.weight, positional_embedding, ln_final
                                             text_model.embeddings.token_embedding / position_embedding,
                                             text_model.final_layer_norm
  [visual.]transformer.resblocks.i.          {vision,text}_model.encoder.layers[i]:
    ln_1, ln_2                                 layer_norm1, layer_norm2
    attn.in_proj_weight / in_proj_bias         self_attn.q_proj, k_proj, v_proj (the fused (3D, D) rows split
                                               in q, k, v order, each Linear weight transposed)
    attn.out_proj, mlp.c_fc, mlp.c_proj        self_attn.out_proj, mlp.fc1, mlp.fc2
  logit_scale                                logit_scale (loaded, unused)
The file is checked strictly against the open_clip layout of the model config (`checkpoint_layout`, the
same names and shapes as hps.build_model's state dict): a missing, unexpected or mis-shaped tensor is a
one-line CheckpointError naming the reward and the file. Both towers use exact (erf) GELU, LayerNorm eps
1e-5, the text tower the causal mask and the row of the largest token id (open_clip's argmax pooling: the
end token), the vision tower class-token pooling; `model_cfg` is hps' (open_clip's JSON layout, None:
ViT-H-14), so the tiny models of `hps.save_tiny` load as they are.

Pixels on the device (`device_pixels`, static shapes): uint8 / 255 in float32, the longer side resized to
the model's size (each side round(side * size / longer), as hps.resize_pad), torch's antialiased bicubic
(interpolate(mode='bicubic', antialias=True): PIL's Keys a = -0.5 filter on float values, nothing rounded or
clamped) as two float32 matmuls at HIGHEST precision whose weights are torch's own float32 weights
(clip_jax.torch_aa_matrix(kind='bicubic'), bit-identical to torch's), zero padding centred (floor of half
the excess left / top), then the OpenAI mean / std; an image whose longer side is already the size is only
padded. Equal to hps.pixels to float32 round-off: the resize sums in another order, and XLA computing x / c
as x * (1 / c) (measured <= 1.4e-6 after mean / std, a few float32 ulps; the tests assert 3e-6). The
scores then equal hpsv21's to ~7e-7 of the largest score on the tiny models (the tests assert 1e-5), as
close as torch's own float32 is to a float64 forward. `preprocess='host'` runs hps.pixels (torch) on the
host instead (for checks).

Tokens: hps' tokenizer (open_clip's SimpleTokenizer on the openai-clip BPE, context 77), on the host.

Sharding, precision, batching and the kwargs `mesh`, `data_axis`, `fsdp_axis`, `dtype` ('float32' /
'bfloat16'; not hpsv21's CUDA-only 'float16'), `matmul_precision`, `batch_size` are clip_jax's
(_ClipJaxReward): the batch split over the mesh's data axis, the parameters replicated or FSDP-sharded on
their width; the sharded result equals the one-device one to float round-off. `device` must be None (kept
so that hpsv21's kwargs fit).

jax, flax, numpy on the device side; torch (reading the .pt file; preprocess='host') and the tokenizer's
packages (openai-clip: ftfy, regex) on the host, imported when a reward is built.
"""
import math

import jax.numpy as jnp
import numpy as np

from ddrl_jax.rewards import clip_jax as cj
from ddrl_jax.rewards import hps
from ddrl_jax.rewards import video_common

REWARD = 'hpsv21_jax'
BASE = hps.REWARD
CheckpointError = hps.CheckpointError
ARGMAX_POOLING = 2     # ClipModel's eos_token_id 2 pools at the argmax of the ids: open_clip's end-token row


def _renamed(message):
  """A message of hps (naming 'hpsv21') naming this reward instead."""
  message = message.replace(f'kwargs.{BASE}.', f'kwargs.{REWARD}.')
  return REWARD + message[len(BASE):] if message.startswith(BASE) else message


def input_problems(kwargs):
  """One-line problems with what the reward built with `kwargs` needs (hps.input_problems: the checkpoint
  file, model_cfg, the CLIP BPE), naming hpsv21_jax; nothing is loaded."""
  return [_renamed(p) for p in hps.input_problems(kwargs)]


def model_config(model_cfg=None):
  """hps.model_config (open_clip's config, defaults filled in); ValueError (one line) naming this reward."""
  try:
    return hps.model_config(model_cfg)
  except (ValueError, TypeError) as e:
    raise ValueError(_renamed(video_common.first_line(e))) from None


def clip_config(model_cfg=None, dtype=jnp.float32):
  """clip_jax.ClipConfig of the open_clip model config `model_cfg` (None: ViT-H-14): exact GELU, eps 1e-5,
  argmax pooling, the towers' widths, depths and heads, the MLP widths int(width * mlp_ratio) (text 4)."""
  cfg = model_config(model_cfg)
  v, t = cfg['vision_cfg'], cfg['text_cfg']

  def tower(width, ratio, layers, heads):
    return cj.TowerConfig(width, int(width * ratio), layers, heads, hps.LN_EPS, 'gelu', dtype, dtype)

  return cj.ClipConfig(tower(t['width'], 4.0, t['layers'], t['heads']),
                       tower(v['width'], v['mlp_ratio'], v['layers'], v['width'] // v['head_width']),
                       vocab_size=t['vocab_size'], max_positions=t['context_length'],
                       eos_token_id=ARGMAX_POOLING, image_size=v['image_size'], patch_size=v['patch_size'],
                       projection_dim=cfg['embed_dim'])


# ------------------------------------------------------------------------------------------ weights
_BLOCK = {'ln_1.weight': ('layer_norm1', 'scale'), 'ln_1.bias': ('layer_norm1', 'bias'),
          'ln_2.weight': ('layer_norm2', 'scale'), 'ln_2.bias': ('layer_norm2', 'bias'),
          'attn.out_proj.weight': ('self_attn', 'out_proj', 'kernel'),
          'attn.out_proj.bias': ('self_attn', 'out_proj', 'bias'),
          'mlp.c_fc.weight': ('mlp', 'fc1', 'kernel'), 'mlp.c_fc.bias': ('mlp', 'fc1', 'bias'),
          'mlp.c_proj.weight': ('mlp', 'fc2', 'kernel'), 'mlp.c_proj.bias': ('mlp', 'fc2', 'bias')}
_QKV = ('q_proj', 'k_proj', 'v_proj')


def _block_layout(prefix, tower):
  """{open_clip name: shape} of the residual blocks of TowerConfig `tower` under `prefix`."""
  d, hidden = tower.hidden_size, tower.intermediate_size
  shapes = {'ln_1.weight': (d,), 'ln_1.bias': (d,), 'attn.in_proj_weight': (3 * d, d),
            'attn.in_proj_bias': (3 * d,), 'attn.out_proj.weight': (d, d), 'attn.out_proj.bias': (d,),
            'ln_2.weight': (d,), 'ln_2.bias': (d,), 'mlp.c_fc.weight': (hidden, d), 'mlp.c_fc.bias': (hidden,),
            'mlp.c_proj.weight': (d, hidden), 'mlp.c_proj.bias': (d,)}
  return {f'{prefix}.resblocks.{i}.{k}': s for i in range(tower.num_layers)
          for k, s in shapes.items()}


def checkpoint_layout(config):
  """{open_clip state-dict name: shape} of the model of `config` (ClipConfig of `clip_config`): the names
  and shapes of hps.build_model's state dict, i.e. of HPS_v2.1_compressed.pt for ViT-H-14."""
  v, t = config.vision, config.text
  w, e, p = v.hidden_size, config.projection_dim, config.patch_size
  out = {'positional_embedding': (config.max_positions, t.hidden_size),
         'text_projection': (t.hidden_size, e), 'logit_scale': (),
         'visual.class_embedding': (w,), 'visual.positional_embedding': (config.num_patches + 1, w),
         'visual.proj': (w, e), 'visual.conv1.weight': (w, config.num_channels, p, p),
         'visual.ln_pre.weight': (w,), 'visual.ln_pre.bias': (w,),
         'visual.ln_post.weight': (w,), 'visual.ln_post.bias': (w,),
         'token_embedding.weight': (config.vocab_size, t.hidden_size),
         'ln_final.weight': (t.hidden_size,), 'ln_final.bias': (t.hidden_size,)}
  out.update(_block_layout('visual.transformer', v))
  out.update(_block_layout('transformer', t))
  return out


_TOP = {'visual.class_embedding': ('vision_model', 'embeddings', 'class_embedding'),
        'visual.positional_embedding': ('vision_model', 'embeddings', 'position_embedding', 'embedding'),
        'visual.ln_pre.weight': ('vision_model', 'pre_layrnorm', 'scale'),
        'visual.ln_pre.bias': ('vision_model', 'pre_layrnorm', 'bias'),
        'visual.ln_post.weight': ('vision_model', 'post_layernorm', 'scale'),
        'visual.ln_post.bias': ('vision_model', 'post_layernorm', 'bias'),
        'visual.proj': ('visual_projection', 'kernel'),
        'token_embedding.weight': ('text_model', 'embeddings', 'token_embedding', 'embedding'),
        'positional_embedding': ('text_model', 'embeddings', 'position_embedding', 'embedding'),
        'ln_final.weight': ('text_model', 'final_layer_norm', 'scale'),
        'ln_final.bias': ('text_model', 'final_layer_norm', 'bias'),
        'text_projection': ('text_projection', 'kernel'), 'logit_scale': ('logit_scale',)}


def _targets(name, value):
  """[(NNX path, layer index or None, array)] that open_clip tensor `name` (float32 numpy) fills."""
  if name == 'visual.conv1.weight':        # (W, C, p, p) -> (C p p, W): the patch rows' (c, i, j) order
    return [(('vision_model', 'embeddings', 'patch_embedding', 'kernel'), None,
             value.reshape(value.shape[0], -1).T)]
  if name in _TOP:
    return [(_TOP[name], None, value)]
  head, rest = name.split('.resblocks.', 1)
  idx, key = rest.split('.', 1)
  base = ('vision_model' if head == 'visual.transformer' else 'text_model', 'encoder', 'layers')
  if key in ('attn.in_proj_weight', 'attn.in_proj_bias'):
    leaf = 'kernel' if key.endswith('weight') else 'bias'
    return [(base + ('self_attn', proj, leaf), int(idx), part.T if leaf == 'kernel' else part)
            for proj, part in zip(_QKV, np.split(value, 3, axis=0))]
  path = base + _BLOCK[key]
  return [(path, int(idx), value.T if path[-1] == 'kernel' else value)]


def read_state_dict(path):
  """{name: float32 torch tensor} of an HPS checkpoint: hps.read_state_dict, its errors naming hpsv21_jax."""
  return hps.read_state_dict(path, reward=REWARD)


def load_params(path, config, what='open_clip ViT-H-14'):
  """{NNX path: numpy in the config's param dtype} of ClipModel(config) from an HPS checkpoint file, checked
  strictly against checkpoint_layout(config) (missing, unexpected, mis-shaped: one-line CheckpointError in
  hps' words, naming hpsv21_jax and the file)."""
  state = read_state_dict(path)
  expected = checkpoint_layout(config)
  hps.check_layout(path, state, expected, what, reward=REWARD)
  dtype = np.dtype(config.vision.param_dtype)
  flat = cj.flat_shapes(config)
  out = {p: np.empty(s.shape, dtype) for p, s in flat.items()}
  filled = {p: 0 for p in flat}
  for name in expected:
    value = state.pop(name).float().numpy()
    for target, idx, array in _targets(name, value):
      if idx is None:
        out[target][...] = array
      else:
        out[target][idx] = array
      filled[target] += 1
  short = [p for p, s in flat.items() if filled[p] != (s.shape[0] if 'layers' in p else 1)]
  assert not short, f'{REWARD}: the open_clip layout leaves {short[0]} unfilled'     # the mapping is total
  return out


# ------------------------------------------------------------------------------------------ pixels
def resized_size(height, width, size):
  """(h, w) of hps.resize_pad's resize: the longer side to `size`, each side round(side * size / longer)
  (Python's round, half to even); (height, width) when the longer side is already `size`."""
  scale = size / float(max(height, width))
  if scale == 1.0:
    return height, width
  return round(height * scale), round(width * scale)


def device_resize_pad(images, size):
  """(M, H, W, 3) uint8 -> (M, size, size, 3) float32 in [0, 1] plus bicubic overshoot: hps.resize_pad on
  the device (torch's antialiased bicubic of the longer side, centred zero padding), jittable."""
  x = images.astype(jnp.float32) / 255.0
  h, w = resized_size(x.shape[1], x.shape[2], size)
  if (h, w) != tuple(x.shape[1:3]):
    x = cj.resize_float(x, (h, w), 'bicubic')
  pad_h, pad_w = size - h, size - w
  return jnp.pad(x, ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0)),
                 constant_values=hps.PAD_FILL)


def device_pixels(images, size):
  """device_resize_pad, then (x - MEAN) / STD: the model's (M, size, size, 3) float32 input (hps.pixels,
  channels last), jittable."""
  x = device_resize_pad(images, size)
  return (x - jnp.asarray(hps.MEAN, jnp.float32)) / jnp.asarray(hps.STD, jnp.float32)


# ------------------------------------------------------------------------------------------ reward
class HPSv21Jax(cj._ClipJaxReward):  # pylint: disable=protected-access
  """reward(samples, prompts) -> (M,) float32 HPSv2.1 (the cosine, no logit scale) of (M, H, W, 3) uint8
  images and M prompts, in JAX; NaN where not scorable.

  Args (hpsv21's, plus clip_jax's placement ones):
    checkpoint: HPS_v2.1_compressed.pt (a torch file with 'state_dict'), or a plain state dict file.
    device: not used (kept so that hpsv21's kwargs fit); must be None.
    dtype: 'float32' (default) or 'bfloat16' (parameters and matmuls).
    batch_size: images per device call (rounded up to a multiple of the data axis' size); the last chunk
      is padded by repeating its last image, so one shape compiles.
    model_cfg: open_clip model config (None: ViT-H-14); for tiny test models (hps.save_tiny).
    mesh, data_axis, fsdp_axis, matmul_precision: as clip_jax's rewards.
    preprocess: 'device' (default) or 'host' (hps.pixels in torch on the host; for checks).
  """

  reward = REWARD
  divisor = 1.0

  def __init__(self, checkpoint=None, device=None, dtype='float32', batch_size=32, model_cfg=None, mesh=None,
               data_axis='data', fsdp_axis=None, preprocess='device', matmul_precision='default'):
    # pylint: disable=super-init-not-called   (the base reads a transformers folder; the placement is redone)
    if device is not None:
      raise ValueError(f'{REWARD}: device={device!r}; the JAX rewards run on JAX devices (mesh=)')
    if int(batch_size) < 1:
      raise ValueError(f'{REWARD}: batch_size {batch_size} < 1')
    if dtype not in ('float32', 'bfloat16'):
      raise ValueError(f"{REWARD}: dtype {dtype!r}; known: ['bfloat16', 'float32']")
    if preprocess not in ('device', 'host'):
      raise ValueError(f"{REWARD}: preprocess {preprocess!r}; known: ['device', 'host']")
    if not checkpoint:
      raise ValueError(f'{REWARD}: no checkpoint ({hps.CHECKPOINT_HINT})')
    checkpoint = hps._path(checkpoint)  # pylint: disable=protected-access
    self.checkpoint, self.preprocess = checkpoint, preprocess
    self.matmul_precision = ('highest' if dtype == 'float32' else None) if matmul_precision == 'default' \
        else matmul_precision
    self.config = clip_config(model_cfg, jnp.float32 if dtype == 'float32' else jnp.bfloat16)
    self.image_size = self.config.image_size
    try:
      self.tokenizer = hps.shared_tokenizer(self.config.max_positions)
    except ImportError as e:
      raise ImportError(_renamed(video_common.first_line(e))) from None
    self.mesh = mesh
    self.data_axes = cj._axes(data_axis) if mesh is not None else ()  # pylint: disable=protected-access
    self.param_shardings = None
    if mesh is not None:                  # checked before the (ViT-H-14: 4 GB) weights are read
      bad = [a for a in self.data_axes if a not in mesh.axis_names]
      if bad:
        raise ValueError(f'{REWARD}: data_axis {data_axis!r}: no mesh axis {bad[0]!r} (the mesh has '
                         f'{mesh.axis_names})')
      try:
        self.param_shardings = {'clip': cj.param_shardings(self.config, mesh, fsdp_axis)}
      except ValueError as e:
        raise ValueError(f'{REWARD}: {video_common.first_line(e)}') from None
    self.data_size = math.prod(dict(mesh.shape)[a] for a in self.data_axes) if mesh is not None else 1
    self.batch_size = -(-int(batch_size) // self.data_size) * self.data_size
    self._graphdef, _ = cj.abstract_state(self.config)
    params = load_params(checkpoint, self.config, 'open_clip ViT-H-14' if model_cfg is None else 'model_cfg')
    self.params = {'clip': cj.place_state(self.config, params,
                                          None if mesh is None else self.param_shardings['clip'])}
    del params
    self._jitted = {}

  # ---- pure functions
  def raw_from_pixels(self, params, pixels, input_ids):
    """(B,) cosines of (B, S, S, 3) float model pixels and (B, L) ids: unit image . unit text features."""
    model = self.model(params)
    return jnp.sum(cj.unit(model.image_features(pixels)) * cj.unit(model.text_features(input_ids)), axis=-1)

  def scores(self, params, pixels_uint8, input_ids):
    """(M,) float32 HPS of (M, H, W, 3) uint8 images and (M, L) int ids (`tokenize`), the pixels made on the
    device (`device_pixels`): pure and jittable."""
    return self.scores_from_pixels(params, device_pixels(pixels_uint8, self.image_size), input_ids)

  def tokenize(self, prompts):
    """(M, context_length) int32 token ids of M prompts on the host (hps' tokenizer: open_clip's)."""
    out = np.zeros((len(prompts), self.tokenizer.context_length), np.int32)
    for i, prompt in enumerate(prompts):
      ids = self.tokenizer.ids(prompt)
      out[i, :len(ids)] = ids
    return out

  def host_pixels(self, samples):
    """(M, S, S, 3) float32 pixels of hps.pixels (torch, on the host)."""
    return np.ascontiguousarray(hps.pixels(samples, self.image_size).numpy().transpose(0, 2, 3, 1))
