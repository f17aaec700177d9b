"""FLUX.1 through the pipeline seam: the family's guidance embedding as a condition (no null branch), its
text encoders and VAE, its presets' recipes, the converter CLI on a diffusers folder, LoRA export loaded by
diffusers + peft, and the smoke presets training through the prompt task."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import flux1_dev
from ddrl_jax import parallel
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.models import autoencoder_kl
from ddrl_jax.models import convert
from ddrl_jax.models import family as family_lib
from ddrl_jax.models import lora as lora_lib
from ddrl_jax.models.flux import convert as flux_convert
from ddrl_jax.models.flux import family as flux_family
from ddrl_jax.models.flux import transformer
from ddrl_jax.tasks import prompt_task


def test_presets_carry_their_recipes():
  fg, dg, dd = (flux1_dev.get_config(a) for a in ('flow_grpo', 'dance_grpo', 'ddrl'))
  assert (fg.algorithm, fg.sampler.kind, fg.sampler.num_steps, fg.sampler.eval_num_steps) == \
      ('flow_grpo', 'flow_sde', 6, 28)
  assert fg.sampler.noise_level == 0.9 and fg.rl.kl_beta == 0.0 and fg.num_rollouts == 24
  assert dict(fg.reward.fns) == {'pickscore': 1.0} and (fg.lora.rank, fg.lora.alpha) == (32, 64)
  assert (dg.algorithm, dg.sampler.kind, dg.sampler.num_steps, dg.sampler.eta, dg.sampler.shift) == \
      ('dance_grpo', 'dance_sde', 12, 0.3, 3.0)
  assert dg.num_rollouts == 12 and dg.rl.train_fraction == 0.6 and dg.flux.resolution == 720
  assert dict(dg.reward.fns) == {'hpsv21': 1.0, 'clipscore': 1.0} and (dg.lora.rank, dg.lora.alpha) == (128, 256)
  assert dd.algorithm == 'ddrl' and dd.rl.data_beta > 0 and dd.data.base_samples == 300 * 24
  for c in (fg, dg, dd):
    assert c.prompt.guidance_rollout == c.prompt.guidance_eval == 3.5 and c.require_inputs


def test_the_resolution_shift_is_flux_pipelines_dynamic_shift():
  """exp(mu) as the static shift gives diffusers' time shift exp(mu) / (exp(mu) + 1/sigma - 1)."""
  s = flux_family.resolution_shift(1024)              # 4096 tokens: mu = 1.15
  assert s == pytest.approx(math.exp(1.15))
  assert flux_family.resolution_shift(256) == pytest.approx(math.exp(0.5))   # 256 tokens
  sigma = np.linspace(0.05, 1.0, 7)
  mu = math.log(s)
  np.testing.assert_allclose(s * sigma / (1 + (s - 1) * sigma), math.exp(mu) / (math.exp(mu) + 1 / sigma - 1))


def test_guidance_is_a_model_input_without_a_null_branch():
  task = prompt_task.PromptTask(flux1_dev.get_config('flow_grpo_smoke'))
  family = task.family
  assert family.guidance_mode == 'embed' and not family.cfg_on
  cond = task.conditions(jax.random.key(0), 3)
  assert set(cond) == {'text', 'pooled', 'guidance', 'index'}
  np.testing.assert_array_equal(cond['guidance'], 3.5)
  assert cond['text'].shape == (3, 8, 24) and cond['pooled'].shape == (3, 20)
  abstract = task.abstract_conditions(3)
  assert jax.tree.map(lambda a: a.shape, abstract) == jax.tree.map(lambda a: a.shape, cond)
  apply_fn, params = family_lib.init_params(family, lora_lib.from_config(task.config), jax.random.key(1))
  x = jax.random.normal(jax.random.key(2), (3,) + task.sample_shape)
  t = jnp.full((3,), 0.5)
  v = apply_fn(params, x, t, cond)
  assert v.shape == x.shape and bool(jnp.isfinite(v).all())
  v2 = apply_fn(params, x, t, dict(cond, guidance=jnp.full((3,), 1.0)))
  assert float(jnp.abs(v - v2).max()) > 0          # the scale reaches the network
  assert family.forward_flops(task.sample_shape) == pytest.approx(
      sum(transformer.forward_flops(family.dit, (8, 8), 8)[1].values()))


def test_the_vae_decodes_images_and_encodes_them_back():
  family = flux_family.FluxFamily(flux1_dev.get_config('flow_grpo_smoke'))
  latents = np.random.RandomState(0).randn(3, *family.sample_shape).astype(np.float32)
  images, finite = family.decode(latents)
  assert images.shape == (3, 64, 64, 3) and images.dtype == np.uint8 and finite.all()
  back = family.encode_samples(images[:, None])
  assert back.shape == (3,) + family.sample_shape and np.isfinite(back).all()


