"""Cosmos-Predict2.5's text conditioning: the Cosmos-Reason1-7B (Qwen2.5-VL-7B) language model in Flax NNX.

Cosmos-Predict2.5 conditions its DiT on "reason embeddings" (nvidia-cosmos/cosmos-predict2.5,
`cosmos_predict2/_src/predict2/text_encoders/text_encoder.py`, `compute_text_embeddings_online` with the
full_concat strategy; diffusers `pipelines/cosmos/pipeline_cosmos2_5_predict.py`, `_get_prompt_embeds`):

1. the prompt becomes a chat: a system turn (SYSTEM_PROMPT) and a user turn holding the prompt, rendered by
   the tokenizer's chat template without a generation prompt;
2. the ids are cut to, or right-padded with the tokenizer's pad id to, exactly MAX_LENGTH = 512 tokens;
3. the decoder runs on them with its causal mask only (no padding mask) at text-only positions 0..L-1, so
   the padding rows attend to the prompt and carry information about it: all 512 rows are kept;
4. transformers' `hidden_states[1:]` are taken: the outputs of layers 1..n-1 and the final-norm output of
   layer n (the pre-norm output of layer n is not among them);
5. `text.reason_full_concat` normalises each per token ((h - mean) / (unbiased std + 1e-8)) and
   concatenates them: (B, 512, 28 * 3584 = 100352).

Qwen2.5-VL's multimodal RoPE gives a text-only sequence the same position on its temporal, height and
width sections, which is the plain 1-D RoPE implemented here (the tests compare against
`Qwen2_5_VLForConditionalGeneration` itself). Only the language model is built: the vision tower and
lm_head of the checkpoint are skipped when loading.

Precision: matmuls run in `config.dtype` on `config.param_dtype` weights; RMSNorm, RoPE, the attention
softmax and the residual stream stay in float32, so the hidden states come out float32. With bf16 weights
the reference keeps a bf16 residual, so a bf16 run here is closer to the float32 model than the reference's.

Layers are stacked on a leading 'layers' axis (`nnx.vmap`) and run under `nnx.scan` (optionally
`nnx.remat`), as the DiTs are; parameters carry logical axis names (LOGICAL_RULES adds 'vocab').

On the training devices (`Reason1TextEncoder(..., plan=plan)`, `from_pretrained(..., plan=plan)`) the
parameters are FSDP-sharded by those names under the run's ShardingPlan (`param_shardings`, `place_params`)
and the forward is jitted with in/out shardings (`sharded_forward`); `ddrl_jax.aot` compiles the same
forward for a TPU slice (its 'text_encoder' row).
"""
import dataclasses
import functools
import glob
import json
import logging
import math
import os
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddrl_jax.models import checked_state
from ddrl_jax.models import layers
from ddrl_jax.models.layers import RMSNorm
from ddrl_jax.models.text import reason_full_concat
from ddrl_jax.parallel import plan as plan_lib
from ddrl_jax.parallel import rules as rules_lib
from ddrl_jax.parallel.plan import constrain

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = 'You are a helpful assistant who will provide prompts to an image generator.'
MAX_LENGTH = 512                # cosmos' NUM_EMBEDDING_PADDING_TOKENS, diffusers' max_sequence_length
TEXT_ENCODER, TOKENIZER = 'text_encoder', 'tokenizer'   # subfolders of a diffusers Cosmos-Predict2.5 folder

LOGICAL_RULES = {'vocab': ''}   # the embedding table's rows; its width is 'embed' (fsdp)
RESIDUAL_NAMES = ('act_batch', 'act_text', 'act_embed')   # (B, L, D)
ATTENTION_IMPLS = ('einsum', 'xla', 'cudnn')
_KERNEL_SCOPE = 'attention_kernel.'   # models.attention's scope prefix (program_kernels reads it)
SHORT_ATTENTION_LEN = 4096            # models.attention.AttentionConfig.min_flash_len's default


@dataclasses.dataclass(frozen=True)
class Qwen25TextConfig:
  """The Qwen2.5 decoder; defaults: the language model of Qwen2.5-VL-7B / Cosmos-Reason1-7B.

  attention_impl: 'einsum' (grouped-query einsums, float32 softmax, any platform) or jax.nn's
    dot_product_attention with implementation 'xla' or 'cudnn' (GPU, bf16/fp16 only).
  remat_policy: one of layers.REMAT_POLICIES; 'none' suits inference (no backward pass).
  """
  vocab_size: int = 152064
  hidden_size: int = 3584
  num_layers: int = 28
  num_heads: int = 28
  num_kv_heads: int = 4
  intermediate_size: int = 18944
  rope_theta: float = 1e6
  rms_norm_eps: float = 1e-6
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat_policy: str = 'none'
  attention_impl: str = 'einsum'

  @property
  def head_dim(self):
    return self.hidden_size // self.num_heads

  @property
  def embedding_dim(self):
    """Width of the full_concat embedding: num_layers * hidden_size (100352 for Reason1-7B)."""
    return self.num_layers * self.hidden_size

  def validate(self):
    if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads or self.head_dim % 2:
      raise ValueError(f'hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads='
                       f'{self.num_kv_heads}: need heads | hidden, kv_heads | heads and an even head dim')
    layers.check_remat_policy(self.remat_policy)
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f'attention_impl={self.attention_impl!r} not in {ATTENTION_IMPLS}')
    return self


