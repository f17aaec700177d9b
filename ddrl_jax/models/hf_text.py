"""Hugging Face text encoders as the diffusers pipelines run them, shared by the families (SD3, Wan, FLUX, ...).

The families' prompt encoders are transformers' PyTorch classes, the ones the diffusers pipelines
themselves run (models/sd3/text.py says why). The pieces more than one family needs live here, so that no
family imports another's folder or copies it:

* `torch_module`, `torch_dtype`: torch imported on demand (the rest of ddrl_jax does not need it), and a
  dtype name (or None) as a torch dtype;
* `pipeline_folder`, `missing_subfolders`, `load_part`, `save_part`: one (tokenizer, encoder) pair read
  from, or written to, its two subfolders of a diffusers pipeline folder, offline;
* `encode_clip`: a CLIP text encoder's per-token hidden state (the penultimate layer by default) and its
  pooled vector (`text_embeds` of CLIPTextModelWithProjection, `pooler_output` of CLIPTextModel), as the
  SD3 and FLUX pipelines' `_get_clip_prompt_embeds` (ids padded to max_length, truncation on, no mask);
* `t5_tokenize`, `encode_t5`: T5 ids padded to max_length with '</s>' appended (and the attention mask),
  and the last hidden state without a mask, as the SD3 and FLUX pipelines' `_get_t5_prompt_embeds`;
* for tests, everything built in-process with no download: `clip_tokenizer` (byte-level BPE over a
  generated vocab) and `t5_tokenizer` (a T5-shaped Unigram), `tiny_clip` and `tiny_t5` (tiny random
  encoders of the released classes), `redraw_` (weights redrawn O(1) so that any mismatch shows).
"""
import json
import os

import numpy as np

CLIP_MAX_LENGTH = 77    # the CLIP tokenizers' model_max_length in the SD3 and FLUX checkpoints
T5_MODEL_MAX_LENGTH = 512

# The words the test tokenizers spell in few tokens (the rest falls back to bytes / characters).
TINY_WORDS = ('a photo of the cat dog sign that says hello world with text on red blue green street '
              'an image in and at is sky tree house big small').split()


def torch_module():
  """The torch module, imported on demand: only the text encoders need it."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("the text encoders run with transformers' PyTorch classes: pip install -e '.[text]'") from e
  return torch


def torch_dtype(dtype):
  """None -> torch.float32; a name ('bfloat16') -> that torch dtype; a torch dtype as is."""
  torch = torch_module()
  if dtype is None:
    return torch.float32
  if isinstance(dtype, str):
    return getattr(torch, dtype)
  return dtype


# ---------------------------------------------------------------------- pipeline folders


def pipeline_folder(path, what):
  """os.fspath(path), or FileNotFoundError naming `what` (e.g. 'SD3 pipeline folder') when it is no folder."""
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f'{what} {path!r} does not exist')
  return path


def missing_subfolders(path, subfolders):
  """The names in `subfolders` that are not folders under `path`."""
  return [s for s in subfolders if not os.path.isdir(os.path.join(path, s))]


def load_part(path, parts, encoder_cls, tokenizer_cls, *, dtype='float32'):
  """(tokenizer, encoder) of the subfolders parts = (encoder subfolder, tokenizer subfolder) of a diffusers
  pipeline folder, offline (`local_files_only=True`); dtype: the encoder's weights (torch dtype or its name)."""
  enc_sub, tok_sub = parts
  kw = dict(local_files_only=True)
  return (tokenizer_cls.from_pretrained(path, subfolder=tok_sub, **kw),
          encoder_cls.from_pretrained(path, subfolder=enc_sub, dtype=torch_dtype(dtype), **kw))


