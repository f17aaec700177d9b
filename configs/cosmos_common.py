"""Cosmos-Predict2.5 post-training presets: the DDRL paper's Table 1 cells (arXiv 2512.04332) and its
baselines, shared by configs/cosmos2b.py and cosmos14b.py.

  --config=configs/cosmos2b.py[:<algorithm>[_<reward>]]     algorithm: ddrl (default), dance_grpo, flow_grpo
                                                           reward: videoalign (default), vbench
  --config=configs/cosmos2b.py:<algorithm>_smoke           the same path at toy size on a CPU

DDRL's values: nvidia-cosmos/cosmos-rl,
configs/cosmos-predict2-5/cosmos-predict2-5-{2b,14b}-720-reason-embedding-ddrl.toml, and the paper's section
4.1: AdamW (0.9, 0.99), lr 1e-5 (2B) / 3e-6 (14B), 16 prompts x 8 rollouts, data_beta 0.01, T = 20 with the
10 even steps trained, no guidance in rollouts; the regularizing data are captioned videos (< 8000) with
text-to-video and image-to-video mixed 1:1 (config.cosmos.i2v_prob 0.5). Evaluation as the paper's
PAI-Bench: 35 steps, guidance 7 (2B) / 3 (14B) against diffusers' default negative prompt.

Rewards (config.reward): 'videoalign' (VideoReward VQ/MQ/TA; the paper's number is their mean; cosmos-rl
trains on the sum clipped to +-5, `--config.reward.kwargs.videoalign.key=sum`) or 'vbench' (the mean of
VBench's five quality dimensions). Both are configured in config.reward.kwargs, so evaluation reports both
(config.cosmos.eval_rewards) whichever one trains. They run in PyTorch on GPUs: with the local backend on the
trainer's hosts (device 'cuda'), or on a separate GPU pool behind the Redis service for a TPU pod
(launch/README.md, "Rewards on GPUs for a TPU run").

Baselines, as the paper ran them inside cosmos-rl's WFM trainer, whose only knobs are kl_beta and
data_beta (same sampler, log-ratio and advantage): the paper's baseline table gives
  dance_grpo: T = 20, |T| = 12 random trained steps per rollout (of the first 19), beta 0, no reference;
  flow_grpo:  T = 10, KL to the frozen reference with beta in [0.001, 0.1] (0.01 here, cosmos-rl's
              2b-480-grpo value; sweep with --config.rl.kl_beta), trained steps 0..8: the paper's table says
              |T| = 10, but the last step of the 2ab sampler is deterministic, so it has no log-probability.
Neither uses data; both still read the records for their prompts and first frames.

Inputs (the run stops in one line naming whichever is missing, ddrl_jax/preflight.py): converted DiT and VAE
weights (`python -m ddrl_jax.models.convert`), the Reason1 text encoder (the diffusers Cosmos-Predict2.5
folder), records prepared from captioned videos (`python -m ddrl_jax.data.prepare --text=none`), the
evaluation prompt file, and the reward models (config.reward.kwargs.*). README.md walks through them.

`:smoke` keeps each algorithm's recipe but shrinks the model (tiny DiT, tiny Wan VAE with the real 16 latent
channels), the video (5 frames = 2 latent frames, 32x32 px), the sampler (T = 4) and the batch (8 groups x
N = 2, 8 = the test process's fake devices), and trains on the stand-ins that need no downloads: moving-square
videos, a byte embedding for text, and a temporal-smoothness reward (tests/test_cosmos_paper_smoke.py runs
the real rewards, text encoder and records at that size).
"""
import ml_collections

from configs import common
from ddrl_jax.models.cosmos import family as cosmos_family

PARALLEL = {
    # cosmos-rl: fsdp_shard_size x dp_replicate_size x context_parallel_size.
    'cosmos2b': dict(data=16, fsdp=8, context=2, tensor=1),     # 256 GPUs
    'cosmos14b': dict(data=4, fsdp=32, context=8, tensor=1),    # 1024 GPUs
}


ALGORITHMS = ('ddrl', 'dance_grpo', 'flow_grpo')
REWARDS = ('videoalign', 'vbench')
GUIDANCE_EVAL = {'cosmos2b': 7.0, 'cosmos14b': 3.0}     # the paper's PAI-Bench evaluation
EVAL_STEPS = 35


