"""The Cosmos video task end to end at toy size, the I2V frame replacement, and the full DDRL configs."""
import json
import math
import os
import shutil

import chex

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import cosmos14b
from configs import cosmos2b
from ddrl_jax import config as config_lib
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.parallel import mesh as mesh_lib
from ddrl_jax.sampling import transitions
from ddrl_jax.tasks import video


@pytest.fixture(scope='module')
def smoke_task():
  task = video.CosmosVideo(cosmos2b.get_config('smoke'))
  apply_fn, params = task.init_model(jax.random.key(0))
  return task, apply_fn, params


# ------------------------------------------------------------------------------------------ smoke run
def _params(trainer):
  return jax.device_get(nnx.to_pure_dict(trainer.state.params))


@pytest.mark.slow
def test_smoke_trains_t2v_and_i2v_and_resumes_on_other_meshes(tmp_path):
  """FSDP 4 x data 2 (the tiny DiT's parameters over 4 devices) for 3 iterations; its step-1 checkpoint
  resumes on 1 device to step 2, and that checkpoint back on the FSDP mesh to step 3: equal to the
  uninterrupted run."""
  config = cosmos2b.get_config('smoke')
  assert config.task == 'video' and config.num_iterations == 2
  config.mesh.update(dict(data=2, fsdp=4))
  config.num_iterations, config.checkpoint_every = 3, 1
  run = tmp_path / 'run'
  trainer = trainer_lib.Trainer(config, run)
  last = trainer.train(progress=False)
  assert last, 'no training step ran'
  kernel = trainer.state.params['blocks']['mlp']['layer1']['kernel'].get_value()
  assert len({str(s.index) for s in kernel.addressable_shards}) == 4      # sharded over fsdp
  assert trainer.sharding_report['params']['per_device_bytes'] < \
      0.3 * trainer.sharding_report['params']['total_bytes']

  moved = tmp_path / 'moved'
  shutil.copytree(run / 'checkpoints', moved / 'checkpoints')
  for step in (2, 3):
    shutil.rmtree(moved / 'checkpoints' / str(step))
  one = cosmos2b.get_config('smoke')
  one.num_iterations, one.checkpoint_every = 2, 1
  one.mesh.data = 1
  single = trainer_lib.Trainer(one, moved, devices=jax.devices()[:1])
  single.train(progress=False)
  back = trainer_lib.Trainer(config, moved)
  back.train(progress=False)
  assert back.ckpt.latest_step() == 3
  chex.assert_trees_all_close(_params(back), _params(trainer), rtol=1e-4, atol=1e-6)

  lines = [json.loads(l) for l in open(os.path.join(run, 'metrics.jsonl'))]
  train = [l for l in lines if 'loss' in l]
  assert [l['step'] for l in train] == [1, 2, 3]
  for l in train:
    for k in ('loss', 'data_loss', 'reward_mean', 'pg_loss'):
      assert math.isfinite(l[k]), (k, l)
    assert l['failed_rewards'] == 0
    assert -1.0 <= l['reward_mean'] <= 0.0       # temporal smoothness of a uint8 video
  assert trainer.ckpt.latest_step() == 3

  # Both modes occurred among the 2 x 8 training groups, and every I2V rollout ended on the GT frame.
  modes = np.concatenate(trainer.task.cond_log[:2])
  assert modes.shape == (16,) and set(modes.tolist()) == {0, 1}
  # ... and each step's metrics count them (the T2V:I2V mix of its 8 groups).
  for l, mode in zip(train[:2], trainer.task.cond_log[:2]):
    assert (l['cond_i2v'], l['cond_t2v']) == (float(mode.sum()), float(8 - mode.sum())), l
  assert len(trainer.task.i2v_frame0_err) >= 1
  assert max(trainer.task.i2v_frame0_err) < 1e-5


