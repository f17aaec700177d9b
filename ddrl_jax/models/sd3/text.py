"""Stable Diffusion 3.5 text conditioning: CLIP-L + OpenCLIP-G + T5-XXL, as diffusers 0.39 encodes prompts.

`SD3TextEncoders.encode` returns what `StableDiffusion3Pipeline.encode_prompt` (clip_skip=None,
num_images_per_prompt=1) returns as `prompt_embeds` and `pooled_prompt_embeds`, as float32 numpy:

* each CLIP (`text_encoder` = CLIP-L, 768-d; `text_encoder_2` = OpenCLIP-G, 1280-d; both
  `CLIPTextModelWithProjection`) reads its tokenizer's ids padded to 77 ('max_length', truncation on,
  no attention mask: CLIP's causal mask only); the per-token features are the penultimate hidden state
  (`hidden_states[-2]`, before the final layer norm), the pooled vector the projected EOS output
  (`text_embeds`);
* the two CLIP sequences are concatenated on the feature axis (768 + 1280 = 2048) and zero-padded to the
  T5 width (4096);
* T5 (`text_encoder_3`, `T5EncoderModel`) reads its ids padded to `max_sequence_length` (default 256,
  truncation on, EOS appended, no attention mask: pad tokens are attended to, as in diffusers); its last
  hidden state follows the CLIP tokens on the sequence axis: joint (B, 77 + max_sequence_length, 4096);
* pooled = concat(pooled CLIP-L, pooled CLIP-G): (B, 2048).
Without T5 (diffusers allows `text_encoder_3=None`) its part is zeros of width `joint_dim` (diffusers
takes it from the transformer's `joint_attention_dim`). The classifier-free-guidance embedding is the same
encoding of the empty prompt "" (diffusers' default negative prompt): `encode_null`.

Why transformers' PyTorch classes and not a JAX port: they are the classes the diffusers pipeline itself
runs, so the embeddings are bit-identical to the reference; they read the sharded safetensors that T5-XXL
ships as (`text_encoder_3/model-0000{1,2}-of-00002.safetensors`) natively, whereas the Flax T5 classes
refuse sharded safetensors; there is no Flax-vs-torch parity risk on a 4.7 B-parameter T5; and the text
encoders run once per prompt at data-preparation time (RL prompt sets are fixed), never inside the
jitted training step, so nothing is gained by having them in JAX.

The pieces that are not SD3's own (the torch import, loading and saving one encoder's subfolders, the CLIP
and T5 encodings, the offline tokenizers and tiny models) are `models.hf_text`'s, shared with the other
families. `tiny_random` builds the same three model classes at toy sizes with random weights and tokenizers
constructed in-process (no download), and `SD3TextEncoders.save_pretrained` writes them as a diffusers
pipeline folder (T5 sharded), so tests go through the real `from_pretrained` path.
"""
import json
import os

import numpy as np

from ddrl_jax.models import hf_text

T5_MAX_SEQUENCE_LENGTH = 256  # diffusers' default max_sequence_length for SD3
SD3_JOINT_DIM = 4096          # SD3 transformer joint_attention_dim (= T5-XXL d_model)

# (component attribute, subfolder) pairs of a diffusers SD3 pipeline folder
CLIP_L_PARTS = ('text_encoder', 'tokenizer')
CLIP_G_PARTS = ('text_encoder_2', 'tokenizer_2')
T5_PARTS = ('text_encoder_3', 'tokenizer_3')


