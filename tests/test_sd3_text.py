"""SD3TextEncoders vs diffusers 0.39's own `StableDiffusion3Pipeline.encode_prompt`, on tiny random CLIP-L-like,
CLIP-G-like and T5 encoders with tokenizers built offline (`sd3.text.tiny_random`), in float32.

The reference pipeline is built by diffusers itself (its constructor with transformer, vae and scheduler None,
or its `from_pretrained` on the folder our `save_pretrained` wrote), so the comparison is against the code
diffusers runs, not a reimplementation.
"""
import types

import numpy as np
import pytest

torch = pytest.importorskip('torch')
diffusers = pytest.importorskip('diffusers')

from ddrl_jax.models.sd3 import text as sd3_text  # noqa: E402

TOL = 1e-6
MAX_SEQ = 24   # a short T5 length keeps the tests fast; the default 256 is checked in test_shapes
LONG = ' '.join(['a big red sign that says hello world on the street'] * 12)   # > 77 CLIP and > 24 T5 tokens
PROMPTS = ['a photo of a cat', 'Hello, World! 42', '', LONG, 'x']


@pytest.fixture(scope='module')
def tiny():
  return sd3_text.tiny_random(seed=0)


@pytest.fixture(scope='module')
def saved(tiny, tmp_path_factory):
  path = tmp_path_factory.mktemp('sd3_text_pipeline')
  tiny.save_pretrained(path, max_shard_size='50KB')
  return path


def _pipeline(enc):
  pipe = diffusers.StableDiffusion3Pipeline(
      transformer=None, scheduler=None, vae=None, text_encoder=enc.text_encoder, tokenizer=enc.tokenizer,
      text_encoder_2=enc.text_encoder_2, tokenizer_2=enc.tokenizer_2, text_encoder_3=enc.text_encoder_3,
      tokenizer_3=enc.tokenizer_3)
  if enc.text_encoder_3 is None:   # diffusers reads the T5-less width from the transformer's config
    pipe.transformer = types.SimpleNamespace(config=types.SimpleNamespace(joint_attention_dim=enc.joint_dim))
  return pipe


def _reference(pipe, prompts, max_sequence_length=MAX_SEQ):
  """diffusers' prompt, negative ("") and pooled embeddings as float32 numpy."""
  with torch.no_grad():
    out = pipe.encode_prompt(prompts, None, None, device=torch.device('cpu'), do_classifier_free_guidance=True,
                             max_sequence_length=max_sequence_length)
  return [o.float().numpy() for o in out]   # prompt_embeds, negative_prompt_embeds, pooled, negative_pooled


def _maxdiff(a, b):
  assert a.shape == b.shape, (a.shape, b.shape)
  return float(np.abs(a - b).max())


def test_long_prompt_is_truncated(tiny):
  """The long prompt really exceeds both CLIP's 77 tokens and the T5 length (so truncation is exercised)."""
  assert len(tiny.tokenizer(LONG).input_ids) > 77
  assert len(tiny.tokenizer_2(LONG).input_ids) > 77
  assert len(tiny.tokenizer_3(LONG).input_ids) > MAX_SEQ
  # different prompts tokenize to different lengths
  assert len({len(tiny.tokenizer(p).input_ids) for p in PROMPTS}) == len(PROMPTS)


def test_matches_diffusers_encode_prompt(tiny):
  ref_joint, ref_neg, ref_pooled, ref_neg_pooled = _reference(_pipeline(tiny), PROMPTS)
  joint, pooled = tiny.encode(PROMPTS, MAX_SEQ)
  assert joint.dtype == np.float32 and pooled.dtype == np.float32
  assert _maxdiff(joint, ref_joint) <= TOL
  assert _maxdiff(pooled, ref_pooled) <= TOL
  null_joint, null_pooled = tiny.encode_null(MAX_SEQ, batch_size=len(PROMPTS))
  assert _maxdiff(null_joint, ref_neg) <= TOL
  assert _maxdiff(null_pooled, ref_neg_pooled) <= TOL
  # the empty prompt inside the batch is the null embedding
  assert _maxdiff(joint[2], null_joint[0]) <= TOL
  # the layout: CLIP features zero-padded past 16 + 24, T5 after the 77 CLIP tokens
  clip_w = tiny.text_encoder.config.hidden_size + tiny.text_encoder_2.config.hidden_size
  assert np.all(joint[:, :77, clip_w:] == 0) and np.any(joint[:, :77, :clip_w] != 0)
  assert np.any(joint[:, 77:, clip_w:] != 0)


