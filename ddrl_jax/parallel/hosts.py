"""Which batch rows each process holds, and global arrays built from every process's own rows.

On a pod every host runs the same program but holds only some rows of each batch: the rows its devices
hold under the batch sharding. Hosts that differ only in their context or tensor coordinates hold the
*same* rows (the replicas of one rollout share its condition, its sample and its reward), hosts that
differ in data/fsdp hold disjoint ones. So, unlike maxdiffusion and MaxText, which split the batch over
every mesh axis, the unit here is a *row set*: the processes with one row set read the same records,
and the lowest-numbered of them (its "lead") decodes and scores the set's rollouts; the others receive
the scores in a small all-gather. With one process everything here is the identity.

  rows = row_split(plan.batch(), num_rows)     # this process's rows of a (num_rows, ...) batch
  x = assemble(local_tree, plan.batch(), num_rows)            # global jax.Arrays from per-host rows
  host = local_values(x, rows.mine)            # this host's rows of a global array, as numpy
  full = exchange(scores_of_my_rows, rows)     # (num_rows, ...) on every host, each row from its lead
"""
import dataclasses
import functools
from typing import Dict

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class RowSplit:
  """The rows of a leading axis of length `num_rows` held by each process under one sharding.

  of_process: {process index: ascending (k,) int array of global rows}.
  process: the process this split is seen from (jax.process_index()).
  """
  num_rows: int
  of_process: Dict[int, np.ndarray]
  process: int

  @property
  def mine(self):
    """(k,) ascending global rows this process holds."""
    return self.of_process[self.process]

  @functools.cached_property
  def row_sets(self):
    """The distinct row sets (tuples), ordered by their first row."""
    return sorted({tuple(r.tolist()) for r in self.of_process.values()}, key=lambda t: t[0])

  @functools.cached_property
  def _lead_of(self):
    first = {}
    for p in sorted(self.of_process):
      first.setdefault(tuple(self.of_process[p].tolist()), p)
    return {p: first[tuple(r.tolist())] for p, r in self.of_process.items()}

  def lead_of(self, process):
    """The lowest process holding the same rows as `process`."""
    return self._lead_of[process]

  @functools.cached_property
  def leads(self):
    """Sorted processes that lead their row set (one per distinct set)."""
    return sorted(set(self._lead_of.values()))

  @property
  def is_lead(self):
    return self.lead_of(self.process) == self.process

  def lead_entries(self, table):
    """The leads' entries (in `leads` order) of an `allgather` table, whose axis 0 is in process order."""
    processes = sorted(self.of_process)
    return np.stack([table[processes.index(p)] for p in self.leads])


def row_split(sharding, num_rows, process=None):
  """The RowSplit of the leading axis of a (num_rows, ...) array under `sharding` (any rank; only the
  leading axis is looked at). Raises ValueError when two processes' rows overlap without being equal
  (a mesh layout whose replicas of one row straddle row-set boundaries, which no loader key can serve)."""
  per = {}
  for device, index in sharding.devices_indices_map((num_rows,)).items():
    per.setdefault(device.process_index, set()).update(range(*index[0].indices(num_rows)))
  of_process = {p: np.asarray(sorted(r), np.int64) for p, r in sorted(per.items())}
  sets = {tuple(r.tolist()) for r in of_process.values()}
  seen = set()
  for s in sets:
    if seen & set(s):
      raise ValueError(f'mesh layout: processes hold partially overlapping batch rows ({sorted(sets)[:4]} '
                       '...); each process must hold whole row sets shared only with its context/tensor '
                       'replicas. Reorder the mesh (config.mesh) or the batch size.')
    seen |= set(s)
  return RowSplit(num_rows, of_process, jax.process_index() if process is None else process)


def assemble(local, sharding, num_rows):
  """Global jax.Arrays (leading axis `num_rows`, sharded by `sharding`) from this process's rows.

  `local` is a tree of host arrays whose leading axis holds this process's rows in ascending order
  (`RowSplit.mine`); jax.make_array_from_process_local_data maps them onto the local devices."""
  def one(a):
    a = np.asarray(a)
    return jax.make_array_from_process_local_data(sharding, a, (num_rows,) + a.shape[1:])

  return jax.tree.map(one, local)


