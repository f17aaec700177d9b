"""Wan2.1 T2V DiT: parity with diffusers' `WanTransformer3DModel` (fp32, CPU, every parameter random),
the state-dict converter both ways, the folder reader on a sharded save_pretrained, the parameter counts
of the real sizes, and remat.

diffusers zero-initialises some parameters (biases, the norm2 bias) and gives norms unit scales; a parity
test on those would not see a swapped or mis-transposed bias, so every tensor is re-drawn here.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddrl_jax.models.wan import transformer as wt
from ddrl_jax.models.wan import transformer_convert as wc

torch = pytest.importorskip('torch')
tw = pytest.importorskip('diffusers.models.transformers.transformer_wan')

CFG = wt.tiny(remat_policy='none')
B, L = 2, 7


def _diffusers_kwargs(cfg):
  return dict(patch_size=cfg.patch_size, num_attention_heads=cfg.num_attention_heads,
              attention_head_dim=cfg.attention_head_dim, in_channels=cfg.in_channels,
              out_channels=cfg.out_channels, text_dim=cfg.text_dim, freq_dim=cfg.freq_dim,
              ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers, cross_attn_norm=cfg.cross_attn_norm,
              qk_norm=cfg.qk_norm, eps=cfg.eps, rope_max_seq_len=cfg.rope_max_seq_len)


def _randomize(model):
  """O(1) random weights everywhere: matrices/convs ~1/sqrt(fan-in), biases 0.1 N(0,1), norm scales 1 + 0.1
  N(0,1), modulation tables 0.3 N(0,1)."""
  gen = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if name.endswith('scale_shift_table'):
        p.copy_(0.3 * noise)
      elif p.ndim >= 2:
        p.copy_(noise / math.sqrt(math.prod(p.shape[1:])))
      elif name.endswith('bias'):
        p.copy_(0.1 * noise)
      else:
        p.copy_(1.0 + 0.1 * noise)
  return model


@pytest.fixture(scope='module')
def torch_model():
  return _randomize(tw.WanTransformer3DModel(**_diffusers_kwargs(CFG)).eval())


@pytest.fixture(scope='module')
def diffusers_sd(torch_model):
  return {k: v.detach().numpy().copy() for k, v in torch_model.state_dict().items()}


@pytest.fixture(scope='module')
def jax_model(diffusers_sd):
  return wc.merge_params(CFG, wc.from_diffusers_state_dict(diffusers_sd, CFG))


def _inputs(seed, shape):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((B,) + shape).astype(np.float32)
  t = rng.uniform(0, 1000, (B,)).astype(np.float32)
  ctx = rng.standard_normal((B, L, CFG.text_dim)).astype(np.float32)
  return x, t, ctx


@pytest.mark.parametrize('shape', [(16, 3, 8, 8), (16, 2, 6, 10)])
def test_parity_with_diffusers(torch_model, jax_model, shape):
  x, t, ctx = _inputs(sum(shape), shape)
  with torch.no_grad():
    ref = torch_model(torch.tensor(x), torch.tensor(t), torch.tensor(ctx), return_dict=False)[0].numpy()
  ours = np.asarray(nnx.jit(lambda m, *a: m(*a))(jax_model, x, t, ctx))
  err = float(np.abs(ours - ref).max())
  print(f'shape={shape} max|ref|={np.abs(ref).max():.3f} max abs diff={err:.2e}')
  assert ours.shape == ref.shape
  assert np.abs(ref).max() > 0.1
  assert err <= 1e-5


def test_state_dict_round_trip(diffusers_sd, jax_model):
  pure = wc.from_diffusers_state_dict(diffusers_sd, CFG)
  want = nnx.to_pure_dict(nnx.state(jax_model, nnx.Param))
  assert jax.tree.structure(pure) == jax.tree.structure(want)
  back = wc.to_diffusers_state_dict(pure, CFG)
  assert back.keys() == diffusers_sd.keys()
  for k, v in diffusers_sd.items():
    np.testing.assert_array_equal(back[k], v, err_msg=k)
  # the Conv3d patch embedding equals a dense layer on layers.patchify's features
  np.testing.assert_array_equal(pure['patch_embedding']['kernel'][:, 0],
                                diffusers_sd['patch_embedding.weight'][0].reshape(-1))


def test_converter_errors(diffusers_sd):
  sd = dict(diffusers_sd)
  sd['blocks.0.attn1.to_q.weight'] = sd['blocks.0.attn1.to_q.weight'][:, :-1]
  del sd['proj_out.bias']
  sd['blocks.9.ffn.net.2.bias'] = np.zeros(3, np.float32)
  with pytest.raises(ValueError) as err:
    wc.from_diffusers_state_dict(sd, CFG)
  msg = str(err.value)
  assert 'blocks.0.attn1.to_q.weight' in msg and 'proj_out.bias' in msg and 'blocks.9.ffn.net.2.bias' in msg
  assert '1 shape differences, 1 missing, 1 unexpected' in msg


def test_folder_reader_sharded(torch_model, diffusers_sd, tmp_path):
  torch_model.save_pretrained(str(tmp_path / 'transformer'), max_shard_size='40KB')
  shards = list((tmp_path / 'transformer').glob('*.safetensors'))
  assert len(shards) > 1 and (tmp_path / 'transformer' / 'diffusion_pytorch_model.safetensors.index.json').exists()
  cfg, pure = wc.load_diffusers_transformer(str(tmp_path), remat_policy='none')
  assert cfg == CFG
  want = wc.from_diffusers_state_dict(diffusers_sd, CFG)
  jax.tree.map(np.testing.assert_array_equal, pure, want)


def test_real_sizes_param_counts():
  for cfg, approx in ((wt.wan1_3b(), 1.419e9), (wt.wan14b(), 14.289e9)):
    kwargs = _diffusers_kwargs(cfg)
    with torch.device('meta'):
      ref = sum(p.numel() for p in tw.WanTransformer3DModel(**kwargs).parameters())
    ours = wt.num_params(cfg)
    print(f'{cfg.num_layers} layers, D={cfg.dim}: ours {ours:,} diffusers {ref:,}')
    assert ours == ref
    assert abs(ours - approx) < 1e-3 * approx
    shapes = wc.abstract_params(cfg)     # the converter's shape check covers the real sizes
    assert shapes[('blocks', 'attn1', 'norm_q', 'scale')].shape == (cfg.num_layers, cfg.dim)


def test_remat_same_output(jax_model, diffusers_sd):
  """remat='full' (scan body rematerialised) gives the loss and gradients of 'none'."""
  x, t, ctx = _inputs(3, (16, 1, 4, 4))
  remat = wc.merge_params(wt.tiny(remat_policy='full'), wc.from_diffusers_state_dict(diffusers_sd, CFG))

  def run(model):
    graphdef, state = nnx.split(model)
    loss = lambda s, x: jnp.mean(nnx.merge(graphdef, s)(x, t, ctx) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)

  (v0, g0), (v1, g1) = run(jax_model), run(remat)
  np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), g1, g0)


def test_logical_names_and_flops():
  abstract = nnx.eval_shape(lambda: wt.WanDiT(CFG, rngs=nnx.Rngs(0)))
  names = {'/'.join(map(str, p)): v.get_metadata().get('out_sharding')
           for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
  assert names['blocks/attn1/to_q/kernel'] == ('layers', 'embed', 'heads')
  assert names['blocks/attn1/norm_q/scale'] == ('layers', 'heads')
  assert names['blocks/ffn/net_0/kernel'] == ('layers', 'embed', 'mlp')
  assert all(n is not None and len(n) == len(s.shape) for (n, s) in
             zip(names.values(), wc.abstract_params(CFG).values()))
  s, parts = wt.forward_flops(wt.wan1_3b(), (21, 60, 104), 512)
  assert s == 32760 and all(v > 0 for v in parts.values())


def test_default_rules_shard_wan14b_on_an_fsdp_mesh():
  """The cosmos DEFAULT_RULES apply unchanged: on a (data 4, fsdp 32, context 8, tensor 1) abstract mesh
  the 14B parameters are FSDP-sharded 32 ways; only vectors stay replicated (the q/k/v/FFN biases and
  the q/k norm scales, named 'heads'/'mlp', which the size-1 tensor axis does not split): 0.02 %."""
  from jax.sharding import AbstractMesh, AxisType
  from jax.sharding import PartitionSpec as P
  from ddrl_jax.parallel import rules as rules_lib
  mesh = AbstractMesh((4, 32, 8, 1), ('data', 'fsdp', 'context', 'tensor'), axis_types=(AxisType.Auto,) * 4)
  rules = rules_lib.resolve_rules(dict(rules_lib.DEFAULT_RULES, **wt.LOGICAL_RULES), 'fsdp', mesh.axis_names)
  params = nnx.state(nnx.eval_shape(lambda: wt.WanDiT(wt.wan14b(), rngs=nnx.Rngs(0))), nnx.Param)
  shardings = rules_lib.param_shardings(params, mesh, rules)
  report = rules_lib.sharding_report(params, shardings)
  assert report['replicated_fraction'] < 1e-3
  assert report['per_device_bytes'] == pytest.approx(report['total_bytes'] / 32, rel=1e-2)
  assert shardings['blocks']['ffn']['net_0']['kernel'].spec == P(None, 'fsdp')
  assert shardings['condition_embedder']['text_embedder']['linear_1']['kernel'].spec == P('fsdp')


def test_bf16_under_a_sharding_plan(diffusers_sd):
  """bf16 matmuls (fp32 params, the fp32 islands kept) traced under an active one-device ShardingPlan
  (every logical activation name resolved) stay close to the fp32 model."""
  from ddrl_jax.parallel import plan as plan_lib
  from ddrl_jax.parallel import rules as rules_lib
  x, t, ctx = _inputs(5, (16, 2, 4, 6))
  pure = wc.from_diffusers_state_dict(diffusers_sd, CFG)
  ref = np.asarray(nnx.jit(lambda m: m(x, t, ctx))(wc.merge_params(CFG, pure)))
  model = wc.merge_params(wt.tiny(remat_policy='full', dtype=jnp.bfloat16), pure)
  from jax.sharding import AxisType
  mesh = jax.make_mesh((1, 1, 1, 1), ('data', 'fsdp', 'context', 'tensor'), devices=jax.devices()[:1],
                       axis_types=(AxisType.Auto,) * 4)
  plan = plan_lib.ShardingPlan(mesh=mesh, rules=rules_lib.resolve_rules(
      dict(rules_lib.DEFAULT_RULES, **wt.LOGICAL_RULES), 'fsdp', mesh.axis_names),
                               sequence_names=wt.SEQUENCE_NAMES)
  graphdef, state = nnx.split(model)
  cast = wt.compute_cast_fn(model)
  fwd = jax.jit(plan.scope(lambda s: nnx.merge(graphdef, cast(s))(x, t, ctx)))
  out = np.asarray(fwd(state))
  assert out.dtype == np.float32
  err = float(np.abs(out - ref).max())
  print(f'bf16 vs fp32 max abs diff {err:.3f} (max|ref| {np.abs(ref).max():.2f})')
  assert err < 0.1 * np.abs(ref).max()
  cast_state = cast(state)
  assert cast_state['condition_embedder']['time_embedder']['linear_1']['kernel'].get_value().dtype == jnp.float32
  assert cast_state['blocks']['attn1']['to_q']['kernel'].get_value().dtype == jnp.bfloat16


@pytest.mark.parametrize('impl', ['ulysses', 'ring'])
def test_context_parallel_equals_one_device(diffusers_sd, impl):
  """FSDP-sharded parameters, frame-sharded residuals and context-parallel self-attention over 2 of the
  8 fake CPU devices (tests/conftest.py) give the one-device output."""
  from ddrl_jax.parallel import plan as plan_lib
  from ddrl_jax.parallel import rules as rules_lib
  if len(jax.devices()) < 8:
    pytest.skip('needs the 8 fake CPU devices of tests/conftest.py')
  x, t, ctx = _inputs(6, (16, 2, 4, 6))        # T' = 2 frames, one per context device
  pure = wc.from_diffusers_state_dict(diffusers_sd, CFG)
  model = wc.merge_params(CFG, pure)
  ref = np.asarray(nnx.jit(lambda m: m(x, t, ctx))(model))
  from jax.sharding import AxisType
  mesh = jax.make_mesh((2, 2, 2, 1), ('data', 'fsdp', 'context', 'tensor'), devices=jax.devices()[:8],
                       axis_types=(AxisType.Auto,) * 4)
  plan = plan_lib.ShardingPlan(mesh=mesh, context_impl=impl, rules=rules_lib.resolve_rules(
      dict(rules_lib.DEFAULT_RULES, **wt.LOGICAL_RULES), 'fsdp', mesh.axis_names),
                               sequence_names=wt.SEQUENCE_NAMES)
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, plan.params(state))
  out = np.asarray(jax.jit(plan.scope(lambda s: nnx.merge(graphdef, s)(x, t, ctx)))(state))
  err = float(np.abs(out - ref).max())
  print(f'{impl}: max abs diff vs one device {err:.2e}')
  assert err <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize('impl', ['ulysses', 'ring'])
def test_context_parallel_gradients_equal_one_device(diffusers_sd, impl):
  """The parameter gradients of a scalar of the output, with FSDP-sharded parameters and the video
  sequence split over 2 context devices (Ulysses or ring), equal the one-device gradients."""
  from jax.sharding import AxisType
  from ddrl_jax.parallel import plan as plan_lib
  from ddrl_jax.parallel import rules as rules_lib
  if len(jax.devices()) < 8:
    pytest.skip('needs the 8 fake CPU devices of tests/conftest.py')
  x, t, ctx = _inputs(7, (16, 2, 4, 6))
  weights = jnp.asarray(np.random.RandomState(3).randn(*x.shape), jnp.float32)
  graphdef, state = nnx.split(wc.merge_params(CFG, wc.from_diffusers_state_dict(diffusers_sd, CFG)))
  loss = lambda s: jnp.sum(nnx.merge(graphdef, s)(x, t, ctx) * weights)
  ref = jax.jit(jax.grad(loss))(state)
  mesh = jax.make_mesh((2, 2, 2, 1), ('data', 'fsdp', 'context', 'tensor'), devices=jax.devices()[:8],
                       axis_types=(AxisType.Auto,) * 4)
  plan = plan_lib.ShardingPlan(mesh=mesh, context_impl=impl, rules=rules_lib.resolve_rules(
      dict(rules_lib.DEFAULT_RULES, **wt.LOGICAL_RULES), 'fsdp', mesh.axis_names),
                               sequence_names=wt.SEQUENCE_NAMES)
  sharded = jax.device_put(state, plan.params(state))
  got = jax.jit(plan.scope(jax.grad(loss)))(sharded)
  errs = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), got, ref)
  scale = max(float(np.abs(np.asarray(a)).max()) for a in jax.tree.leaves(ref))
  worst = max(jax.tree.leaves(errs))
  print(f'{impl}: max abs gradient difference {worst:.2e} (largest gradient {scale:.2f})')
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5),
               got, ref)
