"""The JAX Cosmos-Reason1 text encoder (models/reason1_text.py) against transformers' Qwen2_5_VLForConditionalGeneration
and diffusers' own Cosmos-Predict2.5 `_get_prompt_embeds`, on a tiny random Qwen2.5-VL (text hidden 64, 3 layers,
4 heads, 2 KV heads, mRoPE sections [2, 3, 3]) saved as sharded safetensors and a byte-level tokenizer built offline.
"""
import json
import logging
import os
import shutil
import types

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from ddrl_jax.models import reason1_text as r1  # noqa: E402

TOL = 1e-5          # relative to the largest magnitude, float32
HIDDEN, LAYERS = 64, 3
LONG = 'a red fox jumps over the lazy dog; ' * 20   # > 512 chat tokens with the byte tokenizer
PROMPTS = ['a cat on a mat', 'Hello, World! 42 \u00e9\u00e8 \U0001F600', '']


@pytest.fixture(scope='module')
def hf():
  return r1.tiny_hf_model(seed=0)


@pytest.fixture(scope='module')
def tokenizer():
  return r1.tiny_tokenizer()


@pytest.fixture(scope='module')
def saved(hf, tokenizer, tmp_path_factory):
  """A diffusers-style folder: text_encoder/ (transformers 4.x key layout, 10 shards + index), tokenizer/."""
  root = tmp_path_factory.mktemp('reason1')
  hf.save_pretrained(root / r1.TEXT_ENCODER, safe_serialization=True, max_shard_size='100KB')
  tokenizer.save_pretrained(root / r1.TOKENIZER)
  return root


@pytest.fixture(scope='module')
def encoder(saved):
  return r1.Reason1TextEncoder.from_pretrained(saved, batch_size=2)


def _torch_hidden(hf, ids):
  """transformers' hidden_states[1:] for input_ids only (no attention mask): (B, n, L, D) numpy."""
  with torch.no_grad():
    out = hf(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long), output_hidden_states=True)
  assert len(out.hidden_states) == LAYERS + 1
  return torch.stack(out.hidden_states[1:], dim=1)


def _torch_embedding(hf, ids):
  """The reference's normalisation with torch: (h - mean) / (torch.std (unbiased) + 1e-8), concatenated."""
  hidden = _torch_hidden(hf, ids)
  normed = [(h - h.mean(-1, keepdim=True)) / (h.std(-1, keepdim=True) + 1e-8) for h in hidden.unbind(1)]
  return torch.cat(normed, dim=-1).numpy()


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert a.shape == b.shape, (a.shape, b.shape)
  return float(np.abs(a - b).max() / np.abs(b).max())


def _chat_bytes(prompt):
  """The expected ids, built without the tokenizer: ChatML specials (256 pad, 257 start, 258 end) and bytes."""
  start, end = [257], [258]
  nl = list(b'\n')
  return (start + list(f'system\n{r1.SYSTEM_PROMPT}'.encode()) + end + nl
          + start + list(f'user\n{prompt}'.encode()) + end + nl)


# ------------------------------------------------------------------------------------------------ (a)


def test_hidden_states_match_transformers_vl(hf, encoder, tokenizer):
  """(a) The 3 hidden states equal Qwen2_5_VLForConditionalGeneration's hidden_states[1:] (the last one after
  the final norm) in float32, for right-padded ids and no attention mask: text-only mRoPE == 1-D RoPE."""
  ids = encoder.tokenize(['a cat', 'a much longer prompt about a dog in the park'], 160).input_ids
  assert (ids[0] == tokenizer.pad_token_id).sum() > (ids[1] == tokenizer.pad_token_id).sum() > 0
  ref = _torch_hidden(hf, ids)
  ours = np.asarray(encoder.model(jnp.asarray(ids)))
  assert ours.shape == (2, LAYERS, 160, HIDDEN) and ours.dtype == np.float32
  for layer in range(LAYERS):
    assert _rel(ours[:, layer], ref[:, layer].numpy()) <= TOL, layer
  # the last entry is the final-norm output, not the last layer's raw output (caught by a hook)
  raw = []
  hook = hf.model.language_model.layers[-1].register_forward_hook(lambda m, a, out: raw.append(out[0]))
  try:
    _torch_hidden(hf, ids)
  finally:
    hook.remove()
  assert _rel(ours[:, -1], hf.model.language_model.norm(raw[0]).detach().numpy()) <= TOL
  assert _rel(ours[:, -1], raw[0].numpy()) > 0.1


