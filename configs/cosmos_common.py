"""The DDRL recipe of cosmos-rl's Cosmos-Predict2.5 configs, shared by configs/cosmos2b.py and cosmos14b.py.

Values: nvidia-cosmos/cosmos-rl,
configs/cosmos-predict2-5/cosmos-predict2-5-{2b,14b}-720-reason-embedding-ddrl.toml.

``:smoke`` keeps the architecture and the recipe but shrinks the model (tiny DiT, tiny Wan VAE with the
real 16 latent channels), the video (5 frames = 2 latent frames, 32x32 px), the sampler (T = 4, trained
steps (0, 2)) and the batch (8 groups x N = 2, 8 = the test process's fake devices) so the whole path
(T2V and I2V rollouts, VAE decode, reward, DDRL update, checkpoint) runs on a 2-core CPU.
"""
import ml_collections

from configs import common

PARALLEL = {
    # cosmos-rl: fsdp_shard_size x dp_replicate_size x context_parallel_size.
    'cosmos2b': dict(data=16, fsdp=8, context=2, tensor=1),     # 256 GPUs
    'cosmos14b': dict(data=4, fsdp=32, context=8, tensor=1),    # 1024 GPUs
}


def get_config(model, arg=''):
  """model: 'cosmos2b' or 'cosmos14b'; arg: '' (the paper's recipe) or 'smoke'."""
  if arg not in ('', 'smoke'):
    raise ValueError(f"unknown config arg {arg!r}; known: '' (full recipe), 'smoke'")
  c = common.base_config()
  common.apply_algorithm_preset(c, 'ddrl')
  c.task = 'video'
  common.use_family_rules(c, 'cosmos')
  c.seed = 0
  c.num_iterations = 2001           # trainer.max_iter
  c.batch_size = 16                 # condition groups per optimizer step
  c.num_rollouts = 8                # N: one rollout per data-parallel instance in cosmos-rl
  c.log_every = 1
  c.checkpoint_every = 32           # checkpoint.save_iter
  c.max_checkpoints = 3
  c.eval_every = 0
  c.eval_samples = 128

  s = c.sampler
  s.kind = 'cosmos_2ab'
  s.num_steps = 20
  s.sigma_min, s.sigma_max, s.rho = 0.01, 200.0, 7.0
  s.s_churn, s.s_noise = 1.0, 1.0

  rl = c.rl
  rl.train_steps = tuple(range(0, 19, 2))     # 0, 2, ..., 18
  rl.clip_range = 1e-4
  rl.adv_clip, rl.adv_eps, rl.adv_transform = 5.0, 1e-4, ''
  rl.log_ratio = 'cosmos'
  rl.old_mean = 'rollout'
  rl.data_beta = 0.01
  rl.data_loss_steps = 'full'
  rl.data_noise = 'rollout'                   # use_rl_sigma_and_noise
  rl.cond_dropout = 0.2
  rl.data_weighting = 'cosmos'
  rl.kl_beta = 0.0
  rl.loss_scale = 10.0

  o = c.optim
  o.learning_rate = 1e-5 if model == 'cosmos2b' else 3e-6
  o.b1, o.b2, o.eps, o.weight_decay = 0.9, 0.99, 1e-8, 1e-4
  o.warmup_steps, o.warmup_init_factor = 50, 1e-6
  o.grad_clip = 1.0
  o.ema_power_s = 0.1

  c.mesh = ml_collections.ConfigDict(PARALLEL[model])
  c.sharding.context_impl = 'ulysses'   # cosmos-rl's context parallelism (all-to-all heads <-> sequence)

  # Stand-in reward until a video reward model is wired: temporal smoothness of the decoded video,
  # scored by two local worker processes (cosmos-rl: the dance_grpo VideoAlign service over Redis).
  c.reward.fns = ml_collections.ConfigDict({'temporal_smoothness': 1.0})
  c.reward.chunk_size = 4

  c.cosmos = ml_collections.ConfigDict(dict(
      model=model,                   # CosmosDiTConfig preset
      dit_overrides=ml_collections.ConfigDict(),   # extra CosmosDiTConfig fields
      dtype='bfloat16',              # compute dtype; fp32 master weights (param_dtype)
      param_dtype='float32',
      remat_policy='full',           # selective activation checkpointing on every block
      # Local attention kernel (ddrl_jax/models/attention.py): '' = the platform's (splash on TPU, cuDNN
      # on GPU, xla on CPU); sequences shorter than min_flash_len (the 512 text tokens) stay on xla.
      attention=ml_collections.ConfigDict(dict(kernel='', block_q=512, block_kv=512,
                                               block_kv_compute=512, min_flash_len=4096,
                                               interpret=False)),
      checkpoint='',                 # orbax dir of converted DiT params (models.convert.load_converted)
      cond_timestep=1e-4,            # sigma_conditional / conditional_frame_timestep 0.1 (0-1000 scale)
      i2v_prob=0.5,                  # min/max_num_conditional_frames = 0/1: 50/50 T2V / I2V per group
      frames=93, height=720, width=1280,
      latent_shape=(24, 90, 160),    # (T, H, W) latent of 93 frames at 1280x720
      vae='wan21',
      vae_overrides=ml_collections.ConfigDict(),
      vae_checkpoint='',             # orbax dir of converted Wan2.1 VAE params
      vae_seed=1,
      vae_batch=1,                   # videos per VAE encode/decode call
      data='synthetic',              # moving-square videos (no real dataset loader yet)
      num_videos=64,
      text='bytes',                  # frozen byte embedding (stand-in for Reason1 full_concat)
      text_encoder='',               # text='reason1': diffusers Cosmos-Predict2.5 folder (text_encoder/, tokenizer/)
      text_batch=4,                  # prompts per Reason1 encoder call
      text_length=512,
      text_seed=2,
  ))

  if arg == 'smoke':
    c.num_iterations = 2
    c.batch_size = 8                 # divisible by the 8 fake CPU devices of the tests
    c.num_rollouts = 2
    c.checkpoint_every = 2
    c.eval_every = -1                # no eval before step 0; the trainer still evaluates at the end
    c.eval_samples = 16
    s.num_steps = 4
    rl.train_steps = (0, 2)
    o.warmup_steps = 1
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, context=1, tensor=1))
    cc = c.cosmos
    cc.model = 'tiny'
    cc.dtype = 'float32'
    cc.remat_policy = 'none'
    cc.frames, cc.height, cc.width = 5, 32, 32
    cc.latent_shape = (2, 4, 4)
    cc.vae = 'tiny'
    cc.vae_overrides = ml_collections.ConfigDict(dict(
        z_dim=16, latents_mean=tuple(_wan_mean()), latents_std=tuple(_wan_std())))
    cc.vae_batch = 16
    cc.num_videos = 16
    cc.text_length = 16
  return c


def _wan_mean():
  from ddrl_jax.models.wan import vae as wan_vae  # pylint: disable=g-import-not-at-top
  return wan_vae.WAN21_LATENTS_MEAN


def _wan_std():
  from ddrl_jax.models.wan import vae as wan_vae  # pylint: disable=g-import-not-at-top
  return wan_vae.WAN21_LATENTS_STD
