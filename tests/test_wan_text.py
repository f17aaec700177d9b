"""WanTextEncoder vs diffusers 0.39's own `WanPipeline.encode_prompt`, on a tiny random UMT5EncoderModel with a
tokenizer built offline (`wan.text.tiny_random`), in float32.

The reference pipeline is built by diffusers itself (its constructor with transformer, vae and scheduler None,
or its `from_pretrained` on the folder our `save_pretrained` wrote), so the comparison is against the code
diffusers runs (prompt cleaning, masked encoder, cut to length and zero padding), not a reimplementation.
"""
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip('torch')
diffusers = pytest.importorskip('diffusers')

from ddrl_jax.models.wan import text as wan_text  # noqa: E402

TOL = 1e-6
MAX_SEQ = 24   # a short length for the quick checks; the default 512 is compared in test_matches_diffusers
LONG = ' '.join(['a big red sign that says hello world on the street'] * 12)   # > MAX_SEQ, < 512 tokens
LONGER = ' '.join([LONG] * 5)                                                    # > 512 tokens
PROMPTS = ['a photo of a cat', '  Hello &amp;amp; World!\n\t42  ', '', LONG, 'x', LONGER]


@pytest.fixture(scope='module')
def tiny():
  return wan_text.tiny_random(seed=0)


@pytest.fixture(scope='module')
def saved(tiny, tmp_path_factory):
  path = tmp_path_factory.mktemp('wan_text_pipeline')
  tiny.save_pretrained(path, max_shard_size='20KB')
  return path


def _pipeline(enc):
  return diffusers.WanPipeline(tokenizer=enc.tokenizer, text_encoder=enc.text_encoder, transformer=None, vae=None,
                               scheduler=None)


def _reference(pipe, prompts, negative_prompt=None, max_sequence_length=MAX_SEQ):
  """diffusers' prompt and negative embeddings as float32 numpy."""
  with torch.no_grad():
    pos, neg = pipe.encode_prompt(prompts, negative_prompt, do_classifier_free_guidance=True,
                                  max_sequence_length=max_sequence_length, device=torch.device('cpu'))
  return pos.float().numpy(), neg.float().numpy()


def _maxdiff(a, b):
  assert a.shape == b.shape, (a.shape, b.shape)
  return float(np.abs(a - b).max())


def test_prompts_have_distinct_lengths_and_truncate(tiny):
  full = [len(tiny.tokenizer(wan_text.clean_prompt(p)).input_ids) for p in PROMPTS]
  assert len(set(full)) == len(PROMPTS)           # all different lengths
  assert MAX_SEQ < full[3] < 512 < full[5]         # LONG truncates at MAX_SEQ only, LONGER at 512 too
  assert list(tiny.lengths(PROMPTS, 512)) == [min(n, 512) for n in full]
  assert list(tiny.lengths(PROMPTS, MAX_SEQ)) == [min(n, MAX_SEQ) for n in full]
  assert tiny.lengths([''])[0] == 1                # '</s>' only


@pytest.mark.parametrize('max_sequence_length', [512, MAX_SEQ])
def test_matches_diffusers_encode_prompt(tiny, max_sequence_length):
  ref, ref_neg = _reference(_pipeline(tiny), PROMPTS, max_sequence_length=max_sequence_length)
  emb = tiny.encode(PROMPTS, max_sequence_length)
  assert emb.dtype == np.float32 and emb.shape == (len(PROMPTS), max_sequence_length, wan_text.TINY_TEXT_DIM)
  assert _maxdiff(emb, ref) <= TOL
  null = tiny.encode_null(max_sequence_length, batch_size=len(PROMPTS))
  assert _maxdiff(null, ref_neg) <= TOL
  assert _maxdiff(emb[2], null[0]) <= TOL          # "" inside the batch is the null embedding
  # exact zeros past each prompt's true length, no zero row within it
  for row, n in zip(emb, tiny.lengths(PROMPTS, max_sequence_length)):
    assert np.all(row[n:] == 0)
    assert np.all(np.any(row[:n] != 0, axis=-1))


def test_negative_prompts_match_diffusers(tiny):
  prompts, negatives = ['a cat', 'a dog on the street'], ['blurred, low quality', 'static']
  _, ref_neg = _reference(_pipeline(tiny), prompts, negatives)
  assert _maxdiff(tiny.encode(negatives, MAX_SEQ), ref_neg) <= TOL
  _, ref_neg = _reference(_pipeline(tiny), prompts, 'ugly')   # one string for the whole batch
  assert _maxdiff(np.repeat(tiny.encode('ugly', MAX_SEQ), 2, axis=0), ref_neg) <= TOL


