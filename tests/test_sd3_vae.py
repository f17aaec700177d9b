"""The SD3.5 VAE, `models.autoencoder_kl.AutoencoderKL` (Flax NNX), vs diffusers AutoencoderKL at a tiny
SD3-style config (16 latent channels, no quant convs, mid-block attention), every parameter re-randomized,
in float32."""
import json

import numpy as np
import pytest

torch = pytest.importorskip('torch')
diffusers = pytest.importorskip('diffusers')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from ddrl_jax.models import autoencoder_kl  # noqa: E402
from ddrl_jax.models import autoencoder_kl_convert as vae_convert  # noqa: E402

# 3 blocks (two down/up samplings, 4x), 2 ResNets per down block: widths 8 -> 16 (a conv_shortcut) -> 16
CFG = autoencoder_kl.tiny(block_out_channels=(8, 16, 16), layers_per_block=2, norm_num_groups=4)
SIZES = [(16, 16), pytest.param((24, 40), marks=pytest.mark.slow)]   # the second size: slow tier
TOL = 1e-5

# The SD3 / SD3.5 vae/config.json (stabilityai/stable-diffusion-3.5-medium), as diffusers reads it.
SD35_CONFIG = dict(
    _class_name='AutoencoderKL', act_fn='silu', block_out_channels=[128, 256, 512, 512],
    down_block_types=['DownEncoderBlock2D'] * 4, force_upcast=True, in_channels=3, latent_channels=16,
    latents_mean=None, latents_std=None, layers_per_block=2, mid_block_add_attention=True, norm_num_groups=32,
    out_channels=3, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
    up_block_types=['UpDecoderBlock2D'] * 4, use_post_quant_conv=False, use_quant_conv=False)
# FLUX.1-dev's (and -schnell's) vae/config.json: the same but for its latent scaling.
FLUX1_CONFIG = dict(SD35_CONFIG, scaling_factor=0.3611, shift_factor=0.1159)


def _diffusers_kwargs(cfg):
  n = len(cfg.block_out_channels)
  return dict(in_channels=cfg.in_channels, out_channels=cfg.out_channels, latent_channels=cfg.latent_channels,
              block_out_channels=list(cfg.block_out_channels), layers_per_block=cfg.layers_per_block,
              norm_num_groups=cfg.norm_num_groups, down_block_types=['DownEncoderBlock2D'] * n,
              up_block_types=['UpDecoderBlock2D'] * n, scaling_factor=cfg.scaling_factor,
              shift_factor=cfg.shift_factor, use_quant_conv=cfg.use_quant_conv,
              use_post_quant_conv=cfg.use_post_quant_conv, mid_block_add_attention=cfg.mid_block_add_attention)


