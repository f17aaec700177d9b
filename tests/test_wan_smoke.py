"""Wan2.1 text-to-video through the family seam: the presets' recipes, the task's conditions, FlowGRPO's video
OCR scoring, and (slow) the whole OCR-in-video path on the CPU for flow_grpo and for DDRL on synthesized data."""
import json
import os

import jax
import numpy as np
import pytest

from configs import wan1_3b
from configs import wan14b
from ddrl_jax import config as config_lib
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.data import records
from ddrl_jax.data import synthesize
from ddrl_jax.rewards import ocr as ocr_reward
from ddrl_jax.tasks import prompt_task


# ------------------------------------------------------------------------------------------ recipes
@pytest.mark.parametrize('module', [wan1_3b, wan14b])
def test_presets_carry_their_recipes(module):
  ddrl, grpo, dance = (module.get_config(p) for p in module.PRESETS)
  assert (ddrl.algorithm, grpo.algorithm, dance.algorithm) == ('ddrl', 'flow_grpo', 'dance_grpo')
  for c in (ddrl, grpo, dance):
    assert c.task == 'prompt_task' and c.model_family == 'wan'
    assert c.wan.model == os.path.basename(module.__file__)[:-3]
    assert tuple(c.wan.latent_shape) == (9, 30, 52) and c.sampler.shift == 3.0
    assert c.sampler.num_steps == 20 and c.sampler.eval_num_steps == 50 and c.sampler.eval_deterministic
    assert c.wan.dtype == 'bfloat16' and c.wan.param_dtype == 'float32'
    assert c.reward.fns.to_dict() == {'ocr': 1.0}
    assert c.reward.kwargs.ocr.to_dict() == {'frame_stride': 4, 'video_mean': 'positive'}
    assert c.mesh.context == 1 and c.batch_size == 8
    assert config_lib.validate(c, 8)[1] == c.mesh.fsdp
  # FlowGRPO general_ocr_wan2_1: guidance 4.5 everywhere, group 4, lr 1e-4, clip 1e-3, beta 0.004, per-group std.
  assert (grpo.prompt.guidance_rollout, grpo.prompt.guidance_eval) == (4.5, 4.5)
  assert grpo.num_rollouts == 4 and grpo.optim.learning_rate == 1e-4 and grpo.rl.clip_range == 1e-3
  assert grpo.rl.kl_beta == 0.004 and grpo.rl.kl_form == 'flow_grpo' and not grpo.rl.adv_global_std
  assert grpo.sampler.kind == 'flow_sde' and grpo.sampler.noise_level == 0.7
  # DanceGRPO's Wan script: CFG 5 in sampling and training, group 12, fraction 0.6, clip 1e-4, adv clip 5.
  assert (dance.prompt.guidance_rollout, dance.prompt.guidance_eval) == (5.0, 5.0)
  assert dance.num_rollouts == 12 and dance.rl.train_fraction == 0.6 and dance.rl.clip_range == 1e-4
  assert dance.rl.adv_clip == 5.0 and dance.sampler.kind == 'dance_sde' and dance.sampler.eta == 0.3
  # DDRL: no CFG, the data term on the base's own samples, every other step trained.
  assert (ddrl.prompt.guidance_rollout, ddrl.prompt.guidance_eval) == (1.0, 1.0)
  assert (ddrl.rl.data_weighting, ddrl.rl.data_beta) == ('path_kl', 0.081)    # cosmos-rl's 0.01 in strength
  assert ddrl.rl.cond_dropout == 0.2 and ddrl.rl.data_noise == 'fresh'
  assert ddrl.rl.train_steps == tuple(range(0, 19, 2))
  with pytest.raises(ValueError, match='unknown config arg'):
    module.get_config('grpo')


def test_smoke_variants_shrink_the_model_not_the_recipe():
  for preset in wan1_3b.PRESETS:
    full, smoke = wan1_3b.get_config(preset), wan1_3b.get_config(f'{preset}_smoke')
    assert smoke.algorithm == full.algorithm and smoke.prompt.guidance_rollout == full.prompt.guidance_rollout
    assert smoke.reward.fns.to_dict() == full.reward.fns.to_dict() and smoke.reward.workers == 0
    assert (smoke.wan.model, smoke.wan.vae, smoke.wan.text_encoder) == ('tiny', 'tiny', 'tiny_random')
    assert smoke.wan.vae_overrides.z_dim == 16 and (smoke.batch_size, smoke.num_rollouts) == (2, 2)
    config_lib.validate(smoke, 1)


