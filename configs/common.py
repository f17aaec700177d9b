"""Defaults shared by every config, and the algorithm presets selected with ``--config=...:<preset>``."""
import ml_collections

from ddrl_jax.parallel import rules


def base_config():
  """Every key the trainer reads, with cosmos-rl's DDRL defaults (nvidia-cosmos/cosmos-rl, cosmos_rl/policy/config and
  configs/cosmos-predict2-5/*-ddrl.toml), except rl.data_weighting: 'path_kl', not cosmos-rl's t^2 + (1-t)^2
  (presets that reproduce cosmos-rl name 'cosmos_rl')."""
  c = ml_collections.ConfigDict()
  c.task = ''
  # The network (ddrl_jax/models/family.py FAMILIES); '' = the task's own (toy2d: mlp, ocr: cosmos_t2i,
  # video: cosmos). Its options live in the task's section (config.toy2d, .ocr, .cosmos).
  c.model_family = ''
  c.algorithm = 'ddrl'
  c.seed = 0
  c.num_iterations = 1000       # optimizer steps (one per rollout batch)
  c.batch_size = 16             # B condition groups per step
  c.num_rollouts = 8            # N rollouts per group
  # Rollout slots per data-parallel position per chunk: the rollouts and the update run the B*N slots in
  # chunks of micro_batch per device (a scan; gradients accumulated exactly), so memory follows the chunk,
  # not the batch. 0: one chunk (the whole batch at once). Must divide B*N / (mesh data x fsdp).
  c.micro_batch = 0
  c.log_every = 1
  c.checkpoint_every = 32
  c.max_checkpoints = 3
  c.eval_every = 0              # 0: only at the end
  c.eval_samples = 1024
  c.eval_videos = 4             # video tasks: MP4s of the first this many evaluation samples (0: none)
  c.eval_video_fps = 8          # their frame rate (and the TensorBoard GIF's)
  c.max_nonfinite_steps = 3     # this many updates in a row with a non-finite loss/params: stop
  c.checkpoint_checksums = True # record each checkpoint's file sizes and sha256 (checked on resume)
  # True (full-size presets): refuse to start, in one line, while the weights, data or reward models the
  # task lists are missing (ddrl_jax/preflight.py); False runs with random weights.
  c.require_inputs = False
  c.skip_memory_check = False   # True: build even when the train state alone exceeds the devices' memory

  c.sampler = ml_collections.ConfigDict(dict(
      kind='',                  # '' = the algorithm's default (ddrl: cosmos_2ab, flow_grpo: flow_sde, ...)
      num_steps=20, sigma_min=0.01, sigma_max=200.0, rho=7.0, s_churn=1.0, s_noise=1.0,
      shift=3.0, noise_level=0.7, eta=0.3,
      # Evaluation's sampler: eval_num_steps > 0 samples with that many steps (FlowGRPO: 10 to train, 40
      # to evaluate), eval_deterministic without noise (FlowGRPO evaluates at noise_level 0); the
      # defaults evaluate with the training sampler.
      eval_num_steps=0, eval_deterministic=False))

  c.rl = ml_collections.ConfigDict(dict(
      train_steps=ml_collections.FieldReference(None, field_type=tuple),  # None: algorithm default
      train_fraction=0.6,       # random-step algorithms: fraction of the candidate steps per rollout
      clip_range=1e-4,
      adv_clip=5.0, adv_eps=1e-4,
      adv_normalization='cosmos_rl',  # 'cosmos_rl', 'flow_grpo', 'dance_grpo' (ddrl_jax/rl/advantages.py)
      adv_global_std=True,      # 'flow_grpo' normalization: std of the whole batch (else per prompt)
      adv_transform='',         # '' (z-score), 'neg_exp' (-exp(-A)), 'exact' (-exp(-(r - Z)/beta))
      failed_advantage='zero',  # failed samples: 'zero' (A = 0) or 'transformed_zero' (cosmos-rl: lambda(0))
      exact_beta=1.0,           # beta of the 'exact' transform
      exact_log_partition=ml_collections.FieldReference(None, field_type=float),  # Z; None: group est.
      log_ratio='',             # '' = algorithm default ('cosmos_rl' for ddrl, 'gaussian' otherwise)
      old_mean='rollout',       # 'rollout' (stored means) or 'detached' (exactly on-policy ratio)
      drop_zero_advantages=False,  # FlowGRPO: rollouts with advantage exactly 0 leave the update
      pg_weight=1.0,            # the policy gradient's weight; 0 = a data-term-only (or KL-only) control
      data_beta=0.01,
      data_loss_steps='full',   # 'full', 'first' (cosmos-rl data_on_first_only) or 'random_step'
      data_noise='rollout',     # 'rollout' or 'fresh'
      cond_dropout=0.2,
      # 'path_kl' (the sampler's exact per-step path-KL weight), 'cosmos_rl' (t^2+(1-t)^2), 'eps_mse'
      # (the paper's Algorithm 1, (1-t)^2) or 'none'. The one default that is not cosmos-rl's: its weighting
      # collapsed DDRL on a base off the data at equal total weight (issue 45, README "DDRL's data term").
      data_weighting='path_kl',
      kl_beta=0.0,
      kl_form='exact',          # 'exact' (Gaussian step KL) or 'flow_grpo' (FlowGRPO's code: x |dt|)
      loss_scale=10.0,
      nft_beta=1.0,             # diffusion_nft: the mixing strength of its implicit +/- policies
      nft_old_decay=1))         # diffusion_nft: the old policy's EMA schedule (rl/nft.OLD_DECAY_SCHEDULES)

  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=1e-5, b1=0.9, b2=0.99, eps=1e-8, weight_decay=1e-4,
      warmup_steps=50, warmup_init_factor=1e-6, grad_clip=1.0,
      ema_power_s=0.1))         # power EMA as cosmos-rl; None disables

  # Low-rank adapters (ddrl_jax/models/lora.py). rank 0 = full fine-tuning. With rank r > 0 only the
  # adapters train (optimizer moments, EMA and DiffusionNFT's old policy are adapter-sized) and the base
  # stays frozen; FlowGRPO's KL reference is the base itself. targets: regexes matched in full against
  # dense-layer paths; the default is the attention projections of the Cosmos DiT's blocks (self and
  # cross), i.e. diffusers' transformer_blocks.*.attn1/attn2.to_q/to_k/to_v/to_out.0.
  c.lora = ml_collections.ConfigDict(dict(
      rank=0, alpha=0.0,        # forward scale alpha / rank; alpha 0 means alpha = rank
      targets=(r'(.*\.)?blocks\.(self_attn|cross_attn)\.(q_proj|k_proj|v_proj|output_proj)',),
      init='kaiming'))          # 'kaiming' (peft's default) or 'gaussian' (N(0, 1/r^2), flow_grpo's)

  # Paired data from record shards (ddrl_jax.data: prepare / synthesize write them). '' = the task's
  # built-in data. Each record gives one condition group: its prompt/text and its clean sample.
  c.data = ml_collections.ConfigDict(dict(
      path='',                  # shard files, a directory or a glob
      shuffle=True,
      skip_bad=False,           # True: skip (count, log) corrupt or mis-shaped records
      worker_count=0,           # grain decode processes (0: in the trainer process)
      # DDRL without data.path: > 0 samples this many records of the base model (the evaluation sampler,
      # over the task's training prompts in turn) into the workdir before the first update, resumably
      # (the paper's SD3.5 setting: the data term on the base's own samples). 0 = the task's own data.
      base_samples=0,
      base_samples_dir=''))     # '' = <workdir>/base_samples; set it for a bucket (gs://) workdir

  # Rewards on decoded samples (ddrl_jax.rewards): name -> weight, factory kwargs, combination, and the
  # asynchronous service that scores them while the trainer computes the data term.
  c.reward = ml_collections.ConfigDict(dict(
      fns=ml_collections.ConfigDict(),     # e.g. {'ocr': 1.0}; the columns of the reward matrix
      kwargs=ml_collections.ConfigDict(),  # name -> factory kwargs, e.g. {'ocr': {'upscale': 2}}
      # name -> (low, high): a score outside is a failure, never trained on (default: the reward's
      # reference scale, ddrl_jax/rewards/registry.py SCORE_BOUNDS).
      bounds=ml_collections.ConfigDict(),
      combine='advantage_mean',            # 'advantage_mean' (cosmos-rl) or 'weighted_sum'
      imports=(),                          # modules registering custom rewards (trainer + workers)
      backend='local',                     # 'local' (worker processes here) or 'redis'
      workers=2,                           # local worker processes; 0 = a thread, no isolation
      chunk_size=16,                       # samples per worker request
      chunk_timeout_s=120.0,               # a worker silent this long is killed (NaN, counted)
      timeout_s=600.0,                     # a batch not scored this long after submission -> NaN
      max_failed_batches=3,                # this many batches in a row with no score: stop
      redis_url='redis://localhost:6379/0',
      token_env='DDRL_REWARD_TOKEN',       # environment variable holding the bearer token
      retries=3,                           # Redis connection retries (exponential backoff)
      no_server_grace_s=60.0,              # redis: no live reward server this long -> the batch fails
      task_ttl_s=3600))

  # Mesh sizes; -1 fills with the remaining devices. Batches shard their B axis over (data, fsdp).
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, context=1, tensor=1))

  # How parameters and activations map onto the mesh (ddrl_jax/parallel/rules.py): logical axis name ->
  # comma-separated mesh axes ('' = replicated), e.g. --config.sharding.rules.embed=fsdp,context.
  c.sharding = ml_collections.ConfigDict(dict(
      rules=ml_collections.ConfigDict(dict(rules.DEFAULT_RULES)),
      fsdp_axes='fsdp',              # 'fsdp,context': FSDP over fsdp x context devices (maxdiffusion)
      context_impl='none',           # self-attention on a context-sharded sequence: none, ulysses, ring
      max_replicated_fraction=0.02))  # more replicated parameter bytes than this on an FSDP mesh: error
  return c


