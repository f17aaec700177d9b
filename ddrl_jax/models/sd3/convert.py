"""diffusers `SD3Transformer2DModel` state dicts <-> `MMDiT` parameters (pure dicts).

`from_diffusers_state_dict(sd, cfg)` returns the nested dict of numpy arrays that
`nnx.to_pure_dict(nnx.state(MMDiT(cfg), nnx.Param))` has: Linear weights (out, in) become kernels (in, out),
the patch Conv2d weight (D, C, p, p) becomes the (C*p*p, D) kernel of `pos_embed/proj`, and the tensors of
`transformer_blocks.{i}` are stacked on a leading 'layers' axis into `dual_blocks` (blocks 0..k-1) and
`joint_blocks` (k..num_layers-2); the last block is `last_block`. `to_diffusers_state_dict(pure, cfg)` is
the inverse and also writes diffusers' persistent buffer `pos_embed.pos_embed` (the fixed sin-cos table,
not a parameter here; when the source has it, it is checked against `mmdit.pos_embed_table`).

Names (`diffusers_names`): below a block or the model, a module path maps one to one with '/' for '.',
except `to_out.0` <-> `to_out`, `ff.net.0.proj` <-> `ff/proj_in`, `ff.net.2` <-> `ff/proj_out` (and the
same under `ff_context`); a Linear's `weight` is `kernel`, a norm's `weight` is `scale`.

Usage:
  pure = from_diffusers_state_dict({k: v.numpy() for k, v in sd.items()}, cfg)
  model = model_from_pure(pure, cfg)
"""
import math
import re

import numpy as np

from ddrl_jax.models import checked_state
from ddrl_jax.models.sd3 import mmdit

POS_EMBED_KEY = 'pos_embed.pos_embed'
_BLOCK_RE = re.compile(r'transformer_blocks\.(\d+)\.(.+)')
_STACKS = ('dual_blocks', 'joint_blocks')


def _block_ranges(cfg):
  """{stack or 'last_block': the diffusers block indices it holds}."""
  return {'dual_blocks': range(0, cfg.num_dual),
          'joint_blocks': range(cfg.num_dual, cfg.num_dual + cfg.num_joint),
          'last_block': range(cfg.num_layers - 1, cfg.num_layers)}


def _kind(module, leaf):
  """'patch' (the Conv2d), 'linear' (transposed) or 'vector' (copied) for a module path and leaf."""
  if leaf == 'kernel':
    return 'patch' if module == 'pos_embed.proj' else 'linear'
  return 'vector'


def diffusers_names(path, cfg):
  """diffusers keys of one parameter path ('dual_blocks/attn/to_q/kernel'): one per block for a stacked
  leaf, else one; and the leaf's kind ('linear': transposed, 'patch': the conv, 'vector': as is)."""
  parts = path.split('/')
  ranges = _block_ranges(cfg)
  name = checked_state.joint_dit_name(path, in_block=parts[0] in ranges)
  kind = _kind('.'.join(parts[:-1]), parts[-1])
  if parts[0] in ranges:
    return [f'transformer_blocks.{i}.{name}' for i in ranges[parts[0]]], kind
  return [name], kind


def _our_path(key, cfg):
  """diffusers key -> (our path tuple, index within its stack or None, kind), or None if unknown."""
  m = _BLOCK_RE.fullmatch(key)
  module_key, index, head = key, None, ()
  if m:
    i, module_key = int(m.group(1)), m.group(2)
    for name, indices in _block_ranges(cfg).items():
      if i in indices:
        head, index = (name,), (i - indices.start if name in _STACKS else None)
        break
    else:
      return None
  found = checked_state.joint_dit_leaf(module_key, in_block=bool(m))
  if found is None:
    return None
  module, leaf = found
  return head + module + (leaf,), index, _kind('.'.join(head + module), leaf)


def abstract_params(cfg):
  """{path tuple: ShapeDtypeStruct} of MMDiT(cfg)'s nnx.Param leaves (jax.eval_shape, no allocation)."""
  return checked_state.param_specs(mmdit.abstract_model(cfg))


def check_against_model(pure, cfg, max_listed=10):
  """Raises ValueError when the paths or shapes of a pure parameter dict differ from jax.eval_shape of
  MMDiT(cfg), listing the first `max_listed` differences."""
  checked_state.check_pure(pure, abstract_params(cfg), f'MMDiT({cfg})', max_listed)