# ---------------------------------------------------------------------------------------- the task
def test_conditions_and_abstract_conditions_agree():
  task = prompt_task.PromptTask(wan1_3b.get_config('flow_grpo_smoke'))
  assert task.sample_shape == (16, 2, 4, 4) and task.media_shape == (5, 32, 32, 3)
  assert not set(task.train_prompts) & set(task.eval_prompts)
  assert len(task.train_prompts) + len(task.eval_prompts) == len(prompt_task.read_prompts(''))
  cond = task.conditions(jax.random.key(0), 3)
  assert set(cond) == {'text', 'index', 'guidance', 'null_text'}
  np.testing.assert_array_equal(cond['guidance'], 4.5)
  assert task.prompts(cond) == [task.train_prompts[i] for i in np.asarray(cond['index'])]
  abstract = task.abstract_conditions(3)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), cond)
  ev = task.eval_conditions(jax.random.key(1), 6)
  assert task.prompts(ev) == [task.eval_prompts[i % 4] for i in range(6)]
  null = task.encode_prompts([''])['text_embedding']
  np.testing.assert_array_equal(cond['null_text'], np.repeat(null, 3, 0))
  cached = len(task.family._text_cache)                                              # pylint: disable=protected-access
  task.conditions(jax.random.key(0), 3)
  assert len(task.family._text_cache) == cached                                      # pylint: disable=protected-access
  # No CFG (DDRL): just the text and the index.
  plain = prompt_task.PromptTask(wan1_3b.get_config('ddrl_smoke'))
  assert set(plain.conditions(jax.random.key(0), 2)) == set(plain.abstract_conditions(2)) == {'text', 'index'}
  # Records round trip: record_of -> from_records gives the cached embedding and the latent back.
  x = np.random.RandomState(0).randn(*task.sample_shape).astype(np.float32)
  rec = task.record_of(x, task.train_prompts[0])
  c2, x0 = task.from_records({'prompt': [rec['prompt']], 'sample': rec['sample'][None],
                              'text_embedding': rec['text_embedding'][None]}, None)
  np.testing.assert_array_equal(x0[0], x)
  np.testing.assert_array_equal(c2['text'][0], task.encode_prompts([rec['prompt']])['text_embedding'][0])


@pytest.mark.slow
def test_videos_encode_and_decode_through_the_wan_vae():
  task = prompt_task.PromptTask(wan1_3b.get_config('ddrl_smoke'))
  videos = np.random.RandomState(0).randint(0, 256, (3,) + task.media_shape).astype(np.uint8)
  latents = task.encode_samples(videos)
  assert latents.shape == (3,) + task.sample_shape and np.isfinite(latents).all()
  decoded, finite = task.decode(latents)
  assert decoded.shape == (3,) + task.media_shape and decoded.dtype == np.uint8 and finite.all()
  bad = latents.copy()
  bad[1, 0, 0, 0, 0] = np.nan
  assert task.decode(bad)[1].tolist() == [True, False, True]


# ------------------------------------------------------------------------------ video OCR scoring
class _FakeReader:
  """Reads the text written for each frame (frames carry its index in pixel [0, 0, 0])."""

  def __init__(self, texts):
    self.texts = texts

  def __call__(self, image):
    return self.texts[int(image[0, 0, 0])]


def _video(frames):
  v = np.zeros((frames, 4, 4, 3), np.uint8)
  v[:, 0, 0, 0] = np.arange(frames)
  return v


def test_video_ocr_positive_frame_mean():
  """FlowGRPO's video reward: every 4th frame read, only the frames scoring > 0 averaged, 0 if none."""
  prompt = 'a sign that says "abcd"'
  texts = {0: 'abcd', 4: 'zzzz', 8: 'abzz', 1: 'abcd', 2: 'abcd', 3: 'abcd', 5: '', 6: '', 7: ''}
  read = _FakeReader(texts)
  videos = np.stack([_video(9)])                   # frames 0, 4, 8 read: scores 1, 0, 0.5
  all_mean = ocr_reward.score_samples(read, videos, [prompt], 4, 'test')
  positive = ocr_reward.score_samples(read, videos, [prompt], 4, 'test', video_mean='positive')
  np.testing.assert_allclose(all_mean, [0.5])
  np.testing.assert_allclose(positive, [0.75])
  blank = _FakeReader({i: '' for i in range(9)})
  np.testing.assert_array_equal(ocr_reward.score_samples(blank, videos, [prompt], 4, 'test', 'positive'), [0.0])
  # Images are scored as before; an unknown mode is refused.
  assert ocr_reward.score_samples(read, _video(1)[None][:, 0], [prompt], 4, 'test', 'positive')[0] == 1.0
  with pytest.raises(ValueError, match='video_mean'):
    ocr_reward.score_samples(read, videos, [prompt], 4, 'test', 'best')


