"""diffusers `AutoencoderKLWan` state dict -> `WanVAE` NNX state.

Names follow diffusers one-to-one ('.' -> '/'), except:
- `*.weight` of a conv -> `kernel`: Conv3d (O, I, kt, kh, kw) -> (kt, kh, kw, I, O),
  Conv2d (O, I, kh, kw) -> (kh, kw, I, O), 1x1 Conv2d of the attention (O, I, 1, 1) -> (I, O);
- RMS-norm `gamma` (C, 1, 1[, 1]) -> (C,);
- `resample.1` (the spatial conv inside nn.Sequential) -> `resample`, `upsamplers.0` -> `upsampler`.

Every tensor is validated against `nnx.eval_shape` of the model; ONE ValueError lists all missing,
unexpected and mis-shaped keys.

Usage:
  state = convert_diffusers_vae_state_dict({k: v.numpy() for k, v in vae.state_dict().items()}, cfg)
  model = merge_params(cfg, state)
"""
import numpy as np
from flax import nnx

from ddrl_jax.models import checked_state
from ddrl_jax.models.wan.vae import WanVAE

_RENAMES = (('.resample.1.', '.resample.'), ('.upsamplers.0.', '.upsampler.'))


def abstract_params(config):
  """(abstract model, {path tuple: ShapeDtypeStruct}) of the Params, without allocating."""
  abstract = nnx.eval_shape(lambda: WanVAE(config, rngs=nnx.Rngs(0)))
  state = nnx.state(abstract, nnx.Param)
  return abstract, {tuple(str(p) for p in path): v.get_value() for path, v in nnx.to_flat_state(state)}


def _target_path(key):
  """diffusers key -> NNX path tuple (weight -> kernel)."""
  for old, new in _RENAMES:
    key = key.replace(old, new)
  parts = key.split('.')
  if parts[-1] == 'weight':
    parts[-1] = 'kernel'
  return tuple(parts)


def _transform(value, path, want_ndim):
  """Re-lays out one tensor for the NNX leaf at `path`; returns None when the rank cannot fit."""
  value = np.asarray(value)
  leaf = path[-1]
  if leaf == 'gamma':
    return value.reshape(-1)
  if leaf == 'bias':
    return value
  if value.ndim == 5 and want_ndim == 5:
    return value.transpose(2, 3, 4, 1, 0)
  if value.ndim == 4 and want_ndim == 4:
    return value.transpose(2, 3, 1, 0)
  if value.ndim == 4 and want_ndim == 2 and value.shape[2:] == (1, 1):
    return value[:, :, 0, 0].T
  return None


def convert_diffusers_vae_state_dict(state_dict, config):
  """{diffusers key: np.ndarray} -> nnx.State of WanVAE(config) Params (host numpy values)."""
  abstract, expected = abstract_params(config)
  flat, unexpected, misshaped = {}, [], []
  for key, value in state_dict.items():
    path = _target_path(key)
    if path not in expected:
      unexpected.append(key)
      continue
    want = tuple(expected[path].shape)
    arr = _transform(value, path, len(want))
    if arr is None or tuple(arr.shape) != want:
      misshaped.append(f'{key}: got {tuple(np.shape(value))}, want {want} as {"/".join(path)}')
      continue
    flat[path] = arr
  missing = ['/'.join(p) for p in expected if p not in flat and
             not any(m.endswith('as ' + '/'.join(p)) for m in misshaped)]
  return checked_state.fill_params(abstract, expected, flat, name='WanVAE(config)', missing=missing,
                                   unexpected=unexpected, misshaped=misshaped)


def merge_params(config, state):
  """Builds a WanVAE from a converted Param state without initialising real weights."""
  abstract = nnx.eval_shape(lambda: WanVAE(config, rngs=nnx.Rngs(0)))
  graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
  return nnx.merge(graphdef, state, rest)