def _diffusers_folder(root):
  """A tiny random FLUX pipeline folder written by diffusers: transformer/ (transformer.tiny) and vae/."""
  import diffusers  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  cfg, vcfg = transformer.tiny(), autoencoder_kl.tiny()
  torch.manual_seed(0)
  dit = diffusers.FluxTransformer2DModel(
      patch_size=1, in_channels=cfg.in_channels, num_layers=cfg.num_layers,
      num_single_layers=cfg.num_single_layers, attention_head_dim=cfg.attention_head_dim,
      num_attention_heads=cfg.num_attention_heads, joint_attention_dim=cfg.joint_attention_dim,
      pooled_projection_dim=cfg.pooled_projection_dim, guidance_embeds=True,
      axes_dims_rope=tuple(cfg.axes_dims_rope))
  with torch.no_grad():
    for p in dit.parameters():
      p.normal_(0, 0.05)
  dit.save_pretrained(os.path.join(root, 'transformer'))
  n = len(vcfg.block_out_channels)
  vae = diffusers.AutoencoderKL(
      in_channels=3, out_channels=3, latent_channels=vcfg.latent_channels,
      block_out_channels=list(vcfg.block_out_channels), layers_per_block=vcfg.layers_per_block,
      norm_num_groups=vcfg.norm_num_groups, down_block_types=['DownEncoderBlock2D'] * n,
      up_block_types=['UpDecoderBlock2D'] * n, scaling_factor=vcfg.scaling_factor,
      shift_factor=vcfg.shift_factor, use_quant_conv=False, use_post_quant_conv=False)
  vae.save_pretrained(os.path.join(root, 'vae'))
  return {k: v.detach().numpy().copy() for k, v in dit.state_dict().items()}


@pytest.mark.slow
def test_diffusers_folder_converts_and_loads_sharded(tmp_path):
  """transformer/ and vae/ of one folder -> the converter CLI's code -> the family's base placed on an
  8-device FSDP mesh shard by shard, equal to the diffusers weights; a mismatched model is refused."""
  dit_sd = _diffusers_folder(str(tmp_path / 'pipe'))
  info = convert.convert(str(tmp_path / 'pipe'), 'flux_tiny', str(tmp_path / 'dit'))
  assert info['num_params'] == transformer.num_params(transformer.tiny())
  convert.convert(str(tmp_path / 'pipe'), 'flux_vae_tiny', str(tmp_path / 'vae'))
  config = flux1_dev.get_config('flow_grpo_smoke')
  config.flux.checkpoint = str(tmp_path / 'dit')
  config.flux.vae_checkpoint = str(tmp_path / 'vae')
  config.lora.rank = 0
  config.mesh.data, config.mesh.fsdp = 1, 8
  family = flux_family.FluxFamily(config)
  mesh = parallel.make_mesh(config.mesh, jax.devices()[:8])
  plan = parallel.ShardingPlan.for_model(config, mesh, family)
  _, abstract, _ = family_lib.abstract_params(family, lora_lib.from_config(config), jax.random.key(0))
  params = family_lib.init_params_sharded(family, lora_lib.from_config(config), jax.random.key(0),
                                          plan.params(abstract))
  want = flux_convert.from_diffusers_state_dict(dit_sd, transformer.tiny())
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), nnx.to_pure_dict(params), want)
  images, finite = family.decode(np.zeros((1,) + family.sample_shape, np.float32))
  assert finite.all() and images.shape == (1, 64, 64, 3)
  config.flux.dit_overrides = {'num_layers': 3}
  with pytest.raises(ValueError, match='config.flux.checkpoint'):
    family_lib.init_params(flux_family.FluxFamily(config), lora_lib.from_config(config), jax.random.key(0))


def _train(config, workdir):
  trainer = trainer_lib.Trainer(config, str(workdir), devices=jax.devices()[:1])
  trainer.restore_or_init()
  return trainer, trainer.train()


@pytest.mark.slow
@pytest.mark.parametrize('preset', ['flow_grpo_smoke', 'dance_grpo_smoke', 'ddrl_smoke'])
def test_smoke_presets_train_through_the_prompt_task(tmp_path, preset):
  config = flux1_dev.get_config(preset)
  if preset == 'ddrl_smoke':
    config.data.base_samples = 4
  trainer, metrics = _train(config, tmp_path / 'w')
  assert int(trainer.state.step) == 2 and np.isfinite(metrics['loss'])
  with open(tmp_path / 'w' / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  assert any('reward/ocr' in r for r in rows) and any('eval/ocr' in r for r in rows)
  if preset == 'ddrl_smoke':
    assert np.isfinite(metrics['data_loss'])


@pytest.mark.slow
@pytest.mark.parametrize('preset', ['flow_grpo_smoke', 'dance_grpo_smoke'])
def test_smoke_presets_train_on_their_recipes_rewards(tmp_path, preset):
  """The recipes' own rewards (flow_grpo: PickScore; dance_grpo: HPSv2.1 + CLIPScore) on tiny random
  weights of the real checkpoint layouts, scored in the reward service during training."""
  from ddrl_jax.rewards import clip_rewards  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import hps  # pylint: disable=g-import-not-at-top
  config = flux1_dev.get_config(preset)
  recipe = flux1_dev.get_config(preset[:-len('_smoke')])
  config.reward.fns = recipe.reward.fns
  clip = clip_rewards.save_tiny(str(tmp_path / 'clip'))
  config.reward.kwargs.pickscore.checkpoint = clip['checkpoint']
  config.reward.kwargs.clipscore.checkpoint = clip['checkpoint']
  for key, value in hps.save_tiny(str(tmp_path / 'hps')).items():
    config.reward.kwargs.hpsv21[key] = value
  trainer, metrics = _train(config, tmp_path / 'w')
  assert int(trainer.state.step) == 2 and np.isfinite(metrics['loss'])
  with open(tmp_path / 'w' / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  for name in recipe.reward.fns:
    assert any(np.isfinite(r.get(f'reward/{name}', np.nan)) for r in rows), name
