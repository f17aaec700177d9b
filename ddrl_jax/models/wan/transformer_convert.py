"""diffusers `WanTransformer3DModel` state dicts <-> `WanDiT` parameters (nnx pure dicts), and the reader
of a diffusers folder's `transformer/` (config.json + safetensors, sharded or not).

A pure dict is `nnx.to_pure_dict(nnx.state(model, nnx.Param))`: nested {name: ...} with numpy leaves.
Names follow diffusers ('.' -> nesting) with these changes:
- Linear `weight` (out, in) -> `kernel` (in, out); RMSNorm / LayerNorm `weight` -> `scale`;
- `patch_embedding.weight`, a Conv3d (D, C, pt, ph, pw) with kernel = stride = patch, -> a dense kernel
  (C*pt*ph*pw, D) over the features of `layers.patchify` (index c*pt*ph*pw + r*ph*pw + m*pw + n);
- `attn{1,2}.to_out.0` -> `to_out`, `ffn.net.0.proj` -> `ffn/net_0`, `ffn.net.2` -> `ffn/net_2`;
- `scale_shift_table` (1, k, D) -> (k, D);
- `blocks.{i}.*` are stacked on a leading layer axis under `blocks`.

Every tensor is checked against `jax.eval_shape` of the model; ONE ValueError names the first shape
differences, the missing and the unexpected keys.

Usage:
  cfg, params = load_diffusers_transformer('/ckpt/Wan2.1-T2V-1.3B-Diffusers', dtype=jnp.bfloat16)
  model = merge_params(cfg, params)
"""
import glob
import json
import os

import jax
import numpy as np
from flax import nnx

from ddrl_jax.models import checked_state
from ddrl_jax.models.wan.transformer import WanDiT
from ddrl_jax.models.wan.transformer import WanDiTConfig

_MODULE_RENAMES = {'to_out': ('to_out', '0'), 'net_0': ('net', '0', 'proj'), 'net_2': ('net', '2')}
_IGNORED = ('norm_added_q',)    # diffusers' _keys_to_ignore_on_load_unexpected
_SHOW = 8                       # names listed per kind of error


def abstract_params(config):
  """{path tuple: ShapeDtypeStruct} of WanDiT(config)'s nnx.Param leaves, from jax.eval_shape."""
  return checked_state.param_specs(nnx.eval_shape(lambda: WanDiT(config, rngs=nnx.Rngs(0))))


def _diffusers_key(path):
  """NNX path (without the layer index) -> (diffusers key, with '{}' for the block index, kind)."""
  *mods, leaf = path
  if leaf == 'scale_shift_table':
    kind, name = 'table', 'scale_shift_table'
  elif leaf == 'kernel':
    kind, name = ('conv' if mods == ['patch_embedding'] else 'linear'), 'weight'
  else:
    kind, name = 'copy', 'weight' if leaf == 'scale' else leaf
  parts = []
  for m in mods:
    parts.extend(_MODULE_RENAMES.get(m, (m,)))
  if parts[:1] == ['blocks']:
    parts.insert(1, '{}')
  return '.'.join(parts + [name]), kind


def diffusers_names(path, config):
  """diffusers weight names of one kernel path below the DiT ('blocks/attn1/to_q/kernel' -> one per layer,
  'blocks.{i}.attn1.to_q.weight'), for LoRA export; only Linear kernels (peft's lora_A/lora_B of a Linear)."""
  parts = tuple(path.split('/'))
  key, kind = _diffusers_key(parts)
  if kind != 'linear':
    raise ValueError(f'{path}: LoRA export covers Linear kernels; this is a {kind} parameter ({key})')
  return [key.format(i) for i in range(config.num_layers)] if parts[0] == 'blocks' else [key]


def _to_nnx(value, kind):
  value = np.asarray(value)
  if kind == 'linear':
    return value.T
  if kind == 'conv':
    return value.reshape(value.shape[0], -1).T
  if kind == 'table':
    return value.reshape(value.shape[-2:]) if value.ndim == 3 and value.shape[0] == 1 else value
  return value


def _to_diffusers(value, kind, config):
  value = np.asarray(value)
  if kind == 'linear':
    return value.T
  if kind == 'conv':
    return value.T.reshape((value.shape[1], config.in_channels) + tuple(config.patch_size))
  if kind == 'table':
    return value[None]
  return value


def _raise(what, misshaped, missing, unexpected):
  if not (misshaped or missing or unexpected):
    return
  lines = [f'{what}: {len(misshaped)} shape differences, {len(missing)} missing, {len(unexpected)} unexpected']
  for title, items in (('shape differences', misshaped), ('missing', missing), ('unexpected', unexpected)):
    if items:
      more = f' (+{len(items) - _SHOW} more)' if len(items) > _SHOW else ''
      lines.append(f'  {title}{more}: ' + '; '.join(items[:_SHOW]))
  raise ValueError('\n'.join(lines))


def from_diffusers_state_dict(state_dict, config):
  """diffusers WanTransformer3DModel state dict {name: array} -> pure dict of WanDiT(config)'s Params
  (numpy, in config.param_dtype), structured like nnx.to_pure_dict(nnx.state(model, nnx.Param))."""
  expected = abstract_params(config)
  n = config.num_layers
  used, flat, misshaped, missing = set(), {}, [], []
  for path, spec in expected.items():
    key, kind = _diffusers_key(path)
    keys = [key.format(i) for i in range(n)] if path[0] == 'blocks' else [key]
    want = spec.shape[1:] if path[0] == 'blocks' else spec.shape
    arrays = []
    for k in keys:
      if k not in state_dict:
        missing.append(k)
        continue
      used.add(k)
      arr = _to_nnx(state_dict[k], kind)
      if tuple(arr.shape) != tuple(want):
        misshaped.append(f'{k}: {tuple(np.shape(state_dict[k]))} -> {tuple(arr.shape)} after {kind}, '
                         f'{"/".join(path)} wants {tuple(want)}')
      arrays.append(arr)
    if len(arrays) == len(keys) and all(a.shape == tuple(want) for a in arrays):
      value = np.stack(arrays) if path[0] == 'blocks' else arrays[0]
      flat[path] = value.astype(spec.dtype)
  unexpected = sorted(k for k in state_dict if k not in used and not any(s in k for s in _IGNORED))
  _raise('diffusers WanTransformer3DModel -> WanDiT(config)', misshaped, missing, unexpected)
  return checked_state.nest(flat)