def use_family_rules(config, family):
  """Merges the model family's own logical axis names into config.sharding.rules (so the command line
  can override them, e.g. --config.sharding.rules.act_frames=)."""
  from ddrl_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top
  config.sharding.rules.update(family_lib.logical_rules(family))


def shrink_for_smoke(config, preset):
  """The CPU smoke size of a prompt-task recipe (configs/sd35m.py, wan_common.py): 2 iterations of 2 groups
  x 2 rollouts, 4 sampler steps (6 to evaluate, at the end only), DDRL training steps 0 and 2, rewards
  scored in a thread, LoRA rank 4. The model section is shrunk by the caller."""
  config.require_inputs = False    # tiny random models on purpose
  config.num_iterations = 2
  config.batch_size = 2
  config.num_rollouts = 2
  config.checkpoint_every = 2
  config.eval_every = -1
  config.eval_samples = 4
  config.sampler.num_steps = 4
  config.sampler.eval_num_steps = 6
  if preset == 'ddrl':
    config.rl.train_steps = (0, 2)
  config.reward.workers = 0
  config.reward.chunk_size = 4
  config.lora.rank = 4
  config.lora.alpha = 8
  if config.data.base_samples:
    config.data.base_samples = config.num_iterations * config.batch_size


# Each baseline preset follows one public recipe; the comment block above its branch names the
# repository and file whose arithmetic it reproduces, and what differs.
PRESETS = ('ddrl', 'ddrl_reduced', 'ddrl_reduced_random', 'ddrl_exact', 'flow_grpo',
           'flow_grpo_exact_kl', 'dance_grpo', 'diffusion_nft', 'ddpo')


