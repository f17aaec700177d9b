"""SD3 MMDiT: parity with diffusers' `SD3Transformer2DModel` (fp32, CPU, every parameter re-randomized),
converter round trip and errors, SD3.5-Medium's parameter count, remat and scanned stacks, FLOPs.

Every parameter of the diffusers model is redrawn (torch.manual_seed): weights, biases and the q/k norm
scales (which diffusers initializes to ones), so that no path of the comparison is vacuous. The positional table is diffusers' own buffer (not a parameter) and is compared as part of the
forward pass.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddrl_jax.models.sd3 import convert
from ddrl_jax.models.sd3 import mmdit

torch = pytest.importorskip('torch')
tsd3 = pytest.importorskip('diffusers.models.transformers.transformer_sd3')

B, L = 2, 7
_DIFFUSERS_FIELDS = ('sample_size', 'patch_size', 'in_channels', 'num_layers', 'attention_head_dim',
                     'num_attention_heads', 'joint_attention_dim', 'caption_projection_dim',
                     'pooled_projection_dim', 'out_channels', 'pos_embed_max_size', 'dual_attention_layers',
                     'qk_norm')


def _config(**overrides):
  return mmdit.tiny(**{'remat_policy': 'none', **overrides})


def _diffusers_kwargs(cfg):
  return {f: getattr(cfg, f) for f in _DIFFUSERS_FIELDS}


def _randomize(model, seed=0):
  """Redraws every parameter: weights N(0, 1/fan_in), biases N(0, 0.1^2), q/k norm scales 1 + N(0, 0.1^2)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in sorted(model.named_parameters()):
      noise = torch.randn(p.shape, generator=gen)
      if p.ndim >= 2:
        p.copy_(noise / math.sqrt(math.prod(p.shape[1:])))
      elif '.norm_' in name:
        p.copy_(1 + 0.1 * noise)
      else:
        p.copy_(0.1 * noise)
  return model


@pytest.fixture(scope='module')
def torch_model():
  torch.manual_seed(0)
  model = tsd3.SD3Transformer2DModel(**_diffusers_kwargs(_config())).eval()
  return _randomize(model)


@pytest.fixture(scope='module')
def diffusers_sd(torch_model):
  return {k: v.detach().numpy().copy() for k, v in torch_model.state_dict().items()}


def _jit_forward(model):
  """(jitted fn(state, x, t, text, pooled), state) of an MMDiT (eager NNX calls are slow on CPU)."""
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, *args: nnx.merge(graphdef, s)(*args)), state


@pytest.fixture(scope='module')
def jax_forward(diffusers_sd):
  cfg = _config()
  return _jit_forward(convert.model_from_pure(convert.from_diffusers_state_dict(diffusers_sd, cfg), cfg))


def _inputs(h, w, seed):
  rng = np.random.default_rng(seed)
  cfg = _config()
  f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
  return (f32(B, cfg.in_channels, h, w), rng.uniform(0, 1000, (B,)).astype(np.float32),
          f32(B, L, cfg.joint_attention_dim), f32(B, cfg.pooled_projection_dim))


@pytest.mark.parametrize('hw', [(16, 16), (16, 24)])
def test_parity_with_diffusers(torch_model, jax_forward, hw):
  x, t, text, pooled = _inputs(*hw, seed=hw[1])
  fwd, state = jax_forward
  ours = np.asarray(fwd(state, x, t, text, pooled))
  with torch.no_grad():
    ref = torch_model(torch.tensor(x), torch.tensor(text), torch.tensor(pooled), torch.tensor(t),
                      return_dict=False)[0].numpy()
  err = float(np.abs(ours - ref).max())
  print(f'{hw}: max|ref| = {np.abs(ref).max():.3f}, max abs diff = {err:.2e}')
  assert ours.shape == ref.shape == x.shape
  assert float(np.abs(ref).std()) > 0.1     # not a vacuous comparison
  assert err <= 1e-5