def reason1_7b(**overrides):
  """Cosmos-Reason1-7B's language model (Qwen2.5-VL-7B): 28 layers, hidden 3584, 28 heads, 4 KV heads."""
  return Qwen25TextConfig(**overrides).validate()


def _text_fields(hf):
  """The language-model part of a Qwen2.5-VL config.json: its text_config, or the top level (older files)."""
  text = hf.get('text_config')
  return text if isinstance(text, dict) and 'hidden_size' in text else hf


def config_from_hf(hf, source='config.json', **overrides):
  """Qwen25TextConfig from a transformers config dict (Qwen2.5-VL, its text config, or Qwen2).

  source names the file in errors. Raises ValueError for what this module does not implement (another
  activation, rope scaling other than default/mrope, sliding-window attention).
  """
  text = _text_fields(hf)
  rope = text.get('rope_parameters') or text.get('rope_scaling') or {}   # transformers 5.x: rope_parameters
  model_type = hf.get('model_type')
  if model_type not in ('qwen2_5_vl', 'qwen2_5_vl_text', 'qwen2'):
    raise ValueError(f'{source}: model_type {model_type!r} is not a Qwen2.5(-VL) language model')
  try:
    kw = dict(vocab_size=text['vocab_size'], hidden_size=text['hidden_size'],
              num_layers=text['num_hidden_layers'], num_heads=text['num_attention_heads'],
              num_kv_heads=text.get('num_key_value_heads', text['num_attention_heads']),
              intermediate_size=text['intermediate_size'],
              rope_theta=float(text.get('rope_theta', rope.get('rope_theta', 1e6))),   # transformers' default
              rms_norm_eps=float(text.get('rms_norm_eps', 1e-6)))
  except KeyError as e:
    raise ValueError(f'{source}: no {e.args[0]!r} (looked in text_config and at the top level)') from None
  if text.get('hidden_act', 'silu') != 'silu':
    raise ValueError(f'{source}: hidden_act {text["hidden_act"]!r}; only silu is implemented')
  kinds = {rope.get('rope_type'), rope.get('type')} - {None}
  if kinds - {'default', 'mrope'}:
    raise ValueError(f'{source}: rope_scaling {rope}; only default (m)RoPE is implemented')
  if text.get('use_sliding_window'):
    raise ValueError(f'{source}: use_sliding_window is set; sliding-window attention is not implemented')
  kw.update(overrides)
  return Qwen25TextConfig(**kw).validate()


# ----------------------------------------------------------------------------------------------- pure fns


def rope_cos_sin(length, head_dim, theta):
  """(cos, sin), each (length, head_dim) float32, positions 0..length-1, angles [p f, p f] (rotate-half).

  f_j = theta^(-2j / head_dim), computed in float32 as transformers' default RoPE does.
  """
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def attention_label(impl, length):
  """The kernel label of `causal_attention` in a lowered program (models.attention.program_kernels):
  'cudnn' for impl 'cudnn'; for 'einsum' and 'xla' (XLA attention that holds the (L, L) logits) 'xla_short'
  below attention.AttentionConfig's min_flash_len (4096; the 512 prompt tokens) and 'xla' from it on."""
  if impl == 'cudnn':
    return 'cudnn'
  return 'xla_short' if length < SHORT_ATTENTION_LEN else 'xla'


def attention_kernel(impl):
  """The long-sequence kernel `ddrl_jax.aot` expects of the encoder (check_program): 'cudnn' or 'xla'."""
  return 'cudnn' if impl == 'cudnn' else 'xla'


def causal_attention(q, k, v, impl='einsum'):
  """Causal grouped-query attention: q (B, L, N, Hd), k/v (B, L, K, Hd), K | N -> (B, L, N, Hd).

  Query head h reads KV head h // (N / K), as transformers' repeat_kv. 'einsum' keeps the logits and
  softmax in float32; 'xla' / 'cudnn' are jax.nn.dot_product_attention's implementations. Runs under the
  named scope `attention_kernel.<attention_label>`, as models.attention's kernels do, so that a lowered
  program names it.
  """
  with jax.named_scope(_KERNEL_SCOPE + attention_label(impl, q.shape[1])):
    return _causal_attention(q, k, v, impl)


