"""The checkpoint-conversion CLI (`python -m ddrl_jax.models.convert`), end to end on tiny models.

Each CLI run is a real subprocess; its orbax output is read back with `load_converted` and compared with
the in-process converters (and, for the diffusers folders, with the torch models' outputs).
"""
import json
import math
import os
import subprocess
import sys
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cosmos_names  # tests/cosmos_names.py
from flax import nnx

torch = pytest.importorskip('torch')
diffusers = pytest.importorskip('diffusers')
tc = pytest.importorskip('diffusers.models.transformers.transformer_cosmos')

from ddrl_jax.models import convert as cv  # noqa: E402
from ddrl_jax.models.cosmos import convert as cosmos_convert  # noqa: E402
from ddrl_jax.models.cosmos import dit as cosmos_dit  # noqa: E402
from ddrl_jax.models import video_vae as wan_vae  # noqa: E402
from ddrl_jax.models import video_vae_convert as wan_vae_convert  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COSMOS = cosmos_dit.tiny()
WAN = wan_vae.tiny()


def _cli(*args):
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''),
             JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-m', 'ddrl_jax.models.convert', *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def _run_ok(source, model, out, *extra):
  proc = _cli(f'--source={source}', f'--model={model}', f'--out={out}', *extra)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [l for l in proc.stdout.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith(f'converted {model} '), proc.stdout
  return json.load(open(os.path.join(out, 'conversion.json')))


def _assert_states_equal(got, want):
  want = {p: v.get_value() for p, v in nnx.to_flat_state(want)}
  got = {p: v.get_value() for p, v in nnx.to_flat_state(got)}
  assert got.keys() == want.keys()
  for p in want:
    assert got[p].dtype == want[p].dtype, p
    np.testing.assert_array_equal(np.asarray(got[p], np.float32), np.asarray(want[p], np.float32), err_msg=str(p))


def _num_params(state):
  return sum(math.prod(v.get_value().shape) for _, v in nnx.to_flat_state(state))


# ------------------------------------------------------------------------------------------- Cosmos
@pytest.fixture(scope='module')
def cosmos_torch():
  """A tiny diffusers Cosmos-2.5 transformer matching `cosmos_dit.tiny()` (the CLI's cosmos_tiny)."""
  torch.manual_seed(0)
  c = COSMOS
  model = tc.CosmosTransformer3DModel(
      in_channels=c.in_channels + 1, out_channels=c.in_channels, num_attention_heads=c.num_heads,
      attention_head_dim=c.head_dim, num_layers=c.num_blocks, mlp_ratio=float(c.mlp_ratio),
      text_embed_dim=c.context_dim, adaln_lora_dim=c.adaln_lora_dim, max_size=(16, 32, 32),
      patch_size=c.patch, rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=True, extra_pos_embed_type=None,
      use_crossattn_projection=True, crossattn_proj_in_channels=c.crossattn_in,
      encoder_hidden_states_channels=c.context_dim).eval()
  return cosmos_names.randomize_cosmos_torch(model)


def _nearest_resize(img, size, interpolation=None):
  return torch.nn.functional.interpolate(img, size=tuple(size), mode='nearest')


def test_cosmos_diffusers_folder(cosmos_torch, tmp_path, monkeypatch):
  """Sharded diffusers save (index.json) inside a pipeline's transformer/ -> CLI -> params and outputs match."""
  cosmos_torch.save_pretrained(tmp_path / 'pipe' / 'transformer', max_shard_size='200KB')
  assert (tmp_path / 'pipe' / 'transformer' / 'diffusion_pytorch_model.safetensors.index.json').exists()
  info = _run_ok(tmp_path / 'pipe', 'cosmos_tiny', tmp_path / 'out')
  sd = {k: v.detach().numpy() for k, v in cosmos_torch.state_dict().items()}
  want = cosmos_convert.convert_diffusers_state_dict(sd, COSMOS)
  got = cv.load_converted(tmp_path / 'out', 'cosmos_tiny')
  _assert_states_equal(got, want)
  assert info['naming'] == 'diffusers' and info['num_tensors'] == len(sd)
  assert info['num_params'] == _num_params(want) and info['dtype'] == 'float32'

  # forward of the merged model vs the torch model (one image-to-video case of the parity harness)
  rng = np.random.default_rng(0)
  b, t, h, w = 1, 2, 4, 6
  x_t, gt = (rng.standard_normal((b, 16, t, h, w)).astype(np.float32) for _ in range(2))
  ctx = rng.standard_normal((b, 5, COSMOS.crossattn_in)).astype(np.float32)
  pad = (rng.random((1, 1, 2 * h, 2 * w)) > 0.7).astype(np.float32)
  x_in, cond = (np.asarray(a) for a in cosmos_dit.frame_replace(jnp.asarray(x_t), jnp.asarray(gt), 1))
  tt = np.array([[1e-4, 0.6]], np.float32)
  ours = np.asarray(cosmos_convert.merge_params(COSMOS, got)(x_in, tt, ctx, cond, pad))
  fake = types.SimpleNamespace(functional=types.SimpleNamespace(resize=_nearest_resize),
                               InterpolationMode=types.SimpleNamespace(NEAREST='nearest'))
  monkeypatch.setattr(tc, 'transforms', fake, raising=False)
  with torch.no_grad():
    ref = cosmos_torch(torch.tensor(x_in), torch.tensor(tt)[:, None, :, None, None], torch.tensor(ctx),
                       condition_mask=torch.tensor(cond), padding_mask=torch.tensor(pad),
                       return_dict=False)[0].numpy()
  assert float(np.abs(ours - ref).max()) <= 1e-4 * max(1.0, float(np.abs(ref).max()))


def test_cosmos_original_pt_bf16(cosmos_torch, tmp_path):
  """Original `net.` names in bf16 + entries to drop -> CLI --dtype=bfloat16 -> equals the direct converter."""
  sd = {cosmos_names.to_cosmos_name(k): v.detach().to(torch.bfloat16) for k, v in cosmos_torch.state_dict().items()}
  sd.update({'net.accum_iteration': torch.tensor(7), 'net.accum_video_sample_counter': torch.tensor(3),
             'net.pos_embedder.seq': torch.arange(4.0), 'net.pos_embedder.dim_spatial_range': torch.arange(8.0),
             'net.blocks.0.self_attn.q_proj._extra_state': torch.zeros(3, dtype=torch.uint8)})
  torch.save(sd, tmp_path / 'model.pt')
  info = _run_ok(tmp_path / 'model.pt', 'cosmos_tiny', tmp_path / 'out', '--dtype=bfloat16')
  assert info['naming'] == 'cosmos_original' and info['num_tensors'] == len(sd)
  want = cosmos_convert.convert_cosmos_state_dict({k: v.float().numpy() for k, v in sd.items()}, COSMOS)
  want = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), want)
  got = cv.load_converted(tmp_path / 'out')
  _assert_states_equal(got, want)
  assert all(v.get_value().dtype == jnp.bfloat16 for _, v in nnx.to_flat_state(got))