def test_pos_embed_crop_equals_diffusers_buffer(torch_model):
  cfg = _config()
  pe = torch_model.pos_embed
  for h, w in ((8, 8), (8, 12), (24, 24), (3, 5)):
    np.testing.assert_array_equal(mmdit.pos_embed_crop(cfg, h, w),
                                  pe.cropped_pos_embed(2 * h, 2 * w)[0].numpy())


def test_round_trip(diffusers_sd):
  cfg = _config()
  pure = convert.from_diffusers_state_dict(diffusers_sd, cfg)
  back = convert.to_diffusers_state_dict(pure, cfg)
  assert back.keys() == diffusers_sd.keys()
  for k, v in diffusers_sd.items():
    assert back[k].shape == v.shape and back[k].dtype == v.dtype, k
    np.testing.assert_array_equal(back[k], v, err_msg=k)
  ours = nnx.to_pure_dict(nnx.state(mmdit.abstract_model(cfg), nnx.Param))
  assert jax.tree.structure(ours) == jax.tree.structure(pure)


def test_converter_reports_all_problems(diffusers_sd):
  cfg = _config()
  sd = dict(diffusers_sd)
  del sd['transformer_blocks.1.attn2.to_k.weight']
  del sd['transformer_blocks.4.norm1_context.linear.bias']
  sd['transformer_blocks.0.some_new.weight'] = np.zeros((3, 3), np.float32)
  sd['proj_out.weight'] = np.zeros((5, 32), np.float32)
  sd['pos_embed.pos_embed'] = sd['pos_embed.pos_embed'] + 1
  with pytest.raises(ValueError) as info:
    convert.from_diffusers_state_dict(sd, cfg)
  msg = str(info.value)
  for part in ('transformer_blocks.1.attn2.to_k.weight', 'transformer_blocks.4.norm1_context.linear.bias',
               'unexpected (1): [\'transformer_blocks.0.some_new.weight\']', 'proj_out.weight: got (5, 32)',
               'pos_embed.pos_embed: differs'):
    assert part in msg, (part, msg)
  assert 'transformer_blocks.0.attn2.to_k.weight' not in msg
  pure = convert.from_diffusers_state_dict(diffusers_sd, cfg)
  pure['joint_blocks']['ff']['proj_in']['kernel'] = np.zeros((3, 32, 128), np.float32)
  with pytest.raises(ValueError, match=r'joint_blocks/ff/proj_in/kernel: got \(3, 32, 128\), expected '
                                       r'\(2, 32, 128\)'):
    convert.to_diffusers_state_dict(pure, cfg)


def test_dual_layers_must_be_a_prefix():
  with pytest.raises(ValueError, match='prefix'):
    mmdit.tiny(dual_attention_layers=(0, 2))
  cfg = mmdit.tiny(dual_attention_layers=(0, 1, 4))    # the last block may be dual too
  assert (cfg.num_dual, cfg.num_joint, cfg.last_dual) == (2, 2, True)
  with pytest.raises(ValueError, match='caption_projection_dim'):
    mmdit.tiny(caption_projection_dim=48)


def test_last_block_dual_and_no_dual_parity():
  """Two more layouts (SD3.0-like: no dual block; dual last block) against diffusers, smaller inputs."""
  for cfg in (_config(dual_attention_layers=(), qk_norm=None, num_layers=3),
              _config(dual_attention_layers=(0, 1, 2), num_layers=3)):
    torch.manual_seed(1)
    ref_model = _randomize(tsd3.SD3Transformer2DModel(**_diffusers_kwargs(cfg)).eval(), seed=1)
    sd = {k: v.detach().numpy() for k, v in ref_model.state_dict().items()}
    model = convert.model_from_pure(convert.from_diffusers_state_dict(sd, cfg), cfg)
    x, t, text, pooled = (a[:1] for a in _inputs(8, 12, seed=3))
    with torch.no_grad():
      ref = ref_model(torch.tensor(x), torch.tensor(text), torch.tensor(pooled), torch.tensor(t),
                      return_dict=False)[0].numpy()
    fwd, state = _jit_forward(model)
    err = float(np.abs(np.asarray(fwd(state, x, t, text, pooled)) - ref).max())
    print(f'dual={cfg.dual_attention_layers} qk_norm={cfg.qk_norm}: max abs diff = {err:.2e}')
    assert err <= 1e-5


