"""Cosmos DiT: parity with diffusers' `CosmosTransformer3DModel` (fp32, CPU), parameter counts,
converter errors and scanned (depth-flat) compilation.

How the diffusers call is made apples to apples with the ORIGINAL Cosmos-Predict2.5 net:
- Patchify/unpatchify orderings of diffusers 0.42 equal the original ones (channel-major patch features
  in, (ph, pw, pt, C) features out), so x and the outputs are compared unchanged.
- Timesteps: the original net receives 1000*t and multiplies by 0.001; diffusers' transformer embeds
  its `timestep` as given. Both are fed the same per-frame t in [0, 1] (diffusers as (B, 1, T, 1, 1)).
  For image-to-video the conditioning frame gets t = 1e-4, the original `conditional_frame_timestep=0.1`
  on the 0-1000 scale (the diffusers 2.5 pipeline would pass 0.1 unscaled; we do not use its pipeline).
- QK RMSNorm eps: the original uses 1e-6, diffusers' `Attention` defaults to 1e-5; the diffusers
  modules' eps are set to 1e-6 before the comparison.
- Conditioning: frame replacement (`frame_replace`) and velocity replacement (`replace_cond_velocity`)
  are done outside both nets, exactly as the original model class does; diffusers gets the same
  x_in and `condition_mask` (its in_channels = 16 + 1).
- Padding mask: diffusers resizes it with torchvision, which is not importable beside this torch; the
  test swaps in a nearest resize through torch.nn.functional.interpolate (same index rule, floor(i*in/out)).
  diffusers repeats the mask over the batch, so it is passed with batch 1 to both models.
"""
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cosmos_names  # tests/cosmos_names.py
from flax import nnx

from ddrl_jax.models.cosmos import convert as cosmos_convert
from ddrl_jax.models.cosmos import dit as cd

torch = pytest.importorskip('torch')
tc = pytest.importorskip('diffusers.models.transformers.transformer_cosmos')

HEADS, HEAD_DIM, LAYERS, LORA, CROSS_IN, CTX = 2, 32, 2, 8, 32, 16
B, L, H, W = 2, 5, 4, 6


def _config(**overrides):
  kw = dict(model_channels=HEADS * HEAD_DIM, num_blocks=LAYERS, num_heads=HEADS, adaln_lora_dim=LORA,
            crossattn_in=CROSS_IN, context_dim=CTX, remat_policy='none')
  kw.update(overrides)
  return cd.tiny(**kw)


def _nearest_resize(img, size, interpolation=None):
  return torch.nn.functional.interpolate(img, size=tuple(size), mode='nearest')


@pytest.fixture(scope='module')
def torch_model():
  """A tiny diffusers Cosmos-2.5 transformer with random weights and original-Cosmos qk-norm eps."""
  torch.manual_seed(0)
  model = tc.CosmosTransformer3DModel(
      in_channels=17, out_channels=16, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
      num_layers=LAYERS, mlp_ratio=4.0, text_embed_dim=CTX, adaln_lora_dim=LORA, max_size=(16, 32, 32),
      patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=True,
      extra_pos_embed_type=None, use_crossattn_projection=True, crossattn_proj_in_channels=CROSS_IN,
      encoder_hidden_states_channels=CTX).eval()
  return cosmos_names.randomize_cosmos_torch(model)


@pytest.fixture(scope='module')
def diffusers_sd(torch_model):
  return {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}


@pytest.fixture(scope='module')
def jax_forward(diffusers_sd):
  config = _config()
  model = cosmos_convert.merge_params(config, cosmos_convert.convert_diffusers_state_dict(diffusers_sd, config))
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, *args: nnx.merge(graphdef, s)(*args)), state