class SD3TextEncoders:
  """The three SD3 text encoders with their tokenizers (transformers' torch classes, eval mode, CPU by default).

  Attributes: tokenizer/text_encoder (CLIP-L), tokenizer_2/text_encoder_2 (CLIP-G),
  tokenizer_3/text_encoder_3 (T5; both None when T5 is left out), joint_dim (the width of the joint
  sequence: T5's d_model, or the transformer's joint_attention_dim without T5).
  """

  def __init__(self, tokenizer, text_encoder, tokenizer_2, text_encoder_2, tokenizer_3=None, text_encoder_3=None,
               *, joint_dim=None, device='cpu'):
    if (tokenizer_3 is None) != (text_encoder_3 is None):
      raise ValueError('tokenizer_3 and text_encoder_3 must both be given or both be None')
    self.tokenizer, self.text_encoder = tokenizer, text_encoder
    self.tokenizer_2, self.text_encoder_2 = tokenizer_2, text_encoder_2
    self.tokenizer_3, self.text_encoder_3 = tokenizer_3, text_encoder_3
    if text_encoder_3 is not None:
      d_model = text_encoder_3.config.d_model
      if joint_dim is not None and joint_dim != d_model:
        raise ValueError(f'joint_dim={joint_dim} differs from the T5 width d_model={d_model}')
      joint_dim = d_model
    elif joint_dim is None:
      joint_dim = SD3_JOINT_DIM
    clip_width = text_encoder.config.hidden_size + text_encoder_2.config.hidden_size
    if joint_dim < clip_width:
      raise ValueError(f'joint_dim={joint_dim} is narrower than the two CLIP widths together ({clip_width})')
    self.joint_dim = joint_dim
    self.device = device
    for enc in self.encoders():
      enc.to(device)
      enc.eval()

  def encoders(self):
    return [e for e in (self.text_encoder, self.text_encoder_2, self.text_encoder_3) if e is not None]

  @property
  def clip_max_length(self):
    """diffusers' `tokenizer_max_length`: CLIP-L's tokenizer model_max_length (77)."""
    return self.tokenizer.model_max_length

  @property
  def pooled_dim(self):
    return self.text_encoder.config.projection_dim + self.text_encoder_2.config.projection_dim

  # ------------------------------------------------------------------ loading / saving

  @classmethod
  def from_pretrained(cls, path, *, dtype='float32', load_t5=True, joint_dim=None, device='cpu'):
    """Read the text parts of a diffusers SD3 pipeline folder, offline (`local_files_only=True`).

    Subfolders: text_encoder/, tokenizer/ (CLIP-L), text_encoder_2/, tokenizer_2/ (CLIP-G), and with
    load_t5 text_encoder_3/, tokenizer_3/ (T5, possibly sharded safetensors). Without T5 the joint width
    is joint_dim, else transformer/config.json's joint_attention_dim when present, else 4096.
    dtype: the encoders' weight dtype (torch dtype or its name); outputs are float32 either way.
    """
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
    path = hf_text.pipeline_folder(path, 'SD3 pipeline folder')
    needed = list(CLIP_L_PARTS + CLIP_G_PARTS) + (list(T5_PARTS) if load_t5 else [])
    missing = hf_text.missing_subfolders(path, needed)
    if missing:
      hint = ' (or pass load_t5=False to run without T5)' if set(missing) & set(T5_PARTS) else ''
      raise FileNotFoundError(
          f'SD3 pipeline folder {path!r} lacks the subfolder(s) {", ".join(missing)}: expected text_encoder/, '
          f'tokenizer/ (CLIP-L), text_encoder_2/, tokenizer_2/ (CLIP-G), text_encoder_3/, tokenizer_3/ (T5){hint}')
    tok, enc = hf_text.load_part(path, CLIP_L_PARTS, CLIPTextModelWithProjection, CLIPTokenizer, dtype=dtype)
    tok2, enc2 = hf_text.load_part(path, CLIP_G_PARTS, CLIPTextModelWithProjection, CLIPTokenizer, dtype=dtype)
    tok3 = enc3 = None
    if load_t5:
      tok3, enc3 = hf_text.load_part(path, T5_PARTS, T5EncoderModel, T5TokenizerFast, dtype=dtype)
    elif joint_dim is None:
      cfg = os.path.join(path, 'transformer', 'config.json')
      if os.path.isfile(cfg):
        with open(cfg) as f:
          joint_dim = json.load(f).get('joint_attention_dim')
    return cls(tok, enc, tok2, enc2, tok3, enc3, joint_dim=joint_dim, device=device)

  def save_pretrained(self, path, *, max_shard_size='5GB'):
    """Write the parts as a diffusers SD3 pipeline folder (the text subfolders and a model_index.json).

    max_shard_size applies to T5 (text_encoder_3/), as transformers' save_pretrained shards it.
    """
    os.makedirs(path, exist_ok=True)
    parts = [(CLIP_L_PARTS, self.text_encoder, self.tokenizer), (CLIP_G_PARTS, self.text_encoder_2, self.tokenizer_2)]
    if self.text_encoder_3 is not None:
      parts.append((T5_PARTS, self.text_encoder_3, self.tokenizer_3))
    index = {'_class_name': 'StableDiffusion3Pipeline', 'transformer': [None, None], 'vae': [None, None],
             'scheduler': [None, None]}
    for sub, enc, tok in parts:
      index.update(hf_text.save_part(path, sub, enc, tok, max_shard_size=max_shard_size if sub == T5_PARTS else None))
    for enc_sub, tok_sub in [T5_PARTS] if self.text_encoder_3 is None else []:
      index[enc_sub] = index[tok_sub] = [None, None]
    with open(os.path.join(path, 'model_index.json'), 'w') as f:
      json.dump(index, f, indent=2, sort_keys=True)

  # ------------------------------------------------------------------ encoding

  def _clip(self, tokenizer, encoder, prompts, clip_skip):
    return hf_text.encode_clip(tokenizer, encoder, prompts, max_length=self.clip_max_length, clip_skip=clip_skip,
                               device=self.device)

  def _t5(self, prompts, max_sequence_length):
    if self.text_encoder_3 is None:
      torch = hf_text.torch_module()
      return torch.zeros((len(prompts), max_sequence_length, self.joint_dim), dtype=torch.float32)
    return hf_text.encode_t5(self.tokenizer_3, self.text_encoder_3, prompts, max_length=max_sequence_length,
                             device=self.device)

  def _encode_chunk(self, prompts, prompts_2, prompts_3, max_sequence_length, clip_skip):
    torch = hf_text.torch_module()
    h1, p1 = self._clip(self.tokenizer, self.text_encoder, prompts, clip_skip)
    h2, p2 = self._clip(self.tokenizer_2, self.text_encoder_2, prompts_2, clip_skip)
    clip_seq = torch.cat([h1, h2], dim=-1)
    t5_seq = self._t5(prompts_3, max_sequence_length)
    clip_seq = torch.nn.functional.pad(clip_seq, (0, t5_seq.shape[-1] - clip_seq.shape[-1]))
    joint = torch.cat([clip_seq, t5_seq], dim=-2)
    pooled = torch.cat([p1, p2], dim=-1)
    return joint.cpu().numpy().astype(np.float32), pooled.cpu().numpy().astype(np.float32)

  def encode(self, prompts, max_sequence_length=T5_MAX_SEQUENCE_LENGTH, *, prompts_2=None, prompts_3=None,
             clip_skip=None, batch_size=16):
    """Prompts -> (joint (B, 77 + max_sequence_length, joint_dim), pooled (B, pooled_dim)), float32 numpy.

    prompts_2 / prompts_3: other texts for CLIP-G / T5 (diffusers' prompt_2 / prompt_3); default: prompts.
    clip_skip: as diffusers (None: the penultimate CLIP layer). Runs in chunks of batch_size prompts.
    """
    torch = hf_text.torch_module()
    if isinstance(prompts, str):
      prompts = [prompts]
    prompts = list(prompts)
    n = len(prompts)
    prompts_2 = list(prompts_2 or prompts)
    prompts_3 = list(prompts_3 or prompts)
    if len(prompts_2) != n or len(prompts_3) != n:
      raise ValueError(f'prompts_2/prompts_3 must have as many texts as prompts ({n})')
    joints, pooleds = [], []
    with torch.inference_mode():
      for i in range(0, n, batch_size):
        j, p = self._encode_chunk(prompts[i:i + batch_size], prompts_2[i:i + batch_size],
                                  prompts_3[i:i + batch_size], max_sequence_length, clip_skip)
        joints.append(j)
        pooleds.append(p)
    if not joints:
      return (np.zeros((0, self.clip_max_length + max_sequence_length, self.joint_dim), np.float32),
              np.zeros((0, self.pooled_dim), np.float32))
    return np.concatenate(joints), np.concatenate(pooleds)

  def encode_null(self, max_sequence_length=T5_MAX_SEQUENCE_LENGTH, batch_size=1):
    """The classifier-free-guidance embedding: the empty prompt "" encoded as `encode` does (diffusers'
    default negative prompt, clip_skip None), repeated batch_size times: (batch_size, 77 + L, D), (batch_size, P)."""
    joint, pooled = self.encode([''], max_sequence_length)
    return np.repeat(joint, batch_size, axis=0), np.repeat(pooled, batch_size, axis=0)