# ------------------------------------------------------------------------------------------------ (b)


def test_embedding_at_512_matches_torch_std_and_padding_rows_depend_on_prompt(hf, encoder, caplog):
  """(b) encode() at the default 512 tokens equals the torch formula on transformers' hidden states (unbiased
  torch.std + 1e-8, layers concatenated), for a short prompt (padded) and a long one (truncated, counted,
  logged); the padding rows are real outputs that differ between prompts."""
  prompts = ['a cat on a mat', 'a dog on a log', LONG]
  with caplog.at_level(logging.WARNING, logger=r1.__name__):
    out = encoder.encode(prompts)
  emb = np.asarray(out.embeddings)
  assert emb.shape == (3, 512, LAYERS * HIDDEN) and emb.dtype == np.float32
  assert out.num_truncated == 1 and '1 of 3 prompts exceed 512' in caplog.text
  ids = encoder.tokenize(prompts).input_ids
  assert _rel(emb, _torch_embedding(hf, ids)) <= TOL
  # per layer and token: mean 0, unbiased std 1 (up to the 1e-8)
  per_layer = emb.reshape(3, 512, LAYERS, HIDDEN)
  np.testing.assert_allclose(per_layer.mean(-1), 0, atol=1e-5)
  np.testing.assert_allclose(per_layer.std(-1, ddof=1), 1, atol=1e-5)
  # rows 200..511 are padding for both short prompts, yet differ between them
  assert (ids[:2, 200:] == encoder.tokenizer.pad_token_id).all()
  assert np.abs(emb[0, 200:] - emb[1, 200:]).max() > 0.1


def test_encode_matches_diffusers_get_prompt_embeds(hf, encoder):
  """diffusers 0.39's own `Cosmos2_5_PredictBasePipeline._get_prompt_embeds` (the tokenizer's chat template,
  padding='max_length', truncation, no attention mask, normalise, concatenate) gives the same embedding at a
  max length of 128: three prompts padded, one truncated."""
  diffusers = pytest.importorskip('diffusers')
  pipe = types.SimpleNamespace(tokenizer=encoder.tokenizer, text_encoder=hf, _execution_device=torch.device('cpu'))
  prompts = PROMPTS + [LONG]
  with torch.no_grad():
    ref = diffusers.Cosmos2_5_PredictBasePipeline._get_prompt_embeds(
        pipe, prompts, max_sequence_length=128, device=torch.device('cpu'), dtype=torch.float32).numpy()
  out = encoder.encode(prompts, max_length=128)
  assert out.num_truncated == 1
  assert _rel(out.embeddings, ref) <= TOL


# ------------------------------------------------------------------------------------------------ (c)


def test_chat_ids_padding_and_truncation_rule(tokenizer):
  """(c) The chat ids are system + user ChatML turns without a generation prompt; they are right-padded with
  <|endoftext|> or cut to exactly max_length (512 by default); lengths and truncations are reported; the
  result equals the tokenizer's own padding='max_length' + truncation (diffusers' rule) for right padding."""
  for prompt in PROMPTS + [LONG]:
    want = _chat_bytes(prompt)
    assert r1.chat_token_ids(tokenizer, prompt) == want
    for length in (20, 120, 512):
      tok = r1.tokenize(tokenizer, [prompt], length)
      row = tok.input_ids[0]
      assert row.shape == (length,) and row.dtype == np.int32 and tok.num_tokens[0] == len(want)
      assert row.tolist() == (want + [256] * length)[:length]
      assert tok.num_truncated == int(len(want) > length)
      hf_rule = tokenizer.apply_chat_template(r1.chat_messages(prompt), tokenize=True, add_generation_prompt=False,
                                              padding='max_length', truncation=True, max_length=length)
      assert row.tolist() == list(hf_rule)
  tok = r1.tokenize(tokenizer, PROMPTS + [LONG])
  assert tok.input_ids.shape == (4, r1.MAX_LENGTH) and tok.num_truncated == 1
  assert len(_chat_bytes(LONG)) > 512 > len(_chat_bytes(PROMPTS[1]))
  no_pad = r1.tiny_tokenizer()
  no_pad.pad_token = None
  with pytest.raises(ValueError, match='no pad token'):
    r1.tokenize(no_pad, ['x'])