def _randomize(module, seed):
  """Every parameter redrawn: weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2), norm scales ~ 1 + N(0, 0.2^2)."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      if p.ndim > 1:
        p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(np.prod(p.shape[1:])))
      elif 'norm' in name and name.endswith('weight'):
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
      else:
        p.copy_(0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope='module')
def pair():
  """(diffusers model, converted AutoencoderKL, numpy state dict)."""
  ref = diffusers.AutoencoderKL(**_diffusers_kwargs(CFG)).eval()
  _randomize(ref, 0)
  sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
  model = vae_convert.merge_params(CFG, vae_convert.from_diffusers_state_dict(sd, CFG))
  return ref, model, sd


@nnx.jit
def _encode(model, images, key):
  """(posterior mean, logvar, encode(images), encode(images, key)): one compile per image size."""
  return (*model.posterior(images), model.encode(images), model.encode(images, key=key))


@nnx.jit
def _decode(model, latents):
  return model.decode(latents)


def _max_err(a, b):
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.parametrize('size', SIZES)
def test_encode_matches_diffusers(pair, size):
  ref, model, _ = pair
  h, w = size
  images = torch.rand(2, 3, h, w, generator=torch.Generator().manual_seed(h)) * 2 - 1
  with torch.no_grad():
    dist = ref.encode(images).latent_dist
  mean, logvar, mode, _ = _encode(model, jnp.asarray(images.numpy()), jax.random.key(0))
  s = CFG.spatial_factor
  assert mean.shape == logvar.shape == (2, 16, h // s, w // s) == tuple(dist.mean.shape)
  err_mean, err_logvar = _max_err(mean, dist.mean.numpy()), _max_err(logvar, dist.logvar.numpy())
  print(f'encode {size}: max |mean diff| {err_mean:.2e}, max |logvar diff| {err_logvar:.2e}, '
        f'max |mean| {np.abs(dist.mean.numpy()).max():.2f}')
  assert err_mean <= TOL and err_logvar <= TOL
  np.testing.assert_array_equal(mode, mean)


@pytest.mark.parametrize('size', SIZES)
def test_decode_matches_diffusers(pair, size):
  ref, model, _ = pair
  s = CFG.spatial_factor
  h, w = size[0] // s, size[1] // s
  latents = torch.randn(2, 16, h, w, generator=torch.Generator().manual_seed(10 + h))
  with torch.no_grad():
    want = ref.decode(latents).sample.numpy()
  got = _decode(model, jnp.asarray(latents.numpy()))
  assert got.shape == want.shape == (2, 3, *size)
  err = _max_err(got, want)
  print(f'decode {size}: max |diff| {err:.2e}, max |out| {np.abs(want).max():.2f}')
  assert err <= TOL


def test_sample_is_mean_plus_std_noise(pair):
  _, model, _ = pair
  images = jnp.asarray(np.random.RandomState(0).uniform(-1, 1, (2, 3, 16, 16)), jnp.float32)
  key = jax.random.key(3)
  mean, logvar, _, z = _encode(model, images, key)
  eps = jax.random.normal(key, mean.shape, jnp.float32)
  np.testing.assert_allclose(z, mean + jnp.exp(0.5 * logvar) * eps, rtol=1e-6, atol=1e-6)
  assert not np.allclose(z, _encode(model, images, jax.random.key(4))[3])
  assert float(jnp.min(logvar)) >= -30.0 and float(jnp.max(logvar)) <= 20.0


def test_latent_normalization_matches_diffusers_convention():
  """SD3 pipelines: (mean - shift_factor) * scaling_factor in, latents / scaling_factor + shift_factor out."""
  cfg = autoencoder_kl.sd35()
  assert (cfg.scaling_factor, cfg.shift_factor) == (1.5305, 0.0609)
  model = autoencoder_kl.abstract_model(cfg)
  mu = np.random.RandomState(1).randn(2, 16, 3, 5).astype(np.float32)
  z = model.normalize_latents(jnp.asarray(mu))
  want = (torch.from_numpy(mu) - SD35_CONFIG['shift_factor']) * SD35_CONFIG['scaling_factor']
  np.testing.assert_allclose(z, want.numpy(), rtol=1e-6, atol=1e-6)
  back = (want / SD35_CONFIG['scaling_factor']) + SD35_CONFIG['shift_factor']   # the pipeline's decode path
  np.testing.assert_allclose(model.denormalize_latents(z), back.numpy(), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(model.denormalize_latents(z), mu, rtol=1e-5, atol=1e-6)


def test_sd35_parameter_count_equals_diffusers():
  """The released config, built by diffusers on the meta device: 83,819,683 parameters."""
  cfg = vae_convert.config_from_diffusers(SD35_CONFIG)
  assert cfg == autoencoder_kl.sd35()
  with torch.device('meta'):
    ref = diffusers.AutoencoderKL.from_config(SD35_CONFIG)
  want = sum(p.numel() for p in ref.parameters())
  assert autoencoder_kl.num_params(cfg) == want == 83_819_683
  _, expected = vae_convert.abstract_params(cfg)
  assert len(expected) == len(ref.state_dict())    # one NNX leaf per diffusers tensor


def test_flux1_preset_is_the_flux_vae_config():
  """The shared class's FLUX.1 preset is what its converter reads from FLUX.1's vae/config.json."""
  cfg = autoencoder_kl.flux1()
  assert vae_convert.config_from_diffusers(FLUX1_CONFIG) == cfg
  assert (cfg.latent_channels, cfg.scaling_factor, cfg.shift_factor) == (16, 0.3611, 0.1159)


def test_parameters_carry_logical_names():
  state = nnx.state(autoencoder_kl.abstract_model(CFG), nnx.Param)
  for path, v in nnx.to_flat_state(state):
    names = nnx.spmd.get_var_pspec(v)
    assert names is not None and len(names) == v.get_value().ndim, path
    assert set(names) <= {None, 'conv_in', 'conv_out', 'norm'}, (path, names)


def test_converter_returns_the_models_pure_dict_structure(pair):
  _, model, sd = pair
  params = vae_convert.from_diffusers_state_dict(sd, CFG)
  want = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert jax.tree.structure(params) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  k = params['encoder']['down_blocks'][0]['downsampler']['kernel']
  np.testing.assert_array_equal(k, sd['encoder.down_blocks.0.downsamplers.0.conv.weight'].transpose(2, 3, 1, 0))


def test_converter_reports_all_problems_at_once(pair):
  _, _, sd = pair
  bad = dict(sd)
  del bad['decoder.conv_out.bias']
  bad['encoder.not_a_layer.weight'] = np.zeros((3,), np.float32)
  bad['encoder.conv_in.weight'] = np.zeros((8, 3, 3, 1), np.float32)
  with pytest.raises(ValueError) as err:
    vae_convert.from_diffusers_state_dict(bad, CFG)
  msg = str(err.value)
  assert 'missing (1)' in msg and 'decoder/conv_out/bias' in msg
  assert 'unexpected (1)' in msg and 'encoder.not_a_layer.weight' in msg
  assert 'mis-shaped (1)' in msg and 'encoder.conv_in.weight' in msg


def test_load_diffusers_folder(pair, tmp_path):
  """A pipeline-style folder (<root>/vae/) written by diffusers' save_pretrained loads to the same params."""
  ref, model, _ = pair
  ref.save_pretrained(str(tmp_path / 'vae'), safe_serialization=True)
  with open(tmp_path / 'vae' / 'config.json') as f:
    assert json.load(f)['use_quant_conv'] is False
  cfg, params = vae_convert.load_diffusers_folder(str(tmp_path))
  assert cfg == CFG
  want = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert jax.tree.structure(params) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  loaded = vae_convert.load_model(str(tmp_path / 'vae'), param_dtype=jnp.bfloat16)
  assert loaded.decoder.conv_out.kernel[...].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match='config.json'):
    vae_convert.load_diffusers_folder(str(tmp_path / 'nowhere'))


