"""diffusers `FluxTransformer2DModel` state dicts and folders <-> `FluxTransformer` parameters (pure dicts).

`from_diffusers_state_dict(sd, cfg)` returns the nested dict of numpy arrays that
`nnx.to_pure_dict(nnx.state(FluxTransformer(cfg), nnx.Param))` has: Linear weights (out, in) become
kernels (in, out), norm weights become scales, and the tensors of `transformer_blocks.{i}` /
`single_transformer_blocks.{i}` are stacked on a leading 'layers' axis of the stack of the same name.
Every key must be used and every shape must fit: one ValueError lists all missing, unexpected and
mis-shaped keys (diffusers names), and the result is checked against `nnx.eval_shape` of the model.
`to_diffusers_state_dict(pure, cfg)` is the inverse. FLUX has no buffers (its RoPE tables are computed).

Names (`diffusers_names`): a module path maps one to one with '/' for '.', except `to_out.0` <->
`to_out`, `ff.net.0.proj` <-> `ff/proj_in`, `ff.net.2` <-> `ff/proj_out` (and the same under
`ff_context`); a Linear's `weight` is `kernel`, a q/k RMSNorm's `weight` is `scale`.

Folders: `load_diffusers(path, cfg)` reads a diffusers model folder (config.json + safetensors, sharded
or not) or a pipeline folder holding `transformer/`, refuses a config.json whose architecture differs
from `cfg` (`config_from_diffusers`), and converts.

Usage:
  pure = load_diffusers('/ckpt/FLUX.1-dev', transformer.flux1_dev())
  model = model_from_pure(pure, cfg)
"""
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddrl_jax.models.flux import transformer

STACKS = ('transformer_blocks', 'single_transformer_blocks')
_BLOCK_RE = re.compile(r'(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)')
_NORMS = ('norm_q', 'norm_k', 'norm_added_q', 'norm_added_k')
# (ours, diffusers) renames of module sub-paths below a block, '.'-joined.
_RENAMES = (('ff.proj_in', 'ff.net.0.proj'), ('ff.proj_out', 'ff.net.2'),
            ('ff_context.proj_in', 'ff_context.net.0.proj'), ('ff_context.proj_out', 'ff_context.net.2'),
            ('to_out', 'to_out.0'))
# diffusers config.json fields that fix the architecture (FluxConfig's names).
ARCH_FIELDS = ('patch_size', 'in_channels', 'out_channels', 'num_layers', 'num_single_layers',
               'attention_head_dim', 'num_attention_heads', 'joint_attention_dim', 'pooled_projection_dim',
               'guidance_embeds', 'axes_dims_rope')


def _stack_sizes(cfg):
  return {'transformer_blocks': cfg.num_layers, 'single_transformer_blocks': cfg.num_single_layers}


def _rename(module, pairs):
  for src, dst in pairs:
    if module == src or module.endswith('.' + src):
      return module[:len(module) - len(src)] + dst
  return module


def diffusers_names(path, cfg):
  """diffusers keys of one parameter path ('transformer_blocks/attn/to_q/kernel'): one per block for a
  stacked leaf, else one; and the leaf's kind ('linear': transposed, 'vector': as is)."""
  parts = path.split('/')
  leaf = parts[-1]
  if leaf not in ('kernel', 'bias', 'scale'):
    raise ValueError(f'{path}: no diffusers name for this parameter')
  kind = 'linear' if leaf == 'kernel' else 'vector'
  suffix = 'bias' if leaf == 'bias' else 'weight'
  if parts[0] in STACKS:
    rest = _rename('.'.join(parts[1:-1]), _RENAMES)
    return [f'{parts[0]}.{i}.{rest}.{suffix}' for i in range(_stack_sizes(cfg)[parts[0]])], kind
  return ['.'.join(parts[:-1]) + f'.{suffix}'], kind


