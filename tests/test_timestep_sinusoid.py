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


def _torch_frequencies(dim):
  """diffusers' frequencies as torch computes them on this CPU (its float32 exp)."""
  half = dim // 2
  return torch.exp(-math.log(10000.0) * torch.arange(0, half, dtype=torch.float32) / half).numpy()


@pytest.mark.parametrize('dim', [32, 256, 2048])
def test_the_frequencies_are_correctly_rounded(dim):
  """Each f_j is exp of the float32 exponent, evaluated in float64 and rounded once to float32."""
  half = dim // 2
  exponent = (-math.log(10000.0) * np.arange(half, dtype=np.float32) / np.float32(half)).astype(np.float32)
  exact = np.array([math.exp(float(e)) for e in exponent])
  ours = layers.timestep_frequencies(dim)
  assert ours.dtype == np.float32
  np.testing.assert_array_equal(ours, exact.astype(np.float32))
  assert np.all(np.abs(ours.astype(np.float64) - exact) <= np.spacing(ours) / 2)


@pytest.mark.parametrize('dim,bound', [(32, 1e-7), (256, 3.1e-5), (2048, 3.1e-5)])
def test_sinusoid_is_diffusers_to_float32_rounding(dim, bound):
  """Within `bound` of diffusers where torch's float32 exp is correctly rounded (it is on some CPUs and
  an ulp off on others, e.g. this test's Intel Xeon VMs): the reference's own frequency error, at most
  max(t) x max_j |torch f_j - f_j|, is added to the bound, measured on the CPU the test runs on."""
  ref = _diffusers(dim)
  ours = np.asarray(layers.timestep_sinusoid(jnp.asarray(T), dim))
  reference_error = float(T.max()) * float(np.abs(_torch_frequencies(dim).astype(np.float64)
                                                  - layers.timestep_frequencies(dim)).max())
  err, before = np.abs(ours - ref).max(), np.abs(_with_xla_exp(dim) - ref).max()
  assert err <= bound + reference_error and err <= before, (err, before, reference_error)


def test_every_family_uses_the_one_sinusoid():
  t = jnp.asarray(T[::97])
  np.testing.assert_array_equal(np.asarray(mmdit.time_sinusoid(t)), np.asarray(layers.timestep_sinusoid(t, 256)))
  assert wan_transformer.timestep_sinusoid is layers.timestep_sinusoid
  assert cosmos_dit.timestep_sinusoid is layers.timestep_sinusoid
