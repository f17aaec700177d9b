"""diffusers `AutoencoderKLWan` state dict -> `video_vae.WanVAE` NNX state (the Wan2.1 VAE used by Wan2.1 and
Cosmos-Predict2.5).

Names follow diffusers one-to-one ('.' -> '/'), except:
- `*.weight` of a conv -> `kernel`: Conv3d (O, I, kt, kh, kw) -> (kt, kh, kw, I, O),
  Conv2d (O, I, kh, kw) -> (kh, kw, I, O), 1x1 Conv2d of the attention (O, I, 1, 1) -> (I, O);
- RMS-norm `gamma` (C, 1, 1[, 1]) -> (C,);
- `resample.1` (the spatial conv inside nn.Sequential) -> `resample`, `upsamplers.0` -> `upsampler`.

Every tensor is validated against `nnx.eval_shape` of the model; ONE ValueError lists all missing,
unexpected and mis-shaped keys.

Usage:
  state = convert_diffusers_vae_state_dict({k: v.numpy() for k, v in vae.state_dict().items()}, cfg)
  model = merge_params(cfg, state)
"""
import re

import numpy as np
from flax import nnx

from ddrl_jax.models import checked_state
from ddrl_jax.models.video_vae import WanVAE

_RENAMES = (('.resample.1.', '.resample.'), ('.upsamplers.0.', '.upsampler.'))


def abstract_params(config):
  """(abstract model, {path tuple: ShapeDtypeStruct}) of the Params, without allocating."""
  abstract = nnx.eval_shape(lambda: WanVAE(config, rngs=nnx.Rngs(0)))
  return abstract, checked_state.param_specs(abstract)


def _target_path(key):
  """diffusers key -> NNX path tuple (weight -> kernel)."""
  for old, new in _RENAMES:
    key = key.replace(old, new)
  parts = key.split('.')
  if parts[-1] == 'weight':
    parts[-1] = 'kernel'
  return tuple(parts)


def _transform(value, path, want_ndim):
  """Re-lays out one tensor for the NNX leaf at `path`; returns None when the rank cannot fit."""
  value = np.asarray(value)
  leaf = path[-1]
  if leaf == 'gamma':
    return value.reshape(-1)
  if leaf == 'bias':
    return value
  if value.ndim == 5 and want_ndim == 5:
    return value.transpose(2, 3, 4, 1, 0)
  if value.ndim == 4 and want_ndim == 4:
    return value.transpose(2, 3, 1, 0)
  if value.ndim == 4 and want_ndim == 2 and value.shape[2:] == (1, 1):
    return value[:, :, 0, 0].T
  return None


def convert_diffusers_vae_state_dict(state_dict, config):
  """{diffusers key: np.ndarray} -> nnx.State of WanVAE(config) Params (host numpy values)."""
  abstract, expected = abstract_params(config)
  return checked_state.convert_leaves(state_dict, abstract, expected, target_path=_target_path,
                                      transform=_transform, name='WanVAE(config)')


def merge_params(config, state):
  """Builds a WanVAE from a converted Param state without initialising real weights."""
  abstract = nnx.eval_shape(lambda: WanVAE(config, rngs=nnx.Rngs(0)))
  graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
  return nnx.merge(graphdef, state, rest)


# --------------------------------------------------------------------------- original Wan2.1 names
_WAN_RES = (('residual.0.gamma', 'norm1.gamma'), ('residual.2.', 'conv1.'), ('residual.3.gamma', 'norm2.gamma'),
            ('residual.6.', 'conv2.'), ('shortcut.', 'conv_shortcut.'))


def is_wan_original(keys):
  return any(k.startswith(('encoder.downsamples.', 'decoder.upsamples.', 'encoder.middle.', 'encoder.conv1.'))
             for k in keys)


def _res(rest):
  for old, new in _WAN_RES:
    if rest.startswith(old):
      return new + rest[len(old):]
  return rest


def _decoder_layout(config):
  """Original flat `decoder.upsamples` index -> ('resnets', stage, j) or ('upsampler', stage)."""
  layout, stages = [], len(config.dim_mult)
  for i in range(stages):
    layout += [('resnets', i, j) for j in range(config.num_res_blocks + 1)]
    if i != stages - 1:
      layout.append(('upsampler', i))
  return layout


def wan_original_to_diffusers(state_dict, config):
  """Original Wan2.1 VAE names (`wan/modules/vae.py`, attn_scales=[]) -> diffusers `AutoencoderKLWan` names.

  General in `config` (dim_mult, num_res_blocks); for the released layout it agrees with diffusers'
  `convert_wan_vae_to_diffusers` (checked in tests). Keys it does not know are passed through, so the
  VAE converter reports them as unexpected.
  """
  layout = _decoder_layout(config)
  out = {}
  for key, value in state_dict.items():
    new = key
    m = re.fullmatch(r'(encoder|decoder)\.(.*)', key)
    if key.startswith(('conv1.', 'conv2.')):
      new = ('quant_conv.' if key.startswith('conv1.') else 'post_quant_conv.') + key[6:]
    elif m:
      part, rest = m.groups()
      if rest.startswith('conv1.'):
        new = f'{part}.conv_in.{rest[6:]}'
      elif rest.startswith('head.0.'):
        new = f'{part}.norm_out.{rest[7:]}'
      elif rest.startswith('head.2.'):
        new = f'{part}.conv_out.{rest[7:]}'
      elif (mm := re.fullmatch(r'middle\.([012])\.(.*)', rest)):
        i, r = int(mm.group(1)), mm.group(2)
        new = (f'{part}.mid_block.attentions.0.{r}' if i == 1 else
               f'{part}.mid_block.resnets.{i // 2}.{_res(r)}')
      elif part == 'encoder' and (mm := re.fullmatch(r'downsamples\.(\d+)\.(.*)', rest)):
        new = f'encoder.down_blocks.{mm.group(1)}.{_res(mm.group(2))}'
      elif part == 'decoder' and (mm := re.fullmatch(r'upsamples\.(\d+)\.(.*)', rest)):
        idx, r = int(mm.group(1)), mm.group(2)
        if idx < len(layout):
          slot = layout[idx]
          new = (f'decoder.up_blocks.{slot[1]}.resnets.{slot[2]}.{_res(r)}' if slot[0] == 'resnets' else
                 f'decoder.up_blocks.{slot[1]}.upsamplers.0.{r}')
    out[new] = value
  return out
