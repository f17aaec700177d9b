"""The 'cosmos' family owns its pipeline (models.pipeline.LatentPipeline): the Wan2.1 VAE (the shared
models.video_vae) and the text encoders; the Cosmos video task (tasks/video.py) keeps only its data,
conditions, rewards and evaluation and reaches the VAE and the encoders through the family."""
import ast
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import cosmos2b
from ddrl_jax import tasks
from ddrl_jax.models import pipeline as pipeline_lib
from ddrl_jax.models import text as text_lib
from ddrl_jax.models.cosmos import family as cosmos_family

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VIDEO_TASK = os.path.join(ROOT, 'ddrl_jax', 'tasks', 'video.py')


def _config(**cosmos):
  config = cosmos2b.get_config('smoke')
  config.cosmos.vae_batch = 2                  # compiles in seconds on 2 CPU cores
  config.cosmos.update(cosmos)
  return config


@pytest.fixture(scope='module')
def family():
  return cosmos_family.CosmosVideoFamily(_config())


def test_the_family_is_a_latent_pipeline_of_videos(family):
  assert isinstance(family, pipeline_lib.LatentPipeline)
  assert family.sample_shape == (16, 2, 4, 4) and family.media_shape == (5, 32, 32, 3) and family.is_video
  assert family.text_shapes() == dict(text=(16, 32)) and family.text_width == 32
  assert not family.cache_text and family.guidance_mode == 'none' and not family.cfg_on
  assert family.vae_checkpoint_key == 'config.cosmos.vae_checkpoint' and family.vae_batch == 2
  assert family.device_text_encoder() is None                           # 'bytes': nothing on the devices
  shapes = family.abstract_text_conditions(3)
  assert list(shapes) == ['text'] and shapes['text'].shape == (3, 16, 32)


def test_vae_round_trip_through_the_family(family):
  """encode_samples then decode: finite uint8 videos (M, F, H, W, 3) of media_shape (3 videos: the last
  chunk of vae_batch 2 is padded)."""
  videos = np.random.RandomState(0).randint(0, 256, (3,) + family.media_shape).astype(np.uint8)
  latents = family.encode_samples(videos)
  assert latents.shape == (3,) + family.sample_shape and latents.dtype == np.float32
  assert np.isfinite(latents).all()
  decoded, finite = family.decode(latents)
  assert decoded.shape == (3,) + family.media_shape and decoded.dtype == np.uint8 and finite.all()
  bad = latents.copy()
  bad[1, 0, 0, 0, 0] = np.nan
  assert family.decode(bad)[1].tolist() == [True, False, True]
  with pytest.raises(ValueError, match=r'encode_samples: expected \(B, \*\(5, 32, 32, 3\)\) uint8'):
    family.encode_samples(videos.astype(np.float32))


def test_byte_prompts_through_the_family_are_the_frozen_byte_embedding(family, monkeypatch):
  """The family's 'bytes' encoder is the task's old one: ByteEmbedding(text width, text_length) of seed
  config.cosmos.text_seed on the prompts' UTF-8 bytes; nothing is cached (every call encodes)."""
  prompts = ['a red square moving to the right', '', 'ünïcode ' * 4]
  c = family.c
  emb = text_lib.ByteEmbedding(32, c.text_length, rngs=nnx.Rngs(c.text_seed))
  ids, _ = text_lib.encode_bytes(prompts, c.text_length)
  want = np.asarray(emb(jnp.asarray(ids)), np.float32)
  got = family.encode_prompts(prompts)
  assert list(got) == ['text_embedding']
  np.testing.assert_array_equal(got['text_embedding'], want)

  calls = []
  encode_text = family.encode_text
  monkeypatch.setattr(family, 'encode_text', lambda enc, p: calls.append(list(p)) or encode_text(enc, p))
  family.encode_prompts(prompts[:1])
  family.encode_prompts(prompts[:1])
  assert calls == [prompts[:1], prompts[:1]]                       # cache_text False: encoded each time


def test_the_task_encodes_through_its_family():
  task = tasks.get_task(_config())
  prompts = ['a blue square moving down', 'x']
  np.testing.assert_array_equal(task.encode_prompts(prompts),
                                task.family.encode_prompts(prompts)['text_embedding'])
  np.testing.assert_array_equal(task.family.negative_text(),
                                task.encode_prompts([cosmos_family.NEGATIVE_PROMPT])[0])
  assert task.media_shape == task.family.media_shape and task.sample_shape == task.family.sample_shape
  assert task.video_shape == (3, 5, 32, 32) and task.text_dim == 32
  assert task.device_text_encoder() is None and 'device_text_encoder' in task.capabilities
  assert task.num_truncated_prompts == 0
  assert [i.key for i in task.required_inputs()] == ['cosmos.checkpoint', 'cosmos.vae_checkpoint']


def _imports_and_attributes(path):
  tree = ast.parse(open(path).read())
  modules, attributes = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      modules |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      modules |= {f'{node.module}.{a.name}' for a in node.names} | {node.module}
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
        node.value.attr == 'family':
      attributes.append(node.attr)
  return modules, attributes


def test_the_video_task_imports_no_vae_or_text_encoder():
  """tasks/video.py names no VAE or text-encoder module (nor a family's folder) and reads no private
  attribute of its family, nor the family's network config: both are the family's (models/cosmos/family.py)."""
  modules, attributes = _imports_and_attributes(VIDEO_TASK)
  forbidden = ('ddrl_jax.models.video_vae', 'ddrl_jax.models.video_vae_convert', 'ddrl_jax.models.reason1_text',
               'ddrl_jax.models.text', 'ddrl_jax.models.wan', 'ddrl_jax.models.cosmos', 'ddrl_jax.models.pipeline')
  hits = sorted(m for m in modules for f in forbidden if m == f or m.startswith(f + '.'))
  assert not hits, hits
  source = open(VIDEO_TASK).read()
  for name in ('video_vae', 'ByteEmbedding', 'WanVAE', 'text_lib', 'vae_functions', 'Reason1TextEncoder',
               'encode_bytes'):
    assert name not in source, name
  assert not [a for a in attributes if a.startswith('_') or a == 'dit'], attributes


def test_the_wan_vae_is_shared_not_in_a_family_folder():
  models = os.path.join(ROOT, 'ddrl_jax', 'models')
  assert os.path.isfile(os.path.join(models, 'video_vae.py'))
  assert os.path.isfile(os.path.join(models, 'video_vae_convert.py'))
  assert not os.path.exists(os.path.join(models, 'wan', 'vae.py'))
  assert not os.path.exists(os.path.join(models, 'wan', 'vae_convert.py'))
  for name in ('video_vae.py', 'video_vae_convert.py'):
    modules, _ = _imports_and_attributes(os.path.join(models, name))
    assert not [m for m in modules if m.split('.')[:3] in (['ddrl_jax', 'models', f]
                                                           for f in ('wan', 'cosmos', 'sd3'))], name
