"""grain input pipeline over record shards (ddrl_jax.data.records), with resumable iterator state.

  loader = RecordLoader('/data/train', batch_size=8, seed=0, expected=records.expected_from_manifest(...))
  batch = next(loader)

Pipeline: KeyedSource (ArrayRecord shards -> (record key, raw bytes)) -> IndexSampler (ShardOptions
for this host with drop_remainder, optional shuffle with `seed`, `num_epochs` or endless) -> DataLoader
with operations: Decode map (bytes -> record; a bad record raises RecordError or becomes a counted,
logged skip) -> Filter (drops skips) -> Batch(batch_size, drop_remainder=True).

A batch is a dict:
  prompt:         list[str] of length B (a Python list, not a numpy array).
  sample:         (B, *sample_shape) np.ndarray, e.g. (B, 16, T, H, W) float32.
  text_embedding: (B, L, D) np.ndarray, when the records have it.
  first_frame:    (B, *first_frame_shape) np.ndarray, when the records have it.
  meta:           list[dict] of length B ({} for records without meta).
batch_size is per host (per shard): with shard_count hosts the global batch is batch_size * shard_count.

Checkpointing: `get_state()` / `set_state()` are JSON bytes holding grain's iterator state plus the
counters `records_seen` and `num_skipped`. grain's orbax handler (grain.checkpoint.CheckpointHandler,
registered with orbax for grain.checkpoint.CheckpointSave / CheckpointRestore) saves them, one file per
process, inside a CheckpointManager Composite:

  mngr.save(step, args=ocp.args.Composite(state=..., data=pipeline.save_args(loader)))
  mngr.restore(step, args=ocp.args.Composite(state=..., data=pipeline.restore_args(loader)))

The counters are exact with worker_count=0 (decoding runs in this process); with worker processes
the decode runs there and the counters here stay 0.
"""
import bisect
import hashlib
import json
import logging

import grain
import grain.checkpoint  # pylint: disable=unused-import
import jax
import numpy as np

from ddrl_jax.data import records as records_lib

logger = logging.getLogger(__name__)
RecordError = records_lib.RecordError


class KeyedSource:
  """grain RandomAccessDataSource over shards: key -> (key, raw bytes or None, read error or None).

  Carries the record key so the decode step can name "<file>[<index in file>]" in errors; a read
  failure of the ArrayRecord reader is passed on as a string instead of being raised in grain's
  prefetch threads.
  """

  def __init__(self, paths):
    # pylint: disable-next=g-import-not-at-top
    from array_record.python.array_record_module import ArrayRecordReader
    self.paths = records_lib.list_shards(paths)
    sizes = []
    for path in self.paths:
      reader = ArrayRecordReader(path)
      sizes.append(reader.num_records())
      reader.close()
    self._ends = list(np.cumsum(sizes))
    self._source = grain.sources.ArrayRecordDataSource(self.paths)
    if not len(self._source):
      raise ValueError(f'{self.paths}: the shards hold no records')

  def __len__(self):
    return len(self._source)

  def __getitem__(self, key):
    key = int(key)
    try:
      return key, self._source[key], None
    except Exception as e:  # pylint: disable=broad-except
      return key, None, f'{type(e).__name__}: {e}'

  def where(self, key):
    """Record key -> "<file>[<index in file>]"."""
    shard = bisect.bisect_right(self._ends, key)
    start = self._ends[shard - 1] if shard else 0
    return f'{self.paths[shard]}[{key - start}]'

  def __repr__(self):
    # grain compares repr(source) with the one in a restored iterator state.
    digest = hashlib.sha1('\n'.join(self.paths).encode()).hexdigest()
    return f'KeyedSource(num_files={len(self.paths)}, num_records={len(self)}, sha1_of_paths={digest})'


class Decode(grain.transforms.Map):
  """(key, raw, error) -> record dict with '_where', or None for a counted skip when skip_bad."""

  def __init__(self, source, expected=None, skip_bad=False):
    self.source = source
    self.expected = expected
    self.skip_bad = skip_bad
    self.records_seen = 0
    self.num_skipped = 0

  def map(self, element):
    key, raw, error = element
    where = self.source.where(key)
    self.records_seen += 1
    try:
      if error is not None:
        raise RecordError(f'{where}: unreadable ({error})')
      record = records_lib.decode_record(raw, where, self.expected)
    except RecordError as e:
      if not self.skip_bad:
        raise
      self.num_skipped += 1
      logger.warning('skipping bad record (%d skipped so far): %s', self.num_skipped, e)
      return None
    record['_where'] = where
    return record


class DropSkipped(grain.transforms.Filter):
  """Drops the None that Decode returns for a skipped record."""

  def filter(self, element):
    return element is not None


def stack_records(recs):
  """list of decoded records -> batch dict (see the module docstring)."""
  out = {'prompt': [r['prompt'] for r in recs], 'meta': [r.get('meta') or {} for r in recs]}
  for name in records_lib.ARRAY_FIELDS:
    have = [r for r in recs if name in r]
    if not have:
      continue
    for r in recs:
      if name not in r or r[name].shape != have[0][name].shape or r[name].dtype != have[0][name].dtype:
        got = f'{r[name].shape} {r[name].dtype.name}' if name in r else 'missing'
        raise RecordError(f"{r['_where']}: field {name!r} is {got}, but {have[0]['_where']} in the same "
                          f'batch has {have[0][name].shape} {have[0][name].dtype.name} (pass `expected` '
                          'to check every record)')
    out[name] = np.stack([r[name] for r in recs])
  return out


