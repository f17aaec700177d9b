"""A model's samples over prompts written as record shards, resumably: a killed run continues at its
first unfinished shard and ends with the same records as an uninterrupted one.

Used by `python -m ddrl_jax.data.synthesize` and by the trainer when a DDRL run regularizes with the base
model's own samples (config.data.base_samples, the paper's SD3.5 setting).

Layout of `out`:
  data-00000-of-000NN.array_record, ...  each written whole (`.partial`, then renamed), in order;
  synthesis.json                         the plan (what is sampled, how) and the counts of every
                                         finished shard, rewritten after each shard;
  manifest.json                          written last (ddrl_jax.data.records' format): the set is complete.

Every batch's keys derive from the seed and the index of its first sample, and shards start on batch
boundaries, so which shards a run had finished before it was killed changes nothing in the records.
"""
import hashlib
import json
import logging
import math
import os

import jax
import numpy as np
import tqdm

from ddrl_jax import parallel
from ddrl_jax.data import records as records_lib
from ddrl_jax.parallel import hosts

logger = logging.getLogger(__name__)

PROGRESS = 'synthesis.json'
PREFIX = 'data'


class PlanMismatch(ValueError):
  """`out` holds (some of) the samples of another plan (other prompts, count, seed, sampler or model)."""


def prompts_round_robin(prompts, num):
  """The prompt of each of `num` samples: the prompts in turn, each about num / len(prompts) times."""
  prompts = list(prompts)
  if not prompts:
    raise ValueError('no prompts to sample')
  if num < 1:
    raise ValueError(f'{num} samples: need at least 1')
  return [prompts[i % len(prompts)] for i in range(num)]


def is_complete(out):
  """True when `out` holds a finished set (its manifest.json)."""
  return os.path.isfile(os.path.join(out, records_lib.MANIFEST))


def make_plan(todo, *, seed, batch, records_per_shard, text, **described):
  """The JSON-able identity of a synthesis: the prompts of the samples (their hash), their number, the
  seed, batch and shard sizes, whether text embeddings are stored, and what the caller describes (the
  sampler, the model)."""
  digest = hashlib.sha256('\n'.join(todo).encode('utf-8')).hexdigest()
  return dict(num_samples=len(todo), prompts_sha256=digest, seed=int(seed), batch=int(batch),
              records_per_shard=int(records_per_shard), text=bool(text), **described)