def _our_path(key):
  """diffusers key -> (our path tuple, block index or None, kind), or None when it names no parameter."""
  m = _BLOCK_RE.fullmatch(key)
  head, index, module_key = (), None, key
  if m:
    head, index, module_key = (m.group(1),), int(m.group(2)), m.group(3)
  if '.' not in module_key:
    return None
  module, suffix = module_key.rsplit('.', 1)
  if m:
    module = _rename(module, [(b, a) for a, b in _RENAMES])
  if suffix == 'bias':
    leaf = 'bias'
  elif suffix == 'weight':
    leaf = 'scale' if module.split('.')[-1] in _NORMS else 'kernel'
  else:
    return None
  return head + tuple(module.split('.')) + (leaf,), index, 'linear' if leaf == 'kernel' else 'vector'


def abstract_params(cfg):
  """{path tuple: ShapeDtypeStruct} of FluxTransformer(cfg)'s nnx.Param leaves (nnx.eval_shape)."""
  state = nnx.state(transformer.abstract_model(cfg), nnx.Param)
  return {tuple(str(p) for p in path): v.get_value() for path, v in nnx.to_flat_state(state)}


def _flatten(pure, prefix=()):
  out = {}
  for k, v in pure.items():
    if isinstance(v, dict):
      out.update(_flatten(v, prefix + (str(k),)))
    else:
      out[prefix + (str(k),)] = v
  return out


def _nest(flat):
  out = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out


def check_against_model(pure, cfg, max_listed=10):
  """Raises ValueError when the paths or shapes of a pure parameter dict differ from nnx.eval_shape of
  FluxTransformer(cfg), listing the first `max_listed` differences."""
  expected = abstract_params(cfg)
  got = {p: tuple(np.shape(v)) for p, v in _flatten(pure).items()}
  diffs = [f'{"/".join(p)}: missing (expected {tuple(expected[p].shape)})' for p in expected if p not in got]
  diffs += [f'{"/".join(p)}: unexpected {got[p]}' for p in got if p not in expected]
  diffs += [f'{"/".join(p)}: got {got[p]}, expected {tuple(expected[p].shape)}'
            for p in expected if p in got and got[p] != tuple(expected[p].shape)]
  if diffs:
    listed = '\n  '.join(diffs[:max_listed])
    more = f'\n  ... and {len(diffs) - max_listed} more' if len(diffs) > max_listed else ''
    raise ValueError(f'parameters do not match FluxTransformer({cfg}) ({len(diffs)} differences):\n'
                     f'  {listed}{more}')


def from_diffusers_state_dict(state_dict, cfg):
  """diffusers FluxTransformer2DModel state dict {key: array} -> pure parameter dict of
  FluxTransformer(cfg) (numpy, in cfg.param_dtype).

  Raises one ValueError listing every missing, unexpected and mis-shaped key (diffusers names).
  """
  expected = abstract_params(cfg)
  sizes = _stack_sizes(cfg)
  flat, stacks, unexpected, misshaped = {}, {}, [], []
  for key, value in state_dict.items():
    found = _our_path(key)
    if found is None or found[0] not in expected or (found[1] is not None and found[1] >= sizes[found[0][0]]):
      unexpected.append(key)
      continue
    path, index, kind = found
    value = np.asarray(value)
    arr = value.T if kind == 'linear' else value
    want = tuple(expected[path].shape[1:] if index is not None else expected[path].shape)
    if arr.shape != want:
      torch_shape = tuple(reversed(want)) if kind == 'linear' else want
      misshaped.append(f'{key}: got {tuple(value.shape)}, expected {torch_shape}')
      continue
    if index is None:
      flat[path] = arr
    else:
      stacks.setdefault(path, {})[index] = arr
  for path, parts in stacks.items():
    if len(parts) == sizes[path[0]]:
      flat[path] = np.stack([parts[i] for i in range(sizes[path[0]])])
  missing = []
  for path in expected:
    if path not in flat:
      names, _ = diffusers_names('/'.join(path), cfg)
      have = stacks.get(path, {})
      missing += [n for j, n in enumerate(names) if j not in have]
  bad = {m.split(':', 1)[0] for m in misshaped}       # a mis-shaped key is not also reported missing
  missing = [m for m in missing if m not in bad]
  if missing or unexpected or misshaped:
    raise ValueError(f'state dict does not match FluxTransformer({cfg}):\n'
                     f'  missing ({len(missing)}): {missing}\n'
                     f'  unexpected ({len(unexpected)}): {unexpected}\n'
                     f'  mis-shaped ({len(misshaped)}): {misshaped}')
  pure = _nest({p: np.asarray(v, dtype=expected[p].dtype) for p, v in flat.items()})
  check_against_model(pure, cfg)
  return pure


