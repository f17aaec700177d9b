"""SD3.5 through the family seam: the presets' recipes, the CFG velocity, the diffusers-folder converter placed
sharded, prepare with the real text encoders, and (slow) the whole OCR path on the CPU for each preset."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from configs import sd35m
from ddrl_jax import config as config_lib
from ddrl_jax import parallel
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.data import prepare
from ddrl_jax.data import records
from ddrl_jax.models import autoencoder_kl
from ddrl_jax.models import autoencoder_kl_convert
from ddrl_jax.models import convert
from ddrl_jax.models import family as family_lib
from ddrl_jax.models import lora as lora_lib
from ddrl_jax.models.sd3 import convert as sd3_convert
from ddrl_jax.models.sd3 import family as sd3_family
from ddrl_jax.models.sd3 import mmdit
from ddrl_jax.tasks import prompt_task

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------ recipes
def test_presets_carry_their_recipes():
  ddrl, grpo, nft = (sd35m.get_config(p) for p in ('ddrl', 'flow_grpo', 'diffusion_nft'))
  assert (ddrl.algorithm, grpo.algorithm, nft.algorithm) == ('ddrl', 'flow_grpo', 'diffusion_nft')
  # CFG policy: FlowGRPO guides rollouts, the policy gradient and evaluation at 4.5; DDRL and NFT never.
  assert (grpo.prompt.guidance_rollout, grpo.prompt.guidance_eval) == (4.5, 4.5)
  for c in (ddrl, nft):
    assert (c.prompt.guidance_rollout, c.prompt.guidance_eval) == (1.0, 1.0)
  assert grpo.sampler.num_steps == 10 and grpo.sampler.eval_num_steps == 40
  assert grpo.rl.kl_beta == 0.04 and grpo.rl.kl_form == 'flow_grpo' and grpo.rl.clip_range == 1e-4
  assert (grpo.batch_size, grpo.num_rollouts) == (24, 24)
  for c in (ddrl, grpo, nft):
    assert (c.lora.rank, c.lora.alpha, c.lora.init) == (32, 64, 'gaussian')
    assert c.sd3.resolution == 512 and c.reward.fns.to_dict() == {'ocr': 1.0}
    config_lib.validate(c, 8)
  assert ddrl.rl.cond_dropout == 0.2 and ddrl.rl.data_beta > 0
  with pytest.raises(ValueError, match='unknown config arg'):
    sd35m.get_config('grpo')


def test_lora_targets_are_flow_grpos_joint_attention_only():
  module = mmdit.abstract_model(mmdit.tiny())
  spec = lora_lib.from_config(sd35m.get_config('flow_grpo_smoke'))
  lora_lib.attach(module, spec, jax.random.key(0))
  adapted = sorted('.'.join(str(p) for p in path[:-1]) for path, _ in
                   nnx.to_flat_state(nnx.state(module, nnx.LoRAParam)) if path[-1] == 'lora_a')
  assert 'dual_blocks.attn.to_q' in adapted and 'last_block.attn.add_v_proj' in adapted
  assert not [p for p in adapted if 'attn2' in p or '.ff' in p or 'norm' in p]
  assert len(adapted) == 8 + 8 + 7        # no to_add_out in the context-pre-only last block


def test_cfg_velocity_is_the_guided_combination():
  cfg = mmdit.tiny(remat_policy='none')
  module = nnx.eval_shape(lambda: mmdit.MMDiT(cfg, rngs=nnx.Rngs(0)))
  graphdef, _ = nnx.split(module)
  params = jax.jit(lambda: nnx.split(mmdit.MMDiT(cfg, rngs=nnx.Rngs(0)))[1])()
  rs = np.random.RandomState(0)
  x = jnp.asarray(rs.randn(3, 4, 8, 8), jnp.float32)
  t = jnp.asarray([0.2, 0.5, 0.9], jnp.float32)
  text, null = (jnp.asarray(rs.randn(3, 5, 24), jnp.float32) for _ in range(2))
  pooled, null_pooled = (jnp.asarray(rs.randn(3, 20), jnp.float32) for _ in range(2))
  plain = jax.jit(sd3_family.make_apply_fn(graphdef, False))
  guided = jax.jit(sd3_family.make_apply_fn(graphdef, True))
  v_c = plain(params, x, t, dict(text=text, pooled=pooled))
  v_u = plain(params, x, t, dict(text=null, pooled=null_pooled))
  w = jnp.asarray([1.0, 4.5, 0.0])
  v = guided(params, x, t, dict(text=text, pooled=pooled, null_text=null, null_pooled=null_pooled,
                                guidance=w))
  np.testing.assert_allclose(v, v_u + w[:, None, None, None] * (v_c - v_u), atol=2e-5)
  np.testing.assert_allclose(v[0], v_c[0], atol=2e-5)          # w = 1 is the conditional velocity


# ----------------------------------------------------------------------------------------- converter
def _diffusers_folder(root):
  """A tiny random SD3 pipeline folder written by diffusers: transformer/ (mmdit.tiny) and vae/."""
  import diffusers  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  cfg, vcfg = mmdit.tiny(), autoencoder_kl.tiny()
  torch.manual_seed(0)
  fields = ('sample_size', 'patch_size', 'in_channels', 'num_layers', 'attention_head_dim',
            'num_attention_heads', 'joint_attention_dim', 'caption_projection_dim', 'pooled_projection_dim',
            'out_channels', 'pos_embed_max_size', 'dual_attention_layers', 'qk_norm')
  dit = diffusers.SD3Transformer2DModel(**{f: getattr(cfg, f) for f in fields})
  with torch.no_grad():
    for p in dit.parameters():
      p.normal_(0, 0.05)
  dit.save_pretrained(os.path.join(root, 'transformer'))
  n = len(vcfg.block_out_channels)
  vae = diffusers.AutoencoderKL(
      in_channels=3, out_channels=3, latent_channels=16, block_out_channels=list(vcfg.block_out_channels),
      layers_per_block=vcfg.layers_per_block, norm_num_groups=vcfg.norm_num_groups,
      down_block_types=['DownEncoderBlock2D'] * n, up_block_types=['UpDecoderBlock2D'] * n,
      scaling_factor=vcfg.scaling_factor, shift_factor=vcfg.shift_factor, use_quant_conv=False,
      use_post_quant_conv=False)
  vae.save_pretrained(os.path.join(root, 'vae'))
  to_np = lambda m: {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}
  return to_np(dit), to_np(vae)


def test_diffusers_folder_converts_and_loads_sharded(tmp_path):
  """transformer/ and vae/ of one pipeline folder -> orbax (the converter CLI's code) -> the family's base,
  placed on an 8-device FSDP mesh shard by shard, equal to the diffusers weights."""
  if len(jax.devices()) < 8:
    pytest.skip('needs the 8 fake CPU devices of tests/conftest.py')
  dit_sd, vae_sd = _diffusers_folder(str(tmp_path / 'pipe'))
  info = convert.convert(str(tmp_path / 'pipe'), 'sd3_tiny', str(tmp_path / 'dit'))
  assert info['num_params'] == mmdit.num_params(mmdit.tiny())
  convert.convert(str(tmp_path / 'pipe'), 'sd3_vae_tiny', str(tmp_path / 'vae'))
  vae = nnx.to_pure_dict(convert.load_converted(str(tmp_path / 'vae')))
  want_vae = autoencoder_kl_convert.from_diffusers_state_dict(vae_sd, autoencoder_kl.tiny())
  jax.tree.map(np.testing.assert_array_equal, vae, want_vae)

  config = sd35m.get_config('flow_grpo_smoke')
  config.sd3.dit_overrides = {}
  config.sd3.vae_overrides = {'latent_channels': 4}        # the family checks its VAE against the DiT
  config.sd3.checkpoint = str(tmp_path / 'dit')
  config.lora.rank = 0
  config.mesh.data, config.mesh.fsdp = 1, 8
  family = sd3_family.SD3Family(config)
  mesh = parallel.make_mesh(config.mesh, jax.devices()[:8])
  plan = parallel.ShardingPlan.for_model(config, mesh, family)
  _, abstract, _ = family_lib.abstract_params(family, lora_lib.from_config(config), jax.random.key(0))
  shardings = plan.params(abstract)
  params = family_lib.init_params_sharded(family, lora_lib.from_config(config), jax.random.key(0), shardings)
  kernel = params['joint_blocks']['attn']['to_q']['kernel'][...]
  assert kernel.sharding.shard_shape(kernel.shape) != kernel.shape          # really split over fsdp
  want = sd3_convert.from_diffusers_state_dict(dit_sd, mmdit.tiny())
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b),
               nnx.to_pure_dict(params), want)

  config.sd3.dit_overrides = {'num_layers': 6}                     # another model: named, refused
  with pytest.raises(ValueError, match='config.sd3.checkpoint'):
    family_lib.init_params(sd3_family.SD3Family(config), lora_lib.from_config(config), jax.random.key(0))


# ------------------------------------------------------------------------------------ prepare / text
def test_prepare_writes_text_and_pooled_embeddings(tmp_path):
  """Captioned images -> records whose sample is the VAE latent and whose text_embedding and
  pooled_embedding are the real (tiny random) CLIP-L/G + T5 encoders' output for the caption."""
  task = prompt_task.PromptTask(sd35m.get_config('ddrl_smoke'))
  src = tmp_path / 'src'
  src.mkdir()
  rs = np.random.RandomState(0)
  captions = {'a': 'a sign that says "OPEN"', 'b': 'a poster reading "Hello World"'}
  for stem, text in captions.items():
    Image.fromarray(rs.randint(0, 256, (64, 64, 3)).astype(np.uint8)).save(src / f'{stem}.png')
    (src / f'{stem}.txt').write_text(text)
  summary = prepare.prepare(str(src), str(tmp_path / 'out'), task)
  recs = records.read_all(str(tmp_path / 'out'))
  assert summary['num_records'] == 2
  enc = task.encode_prompts([r['prompt'] for r in recs])
  for i, r in enumerate(recs):
    assert r['sample'].shape == task.sample_shape
    np.testing.assert_array_equal(r['text_embedding'], enc['text_embedding'][i])
    np.testing.assert_array_equal(r['pooled_embedding'], enc['pooled_embedding'][i])
  assert recs[0]['text_embedding'].shape == (77 + 8, 48) and recs[0]['pooled_embedding'].shape == (40,)
  cond, x0 = task.from_records({'prompt': [r['prompt'] for r in recs],
                                'sample': np.stack([r['sample'] for r in recs]),
                                'text_embedding': np.stack([r['text_embedding'] for r in recs]),
                                'pooled_embedding': np.stack([r['pooled_embedding'] for r in recs])}, None)
  assert x0.shape == (2,) + task.sample_shape and cond['text'].shape == (2, 85, 48)


def test_prompts_split_and_cache():
  task = prompt_task.PromptTask(sd35m.get_config('flow_grpo_smoke'))
  assert not set(task.train_prompts) & set(task.eval_prompts)
  assert len(task.train_prompts) + len(task.eval_prompts) == len(prompt_task.read_prompts(""))
  cond = task.conditions(jax.random.key(0), 3)
  assert set(cond) == {'text', 'pooled', 'index', 'guidance', 'null_text', 'null_pooled'}
  np.testing.assert_array_equal(cond['guidance'], 4.5)
  assert task.prompts(cond) == [task.train_prompts[i] for i in np.asarray(cond['index'])]
  ev = task.eval_conditions(jax.random.key(1), 6)
  assert task.prompts(ev) == [task.eval_prompts[i % 4] for i in range(6)]
  cached = len(task.family._text_cache)                                              # pylint: disable=protected-access
  task.conditions(jax.random.key(0), 3)
  assert len(task.family._text_cache) == cached                                      # pylint: disable=protected-access
  abstract = task.abstract_conditions(3)
  assert jax.tree.map(lambda a: a.shape, abstract) == jax.tree.map(lambda a: a.shape, cond)


# ------------------------------------------------------------------------------------- the whole path
def _train(config, workdir):
  trainer = trainer_lib.Trainer(config, str(workdir), devices=jax.devices()[:1])
  trainer.restore_or_init()
  metrics = trainer.train()
  return trainer, metrics


@pytest.mark.slow
def test_flow_grpo_smoke_runs_with_cfg_and_the_ocr_reward(tmp_path):
  """Rollouts and the policy gradient at guidance 4.5 (a 2B forward), Tesseract on the decoded images,
  the KL to the base with the adapters off, evaluation with the 6-step ODE, a checkpoint."""
  trainer, metrics = _train(sd35m.get_config('flow_grpo_smoke'), tmp_path / 'w')
  assert int(trainer.state.step) == 2 and trainer.state.ref_params is None        # the base is the ref
  assert np.isfinite(metrics['loss'])
  with open(tmp_path / 'w' / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  assert any('reward/ocr' in r for r in rows)
  assert any('eval/ocr' in r and 'eval/ocr_rapid' in r for r in rows)     # both readers at the end
  assert os.path.isdir(tmp_path / 'w' / 'checkpoints' / '2')


@pytest.mark.slow
def test_ddrl_smoke_regularizes_with_the_bases_own_samples(tmp_path):
  """The DDRL preset samples the base first (config.data.base_samples, with the text and pooled
  embeddings) and trains on those records: the paper's Table 4 recipe at toy size, no manual step."""
  config = sd35m.get_config('ddrl_smoke')
  config.batch_size = 4
  config.data.base_samples = 8
  trainer, metrics = _train(config, tmp_path / 'w')
  recs = records.read_all(str(tmp_path / 'w' / 'base_samples'))
  assert len(recs) == 8 and {'text_embedding', 'pooled_embedding'} <= set(recs[0])
  assert {r['prompt'] for r in recs} <= set(prompt_task.PromptTask(config).train_prompts)
  assert int(trainer.state.step) == 2 and metrics['data_records_seen'] == 8
  assert np.isfinite(metrics['loss']) and np.isfinite(metrics['data_loss'])