def _torch_forward(model, x, t, ctx, cond_mask, padding_mask, monkeypatch):
  fake = types.SimpleNamespace(functional=types.SimpleNamespace(resize=_nearest_resize),
                               InterpolationMode=types.SimpleNamespace(NEAREST='nearest'))
  monkeypatch.setattr(tc, 'transforms', fake, raising=False)
  with torch.no_grad():
    out = model(torch.tensor(x), torch.tensor(t)[:, None, :, None, None], torch.tensor(ctx),
                condition_mask=torch.tensor(cond_mask), padding_mask=torch.tensor(padding_mask),
                return_dict=False)[0]
  return out.numpy()


@pytest.mark.parametrize('num_frames', [1, 2, 3])
@pytest.mark.parametrize('num_cond', [0, 1])
def test_parity_with_diffusers(torch_model, jax_forward, num_frames, num_cond, monkeypatch):
  rng = np.random.default_rng(num_frames * 10 + num_cond)
  f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
  x_t, gt, noise = f32(B, 16, num_frames, H, W), f32(B, 16, num_frames, H, W), f32(B, 16, num_frames, H, W)
  ctx = f32(B, L, CROSS_IN)
  padding_mask = (rng.random((1, 1, 2 * H, 2 * W)) > 0.7).astype(np.float32)
  t = rng.uniform(0.05, 1.0, (B, 1)).repeat(num_frames, 1).astype(np.float32)
  x_in, cond_mask = cd.frame_replace(jnp.asarray(x_t), jnp.asarray(gt), num_cond)
  t = np.where(np.arange(num_frames)[None] < num_cond, 1e-4, t).astype(np.float32)
  x_in, cond_mask = np.asarray(x_in), np.asarray(cond_mask)

  fwd, state = jax_forward
  ours = np.asarray(fwd(state, x_in, t, ctx, cond_mask, padding_mask))
  ref = _torch_forward(torch_model, x_in, t, ctx, cond_mask, padding_mask, monkeypatch)
  scale = max(1.0, float(np.abs(ref).max()))
  err = float(np.abs(ours - ref).max())
  print(f'T={num_frames} k={num_cond} max|ref|={np.abs(ref).max():.3f} max abs err={err:.2e}')
  assert err <= 1e-4 * scale
  v_ours = cd.replace_cond_velocity(ours, noise, gt, cond_mask)
  v_ref = cd.replace_cond_velocity(ref, noise, gt, cond_mask)
  np.testing.assert_allclose(np.asarray(v_ours), np.asarray(v_ref), atol=1e-4 * scale)
  if num_cond:
    np.testing.assert_allclose(np.asarray(v_ours)[:, :, :num_cond], (noise - gt)[:, :, :num_cond])


def test_original_checkpoint_names_convert_identically(diffusers_sd):
  config = _config()
  ref = cosmos_convert.convert_diffusers_state_dict(diffusers_sd, config)
  sd = {cosmos_names.to_cosmos_name(k): v for k, v in diffusers_sd.items()}
  sd.update({'net.accum_iteration': np.zeros(()), 'net.pos_embedder.seq': np.arange(4.0),
             'net.blocks.0.self_attn.q_proj._extra_state': np.zeros(1)})
  ours = cosmos_convert.convert_cosmos_state_dict(sd, config)
  flat_ref = dict(nnx.to_flat_state(ref))
  for path, var in nnx.to_flat_state(ours):
    np.testing.assert_array_equal(var.get_value(), flat_ref[path].get_value())


def test_converter_reports_all_problems(diffusers_sd):
  sd = dict(diffusers_sd)
  del sd['transformer_blocks.1.attn2.to_k.weight']
  sd['transformer_blocks.0.some_new.weight'] = np.zeros((3, 3), np.float32)
  sd['proj_out.weight'] = np.zeros((5, 64), np.float32)
  with pytest.raises(ValueError) as info:
    cosmos_convert.convert_diffusers_state_dict(sd, _config())
  msg = str(info.value)
  assert 'blocks/cross_attn/k_proj/kernel for blocks [1]' in msg
  assert 'transformer_blocks.0.some_new.weight' in msg
  assert 'proj_out.weight: got (5, 64)' in msg


def _param_count(config):
  _, flat = cosmos_convert.abstract_params(config)
  return sum(math.prod(v.shape) for v in flat.values())


