"""Workdir files that may live on local disk or in a bucket (gs://..., s3://...; a pod's shared workdir).

Orbax writes checkpoints to either through etils.epath; this module does the same for the rest of the
workdir (metrics.jsonl, sample grids). Buckets need their filesystem package (`pip install -e
'.[tpu]'` brings gcsfs and google-cloud-storage, which TensorBoard's gs:// writer uses too). A bucket
object cannot be appended to, so callers rewrite whole (small) files there.
"""
import os


def is_remote(path):
  """Whether `path` is a URL (gs://, s3://, ...) rather than a local path."""
  return '://' in str(path)


def absolute(path):
  """A local path made absolute; a URL unchanged (os.path.abspath would turn gs://b into ./gs:/b)."""
  return str(path) if is_remote(path) else os.path.abspath(path)


def _epath(path):
  from etils import epath  # pylint: disable=g-import-not-at-top
  return epath.Path(path)


def exists(path):
  return _epath(path).exists() if is_remote(path) else os.path.exists(path)


def read_text(path):
  """The file's text, or None when it does not exist."""
  if not exists(path):
    return None
  if is_remote(path):
    return _epath(path).read_text()
  with open(path) as f:
    return f.read()


def write_bytes(path, data):
  """Writes `data` to `path` (parents created); locally through a temporary file and a rename, so a
  reader never sees half a file."""
  if is_remote(path):
    p = _epath(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'wb') as f:
    f.write(data)
  os.replace(tmp, path)


def write_text(path, text):
  write_bytes(path, text.encode())