def to_diffusers_state_dict(pure, cfg):
  """Pure parameter dict of FluxTransformer(cfg) -> diffusers state dict {key: numpy array} (Linear
  weights (out, in), per-block tensors unstacked): the inverse of `from_diffusers_state_dict`."""
  check_against_model(pure, cfg)
  out = {}
  for path, value in _flatten(pure).items():
    names, kind = diffusers_names('/'.join(path), cfg)
    value = np.asarray(value)
    parts = list(value) if path[0] in STACKS else [value]
    for name, part in zip(names, parts):
      out[name] = np.ascontiguousarray(part.T if kind == 'linear' else part)
  return out


def config_from_diffusers(config_json, **overrides):
  """A FluxConfig from a diffusers config.json dict (its ARCH_FIELDS; absent ones take diffusers'
  defaults), with our fields (dtype, remat_policy, attention, ...) from `overrides`."""
  defaults = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                  attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                  pooled_projection_dim=768, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
  kw = {f: config_json.get(f, defaults[f]) for f in ARCH_FIELDS}
  kw['axes_dims_rope'] = tuple(kw['axes_dims_rope'])
  kw.update(overrides)
  return transformer.FluxConfig(**kw)


def check_config(config_json, cfg, where='config.json'):
  """Raises ValueError naming every architecture field of a diffusers config.json that differs from cfg."""
  theirs = config_from_diffusers(config_json)
  diffs = [f'{f}: {getattr(theirs, f)!r} in {where}, {getattr(cfg, f)!r} configured' for f in ARCH_FIELDS
           if (theirs.out_ch if f == 'out_channels' else getattr(theirs, f))
           != (cfg.out_ch if f == 'out_channels' else getattr(cfg, f))]
  if diffs:
    raise ValueError(f'the checkpoint is another FLUX architecture: {"; ".join(diffs)}')


def load_diffusers(path, cfg):
  """Pure parameter dict of FluxTransformer(cfg) from a diffusers folder: a FluxTransformer2DModel folder
  (config.json + *.safetensors, sharded or not) or a pipeline folder holding transformer/. Its
  config.json, when present, must describe cfg's architecture (`check_config`)."""
  from ddrl_jax.models import convert as convert_lib  # pylint: disable=g-import-not-at-top
  folder = convert_lib._diffusers_dir(path, 'transformer')  # pylint: disable=protected-access
  config_path = os.path.join(folder, 'config.json')
  if os.path.exists(config_path):
    with open(config_path) as f:
      check_config(json.load(f), cfg, config_path)
  return from_diffusers_state_dict(convert_lib.load_diffusers_dir(path, 'transformer'), cfg)


def state_from_diffusers(state_dict, cfg):
  """(nnx.State of FluxTransformer(cfg)'s Params, 'diffusers'): a `models.family.Converter`'s convert."""
  state = nnx.state(transformer.abstract_model(cfg), nnx.Param)
  nnx.replace_by_pure_dict(state, from_diffusers_state_dict(state_dict, cfg))
  return state, 'diffusers'


def model_from_pure(pure, cfg):
  """FluxTransformer(cfg) with its parameters set from a pure dict (e.g. `from_diffusers_state_dict`'s)."""
  check_against_model(pure, cfg)
  graphdef, state = nnx.split(transformer.abstract_model(cfg))
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))
  return nnx.merge(graphdef, state)


def num_diffusers_params(state_dict):
  """Elements of a diffusers state dict (the count `transformer.num_params` gives)."""
  return sum(math.prod(np.shape(v)) for v in state_dict.values())