def test_param_counts_of_presets():
  n2b, n14b = _param_count(cd.cosmos2b()), _param_count(cd.cosmos14b())
  assert abs(n2b / 2.059e9 - 1) < 0.01, n2b
  assert abs(n14b / 14.37e9 - 1) < 0.01, n14b


def _sub_jaxprs(params):
  for p in params.values():
    for sub in p if isinstance(p, (list, tuple)) else [p]:
      if hasattr(sub, 'eqns'):
        yield sub
      elif hasattr(getattr(sub, 'jaxpr', None), 'eqns'):
        yield sub.jaxpr


def _scan_lengths(jaxpr):
  """Lengths of every scan primitive in a jaxpr, recursively."""
  lengths = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'scan':
      lengths.append(eqn.params['length'])
    for sub in _sub_jaxprs(eqn.params):
      lengths += _scan_lengths(sub)
  return lengths


@pytest.mark.parametrize('depth', [2, 4])
def test_blocks_are_scanned(depth):
  config = _config(num_blocks=depth, remat_policy='full')
  graphdef, state = nnx.split(cd.CosmosDiT(config, rngs=nnx.Rngs(0)))
  fwd = lambda s, x, t, c: nnx.merge(graphdef, s)(x, t, c)
  args = (jnp.zeros((1, 16, 2, H, W)), jnp.full((1, 2), 0.5), jnp.zeros((1, L, CROSS_IN)))
  assert depth in _scan_lengths(jax.make_jaxpr(fwd)(state, *args).jaxpr)
  if depth == 2:  # one compile of forward + backward through the scanned, rematerialised blocks
    loss, grads = jax.jit(jax.value_and_grad(lambda s: jnp.mean(fwd(s, *args) ** 2)))(state)
    assert bool(jnp.isfinite(loss))
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  specs = nnx.get_partition_spec(state)
  assert tuple(specs['blocks']['mlp']['layer1']['kernel'].get_value()) == ('layers', 'embed', 'mlp')


def test_remat_does_not_change_output_and_projected_context_path():
  args = (jnp.ones((1, 16, 2, H, W)), jnp.full((1, 2), 0.5))
  outs = [cd.CosmosDiT(_config(remat_policy=p), rngs=nnx.Rngs(3))(*args, jnp.ones((1, L, CROSS_IN)))
          for p in ('none', 'full')]
  np.testing.assert_allclose(outs[0], outs[1], atol=1e-6)
  model = cd.CosmosDiT(_config(crossattn_in=None), rngs=nnx.Rngs(3))
  assert model.crossattn_proj is None
  assert model(*args, jnp.ones((1, L, CTX))).shape == (1, 16, 2, H, W)


def test_bf16_forward_runs():
  config = _config(dtype=jnp.bfloat16, remat_policy='dots')
  model = cd.CosmosDiT(config, rngs=nnx.Rngs(1))
  x = jnp.ones((1, 16, 2, H, W), jnp.bfloat16)
  out = nnx.jit(lambda m, x: m(x, jnp.full((1, 2), 0.3), jnp.ones((1, L, CROSS_IN))))(model, x)
  assert out.dtype == jnp.bfloat16 and bool(jnp.isfinite(out.astype(jnp.float32)).all())