@pytest.mark.slow
def test_other_autoencoderkl_switches_match_diffusers():
  """quant_conv / post_quant_conv on and the mid-block attention off (SD1.x/SDXL/FLUX-style switches)."""
  cfg = autoencoder_kl.tiny(block_out_channels=(8, 16), latent_channels=4, use_quant_conv=True,
                     use_post_quant_conv=True, mid_block_add_attention=False)
  ref = diffusers.AutoencoderKL(**_diffusers_kwargs(cfg)).eval()
  _randomize(ref, 1)
  sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
  model = vae_convert.merge_params(cfg, vae_convert.from_diffusers_state_dict(sd, cfg))
  images = torch.rand(1, 3, 8, 12, generator=torch.Generator().manual_seed(5)) * 2 - 1
  with torch.no_grad():
    dist = ref.encode(images).latent_dist
    want = ref.decode(dist.mean).sample.numpy()

  @nnx.jit
  def run(m, x):
    mean, logvar = m.posterior(x)
    return mean, logvar, m.decode(mean)

  mean, logvar, got = run(model, jnp.asarray(images.numpy()))
  assert _max_err(mean, dist.mean.numpy()) <= TOL and _max_err(logvar, dist.logvar.numpy()) <= TOL
  assert _max_err(got, want) <= TOL