def to_diffusers_state_dict(params, config):
  """Inverse of `from_diffusers_state_dict`: pure dict (or nnx.State of Params) -> {diffusers name: numpy}."""
  if isinstance(params, nnx.State):
    params = nnx.to_pure_dict(params)
  flat = checked_state.flatten(params)
  expected = abstract_params(config)
  misshaped = [f'{"/".join(p)}: {tuple(np.shape(flat[p]))}, want {tuple(s.shape)}'
               for p, s in expected.items() if p in flat and tuple(np.shape(flat[p])) != tuple(s.shape)]
  _raise('WanDiT params -> diffusers', misshaped, ['/'.join(p) for p in expected if p not in flat],
         ['/'.join(p) for p in flat if p not in expected])
  out = {}
  for path, value in flat.items():
    key, kind = _diffusers_key(path)
    value = np.asarray(value)
    if path[0] == 'blocks':
      for i in range(value.shape[0]):
        out[key.format(i)] = _to_diffusers(value[i], kind, config)
    else:
      out[key] = _to_diffusers(value, kind, config)
  return out


def merge_params(config, params):
  """A WanDiT with `params` (pure dict) as its Params, without random initialisation of real weights."""
  abstract = nnx.eval_shape(lambda: WanDiT(config, rngs=nnx.Rngs(0)))
  graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
  nnx.replace_by_pure_dict(state, jax.tree.map(jax.numpy.asarray, params))
  return nnx.merge(graphdef, state, rest)


# --------------------------------------------------------------------------------------- folder reader
_CONFIG_FIELDS = ('patch_size', 'num_attention_heads', 'attention_head_dim', 'in_channels', 'out_channels',
                  'text_dim', 'freq_dim', 'ffn_dim', 'num_layers', 'cross_attn_norm', 'qk_norm', 'eps',
                  'rope_max_seq_len')


def config_from_diffusers(diffusers_config, **overrides):
  """WanDiTConfig from a diffusers transformer config.json dict; `overrides` set dtype, remat_policy, ...

  Raises for the image-conditioned variants (image_dim / added_kv_proj_dim / pos_embed_seq_len), which
  WanDiT does not implement."""
  c = dict(diffusers_config)
  cls = c.get('_class_name', 'WanTransformer3DModel')
  if cls != 'WanTransformer3DModel':
    raise ValueError(f'config.json describes {cls}, not WanTransformer3DModel')
  extra = {k: c[k] for k in ('image_dim', 'added_kv_proj_dim', 'pos_embed_seq_len') if c.get(k) is not None}
  if extra:
    raise ValueError(f'image-conditioned Wan ({extra}) is not supported: WanDiT is text-to-video only')
  kw = {k: c[k] for k in _CONFIG_FIELDS if k in c}
  if 'patch_size' in kw:
    kw['patch_size'] = tuple(kw['patch_size'])
  if kw.get('out_channels') is None:
    kw['out_channels'] = kw.get('in_channels', WanDiTConfig.in_channels)
  kw.update(overrides)
  return WanDiTConfig(**kw)


def _load_shard(path):
  """{name: numpy} of one safetensors file; bfloat16 tensors go through safetensors' flax reader on the
  host CPU (numpy has no bfloat16), other dtypes through its numpy reader."""
  from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  try:
    return st_numpy.load_file(path)
  except (TypeError, ValueError):
    out = {}
    with jax.default_device(jax.devices('cpu')[0]), safe_open(path, framework='flax') as f:
      for k in f.keys():
        out[k] = np.asarray(f.get_tensor(k))
    return out


def read_safetensors_dir(directory):
  """{name: numpy} of a diffusers model folder: the shards listed by
  `diffusion_pytorch_model.safetensors.index.json`, else every `*.safetensors` file in it."""
  index = os.path.join(directory, 'diffusion_pytorch_model.safetensors.index.json')
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)['weight_map']
    files = sorted(set(weight_map.values()))
  else:
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, '*.safetensors')))
  if not files:
    raise FileNotFoundError(f'no *.safetensors in {directory}')
  state = {}
  for name in files:
    shard = _load_shard(os.path.join(directory, name))
    clash = set(shard) & set(state)
    if clash:
      raise ValueError(f'{name} repeats {sorted(clash)[:_SHOW]}')
    state.update(shard)
  if os.path.exists(index):
    lacking = sorted(set(weight_map) - set(state))
    if lacking:
      raise ValueError(f'{index} lists tensors no shard holds: {lacking[:_SHOW]}')
  return state


def load_diffusers_transformer(path, **config_overrides):
  """(WanDiTConfig, pure dict) from a diffusers pipeline folder (its `transformer/`) or a transformer
  folder (config.json + safetensors). `config_overrides`: dtype, param_dtype, remat_policy, attention."""
  directory = os.path.join(path, 'transformer') if os.path.isdir(os.path.join(path, 'transformer')) else path
  with open(os.path.join(directory, 'config.json')) as f:
    config = config_from_diffusers(json.load(f), **config_overrides)
  return config, from_diffusers_state_dict(read_safetensors_dir(directory), config)