def test_sd35_medium_param_count_matches_diffusers():
  cfg = mmdit.sd35_medium()
  with torch.device('meta'):
    ref = tsd3.SD3Transformer2DModel(**_diffusers_kwargs(cfg))
  ref_count = sum(p.numel() for p in ref.parameters())
  ours = mmdit.num_params(cfg)
  print(f'SD3.5-Medium parameters: ours {ours:,}, diffusers {ref_count:,}')
  assert ours == ref_count
  assert abs(ours / 2.2432e9 - 1) < 1e-3
  # Every diffusers key has exactly one counterpart of the right shape.
  shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items() if k != convert.POS_EMBED_KEY}
  ours_shapes = {}
  for path, leaf in convert.abstract_params(cfg).items():
    names, kind = convert.diffusers_names('/'.join(path), cfg)
    shape = tuple(leaf.shape[1:] if len(names) > 1 or path[0] in ('dual_blocks', 'joint_blocks') else leaf.shape)
    if kind == 'patch':
      shape = (shape[1], cfg.in_channels, cfg.patch_size, cfg.patch_size)
    for name in names:
      ours_shapes[name] = shape[::-1] if kind == 'linear' else shape
  assert ours_shapes == shapes


def _scan_lengths(jaxpr):
  lengths = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'scan':
      lengths.append(eqn.params['length'])
    for p in eqn.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = sub if hasattr(sub, 'eqns') else getattr(sub, 'jaxpr', None)
        if hasattr(inner, 'eqns'):
          lengths += _scan_lengths(inner)
  return lengths


def test_stacks_scan_and_remat_keeps_output():
  """Stacks scan (leading 'layers' axis, scan primitives of both lengths); 'full' remat gives the loss and
  gradients of no remat (the other policies run the same nnx.remat path with another policy)."""
  cfg = _config(num_layers=6, dual_attention_layers=(0, 1))       # stacks of 2 (dual) and 3 (plain)
  state = jax.jit(lambda: nnx.state(mmdit.MMDiT(cfg, rngs=nnx.Rngs(3))))()   # one compile, not eager init
  pure = nnx.to_pure_dict(nnx.state(state, nnx.Param))
  assert pure['dual_blocks']['attn2']['to_q']['kernel'].shape == (2, 32, 32)
  assert pure['dual_blocks']['norm1']['linear']['kernel'].shape == (2, 32, 9 * 32)
  assert pure['joint_blocks']['attn']['to_add_out']['kernel'].shape == (3, 32, 32)
  assert pure['last_block']['norm1_context']['linear']['kernel'].shape == (32, 2 * 32)
  assert 'to_add_out' not in pure['last_block']['attn'] and 'ff_context' not in pure['last_block']
  abstract_state = nnx.state(mmdit.abstract_model(cfg))
  specs = nnx.get_partition_spec(abstract_state)
  assert tuple(specs['joint_blocks']['ff']['proj_in']['kernel'].get_value()) == ('layers', 'embed', 'mlp')
  names = {n for _, logical, _ in _logical_names(abstract_state) for n in (logical or ()) if n}
  assert names <= set(mmdit.LOGICAL_RULES), names - set(mmdit.LOGICAL_RULES)

  args = (jnp.ones((1, 4, 8, 12)), jnp.full((1,), 300.0), jnp.ones((1, 3, 24)), jnp.ones((1, 20)))
  outs = {}
  for policy in ('none', 'full'):
    graphdef = nnx.graphdef(mmdit.abstract_model(_config(num_layers=6, remat_policy=policy)))
    loss_fn = lambda s: jnp.mean(nnx.merge(graphdef, s)(*args) ** 2)
    if policy == 'none':
      lengths = _scan_lengths(jax.make_jaxpr(loss_fn)(state).jaxpr)
      assert 2 in lengths and 3 in lengths, lengths
    outs[policy] = jax.jit(jax.value_and_grad(loss_fn))(state)
  for policy in ('full',):
    np.testing.assert_allclose(outs[policy][0], outs['none'][0], rtol=1e-6)
    for g, r in zip(jax.tree.leaves(outs[policy][1]), jax.tree.leaves(outs['none'][1])):
      np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
  g = nnx.to_pure_dict(outs['none'][1])
  assert float(jnp.abs(g['dual_blocks']['attn2']['to_q']['kernel']).max()) > 0


