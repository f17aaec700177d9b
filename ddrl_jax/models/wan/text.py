"""Wan2.1 text conditioning: UMT5-XXL, as diffusers 0.39's `WanPipeline.encode_prompt` encodes prompts.

`WanTextEncoder.encode` returns what `WanPipeline.encode_prompt` (num_videos_per_prompt=1) returns as
`prompt_embeds`, as float32 numpy of shape (B, max_sequence_length, d_model) (d_model 4096 for UMT5-XXL):

* each prompt is cleaned as diffusers' `prompt_clean` does: `ftfy.fix_text` only when the ftfy package is
  importable (diffusers decides with `is_ftfy_available()`, so both follow the same environment), then
  `html.unescape` twice, strip, every whitespace run (the `regex` module's `\\s+`) -> one space, strip;
* the tokenizer (`tokenizer/`, T5TokenizerFast for google/umt5-xxl) pads to `max_sequence_length`
  ('max_length', truncation on, '</s>' appended) and returns the attention mask;
* `UMT5EncoderModel` (`text_encoder/`) runs **with** that mask; its last hidden state is cut to each prompt's
  true length (the mask's sum, '</s>' included) and the rest of the sequence is set to exact zeros, so the
  result is always max_sequence_length long (the DiT then attends to the zero rows unmasked).
diffusers' `__call__` uses max_sequence_length=512 (the `encode_prompt` helper defaults to 226); 512 is the
default here. The classifier-free-guidance embedding is the same encoding of "" (diffusers' default negative
prompt): `encode_null`.

Why transformers' PyTorch class and not a JAX port: there is no Flax UMT5 class in transformers; the torch
`UMT5EncoderModel` is what the diffusers pipeline itself runs, so the embeddings are identical to the
reference; it reads the sharded safetensors that UMT5-XXL ships as natively; and the text encoder runs once
per prompt at data-preparation time (RL prompt sets are fixed), never inside the jitted training step, so
nothing would be gained by having it in JAX.

The torch import, the subfolder loading / saving and the T5 tokenization are `models.hf_text`'s, shared with
the other families. `tiny_random` builds the same classes at toy size with random weights and a tokenizer
built in-process (no download; hf_text's T5-shaped Unigram tokenizer), and `WanTextEncoder.save_pretrained`
writes them as the text part of a diffusers Wan pipeline folder (the encoder sharded), so tests go through the
real `from_pretrained` path.
"""
import html
import importlib.util
import json
import os

import numpy as np

from ddrl_jax.models import hf_text

MAX_SEQUENCE_LENGTH = 512   # WanPipeline.__call__'s default max_sequence_length
WAN_TEXT_DIM = 4096         # UMT5-XXL d_model (the Wan DiT's text_dim)

TEXT_ENCODER, TOKENIZER = 'text_encoder', 'tokenizer'   # subfolders of a diffusers Wan pipeline folder


# ---------------------------------------------------------------------- prompt cleaning

_FTFY = importlib.util.find_spec('ftfy') is not None   # the test diffusers makes (`is_ftfy_available`)


def clean_prompt(text):
  """diffusers' Wan `prompt_clean`: ftfy (if installed), html-unescape twice, collapse whitespace, strip."""
  import regex  # a transformers dependency; diffusers uses it (not `re`) for this substitution
  if _FTFY:
    import ftfy
    text = ftfy.fix_text(text)
  text = html.unescape(html.unescape(text)).strip()
  return regex.sub(r'\s+', ' ', text).strip()


# ---------------------------------------------------------------------- the encoder