# ------------------------------------------------------------------------------------ frame replace
def test_i2v_x0_prediction_equals_gt(smoke_task):
  task, apply_fn, params = smoke_task
  rng = np.random.RandomState(0)
  b = 4
  latents = task.dataset_latents()
  gt_video = jnp.asarray(latents[:b])
  noise = jnp.asarray(rng.randn(*gt_video.shape).astype(np.float32))
  t = jnp.asarray([0.9, 0.5, 0.1, 0.0099], jnp.float32)
  tb = t.reshape(-1, 1, 1, 1, 1)
  # A state whose frame 0 is *not* on the GT path (as after churn): replacement must not rely on it.
  x_t = (1 - tb) * gt_video + tb * noise + 0.3 * jnp.asarray(rng.randn(*gt_video.shape), jnp.float32)
  text = jnp.asarray(task.prompt_embeddings()[:b])
  cond = dict(text=text, first_frame=gt_video[:, :, :1], num_cond=jnp.asarray([1, 1, 1, 0]),
              index=jnp.arange(b))
  v = jax.jit(apply_fn)(params, x_t, t, cond)
  x0_hat = x_t - tb * v
  np.testing.assert_allclose(x0_hat[:3, :, :1], gt_video[:3, :, :1], rtol=0, atol=2e-6)
  assert float(jnp.abs(x0_hat[3, :, :1] - gt_video[3, :, :1]).max()) > 1e-2   # T2V: no replacement
  assert float(jnp.abs(x0_hat[:3, :, 1:] - gt_video[:3, :, 1:]).max()) > 1e-2  # only frame 0

  # The sampler's form: x0 = (1 - t) x_sigma - t v with the net input (1 - t) x_sigma.
  x_sigma = x_t / (1 - tb)
  v2 = jax.jit(apply_fn)(params, (1 - tb) * x_sigma, t, cond)
  x0_sampler = transitions.cosmos_x0(x_sigma, v2, tb)
  np.testing.assert_allclose(x0_sampler[:3, :, :1], gt_video[:3, :, :1], rtol=0, atol=2e-6)

  # On the data path x_t = (1 - t) x0 + t eps the replaced velocity is cosmos' eps - gt (zero loss).
  on_path = (1 - tb) * gt_video + tb * noise
  v3 = jax.jit(apply_fn)(params, on_path, t, cond)
  np.testing.assert_allclose(v3[:3, :, :1], (noise - gt_video)[:3, :, :1], rtol=1e-5, atol=1e-4)

  # Text dropout (zeroed 'text') keeps the frame condition.
  v4 = jax.jit(apply_fn)(params, x_t, t, dict(cond, text=jnp.zeros_like(text)))
  np.testing.assert_allclose((x_t - tb * v4)[:3, :, :1], gt_video[:3, :, :1], rtol=0, atol=2e-6)


def test_task_shapes_and_restore_structure(smoke_task):
  task, _, params = smoke_task
  assert task.sample_shape == (16, 2, 4, 4)
  assert task.video_shape == (3, 5, 32, 32)
  cond = task.conditions(jax.random.key(1), 8)
  assert cond['text'].shape == (8, 16, task.text_dim)
  assert cond['first_frame'].shape == (8, 16, 1, 4, 4)
  x0 = task.data(jax.random.key(2), cond)
  assert x0.shape == (8,) + task.sample_shape
  np.testing.assert_array_equal(x0[:, :, :1], cond['first_frame'])   # data and I2V frame are paired
  _, abstract = task.abstract_params(jax.random.key(0))
  assert jax.tree.structure(abstract) == jax.tree.structure(params)
  assert [a.shape for a in jax.tree.leaves(abstract)] == [p.shape for p in jax.tree.leaves(params)]
  samples = np.concatenate([np.asarray(x0), np.full_like(np.asarray(x0), np.nan)])
  slots = jax.tree.map(lambda a: np.concatenate([a, a]), cond)
  videos, valid = task.reward_inputs(samples, slots)
  prompts = task.prompts(slots)
  assert videos.shape == (16, 5, 32, 32, 3) and videos.dtype == np.uint8
  assert prompts[:8] == prompts[8:] and all(isinstance(p, str) and p for p in prompts)
  np.testing.assert_array_equal(valid, [True] * 8 + [False] * 8)


