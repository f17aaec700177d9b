"""Params-only checkpoints: the exported weights of a model (e.g. a pretrained base model to ship)."""
import os

import flax.nnx as nnx
import jax
import orbax.checkpoint as ocp

from ddrl_jax import storage


def save_params(path, params):
  """Writes a params-only orbax checkpoint (the pure dict of an nnx.State) to `path`."""
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(storage.absolute(path), nnx.to_pure_dict(params), force=True)
  ckptr.wait_until_finished()


def load_params(path, template, key='checkpoint'):
  """Reads `save_params` output into the structure of the nnx.State `template` (shapes checked)."""
  # This process's first device: portable across topologies, and addressable on every host.
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                        nnx.to_pure_dict(template))
  try:
    loaded = ocp.StandardCheckpointer().restore(storage.absolute(path), target)
  except Exception as e:  # orbax names the mismatching leaf
    raise ValueError(f'{key}={path!r} does not match the configured model: {e}') from e
  state = jax.tree.map(lambda a: a, template)
  nnx.replace_by_pure_dict(state, loaded)
  return state