def test_encode_chunks_and_storage_dtype(encoder):
  """Chunks of batch_size (the last one padded to the same shape) give the rows of a one-by-one run; bf16 output
  is the float32 embedding rounded."""
  prompts = PROMPTS + ['x']
  full = np.asarray(encoder.encode(prompts, max_length=128).embeddings)
  for i, p in enumerate(prompts):
    assert _rel(encoder.encode([p], max_length=128).embeddings[0], full[i]) <= TOL
  bf16 = encoder.encode(prompts[:2], max_length=128, out_dtype=jnp.bfloat16).embeddings
  assert bf16.dtype == jnp.bfloat16
  assert _rel(np.asarray(bf16, np.float32), full[:2]) <= 1e-2
  assert encoder.encode([], max_length=128).embeddings.shape == (0, 128, LAYERS * HIDDEN)


def test_bf16_compute_remat_and_attention_impls(saved, encoder):
  """bf16 matmuls on fp32 weights stay close to float32; rematerialised layers and jax.nn's XLA attention give
  the float32 result."""
  ids = encoder.tokenize(PROMPTS[:2], 64).input_ids
  want = np.asarray(encoder.model(jnp.asarray(ids)))
  folder = saved / r1.TEXT_ENCODER
  model, _ = r1.load_model(folder, remat_policy='full', attention_impl='xla')
  assert _rel(model(jnp.asarray(ids)), want) <= TOL
  model, cfg = r1.load_model(folder, dtype=jnp.bfloat16)
  assert cfg.param_dtype == jnp.float32
  got = np.asarray(model(jnp.asarray(ids)))
  assert got.dtype == np.float32 and _rel(got, want) <= 3e-2


# ------------------------------------------------------------------------------------------------ (d)


def _copy(saved, tmp_path):
  dst = tmp_path / 'text_encoder'
  shutil.copytree(saved / r1.TEXT_ENCODER, dst)
  return dst


def _rewrite(folder, fn):
  """Applies fn(dict of numpy tensors) -> dict to the checkpoint, written back as one model.safetensors."""
  from safetensors import safe_open
  from safetensors.numpy import save_file
  tensors = {}
  for f in r1.weight_files(folder):
    with safe_open(f, 'np') as h:
      tensors.update({k: h.get_tensor(k) for k in h.keys()})
    os.remove(f)
  os.remove(folder / 'model.safetensors.index.json')
  save_file(fn(tensors), folder / 'model.safetensors')


def _one_line_error(exc_type, fn, *needles):
  with pytest.raises(exc_type) as info:
    fn()
  msg = str(info.value)
  assert '\n' not in msg, msg
  for needle in needles:
    assert needle in msg, (needle, msg)
  return msg


def test_loader_errors_name_the_file(saved, tmp_path):
  """(d) One-line errors naming the folder/file: missing folder, config.json, shard, weights; an unreadable
  file; missing, unexpected and mis-shaped keys; a mix of key layouts; a config this module does not implement."""
  base = str(tmp_path)
  _one_line_error(FileNotFoundError, lambda: r1.load_model(tmp_path / 'nope'), 'nope', 'does not exist')
  folder = _copy(saved, tmp_path)
  os.rename(folder / 'config.json', folder / 'config.bak')
  _one_line_error(FileNotFoundError, lambda: r1.load_model(folder), 'config.json', 'missing')
  os.rename(folder / 'config.bak', folder / 'config.json')
  shard = sorted(f for f in os.listdir(folder) if f.startswith('model-'))[3]
  os.rename(folder / shard, folder / (shard + '.bak'))
  _one_line_error(FileNotFoundError, lambda: r1.load_model(folder), shard, 'model.safetensors.index.json')
  os.rename(folder / (shard + '.bak'), folder / shard)
  (folder / 'bad').mkdir()
  shutil.copy(folder / 'config.json', folder / 'bad' / 'config.json')
  _one_line_error(FileNotFoundError, lambda: r1.load_model(folder / 'bad'), 'bad', 'no model.safetensors')
  (folder / 'bad' / 'model.safetensors').write_bytes(b'not a safetensors file')
  _one_line_error(ValueError, lambda: r1.load_model(folder / 'bad'), 'bad/model.safetensors', 'cannot read')

  def drop_and_add(t):
    del t['model.layers.1.mlp.up_proj.weight'], t['model.norm.weight']
    t['model.layers.7.mlp.up_proj.weight'] = t['model.layers.0.mlp.up_proj.weight']   # layer beyond config
    t['model.extra.weight'] = np.zeros(3, np.float32)
    t['visual.blocks.0.attn.qkv.weight'] = np.zeros(3, np.float32)                   # ignored
    t['lm_head.weight'] = np.zeros(3, np.float32)                                    # ignored
    return t

  _rewrite(folder, drop_and_add)
  _one_line_error(ValueError, lambda: r1.load_model(folder), base, 'missing 2',
                  'model.layers.1.mlp.up_proj.weight', 'model.norm.weight', 'unexpected 2',
                  'model.layers.7.mlp.up_proj.weight', 'model.extra.weight')
  shutil.rmtree(folder)
  folder = _copy(saved, tmp_path)
  cfg = json.loads((folder / 'config.json').read_text())
  cfg['text_config']['vocab_size'] = 301
  (folder / 'config.json').write_text(json.dumps(cfg))
  _one_line_error(ValueError, lambda: r1.load_model(folder), 'mis-shaped 1',
                  'model.embed_tokens.weight in model-0000', '(300, 64), expected (301, 64)')
  shutil.rmtree(folder)
  folder = _copy(saved, tmp_path)
  _rewrite(folder, lambda t: {**t, 'model.language_model.norm.weight': t.pop('model.norm.weight')})
  _one_line_error(ValueError, lambda: r1.load_model(folder), 'mixes key layouts')
  cfg['text_config']['vocab_size'] = 300
  cfg['text_config']['use_sliding_window'] = True
  (folder / 'config.json').write_text(json.dumps(cfg))
  _one_line_error(ValueError, lambda: r1.load_model(folder), 'config.json', 'sliding-window')