class WanTextEncoder:
  """The Wan2.1 UMT5 text encoder with its tokenizer (transformers' torch classes, eval mode, CPU by default).

  Attributes: tokenizer, text_encoder, device; dim (d_model, the embeddings' width).
  """

  def __init__(self, tokenizer, text_encoder, *, device='cpu'):
    self.tokenizer, self.text_encoder = tokenizer, text_encoder
    self.device = device
    text_encoder.to(device)
    text_encoder.eval()

  @property
  def dim(self):
    return self.text_encoder.config.d_model

  # ------------------------------------------------------------------ loading / saving

  @classmethod
  def from_pretrained(cls, path, *, dtype='float32', device='cpu'):
    """Read text_encoder/ (UMT5EncoderModel, possibly sharded safetensors) and tokenizer/ of a diffusers Wan
    pipeline folder, offline (`local_files_only=True`), with the classes diffusers uses (UMT5EncoderModel,
    AutoTokenizer). dtype: the encoder's weight dtype (torch dtype or its name; diffusers' examples load the
    pipeline in bfloat16, whose embeddings then differ from float32 ones by bf16 rounding); outputs are
    float32 either way.
    """
    from transformers import AutoTokenizer, UMT5EncoderModel
    path = hf_text.pipeline_folder(path, 'Wan pipeline folder')
    missing = hf_text.missing_subfolders(path, (TEXT_ENCODER, TOKENIZER))
    if missing:
      raise FileNotFoundError(
          f'Wan pipeline folder {path!r} lacks the subfolder(s) {", ".join(missing)}: expected '
          f'{TEXT_ENCODER}/ (UMT5EncoderModel) and {TOKENIZER}/ (the umt5-xxl tokenizer)')
    tok, enc = hf_text.load_part(path, (TEXT_ENCODER, TOKENIZER), UMT5EncoderModel, AutoTokenizer, dtype=dtype)
    return cls(tok, enc, device=device)

  def save_pretrained(self, path, *, max_shard_size='5GB'):
    """Write text_encoder/ (safetensors, sharded at max_shard_size) and tokenizer/ as a diffusers Wan pipeline
    folder. model_index.json: an existing one gets its text_encoder/tokenizer entries updated (its other
    components kept); otherwise one is written listing only these two parts (the others None).
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    entries = hf_text.save_part(path, (TEXT_ENCODER, TOKENIZER), self.text_encoder, self.tokenizer,
                                max_shard_size=max_shard_size)
    index_path = os.path.join(path, 'model_index.json')
    if os.path.isfile(index_path):
      with open(index_path) as f:
        index = json.load(f)
    else:
      index = {'_class_name': 'WanPipeline', 'transformer': [None, None], 'vae': [None, None],
               'scheduler': [None, None]}
    index.update(entries)
    with open(index_path, 'w') as f:
      json.dump(index, f, indent=2, sort_keys=True)

  # ------------------------------------------------------------------ encoding

  def tokenize(self, prompts, max_sequence_length=MAX_SEQUENCE_LENGTH):
    """Cleaned prompts -> (input_ids, attention_mask), torch int64 (B, max_sequence_length), as diffusers."""
    return hf_text.t5_tokenize(self.tokenizer, [clean_prompt(p) for p in prompts], max_sequence_length)

  def _encode_chunk(self, prompts, max_sequence_length):
    torch = hf_text.torch_module()
    ids, mask = self.tokenize(prompts, max_sequence_length)
    hidden = self.text_encoder(ids.to(self.device), mask.to(self.device)).last_hidden_state
    hidden = hidden.to(torch.float32).cpu()
    lengths = mask.gt(0).sum(dim=1)
    keep = torch.arange(hidden.shape[1])[None, :] < lengths[:, None]   # the first `length` rows of each prompt
    return torch.where(keep[..., None], hidden, torch.zeros((), dtype=hidden.dtype)).numpy().astype(np.float32)

  def encode(self, prompts, max_sequence_length=MAX_SEQUENCE_LENGTH, *, batch_size=16):
    """Prompts -> (B, max_sequence_length, dim) float32 numpy: diffusers' Wan prompt_embeds (rows past each
    prompt's token count, '</s>' included, are zeros). Runs in chunks of batch_size prompts."""
    torch = hf_text.torch_module()
    if isinstance(prompts, str):
      prompts = [prompts]
    prompts = list(prompts)
    if batch_size < 1:
      raise ValueError(f'batch_size must be >= 1, got {batch_size}')
    chunks = []
    with torch.inference_mode():
      for i in range(0, len(prompts), batch_size):
        chunks.append(self._encode_chunk(prompts[i:i + batch_size], max_sequence_length))
    if not chunks:
      return np.zeros((0, max_sequence_length, self.dim), np.float32)
    return np.concatenate(chunks)

  def lengths(self, prompts, max_sequence_length=MAX_SEQUENCE_LENGTH):
    """Each prompt's token count after cleaning and truncation ('</s>' included): its non-zero rows."""
    if isinstance(prompts, str):
      prompts = [prompts]
    _, mask = self.tokenize(list(prompts), max_sequence_length)
    return mask.gt(0).sum(dim=1).numpy()

  def encode_null(self, max_sequence_length=MAX_SEQUENCE_LENGTH, batch_size=1):
    """The classifier-free-guidance embedding: "" (diffusers' default negative prompt) encoded as `encode`
    does, repeated batch_size times: (batch_size, max_sequence_length, dim)."""
    return np.repeat(self.encode([''], max_sequence_length), batch_size, axis=0)


# ---------------------------------------------------------------------- tiny random encoder (tests)

TINY_TEXT_DIM = 24      # d_model of tiny_random's UMT5
TINY_TEXT_LAYERS = 2
TINY_TEXT_HEADS = 2


def tiny_random(seed=0, *, dim=TINY_TEXT_DIM, num_layers=TINY_TEXT_LAYERS, num_heads=TINY_TEXT_HEADS):
  """A tiny UMT5EncoderModel with random weights and an offline T5-shaped tokenizer.

  Same classes as Wan (UMT5EncoderModel, T5TokenizerFast: <pad>=0, </s>=1, <unk>=2, '</s>' appended), shapes
  shrunk: d_model dim, num_layers layers, num_heads heads of dim // num_heads, gated-gelu FFN of 2 * dim,
  per-layer relative position buckets (8 buckets, max distance 32) as UMT5. Weights are redrawn O(1) (the
  transformers init is tiny-std for some) so that any mismatch shows.
  """
  from transformers import UMT5Config, UMT5EncoderModel
  torch = hf_text.torch_module()
  if dim % num_heads:
    raise ValueError(f'dim={dim} must be divisible by num_heads={num_heads}')
  torch.manual_seed(seed)
  tok = hf_text.t5_tokenizer()
  cfg = UMT5Config(vocab_size=len(tok), d_model=dim, d_kv=dim // num_heads, d_ff=2 * dim, num_layers=num_layers,
                   num_heads=num_heads, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                   feed_forward_proj='gated-gelu', is_encoder_decoder=False, use_cache=False, dropout_rate=0.0,
                   tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
  enc = UMT5EncoderModel(cfg).float().eval()
  hf_text.redraw_([enc], seed + 1)
  return WanTextEncoder(tok, enc)
