"""The 2-D velocity MLP of the toy task ('mlp' family): v_theta(x_t, t, c) for points in the plane.

Reads config.toy2d.width and .depth. It has no base checkpoint: the toy task pretrains it on its mixture
(tasks/toy2d.py) before the RL run.
"""
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np


def timestep_embedding(t, dim):
  """Sinusoidal embedding of t in [0, 1]: (batch,) -> (batch, dim)."""
  half = dim // 2
  freqs = jnp.exp(-np.log(1000.0) * jnp.arange(half) / half)
  args = 100.0 * t[:, None] * freqs[None]
  return jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)


class VelocityMLP(nnx.Module):
  """v_theta(x_t, t, c) for 2-D data: [x, emb(t), c] -> width -> ... -> 2 (SiLU)."""

  def __init__(self, *, width=256, depth=3, t_dim=32, cond_dim=1, rngs: nnx.Rngs):
    self.t_dim = t_dim
    dims = [2 + t_dim + cond_dim] + [width] * depth
    self.hidden = nnx.List([nnx.Linear(i, o, rngs=rngs) for i, o in zip(dims[:-1], dims[1:])])
    self.out = nnx.Linear(width, 2, kernel_init=nnx.initializers.zeros_init(), rngs=rngs)

  def __call__(self, x, t, cond):
    h = jnp.concatenate([x, timestep_embedding(t, self.t_dim), cond], axis=-1)
    for layer in self.hidden:
      h = jax.nn.silu(layer(h))
    return self.out(h)


def mlp_forward_flops(width, depth, t_dim=32, cond_dim=1):
  """Matmul FLOPs (2 per multiply-accumulate) of one `VelocityMLP` forward of one sample."""
  dims = [2 + t_dim + cond_dim] + [width] * depth + [2]
  return 2.0 * sum(i * o for i, o in zip(dims[:-1], dims[1:]))


def make_apply_fn(graphdef):
  """apply_fn(params, x_t, t, cond) for an NNX graphdef (params = its nnx.State)."""
  def apply_fn(params, x_t, t, cond):
    return nnx.merge(graphdef, params)(x_t, t, cond)
  return apply_fn


class MLPFamily:
  """The velocity MLP as a model family (no attention, no sharding rules of its own, float32)."""

  name = 'mlp'
  compute_dtype = 'float32'
  remat_policy = 'none'
  resume_safe_keys = ()

  def __init__(self, config):
    self.width, self.depth = config.toy2d.width, config.toy2d.depth

  def build(self, key):
    return VelocityMLP(width=self.width, depth=self.depth, rngs=nnx.Rngs(key))

  def apply_fn(self, graphdef):
    return make_apply_fn(graphdef)

  def load_base(self, abstract_base):
    del abstract_base
    return None

  def forward_flops(self, sample_shape):
    del sample_shape
    return mlp_forward_flops(self.width, self.depth)

  def attention_shape(self):
    return None

  def attention_kernel(self, platform):
    del platform
    return None

  def logical_rules(self):
    return {}

  def sequence_names(self):
    return ()

  def compute_cast(self, abstract_module):
    del abstract_module
    return None

  def exporter(self):
    return None


FAMILIES = {'mlp': MLPFamily}
