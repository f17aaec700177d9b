"""One training record: its byte format, validation, and ArrayRecord shards of records.

Record (a dict):
  prompt:         str, required.
  sample:         np.ndarray, required: float32 latents, e.g. (16, T, H, W) video or (C, H, W) image
                  latents (bfloat16 latents are stored as float32), or uint8 pixels (H, W, 3) / (F, H, W, 3).
  text_embedding: optional (L, D) float32 precomputed text embedding of the prompt.
  first_frame:    optional np.ndarray, the clean first frame for image-to-video, e.g. (16, 1, H, W)
                  latents (= sample[:, :1]) or (1, H, W, 3) pixels.
  pooled_embedding: optional (D,) float32 pooled text embedding (SD3's CLIP-L/G pooled 2048 vector).
  meta:           optional JSON-able dict, e.g. {'file': 'clips/a.mp4'}.

Bytes: a msgpack map with the keys above plus 'version' (FORMAT_VERSION); each array is the bytes of
`np.save(..., allow_pickle=False)` (a .npy file), so nothing is ever unpickled. Arrays may be float32,
float16, int32 or uint8 and must be finite.

Shards (`write_shards`): `<prefix>-00000-of-00003.array_record`, ... (ArrayRecord, 'group_size:1' for
random access), one record per ArrayRecord entry, plus `manifest.json`:
  {"format": "ddrl_jax.records", "version": 1, "num_records": N, "shards": [file names],
   "records_per_shard": R, "fields": {"sample": {"shape": [...], "dtype": "float32"}, ...},
   "created_by": "...", "extra": {...}}
All records of one `write_shards` call have the fields, shapes and dtypes of the first one.

Errors: `RecordError` (a ValueError) for a record that does not decode or does not have the expected
shape; its message starts with "<file>[<index>]: ".
"""
import glob
import io
import json
import os
from typing import Iterable, Sequence

import msgpack
import numpy as np

FORMAT_VERSION = 1
ARRAY_FIELDS = ('sample', 'text_embedding', 'first_frame', 'pooled_embedding')
FIELDS = ('prompt', 'meta') + ARRAY_FIELDS
DTYPES = ('float32', 'float16', 'int32', 'uint8')
MANIFEST = 'manifest.json'
SUFFIX = '.array_record'
WRITER_OPTIONS = 'group_size:1'


class RecordError(ValueError):
  """A record that does not decode or has the wrong shape; the message starts with "<file>[<index>]: "."""


# ----------------------------------------------------------------------------------- one record
def _check_array(name, value):
  if not isinstance(value, np.ndarray):
    if not (hasattr(value, 'shape') and hasattr(value, 'dtype')):
      raise ValueError(f'record field {name!r}: expected an array, got {type(value).__name__}')
    value = np.asarray(value)
  if value.dtype.name not in DTYPES:
    raise ValueError(f'record field {name!r}: dtype {value.dtype} is not one of {DTYPES} '
                     '(cast bfloat16 to float32)')
  if value.dtype.kind == 'f' and not np.isfinite(value).all():
    raise ValueError(f'record field {name!r}: contains NaN or inf')
  return value


def _npy_bytes(array):
  buf = io.BytesIO()
  np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
  return buf.getvalue()


def encode_record(record: dict) -> bytes:
  """Record dict (see the module docstring) -> msgpack bytes. Raises ValueError on a bad field."""
  unknown = set(record) - set(FIELDS)
  if unknown:
    raise ValueError(f'record: unknown fields {sorted(unknown)}; known: {FIELDS}')
  for name in ('prompt', 'sample'):
    if record.get(name) is None:
      raise ValueError(f'record: missing required field {name!r}')
  if not isinstance(record['prompt'], str):
    raise ValueError(f"record field 'prompt': expected str, got {type(record['prompt']).__name__}")
  out = {'version': FORMAT_VERSION, 'prompt': record['prompt']}
  for name in ARRAY_FIELDS:
    if record.get(name) is not None:
      out[name] = _npy_bytes(_check_array(name, record[name]))
  if record.get('text_embedding') is not None and np.ndim(record['text_embedding']) != 2:
    raise ValueError(f"record field 'text_embedding': expected (L, D), got shape "
                     f"{np.shape(record['text_embedding'])}")
  if record.get('meta') is not None:
    meta = record['meta']
    try:
      if not isinstance(meta, dict):
        raise TypeError(f'a {type(meta).__name__}')
      json.dumps(meta)
    except (TypeError, ValueError) as e:
      raise ValueError(f"record field 'meta': expected a JSON-able dict ({e})") from e
    out['meta'] = meta
  return msgpack.packb(out, use_bin_type=True)