def local_values(x, rows):
  """Host numpy of the global rows `rows` (ascending, addressable here) of a jax.Array whose leading
  axis is sharded; replicated copies are read once."""
  if x.is_fully_addressable:
    return np.asarray(x)[np.asarray(rows)]
  blocks = {}
  for shard in x.addressable_shards:
    start, stop, _ = shard.index[0].indices(x.shape[0]) if shard.index else (0, x.shape[0], 1)
    if start not in blocks:
      blocks[start] = (stop, shard.data)
  index = {}
  for start, (stop, _) in blocks.items():
    for r in range(start, stop):
      index[r] = start
  missing = [int(r) for r in rows if int(r) not in index]
  if missing:
    raise ValueError(f'rows {missing[:8]} of a {x.shape} array are not held by process '
                     f'{jax.process_index()}')
  host = {start: np.asarray(data) for start, (_, data) in blocks.items()}
  return np.stack([host[index[int(r)]][int(r) - index[int(r)]] for r in rows])


def allgather(value):
  """(num_processes, *value.shape): every process's `value` (equal shapes), on every process."""
  value = np.asarray(value)
  if jax.process_count() == 1:
    return value[None]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(value, tiled=False))


def exchange(mine, split):
  """(num_rows, ...) on every process: row r from the lead of its row set's `mine` (this process's
  values for `split.mine`, in that order; non-leads pass anything of the same shape)."""
  mine = np.asarray(mine)
  if mine.shape[0] != len(split.mine):
    raise ValueError(f'exchange: {mine.shape[0]} values for {len(split.mine)} rows')
  out = np.zeros((split.num_rows,) + mine.shape[1:], mine.dtype)
  for p, values in zip(split.leads, split.lead_entries(allgather(mine))):
    out[split.of_process[p]] = values
  return out


def gather_global(x):
  """Host numpy of a whole global jax.Array on every process (small arrays: eval grids, 2-D points)."""
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def mean_over_leads(metrics, weight, split):
  """The `weight`-weighted mean of each lead process's `metrics` dict (non-leads pass None), the same
  on every process; a lead's NaN (e.g. no finite sample in its rows) is left out of that metric's mean.
  Exact for metrics that are means over samples; for others (a standard deviation) it is the mean of
  the row sets' values. Leads must report the same keys. One lead: its metrics unchanged."""
  keys = [str(k) for k in allgather_keys(sorted(metrics) if metrics is not None else [])]
  vec = np.asarray([float(metrics[k]) for k in keys] + [float(weight)] if metrics is not None
                   else [np.nan] * len(keys) + [0.0], np.float64)
  rows = split.lead_entries(allgather(vec))
  if len(rows) == 1:              # no mean to take: the lead's values as they are
    return dict(zip(keys, rows[0, :-1].tolist()))
  out = {}
  for i, k in enumerate(keys):
    w = np.where(np.isfinite(rows[:, i]), rows[:, -1], 0.0)
    out[k] = float(np.sum(np.nan_to_num(rows[:, i]) * w) / np.sum(w)) if w.sum() else float('nan')
  return out


