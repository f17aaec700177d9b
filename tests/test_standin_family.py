"""The seam with a family the library has never seen: a tiny stand-in text-to-image family defined in this
file (its own network, byte-hash text encoder and pooling VAE), registered at run time, trains and is
evaluated through the prompt task, the trainer and the sharding plan with no change to ddrl_jax."""
import hashlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from configs import sd35m
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import tasks
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.models import family as family_lib
from ddrl_jax.models import layers
from ddrl_jax.models import pipeline

LATENT = (4, 8, 8)            # (C, h, w) latents of 16 x 16 images
TEXT = (3, 8)                 # (tokens, width) of the stand-in text encoder
WIDTH = 32


class StandInNet(nnx.Module):
  """v = out(gelu(in(x) + text(mean text) + t)) on flattened latents: Dense layers with logical names."""

  def __init__(self, rngs):
    d = int(np.prod(LATENT))
    dense = lambda i, o, names: layers.dense(i, o, names, rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                                             bias=True)
    self.x_in = dense(d, WIDTH, ('embed', 'mlp'))
    self.text_in = dense(TEXT[1], WIDTH, ('cross_embed', 'mlp'))
    self.out = dense(WIDTH, d, ('mlp', 'embed'))

  def __call__(self, x, t, text):
    b = x.shape[0]
    h = self.x_in(x.reshape(b, -1)) + self.text_in(text.mean(1)) + t[:, None]
    return self.out(jax.nn.gelu(h)).reshape(x.shape)


class ByteHashEncoder:
  """Prompts -> (B, 3, 8) embeddings from the prompt's bytes (deterministic, no weights)."""

  def encode(self, prompts):
    out = []
    for p in prompts:
      digest = hashlib.sha256(p.encode()).digest()[:int(np.prod(TEXT))]
      out.append(np.frombuffer(digest, np.uint8).astype(np.float32).reshape(TEXT) / 255.0 - 0.5)
    return np.stack(out)


class PoolingVAE(nnx.Module):
  """Images (B, 3, 16, 16) in [-1, 1] <-> latents (B, 4, 8, 8): 2x2 mean pool plus a zero channel, and
  nearest upsampling of the first three channels back. No parameters."""

  def encode(self, pixels):
    b = pixels.shape[0]
    pooled = pixels.reshape(b, 3, 8, 2, 8, 2).mean((3, 5))
    return jnp.concatenate([pooled, jnp.zeros((b, 1, 8, 8), pooled.dtype)], axis=1)

  def decode(self, z):
    return jnp.repeat(jnp.repeat(z[:, :3], 2, axis=2), 2, axis=3)

  def normalize_latents(self, z):
    return z

  def denormalize_latents(self, z):
    return z


class StandInFamily(family_lib.SectionFamily, pipeline.LatentPipeline):
  """A text-to-image family defined outside ddrl_jax/models (see the module docstring)."""

  name = 'standin'
  section = 'standin'
  resume_safe_keys = ()
  compute_dtype = 'float32'
  remat_policy = 'none'
  TEXT_FIELDS = {'text': 'text_embedding'}
  DECODE_PERM = (0, 2, 3, 1)
  shape_key = 'config.standin'
  sample_shape = LATENT
  media_shape = (1, 16, 16, 3)
  vae_batch = 2

  def __init__(self, config):
    self.config = config
    self.c = config.standin

  def build(self, key):
    return StandInNet(nnx.Rngs(key))

  def apply_fn(self, graphdef):
    cfg_on = self.cfg_on

    def apply(params, x_t, t, cond):
      model = nnx.merge(graphdef, jax.tree.map(lambda a: a, params))
      t = jnp.reshape(t, (x_t.shape[0],)).astype(jnp.float32)
      if not cfg_on:
        return model(x_t, t, cond['text'])
      return family_lib.guided_velocity(model, x_t, t, cond, ('text',))
    return apply

  def forward_flops(self, sample_shape):
    return 2.0 * (2 * int(np.prod(sample_shape)) * WIDTH + TEXT[1] * WIDTH) * (2 if self.cfg_on else 1)

  def attention_shape(self):
    return None

  def attention_kernel(self, platform):
    return None

  def compute_cast(self, abstract_module):
    return None

  def exporter(self):
    return None

  def make_text_encoder(self):
    return ByteHashEncoder()

  def encode_text(self, encoder, prompts):
    return dict(text_embedding=encoder.encode(prompts))

  def text_shapes(self):
    return dict(text=TEXT)

  def build_vae(self):
    return PoolingVAE()

  def media_to_pixels(self, media_u8):
    return np.transpose(media_u8[:, 0].astype(np.float32) / 127.5 - 1.0, (0, 3, 1, 2))

  def required_inputs(self):
    return []


@pytest.fixture
def standin():
  family_lib.register('standin', StandInFamily)
  yield
  family_lib.unregister('standin')


def standin_config(algorithm='flow_grpo'):
  """configs/sd35m.py's smoke recipe with the stand-in family: only the model keys change."""
  c = sd35m.get_config(f'{algorithm}_smoke')
  c.model_family = 'standin'
  c.standin = ml_collections.ConfigDict(dict(checkpoint=''))
  c.lora.rank = 0
  c.reward.fns = ml_collections.ConfigDict({'mean_intensity': 1.0})
  c.num_iterations = 2
  return c


def test_a_registered_family_is_known_and_a_builtin_name_is_refused(standin):
  assert 'standin' in family_lib.known_families()
  with pytest.raises(ValueError, match="model family 'sd3' is built in"):
    family_lib.register('sd3', StandInFamily)
  task = tasks.get_task(standin_config())
  assert task.family.name == 'standin' and task.sample_shape == LATENT
  cond = task.conditions(jax.random.key(0), 2)
  assert set(cond) == {'text', 'null_text', 'guidance', 'index'} and cond['text'].shape == (2,) + TEXT
  media, finite = task.decode(np.zeros((3,) + LATENT, np.float32))
  assert media.shape == (3, 16, 16, 3) and finite.all()
  latents = task.encode_samples(np.full((2, 1, 16, 16, 3), 255, np.uint8))
  np.testing.assert_allclose(latents[:, :3], 1.0)
  np.testing.assert_allclose(latents[:, 3], 0.0)


@pytest.mark.parametrize('algorithm', ['flow_grpo', pytest.param('ddrl', marks=pytest.mark.slow)])
def test_a_family_defined_in_a_test_trains_through_the_prompt_task(standin, algorithm, tmp_path):
  c = standin_config(algorithm)
  trainer = trainer_lib.Trainer(c, str(tmp_path / 'run'), devices=jax.devices()[:1])
  trainer.train(progress=False)
  rows = metrics_lib.read_metrics(tmp_path / 'run')
  losses = [r['loss'] for r in rows if 'loss' in r]
  assert len(losses) == c.num_iterations and np.all(np.isfinite(losses))
  assert any('eval/reward/mean_intensity' in r for r in rows)