def _read_progress(out):
  path = os.path.join(out, PROGRESS)
  if not os.path.isfile(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def _write_json(path, value):
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    json.dump(value, f, indent=1)
  os.replace(tmp, path)


def _differences(saved, plan):
  keys = sorted(set(saved) | set(plan))
  return [f'{k}: {saved.get(k)!r} -> {plan.get(k)!r}' for k in keys if saved.get(k) != plan.get(k)]


def _start_or_resume(out, plan, num_shards):
  """The progress record of `out` for `plan` (new, or the one a killed run left); raises PlanMismatch
  when `out` holds another plan's samples, ValueError when it holds shards of unknown origin."""
  os.makedirs(out, exist_ok=True)
  progress = _read_progress(out)
  if progress is None:
    found = [n for n in os.listdir(out) if n.endswith(records_lib.SUFFIX)]
    if found or is_complete(out):
      raise ValueError(f'{out}: already holds {len(found)} record shards not written by a synthesis '
                       f'(no {PROGRESS}); use another directory')
    progress = dict(plan=plan, shards={})
    _write_json(os.path.join(out, PROGRESS), progress)
    return progress
  if progress['plan'] != plan:
    raise PlanMismatch(f'{out}: holds samples of another synthesis ({"; ".join(_differences(progress["plan"], plan))}); '
                       'remove the directory or use another one')
  # A shard listed as finished must still be there; a missing one is sampled again.
  names = [records_lib.shard_name(PREFIX, i, num_shards) for i in range(num_shards)]
  progress['shards'] = {n: v for n, v in progress['shards'].items()
                        if n in names and os.path.isfile(os.path.join(out, n))}
  return progress


def _write_shard(records, path):
  """Writes an iterable of records as one ArrayRecord file at `path` (via path.partial); returns
  (count, fields of the first record or None)."""
  # pylint: disable-next=g-import-not-at-top
  from array_record.python.array_record_module import ArrayRecordWriter
  partial = path + '.partial'
  writer = ArrayRecordWriter(partial, records_lib.WRITER_OPTIONS)
  count, fields = 0, None
  try:
    for record in records:
      desc = records_lib.describe(record)
      if fields is None:
        fields = desc
      elif desc != fields:
        raise ValueError(f'{path}: record {count} has fields {desc}, the first one {fields}')
      writer.write(records_lib.encode_record(record))
      count += 1
    writer.close()
    writer = None
  finally:
    if writer is not None:
      writer.close()
      os.remove(partial)
  os.replace(partial, path)
  return count, fields


def write_samples(task, sample_fn, params, mesh, out, todo, *, seed=0, batch=64, text=True,
                  records_per_shard=1000, described=None, extra=None, progress=True, desc='synthesize'):
  """Samples one record per entry of `todo` (a prompt per sample) into `out`, resuming what a killed
  call with the same plan finished; returns a summary dict.

  task: has `conditions_from_prompts` and `record_of`. sample_fn: (params, cond (M, ...), key) ->
  (M, 1, *task.sample_shape) samples, M a multiple of the mesh's data-parallel size. batch: samples per
  call (rounded down to that multiple). described: JSON-able facts that belong to the plan (sampler,
  model). On several processes every process samples and process 0 writes (`out` on a shared filesystem).
  Non-finite samples are skipped, logged and counted.
  """
  dp = parallel.data_parallel_size(mesh)
  batch = max(dp, batch // dp * dp)
  per_shard = max(batch, records_per_shard // batch * batch)
  num_shards = math.ceil(len(todo) / per_shard)
  plan = make_plan(todo, seed=seed, batch=batch, records_per_shard=per_shard, text=text,
                   **(described or {}))
  writer = jax.process_index() == 0
  names = [records_lib.shard_name(PREFIX, i, num_shards) for i in range(num_shards)]
  done = np.zeros(num_shards, bool)
  if writer:
    if is_complete(out):
      state = _read_progress(out)
      if state is None:
        raise PlanMismatch(f'{out}: holds a finished set of records not written by a synthesis (no '
                           f'{PROGRESS}); use another directory')
      if state['plan'] != plan:
        raise PlanMismatch(f'{out}: holds the finished samples of another synthesis '
                           f'({"; ".join(_differences(state["plan"], plan))}); remove it or use another one')
    else:
      state = _start_or_resume(out, plan, num_shards)
    done = np.asarray([n in state['shards'] for n in names])
  done = hosts.allgather(done)[0]                    # process 0 decides; everyone samples the same
  cached = sum(min(per_shard, len(todo) - i * per_shard) for i in np.flatnonzero(done))
  if cached and not done.all():
    logger.info('%s: resuming in %s: %d of %d samples already written', desc, out, cached, len(todo))
  key = jax.random.key(seed)
  skipped = {'count': 0}

  def shard_records(index, bar):
    lo, hi = index * per_shard, min(len(todo), (index + 1) * per_shard)
    for start in range(lo, hi, batch):
      chunk = todo[start:min(hi, start + batch)]
      padded = chunk + [chunk[-1]] * (-len(chunk) % dp)        # slots must divide the mesh
      k_cond, k_sample = jax.random.split(jax.random.fold_in(key, start))
      cond = task.conditions_from_prompts(padded, k_cond)
      cond = jax.device_put(cond, parallel.batch_sharding(mesh))
      samples = hosts.gather_global(sample_fn(params, cond, k_sample))
      samples = samples.reshape((len(padded),) + tuple(task.sample_shape))[:len(chunk)]
      for prompt, sample in zip(chunk, samples):
        if not np.isfinite(sample).all():
          skipped['count'] += 1
          logger.warning('%s: skipping a non-finite sample of prompt %r', desc, prompt)
          continue
        if writer:
          yield task.record_of(sample, prompt, text=text)
      bar.update(len(chunk))

  bar = tqdm.tqdm(total=len(todo), initial=cached, disable=not (progress and writer), desc=desc,
                  dynamic_ncols=True)
  try:
    for i in np.flatnonzero(~done):
      skipped['count'] = 0
      if writer:
        count, fields = _write_shard(shard_records(i, bar), os.path.join(out, names[i]))
        state['shards'][names[i]] = dict(records=count, skipped_nonfinite=skipped['count'], fields=fields)
        _write_json(os.path.join(out, PROGRESS), state)
      else:
        for _ in shard_records(i, bar):
          pass
  finally:
    bar.close()
  if writer and not is_complete(out):
    rows = [state['shards'][n] for n in names]
    fields = next((r['fields'] for r in rows if r['fields']), None)
    if fields is None:
      raise ValueError(f'{out}: every one of the {len(todo)} samples was non-finite; nothing to train on')
    if any(r['fields'] and r['fields'] != fields for r in rows):
      raise ValueError(f'{out}: shards hold records of different fields {[r["fields"] for r in rows]}')
    manifest = dict(format='ddrl_jax.records', version=records_lib.FORMAT_VERSION,
                    num_records=sum(r['records'] for r in rows), shards=names, records_per_shard=per_shard,
                    fields=fields, created_by='ddrl_jax.data.synthesis.write_samples',
                    extra=dict(extra or {}, plan=plan,
                               skipped_nonfinite=sum(r['skipped_nonfinite'] for r in rows)))
    _write_json(os.path.join(out, records_lib.MANIFEST), manifest)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices('ddrl_jax synthesis ' + out)
  manifest = records_lib.read_manifest(out)
  return dict(shards=[os.path.join(out, n) for n in manifest['shards']],
              num_records=manifest['num_records'],
              skipped_nonfinite=manifest['extra'].get('skipped_nonfinite', 0),
              resumed_samples=int(cached))
