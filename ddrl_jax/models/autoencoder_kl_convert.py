"""diffusers `AutoencoderKL` state dict (the `vae/` of SD3 / SD3.5, FLUX.1, ...) -> `autoencoder_kl.AutoencoderKL`
parameters.

Names follow diffusers one-to-one ('.' -> '/'), except:
- conv `weight` (O, I, kh, kw) -> `kernel` (kh, kw, I, O); attention Linear `weight` (O, I) -> `kernel` (I, O)
  (a legacy 1x1-conv attention weight (O, I, 1, 1) is accepted too);
- GroupNorm `weight` -> `scale`;
- `downsamplers.0.conv` -> `downsampler`, `upsamplers.0.conv` -> `upsampler`, `to_out.0` -> `to_out`;
- legacy attention names (`query`, `key`, `value`, `proj_attn`) -> `to_q`, `to_k`, `to_v`, `to_out`.

Every tensor is validated against `nnx.eval_shape` of the model; ONE ValueError lists all missing,
unexpected and mis-shaped keys.

Usage:
  cfg, params = load_diffusers_folder('/path/to/stable-diffusion-3.5-medium')   # or .../vae, or FLUX.1-dev
  model = merge_params(cfg, params)
or, from a torch module:
  params = from_diffusers_state_dict({k: v.numpy() for k, v in vae.state_dict().items()}, cfg)
"""
import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddrl_jax.models import checked_state
from ddrl_jax.models import family as family_lib
from ddrl_jax.models import autoencoder_kl as vae_lib

WEIGHTS_NAME = 'diffusion_pytorch_model.safetensors'
INDEX_NAME = WEIGHTS_NAME + '.index.json'

_RENAMES = (('.downsamplers.0.conv.', '.downsampler.'), ('.upsamplers.0.conv.', '.upsampler.'),
            ('.to_out.0.', '.to_out.'), ('.attentions.0.query.', '.attentions.0.to_q.'),
            ('.attentions.0.key.', '.attentions.0.to_k.'), ('.attentions.0.value.', '.attentions.0.to_v.'),
            ('.attentions.0.proj_attn.', '.attentions.0.to_out.'))


def abstract_params(config):
  """(abstract model, {path tuple of str: ShapeDtypeStruct}) of AutoencoderKL(config)'s Params."""
  abstract = vae_lib.abstract_model(config)
  return abstract, checked_state.param_specs(abstract)


def _target_path(key, expected):
  """diffusers key -> NNX path tuple: renames, then weight -> scale (norms) or kernel (convs, linears)."""
  for old, new in _RENAMES:
    key = key.replace(old, new)
  parts = key.split('.')
  if parts[-1] == 'weight':
    parts[-1] = 'scale' if tuple(parts[:-1]) + ('scale',) in expected else 'kernel'
  return tuple(parts)


def _transform(value, path, want_ndim):
  """Re-lays out one tensor for the NNX leaf at `path`; None when the rank cannot fit."""
  value = np.asarray(value)
  if path[-1] in ('scale', 'bias'):
    return value
  if value.ndim == 4 and want_ndim == 4:
    return value.transpose(2, 3, 1, 0)
  if value.ndim == 2 and want_ndim == 2:
    return value.T
  if value.ndim == 4 and want_ndim == 2 and value.shape[2:] == (1, 1):
    return value[:, :, 0, 0].T
  return None


def from_diffusers_state_dict(state_dict, config):
  """{diffusers key: np.ndarray} -> pure nested dict of AutoencoderKL(config)'s Params (host numpy, cast to
  config.param_dtype), the structure of `nnx.to_pure_dict(nnx.state(model, nnx.Param))`."""
  abstract, expected = abstract_params(config)
  state = checked_state.convert_leaves(state_dict, abstract, expected,
                                       target_path=lambda key: _target_path(key, expected),
                                       transform=_transform, name='AutoencoderKL(config)')
  return nnx.to_pure_dict(state)


def state_from_diffusers(state_dict, config):
  """(nnx.State of AutoencoderKL(config)'s Params, 'diffusers'): a `models.family.Converter`'s convert."""
  pure = from_diffusers_state_dict(state_dict, config)
  return checked_state.param_state(vae_lib.abstract_model(config), pure), 'diffusers'


def converter(preset):
  """The `family.Converter` of an AutoencoderKL preset (`autoencoder_kl.sd35`, `.flux1`, `.tiny`): diffusers'
  `vae/` -> params, for `python -m ddrl_jax.models.convert`."""
  return family_lib.preset_converter(preset, vae_lib.abstract_model, state_from_diffusers, 'vae')


def merge_params(config, params):
  """An AutoencoderKL(config) holding `params` (a pure dict from `from_diffusers_state_dict`), with no random init."""
  abstract = vae_lib.abstract_model(config)
  graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
  nnx.replace_by_pure_dict(state, params)
  state = nnx.map_state(lambda _, v: jnp.asarray(v), state)
  return nnx.merge(graphdef, state, rest)