def test_extra_learnable_positions_match_diffusers(monkeypatch):
  """`extra_pos_embed` (Cosmos' extra_per_block_abs_pos_emb) against diffusers' 'learnable' type."""
  torch.manual_seed(1)
  model = tc.CosmosTransformer3DModel(
      in_channels=17, out_channels=16, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
      num_layers=LAYERS, mlp_ratio=4.0, text_embed_dim=CTX, adaln_lora_dim=LORA, max_size=(16, 32, 32),
      patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=True,
      extra_pos_embed_type='learnable', use_crossattn_projection=True, crossattn_proj_in_channels=CROSS_IN,
      encoder_hidden_states_channels=CTX).eval()
  model = cosmos_names.randomize_cosmos_torch(model)
  sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  assert any('pos_emb_h' in k for k in sd)
  config = _config(extra_pos_embed=True, extra_pos_max_size=(16, 16, 16))
  ours_model = cosmos_convert.merge_params(config, cosmos_convert.convert_diffusers_state_dict(sd, config))
  rng = np.random.default_rng(7)
  x = rng.standard_normal((B, 16, 2, H, W)).astype(np.float32)
  t = rng.uniform(0.05, 1.0, (B, 2)).astype(np.float32)
  ctx = rng.standard_normal((B, L, CROSS_IN)).astype(np.float32)
  cond = np.zeros((B, 1, 2, H, W), np.float32)
  pad = np.zeros((1, 1, 2 * H, 2 * W), np.float32)
  ours = np.asarray(ours_model(jnp.asarray(x), jnp.asarray(t), jnp.asarray(ctx), jnp.asarray(cond),
                               jnp.asarray(pad)))
  ref = _torch_forward(model, x, t, ctx, cond, pad, monkeypatch)
  np.testing.assert_allclose(ours, ref, atol=1e-4 * max(1.0, float(np.abs(ref).max())))
  # Without the table the output changes: the positions are used.
  no_pos = _config()
  plain = cosmos_convert.merge_params(no_pos, cosmos_convert.convert_diffusers_state_dict(
      {k: v for k, v in sd.items() if 'pos_emb' not in k}, no_pos))
  other = np.asarray(plain(jnp.asarray(x), jnp.asarray(t), jnp.asarray(ctx), jnp.asarray(cond),
                           jnp.asarray(pad)))
  assert np.abs(other - ref).max() > 1e-2
  with pytest.raises(ValueError, match='extra_pos_max_size'):
    cd.LearnablePosEmbAxis(_config(extra_pos_embed=True, extra_pos_max_size=(1, 2, 2)), nnx.Rngs(0))(1, 3, 2)


# ----------------------------------------------------------------------- the speed rewrites (issue 13)
def test_gelu_is_the_exact_gelu_in_float64():
  """cd.gelu (erf form) against 0.5 x (1 + erf(x / sqrt 2)) in float64, and its gradient against
  Phi(x) + x phi(x); across the tails where the erfc form and the erf form differ most."""
  x = np.linspace(-10, 10, 4001)
  want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
  dwant = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) + v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi)
                    for v in x])
  xs = jnp.asarray(x, jnp.float32)
  np.testing.assert_allclose(np.asarray(cd.gelu(xs)), want, atol=2e-6, rtol=2e-6)
  np.testing.assert_allclose(np.asarray(jax.vmap(jax.grad(cd.gelu))(xs)), dwant, atol=2e-6, rtol=2e-6)
  xb = jnp.asarray(x, jnp.bfloat16)      # bf16 in and out, computed in float32 (no cancellation)
  want_b = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in np.asarray(xb, np.float64)])
  assert cd.gelu(xb).dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(cd.gelu(xb), np.float64), want_b, rtol=8e-3, atol=1e-6)


def test_token_linear_equals_a_dense_layer_over_every_leading_axis():
  """TokenLinear's output and kernel/bias gradients equal an einsum over the unflattened axes."""
  layer = cd.TokenLinear(8, 5, use_bias=True, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 3, 4, 8))
  kernel, bias = layer.kernel[...], jax.random.normal(jax.random.key(2), (5,))
  layer.bias[...] = bias
  np.testing.assert_allclose(layer(x), jnp.einsum('abcd,de->abce', x, kernel) + bias, rtol=1e-6, atol=1e-6)
  dy = jax.random.normal(jax.random.key(3), (2, 3, 4, 5))
  gdef, state = nnx.split(layer)
  grads = jax.grad(lambda s: jnp.sum(nnx.merge(gdef, s)(x) * dy))(state)
  np.testing.assert_allclose(grads['kernel'][...], jnp.einsum('abcd,abce->de', x, dy), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grads['bias'][...], dy.sum((0, 1, 2)), rtol=1e-5, atol=1e-5)