def test_prompt_cleaning_as_diffusers():
  from diffusers.pipelines.wan import pipeline_wan
  from diffusers.utils import is_ftfy_available
  assert wan_text._FTFY == is_ftfy_available()
  # '\x1c' tells the `regex` module diffusers uses (kept) from `re` (collapsed) apart
  texts = ['  a\u00a0b\t\tc\n', '&amp;lt;tag&amp;gt; &quot;x&quot;', 'a\x1cb\u2003c\u3000d', '\u00e2\u0080\u0099ok', '', ' \n ']
  for t in texts:
    assert wan_text.clean_prompt(t) == pipeline_wan.prompt_clean(t), repr(t)


def test_chunked_batches_match(tiny):
  whole = tiny.encode(PROMPTS, MAX_SEQ)
  assert _maxdiff(whole, tiny.encode(PROMPTS, MAX_SEQ, batch_size=2)) <= TOL
  assert _maxdiff(whole, tiny.encode(PROMPTS, MAX_SEQ, batch_size=1)) <= TOL


def test_round_trip_sharded(tiny, saved):
  """save_pretrained -> from_pretrained (the encoder as several safetensors shards) gives the same embeddings,
  and diffusers' own WanPipeline.from_pretrained reads the folder and agrees."""
  shards = sorted(p.name for p in (saved / 'text_encoder').glob('model-*.safetensors'))
  assert len(shards) >= 2 and (saved / 'text_encoder' / 'model.safetensors.index.json').exists()
  loaded = wan_text.WanTextEncoder.from_pretrained(saved)
  assert loaded.dim == tiny.dim == wan_text.TINY_TEXT_DIM
  assert type(loaded.text_encoder).__name__ == 'UMT5EncoderModel'
  assert next(loaded.text_encoder.parameters()).dtype == torch.float32
  a = tiny.encode(PROMPTS, MAX_SEQ)
  b = loaded.encode(PROMPTS, MAX_SEQ)
  assert np.array_equal(a, b)
  pipe = diffusers.WanPipeline.from_pretrained(saved, transformer=None, vae=None, scheduler=None,
                                               local_files_only=True)
  ref, ref_neg = _reference(pipe, PROMPTS)
  assert _maxdiff(b, ref) <= TOL and _maxdiff(loaded.encode_null(MAX_SEQ, len(PROMPTS)), ref_neg) <= TOL


def test_save_keeps_other_components(tiny, tmp_path):
  index = {'_class_name': 'WanPipeline', 'transformer': ['diffusers', 'WanTransformer3DModel'],
           'vae': ['diffusers', 'AutoencoderKLWan'], 'scheduler': ['diffusers', 'UniPCMultistepScheduler']}
  (tmp_path / 'model_index.json').write_text(json.dumps(index))
  tiny.save_pretrained(tmp_path)
  written = json.loads((tmp_path / 'model_index.json').read_text())
  assert written['transformer'] == index['transformer'] and written['vae'] == index['vae']
  assert written['text_encoder'] == ['transformers', 'UMT5EncoderModel']
  assert written['tokenizer'][0] == 'transformers'


@pytest.mark.parametrize('missing', ['text_encoder', 'tokenizer'])
def test_missing_subfolder_error(saved, tmp_path, missing):
  path = tmp_path / 'pipe'
  shutil.copytree(saved, path)
  shutil.rmtree(path / missing)
  with pytest.raises(FileNotFoundError, match=f'lacks the subfolder.*{missing}'):
    wan_text.WanTextEncoder.from_pretrained(path)
  with pytest.raises(FileNotFoundError, match='does not exist'):
    wan_text.WanTextEncoder.from_pretrained(tmp_path / 'nowhere')


def test_shapes(tiny):
  emb = tiny.encode(['a photo of a cat', LONG, 'hello'])   # default max_sequence_length 512
  assert emb.shape == (3, wan_text.MAX_SEQUENCE_LENGTH, wan_text.TINY_TEXT_DIM) == (3, 512, 24)
  assert tiny.encode('one prompt').shape == (1, 512, 24)
  assert tiny.encode_null().shape == (1, 512, 24)
  assert tiny.encode_null(MAX_SEQ, batch_size=3).shape == (3, MAX_SEQ, 24)
  assert tiny.encode([], MAX_SEQ).shape == (0, MAX_SEQ, 24)
  cfg = tiny.text_encoder.config
  assert (cfg.d_model, cfg.num_layers, cfg.num_heads) == (wan_text.TINY_TEXT_DIM, wan_text.TINY_TEXT_LAYERS,
                                                          wan_text.TINY_TEXT_HEADS) == (24, 2, 2)