def config_from_diffusers(cfg_json, **overrides):
  """diffusers AutoencoderKL config.json (dict) -> AutoencoderKLConfig; refuses what AutoencoderKL does not
  implement."""
  def _all(name, want):
    got = cfg_json.get(name)
    if got is not None and any(t != want for t in got):
      raise ValueError(f'config.json {name}={got}: AutoencoderKL implements only {want}')
  _all('down_block_types', 'DownEncoderBlock2D')
  _all('up_block_types', 'UpDecoderBlock2D')
  if cfg_json.get('act_fn', 'silu') != 'silu':
    raise ValueError(f'config.json act_fn={cfg_json["act_fn"]!r}: AutoencoderKL implements only silu')
  for name in ('latents_mean', 'latents_std'):
    if cfg_json.get(name) is not None:
      raise ValueError(f'config.json {name} is set: AutoencoderKL normalizes with scaling_factor/shift_factor only')
  blocks = tuple(cfg_json.get('block_out_channels', (64,)))
  for name in ('down_block_types', 'up_block_types'):
    if cfg_json.get(name) is not None and len(cfg_json[name]) != len(blocks):
      raise ValueError(f'config.json {name} has {len(cfg_json[name])} entries for {len(blocks)} block widths')
  # defaults are diffusers' AutoencoderKL defaults, for keys a config.json leaves out
  kw = dict(in_channels=cfg_json.get('in_channels', 3), out_channels=cfg_json.get('out_channels', 3),
            latent_channels=cfg_json.get('latent_channels', 4), block_out_channels=blocks,
            layers_per_block=cfg_json.get('layers_per_block', 1),
            norm_num_groups=cfg_json.get('norm_num_groups', 32),
            scaling_factor=float(cfg_json.get('scaling_factor', 0.18215)),
            shift_factor=float(cfg_json.get('shift_factor') or 0.0),
            use_quant_conv=bool(cfg_json.get('use_quant_conv', True)),
            use_post_quant_conv=bool(cfg_json.get('use_post_quant_conv', True)),
            mid_block_add_attention=bool(cfg_json.get('mid_block_add_attention', True)))
  kw.update(overrides)
  return vae_lib.AutoencoderKLConfig(**kw)


def _vae_dir(path):
  """`path` itself when it holds config.json and weights, else its `vae/` subfolder (a pipeline folder)."""
  for d in (path, os.path.join(path, 'vae')):
    if os.path.exists(os.path.join(d, 'config.json')) and (
        os.path.exists(os.path.join(d, WEIGHTS_NAME)) or os.path.exists(os.path.join(d, INDEX_NAME))):
      return d
  raise ValueError(f'{path}: neither it nor {os.path.join(path, "vae")} holds config.json and {WEIGHTS_NAME} '
                   f'(or {INDEX_NAME})')


def read_safetensors(path, into=None):
  """{name: numpy array} of one .safetensors file (bf16 stays bf16, as ml_dtypes' numpy type)."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  out = {} if into is None else into
  with safe_open(path, framework='flax') as f:   # 'flax' reads bf16, which framework='numpy' cannot
    for k in f.keys():
      out[k] = np.asarray(f.get_tensor(k))
  return out


def load_diffusers_folder(path, **overrides):
  """(AutoencoderKLConfig, pure params dict) from a diffusers pipeline folder (reads `vae/`) or a vae folder:
  `config.json` -> config (fields of AutoencoderKLConfig in `overrides` win, e.g. dtype, param_dtype), and
  `diffusion_pytorch_model.safetensors` (or its sharded index) -> params cast to config.param_dtype."""
  d = _vae_dir(path)
  with open(os.path.join(d, 'config.json')) as f:
    cfg = config_from_diffusers(json.load(f), **overrides)
  index = os.path.join(d, INDEX_NAME)
  if os.path.exists(index):
    with open(index) as f:
      files = [os.path.join(d, n) for n in sorted(set(json.load(f)['weight_map'].values()))]
  else:
    files = [os.path.join(d, WEIGHTS_NAME)]
  state_dict = {}
  for file in files:
    read_safetensors(file, into=state_dict)
  return cfg, from_diffusers_state_dict(state_dict, cfg)


def load_model(path, **overrides):
  """AutoencoderKL with the weights of a diffusers folder (see `load_diffusers_folder`)."""
  cfg, params = load_diffusers_folder(path, **overrides)
  return merge_params(cfg, params)


__all__ = ['abstract_params', 'config_from_diffusers', 'converter', 'from_diffusers_state_dict',
           'load_diffusers_folder', 'load_model', 'merge_params', 'read_safetensors', 'state_from_diffusers']