def _load_npy(data):
  if not isinstance(data, bytes):
    raise ValueError(f'expected .npy bytes, got {type(data).__name__}')
  return np.load(io.BytesIO(data), allow_pickle=False)


def check_expected(record, where, expected):
  """Raises RecordError when a field's (shape, dtype) differs from expected[field] (None = any dim)."""
  for name, (shape, dtype) in expected.items():
    value = record.get(name)
    if value is None:
      raise RecordError(f'{where}: missing field {name!r} (expected shape {tuple(shape)} {dtype})')
    got = (tuple(value.shape), value.dtype.name)
    ok = len(got[0]) == len(shape) and all(w is None or w == g for w, g in zip(shape, got[0]))
    if not ok or got[1] != np.dtype(dtype).name:
      raise RecordError(f'{where}: field {name!r} has shape {got[0]} {got[1]}, expected '
                        f'{tuple(shape)} {np.dtype(dtype).name}')


def decode_record(raw: bytes, where: str, expected: dict | None = None) -> dict:
  """msgpack bytes -> record dict with numpy arrays.

  Args:
    raw: bytes of `encode_record`.
    where: "<file>[<index>]", the start of any error message.
    expected: optional {field: (shape, dtype)}; a shape entry None matches any size.
  Raises:
    RecordError: the bytes do not decode to a record, or a field differs from `expected`.
  """
  try:
    obj = msgpack.unpackb(raw, raw=False)
    if not isinstance(obj, dict):
      raise ValueError(f'not a msgpack map but {type(obj).__name__}')
    if obj.get('version') != FORMAT_VERSION:
      raise ValueError(f"format version {obj.get('version')!r}, expected {FORMAT_VERSION}")
    if not isinstance(obj.get('prompt'), str) or 'sample' not in obj:
      raise ValueError("missing 'prompt' (str) or 'sample'")
    record = {'prompt': obj['prompt']}
    for name in ARRAY_FIELDS:
      if name in obj:
        record[name] = _load_npy(obj[name])
    if 'meta' in obj:
      record['meta'] = obj['meta']
  except Exception as e:  # msgpack and numpy raise many types on garbage bytes  # pylint: disable=broad-except
    raise RecordError(f'{where}: corrupt record ({type(e).__name__}: {e})') from e
  if expected:
    check_expected(record, where, expected)
  return record


def describe(record: dict) -> dict:
  """{field: {'shape': [...], 'dtype': str}} of a record's array fields."""
  return {name: {'shape': list(np.shape(record[name])), 'dtype': np.asarray(record[name]).dtype.name}
          for name in ARRAY_FIELDS if record.get(name) is not None}


# -------------------------------------------------------------------------------------- shards
def shard_name(prefix, index, count):
  return f'{prefix}-{index:05d}-of-{count:05d}{SUFFIX}'


