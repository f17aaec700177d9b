"""FLUX.1 transformer: parity with diffusers' `FluxTransformer2DModel` (fp32, CPU, every parameter re-randomized,
weights through a save_pretrained folder and our converter), RoPE tables, packing helpers against
FluxPipeline's static methods, FLUX.1-dev's parameter count, converter round trip and errors, scanned stacks
and remat, gradients, bf16 and LoRA, FLOPs.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddrl_jax.models.flux import convert
from ddrl_jax.models.flux import transformer as ft

torch = pytest.importorskip('torch')
tflux = pytest.importorskip('diffusers.models.transformers.transformer_flux')

B, L = 2, 7


def _config(**overrides):
  return ft.tiny(**{'remat_policy': 'none', **overrides})


def _diffusers_kwargs(cfg):
  kw = {f: getattr(cfg, f) for f in convert.ARCH_FIELDS}
  kw['axes_dims_rope'] = tuple(kw['axes_dims_rope'])
  return kw


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
  return _randomize(tflux.FluxTransformer2DModel(**_diffusers_kwargs(_config())).eval())


@pytest.fixture(scope='module')
def diffusers_folder(torch_model, tmp_path_factory):
  path = tmp_path_factory.mktemp('flux_tiny')
  torch_model.save_pretrained(str(path / 'transformer'))    # a pipeline folder's layout
  return path


@pytest.fixture(scope='module')
def diffusers_sd(torch_model):
  return {k: v.detach().numpy().copy() for k, v in torch_model.state_dict().items()}


@pytest.fixture(scope='module')
def jax_model(diffusers_folder):
  cfg = _config()
  return convert.model_from_pure(convert.load_diffusers(str(diffusers_folder), cfg), cfg)


def _jit(model, method='__call__'):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, *a: getattr(nnx.merge(graphdef, s), method)(*a)), state


def _inputs(h, w, seed, cfg=None):
  cfg = cfg or _config()
  rng = np.random.default_rng(seed)
  f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
  return (f32(B, cfg.latent_channels, h, w), rng.uniform(0, 1, (B,)).astype(np.float32),
          f32(B, L, cfg.joint_attention_dim), f32(B, cfg.pooled_projection_dim),
          rng.uniform(1, 5, (B,)).astype(np.float32))


def _reference(torch_model, x, t, text, pooled, guidance):
  """diffusers' forward as FluxPipeline calls it: packed latents, image/text ids, t and guidance unscaled."""
  pipe = pytest.importorskip('diffusers.pipelines.flux.pipeline_flux').FluxPipeline
  b, c, h, w = x.shape
  packed = pipe._pack_latents(torch.tensor(x), b, c, h, w)
  img_ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, 'cpu', torch.float32)
  with torch.no_grad():
    out = torch_model(hidden_states=packed, encoder_hidden_states=torch.tensor(text),
                      pooled_projections=torch.tensor(pooled), timestep=torch.tensor(t),
                      img_ids=img_ids, txt_ids=torch.tensor(ft.text_ids(text.shape[1])),
                      guidance=torch.tensor(guidance), return_dict=False)[0]
  return out.numpy(), pipe._unpack_latents(out, 8 * h, 8 * w, 8).numpy()


def _correctly_rounded_sinusoid(timesteps, embedding_dim, flip_sin_to_cos=False, downscale_freq_shift=1,
                                scale=1, max_period=10000):
  """diffusers' get_timestep_embedding for FLUX's Timesteps(256, True, 0) with `layers.timestep_frequencies`
  (correctly rounded) in place of torch's float32 exp, which is an ulp off on some frequencies on CPU."""
  from ddrl_jax.models import layers   # pylint: disable=g-import-not-at-top
  assert flip_sin_to_cos and downscale_freq_shift == 0 and scale == 1 and max_period == 10000
  arg = timesteps[:, None].float() * torch.tensor(layers.timestep_frequencies(embedding_dim))[None]
  return torch.cat([torch.cos(arg), torch.sin(arg)], dim=-1)


