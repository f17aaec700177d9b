"""FLUX.1 text conditioning: CLIP-L pooled + T5-XXL states, as diffusers 0.39's `FluxPipeline.encode_prompt`.

`FluxTextEncoders.encode` returns `prompt_embeds` and `pooled_prompt_embeds` of that pipeline
(num_images_per_prompt=1), as float32 numpy:
* CLIP-L (`text_encoder`, a plain `CLIPTextModel`: no projection) reads its ids padded to 77 (truncation
  on, no attention mask); the pooled vector is its `pooler_output` (the final layer norm's output at the
  EOS token): (B, 768). FLUX uses no CLIP token states.
* T5-XXL (`text_encoder_2`, `T5EncoderModel`) reads its ids padded to `max_sequence_length` (512 for
  [dev], 256 for [schnell]; FlowGRPO trains with 128), EOS appended, no attention mask (pad tokens are
  attended to, as in diffusers); its last hidden state is the text sequence (B, L, 4096).
The text position ids are zeros (the transformer's `text_ids`), so nothing else is returned. FLUX.1-dev is
guidance-distilled: there is no negative prompt (guidance is a model input).

The pieces shared with other families (the torch import, one encoder's subfolders, the CLIP and T5
encodings, offline tokenizers and tiny models) are `models.hf_text`'s; the encoders are transformers'
PyTorch classes for the reasons `models.sd3.text` gives (the reference's own classes, sharded T5
safetensors, run once per prompt outside the jitted step). `tiny_random` builds the same classes at toy
sizes with tokenizers made in-process; `save_pretrained` writes a diffusers-shaped pipeline folder, so
tests go through `from_pretrained`.
"""
import json
import os

import numpy as np

from ddrl_jax.models import hf_text

MAX_SEQUENCE_LENGTH = 512       # FluxPipeline's default max_sequence_length ([dev])
CLIP_PARTS = ('text_encoder', 'tokenizer')
T5_PARTS = ('text_encoder_2', 'tokenizer_2')


class FluxTextEncoders:
  """CLIP-L (pooled) and T5 (states) with their tokenizers, transformers' torch classes in eval mode."""

  def __init__(self, tokenizer, text_encoder, tokenizer_2, text_encoder_2, *, device='cpu'):
    self.tokenizer, self.text_encoder = tokenizer, text_encoder
    self.tokenizer_2, self.text_encoder_2 = tokenizer_2, text_encoder_2
    self.device = device
    for enc in (text_encoder, text_encoder_2):
      enc.to(device)
      enc.eval()

  @property
  def pooled_dim(self):
    return self.text_encoder.config.hidden_size

  @property
  def text_dim(self):
    return self.text_encoder_2.config.d_model

  @classmethod
  def from_pretrained(cls, path, *, dtype='float32', device='cpu'):
    """The text parts of a diffusers FLUX.1 pipeline folder, offline: text_encoder/ + tokenizer/ (CLIP-L),
    text_encoder_2/ + tokenizer_2/ (T5, possibly sharded safetensors). dtype: the weights' (outputs are
    float32)."""
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
    path = hf_text.pipeline_folder(path, 'FLUX pipeline folder')
    missing = hf_text.missing_subfolders(path, list(CLIP_PARTS + T5_PARTS))
    if missing:
      raise FileNotFoundError(f'FLUX pipeline folder {path!r} lacks the subfolder(s) {", ".join(missing)}: '
                              'expected text_encoder/, tokenizer/ (CLIP-L), text_encoder_2/, tokenizer_2/ (T5)')
    tok, enc = hf_text.load_part(path, CLIP_PARTS, CLIPTextModel, CLIPTokenizer, dtype=dtype)
    tok2, enc2 = hf_text.load_part(path, T5_PARTS, T5EncoderModel, T5TokenizerFast, dtype=dtype)
    return cls(tok, enc, tok2, enc2, device=device)

  def save_pretrained(self, path, *, max_shard_size='5GB'):
    """The parts as a diffusers FLUX pipeline folder (text subfolders and a model_index.json; T5 sharded at
    max_shard_size)."""
    os.makedirs(path, exist_ok=True)
    index = {'_class_name': 'FluxPipeline', 'transformer': [None, None], 'vae': [None, None],
             'scheduler': [None, None]}
    index.update(hf_text.save_part(path, CLIP_PARTS, self.text_encoder, self.tokenizer))
    index.update(hf_text.save_part(path, T5_PARTS, self.text_encoder_2, self.tokenizer_2,
                                   max_shard_size=max_shard_size))
    with open(os.path.join(path, 'model_index.json'), 'w') as f:
      json.dump(index, f, indent=2, sort_keys=True)

  def encode(self, prompts, max_sequence_length=MAX_SEQUENCE_LENGTH, *, prompts_2=None, batch_size=16):
    """Prompts -> (T5 states (B, max_sequence_length, text_dim), CLIP pooled (B, pooled_dim)), float32
    numpy. prompts_2: other texts for T5 (diffusers' prompt_2; default: prompts). In chunks of batch_size."""
    torch = hf_text.torch_module()
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    prompts_2 = list(prompts_2 or prompts)
    if len(prompts_2) != len(prompts):
      raise ValueError(f'prompts_2 must have as many texts as prompts ({len(prompts)})')
    states, pooled = [], []
    with torch.inference_mode():
      for i in range(0, len(prompts), batch_size):
        _, p = hf_text.encode_clip(self.tokenizer, self.text_encoder, prompts[i:i + batch_size],
                                   device=self.device)
        s = hf_text.encode_t5(self.tokenizer_2, self.text_encoder_2, prompts_2[i:i + batch_size],
                              max_length=max_sequence_length, device=self.device)
        states.append(s.cpu().numpy().astype(np.float32))
        pooled.append(p.cpu().numpy().astype(np.float32))
    if not states:
      return (np.zeros((0, max_sequence_length, self.text_dim), np.float32),
              np.zeros((0, self.pooled_dim), np.float32))
    return np.concatenate(states), np.concatenate(pooled)


TINY_CLIP_DIM, TINY_T5_DIM = 20, 24      # the tiny transformer's pooled_projection_dim, joint_attention_dim


def tiny_random(seed=0, *, clip_dim=TINY_CLIP_DIM, t5_dim=TINY_T5_DIM, layers=2):
  """A tiny CLIP-L-like CLIPTextModel (quick_gelu, legacy argmax EOS pooling, no projection) and a tiny
  T5 v1.1-like encoder with random weights and offline tokenizers: FLUX's classes at toy widths."""
  import tempfile  # pylint: disable=g-import-not-at-top
  torch = hf_text.torch_module()
  torch.manual_seed(seed)
  with tempfile.TemporaryDirectory() as tmp:
    tok = hf_text.clip_tokenizer(os.path.join(tmp, 'clip_vocab'), pad_token='<|endoftext|>')
  enc = hf_text.tiny_clip(tok, clip_dim, act='quick_gelu', eos_token_id=2, layers=layers, projection=False)
  tok2 = hf_text.t5_tokenizer()
  enc2 = hf_text.tiny_t5(tok2, t5_dim, layers=layers)
  hf_text.redraw_([enc, enc2], seed + 1)
  return FluxTextEncoders(tok, enc, tok2, enc2)
