"""One timestep sinusoid for every family (layers.timestep_sinusoid), against diffusers' Timesteps
(get_timestep_embedding, flip_sin_to_cos=True, downscale_freq_shift=0) in float32: its frequencies are a
correctly rounded constant, so XLA's float32 exp no longer adds an ulp of a frequency (up to 2e-6 at a
32-wide embedding, 6e-5 at 2048) on top of the float32 cos / sin of arguments near 1000."""
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.models.embeddings import get_timestep_embedding

from ddrl_jax.models import layers
from ddrl_jax.models.cosmos import dit as cosmos_dit
from ddrl_jax.models.sd3 import mmdit
from ddrl_jax.models.wan import transformer as wan_transformer

T = np.linspace(0, 1000, 2001).astype(np.float32)


def _diffusers(dim):
  return get_timestep_embedding(torch.from_numpy(T), dim, flip_sin_to_cos=True,
                                downscale_freq_shift=0).numpy()


def _with_xla_exp(dim):
  """The previous form: the frequencies through XLA's float32 exp."""
  half = dim // 2
  freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
  arg = jnp.asarray(T)[:, None] * freqs
  return np.asarray(jnp.concatenate([jnp.cos(arg), jnp.sin(arg)], axis=-1))


@pytest.mark.parametrize('dim,bound', [(32, 1e-7), (256, 3.1e-5), (2048, 3.1e-5)])
def test_sinusoid_is_diffusers_to_float32_rounding(dim, bound):
  ref = _diffusers(dim)
  ours = np.asarray(layers.timestep_sinusoid(jnp.asarray(T), dim))
  err, before = np.abs(ours - ref).max(), np.abs(_with_xla_exp(dim) - ref).max()
  assert err <= bound and err <= before, (err, before)


def test_every_family_uses_the_one_sinusoid():
  t = jnp.asarray(T[::97])
  np.testing.assert_array_equal(np.asarray(mmdit.time_sinusoid(t)), np.asarray(layers.timestep_sinusoid(t, 256)))
  assert wan_transformer.timestep_sinusoid is layers.timestep_sinusoid
  assert cosmos_dit.timestep_sinusoid is layers.timestep_sinusoid