def split_arg(arg):
  """'<algorithm>[_<reward>][_smoke]' -> (algorithm, reward, smoke); '' is ddrl with videoalign."""
  smoke = arg == 'smoke' or arg.endswith('_smoke')
  rest = '' if arg == 'smoke' else arg[:-len('_smoke')] if smoke else arg
  reward = 'videoalign'
  for name in REWARDS:
    if rest == name or rest.endswith('_' + name):
      reward, rest = name, rest[:-len(name)].rstrip('_')
  algorithm = rest or 'ddrl'
  if algorithm not in ALGORITHMS:
    raise ValueError(f'unknown config arg {arg!r}; known: <algorithm>[_<reward>][_smoke] with algorithm '
                     f'in {ALGORITHMS}, reward in {REWARDS} (e.g. ddrl_vbench, flow_grpo_smoke)')
  return algorithm, reward, smoke


def reward_section(c, reward):
  """config.reward for the paper's rewards: `reward` trains; both are configured for evaluation."""
  c.reward.fns = ml_collections.ConfigDict({reward: 1.0})
  c.reward.kwargs = ml_collections.ConfigDict({
      # VideoReward release folder (model_config.json + checkpoint-<step>/); base_model: its
      # model_name_or_path (Qwen/Qwen2-VL-2B-Instruct) unless given. 93 frames made at 16 fps.
      'videoalign': dict(checkpoint='', device='cuda', dtype='bfloat16', key='mean', fps=16.0),
      # VBench's weights files ('' = its cache, $VBENCH_CACHE_DIR or ~/.cache/vbench).
      'vbench': dict(weights_dir='', device='cuda'),
  })
  c.reward.workers = 2
  c.reward.chunk_size = 4
  c.reward.chunk_timeout_s = 600.0