def allgather_keys(keys):
  """The metric names of process 0 (whose set every lead must share), on every process."""
  if jax.process_count() == 1:
    return keys
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  encoded = np.frombuffer('\n'.join(keys).encode().ljust(4096, b'\0'), np.uint8)
  if len(encoded) > 4096:
    raise ValueError('mean_over_leads: metric names longer than 4 KiB in all')
  shared = np.asarray(multihost_utils.broadcast_one_to_all(encoded))
  text = shared.tobytes().rstrip(b'\0').decode()
  names = text.split('\n') if text else []
  if keys and sorted(keys) != sorted(names):
    raise ValueError(f'process {jax.process_index()} reports metrics {keys}, process 0 {names}')
  return names


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """Where the rows of an iteration's batches live: B groups of N rollout slots, and the B-row data.

  slots: RowSplit of the (B*N, ...) rollout batch.  data: RowSplit of the (B, ...) data batch.
  groups: (G,) ascending groups whose condition (record) this process needs: its slots' groups and
    its data rows. Local condition trees have G rows in this order.
  shard_index, shard_count: the record loader's key. Processes needing the same groups (context or
    tensor replicas on other hosts) get the same index and read identical records; others disjoint ones.
  """
  group_size: int
  slots: RowSplit
  data: RowSplit
  groups: np.ndarray
  shard_index: int
  shard_count: int

  def slots_from_groups(self, tree):
    """A (G, ...) tree of this process's groups -> its slot rows (len(slots.mine), ...)."""
    pos = np.searchsorted(self.groups, self.slots.mine // self.group_size)
    return jax.tree.map(lambda a: np.asarray(a)[pos], tree)

  def data_from_groups(self, tree):
    """A (G, ...) tree of this process's groups -> its data rows (len(data.mine), ...)."""
    pos = np.searchsorted(self.groups, self.data.mine)
    return jax.tree.map(lambda a: np.asarray(a)[pos], tree)

  def my_groups(self, tree):
    """A global (B, ...) tree -> this process's (G, ...) groups."""
    return jax.tree.map(lambda a: np.asarray(a)[self.groups], tree)

  def list_from_groups(self, items, rows='slots'):
    """A length-G list (e.g. prompts) -> one entry per slot row (or data row)."""
    split = self.slots if rows == 'slots' else self.data
    div = self.group_size if rows == 'slots' else 1
    pos = np.searchsorted(self.groups, split.mine // div)
    return [items[int(i)] for i in pos]


def batch_layout(slot_sharding, data_sharding, num_groups, group_size, process=None):
  """The BatchLayout of B = `num_groups` groups of N = `group_size` slots under the two shardings."""
  slots = row_split(slot_sharding, num_groups * group_size, process)
  data = row_split(data_sharding, num_groups, process)
  needs = {p: tuple(sorted(set((slots.of_process[p] // group_size).tolist()) |
                           set(data.of_process[p].tolist()))) for p in slots.of_process}
  sets = sorted(set(needs.values()), key=lambda t: t[0])
  flat = [g for s in sets for g in s]
  if len(flat) != len(set(flat)):
    raise ValueError(f'batch of {num_groups} groups x {group_size}: processes need partially '
                     f'overlapping groups {sets[:4]}; choose config.batch_size so that every process '
                     'holds whole groups (or a share of one group)')
  me = slots.process
  return BatchLayout(group_size=group_size, slots=slots, data=data,
                     groups=np.asarray(needs[me], np.int64), shard_index=sets.index(needs[me]),
                     shard_count=len(sets))


def local_data_parallel(fn):
  """`fn(state, x)` jitted over this process's own devices: x's leading axis split across them (padded
  with zeros to a multiple of their number), `state` replicated on them (placed once with
  `call.place(state)`). The returned `call(state, x)` gives host numpy outputs of x's rows.

  For work each host does on its own rows, such as decoding its rollouts with the VAE before scoring:
  it never leaves the host and uses all of its chips instead of the first."""
  devices = jax.local_devices()
  mesh = jax.sharding.Mesh(np.asarray(devices), ('local',))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('local'))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  jitted = jax.jit(fn, in_shardings=(replicated, rows), out_shardings=rows)

  def call(state, x):
    x = np.asarray(x)
    n, pad = x.shape[0], (-x.shape[0]) % len(devices)
    if pad:
      x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
    # Placed explicitly: a multi-process jit refuses host numpy with a non-replicated sharding.
    return jax.tree.map(lambda o: np.asarray(o)[:n], jitted(state, jax.device_put(x, rows)))

  call.place = lambda state: jax.device_put(state, replicated)
  call.num_devices = len(devices)
  return call


def in_chunks(call, state, x, per_device):
  """`call(state, chunk)` (a `local_data_parallel` function) over x in chunks of per_device rows per local
  device, the last one zero-padded to the full size (one compiled shape, and a row's result does not
  depend on how the rows were batched); the outputs of x's rows concatenated, as a tuple."""
  x = np.asarray(x)
  step = per_device * call.num_devices
  outs = []
  for s in range(0, x.shape[0], step):
    chunk = x[s:s + step]
    padded = np.zeros((step,) + chunk.shape[1:], chunk.dtype)
    padded[:len(chunk)] = chunk
    outs.append(tuple(np.asarray(o)[:len(chunk)] for o in call(state, padded)))
  return tuple(np.concatenate(parts) for parts in zip(*outs))
