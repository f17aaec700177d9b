"""What the weight converters share: a model's parameter paths and shapes from `nnx.eval_shape`, pure dicts
as {path tuple: leaf} and back, the state dict checked against the model with ONE ValueError listing every
missing, unexpected and mis-shaped key, and the converted parameters put into the model.

  param_specs(abstract)        {path tuple of str: ShapeDtypeStruct} of a module's nnx.Param leaves
  flatten(pure) / nest(flat)   nested {name: ...} <-> {path tuple: leaf}
  raise_bad_keys(name, ...)    the one error listing all problems (nothing when there are none)
  check_pure(pure, expected)   a pure dict's paths and shapes against param_specs' (one error, first few)
  convert_leaves(...)          one source tensor per parameter (the VAEs): convert, check, fill the state
  stack_blocks(...)            diffusers' per-block tensors `<stack>.{i}.*` -> leaves stacked on a leading
                               'layers' axis (the two-stream DiTs, SD3 and FLUX); `unstack_blocks` inverts it
  joint_dit_name / joint_dit_leaf   our paths <-> diffusers' names in the two-stream DiTs (SD3, FLUX)
  fill_params(...)             the last step: report every bad key at once, then fill the abstract state
  param_state(abstract, pure)  nnx.State of the Params holding a pure dict (a `family.Converter`'s output)
  merge_pure(abstract, pure)   the module holding a pure dict, without random initialisation
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def param_specs(abstract):
  """{path tuple of str: ShapeDtypeStruct} of the nnx.Param leaves of `abstract` (from nnx.eval_shape)."""
  state = nnx.state(abstract, nnx.Param)
  return {tuple(str(p) for p in path): v.get_value() for path, v in nnx.to_flat_state(state)}


def flatten(pure, prefix=()):
  """Nested {name: ... leaf} -> {path tuple of str: leaf}."""
  out = {}
  for k, v in pure.items():
    if isinstance(v, dict):
      out.update(flatten(v, prefix + (str(k),)))
    else:
      out[prefix + (str(k),)] = v
  return out


def nest(flat):
  """{path tuple: leaf} -> nested {name: ... leaf} (the inverse of `flatten`)."""
  out = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out


def raise_bad_keys(name, missing, unexpected, misshaped):
  """Raises one ValueError listing every missing, unexpected and mis-shaped key when there is any; `name` is
  the model, for the message (e.g. 'CosmosDiT(config)')."""
  if missing or unexpected or misshaped:
    raise ValueError(f'state dict does not match {name}:\n'
                     f'  missing ({len(missing)}): {missing}\n'
                     f'  unexpected ({len(unexpected)}): {unexpected}\n'
                     f'  mis-shaped ({len(misshaped)}): {misshaped}')


def check_pure(pure, expected, name, max_listed=10):
  """Raises ValueError when the paths or shapes of a pure parameter dict differ from `expected`
  (`param_specs` of the model `name`), listing the first `max_listed` differences."""
  got = {p: tuple(np.shape(v)) for p, v in flatten(pure).items()}
  diffs = [f'{"/".join(p)}: missing (expected {tuple(expected[p].shape)})' for p in expected if p not in got]
  diffs += [f'{"/".join(p)}: unexpected {got[p]}' for p in got if p not in expected]
  diffs += [f'{"/".join(p)}: got {got[p]}, expected {tuple(expected[p].shape)}'
            for p in expected if p in got and got[p] != tuple(expected[p].shape)]
  if diffs:
    listed = '\n  '.join(diffs[:max_listed])
    more = f'\n  ... and {len(diffs) - max_listed} more' if len(diffs) > max_listed else ''
    raise ValueError(f'parameters do not match {name} ({len(diffs)} differences):\n  {listed}{more}')


def convert_leaves(state_dict, abstract, expected, *, target_path, transform, name):
  """A state dict whose every tensor is one parameter -> nnx.State of `abstract`'s Params (`fill_params`).

  target_path(key) -> the parameter's path tuple; transform(value, path, want_ndim) -> the tensor in our
  layout, or None when its rank cannot fit. A key is unexpected when its path is not in `expected`,
  mis-shaped when the transformed shape differs; a parameter no key filled is missing (unless a mis-shaped
  key was meant for it)."""
  flat, unexpected, misshaped = {}, [], []
  for key, value in state_dict.items():
    path = target_path(key)
    if path not in expected:
      unexpected.append(key)
      continue
    want = tuple(expected[path].shape)
    arr = transform(value, path, len(want))
    if arr is None or tuple(arr.shape) != want:
      misshaped.append(f'{key}: got {tuple(np.shape(value))}, want {want} as {"/".join(path)}')
      continue
    flat[path] = arr
  missing = ['/'.join(p) for p in expected if p not in flat and
             not any(m.endswith('as ' + '/'.join(p)) for m in misshaped)]
  return fill_params(abstract, expected, flat, name=name, missing=missing, unexpected=unexpected,
                     misshaped=misshaped)


def _transpose_linear(value, kind):
  return value.T if kind == 'linear' else value


def _torch_shape(shape, kind):
  return tuple(reversed(shape)) if kind == 'linear' else shape


def stack_blocks(state_dict, expected, *, locate, sizes, names_of, name, to_ours=_transpose_linear,
                 torch_shape=_torch_shape, checks=None):
  """A state dict whose per-block tensors stack on a leading 'layers' axis -> the pure dict of `expected`'s
  parameters (numpy, in their dtypes). Raises one ValueError (`raise_bad_keys`) listing every missing,
  unexpected and mis-shaped key, in the state dict's names.

  locate(key) -> (our path tuple, block index within its stack or None, kind), or None for a key that names
  no parameter; sizes: {stack (a path's first name): number of blocks}; names_of(path) -> (the source names
  of a path, one per block for a stacked one; kind); to_ours(value, kind) -> our layout (default: 'linear'
  transposed, else as is); torch_shape(shape, kind) -> the source shape of a converted shape; checks:
  {key: check(value) -> a problem string or None} for keys that are no parameter (buffers)."""
  flat, stacks, unexpected, misshaped = {}, {}, [], []
  for key, value in state_dict.items():
    if checks and key in checks:
      problem = checks[key](value)
      if problem:
        misshaped.append(problem)
      continue
    found = locate(key)
    if found is None or found[0] not in expected or (found[1] is not None and found[1] >= sizes[found[0][0]]):
      unexpected.append(key)
      continue
    path, index, kind = found
    value = np.asarray(value)
    arr = to_ours(value, kind)
    want = tuple(expected[path].shape[1:] if index is not None else expected[path].shape)
    if arr.shape != want:
      misshaped.append(f'{key}: got {tuple(value.shape)}, expected {torch_shape(want, kind)}')
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
      names, _ = names_of(path)
      have = stacks.get(path, {})
      missing += [n for j, n in enumerate(names) if j not in have]
  bad = {m.split(':', 1)[0] for m in misshaped}       # a mis-shaped key is not also reported missing
  missing = [m for m in missing if m not in bad]
  raise_bad_keys(name, missing, unexpected, misshaped)
  return nest({p: np.asarray(v, dtype=expected[p].dtype) for p, v in flat.items()})


def unstack_blocks(pure, *, names_of, stacks, to_theirs=_transpose_linear):
  """A pure dict -> the state dict {source name: numpy} (`stack_blocks`' inverse): the leaves under a
  `stacks` name are split along their leading axis, one tensor per block. names_of(path) -> (names, kind);
  to_theirs(value, kind) -> the source layout (default: 'linear' transposed, else as is)."""
  out = {}
  for path, value in flatten(pure).items():
    names, kind = names_of(path)
    value = np.asarray(value)
    parts = list(value) if path[0] in stacks else [value]
    for n, part in zip(names, parts):
      out[n] = np.ascontiguousarray(to_theirs(part, kind))
  return out


# ------------------------------------------------------- diffusers names of the two-stream DiTs (SD3, FLUX)
# (ours, diffusers) module sub-paths below a block, '.'-joined: layers.FeedForward's projections (under `ff`
# and `ff_context`) and the attention's output projection.
JOINT_BLOCK_RENAMES = (('ff.proj_in', 'ff.net.0.proj'), ('ff.proj_out', 'ff.net.2'),
                       ('ff_context.proj_in', 'ff_context.net.0.proj'),
                       ('ff_context.proj_out', 'ff_context.net.2'), ('to_out', 'to_out.0'))
JOINT_NORMS = ('norm_q', 'norm_k', 'norm_added_q', 'norm_added_k')    # q/k RMSNorms: `weight` is `scale`


def rename_tail(module, pairs):
  """'.'-joined `module` with its trailing sub-path renamed by the first (src, dst) of `pairs` it ends in."""
  for src, dst in pairs:
    if module == src or module.endswith('.' + src):
      return module[:len(module) - len(src)] + dst
  return module


def joint_dit_name(path, in_block):
  """diffusers' '<module>.<weight|bias>' of a two-stream DiT's parameter path ('/'-joined); in_block: the
  path's first name is its block stack, left out, and the sub-path below it is renamed (JOINT_BLOCK_RENAMES)."""
  parts = path.split('/')
  if parts[-1] not in ('kernel', 'bias', 'scale'):
    raise ValueError(f'{path}: no diffusers name for this parameter')
  module = '.'.join(parts[1:-1] if in_block else parts[:-1])
  if in_block:
    module = rename_tail(module, JOINT_BLOCK_RENAMES)
  return f'{module}.{"bias" if parts[-1] == "bias" else "weight"}'


def joint_dit_leaf(module_key, in_block):
  """diffusers' '<module>.<weight|bias>' (below a block when in_block) -> (our module path tuple, leaf), or
  None when it names no parameter: a `weight` is a `scale` of the JOINT_NORMS, else a `kernel`."""
  if '.' not in module_key:
    return None
  module, suffix = module_key.rsplit('.', 1)
  if in_block:
    module = rename_tail(module, [(b, a) for a, b in JOINT_BLOCK_RENAMES])
  if suffix == 'bias':
    leaf = 'bias'
  elif suffix == 'weight':
    leaf = 'scale' if module.split('.')[-1] in JOINT_NORMS else 'kernel'
  else:
    return None
  return tuple(module.split('.')), leaf


def fill_params(abstract, expected, flat, *, name, missing, unexpected, misshaped):
  """Raises one ValueError listing all problems, else returns `abstract`'s Params filled from `flat`.

  Args:
    abstract: the model from `nnx.eval_shape`.
    expected: {path tuple: ShapeDtypeStruct} of its Params.
    flat: {path tuple: numpy array} converted tensors, shapes already checked.
    name: the model, for the message (e.g. 'CosmosDiT(config)').
    missing, unexpected, misshaped: lists of human-readable key descriptions.
  """
  raise_bad_keys(name, missing, unexpected, misshaped)
  state = nnx.state(abstract, nnx.Param)
  for path, variable in nnx.to_flat_state(state):
    key = tuple(str(p) for p in path)
    variable.set_value(flat[key].astype(expected[key].dtype))
  return state


def param_state(abstract, pure):
  """nnx.State of the Params of `abstract` (from nnx.eval_shape) holding the pure dict `pure`."""
  state = nnx.state(abstract, nnx.Param)
  nnx.replace_by_pure_dict(state, pure)
  return state


def merge_pure(abstract, pure):
  """The module `abstract` (from nnx.eval_shape, Params only) with its parameters set from `pure` (device
  arrays), without random initialisation."""
  graphdef, state = nnx.split(abstract)
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))
  return nnx.merge(graphdef, state)