def test_new_key_layout_and_top_level_config_load_the_same_weights(saved, encoder, tmp_path):
  """transformers 5.x names (model.language_model.*, model.visual.*) and a config.json with the text fields at
  the top level (Qwen's original files) load the same parameters as the 4.x layout."""
  folder = _copy(saved, tmp_path)

  def rename(t):
    out = {}
    for k, v in t.items():
      if k.startswith('model.'):
        k = 'model.language_model.' + k[len('model.'):]
      elif k.startswith('visual.'):
        k = 'model.' + k
      out[k] = v
    return out

  _rewrite(folder, rename)
  cfg = json.loads((folder / 'config.json').read_text())
  cfg.update(cfg.pop('text_config'))
  cfg['model_type'] = 'qwen2_5_vl'
  (folder / 'config.json').write_text(json.dumps(cfg))
  model, config = r1.load_model(folder)
  assert config == encoder.config
  ids = jnp.asarray(encoder.tokenize(['a cat'], 32).input_ids)
  np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(encoder.model(ids)))


def test_config_presets_and_parameter_count():
  """reason1_7b has Qwen2.5-VL-7B's language-model shapes: 100352 embedding features, 7.07e9 parameters
  (without lm_head and vision tower), counted on abstract shapes only."""
  cfg = r1.reason1_7b()
  assert (cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.embedding_dim) == (28, 3584, 128, 100352)
  _, params = r1.abstract_params(cfg)
  total = sum(int(np.prod(s.shape)) for s in params.values())
  d, f, kv = 3584, 18944, 4 * 128
  per_layer = (d * d + d) + 2 * (d * kv + kv) + d * d + 3 * d * f + 2 * d
  assert total == 152064 * d + 28 * per_layer + d == 7_070_619_136
  flops = r1.forward_flops(cfg)
  kernels = sum(int(np.prod(s.shape)) for path, s in params.items() if path[-1] == 'kernel')
  assert flops['linear'] == 2 * kernels * 512 and flops['attention'] == 4 * 512 * 512 * 3584 * 28
  hf7b = {'model_type': 'qwen2_5_vl', 'hidden_size': 3584, 'intermediate_size': 18944, 'num_attention_heads': 28,
          'num_hidden_layers': 28, 'num_key_value_heads': 4, 'rms_norm_eps': 1e-06, 'rope_theta': 1000000.0,
          'vocab_size': 152064, 'rope_scaling': {'type': 'mrope', 'mrope_section': [16, 24, 24]},
          'use_sliding_window': False, 'hidden_act': 'silu'}
  assert r1.config_from_hf(hf7b) == cfg
  with pytest.raises(ValueError, match='rope_scaling'):
    r1.config_from_hf({**hf7b, 'rope_scaling': {'rope_type': 'yarn', 'factor': 4.0}})
  with pytest.raises(ValueError, match='model_type'):
    r1.config_from_hf({**hf7b, 'model_type': 'llama'})
  v5 = {k: v for k, v in hf7b.items() if k not in ('rope_theta', 'rope_scaling')}   # transformers 5.x form
  v5['rope_parameters'] = {'rope_type': 'default', 'rope_theta': 5e5, 'mrope_section': [16, 24, 24]}
  assert r1.config_from_hf(v5).rope_theta == 5e5


