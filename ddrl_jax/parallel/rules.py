"""Logical axis rules: the logical names on parameters and activations -> mesh axes, as config data.

Models name the axes of their parameters (`nnx.with_partitioning(..., ('embed', 'heads'))`) and of their
activations (`partitioning.constrain(x, ('act_batch', 'act_seq', 'act_heads', None))`); nothing in a model
knows the mesh. `config.sharding.rules` maps each name to a comma-separated list of mesh axes ('' =
replicated), so a user changes the layout from the command line:

    --config.sharding.rules.embed=fsdp,context      # FSDP over 16 devices instead of 8
    --config.sharding.fsdp_axes=fsdp,context        # the same for every parameter rule (maxdiffusion)

Parameter rules are the names without the 'act_' prefix; `fsdp_axes` replaces the axis 'fsdp' in them
(and only in them: the batch of activations stays on (data, fsdp)). A dimension that the product of its
mesh axes does not divide drops axes from the end until it does, with a log line; an axis of size 1 is
left out (it shards nothing), and an axis already used by an earlier dimension of the same array is
dropped (a mesh axis can shard one dimension only).
"""
import logging
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

logger = logging.getLogger(__name__)

# The shared vocabulary of logical names -> mesh axes. Every model family names its axes with these (and
# adds its own through its `logical_rules()`, merged into config.sharding.rules by its configs and under
# them by `ShardingPlan.from_config`). Parameters are FSDP-sharded on their model-width dimension and
# replicated over data (HSDP, as cosmos-rl); activations split the batch over (data, fsdp) and the token
# sequence over context.
DEFAULT_RULES = {
    'layers': '',              # the stacked-blocks axis (scanned over: never sharded)
    'embed': 'fsdp',           # model width D
    'cross_embed': 'fsdp',     # width of the conditioning context (text) the attention reads
    'heads': 'tensor',         # N * Hd of q/k/v/o
    'mlp': 'tensor',           # MLP hidden (4D)
    'kv': '',                  # per-head q/k RMSNorm scales (Hd)
    'act_batch': 'data,fsdp',  # rollout slots / samples
    'act_seq': 'context',      # tokens S (frame-major for video, so contiguous frames)
    'act_heads': 'tensor',
    'act_embed': '',
    'act_mlp': 'tensor',
    'act_kv': '',              # head dim
    'act_text': '',            # the L context tokens of cross-attention
}
SEQUENCE_NAMES = ('act_seq',)  # activation names of the token sequence (context parallelism splits them)


def is_activation_rule(name):
  return name.startswith('act_')


def _axes(value):
  """'data,fsdp' -> ('data', 'fsdp'); '' or None -> ()."""
  if value is None:
    return ()
  if isinstance(value, (tuple, list)):
    return tuple(a for a in value if a)
  return tuple(a.strip() for a in str(value).split(',') if a.strip())


def resolve_rules(rules, fsdp_axes='fsdp', mesh_axes=None):
  """{logical name: mesh axes tuple} from config-style rules, with 'fsdp' expanded to `fsdp_axes` in the
  parameter rules. Raises ValueError naming `config.sharding.rules.<name>` for an unknown mesh axis."""
  fsdp = _axes(fsdp_axes)
  out = {}
  for name, value in dict(rules).items():
    axes = _axes(value)
    if not is_activation_rule(name):
      axes = tuple(a for ax in axes for a in (fsdp if ax == 'fsdp' else (ax,)))
    if mesh_axes is not None:
      bad = [a for a in axes if a not in mesh_axes]
      if bad:
        raise ValueError(f'config.sharding.rules.{name}={value!r}: unknown mesh axes {bad}; the mesh has '
                         f'{tuple(mesh_axes)}')
    out[name] = axes
  return out


_logged_drops = set()


def _log_drop(what, dim, axes, kept):
  """Logs once per case: at WARNING for parameters (replicated: more memory per device), DEBUG for
  activations and data (whose batch of B groups or of one example inside vmap routinely does not
  divide)."""
  key = (what, dim, axes, kept)
  if key not in _logged_drops:
    _logged_drops.add(key)
    level = logging.DEBUG if what.startswith(('activation', 'data')) else logging.WARNING
    logger.log(level, 'sharding: %s dimension of size %d does not divide over %s; using %s', what, dim,
               axes, kept or 'no axis (replicated)')