def _causal_attention(q, k, v, impl):
  if impl != 'einsum':
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  b, l, n, hd = q.shape
  kv = k.shape[2]
  qg = q.reshape(b, l, kv, n // kv, hd)
  logits = jnp.einsum('bqkgd,bskd->bkgqs', qg, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
  causal = jnp.tril(jnp.ones((l, l), bool))
  probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
  out = jnp.einsum('bkgqs,bskd->bqkgd', probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(b, l, n, hd).astype(q.dtype)


# ----------------------------------------------------------------------------------------------- modules


class Attention(nnx.Module):
  """Qwen2 self-attention: q/k/v projections with biases, o without, RoPE on q and k, causal GQA."""

  def __init__(self, cfg, rngs):
    d, hd = cfg.hidden_size, cfg.head_dim
    self.cfg = cfg
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    self.q_proj = layers.dense(d, cfg.num_heads * hd, ('embed', 'heads'), rngs, bias=True, **kw)
    self.k_proj = layers.dense(d, cfg.num_kv_heads * hd, ('embed', 'heads'), rngs, bias=True, **kw)
    self.v_proj = layers.dense(d, cfg.num_kv_heads * hd, ('embed', 'heads'), rngs, bias=True, **kw)
    self.o_proj = layers.dense(cfg.num_heads * hd, d, ('heads', 'embed'), rngs, **kw)

  def __call__(self, x, cos, sin):
    """x (B, L, D), cos/sin (L, Hd) -> (B, L, D)."""
    b, l, _ = x.shape
    cfg = self.cfg
    hd = cfg.head_dim
    q = layers.apply_rope(self.q_proj(x).reshape(b, l, cfg.num_heads, hd), cos, sin)
    k = layers.apply_rope(self.k_proj(x).reshape(b, l, cfg.num_kv_heads, hd), cos, sin)
    v = self.v_proj(x).reshape(b, l, cfg.num_kv_heads, hd)
    out = causal_attention(q, k, v, cfg.attention_impl)
    return self.o_proj(out.reshape(b, l, cfg.num_heads * hd))


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

  def __init__(self, cfg, rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    self.gate_proj = layers.dense(d, f, ('embed', 'mlp'), rngs, **kw)
    self.up_proj = layers.dense(d, f, ('embed', 'mlp'), rngs, **kw)
    self.down_proj = layers.dense(f, d, ('mlp', 'embed'), rngs, **kw)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); x the float32 residual (B, L, D)."""

  def __init__(self, cfg, rngs):
    self.cfg = cfg
    d, eps, pdt = cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype
    self.input_layernorm = RMSNorm(d, 'embed', eps, pdt)
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = RMSNorm(d, 'embed', eps, pdt)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, cos, sin):
    dtype = self.cfg.dtype
    x = x + self.self_attn(self.input_layernorm(x).astype(dtype), cos, sin).astype(jnp.float32)
    return x + self.mlp(self.post_attention_layernorm(x).astype(dtype)).astype(jnp.float32)


class Qwen25TextModel(nnx.Module):
  """The Qwen2.5 decoder without lm_head. Parameter names follow transformers' (`embed_tokens`, `layers`,
  `self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, `norm`, ...)."""

  def __init__(self, config, *, rngs):
    cfg = self.config = config.validate()
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), ('vocab', 'embed'), eager_sharding=False)
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=jnp.float32,
                                  param_dtype=cfg.param_dtype, embedding_init=init, rngs=rngs)
    self.layers = layers.stacked(lambda r: DecoderLayer(cfg, r), cfg.num_layers, rngs)
    self.norm = RMSNorm(cfg.hidden_size, 'embed', cfg.rms_norm_eps, cfg.param_dtype)

  def __call__(self, input_ids):
    """input_ids (B, L) int -> (B, num_layers, L, D) float32: transformers' `hidden_states[1:]`.

    Entry i < num_layers - 1 is the output of layer i + 1; the last is the final norm of the last layer.
    """
    cfg = self.config
    cos, sin = rope_cos_sin(input_ids.shape[1], cfg.head_dim, cfg.rope_theta)
    x = constrain(self.embed_tokens(input_ids).astype(jnp.float32), RESIDUAL_NAMES)

    def body(layer, carry):
      out = constrain(layer(carry, cos, sin), RESIDUAL_NAMES)
      return out, out

    last, outputs = layers.scan_blocks(body, self.layers, x, cfg.remat_policy,
                                       out_axes=(nnx.Carry, 0))   # outputs (num_layers, B, L, D)
    states = jnp.concatenate([outputs[:-1], self.norm(last)[None]], axis=0)
    return jnp.transpose(states, (1, 0, 2, 3))


def forward_flops(cfg, tokens=MAX_LENGTH):
  """Analytic FLOPs (2 x multiply-accumulates) of one forward of one prompt of `tokens` tokens: {part: FLOPs}.

  linear: every projection (2 x kernel parameters x tokens; the embedding is a lookup); attention: q k^T
  and p v over all token pairs (a causal kernel can skip half of it).
  """
  d, nq, nkv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  kernels = d * nq + 2 * d * nkv + nq * d + 3 * d * cfg.intermediate_size
  return dict(linear=2 * kernels * tokens * cfg.num_layers,
              attention=2 * 2 * tokens * tokens * nq * cfg.num_layers)


# ------------------------------------------------------------------------------------------ tokenization


def chat_messages(prompt):
  """The two-turn chat that cosmos and diffusers build for one prompt (content as a list of text parts)."""
  return [{'role': 'system', 'content': [{'type': 'text', 'text': SYSTEM_PROMPT}]},
          {'role': 'user', 'content': [{'type': 'text', 'text': prompt}]}]


def chat_token_ids(tokenizer, prompt):
  """The prompt's chat rendered by the tokenizer's template (no generation prompt) and tokenized: [int]."""
  out = tokenizer.apply_chat_template(chat_messages(prompt), tokenize=True, add_generation_prompt=False,
                                      add_vision_id=False)
  if not isinstance(out, list):     # a BatchEncoding when a tokenizer returns dicts
    out = out['input_ids']
  return [int(i) for i in out]


def pad_or_truncate(ids, length, pad_id):
  """ids [int] -> (length,) int32: the first `length` ids, or ids followed by pad_id up to `length`."""
  out = np.full((length,), pad_id, np.int32)
  keep = ids[:length]
  out[:len(keep)] = keep
  return out


class Tokenized(NamedTuple):
  """input_ids (B, max_length) int32; num_tokens (B,) the chat's token counts before truncation."""
  input_ids: np.ndarray
  num_tokens: np.ndarray

  @property
  def num_truncated(self):
    return int((self.num_tokens > self.input_ids.shape[1]).sum())


def tokenize(tokenizer, prompts, max_length=MAX_LENGTH):
  """Prompts -> Tokenized: chat ids right-padded with the tokenizer's pad id or cut to max_length."""
  pad_id = tokenizer.pad_token_id
  if pad_id is None:
    raise ValueError(f'{type(tokenizer).__name__} has no pad token; the Qwen2.5-VL tokenizer pads with '
                     '<|endoftext|>')
  chats = [chat_token_ids(tokenizer, p) for p in prompts]
  ids = np.stack([pad_or_truncate(c, max_length, pad_id) for c in chats]) if chats else \
      np.zeros((0, max_length), np.int32)
  return Tokenized(ids, np.asarray([len(c) for c in chats], np.int64))


# ----------------------------------------------------------------------------------------------- loading


# transformers key (after the language-model prefix) -> (NNX path below the model, is a Linear weight)
_GLOBAL_KEYS = {
    'embed_tokens.weight': (('embed_tokens', 'embedding'), False),
    'norm.weight': (('norm', 'scale'), False),
}
_LAYER_KEYS = {
    **{f'self_attn.{p}_proj.{w}': (('self_attn', f'{p}_proj', 'kernel' if w == 'weight' else 'bias'),
                                   w == 'weight') for p in 'qkv' for w in ('weight', 'bias')},
    'self_attn.o_proj.weight': (('self_attn', 'o_proj', 'kernel'), True),
    **{f'mlp.{p}_proj.weight': (('mlp', f'{p}_proj', 'kernel'), True) for p in ('gate', 'up', 'down')},
    'input_layernorm.weight': (('input_layernorm', 'scale'), False),
    'post_attention_layernorm.weight': (('post_attention_layernorm', 'scale'), False),
}
# Language-model prefixes: transformers >= 4.52 in memory / 5.x files, 4.x files (and Qwen's own), a bare
# Qwen2_5_VLModel, a bare Qwen2Model. Longest first.
_PREFIXES = ('model.language_model.', 'model.', 'language_model.', '')
_SKIPPED = re.compile(r'(model\.)?visual\..*|lm_head\..*|.*rotary_emb\.inv_freq')
_LAYER_KEY = re.compile(r'layers\.(\d+)\.(.+)')


def _classify(key):
  """Checkpoint key -> (prefix, NNX path, layer index or None, is linear) or None if not a text weight."""
  for prefix in _PREFIXES:
    if not key.startswith(prefix):
      continue
    rest = key[len(prefix):]
    if rest in _GLOBAL_KEYS:
      path, linear = _GLOBAL_KEYS[rest]
      return prefix, path, None, linear
    m = _LAYER_KEY.fullmatch(rest)
    if m and m.group(2) in _LAYER_KEYS:
      path, linear = _LAYER_KEYS[m.group(2)]
      return prefix, ('layers',) + path, int(m.group(1)), linear
  return None


def _source_name(prefix, path, idx):
  """The checkpoint key of an NNX path in the layout `prefix` (for error messages)."""
  table = _LAYER_KEYS if idx is not None else _GLOBAL_KEYS
  sub = path[1:] if idx is not None else path
  name = next(k for k, (p, _) in table.items() if p == sub)
  return f'{prefix}layers.{idx}.{name}' if idx is not None else f'{prefix}{name}'


def _short(items, limit=4):
  items = list(items)
  more = f', +{len(items) - limit} more' if len(items) > limit else ''
  return f'{len(items)} [{", ".join(items[:limit])}{more}]'


def read_config(folder):
  """config.json of a checkpoint folder as a dict; one-line errors naming the file."""
  path = os.path.join(folder, 'config.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: missing (a Qwen2.5-VL text_encoder folder holds config.json and '
                            f'*.safetensors)')
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f'{path}: not valid JSON ({e})') from None


def weight_files(folder):
  """The safetensors files of a transformers checkpoint folder: the shards its index lists, else
  model.safetensors, else every *.safetensors. One-line FileNotFoundError naming what is missing."""
  index = os.path.join(folder, 'model.safetensors.index.json')
  if os.path.isfile(index):
    with open(index) as f:
      shards = sorted(set(json.load(f)['weight_map'].values()))
    files = [os.path.join(folder, s) for s in shards]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
      raise FileNotFoundError(f'{missing[0]}: shard listed in {index} is missing'
                              + (f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''))
    return files
  single = os.path.join(folder, 'model.safetensors')
  files = [single] if os.path.isfile(single) else sorted(glob.glob(os.path.join(folder, '*.safetensors')))
  if not files:
    raise FileNotFoundError(f'{folder}: no model.safetensors, model.safetensors.index.json or *.safetensors')
  return files


def abstract_params(config):
  """(abstract model, {path tuple: ShapeDtypeStruct} of its Params) without allocating."""
  abstract = nnx.eval_shape(lambda: Qwen25TextModel(config, rngs=nnx.Rngs(0)))
  return abstract, checked_state.param_specs(abstract)


def load_params(folder, config):
  """{NNX path: numpy in config.param_dtype} of the language model in a transformers checkpoint folder.

  Reads every shard lazily (shapes are checked from the headers before a tensor is read), transposes
  Linear weights to (in, out) kernels and fills the layer stacks in place. Vision-tower, lm_head and
  rotary buffers are skipped. Raises one one-line ValueError listing missing, unexpected and mis-shaped
  keys (with the file of each mis-shaped one), or for a checkpoint that mixes two key layouts.
  """
  from safetensors import SafetensorError
  from safetensors import safe_open
  _, expected = abstract_params(config)
  n = config.num_layers
  dtype = np.dtype(config.param_dtype)
  out = {path: np.empty(spec.shape, dtype) for path, spec in expected.items()}
  filled = {path: set() for path in expected}
  unexpected, misshaped, prefixes = [], [], set()
  for file in weight_files(folder):
    try:
      handle = safe_open(file, framework='np')
    except SafetensorError as e:
      raise ValueError(f'{file}: cannot read safetensors ({e})') from None
    with handle as f:
      for key in f.keys():
        if _SKIPPED.fullmatch(key):
          continue
        hit = _classify(key)
        if hit is None or (hit[2] is not None and hit[2] >= n):
          unexpected.append(key)
          continue
        prefix, path, idx, linear = hit
        prefixes.add(prefix)
        shape = tuple(f.get_slice(key).get_shape())
        want = expected[path].shape[1:] if idx is not None else expected[path].shape
        got = shape[::-1] if linear else shape
        if got != tuple(want):
          want_src = tuple(want)[::-1] if linear else tuple(want)
          misshaped.append(f'{key} in {os.path.basename(file)}: {shape}, expected {want_src}')
          continue
        value = f.get_tensor(key)
        value = value.T if linear else value
        if idx is None:
          out[path][...] = value
        else:
          out[path][idx] = value
        filled[path].add(idx)
  if len(prefixes) > 1:
    raise ValueError(f'{folder}: the checkpoint mixes key layouts {sorted(prefixes)}; expected one of '
                     f'{_PREFIXES[:2]}')
  prefix = prefixes.pop() if prefixes else 'model.'
  missing = []
  for path in expected:
    wanted = set(range(n)) if path[0] == 'layers' else {None}
    missing += [_source_name(prefix, path, i) for i in sorted(wanted - filled[path], key=lambda i: i or 0)]
  if missing or unexpected or misshaped:
    parts = [f'{what} {_short(items)}' for what, items in
             (('missing', missing), ('unexpected', unexpected), ('mis-shaped', misshaped)) if items]
    raise ValueError(f'{folder}: checkpoint does not match the Qwen2.5 language model ({n} layers, hidden '
                     f'{config.hidden_size}, vocab {config.vocab_size}): {"; ".join(parts)}')
  return out


def model_from_params(config, params):
  """A Qwen25TextModel holding `params` ({NNX path: array}), without random initialisation."""
  abstract, expected = abstract_params(config)
  if set(params) != set(expected):
    raise ValueError(f'params do not match the model: {_short(map(str, set(params) ^ set(expected)))}')
  graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
  for path, variable in nnx.to_flat_state(state):
    key = tuple(str(p) for p in path)
    variable.set_value(jnp.asarray(params[key], expected[key].dtype))
  return nnx.merge(graphdef, state, rest)


def load_model(folder, plan=None, **config_overrides):
  """(Qwen25TextModel, config) from a transformers checkpoint folder (config.json + safetensors);
  config_overrides (dtype, param_dtype, remat_policy, attention_impl) go to the config. With a
  ShardingPlan `plan`, the weights go from host memory straight onto `param_shardings(config, plan)`
  (`place_params`: no device ever holds a whole weight); without one, onto the default device."""
  folder = os.fspath(folder)
  if not os.path.isdir(folder):
    raise FileNotFoundError(f'{folder}: text encoder folder does not exist')
  config = config_from_hf(read_config(folder), os.path.join(folder, 'config.json'), **config_overrides)
  if plan is None:
    return model_from_params(config, load_params(folder, config)), config
  graphdef, _ = abstract_state(config)
  return nnx.merge(graphdef, place_params(load_params(folder, config), config, plan)), config


# ------------------------------------------------------------------------------------- sharded placement
#
# On the training devices the encoder is placed like the DiT: every weight's model width ('embed') over the
# plan's FSDP axes, so the 7B encoder costs its bf16 bytes / fsdp per chip instead of all of them, and its
# forward runs under `plan.scope` (the residual constraints read the plan; GSPMD gathers each layer's
# weights inside the scan). Prompts split over the plan's batch axes where their count divides them.


def abstract_state(config):
  """(graphdef, abstract nnx.State) of Qwen25TextModel(config): every variable a ShapeDtypeStruct inside
  its nnx.Param (which carries the logical axis names), in the structure of `nnx.split(model)[1]`;
  nothing is allocated."""
  return nnx.split(nnx.eval_shape(lambda: Qwen25TextModel(config, rngs=nnx.Rngs(0))))


def sharding_rules(plan):
  """plan.rules plus the encoder's own logical names (LOGICAL_RULES: 'vocab', unsharded) where the plan
  has none (so config.sharding.rules.vocab, when set, wins)."""
  rules = dict(plan.rules)
  for name, axes in rules_lib.resolve_rules(LOGICAL_RULES, mesh_axes=plan.mesh.axis_names).items():
    rules.setdefault(name, axes)
  return rules


def param_shardings(config, plan):
  """nnx.State of NamedShardings (the structure of `abstract_state(config)[1]`) of the encoder's
  parameters on plan.mesh, from their logical names under `sharding_rules(plan)`: with the default rules
  every matrix, the embedding table and the norm scales split their model width ('embed') over the fsdp
  axes (as the DiT's), 'heads' / 'mlp' over 'tensor'; 'layers' and 'vocab' are not split. A dimension
  its axes do not divide drops them (rules.mesh_spec)."""
  _, state = abstract_state(config)
  return rules_lib.param_shardings(state, plan.mesh, sharding_rules(plan))


def batch_sharding(plan, shape):
  """NamedSharding of a (B, ...) array: B over the plan's batch axes ('act_batch': data, fsdp), dropping
  axes from the end until their product divides B (replicated when none does); the rest replicated."""
  return plan.sharding(('act_batch',), tuple(shape), 'activation')


def place_params(params, config, plan):
  """The encoder's parameters on `param_shardings(config, plan)` as an nnx.State. `params`: load_params'
  {NNX path: numpy} (each device receives only its slices from host memory, plan.place) or an nnx.State
  of arrays (resharded where it differs)."""
  shardings = param_shardings(config, plan)
  _, state = abstract_state(config)
  if isinstance(params, nnx.State):
    values = {tuple(str(p) for p in path): v.get_value() for path, v in nnx.to_flat_state(params)}
  else:
    values = params
  expected = {tuple(str(p) for p in path) for path, _ in nnx.to_flat_state(state)}
  if set(values) != expected:
    raise ValueError(f'params do not match the model: {_short(map(str, set(values) ^ expected))}')
  for path, variable in nnx.to_flat_state(state):
    key = tuple(str(p) for p in path)
    value = values[key]
    spec = variable.get_value()
    if tuple(value.shape) != tuple(spec.shape):
      raise ValueError(f'params: {"/".join(key)} has shape {tuple(value.shape)}, the model {spec.shape}')
    if not isinstance(value, jax.Array):
      value = np.asarray(value, spec.dtype)
    variable.set_value(value.astype(spec.dtype) if value.dtype != spec.dtype else value)
  return plan_lib.place(state, shardings)


class ShardedForward(NamedTuple):
  """`sharded_forward`'s result. fn: jitted (params nnx.State, input_ids (B, L) int32) -> (B, L,
  num_layers * hidden) embeddings; params / input_ids / output: its in and out shardings."""
  fn: Any
  params: Any
  input_ids: Any
  output: Any


def sharded_forward(config, plan, batch_size, length=MAX_LENGTH, out_dtype=jnp.float32):
  """The encoder's forward on plan.mesh for (batch_size, length) ids: reason_full_concat of the hidden
  states in out_dtype, jitted with in_shardings (param_shardings(config, plan), batch_sharding(ids)) and
  out_shardings batch_sharding(output), traced under plan.scope. Equal to the unsharded forward
  (`Reason1TextEncoder.embed_ids` without a plan) up to the reduction order of the split matmuls."""
  graphdef, _ = abstract_state(config)
  params = param_shardings(config, plan)
  ids = batch_sharding(plan, (batch_size, length))
  out = batch_sharding(plan, (batch_size, length, config.embedding_dim))
  out_dtype = np.dtype(out_dtype)

  def forward(state, input_ids):
    model = nnx.merge(graphdef, state)
    return reason_full_concat(model(input_ids)).astype(out_dtype)

  fn = jax.jit(plan.scope(forward), in_shardings=(params, ids), out_shardings=out)
  return ShardedForward(fn, params, ids, out)


class DeviceEncoder(NamedTuple):
  """The encoder as a task runs it on the training devices, for `ddrl_jax.aot` (a task's
  `device_text_encoder()`): its config and the shape of one call, batch_size prompts of `length` tokens
  -> (batch_size, length, embedding_dim) out_dtype embeddings."""
  config: Qwen25TextConfig
  batch_size: int
  length: int = MAX_LENGTH
  out_dtype: Any = jnp.float32

  def forward(self, plan):
    """The call's ShardedForward on plan.mesh (`sharded_forward`)."""
    return sharded_forward(self.config, plan, self.batch_size, self.length, self.out_dtype)

  def abstract_inputs(self, forward):
    """(params, input_ids) as ShapeDtypeStructs carrying `forward`'s in_shardings; nothing allocated."""
    _, state = abstract_state(self.config)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                          forward.params)
    return params, jax.ShapeDtypeStruct((self.batch_size, self.length), jnp.int32, sharding=forward.input_ids)

  def forward_flops(self):
    """Analytic FLOPs of one call (`forward_flops` x batch_size)."""
    return self.batch_size * sum(forward_flops(self.config, self.length).values())

  @property
  def attention_kernel(self):
    """The kernel its lowered program's attention must be (models.attention.check_program)."""
    return attention_kernel(self.config.attention_impl)

  def describe(self):
    """A JSON-able summary for report rows."""
    cfg = self.config
    return dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                param_dtype=np.dtype(cfg.param_dtype).name, batch=self.batch_size, length=self.length)


def device_encoder(section, text_dim, dtype):
  """The DeviceEncoder of a Cosmos task's config section (config.cosmos), or None unless section.text is
  'reason1'. As the task loads it: dtype = param_dtype = `dtype` (the DiT's; no float32 masters), the
  architecture of section.text_encoder's config.json where that folder is on this host (the diffusers
  folder or its text_encoder/), else Cosmos-Reason1-7B's (`reason1_7b`), with
  section.text_encoder_overrides (Qwen25TextConfig fields, when the section has that key) on top; calls
  of section.text_batch prompts at section.text_length tokens, float32 out. Raises ValueError when the
  embeddings are not `text_dim` wide (the DiT's text width)."""
  if section.get('text') != 'reason1':
    return None
  kw = dict(dtype=dtype, param_dtype=dtype)
  kw.update(dict(section.get('text_encoder_overrides') or {}))
  folder = os.fspath(section.get('text_encoder') or '')
  if folder and not os.path.isfile(os.path.join(folder, 'config.json')):
    folder = os.path.join(folder, TEXT_ENCODER)
  if folder and os.path.isfile(os.path.join(folder, 'config.json')):
    config = config_from_hf(read_config(folder), os.path.join(folder, 'config.json'), **kw)
  else:
    config = reason1_7b(**kw)
  if config.embedding_dim != text_dim:
    raise ValueError(f'the Reason1 text encoder gives {config.num_layers} layers x {config.hidden_size} = '
                     f'{config.embedding_dim}-wide embeddings; the DiT takes {text_dim} '
                     f'(config.cosmos.model, config.cosmos.text_encoder_overrides)')
  return DeviceEncoder(config, int(section.get('text_batch', 4)), int(section.get('text_length', MAX_LENGTH)))


# ----------------------------------------------------------------------------------------------- encoder


@functools.partial(jax.jit, static_argnums=(0, 3))
def _embed(graphdef, state, input_ids, out_dtype):
  model = nnx.merge(graphdef, state)
  return reason_full_concat(model(input_ids)).astype(out_dtype)


class Encoded(NamedTuple):
  """embeddings (B, max_length, num_layers * hidden) jax array (numpy when a plan spans several processes:
  gathered on every host); num_truncated: prompts cut to max_length."""
  embeddings: jax.Array
  num_truncated: int


class Reason1TextEncoder:
  """Prompts -> Cosmos-Predict2.5 reason embeddings with a Qwen25TextModel and a Qwen chat tokenizer.

  plan: a ShardingPlan to run on its mesh (the training devices): the parameters FSDP-sharded
  (`param_shardings`), each chunk's ids and embeddings split over the batch axes where batch_size divides
  them (`sharded_forward`). None: the parameters and the forward on the default device.
  """

  def __init__(self, model, tokenizer, *, max_length=MAX_LENGTH, batch_size=4, plan=None):
    if batch_size < 1:
      raise ValueError(f'batch_size must be >= 1, got {batch_size}')
    self.config = model.config
    self.tokenizer = tokenizer
    self.max_length, self.batch_size = max_length, batch_size
    self.plan = plan
    self._graphdef, state = nnx.split(model)
    self._state = jax.device_put(state) if plan is None else place_params(state, self.config, plan)
    self._forwards = {}

  @property
  def model(self):
    return nnx.merge(self._graphdef, self._state)

  @property
  def dim(self):
    return self.config.embedding_dim

  @classmethod
  def from_pretrained(cls, path, *, tokenizer=None, max_length=MAX_LENGTH, batch_size=4, plan=None,
                      **config_overrides):
    """Load from a diffusers Cosmos-Predict2.5 folder (text_encoder/ + tokenizer/) or a text_encoder
    folder itself. tokenizer: a tokenizer object or folder; by default the folder's own tokenizer files,
    else its sibling tokenizer/ folder. Everything is read offline (local files only). plan: see the
    class; the weights then go from host memory straight to their shards."""
    from transformers import AutoTokenizer
    path = os.fspath(path)
    if not os.path.isdir(path):
      raise FileNotFoundError(f'{path}: text encoder folder does not exist')
    if not os.path.isfile(os.path.join(path, 'config.json')) and os.path.isdir(os.path.join(path, TEXT_ENCODER)):
      path = os.path.join(path, TEXT_ENCODER)
    model, _ = load_model(path, plan=plan, **config_overrides)
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
      where = os.fspath(tokenizer) if tokenizer is not None else _tokenizer_folder(path)
      tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
    return cls(model, tokenizer, max_length=max_length, batch_size=batch_size, plan=plan)

  def tokenize(self, prompts, max_length=None):
    return tokenize(self.tokenizer, list(prompts), max_length or self.max_length)

  def sharded(self, batch_size, length, out_dtype=jnp.float32):
    """The plan's ShardedForward for (batch_size, length) ids (built once per shape and dtype)."""
    key = (batch_size, length, np.dtype(out_dtype))
    if key not in self._forwards:
      self._forwards[key] = sharded_forward(self.config, self.plan, batch_size, length, out_dtype)
    return self._forwards[key]

  def embed_ids(self, input_ids, out_dtype=jnp.float32):
    """(B, L) ids -> (B, L, num_layers * hidden) in out_dtype, computed in float32 from the model. With a
    plan: on its mesh, the ids placed on (and the result in) the batch sharding of `sharded_forward`."""
    if self.plan is None:
      return _embed(self._graphdef, self._state, jnp.asarray(input_ids, jnp.int32), np.dtype(out_dtype))
    ids = np.asarray(input_ids, np.int32)
    fwd = self.sharded(ids.shape[0], ids.shape[1], out_dtype)
    return fwd.fn(self._state, plan_lib.place(ids, fwd.input_ids))

  def encode(self, prompts, *, max_length=None, out_dtype=jnp.float32):
    """Prompts -> Encoded((B, max_length, num_layers * hidden) in out_dtype, number truncated).

    Runs in chunks of batch_size rows (the last one padded, so one shape compiles); prompts whose chat
    exceeds max_length are cut as the reference does, counted, and logged as a warning.
    """
    if isinstance(prompts, str):
      prompts = [prompts]
    tok = self.tokenize(prompts, max_length)
    ids, length = tok.input_ids, tok.input_ids.shape[1]
    if tok.num_truncated:
      logger.warning('reason1 text encoder: %d of %d prompts exceed %d chat tokens (longest %d) and were '
                     'truncated', tok.num_truncated, len(ids), length, int(tok.num_tokens.max()))
    if not len(ids):
      return Encoded(jnp.zeros((0, length, self.dim), out_dtype), 0)
    chunks = []
    for i in range(0, len(ids), self.batch_size):
      chunk = ids[i:i + self.batch_size]
      pad = self.batch_size - len(chunk) if len(ids) > self.batch_size else 0
      if pad:
        chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)])
      chunks.append(self.embed_ids(chunk, out_dtype)[:len(chunk) - pad])
    out = chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks)
    if isinstance(out, jax.Array) and not out.is_fully_addressable:   # a plan over several processes
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      out = multihost_utils.process_allgather(out, tiled=True)       # every host gets the whole batch
    return Encoded(out, tok.num_truncated)


def _tokenizer_folder(model_folder):
  """The folder's own tokenizer files, else its sibling tokenizer/ (diffusers pipeline layout)."""
  if any(os.path.isfile(os.path.join(model_folder, f)) for f in ('tokenizer.json', 'tokenizer_config.json')):
    return model_folder
  sibling = os.path.join(os.path.dirname(os.path.abspath(model_folder)), TOKENIZER)
  if os.path.isdir(sibling):
    return sibling
  raise FileNotFoundError(f'{model_folder}: no tokenizer files in it and no sibling {TOKENIZER}/ folder; '
                          'pass tokenizer= (the Qwen/Qwen2.5-VL-7B-Instruct tokenizer)')


# ---------------------------------------------------------------------- tiny random model (tests)

# A Qwen-style chat template (ChatML turns, a default system turn when none is given, text parts of list
# contents concatenated); the real tokenizer brings its own.
TINY_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if loop.first and m['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- else -%}{%- for part in m['content'] if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
TINY_SPECIAL_TOKENS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')   # ids 256, 257, 258


def tiny_tokenizer(chat_template=TINY_CHAT_TEMPLATE):
  """A byte-level BPE tokenizer without merges (byte b -> id b) plus Qwen's ChatML special tokens,
  as a PreTrainedTokenizerFast padding on the right with <|endoftext|> (Qwen2.5-VL's pad token)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
  vocab = {ch: b for b, ch in bytes_to_unicode().items()}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(list(TINY_SPECIAL_TOKENS))
  return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token='<|endoftext|>', eos_token='<|im_end|>',
                                 padding_side='right', chat_template=chat_template)


def tiny_hf_config(vocab_size=300, hidden=64, num_layers=3, heads=4, kv_heads=2, intermediate=128):
  """A tiny transformers Qwen2_5_VLConfig (text hidden 64, 3 layers, 4 heads of 16, 2 KV heads, mRoPE
  sections [2, 3, 3], rope_theta 1e4 so that angles wrap; a one-block vision tower)."""
  from transformers import Qwen2_5_VLConfig
  text = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, intermediate_size=intermediate, rms_norm_eps=1e-6,
              rope_theta=1e4, max_position_embeddings=1024, tie_word_embeddings=False,
              rope_scaling={'type': 'mrope', 'mrope_section': [2, 3, 3]})
  vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                fullatt_block_indexes=[0])
  return Qwen2_5_VLConfig(text_config=text, vision_config=vision)


def tiny_hf_model(seed=0, **config_kwargs):
  """transformers' Qwen2_5_VLForConditionalGeneration at tiny size, float32, eval mode, with weights redrawn
  O(1) (matrices ~ N(0, 1/fan_in), norm scales 1 + 0.1 N, biases 0.1 N) so that any mismatch shows."""
  import torch
  from transformers import Qwen2_5_VLForConditionalGeneration
  torch.manual_seed(seed)
  model = Qwen2_5_VLForConditionalGeneration(tiny_hf_config(**config_kwargs)).float().eval()
  g = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim > 1:
        p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
      elif 'norm' in name:
        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
      else:
        p.copy_(0.1 * torch.randn(p.shape, generator=g))
  return model


def save_tiny(folder, hidden=16, num_layers=2, seed=0):
  """Writes a tiny random Cosmos-Reason1 text encoder in the diffusers layout (folder/text_encoder/ with
  config.json + safetensors, folder/tokenizer/) and returns `folder`: for smoke runs and tests of the
  loading path (its embeddings are num_layers * hidden wide; the tiny Cosmos DiT takes 32)."""
  hf = tiny_hf_model(seed=seed, hidden=hidden, num_layers=num_layers, heads=2, kv_heads=1,
                     intermediate=2 * hidden)
  hf.save_pretrained(os.path.join(folder, TEXT_ENCODER), safe_serialization=True)
  tiny_tokenizer().save_pretrained(os.path.join(folder, TOKENIZER))
  return folder