def test_mismatched_checkpoint_names_every_problem(cosmos_torch, tmp_path):
  from safetensors.torch import save_file
  sd = {k: v.detach().clone().contiguous() for k, v in cosmos_torch.state_dict().items()}
  del sd['transformer_blocks.1.attn2.to_k.weight']
  sd['proj_out.weight'] = torch.zeros(5, 64)
  save_file(sd, str(tmp_path / 'bad.safetensors'))
  proc = _cli(f'--source={tmp_path / "bad.safetensors"}', '--model=cosmos_tiny', f'--out={tmp_path / "out"}')
  assert proc.returncode != 0
  assert 'blocks/cross_attn/k_proj/kernel for blocks [1]' in proc.stderr, proc.stderr
  assert 'proj_out.weight: got (5, 64)' in proc.stderr
  assert str(tmp_path / 'bad.safetensors') in proc.stderr
  assert not (tmp_path / 'out' / 'params').exists()


class _NotATensor:
  def __init__(self):
    self.payload = [1, 2, 3]


def test_non_tensor_pickle_is_refused(tmp_path):
  torch.save({'net.x_embedder.proj.1.weight': torch.zeros(4, 4), 'extra': _NotATensor()}, tmp_path / 'evil.pt')
  proc = _cli(f'--source={tmp_path / "evil.pt"}', '--model=cosmos_tiny', f'--out={tmp_path / "out"}')
  assert proc.returncode != 0
  assert 'refused' in proc.stderr and 'non-tensor' in proc.stderr, proc.stderr
  assert '_NotATensor' in proc.stderr
  assert 'weights_only=False' not in proc.stderr  # no advice to unpickle it anyway
  assert not (tmp_path / 'out' / 'params').exists()