def _logical_names(state):
  from ddrl_jax.parallel import rules   # pylint: disable=g-import-not-at-top
  return rules.logical_names(state)


def test_forward_flops_match_kernel_sizes():
  cfg = mmdit.sd35_medium()
  s, parts = mmdit.forward_flops(cfg, (128, 128), 333)
  assert s == 4096
  image_mods = ('to_q', 'to_k', 'to_v', 'to_out', 'proj_in', 'proj_out')
  text_mods = ('add_q_proj', 'add_k_proj', 'add_v_proj', 'to_add_out')
  macs = 0
  for path, leaf in convert.abstract_params(cfg).items():
    if path[0] not in ('dual_blocks', 'joint_blocks', 'last_block') or path[-1] != 'kernel':
      continue
    size = math.prod(leaf.shape)
    if path[1] == 'ff_context' or path[-2] in text_mods:
      macs += size * 333
    elif path[-2] in image_mods:
      macs += size * s
  assert parts['linear'] == 2 * macs
  assert parts['attention'] == 2 * (24 * 2 * (s + 333) ** 2 * 1536 + 13 * 2 * s * s * 1536)
  assert set(parts) == {'linear', 'attention', 'embed', 'other'}
  # About 36% of the parameters act on every image token (adaLN weights act once per sample, 29% of the
  # parameters are text-stream weights on L tokens), so the matmul FLOPs are ~0.76 x 2 N S.
  n = mmdit.num_params(cfg)
  assert 0.7 * n * s < sum(parts.values()) - parts['attention'] < 0.8 * n * s


def test_lora_attaches_to_stacked_attention_and_bf16_runs(diffusers_sd, jax_forward):
  from ddrl_jax.models import lora   # pylint: disable=g-import-not-at-top
  cfg = _config()
  pure = convert.from_diffusers_state_dict(diffusers_sd, cfg)
  x, t, text, pooled = (a[:1] for a in _inputs(8, 8, seed=5))
  base = np.asarray(jax_forward[0](jax_forward[1], x, t, text, pooled))
  model = convert.model_from_pure(pure, cfg)
  spec = lora.LoRAConfig(rank=4, alpha=4.0, targets=(r'.*\.attn2?\.(to_q|to_k|to_v|to_out|add_[qkv]_proj|to_add_out)',))
  paths = lora.attach(model, spec, jax.random.key(0))
  assert 'dual_blocks.attn.add_q_proj' in paths and 'last_block.attn.to_out' in paths
  assert model.dual_blocks.attn2.to_q.lora_a.shape == (2, 32, 4)
  fwd, state = _jit_forward(model)
  np.testing.assert_array_equal(np.asarray(fwd(state, x, t, text, pooled)), base)   # B = 0 at init

  bf16 = _config(dtype=jnp.bfloat16)
  fwd16, state16 = _jit_forward(convert.model_from_pure(pure, bf16))
  out16 = np.asarray(fwd16(state16, x, t, text, pooled)).astype(np.float32)
  assert np.isfinite(out16).all()
  assert float(np.abs(out16 - base).max()) < 0.1 * float(np.abs(base).max())