def write_shards(records: Iterable[dict], out_dir: str, *, prefix: str = 'data',
                 records_per_shard: int = 1000, overwrite: bool = False,
                 extra: dict | None = None) -> list[str]:
  """Writes records to ArrayRecord shards plus manifest.json in out_dir; returns the shard paths.

  Records stream to `<prefix>-00000.array_record.partial`, ...; once the input is exhausted the shards
  are renamed to `<prefix>-00000-of-000NN.array_record` (nothing else is buffered). On an error the
  partial files are removed. `extra` (JSON-able) is stored in the manifest under 'extra'.
  """
  # pylint: disable-next=g-import-not-at-top
  from array_record.python.array_record_module import ArrayRecordWriter
  if records_per_shard < 1:
    raise ValueError(f'records_per_shard={records_per_shard}: must be >= 1')
  os.makedirs(out_dir, exist_ok=True)
  old = glob.glob(os.path.join(glob.escape(out_dir), f'{glob.escape(prefix)}-*{SUFFIX}'))
  if old and not overwrite:
    raise ValueError(f'{out_dir}: already holds {len(old)} {prefix}-*{SUFFIX} shards '
                     '(pass overwrite=True to replace them)')
  for path in old:
    os.remove(path)
  partial, writer, fields, count = [], None, None, 0
  try:
    for record in records:
      raw = encode_record(record)
      desc = describe(record)
      if fields is None:
        fields = desc
      elif desc != fields:
        raise ValueError(f'record {count} (meta {record.get("meta")}): fields {desc} differ from the '
                         f'first record\'s {fields}')
      if count % records_per_shard == 0:
        if writer is not None:
          writer.close()
        partial.append(os.path.join(out_dir, f'{prefix}-{len(partial):05d}{SUFFIX}.partial'))
        writer = ArrayRecordWriter(partial[-1], WRITER_OPTIONS)
      writer.write(raw)
      count += 1
    if writer is not None:
      writer.close()
      writer = None
    if not count:
      raise ValueError(f'write_shards({out_dir!r}): no records')
  except BaseException:
    if writer is not None:
      writer.close()
    for path in partial:
      if os.path.exists(path):
        os.remove(path)
    raise
  names = [shard_name(prefix, i, len(partial)) for i in range(len(partial))]
  for src, name in zip(partial, names):
    os.replace(src, os.path.join(out_dir, name))
  manifest = dict(format='ddrl_jax.records', version=FORMAT_VERSION, num_records=count, shards=names,
                  records_per_shard=records_per_shard, fields=fields,
                  created_by='ddrl_jax.data.records.write_shards', extra=extra or {})
  with open(os.path.join(out_dir, MANIFEST), 'w') as f:
    json.dump(manifest, f, indent=1)
  return [os.path.join(out_dir, n) for n in names]


def list_shards(paths: str | Sequence[str]) -> list[str]:
  """Files, directories (every *.array_record inside) or glob patterns -> sorted, unique shard paths."""
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  if not paths:
    raise ValueError('list_shards: no paths given')
  found = set()
  for p in map(os.fspath, paths):
    if os.path.isdir(p):
      matches = glob.glob(os.path.join(glob.escape(p), f'*{SUFFIX}'))
    elif glob.has_magic(p):
      matches = [m for m in glob.glob(p) if os.path.isfile(m)]
    else:
      matches = [p] if os.path.isfile(p) else []
    if not matches:
      raise ValueError(f'{p!r}: no ArrayRecord shards (expected a file, a directory holding '
                       f'*{SUFFIX} files, or a glob pattern)')
    found.update(matches)
  return sorted(found)


def read_manifest(records_dir: str) -> dict:
  path = os.path.join(records_dir, MANIFEST)
  if not os.path.isfile(path):
    raise ValueError(f'{records_dir}: no {MANIFEST} (write the shards with ddrl_jax.data.records.'
                     'write_shards or python -m ddrl_jax.data.prepare)')
  with open(path) as f:
    return json.load(f)


def expected_from_manifest(records_dir: str) -> dict:
  """The `expected` argument for decode_record / RecordLoader: {field: (shape, dtype)} of manifest.json."""
  fields = read_manifest(records_dir)['fields']
  return {name: (tuple(f['shape']), f['dtype']) for name, f in fields.items()}


def read_all(paths, expected=None) -> list[dict]:
  """Every record of the shards, in file order (for tests and small data sets)."""
  # pylint: disable-next=g-import-not-at-top
  from array_record.python.array_record_module import ArrayRecordReader
  out = []
  for path in list_shards(paths):
    reader = ArrayRecordReader(path)
    try:
      raws = reader.read_all()
    finally:
      reader.close()
    out.extend(decode_record(raw, f'{path}[{i}]', expected) for i, raw in enumerate(raws))
  return out