# ------------------------------------------------------------------------------------------ sharded placement


def _plan(**mesh):
  """A ShardingPlan with the default rules on the 8 fake CPU devices (tests/conftest.py)."""
  from ddrl_jax import parallel
  from ddrl_jax.parallel import rules
  m = parallel.make_mesh(dict(dict(data=1, fsdp=1, context=1, tensor=1), **mesh))
  return parallel.ShardingPlan(mesh=m, rules=rules.resolve_rules(rules.DEFAULT_RULES, mesh_axes=m.axis_names))


def test_sharded_placement_equals_the_unsharded_encoder(saved, encoder):
  """On data 2 x fsdp 4, the weights split their width over fsdp (about 1/4 of the bytes per device) and the
  sharded forward equals the one-device encoder (float32, 1e-5): prompts in chunks of 2 split over data, a
  batch of 3 (no batch axis divides it) replicated; the checkpoint loads straight onto the shards."""
  from jax.sharding import PartitionSpec as P
  from ddrl_jax.parallel import rules
  plan = _plan(data=2, fsdp=4)
  sharded = r1.Reason1TextEncoder.from_pretrained(saved, batch_size=2, plan=plan)
  state = sharded._state
  for path, spec in [(('layers', 'mlp', 'gate_proj', 'kernel'), P(None, 'fsdp')),
                     (('layers', 'mlp', 'down_proj', 'kernel'), P(None, None, 'fsdp')),
                     (('embed_tokens', 'embedding'), P(None, 'fsdp')), (('norm', 'scale'), P('fsdp'))]:
    value = state[path[0]]
    for p in path[1:]:
      value = value[p]
    value = value.get_value()
    assert value.sharding.spec == spec and not value.sharding.is_fully_replicated, path
    dim = list(spec).index('fsdp')                      # the model width, HIDDEN over 4 devices
    assert value.shape[dim] == HIDDEN and value.addressable_shards[0].data.shape[dim] == HIDDEN // 4, path
  _, abstract = r1.abstract_state(sharded.config)
  report = rules.sharding_report(abstract, r1.param_shardings(sharded.config, plan))
  assert report['per_device_bytes'] < 0.3 * report['total_bytes']

  prompts = PROMPTS + ['x']
  want = np.asarray(encoder.encode(prompts, max_length=64).embeddings)
  got = sharded.encode(prompts, max_length=64)
  assert _rel(got.embeddings, want) <= TOL
  fwd2 = sharded.sharded(2, 64)
  assert fwd2.input_ids.spec == P('data') and fwd2.output.spec == P('data')
  ids = encoder.tokenize(prompts[:3], 64).input_ids
  fwd3 = r1.sharded_forward(encoder.config, plan, 3, 64)            # params placed from a one-device state
  assert fwd3.input_ids.is_fully_replicated and fwd3.output.is_fully_replicated
  out = fwd3.fn(r1.place_params(encoder._state, encoder.config, plan), ids)
  assert out.sharding.is_fully_replicated and _rel(out, want[:3]) <= TOL
  with pytest.raises(ValueError, match='params do not match the model'):
    r1.place_params({('norm', 'scale'): np.ones(HIDDEN)}, encoder.config, plan)


def test_sharded_program_names_its_short_causal_attention():
  """The encoder's attention runs under models.attention's scope label: 'xla_short' for 512 tokens."""
  from ddrl_jax.models import attention
  cfg = r1.Qwen25TextConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=128)
  plan = _plan(fsdp=8)
  fwd = r1.sharded_forward(cfg, plan, 4, 512)
  _, abstract = r1.abstract_state(cfg)
  text = fwd.fn.lower(abstract, np.zeros((4, 512), np.int32)).as_text(debug_info=True)
  assert attention.program_kernels(text) == ['xla_short']
  assert attention.check_program(text, r1.attention_kernel(cfg.attention_impl), 'cpu') == []
  assert r1.attention_label('cudnn', 512) == 'cudnn' and r1.attention_label('einsum', 8192) == 'xla'