# ---------------------------------------------------------------------- tiny random encoders (tests)

TINY_CLIP_L_DIM, TINY_CLIP_G_DIM, TINY_T5_DIM = 16, 24, 48
TINY_JOINT_DIM = TINY_T5_DIM                        # the joint sequence's width (T5's; CLIPs zero-padded)
TINY_POOLED_DIM = TINY_CLIP_L_DIM + TINY_CLIP_G_DIM   # the pooled vector's width


def tiny_random(seed=0, *, clip_l_dim=TINY_CLIP_L_DIM, clip_g_dim=TINY_CLIP_G_DIM, t5_dim=TINY_T5_DIM, clip_layers=2, t5_layers=2, with_t5=True,
                tmpdir=None):
  """Tiny CLIP-L-like, CLIP-G-like and T5 encoders with random weights and offline tokenizers.

  Same classes as SD3 (CLIPTextModelWithProjection x2, T5EncoderModel; CLIPTokenizer x2, T5TokenizerFast),
  shapes shrunk: CLIP-L-like width clip_l_dim (quick_gelu, legacy eos_token_id=2 argmax pooling, pads with
  <|endoftext|>), CLIP-G-like width clip_g_dim (gelu, pooling at the first EOS id, pads with '!' as SD3's
  tokenizer_2), both with projection_dim = width as in SD3; T5 v1.1-like (gated-gelu, no biases)
  with d_model t5_dim >= clip_l_dim + clip_g_dim (SD3: 4096 >= 768 + 1280).
  tmpdir: where the CLIP vocab/merges files are written (a temporary folder when None).
  """
  import tempfile

  torch = hf_text.torch_module()
  if t5_dim < clip_l_dim + clip_g_dim:
    raise ValueError(f't5_dim={t5_dim} must be >= clip_l_dim + clip_g_dim = {clip_l_dim + clip_g_dim}')
  torch.manual_seed(seed)
  with tempfile.TemporaryDirectory() as tmp:
    base = tmpdir or tmp
    tok = hf_text.clip_tokenizer(os.path.join(base, 'clip_l_vocab'), pad_token='<|endoftext|>')
    tok2 = hf_text.clip_tokenizer(os.path.join(base, 'clip_g_vocab'), pad_token='!')
  enc = hf_text.tiny_clip(tok, clip_l_dim, act='quick_gelu', eos_token_id=2, layers=clip_layers)
  enc2 = hf_text.tiny_clip(tok2, clip_g_dim, act='gelu', eos_token_id=tok2.eos_token_id, layers=clip_layers)
  tok3 = enc3 = None
  if with_t5:
    tok3 = hf_text.t5_tokenizer()
    enc3 = hf_text.tiny_t5(tok3, t5_dim, layers=t5_layers)
  hf_text.redraw_([e for e in (enc, enc2, enc3) if e is not None], seed + 1)
  return SD3TextEncoders(tok, enc, tok2, enc2, tok3, enc3, joint_dim=None if with_t5 else t5_dim)
