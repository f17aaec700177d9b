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

import numpy as np

from ddrl_jax.models import checked_state
from ddrl_jax.models.flux import transformer

STACKS = ('transformer_blocks', 'single_transformer_blocks')
_BLOCK_RE = re.compile(r'(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)')
# diffusers config.json fields that fix the architecture (FluxConfig's names).
ARCH_FIELDS = ('patch_size', 'in_channels', 'out_channels', 'num_layers', 'num_single_layers',
               'attention_head_dim', 'num_attention_heads', 'joint_attention_dim', 'pooled_projection_dim',
               'guidance_embeds', 'axes_dims_rope')


def _stack_sizes(cfg):
  return {'transformer_blocks': cfg.num_layers, 'single_transformer_blocks': cfg.num_single_layers}


def diffusers_names(path, cfg):
  """diffusers keys of one parameter path ('transformer_blocks/attn/to_q/kernel'): one per block for a
  stacked leaf, else one; and the leaf's kind ('linear': transposed, 'vector': as is)."""
  parts = path.split('/')
  name = checked_state.joint_dit_name(path, in_block=parts[0] in STACKS)
  kind = 'linear' if parts[-1] == 'kernel' else 'vector'
  if parts[0] in STACKS:
    return [f'{parts[0]}.{i}.{name}' for i in range(_stack_sizes(cfg)[parts[0]])], kind
  return [name], kind


def _our_path(key):
  """diffusers key -> (our path tuple, block index or None, kind), or None when it names no parameter."""
  m = _BLOCK_RE.fullmatch(key)
  head, index, module_key = (), None, key
  if m:
    head, index, module_key = (m.group(1),), int(m.group(2)), m.group(3)
  found = checked_state.joint_dit_leaf(module_key, in_block=bool(m))
  if found is None:
    return None
  module, leaf = found
  return head + module + (leaf,), index, 'linear' if leaf == 'kernel' else 'vector'


def abstract_params(cfg):
  """{path tuple: ShapeDtypeStruct} of FluxTransformer(cfg)'s nnx.Param leaves (nnx.eval_shape)."""
  return checked_state.param_specs(transformer.abstract_model(cfg))


def check_against_model(pure, cfg, max_listed=10):
  """Raises ValueError when the paths or shapes of a pure parameter dict differ from nnx.eval_shape of
  FluxTransformer(cfg), listing the first `max_listed` differences."""
  checked_state.check_pure(pure, abstract_params(cfg), f'FluxTransformer({cfg})', max_listed)


def from_diffusers_state_dict(state_dict, cfg):
  """diffusers FluxTransformer2DModel state dict {key: array} -> pure parameter dict of
  FluxTransformer(cfg) (numpy, in cfg.param_dtype).

  Raises one ValueError listing every missing, unexpected and mis-shaped key (diffusers names).
  """
  pure = checked_state.stack_blocks(state_dict, abstract_params(cfg), locate=_our_path, sizes=_stack_sizes(cfg),
                                    names_of=lambda path: diffusers_names('/'.join(path), cfg),
                                    name=f'FluxTransformer({cfg})')
  check_against_model(pure, cfg)
  return pure


def to_diffusers_state_dict(pure, cfg):
  """Pure parameter dict of FluxTransformer(cfg) -> diffusers state dict {key: numpy array} (Linear
  weights (out, in), per-block tensors unstacked): the inverse of `from_diffusers_state_dict`."""
  check_against_model(pure, cfg)
  return checked_state.unstack_blocks(pure, names_of=lambda path: diffusers_names('/'.join(path), cfg),
                                      stacks=STACKS)


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
  pure = from_diffusers_state_dict(state_dict, cfg)
  return checked_state.param_state(transformer.abstract_model(cfg), pure), 'diffusers'


def model_from_pure(pure, cfg):
  """FluxTransformer(cfg) with its parameters set from a pure dict (e.g. `from_diffusers_state_dict`'s)."""
  check_against_model(pure, cfg)
  return checked_state.merge_pure(transformer.abstract_model(cfg), pure)


def num_diffusers_params(state_dict):
  """Elements of a diffusers state dict (the count `transformer.num_params` gives)."""
  return sum(math.prod(np.shape(v)) for v in state_dict.values())
