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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddrl_jax.models.sd3 import mmdit

POS_EMBED_KEY = 'pos_embed.pos_embed'
_BLOCK_RE = re.compile(r'transformer_blocks\.(\d+)\.(.+)')
_NORMS = ('norm_q', 'norm_k', 'norm_added_q', 'norm_added_k')
# (ours, diffusers) renames of module sub-paths, '.'-joined.
_RENAMES = (('ff.proj_in', 'ff.net.0.proj'), ('ff.proj_out', 'ff.net.2'),
            ('ff_context.proj_in', 'ff_context.net.0.proj'), ('ff_context.proj_out', 'ff_context.net.2'),
            ('to_out', 'to_out.0'))
_STACKS = ('dual_blocks', 'joint_blocks')


def _block_ranges(cfg):
  """{stack or 'last_block': the diffusers block indices it holds}."""
  return {'dual_blocks': range(0, cfg.num_dual),
          'joint_blocks': range(cfg.num_dual, cfg.num_dual + cfg.num_joint),
          'last_block': range(cfg.num_layers - 1, cfg.num_layers)}


def _rename(module, pairs):
  for src, dst in pairs:
    if module == src or module.endswith('.' + src):
      return module[:len(module) - len(src)] + dst
  return module


def _kind(module, leaf):
  """'patch' (the Conv2d), 'linear' (transposed) or 'vector' (copied) for a module path and leaf."""
  if leaf == 'kernel':
    return 'patch' if module == 'pos_embed.proj' else 'linear'
  return 'vector'


def diffusers_names(path, cfg):
  """diffusers keys of one parameter path ('dual_blocks/attn/to_q/kernel'): one per block for a stacked
  leaf, else one; and the leaf's kind ('linear': transposed, 'patch': the conv, 'vector': as is)."""
  parts = path.split('/')
  head, module, leaf = parts[0], '.'.join(parts[:-1]), parts[-1]
  if leaf not in ('kernel', 'bias', 'scale'):
    raise ValueError(f'{path}: no diffusers name for this parameter')
  kind = _kind(module, leaf)
  suffix = 'bias' if leaf == 'bias' else 'weight'
  if head in _block_ranges(cfg):
    rest = _rename('.'.join(parts[1:-1]), _RENAMES)
    return [f'transformer_blocks.{i}.{rest}.{suffix}' for i in _block_ranges(cfg)[head]], kind
  return [f'{module}.{suffix}'], kind


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
  if '.' not in module_key:
    return None
  module, suffix = module_key.rsplit('.', 1)
  module = _rename(module, [(b, a) for a, b in _RENAMES]) if m else module
  if suffix == 'bias':
    leaf = 'bias'
  elif suffix == 'weight':
    leaf = 'scale' if module.split('.')[-1] in _NORMS else 'kernel'
  else:
    return None
  return head + tuple(module.split('.')) + (leaf,), index, _kind('.'.join(head + (module,)), leaf)


def abstract_params(cfg):
  """{path tuple: ShapeDtypeStruct} of MMDiT(cfg)'s nnx.Param leaves (jax.eval_shape, no allocation)."""
  state = nnx.state(mmdit.abstract_model(cfg), nnx.Param)
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
  """Raises ValueError when the paths or shapes of a pure parameter dict differ from jax.eval_shape of
  MMDiT(cfg), listing the first `max_listed` differences."""
  expected = abstract_params(cfg)
  got = {p: tuple(np.shape(v)) for p, v in _flatten(pure).items()}
  diffs = [f'{"/".join(p)}: missing (expected {tuple(expected[p].shape)})' for p in expected if p not in got]
  diffs += [f'{"/".join(p)}: unexpected {got[p]}' for p in got if p not in expected]
  diffs += [f'{"/".join(p)}: got {got[p]}, expected {tuple(expected[p].shape)}'
            for p in expected if p in got and got[p] != tuple(expected[p].shape)]
  if diffs:
    listed = '\n  '.join(diffs[:max_listed])
    more = f'\n  ... and {len(diffs) - max_listed} more' if len(diffs) > max_listed else ''
    raise ValueError(f'parameters do not match MMDiT({cfg}) ({len(diffs)} differences):\n  {listed}{more}')


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
  expected = abstract_params(cfg)
  sizes = {name: len(r) for name, r in _block_ranges(cfg).items()}
  flat, stacks, unexpected, misshaped = {}, {}, [], []
  for key, value in state_dict.items():
    if key == POS_EMBED_KEY:
      problem = _check_pos_embed(value, cfg)
      if problem:
        misshaped.append(problem)
      continue
    found = _our_path(key, cfg)
    if found is None or found[0] not in expected:
      unexpected.append(key)
      continue
    path, index, kind = found
    arr = _to_ours(value, kind)
    want = tuple(expected[path].shape[1:] if index is not None else expected[path].shape)
    if arr.shape != want:
      misshaped.append(f'{key}: got {tuple(np.shape(value))}, expected {_torch_shape(want, kind, cfg)}')
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
    if path in flat:
      continue
    names, _ = diffusers_names('/'.join(path), cfg)
    have = stacks.get(path, {})
    missing += [n for j, n in enumerate(names) if j not in have]
  # A mis-shaped key is reported as such, not also as missing.
  bad = {m.split(':', 1)[0] for m in misshaped}
  missing = [m for m in missing if m not in bad]
  if missing or unexpected or misshaped:
    raise ValueError(f'state dict does not match SD3 MMDiT({cfg}):\n'
                     f'  missing ({len(missing)}): {missing}\n'
                     f'  unexpected ({len(unexpected)}): {unexpected}\n'
                     f'  mis-shaped ({len(misshaped)}): {misshaped}')
  pure = _nest({p: np.asarray(v, dtype=expected[p].dtype) for p, v in flat.items()})
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
  out = {}
  for path, value in _flatten(pure).items():
    names, kind = diffusers_names('/'.join(path), cfg)
    value = np.asarray(value)
    parts = list(value) if path[0] in _STACKS else [value]
    for name, part in zip(names, parts):
      if kind == 'linear':
        part = part.T
      elif kind == 'patch':
        part = part.T.reshape(-1, c, p, p)
      out[name] = np.ascontiguousarray(part)
  if with_pos_embed:
    out[POS_EMBED_KEY] = mmdit.pos_embed_table(cfg)
  return out


def model_from_pure(pure, cfg):
  """MMDiT(cfg) with its parameters set from a pure dict (e.g. `from_diffusers_state_dict`'s)."""
  check_against_model(pure, cfg)
  graphdef, state = nnx.split(mmdit.abstract_model(cfg))
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))
  return nnx.merge(graphdef, state)


def num_diffusers_params(state_dict):
  """Elements of a diffusers state dict without the pos_embed buffer (the count `mmdit.num_params` gives)."""
  return sum(math.prod(np.shape(v)) for k, v in state_dict.items() if k != POS_EMBED_KEY)