def _to_ours(value, kind):
  value = np.asarray(value)
  if kind == 'linear':
    return value.T
  if kind == 'patch':
    return value.reshape(value.shape[0], -1).T     # (D, C, p, p) -> (C*p*p, D), features (c, ph, pw)
  return value


def _check_pos_embed(value, cfg):
  """The buffer must be diffusers' table for cfg (else sample_size / pos_embed_max_size differ)."""
  want = mmdit.pos_embed_table(cfg)
  value = np.asarray(value)
  if value.shape != want.shape:
    return f'{POS_EMBED_KEY}: got {value.shape}, expected {want.shape} (pos_embed_max_size={cfg.pos_embed_max_size})'
  err = float(np.max(np.abs(value.astype(np.float32) - want)))
  if err > 1e-4:
    return (f'{POS_EMBED_KEY}: differs from the sin-cos table of sample_size={cfg.sample_size}, '
            f'pos_embed_max_size={cfg.pos_embed_max_size} by {err:.3g}')
  return None


def from_diffusers_state_dict(state_dict, cfg):
  """diffusers SD3Transformer2DModel state dict {key: array} -> pure parameter dict of MMDiT(cfg).

  Raises one ValueError listing every missing, unexpected and mis-shaped key (diffusers names). The
  buffer `pos_embed.pos_embed` is optional; when present it is checked against the table cfg implies.
  """
  pure = checked_state.stack_blocks(
      state_dict, abstract_params(cfg), locate=lambda key: _our_path(key, cfg),
      sizes={name: len(r) for name, r in _block_ranges(cfg).items()},
      names_of=lambda path: diffusers_names('/'.join(path), cfg), name=f'SD3 MMDiT({cfg})', to_ours=_to_ours,
      torch_shape=lambda shape, kind: _torch_shape(shape, kind, cfg),
      checks={POS_EMBED_KEY: lambda value: _check_pos_embed(value, cfg)})
  check_against_model(pure, cfg)
  return pure


def _torch_shape(shape, kind, cfg):
  """diffusers' shape of a tensor whose converted shape is `shape`."""
  if kind == 'linear':
    return tuple(reversed(shape))
  if kind == 'patch':
    return (shape[1], cfg.in_channels, cfg.patch_size, cfg.patch_size)
  return shape


def to_diffusers_state_dict(pure, cfg, with_pos_embed=True):
  """Pure parameter dict of MMDiT(cfg) -> diffusers state dict {key: numpy array} (Linear weights
  (out, in), the patch Conv2d weight (D, C, p, p), per-block tensors unstacked), plus the buffer
  `pos_embed.pos_embed` unless with_pos_embed=False. The inverse of `from_diffusers_state_dict`."""
  check_against_model(pure, cfg)
  p, c = cfg.patch_size, cfg.in_channels

  def to_theirs(part, kind):
    if kind == 'linear':
      return part.T
    if kind == 'patch':
      return part.T.reshape(-1, c, p, p)
    return part

  out = checked_state.unstack_blocks(pure, names_of=lambda path: diffusers_names('/'.join(path), cfg),
                                     stacks=_STACKS, to_theirs=to_theirs)
  if with_pos_embed:
    out[POS_EMBED_KEY] = mmdit.pos_embed_table(cfg)
  return out


def model_from_pure(pure, cfg):
  """MMDiT(cfg) with its parameters set from a pure dict (e.g. `from_diffusers_state_dict`'s)."""
  check_against_model(pure, cfg)
  return checked_state.merge_pure(mmdit.abstract_model(cfg), pure)


def state_from_diffusers(state_dict, cfg):
  """(nnx.State of MMDiT(cfg)'s Params, 'diffusers'): a `models.family.Converter`'s convert."""
  pure = from_diffusers_state_dict(state_dict, cfg)
  return checked_state.param_state(mmdit.abstract_model(cfg), pure), 'diffusers'


def num_diffusers_params(state_dict):
  """Elements of a diffusers state dict without the pos_embed buffer (the count `mmdit.num_params` gives)."""
  return sum(math.prod(np.shape(v)) for k, v in state_dict.items() if k != POS_EMBED_KEY)