def test_chunked_batches_match(tiny):
  whole = tiny.encode(PROMPTS, MAX_SEQ)
  chunked = tiny.encode(PROMPTS, MAX_SEQ, batch_size=2)
  assert _maxdiff(whole[0], chunked[0]) <= TOL and _maxdiff(whole[1], chunked[1]) <= TOL


def test_separate_prompts_match_diffusers(tiny):
  """prompt_2 / prompt_3 (other texts for CLIP-G / T5) as diffusers routes them."""
  p, p2, p3 = ['a cat', 'a dog'], ['red sky', 'blue tree'], ['sign that says hello', 'big house']
  with torch.no_grad():
    ref = _pipeline(tiny).encode_prompt(p, p2, p3, device=torch.device('cpu'), do_classifier_free_guidance=False,
                                        max_sequence_length=MAX_SEQ)
  joint, pooled = tiny.encode(p, MAX_SEQ, prompts_2=p2, prompts_3=p3)
  assert _maxdiff(joint, ref[0].numpy()) <= TOL and _maxdiff(pooled, ref[2].numpy()) <= TOL


def test_round_trip_sharded(tiny, saved):
  """save_pretrained -> from_pretrained (T5 as several safetensors shards) gives the same embeddings, and
  diffusers' own from_pretrained reads the folder and agrees."""
  shards = sorted(p.name for p in (saved / 'text_encoder_3').glob('model-*.safetensors'))
  assert len(shards) >= 2 and (saved / 'text_encoder_3' / 'model.safetensors.index.json').exists()
  loaded = sd3_text.SD3TextEncoders.from_pretrained(saved)
  assert loaded.joint_dim == tiny.joint_dim and loaded.pooled_dim == tiny.pooled_dim
  for m in loaded.encoders():
    assert next(m.parameters()).dtype == torch.float32
  a = tiny.encode(PROMPTS, MAX_SEQ)
  b = loaded.encode(PROMPTS, MAX_SEQ)
  assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
  pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(saved, transformer=None, vae=None, scheduler=None,
                                                            local_files_only=True)
  ref_joint, ref_neg, ref_pooled, ref_neg_pooled = _reference(pipe, PROMPTS)
  assert _maxdiff(b[0], ref_joint) <= TOL and _maxdiff(b[1], ref_pooled) <= TOL


def test_without_t5_matches_diffusers(saved):
  """text_encoder_3=None: the T5 part is zeros of the joint width, as diffusers."""
  enc = sd3_text.SD3TextEncoders.from_pretrained(saved, load_t5=False, joint_dim=48)
  assert enc.text_encoder_3 is None
  ref_joint, ref_neg, ref_pooled, _ = _reference(_pipeline(enc), PROMPTS[:3])
  joint, pooled = enc.encode(PROMPTS[:3], MAX_SEQ)
  assert joint.shape == (3, 77 + MAX_SEQ, 48) and np.all(joint[:, 77:] == 0)
  assert _maxdiff(joint, ref_joint) <= TOL and _maxdiff(pooled, ref_pooled) <= TOL
  assert _maxdiff(enc.encode_null(MAX_SEQ, batch_size=3)[0], ref_neg) <= TOL


@pytest.mark.parametrize('missing', ['text_encoder_2', 'tokenizer_3'])
def test_missing_subfolder_error(saved, tmp_path, missing):
  import shutil
  path = tmp_path / 'pipe'
  shutil.copytree(saved, path)
  shutil.rmtree(path / missing)
  with pytest.raises(FileNotFoundError, match=missing):
    sd3_text.SD3TextEncoders.from_pretrained(path)
  with pytest.raises(FileNotFoundError, match='does not exist'):
    sd3_text.SD3TextEncoders.from_pretrained(tmp_path / 'nowhere')


def test_shapes(tiny):
  joint, pooled = tiny.encode(['a photo of a cat', LONG, 'hello'])   # default max_sequence_length 256
  assert joint.shape == (3, 77 + 256, tiny.joint_dim) == (3, 333, 48)
  assert pooled.shape == (3, tiny.pooled_dim) == (3, 16 + 24)
  null_joint, null_pooled = tiny.encode_null()
  assert null_joint.shape == (1, 333, 48) and null_pooled.shape == (1, 40)
  assert tiny.encode([], MAX_SEQ)[0].shape == (0, 77 + MAX_SEQ, 48)


def test_tiny_t5_must_be_wide_enough():
  with pytest.raises(ValueError, match='t5_dim'):
    sd3_text.tiny_random(clip_l_dim=16, clip_g_dim=24, t5_dim=32)
