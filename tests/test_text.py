"""Text conditioning: MiniLM in JAX against its PyTorch original, full_concat, byte embeddings."""
import flax.nnx as nnx
import jax
import numpy as np
import pytest

from ddrl_jax.models import text

SENTENCES = ['A cat holding a sign that says hello', 'a kitten holds up a sign reading hello',
             'The stock market fell sharply on Monday']


@pytest.fixture(scope='module')
def minilm():
  return text.MiniLMEncoder(max_length=24)


def test_minilm_matches_pytorch_sentence_transformers(minilm):
  """The JAX encoder reproduces the PyTorch BERT of the same files (an independent implementation)."""
  torch = pytest.importorskip('torch')
  from transformers import BertModel
  ref = BertModel.from_pretrained(text.minilm_path(), local_files_only=True).eval()
  ids, mask = minilm.tokenize(SENTENCES)
  with torch.no_grad():
    want = ref(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).last_hidden_state
  got, got_mask = minilm(SENTENCES)
  assert got.shape == (3, 24, 384) and got_mask.dtype == bool
  np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=2e-4, rtol=1e-4)


def test_minilm_embeds_meaning(minilm):
  e = np.asarray(minilm.pooled(SENTENCES))
  np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
  paraphrase, unrelated = e[0] @ e[1], e[0] @ e[2]
  assert paraphrase > 0.7 and unrelated < 0.3, (paraphrase, unrelated)


def test_reason_full_concat_normalises_each_layer_per_token():
  rng = np.random.RandomState(0)
  h = rng.randn(2, 3, 5, 8) * 4.0 + 2.0
  out = np.asarray(text.reason_full_concat(h))
  assert out.shape == (2, 5, 24)
  layer1 = out[:, :, 8:16]                      # layer index 1, all tokens
  ref = (h[:, 1] - h[:, 1].mean(-1, keepdims=True)) / (h[:, 1].std(-1, ddof=1, keepdims=True) + 1e-8)
  np.testing.assert_allclose(layer1, ref, rtol=1e-5, atol=1e-5)


def test_byte_embedding_roundtrip_and_shapes():
  ids, mask = text.encode_bytes(['hé', 'a long text'], max_length=4)
  assert ids.shape == (2, 4)
  np.testing.assert_array_equal(ids[0], [ord('h'), 0xC3, 0xA9, text.PAD_BYTE])
  np.testing.assert_array_equal(mask[1], [True] * 4)
  emb = text.ByteEmbedding(16, max_length=4, rngs=nnx.Rngs(0))
  out = emb(jax.numpy.asarray(ids))
  assert out.shape == (2, 4, 16)
  assert not np.allclose(out[0, 0], out[1, 0])       # 'h' and 'a' embed differently