def save_part(path, parts, encoder, tokenizer, *, max_shard_size=None):
  """Writes encoder and tokenizer to their subfolders parts = (encoder, tokenizer) of a pipeline folder (the
  encoder as safetensors, sharded at max_shard_size when given); returns their model_index.json entries."""
  enc_sub, tok_sub = parts
  shard = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
  encoder.save_pretrained(os.path.join(path, enc_sub), safe_serialization=True, **shard)
  tokenizer.save_pretrained(os.path.join(path, tok_sub))
  return {enc_sub: ['transformers', type(encoder).__name__], tok_sub: ['transformers', type(tokenizer).__name__]}


# ---------------------------------------------------------------------- encoding


def encode_clip(tokenizer, encoder, prompts, *, max_length=CLIP_MAX_LENGTH, clip_skip=None, device='cpu'):
  """(hidden (B, max_length, width), pooled (B, P)) as float32 torch tensors, from ids padded to max_length
  (truncation on, no attention mask: CLIP's causal mask only). hidden: hidden_states[-2] (the penultimate
  layer, before the final layer norm) or, with clip_skip, hidden_states[-(clip_skip + 2)]; pooled: the
  projected `text_embeds` of a CLIPTextModelWithProjection (SD3), the `pooler_output` of a CLIPTextModel
  (FLUX)."""
  torch = torch_module()
  ids = tokenizer(prompts, padding='max_length', max_length=max_length, truncation=True,
                  return_tensors='pt').input_ids
  out = encoder(ids.to(device), output_hidden_states=True)
  hidden = out.hidden_states[-2 if clip_skip is None else -(clip_skip + 2)]
  pooled = getattr(out, 'text_embeds', None)
  if pooled is None:
    pooled = out.pooler_output
  return hidden.to(torch.float32), pooled.to(torch.float32)


def t5_tokenize(tokenizer, prompts, max_length):
  """(input_ids, attention_mask), torch int64 (B, max_length): padded to max_length, truncation on, '</s>'
  appended."""
  out = tokenizer(prompts, padding='max_length', max_length=max_length, truncation=True, add_special_tokens=True,
                  return_attention_mask=True, return_tensors='pt')
  return out.input_ids, out.attention_mask


def encode_t5(tokenizer, encoder, prompts, *, max_length, device='cpu'):
  """T5's last hidden state (B, max_length, d_model), float32 torch, run without an attention mask (pad tokens
  are attended to, as in the SD3 and FLUX pipelines)."""
  torch = torch_module()
  ids, _ = t5_tokenize(tokenizer, prompts, max_length)
  return encoder(ids.to(device))[0].to(torch.float32)


# ---------------------------------------------------------------------- offline tokenizers, tiny models (tests)


def clip_tokenizer(directory, pad_token, *, model_max_length=CLIP_MAX_LENGTH):
  """A CLIPTokenizer over a generated byte-level BPE vocab, written to `directory`: the 256 byte symbols,
  each also word-final ('</w>'), merges spelling TINY_WORDS left to right, then <|startoftext|>,
  <|endoftext|> (the highest id, as in CLIP, so the legacy argmax EOS pooling finds it)."""
  from transformers import CLIPTokenizer  # pylint: disable=g-import-not-at-top
  from transformers.models.clip.tokenization_clip import bytes_to_unicode  # pylint: disable=g-import-not-at-top
  symbols = list(bytes_to_unicode().values())
  vocab = symbols + [s + '</w>' for s in symbols]
  merges = []
  for word in TINY_WORDS:
    piece = word[0]
    for k, ch in enumerate(word[1:], start=1):
      nxt = ch + ('</w>' if k == len(word) - 1 else '')
      merge = f'{piece} {nxt}'
      piece = piece + nxt
      if merge not in merges:
        merges.append(merge)
        vocab.append(piece)
  vocab += ['<|startoftext|>', '<|endoftext|>']
  assert len(set(vocab)) == len(vocab)
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, 'vocab.json'), 'w') as f:
    json.dump({t: i for i, t in enumerate(vocab)}, f)
  with open(os.path.join(directory, 'merges.txt'), 'w') as f:
    f.write('#version: 0.2\n' + '\n'.join(merges) + '\n')
  return CLIPTokenizer(os.path.join(directory, 'vocab.json'), os.path.join(directory, 'merges.txt'),
                       pad_token=pad_token, model_max_length=model_max_length)