@pytest.mark.parametrize('hw', [(16, 16), (12, 20)])
def test_parity_with_diffusers(torch_model, jax_model, hw, monkeypatch):
  x, t, text, pooled, guidance = _inputs(*hw, seed=hw[1])
  ref_packed, ref = _reference(torch_model, x, t, text, pooled, guidance)
  fwd, state = _jit(jax_model)
  ours = np.asarray(fwd(state, x, t, text, pooled, guidance))
  assert ours.shape == ref.shape == x.shape
  scale = float(np.abs(ref).max())
  err = float(np.abs(ours - ref).max()) / scale
  # The same with the reference's sinusoid on correctly rounded frequencies (ours): what is left is
  # float32 round-off. (At guidance 5 the sinusoid's argument reaches 5000, where torch's one-ulp-off
  # frequencies move it by up to 2.4e-4.)
  monkeypatch.setattr(pytest.importorskip('diffusers.models.embeddings'), 'get_timestep_embedding',
                      _correctly_rounded_sinusoid)
  _, ref_exact = _reference(torch_model, x, t, text, pooled, guidance)
  err_exact = float(np.abs(ours - ref_exact).max()) / scale
  print(f'latent {hw}: max|ref| = {scale:.3f}, max abs diff / max|ref| = {err:.2e} '
        f'({err_exact:.2e} against correctly rounded timestep frequencies)')
  assert float(np.abs(ref).std()) > 0.1     # not a vacuous comparison
  assert err <= 1e-5
  assert err_exact <= 2e-6
  # The packed entry gives diffusers' packed output.
  graphdef, _ = nnx.split(jax_model)
  packed = jax.jit(lambda s, *a: nnx.merge(graphdef, s).forward_packed(
      a[0], (hw[0] // 2, hw[1] // 2), *a[1:]))(state, ft.pack_latents(x), t, text, pooled, guidance)
  assert float(np.abs(np.asarray(packed) - ref_packed).max()) <= 1e-5 * scale


def test_rope_tables_equal_diffusers(torch_model):
  cfg = _config()
  for h, w in ((4, 6), (8, 8)):
    ids = np.concatenate([ft.text_ids(L), ft.image_ids(h, w)])
    ref_cos, ref_sin = torch_model.pos_embed(torch.tensor(ids))
    cos, sin = ft.rope_cos_sin(cfg.axes_dims_rope, ids)
    # diffusers repeats each pair's cos / sin twice (repeat_interleave); ours holds one per pair.
    np.testing.assert_array_equal(np.repeat(cos, 2, axis=1), ref_cos.numpy())
    np.testing.assert_array_equal(np.repeat(sin, 2, axis=1), ref_sin.numpy())
    np.testing.assert_array_equal(cos[:L], 1)     # text ids 0: the identity rotation (skipped)
    np.testing.assert_array_equal(sin[:L], 0)


def test_pack_unpack_and_ids_equal_the_pipeline():
  pipe = pytest.importorskip('diffusers.pipelines.flux.pipeline_flux').FluxPipeline
  rng = np.random.default_rng(0)
  for c, h, w in ((16, 8, 12), (4, 6, 2)):
    x = rng.standard_normal((2, c, h, w)).astype(np.float32)
    packed = np.asarray(ft.pack_latents(jnp.asarray(x)))
    np.testing.assert_array_equal(packed, pipe._pack_latents(torch.tensor(x), 2, c, h, w).numpy())
    # feature c*4 + 2p + q of token (i, j) is x[c, 2i + p, 2j + q]: here c = 3, (i, j) = (1, 0), (p, q) = (1, 1)
    assert packed[1, 1 * (w // 2) + 0, 3 * 4 + 2 * 1 + 1] == x[1, 3, 3, 1]
    np.testing.assert_array_equal(np.asarray(ft.unpack_latents(jnp.asarray(packed), h, w)), x)
    np.testing.assert_array_equal(
        pipe._unpack_latents(torch.tensor(packed), 8 * h, 8 * w, 8).numpy(), x)
    np.testing.assert_array_equal(ft.image_ids(h // 2, w // 2),
                                  pipe._prepare_latent_image_ids(2, h // 2, w // 2, 'cpu', torch.float32).numpy())
  with pytest.raises(ValueError, match='even'):
    ft.pack_latents(jnp.zeros((1, 16, 5, 4)))


def test_flux1_dev_param_count_matches_diffusers():
  cfg = ft.flux1_dev()
  with torch.device('meta'):
    ref = tflux.FluxTransformer2DModel(**_diffusers_kwargs(cfg))
  ref_count = sum(p.numel() for p in ref.parameters())
  ours = ft.num_params(cfg)
  print(f'FLUX.1-dev parameters: ours {ours:,}, diffusers {ref_count:,}')
  assert ours == ref_count
  assert abs(ours / 11.9014e9 - 1) < 1e-4
  # Every diffusers key has exactly one counterpart of the right shape.
  shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
  ours_shapes = {}
  for path, leaf in convert.abstract_params(cfg).items():
    names, kind = convert.diffusers_names('/'.join(path), cfg)
    shape = tuple(leaf.shape[1:] if path[0] in convert.STACKS else leaf.shape)
    for name in names:
      ours_shapes[name] = shape[::-1] if kind == 'linear' else shape
  assert ours_shapes == shapes
  # [schnell]: no guidance embedder.
  schnell = ft.flux1_schnell()
  assert ft.num_params(schnell) == ours - sum(
      math.prod(v.shape) for k, v in ref.state_dict().items() if 'guidance_embedder' in k)


def test_round_trip_and_config_check(diffusers_sd, diffusers_folder):
  cfg = _config()
  pure = convert.from_diffusers_state_dict(diffusers_sd, cfg)
  back = convert.to_diffusers_state_dict(pure, cfg)
  assert back.keys() == diffusers_sd.keys()
  for k, v in diffusers_sd.items():
    assert back[k].shape == v.shape and back[k].dtype == v.dtype, k
    np.testing.assert_array_equal(back[k], v, err_msg=k)
  ours = nnx.to_pure_dict(nnx.state(ft.abstract_model(cfg), nnx.Param))
  assert jax.tree.structure(ours) == jax.tree.structure(pure)
  assert convert.num_diffusers_params(diffusers_sd) == ft.num_params(cfg)
  # A folder of another architecture is refused by its config.json, naming the fields.
  with pytest.raises(ValueError, match=r'num_single_layers: 2 in .*config.json, 3 configured'):
    convert.load_diffusers(str(diffusers_folder), _config(num_single_layers=3))
  with pytest.raises(ValueError, match='guidance_embeds'):
    convert.load_diffusers(str(diffusers_folder), _config(guidance_embeds=False))
  # The converter's nnx.State form (models.family.Converter.convert).
  state, naming = convert.state_from_diffusers(diffusers_sd, cfg)
  assert naming == 'diffusers'
  np.testing.assert_array_equal(nnx.to_pure_dict(state)['proj_out']['kernel'], diffusers_sd['proj_out.weight'].T)


def test_converter_reports_all_problems(diffusers_sd):
  cfg = _config()
  sd = dict(diffusers_sd)
  del sd['transformer_blocks.1.attn.add_k_proj.weight']
  del sd['single_transformer_blocks.0.norm.linear.bias']
  sd['transformer_blocks.0.some_new.weight'] = np.zeros((3, 3), np.float32)
  sd['single_transformer_blocks.2.proj_mlp.weight'] = np.zeros((128, 32), np.float32)   # only 2 blocks
  sd['proj_out.weight'] = np.zeros((5, 32), np.float32)
  with pytest.raises(ValueError) as info:
    convert.from_diffusers_state_dict(sd, cfg)
  msg = str(info.value)
  for part in ('missing (2)', 'transformer_blocks.1.attn.add_k_proj.weight',
               'single_transformer_blocks.0.norm.linear.bias', 'transformer_blocks.0.some_new.weight',
               'single_transformer_blocks.2.proj_mlp.weight', 'proj_out.weight: got (5, 32), expected (64, 32)'):
    assert part in msg, (part, msg)
  assert 'transformer_blocks.0.attn.add_k_proj.weight' not in msg
  pure = convert.from_diffusers_state_dict(diffusers_sd, cfg)
  pure['single_transformer_blocks']['proj_out']['kernel'] = np.zeros((3, 160, 32), np.float32)
  with pytest.raises(ValueError, match=r'single_transformer_blocks/proj_out/kernel: got \(3, 160, 32\), '
                                       r'expected \(2, 160, 32\)'):
    convert.to_diffusers_state_dict(pure, cfg)


def test_config_and_input_errors(jax_model):
  with pytest.raises(ValueError, match='axes_dims_rope'):
    ft.tiny(axes_dims_rope=(4, 4, 6))
  with pytest.raises(ValueError, match='patch_size'):
    ft.tiny(patch_size=2)
  x, t, text, pooled, guidance = _inputs(8, 8, seed=0)
  with pytest.raises(ValueError, match='guidance'):
    jax.eval_shape(lambda: jax_model(x, t, text, pooled))
  with pytest.raises(ValueError, match='x has 4 channels; this FLUX config takes 16'):
    jax.eval_shape(lambda: jax_model(x[:, :4], t, text, pooled, guidance))


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


def test_stacks_scan_remat_and_gradients(diffusers_sd):
  """Stacks scan (leading 'layers' axis, scans of both lengths); 'full' remat gives the loss and gradients
  of no remat; every gradient is finite and the guidance, text and single-block weights get some."""
  cfg = _config(num_layers=2, num_single_layers=3)
  state = jax.jit(lambda: nnx.state(ft.FluxTransformer(cfg, rngs=nnx.Rngs(3))))()
  pure = nnx.to_pure_dict(nnx.state(state, nnx.Param))
  assert pure['transformer_blocks']['norm1']['linear']['kernel'].shape == (2, 32, 6 * 32)
  assert pure['single_transformer_blocks']['proj_out']['kernel'].shape == (3, 5 * 32, 32)
  assert 'to_out' not in pure['single_transformer_blocks']['attn']
  abstract_state = nnx.state(ft.abstract_model(cfg))
  specs = nnx.get_partition_spec(abstract_state)
  assert tuple(specs['single_transformer_blocks']['proj_mlp']['kernel'].get_value()) == ('layers', 'embed', 'mlp')
  from ddrl_jax.parallel import rules   # pylint: disable=g-import-not-at-top
  leaves = rules.logical_names(nnx.state(abstract_state, nnx.Param))
  assert all(logical for _, logical, _ in leaves)        # every parameter carries logical names
  names = {n for _, logical, _ in leaves for n in logical if n}
  assert names <= set(ft.LOGICAL_RULES), names - set(ft.LOGICAL_RULES)

  args = tuple(jnp.asarray(a[:1]) for a in _inputs(8, 12, seed=4, cfg=cfg))
  outs = {}
  for policy in ('none', 'full'):
    graphdef = nnx.graphdef(ft.abstract_model(_config(num_layers=2, num_single_layers=3, remat_policy=policy)))
    loss_fn = lambda s: jnp.mean(nnx.merge(graphdef, s)(*args) ** 2)
    if policy == 'none':
      lengths = _scan_lengths(jax.make_jaxpr(loss_fn)(state).jaxpr)
      assert 2 in lengths and 3 in lengths, lengths
    outs[policy] = jax.jit(jax.value_and_grad(loss_fn))(state)
  np.testing.assert_allclose(outs['full'][0], outs['none'][0], rtol=1e-6)
  for g, r in zip(jax.tree.leaves(outs['full'][1]), jax.tree.leaves(outs['none'][1])):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
  g = nnx.to_pure_dict(outs['none'][1])
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))
  for path in (('time_text_embed', 'guidance_embedder', 'linear_1', 'kernel'),
               ('transformer_blocks', 'attn', 'add_k_proj', 'kernel'),
               ('single_transformer_blocks', 'proj_out', 'kernel'), ('context_embedder', 'kernel')):
    leaf = g
    for k in path:
      leaf = leaf[k]
    assert float(jnp.abs(leaf).max()) > 0, path


def test_lora_attaches_and_bf16_runs(diffusers_sd, jax_model):
  from ddrl_jax.models import lora   # pylint: disable=g-import-not-at-top
  cfg = _config()
  pure = convert.from_diffusers_state_dict(diffusers_sd, cfg)
  x, t, text, pooled, guidance = (a[:1] for a in _inputs(8, 8, seed=5))
  fwd, state = _jit(jax_model)
  base = np.asarray(fwd(state, x, t, text, pooled, guidance))
  model = convert.model_from_pure(pure, cfg)
  spec = lora.LoRAConfig(rank=4, alpha=4.0, targets=(r'.*\.attn\.(to_q|to_k|to_v|to_out|add_[qkv]_proj|to_add_out)',
                                                     r'.*single_transformer_blocks\.(proj_mlp|proj_out)'))
  paths = lora.attach(model, spec, jax.random.key(0))
  assert 'transformer_blocks.attn.add_q_proj' in paths and 'single_transformer_blocks.proj_out' in paths
  assert model.single_transformer_blocks.proj_out.lora_a.shape == (2, 160, 4)
  fwd_lora, state_lora = _jit(model)
  np.testing.assert_array_equal(np.asarray(fwd_lora(state_lora, x, t, text, pooled, guidance)), base)

  # bf16 compute on float32 parameters: `layers.compute_cast_fn` casts the matmul weights of attention,
  # MLPs and the embedders, not the float32 islands (adaLN, time/pooled embedding, proj_out).
  from ddrl_jax.models import layers   # pylint: disable=g-import-not-at-top
  bf16 = _config(dtype=jnp.bfloat16)
  cast = layers.compute_cast_fn(ft.abstract_model(bf16))(pure)
  assert cast['single_transformer_blocks']['proj_out']['kernel'].dtype == jnp.bfloat16
  assert cast['transformer_blocks']['attn']['add_q_proj']['bias'].dtype == jnp.bfloat16
  assert cast['x_embedder']['kernel'].dtype == cast['context_embedder']['kernel'].dtype == jnp.bfloat16
  assert cast['transformer_blocks']['norm1']['linear']['kernel'].dtype == np.float32
  assert cast['time_text_embed']['guidance_embedder']['linear_1']['kernel'].dtype == np.float32
  assert cast['proj_out']['kernel'].dtype == np.float32
  fwd16, state16 = _jit(convert.model_from_pure(pure, bf16))
  out16 = np.asarray(fwd16(state16, x, t, text, pooled, guidance)).astype(np.float32)
  assert np.isfinite(out16).all()
  assert float(np.abs(out16 - base).max()) < 0.1 * float(np.abs(base).max())


def test_forward_flops_match_kernel_sizes():
  cfg = ft.flux1_dev()
  s, parts = ft.forward_flops(cfg, (128, 128), 512)
  assert s == 4096
  macs = 0
  for path, leaf in convert.abstract_params(cfg).items():
    if path[0] in convert.STACKS and path[-1] == 'kernel' and 'norm' not in path[1]:
      macs += math.prod(leaf.shape) * (s + 512) // (2 if path[0] == 'transformer_blocks' else 1)
  assert parts['linear'] == 2 * macs
  assert parts['attention'] == 2 * 57 * 2 * (s + 512) ** 2 * 3072
  n = ft.num_params(cfg)
  # The adaLN weights (27% of the parameters) act once per sample, and a double block's image and text
  # weights (half of its others each) act on S or L tokens: the matmuls are ~0.54 x 2 N (S + L).
  assert 0.5 * n * (s + 512) < (sum(parts.values()) - parts['attention']) / 2 < 0.6 * n * (s + 512)
