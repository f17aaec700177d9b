"""WanVAE (Flax NNX) vs diffusers AutoencoderKLWan at a tiny random config, in float32."""
import numpy as np
import pytest

torch = pytest.importorskip('torch')
diffusers = pytest.importorskip('diffusers')

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from ddrl_jax.models import video_vae as wan_vae  # noqa: E402
from ddrl_jax.models.video_vae_convert import convert_diffusers_vae_state_dict, merge_params  # noqa: E402

CFG = wan_vae.tiny()  # base_dim 8, dim_mult (1,2,2,2), 1 res block, z_dim 4: 8x8 spatial, 4x temporal
H, W = 16, 24


@pytest.fixture(scope='module')
def pair():
  """(diffusers model, converted WanVAE, numpy state dict); gammas randomised so norms are tested."""
  torch.manual_seed(0)
  ref = diffusers.AutoencoderKLWan(
      base_dim=CFG.base_dim, z_dim=CFG.z_dim, dim_mult=list(CFG.dim_mult),
      num_res_blocks=CFG.num_res_blocks, temperal_downsample=list(CFG.temperal_downsample),
      latents_mean=list(CFG.latents_mean), latents_std=list(CFG.latents_std)).eval()
  with torch.no_grad():
    for name, p in ref.named_parameters():
      if name.endswith('gamma'):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
  sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
  model = merge_params(CFG, convert_diffusers_vae_state_dict(sd, CFG))
  return ref, model, sd


@nnx.jit(static_argnames=('chunked', 'chunk_frames'))
def _encode(model, video, chunked=True, chunk_frames=4):
  return model.encode(video, chunked=chunked, chunk_frames=chunk_frames)


@nnx.jit(static_argnames='chunked')
def _decode(model, latent, chunked=True):
  return model.decode(latent, chunked=chunked)


def _max_err(a, b):
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.parametrize('frames', [1, 5, 9])
def test_encode_matches_diffusers(pair, frames):
  ref, model, _ = pair
  video = torch.rand(2, 3, frames, H, W, generator=torch.Generator().manual_seed(frames)) * 2 - 1
  with torch.no_grad():
    want = ref.encode(video).latent_dist.mean.numpy()
  got = _encode(model, jnp.asarray(video.numpy()))
  assert got.shape == (2, CFG.z_dim, 1 + (frames - 1) // 4, H // 8, W // 8) == want.shape
  assert _max_err(got, want) < 1e-4 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize('frames', [1, 5, 9])
def test_decode_matches_diffusers(pair, frames):
  ref, model, _ = pair
  t = 1 + (frames - 1) // 4
  latent = 0.5 * torch.randn(2, CFG.z_dim, t, H // 8, W // 8, generator=torch.Generator().manual_seed(10 + t))
  with torch.no_grad():
    want = ref.decode(latent).sample.numpy()
  got = _decode(model, jnp.asarray(latent.numpy()))
  assert got.shape == (2, 3, frames, H, W) == want.shape
  assert np.mean(np.abs(want) < 1.0) > 0.5  # mostly un-clipped, so the comparison is meaningful
  assert _max_err(got, want) < 1e-4 * max(1.0, np.abs(want).max())


def test_chunked_equals_whole_sequence(pair):
  """The cached chunk loop (lax.scan over chunks) equals one whole-sequence pass, both directions."""
  _, model, _ = pair
  rng = np.random.RandomState(0)
  latent = jnp.asarray(0.5 * rng.randn(1, CFG.z_dim, 3, H // 8, W // 8), jnp.float32)
  assert _max_err(_decode(model, latent), _decode(model, latent, chunked=False)) < 1e-5
  video = jnp.asarray(rng.uniform(-1, 1, (1, 3, 9, H, W)), jnp.float32)
  assert _max_err(_encode(model, video), _encode(model, video, chunked=False)) < 1e-5
  # an 8-frame chunk (Cosmos uses 16) gives the same latents as the reference's 4
  assert _max_err(_encode(model, video, chunk_frames=8), _encode(model, video)) < 1e-5


def test_encode_rejects_bad_frame_count(pair):
  with pytest.raises(ValueError, match='1 \\+ 4k'):
    pair[1].encode(jnp.zeros((1, 3, 6, H, W)))


def test_latent_normalization_roundtrip():
  model = nnx.eval_shape(lambda: wan_vae.WanVAE(CFG, rngs=nnx.Rngs(0)))
  mu = jnp.asarray(np.random.RandomState(1).randn(2, CFG.z_dim, 3, 2, 3), jnp.float32)
  z = model.normalize_latents(mu)
  mean = np.asarray(CFG.latents_mean)[None, :, None, None, None]
  std = np.asarray(CFG.latents_std)[None, :, None, None, None]
  np.testing.assert_allclose(z, (np.asarray(mu) - mean) / std, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(model.denormalize_latents(z), mu, rtol=1e-5, atol=1e-5)


def test_wan21_preset_shapes():
  """Released config: 16 latent channels, 8x/4x compression, about 127M parameters."""
  cfg = wan_vae.wan21()
  model = nnx.eval_shape(lambda: wan_vae.WanVAE(cfg, rngs=nnx.Rngs(0)))
  n = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
  assert n == 126_892_531  # = sum of numel of diffusers AutoencoderKLWan() defaults
  assert (cfg.z_dim, cfg.spatial_factor, cfg.temporal_factor) == (16, 8, 4)


def test_converter_reports_all_problems_at_once(pair):
  _, _, sd = pair
  bad = dict(sd)
  del bad['decoder.conv_out.bias']
  bad['encoder.not_a_layer.weight'] = np.zeros((3,), np.float32)
  bad['encoder.conv_in.weight'] = np.zeros((8, 3, 3, 3, 1), np.float32)
  with pytest.raises(ValueError) as err:
    convert_diffusers_vae_state_dict(bad, CFG)
  msg = str(err.value)
  assert 'missing (1)' in msg and 'decoder/conv_out/bias' in msg
  assert 'unexpected (1)' in msg and 'encoder.not_a_layer.weight' in msg
  assert 'mis-shaped (1)' in msg and 'encoder.conv_in.weight' in msg