class RecordLoader:
  """Iterator of batches (see the module docstring) over record shards, with get_state/set_state.

  Args:
    paths: shard files, directories or globs (records.list_shards).
    batch_size: records per batch on this host; the last partial batch of an epoch is dropped.
    seed: shuffle seed (non-negative 32-bit int); the order is a function of seed, shard and epoch.
    shuffle: shuffle the records (a new permutation each epoch).
    shard_index, shard_count: this host's shard; None means jax.process_index() / process_count().
      Each shard reads a disjoint floor(N / shard_count) of the records each epoch.
    expected: optional {field: (shape, dtype)} every record must match (records.expected_from_manifest).
    skip_bad: skip (count, log) corrupt or mis-shaped records instead of raising RecordError.
    worker_count: grain worker processes (0 = decode in this process; counters exact only then).
      With workers each one batches its own slice of the records (so the order, and which records
      an epoch's dropped remainder holds, differ from worker_count=0), and grain reads absl flags:
      run under absl.app.run (as ddrl_jax.train does) or call flags.FLAGS.mark_as_parsed().
    num_epochs: None = repeat forever.
    read_threads, prefetch: grain ReadOptions for reading raw records ahead (prefetch in records;
      default 2 * batch_size, as one record can be tens of MB of latents).
  """

  def __init__(self, paths, batch_size, *, seed=0, shuffle=True, shard_index=None, shard_count=None,
               expected=None, skip_bad=False, worker_count=0, num_epochs=None, read_threads=4,
               prefetch=None):
    if batch_size < 1:
      raise ValueError(f'batch_size={batch_size}: must be >= 1')
    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
      raise ValueError(f'shard_index={shard_index} not in [0, shard_count={shard_count})')
    self.source = KeyedSource(paths)
    if len(self.source) // shard_count < 1:
      raise ValueError(f'{len(self.source)} records cannot be split into {shard_count} shards')
    shard = grain.sharding.ShardOptions(shard_index, shard_count, drop_remainder=True)
    sampler = grain.samplers.IndexSampler(len(self.source), shard_options=shard, shuffle=shuffle,
                                          seed=seed, num_epochs=num_epochs)
    self._decode = Decode(self.source, expected, skip_bad)
    self._loader = grain.DataLoader(
        data_source=self.source, sampler=sampler, shard_options=shard, worker_count=worker_count,
        operations=[self._decode, DropSkipped(),
                    grain.transforms.Batch(batch_size, drop_remainder=True, batch_fn=stack_records)],
        read_options=grain.ReadOptions(num_threads=read_threads,
                                       prefetch_buffer_size=prefetch or 2 * batch_size))
    self._iter = iter(self._loader)
    self.batch_size = batch_size
    self.shard = (shard_index, shard_count)

  @property
  def num_skipped(self):
    """Bad records skipped so far (skip_bad=True), restored with the state."""
    return self._decode.num_skipped

  @property
  def records_seen(self):
    """Records decoded or skipped into the batches returned so far (restored with the state)."""
    return self._decode.records_seen

  def __iter__(self):
    return self

  def __next__(self):
    return next(self._iter)

  def get_state(self) -> bytes:
    return json.dumps({'grain': json.loads(self._iter.get_state()), 'shard': list(self.shard),
                       'records_seen': self.records_seen, 'num_skipped': self.num_skipped}).encode()

  def set_state(self, state: bytes):
    state = json.loads(state)
    check_shard(state, self.shard)
    self._iter.set_state(json.dumps(state['grain']).encode())
    self._decode.records_seen = state['records_seen']
    self._decode.num_skipped = state['num_skipped']

  def start_prefetch(self):
    """Starts reading ahead (grain's checkpoint handler calls this after a restore)."""
    self._iter.start_prefetch()


def check_shard(state, shard, where='the saved loader state'):
  """Raises ValueError when a saved state (dict) belongs to another shard than `shard` (index, count)."""
  saved = tuple(state.get('shard') or shard)
  if saved != tuple(shard):
    raise ValueError(f'{where} is shard {saved[0]} of {saved[1]}, this loader reads shard {shard[0]} of '
                     f'{shard[1]}: the records it would continue from are not this shard\'s (the mesh or '
                     'the number of processes changed)')


def saved_state(step_dir, item='data'):
  """The dict this process's loader saved in a checkpoint step directory, or None if it has none
  (written by another number of processes). grain's handler writes process_<i>-of-<n>.json."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  path = epath.Path(step_dir) / item / f'process_{jax.process_index()}-of-{jax.process_count()}.json'
  if not path.exists():
    return None
  state = json.loads(path.read_text())
  return json.loads(state) if isinstance(state, str) else state


def saved_by_processes(step_dir, count, item='data'):
  """Whether a checkpoint holds loader states written by `count` processes (any of them)."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  directory = epath.Path(step_dir) / item
  return directory.exists() and any(p.name.endswith(f'-of-{count}.json') for p in directory.iterdir())


def save_args(loader):
  """orbax args that save `loader`'s state: put under 'data' in ocp.args.Composite(...)."""
  return grain.checkpoint.CheckpointSave(loader)


def restore_args(loader):
  """orbax args that restore into `loader` (set_state in place): 'data' in ocp.args.Composite(...)."""
  return grain.checkpoint.CheckpointRestore(loader)