# -------------------------------------------------------------------------------------- full configs
@pytest.mark.parametrize('module,lr,devices,mesh,dit', [
    (cosmos2b, 1e-5, 256, (16, 8, 2, 1), (2048, 28, 16)),
    (cosmos14b, 3e-6, 1024, (4, 32, 8, 1), (5120, 36, 40)),
])
def test_full_config_recipe(module, lr, devices, mesh, dit):
  c = module.get_config()
  assert c.algorithm == 'ddrl' and c.task == 'video'
  assert (c.batch_size, c.num_rollouts) == (16, 8)
  assert config_lib.sampler_kind(c) == 'cosmos_2ab'
  s = c.sampler
  assert (s.num_steps, s.sigma_min, s.sigma_max, s.rho, s.s_churn) == (20, 0.01, 200.0, 7.0, 1.0)
  assert config_lib.train_steps(c) == tuple(range(0, 19, 2))
  rl = c.rl
  assert (rl.data_beta, rl.kl_beta, rl.clip_range, rl.loss_scale) == (0.01, 0.0, 1e-4, 10.0)
  assert (rl.cond_dropout, rl.data_noise, rl.data_loss_steps, rl.log_ratio) == (0.2, 'rollout', 'full',
                                                                               'cosmos_rl')
  o = c.optim
  assert (o.learning_rate, o.b1, o.b2, o.weight_decay, o.eps) == (lr, 0.9, 0.99, 1e-4, 1e-8)
  assert (o.warmup_steps, o.warmup_init_factor, o.grad_clip, o.ema_power_s) == (50, 1e-6, 1.0, 0.1)
  assert mesh_lib.mesh_shape(c.mesh, devices) == mesh
  cc = c.cosmos
  assert (cc.i2v_prob, cc.cond_timestep, cc.dtype, cc.param_dtype) == (0.5, 1e-4, 'bfloat16', 'float32')
  task = video.CosmosVideo(c)        # lazy: builds no VAE, data or model
  assert task.sample_shape == (16, 24, 90, 160)
  assert task.video_shape == (3, 93, 720, 1280)
  dit_cfg = task.family.dit
  assert (dit_cfg.model_channels, dit_cfg.num_blocks, dit_cfg.num_heads) == dit
  assert dit_cfg.dtype == jnp.bfloat16 and dit_cfg.param_dtype == jnp.float32


@pytest.mark.parametrize('module,devices', [(cosmos2b, 256), (cosmos14b, 1024)])
def test_full_config_validates(module, devices):
  assert config_lib.validate(module.get_config(), devices) == mesh_lib.mesh_shape(
      module.get_config().mesh, devices)


def test_smoke_config_validates_on_test_devices():
  c = cosmos2b.get_config('smoke')
  config_lib.validate(c, len(jax.devices()))
  config_lib.validate(cosmos14b.get_config('smoke'), len(jax.devices()))


# ------------------------------------------------------------------------------ records as the data
@pytest.mark.slow
def test_smoke_trains_on_prepared_records(tmp_path):
  from ddrl_jax.data import prepare  # pylint: disable=g-import-not-at-top
  config = cosmos2b.get_config('smoke')
  config.num_iterations = 1
  task = video.CosmosVideo(config)
  source = tmp_path / 'videos'
  source.mkdir()
  _, f, h, w = task.video_shape
  for i in range(8):
    clip = video.render_square_video(i, f, h, w)                      # (3, F, H, W) in [-1, 1]
    u8 = np.round((clip.transpose(1, 2, 3, 0) + 1) * 127.5).astype(np.uint8)
    np.save(source / f'clip{i}.npy', u8)
    (source / f'clip{i}.txt').write_text(video.PROMPTS[i][0])
  summary = prepare.prepare(str(source), str(tmp_path / 'records'), task, batch=4)
  assert summary['num_records'] == 8
  config.data.path = str(tmp_path / 'records')
  trainer = trainer_lib.Trainer(config, tmp_path / 'run')
  last = trainer.train(progress=False)
  assert last['data_records_seen'] == 8 and last['failed_rewards'] == 0
  assert math.isfinite(last['data_loss']) and math.isfinite(last['loss'])