def t5_tokenizer(*, model_max_length=T5_MODEL_MAX_LENGTH):
  """A T5TokenizerFast over an in-process `tokenizers` Unigram model shaped like T5's: <pad>=0, </s>=1,
  <unk>=2, Metaspace pre-tokenizer ('▁' word prefix), '</s>' appended by the post-processor."""
  # pylint: disable=g-import-not-at-top
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
  from transformers import T5TokenizerFast
  chars = sorted(set('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?\'"-:;()'))
  vocab = [('<pad>', 0.0), ('</s>', 0.0), ('<unk>', 0.0), ('▁', -2.0)]
  vocab += [('▁' + w, -3.0 - 0.01 * i) for i, w in enumerate(TINY_WORDS)]
  vocab += [(c, -6.0) for c in chars] + [('▁' + c, -6.5) for c in chars if c not in TINY_WORDS]
  tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
  tok.normalizer = normalizers.Sequence([normalizers.Replace(Regex(' {2,}'), ' ')])
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='always')
  tok.decoder = decoders.Metaspace(replacement='▁', prepend_scheme='always')
  tok.post_processor = processors.TemplateProcessing(
      single='$A </s>', pair='$A </s> $B </s>', special_tokens=[('</s>', 1)])
  return T5TokenizerFast(tokenizer_object=tok, eos_token='</s>', unk_token='<unk>', pad_token='<pad>',
                         extra_ids=0, model_max_length=model_max_length)


def tiny_clip(tokenizer, dim, *, act, eos_token_id, layers=2, heads=2, projection=True):
  """A tiny random CLIP text encoder over `tokenizer`'s vocab, in float32 eval mode: width dim, 4 * dim MLP,
  77 positions; CLIPTextModelWithProjection (projection_dim = dim, as SD3's) or, with projection=False,
  CLIPTextModel. eos_token_id: 2 selects transformers' legacy argmax pooling (the released CLIP-L config),
  the tokenizer's EOS id pooling at its first occurrence."""
  # pylint: disable=g-import-not-at-top
  from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
  cfg = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=dim, intermediate_size=4 * dim, projection_dim=dim,
                       num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=CLIP_MAX_LENGTH,
                       hidden_act=act, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_token_id,
                       pad_token_id=1)
  return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg).float().eval()


def tiny_t5(tokenizer, dim, *, layers=2):
  """A tiny random T5 v1.1-like T5EncoderModel (gated-gelu, no biases) over `tokenizer`'s vocab, in float32
  eval mode: d_model dim, 4 heads of 8, 2 * dim FFN, 8 relative-position buckets (max distance 32)."""
  from transformers import T5Config, T5EncoderModel  # pylint: disable=g-import-not-at-top
  cfg = T5Config(vocab_size=len(tokenizer), d_model=dim, d_kv=8, d_ff=2 * dim, num_layers=layers,
                 num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                 feed_forward_proj='gated-gelu', is_encoder_decoder=False, use_cache=False,
                 pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
  return T5EncoderModel(cfg).float().eval()


def redraw_(modules, seed):
  """Redraws every parameter of the torch `modules` in place from one generator seeded `seed`: matrices
  N(0, 1/fan_in), norm weights 1 + 0.1 N(0, 1), other vectors 0.1 N(0, 1). transformers' init is tiny-std for
  some weights (T5's); O(1) weights let any mismatch show."""
  torch = torch_module()
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for m in modules:
      for name, p in m.named_parameters():
        if p.ndim > 1:
          p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
        elif 'norm' in name and name.endswith('weight') or name.endswith('layer_norm.weight'):
          p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        else:
          p.copy_(0.1 * torch.randn(p.shape, generator=g))