def mesh_spec(logical, shape, rules, axis_sizes, what='array'):
  """The PartitionSpec of an array of `shape` whose dimensions carry the `logical` names.

  Args:
    logical: tuple of logical names (or None) per leading dimension; shorter than shape = trailing None.
    shape: the array's shape.
    rules: resolved rules {name: mesh axes tuple} (`resolve_rules`).
    axis_sizes: {mesh axis: size}.
    what: a name for log lines and errors (e.g. the parameter's path).
  Raises ValueError for a logical name without a rule.
  """
  logical = tuple(logical or ())
  if len(logical) > len(shape):
    raise ValueError(f'{what}: {len(logical)} logical names {logical} for an array of shape {shape}')
  used, out = set(), []
  for dim, name in zip(shape, logical + (None,) * (len(shape) - len(logical))):
    if name is None:
      out.append(None)
      continue
    if name not in rules:
      raise ValueError(f'{what}: no rule for the logical axis {name!r} in config.sharding.rules '
                       f'(known: {sorted(rules)})')
    axes = [a for a in rules[name] if a not in used and axis_sizes.get(a, 1) > 1]
    wanted = tuple(axes)
    while axes and dim % math.prod(axis_sizes[a] for a in axes):
      axes.pop()
    if tuple(axes) != wanted:
      _log_drop(f'{what} ({name})', dim, wanted, tuple(axes))
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def _is_variable(x):
  return isinstance(x, nnx.Variable)


def logical_names(tree):
  """[(path string, logical names or None, shape)] per leaf of a (possibly abstract) parameter tree.

  nnx Variables carry their names as metadata; a plain array leaf has none (replicated)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)
  out = []
  for path, leaf in flat:
    names = nnx.spmd.get_var_pspec(leaf) if _is_variable(leaf) else None
    value = leaf.get_value() if _is_variable(leaf) else leaf
    out.append((jax.tree_util.keystr(path), tuple(names) if names is not None else None,
                tuple(np.shape(value))))
  return out


def param_specs(tree, rules, axis_sizes):
  """A tree of PartitionSpecs with the structure of `tree` (one per array leaf)."""
  specs = [mesh_spec(names, shape, rules, axis_sizes, path) for path, names, shape in logical_names(tree)]
  return jax.tree.unflatten(jax.tree.structure(tree), specs)


def param_shardings(tree, mesh, rules):
  """NamedShardings for a parameter tree on `mesh` (an abstract mesh works: no devices needed)."""
  specs = param_specs(tree, rules, dict(mesh.shape))
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def spec_bytes(shape, dtype, spec, axis_sizes):
  """(per-device bytes, total bytes) of one array under `spec`."""
  total = math.prod(shape) * np.dtype(dtype).itemsize
  shards = math.prod(axis_sizes[a] for entry in spec if entry is not None
                     for a in (entry if isinstance(entry, tuple) else (entry,)))
  return total // shards, total


def sharding_report(abstract, shardings):
  """Bytes of an abstract tree under its shardings.

  Returns dict(total_bytes, per_device_bytes, replicated_bytes, replicated_fraction, largest_replicated:
  [(path, bytes)] of the 5 largest fully replicated leaves).
  """
  arrays = jax.tree_util.tree_flatten_with_path(abstract)[0]
  shards = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  if len(arrays) != len(shards):
    raise ValueError(f'{len(arrays)} arrays but {len(shards)} shardings')
  total = per_device = replicated = 0
  rep_leaves = []
  for (path, a), s in zip(arrays, shards):
    dev, tot = spec_bytes(a.shape, a.dtype, s.spec, dict(s.mesh.shape))
    total += tot
    per_device += dev
    if dev == tot:
      replicated += tot
      rep_leaves.append((jax.tree_util.keystr(path), tot))
  rep_leaves.sort(key=lambda x: -x[1])
  return dict(total_bytes=total, per_device_bytes=per_device, replicated_bytes=replicated,
              replicated_fraction=replicated / max(total, 1), largest_replicated=rep_leaves[:5])


def assert_sufficiently_sharded(abstract_params, shardings, max_fraction):
  """Raises ValueError when more than `max_fraction` of the parameter bytes are replicated on a mesh
  whose parameter axes shard anything (MaxText's assert_params_sufficiently_sharded). Returns the report."""
  report = sharding_report(abstract_params, shardings)
  if report['replicated_fraction'] > max_fraction:
    largest = ', '.join(f'{p} ({b / 2**20:.1f} MiB)' for p, b in report['largest_replicated'])
    raise ValueError(
        f'{100 * report["replicated_fraction"]:.1f}% of the parameter bytes are replicated, more than '
        f'config.sharding.max_replicated_fraction = {max_fraction}; largest replicated: {largest}. '
        f'Map their logical axes in config.sharding.rules, or use mesh.data instead of mesh.fsdp for a '
        f'model without logical axis names.')
  return report