def apply_algorithm_preset(config, preset):
  """Sets the algorithm and its recipe-specific keys. Unknown presets raise naming the choices."""
  if preset not in PRESETS:
    raise ValueError(f'unknown config preset {preset!r}; known: {PRESETS}')
  rl = config.rl
  if preset == 'ddrl':
    config.algorithm = 'ddrl'
    rl.data_loss_steps = 'full'
  elif preset == 'ddrl_reduced':
    # cosmos-rl's `data_on_first_only` (nvidia-cosmos/cosmos-rl cosmos_rl/policy/trainer/wfm_trainer.py,
    # `rl_training_step`): the data term only at the first trained step (cosmos-rl's timesteps == 0, the
    # first entry of train_on, sigma_hat = 209.5 for the 2B recipe), and since `training_step` divides
    # each step's loss by len(train_on), with weight data_beta / K.
    config.algorithm = 'ddrl'
    rl.data_loss_steps = 'first'
    rl.data_weighting = 'cosmos_rl'             # cosmos-rl's variant keeps cosmos-rl's weighting
  elif preset == 'ddrl_reduced_random':
    # The paper's reduced variant ("randomly sample t"): the data term at one random trained step per
    # rollout with weight data_beta, i.e. K times cosmos-rl's data_on_first_only weight. Not in cosmos-rl.
    config.algorithm = 'ddrl'
    rl.data_loss_steps = 'random_step'
  elif preset == 'ddrl_exact':
    # Theorem 3.1 as stated: lambda(x) = -exp(-x) advantages, the sampler's exact path-KL weight on the
    # data loss, normalized log-probs, every step trained, data_beta 1 (beta sits inside the transform).
    config.algorithm = 'ddrl'
    config.sampler.kind = 'flow_sde'
    config.sampler.noise_level = 1.0
    config.sampler.shift = 1.0
    rl.adv_transform = 'exact'
    rl.log_ratio = 'gaussian'
    rl.data_weighting = 'path_kl'
    rl.data_beta = 1.0
    rl.data_noise = 'fresh'
    rl.cond_dropout = 0.0
    rl.train_steps = tuple(range(config.sampler.num_steps))
    rl.old_mean = 'detached'
    rl.clip_range = 1e3
  elif preset in ('flow_grpo', 'flow_grpo_exact_kl'):
    # FlowGRPO's OCR recipe, yifan123/flow_grpo:
    #   config/grpo.py `general_ocr_sd3`: train.beta 0.04 (kl_beta), sample.global_std True,
    #     train.timestep_fraction 0.99 (the first int(0.99 T) steps: flow_grpo's default train steps);
    #     config/base.py: train.clip_range 1e-4, train.adv_clip_max 5, sample.noise_level 0.7;
    #   flow_grpo/stat_tracking.py: per-prompt mean, population std of the whole batch, + 1e-4;
    #   scripts/train_sd3.py: the KL divided by 2 std_dev_t^2 (no |dt|), rollouts with advantage exactly
    #     0 (e.g. every member of a zero-std group) removed from the update batch, the clamp at +-5.
    # flow_grpo_exact_kl differs only in the KL: the exact Gaussian step KL at the same kl_beta, |1/dt|
    # times stronger (10x at 10 uniform steps). Runs made before these presets existed used it together
    # with adv_normalization='cosmos_rl' and drop_zero_advantages=False.
    config.algorithm = 'flow_grpo'
    rl.kl_beta = 0.04
    rl.kl_form = 'flow_grpo' if preset == 'flow_grpo' else 'exact'
    rl.adv_normalization = 'flow_grpo'
    rl.adv_global_std = True
    rl.adv_eps = 1e-4
    rl.adv_clip = 5.0
    rl.clip_range = 1e-4
    rl.drop_zero_advantages = True
  elif preset == 'dance_grpo':
    # DanceGRPO, XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py `train_one_step` (with --use_group):
    # group mean and torch's unbiased std + 1e-8, the clamp at adv_clip_max; trained steps: a random
    # permutation of all but the last step per sample, the first int(fraction * (T - 1)) of it.
    # scripts/finetune/finetune_flux_grpo.sh: --timestep_fraction 0.6 --adv_clip_max 5.0
    # --clip_range 1e-4. No KL, no zero-advantage filter.
    config.algorithm = 'dance_grpo'
    rl.adv_normalization = 'dance_grpo'
    rl.adv_eps = 1e-8
    rl.adv_clip = 5.0
    rl.clip_range = 1e-4
    rl.train_fraction = 0.6
  elif preset == 'diffusion_nft':
    # DiffusionNFT's OCR recipe, NVlabs/DiffusionNFT (ddrl_jax/rl/nft.py has the objective):
    #   config/nft.py `sd3_ocr`: beta 0.1 (nft_beta), decay_type 2 (the old policy = theta for 75 steps,
    #     then an EMA rising by 0.0075 per step to 0.999), train.beta 1e-4 (the velocity MSE to the base,
    #     kl_beta), sample.guidance_scale 1 (CFG-free);
    #   config/base.py: train.adv_clip_max 5, train.timestep_fraction 0.99, sample.global_std True;
    #   scripts/train_nft_sd3.py: flow_grpo's PerPromptStatTracker (per-prompt mean, std of the batch,
    #     + 1e-4), no zero-advantage filter, no loss scale.
    # Kept from the task: its sampler (the reference rolls out with a deterministic dpm2 ODE; NFT only
    # needs clean samples) and one optimizer step per rollout batch (sd3_ocr takes 2).
    config.algorithm = 'diffusion_nft'
    rl.nft_beta = 0.1
    rl.nft_old_decay = 2
    rl.kl_beta = 1e-4
    rl.adv_normalization = 'flow_grpo'
    rl.adv_global_std = True
    rl.adv_eps = 1e-4
    rl.adv_clip = 5.0
    rl.train_steps = None
    rl.train_fraction = 0.99
    rl.loss_scale = 1.0
  elif preset == 'ddpo':
    config.algorithm = 'ddpo'
    config.sampler.eta = 1.0
    rl.train_fraction = 1.0
