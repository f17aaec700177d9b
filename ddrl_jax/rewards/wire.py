"""Byte encoding of reward requests and replies: msgpack maps with arrays as .npy bytes, never pickle.

The same encoding crosses the in-process worker pipes and Redis, so a reply that fails to decode is
treated identically everywhere: as garbage (NaN scores, counted), not as a crash.
"""
import io

import msgpack
import numpy as np


class WireError(ValueError):
  """A payload that is not a valid message (bad msgpack, bad .npy, pickled objects, missing fields)."""


def array_to_bytes(a):
  """np.ndarray -> .npy bytes. Object arrays are refused (they would need pickle)."""
  a = np.asarray(a)
  if a.dtype.hasobject:
    raise WireError(f'cannot send an object array (dtype {a.dtype}); arrays travel as plain .npy')
  buf = io.BytesIO()
  np.save(buf, a, allow_pickle=False)
  return buf.getvalue()


def bytes_to_array(b):
  """.npy bytes -> np.ndarray; WireError on anything else (pickle included)."""
  if not isinstance(b, (bytes, bytearray)):
    raise WireError(f'expected .npy bytes, got {type(b).__name__}')
  try:
    return np.load(io.BytesIO(b), allow_pickle=False)
  except Exception as e:  # numpy raises ValueError / EOFError / OSError for bad headers
    raise WireError(f'not a valid .npy array: {e}') from None


def pack(message):
  """dict (str keys; values: msgpack types, bytes, or np.ndarray) -> bytes. Arrays become .npy bytes."""
  def default(obj):
    if isinstance(obj, np.ndarray):
      return msgpack.ExtType(1, array_to_bytes(obj))
    if isinstance(obj, np.generic):
      return obj.item()
    raise WireError(f'cannot encode {type(obj).__name__}')
  return msgpack.packb(message, default=default, use_bin_type=True)


def unpack(data, required=()):
  """bytes -> dict, decoding the arrays; WireError if malformed or a `required` key is missing."""
  def ext_hook(code, payload):
    if code != 1:
      raise WireError(f'unknown msgpack extension type {code}')
    return bytes_to_array(payload)
  try:
    message = msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=True)
  except WireError:
    raise
  except Exception as e:  # msgpack raises several exception types for truncated/invalid data
    raise WireError(f'not a msgpack message: {type(e).__name__}: {e}') from None
  if not isinstance(message, dict):
    raise WireError(f'expected a msgpack map, got {type(message).__name__}')
  missing = [k for k in required if k not in message]
  if missing:
    raise WireError(f'message lacks {missing}')
  return message


def check_scores(scores, num):
  """A worker's reply value for one reward -> (num,) float32, or raise WireError saying why not.

  Non-finite entries are kept (NaN = that sample failed); anything else that is not a numeric (num,)
  vector (wrong length, strings, nested lists) is garbage.
  """
  a = scores if isinstance(scores, np.ndarray) else np.asarray(scores) if isinstance(
      scores, (list, tuple)) else None
  if a is None or a.dtype.kind not in 'biuf':
    raise WireError(f'scores are not a numeric array ({type(scores).__name__})')
  if a.shape != (num,):
    raise WireError(f'scores have shape {a.shape}, expected ({num},)')
  return a.astype(np.float32)