# ------------------------------------------------------------------------------------------ Wan VAE
@pytest.fixture(scope='module')
def wan_torch():
  torch.manual_seed(0)
  ref = diffusers.AutoencoderKLWan(
      base_dim=WAN.base_dim, z_dim=WAN.z_dim, dim_mult=list(WAN.dim_mult), num_res_blocks=WAN.num_res_blocks,
      temperal_downsample=list(WAN.temperal_downsample), latents_mean=list(WAN.latents_mean),
      latents_std=list(WAN.latents_std)).eval()
  with torch.no_grad():
    for name, p in ref.named_parameters():
      if name.endswith('gamma'):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
  return ref


def test_wan_diffusers_folder(wan_torch, tmp_path):
  wan_torch.save_pretrained(tmp_path / 'vae')
  info = _run_ok(tmp_path / 'vae', 'wan_tiny', tmp_path / 'out')
  sd = {k: v.detach().numpy() for k, v in wan_torch.state_dict().items()}
  want = wan_vae_convert.convert_diffusers_vae_state_dict(sd, WAN)
  got = cv.load_converted(tmp_path / 'out', 'wan_tiny')
  _assert_states_equal(got, want)
  assert info['naming'] == 'diffusers' and info['num_params'] == _num_params(want) == sum(
      v.numel() for v in wan_torch.state_dict().values())

  latent = 0.5 * torch.randn(1, WAN.z_dim, 2, 2, 3, generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    ref = wan_torch.decode(latent).sample.numpy()
  ours = np.asarray(wan_vae_convert.merge_params(WAN, got).decode(jnp.asarray(latent.numpy())))
  assert ours.shape == ref.shape
  assert float(np.abs(ours - ref).max()) < 1e-4 * max(1.0, float(np.abs(ref).max()))


def _wan_original_keys(base_dim, z_dim, dim_mult, num_res_blocks, temperal_downsample):
  """Parameter names of the original Wan2.1 `WanVAE_` (wan/modules/vae.py, attn_scales=[])."""
  def res(prefix, din, dout):
    ks = [f'{prefix}.residual.{i}.{n}' for i, n in
          ((0, 'gamma'), (2, 'weight'), (2, 'bias'), (3, 'gamma'), (6, 'weight'), (6, 'bias'))]
    return ks + ([f'{prefix}.shortcut.weight', f'{prefix}.shortcut.bias'] if din != dout else [])

  def resample(prefix, temporal):
    ks = [f'{prefix}.resample.1.weight', f'{prefix}.resample.1.bias']
    return ks + ([f'{prefix}.time_conv.weight', f'{prefix}.time_conv.bias'] if temporal else [])

  def middle(part, d):
    return (res(f'{part}.middle.0', d, d) + [f'{part}.middle.1.{n}' for n in
            ('norm.gamma', 'to_qkv.weight', 'to_qkv.bias', 'proj.weight', 'proj.bias')] + res(f'{part}.middle.2', d, d))

  head = lambda part: [f'{part}.head.0.gamma', f'{part}.head.2.weight', f'{part}.head.2.bias']
  keys = ['encoder.conv1.weight', 'encoder.conv1.bias']
  dims, k = [base_dim * u for u in [1] + list(dim_mult)], 0
  for i, (din, dout) in enumerate(zip(dims[:-1], dims[1:])):
    for _ in range(num_res_blocks):
      keys += res(f'encoder.downsamples.{k}', din, dout)
      k, din = k + 1, dout
    if i != len(dim_mult) - 1:
      keys += resample(f'encoder.downsamples.{k}', temperal_downsample[i])
      k += 1
  keys += middle('encoder', dims[-1]) + head('encoder')
  keys += ['conv1.weight', 'conv1.bias', 'conv2.weight', 'conv2.bias', 'decoder.conv1.weight', 'decoder.conv1.bias']
  dims, k = [base_dim * u for u in [dim_mult[-1]] + list(dim_mult)[::-1]], 0
  keys += middle('decoder', dims[0])
  for i, (din, dout) in enumerate(zip(dims[:-1], dims[1:])):
    din = din // 2 if i > 0 else din
    for _ in range(num_res_blocks + 1):
      keys += res(f'decoder.upsamples.{k}', din, dout)
      k, din = k + 1, dout
    if i != len(dim_mult) - 1:
      keys += resample(f'decoder.upsamples.{k}', list(temperal_downsample)[::-1][i])
      k += 1
  return keys + head('decoder')


def test_wan_original_names_match_diffusers_own_mapping():
  """For the released layout our general renaming equals diffusers' single-file `convert_wan_vae_to_diffusers`,
  and lands exactly on the parameter names of `AutoencoderKLWan()`."""
  from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
  c = wan_vae.wan21()
  keys = _wan_original_keys(c.base_dim, c.z_dim, c.dim_mult, c.num_res_blocks, c.temperal_downsample)
  ours = wan_vae_convert.wan_original_to_diffusers({k: k for k in keys}, c)
  theirs = convert_wan_vae_to_diffusers({k: k for k in keys})
  assert ours == theirs
  with torch.device('meta'):
    names = set(diffusers.AutoencoderKLWan().state_dict())
  assert set(ours) == names and wan_vae_convert.is_wan_original(keys)
  assert not wan_vae_convert.is_wan_original(names)


def test_wan_original_pth(wan_torch, tmp_path):
  """A tiny `Wan2.1_VAE.pth`-style file (original names, bf16) -> CLI -> equals the diffusers conversion."""
  keys = _wan_original_keys(WAN.base_dim, WAN.z_dim, WAN.dim_mult, WAN.num_res_blocks, WAN.temperal_downsample)
  rename = wan_vae_convert.wan_original_to_diffusers({k: k for k in keys}, WAN)
  diff_sd = wan_torch.state_dict()
  assert set(rename) == set(diff_sd)
  sd = {orig: diff_sd[new].detach().to(torch.bfloat16) for new, orig in rename.items()}
  torch.save(sd, tmp_path / 'tokenizer.pth')
  info = _run_ok(tmp_path / 'tokenizer.pth', 'wan_tiny', tmp_path / 'out')
  assert info['naming'] == 'wan_original' and info['num_tensors'] == len(sd)
  want = wan_vae_convert.convert_diffusers_vae_state_dict(
      {new: sd[orig].float().numpy() for new, orig in rename.items()}, WAN)
  _assert_states_equal(cv.load_converted(tmp_path / 'out', 'wan_tiny'), want)


def test_converted_checkpoint_starts_the_video_task(cosmos_torch, tmp_path):
  """convert -> orbax dir -> config.cosmos.checkpoint -> the task's initial params are the converted ones."""
  from configs import cosmos2b
  from ddrl_jax.tasks import video
  cosmos_torch.save_pretrained(tmp_path / 'transformer')
  cv.convert(tmp_path / 'transformer', 'cosmos_tiny', tmp_path / 'out')
  config = cosmos2b.get_config('smoke')
  config.cosmos.checkpoint = str(tmp_path / 'out')
  _, params = video.CosmosVideo(config).init_model(jax.random.key(0))
  want = cv.load_converted(tmp_path / 'out')
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.filter_state(params, nnx.Param)), nnx.to_pure_dict(want))
  # The trainer's path: from host memory onto an FSDP mesh, each device receiving only its slices.
  from ddrl_jax import parallel  # pylint: disable=g-import-not-at-top
  config.mesh.update(dict(data=2, fsdp=4))
  task = video.CosmosVideo(config)
  _, abstract = task.abstract_params(jax.random.key(0))
  plan = parallel.ShardingPlan.from_config(config, parallel.make_mesh(config.mesh, jax.devices()))
  sharded = task.init_params_sharded(jax.random.key(0), plan.params(abstract))
  kernel = sharded['blocks']['mlp']['layer1']['kernel'].get_value()
  assert len({str(s.index) for s in kernel.addressable_shards}) == 4
  chex.assert_trees_all_close(jax.device_get(nnx.to_pure_dict(sharded)), nnx.to_pure_dict(want))
  # A checkpoint of another size is refused with the key named.
  config.cosmos.dit_overrides = {'num_blocks': 3}
  with pytest.raises(ValueError, match='config.cosmos.checkpoint'):
    video.CosmosVideo(config).init_model(jax.random.key(0))
  task = video.CosmosVideo(config)
  _, abstract = task.abstract_params(jax.random.key(0))
  with pytest.raises(ValueError, match='config.cosmos.checkpoint'):
    task.init_params_sharded(jax.random.key(0), plan.params(abstract))