def get_config(model, arg=''):
  """model: 'cosmos2b' or 'cosmos14b'; arg: see the module docstring."""
  algorithm, reward, smoke = split_arg(arg)
  c = common.base_config()
  common.apply_algorithm_preset(c, algorithm)
  c.task = 'video'
  common.use_family_rules(c, 'cosmos')
  c.seed = 0
  c.require_inputs = True
  c.num_iterations = 2001           # trainer.max_iter
  c.batch_size = 16                 # condition groups per optimizer step
  c.num_rollouts = 8                # N: one rollout per data-parallel instance in cosmos-rl
  c.log_every = 1
  c.checkpoint_every = 32           # checkpoint.save_iter
  c.max_checkpoints = 3
  c.eval_every = 0
  c.eval_samples = 128

  s = c.sampler
  s.kind = 'cosmos_2ab'             # every algorithm: cosmos-rl's sampler (the baselines ran in it too)
  s.num_steps = 20
  s.sigma_min, s.sigma_max, s.rho = 0.01, 200.0, 7.0
  s.s_churn, s.s_noise = 1.0, 1.0
  s.eval_num_steps = EVAL_STEPS

  rl = c.rl
  rl.clip_range = 1e-4
  rl.adv_clip, rl.adv_eps, rl.adv_transform = 5.0, 1e-4, ''
  rl.adv_normalization = 'cosmos_rl'
  rl.drop_zero_advantages = False
  rl.log_ratio = 'cosmos_rl'
  rl.old_mean = 'rollout'
  rl.loss_scale = 10.0
  rl.kl_beta = 0.0
  if algorithm == 'ddrl':
    rl.train_steps = tuple(range(0, 19, 2))     # 0, 2, ..., 18
    rl.data_beta = 0.01
    rl.data_loss_steps = 'full'
    rl.data_noise = 'rollout'                   # use_rl_sigma_and_noise
    rl.cond_dropout = 0.2
    rl.data_weighting = 'cosmos_rl'
  elif algorithm == 'dance_grpo':
    rl.train_steps = tuple(range(19))           # candidates; 12 drawn per rollout
    rl.train_fraction = 0.65                    # int(0.65 * 19) = 12
  else:                                         # flow_grpo
    s.num_steps = 10
    rl.train_steps = tuple(range(9))
    rl.kl_beta = 0.01
    rl.kl_form = 'exact'

  o = c.optim
  o.learning_rate = 1e-5 if model == 'cosmos2b' else 3e-6
  o.b1, o.b2, o.eps, o.weight_decay = 0.9, 0.99, 1e-8, 1e-4
  o.warmup_steps, o.warmup_init_factor = 50, 1e-6
  o.grad_clip = 1.0
  o.ema_power_s = 0.1

  c.mesh = ml_collections.ConfigDict(PARALLEL[model])
  c.sharding.context_impl = 'ulysses'   # cosmos-rl's context parallelism (all-to-all heads <-> sequence)
  reward_section(c, reward)

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
      checkpoint='',                 # orbax dir of converted DiT params (models.convert --model=<model>)
      cond_timestep=1e-4,            # sigma_conditional / conditional_frame_timestep 0.1 (0-1000 scale)
      i2v_prob=0.5,                  # min/max_num_conditional_frames = 0/1: 50/50 T2V / I2V per group
      frames=93, height=720, width=1280,
      latent_shape=(24, 90, 160),    # (T, H, W) latent of 93 frames at 1280x720
      vae='wan21',
      vae_overrides=ml_collections.ConfigDict(),
      vae_checkpoint='',             # orbax dir of converted Wan2.1 VAE params (--model=wan21_vae)
      vae_seed=1,
      vae_batch=1,                   # videos per VAE encode/decode call
      data='records',                # config.data.path: records of captioned videos (data.prepare)
      num_videos=64,                 # data='synthetic' (smoke): moving-square videos
      text='reason1',                # Cosmos-Reason1 full_concat embeddings, computed online
      text_encoder='',               # diffusers Cosmos-Predict2.5 folder (text_encoder/, tokenizer/)
      text_encoder_overrides=ml_collections.ConfigDict(),   # Qwen25TextConfig fields (aot without weights)
      text_batch=4,                  # prompts per Reason1 encoder call
      text_length=512,
      text_seed=2,
      eval_prompts='',               # prompt file: prompt, category, optional first frame (PAI-Bench)
      guidance_eval=GUIDANCE_EVAL[model],   # Cosmos CFG: v_c + w (v_c - v_neg); 0 = none
      negative_prompt=cosmos_family.NEGATIVE_PROMPT,
      eval_rewards=REWARDS,          # what `python -m ddrl_jax.evaluate` reports (config.reward.kwargs)
  ))

  if smoke:
    shrink_for_smoke(c, algorithm)
  return c


def shrink_for_smoke(c, algorithm):
  """The CPU size of a preset, on stand-ins that need no downloads (see the module docstring)."""
  c.require_inputs = False
  c.num_iterations = 2
  c.batch_size = 8                 # divisible by the 8 fake CPU devices of the tests
  c.num_rollouts = 2
  c.checkpoint_every = 2
  c.eval_every = -1                # no eval before step 0; the trainer still evaluates at the end
  c.eval_samples = 16
  s, rl = c.sampler, c.rl
  s.num_steps = 4
  s.eval_num_steps = 0             # evaluate with the training sampler
  rl.train_steps = {'ddrl': (0, 2), 'dance_grpo': (0, 1, 2), 'flow_grpo': (0, 1, 2)}[algorithm]
  c.optim.warmup_steps = 1
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, context=1, tensor=1))
  c.reward.fns = ml_collections.ConfigDict({'temporal_smoothness': 1.0})
  c.reward.kwargs = ml_collections.ConfigDict()
  c.reward.chunk_size = 4
  c.reward.chunk_timeout_s = 120.0
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
  cc.data = 'synthetic'
  cc.num_videos = 16
  cc.text = 'bytes'
  cc.text_length = 16
  cc.eval_rewards = ('temporal_smoothness',)


def _wan_mean():
  from ddrl_jax.models import video_vae  # pylint: disable=g-import-not-at-top
  return video_vae.WAN21_LATENTS_MEAN


def _wan_std():
  from ddrl_jax.models import video_vae  # pylint: disable=g-import-not-at-top
  return video_vae.WAN21_LATENTS_STD