def test_wan_task_evaluation_readers_share_the_video_mode():
  task = prompt_task.PromptTask(wan1_3b.get_config('flow_grpo_smoke'))
  tess, rapid = prompt_task.readers_of(task.config)
  assert (tess.video_mean, tess.frame_stride) == ('positive', 4)
  assert (rapid.video_mean, rapid.frame_stride) == ('positive', 4)


# ------------------------------------------------------------------------------------- the whole path
def _train(config, workdir):
  trainer = trainer_lib.Trainer(config, str(workdir), devices=jax.devices()[:1])
  trainer.restore_or_init()
  metrics = trainer.train(progress=False)
  return trainer, metrics


@pytest.mark.slow
def test_flow_grpo_smoke_trains_with_tesseract_on_decoded_frames(tmp_path):
  """Rollouts and the policy gradient at guidance 4.5, the tiny Wan VAE decoding 5-frame videos, Tesseract
  scoring every 4th frame (positive-frame mean), the KL to the base, evaluation (both readers and temporal
  smoothness), a checkpoint."""
  trainer, metrics = _train(wan1_3b.get_config('flow_grpo_smoke'), tmp_path / 'w')
  assert int(trainer.state.step) == 2 and trainer.state.ref_params is None        # the base is the ref
  assert np.isfinite(metrics['loss'])
  evaluation = trainer.last_evaluation
  assert evaluation['step'] == 2
  for key in ('eval/ocr', 'eval/ocr_rapid', 'eval/temporal_smoothness'):
    assert np.isfinite(evaluation[key]), evaluation
  with open(tmp_path / 'w' / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  assert any('reward' in r or 'reward_mean' in r for r in rows)
  assert os.path.isdir(tmp_path / 'w' / 'checkpoints' / '2')
  from ddrl_jax import video_io  # pylint: disable=g-import-not-at-top
  mp4s = sorted((tmp_path / 'w' / 'samples').glob('*.mp4'))          # videos one can watch
  assert mp4s, 'the Wan smoke evaluation wrote no MP4'
  frames = video_io.read_mp4(str(mp4s[0]))
  assert frames.shape[0] == 5 and frames.shape[-1] == 3
  # `python -m ddrl_jax.export_lora` on the run: diffusers' WanTransformer3DModel names, merged weights.
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  from ddrl_jax import export_lora  # pylint: disable=g-import-not-at-top
  config = wan1_3b.get_config('flow_grpo_smoke')
  info = export_lora.export(config, tmp_path / 'w', str(tmp_path / 'export'), merged=True,
                            devices=jax.devices()[:1])
  layers = trainer.task.family.dit.num_layers
  assert info['step'] == 2 and info['modules'] == layers * 8     # q, k, v, out of attn1 and attn2
  with safe_open(info['adapters'], 'np') as f:
    assert 'transformer.blocks.0.attn2.to_out.0.lora_A.weight' in f.keys()
  with safe_open(info['merged'], 'np') as f:
    assert 'blocks.0.attn1.to_q.weight' in f.keys() and not any('lora' in k for k in f.keys())


@pytest.mark.slow
def test_ddrl_smoke_regularizes_with_the_bases_own_samples(tmp_path):
  """data.synthesize writes the base's videos' latents with their UMT5 embeddings; DDRL trains on them."""
  config = wan1_3b.get_config('ddrl_smoke')
  prompts = prompt_task.PromptTask(config).train_prompts[:2]
  syn_config = config.copy_and_resolve_references()
  syn_config.batch_size = 4          # synthesize's Trainer takes every device: 4 x 2 slots over the 8 fake ones
  summary = synthesize.synthesize(syn_config, str(tmp_path / 'syn'), prompts=prompts, per_prompt=2, batch=4,
                                  progress=False)
  assert summary['num_records'] == 4
  recs = records.read_all(str(tmp_path / 'syn'))
  assert 'text_embedding' in recs[0] and recs[0]['sample'].shape == (16, 2, 4, 4)
  config.data.path = str(tmp_path / 'syn')
  trainer, metrics = _train(config, tmp_path / 'w')
  assert int(trainer.state.step) == 2
  assert np.isfinite(metrics['loss']) and np.isfinite(metrics['data_loss'])
