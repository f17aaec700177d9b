"""Wan2.1 text-to-video with FlowGRPO's OCR-in-video reward (task prompt_task, model family wan), shared by
configs/wan1_3b.py and configs/wan14b.py.

    python -m ddrl_jax.train --config=configs/wan1_3b.py:flow_grpo --workdir=...
    python -m ddrl_jax.train --config=configs/wan1_3b.py:ddrl --workdir=...  (samples its data first, below)
    python -m ddrl_jax.train --config=configs/wan14b.py:dance_grpo --workdir=...

Weights: convert a diffusers Wan2.1-T2V folder once (`python -m ddrl_jax.models.convert --source=<folder>
--model=wan1_3b --out=...`, or wan14b, and `--model=wan21_vae`), point config.wan.checkpoint and
config.wan.vae_checkpoint at the outputs and config.wan.text_encoder at the folder (its UMT5 text_encoder/
and tokenizer/). DDRL's data are the base model's own samples: on its first run the trainer samples
config.data.base_samples of them (2,400: one per group of the 300 iterations) into <workdir>/base_samples,
resumably, before the first update (or give records: --config.data.path).

Shared by every preset (FlowGRPO's Wan run, yifan123/flow_grpo config/grpo.py `general_ocr_wan2_1`): 33 frames at 240 x 416 (latent (9, 30,
52), 3510 DiT tokens), bf16 compute with fp32 master weights, the shifted flow schedule at shift 3, FlowGRPO's
OCR prompts (its training split is not public: the 1017 test prompts less 128 held out), the reward
{'ocr': 1} with FlowGRPO's video OCR scoring (every 4th frame, the mean over the frames scoring > 0:
video_mean='positive', also in evaluation's Tesseract and RapidOCR readers), 8 prompts per optimizer step
(flow_grpo's per-GPU batch of 8 videos = 2 groups of 4, on 4 GPUs), LoRA r32 a64 gaussian on the attention
projections of every block (attn1/attn2 to_q, to_k, to_v, to_out: the Wan analogue of flow_grpo's SD3
targets; train_wan2_1.py's own list was not read). temporal_smoothness is an extra evaluation metric and
an optional reward (`--config.reward.fns="{'ocr': 1.0, 'temporal_smoothness': 0.1}"`).

Presets:
  ddrl:       the paper's (arXiv 2512.04332) recipe adapted as configs/sd35m.py adapts it: the base model's
              own samples as data (data.base_samples), no classifier-free guidance anywhere (guidance 1;
              the data term drops the condition 20% of the time), cosmos-rl's DDRL keys (every other of the
              20 steps trained, loss scale 10; data_beta 0.081 on the path-KL weighting, cosmos-rl's 0.01 at
              the same total weight), aligned with FlowGRPO's Wan run: its
              flow SDE (noise 0.7), group 4, lr 1e-4, clip 1e-3, per-group advantage std.
  flow_grpo:  yifan123/flow_grpo config/grpo.py `general_ocr_wan2_1` (+ config/base.py,
              scripts/train_wan2_1.py): 20 training / 50 evaluation steps (evaluation at noise 0), guidance
              4.5 (`sample.guidance_scale=4.5`) in rollouts, in the policy gradient (train.cfg True) and in
              evaluation, the flow SDE at noise_level 0.7, group 4, lr 1e-4, clip 1e-3, KL beta 0.004 in
              FlowGRPO's form, sample.global_std False (per-group std), timestep_fraction 0.99, EMA on, bf16.
  dance_grpo: XueZeyue/DanceGRPO fastvideo/train_grpo_wan_2_1.py (flux_step's SDE and GRPO loss, copied
              from train_grpo_flux.py) with its Wan finetune script's values as the reference doc gives
              them ("Wan-2.1 used as an image model": 20 steps, group 12, CFG 5 `--cfg_infer 5.0` in
              sampling and training, shift 3) with the flux script's GRPO keys (timestep_fraction 0.6, clip 1e-4, adv_clip_max 5);
              eta 0.3 (the doc gives eta for images, 0.3, and HunyuanVideo, 0.25, not for Wan); DanceGRPO's
              lr 1e-5 (its FLUX / Qwen-Image value; the doc gives none for Wan); the task's video size.
Differences from the references: one rollout batch per optimizer step (flow_grpo: 2 per epoch), our power
EMA in place of flow_grpo's, PaddleOCR replaced by Tesseract (training) and RapidOCR (held-out judge), and
the per-frame score keeps flow_grpo's image rule (a substring counts as exact, rewards/ocr.py).

Meshes: batches shard over data x fsdp (data fills the devices given). No context parallelism: the 9
latent frames divide over no power-of-two context axis > 1 (the sequence is sharded by latent frames), and
3510 tokens do not need it. v5p: wan1_3b on v5p-32 (16 chips: data 4 x fsdp 4), wan14b on v5p-64 (32
chips: data 4 x fsdp 8). H100/H200 clusters (8 GPUs a node, fsdp within a node over NVLink): wan1_3b on 2
nodes (data 4 x fsdp 4), wan14b on 4 nodes (data 4 x fsdp 8); launch/README.md has the commands.

':<preset>_smoke' keeps the recipe and the real OCR reward but shrinks the rest for a 2-core CPU: the tiny
Wan DiT, the tiny Wan VAE with the real 16 latent channels, a tiny random UMT5 built in-process, 5 frames at
32 x 32 (latent (2, 4, 4)), 4 sampler steps, 2 groups of 2, reward in a thread.
"""
import ml_collections

from configs import common

PRESETS = ('ddrl', 'flow_grpo', 'dance_grpo')
MODELS = ('wan1_3b', 'wan14b')
LORA_TARGETS = (r'blocks\.(attn1|attn2)\.(to_q|to_k|to_v|to_out)',)
# fsdp per model; data = -1 fills the devices (see the module docstring for the slices and nodes).
FSDP = {'wan1_3b': 4, 'wan14b': 8}
GUIDANCE = {'ddrl': 1.0, 'flow_grpo': 4.5, 'dance_grpo': 5.0}


def split_arg(arg):
  """'flow_grpo' -> ('flow_grpo', False); 'ddrl_smoke' -> ('ddrl', True); '' and 'smoke' mean flow_grpo."""
  smoke = arg == 'smoke' or arg.endswith('_smoke')
  preset = arg[:-len('_smoke')] if arg.endswith('_smoke') else arg
  preset = preset if preset not in ('', 'smoke') else 'flow_grpo'
  if preset not in PRESETS:
    raise ValueError(f'unknown config arg {arg!r}; known: {PRESETS}, each optionally with _smoke')
  return preset, smoke


def get_config(model, arg='flow_grpo'):
  if model not in MODELS:
    raise ValueError(f'unknown Wan model {model!r}; known: {MODELS}')
  preset, smoke = split_arg(arg)
  c = common.base_config()
  c.task = 'prompt_task'
  c.model_family = 'wan'
  common.use_family_rules(c, 'wan')
  common.apply_algorithm_preset(c, preset)
  c.seed = 0
  c.num_iterations = 1000 if preset == 'dance_grpo' else 300
  c.batch_size = 8                  # prompts per optimizer step
  c.num_rollouts = 12 if preset == 'dance_grpo' else 4    # group size
  c.log_every = 1
  c.checkpoint_every = 30
  c.eval_every = 30                 # flow_grpo: eval_freq 30 epochs
  c.eval_samples = 128

  s = c.sampler
  s.kind = 'dance_sde' if preset == 'dance_grpo' else 'flow_sde'
  s.num_steps = 20
  s.shift = 3.0                     # Wan's flow shift at 480p; flow_grpo's and DanceGRPO's Wan value
  s.noise_level = 0.7               # flow_grpo config/base.py sample.noise_level
  s.eta = 0.3                       # dance_sde only
  s.eval_num_steps = 50
  s.eval_deterministic = True       # flow_grpo evaluates at noise_level 0

  rl = c.rl
  rl.log_ratio = 'gaussian'
  if preset in ('ddrl', 'flow_grpo'):
    rl.adv_normalization = 'flow_grpo'
    rl.adv_global_std = False       # general_ocr_wan2_1: sample.global_std = False
    rl.adv_eps = 1e-4
    rl.clip_range = 1e-3            # general_ocr_wan2_1: train.clip_range
  if preset == 'flow_grpo':
    rl.kl_beta = 0.004              # general_ocr_wan2_1: train.beta
  if preset == 'ddrl':
    # cosmos-rl's 0.01 x its t^2 + (1-t)^2 weight, carried on the path-KL weighting (the default): 0.01 x
    # 7.096 / 0.872 over these trained steps.
    rl.data_beta = 0.081
    rl.data_loss_steps = 'full'
    rl.data_noise = 'fresh'         # synthetic data: no rollout noise belongs to them
    rl.cond_dropout = 0.2
    rl.train_steps = tuple(range(0, 19, 2))   # every other step of 20 (the paper's |T| = T / 2)
    # The base's own samples, made by the trainer on the first run: one record per group of every
    # iteration, so no record repeats (the paper gives no number).
    c.data.base_samples = c.num_iterations * c.batch_size

  o = c.optim
  o.learning_rate = 1e-5 if preset == 'dance_grpo' else 1e-4
  o.b1, o.b2, o.eps, o.weight_decay = 0.9, 0.999, 1e-8, 1e-4
  o.warmup_steps = 0
  o.grad_clip = 1.0
  o.ema_power_s = 0.1

  c.lora.rank = 32
  c.lora.alpha = 64
  c.lora.init = 'gaussian'
  c.lora.targets = LORA_TARGETS

  c.reward.fns = ml_collections.ConfigDict({'ocr': 1.0})
  video_ocr = dict(frame_stride=4, video_mean='positive')   # flow_grpo's video OCR reward
  c.reward.kwargs = ml_collections.ConfigDict({'ocr': video_ocr})   # evaluation's RapidOCR reads alike
  c.reward.workers = 8
  c.reward.chunk_size = 4

  cfg_scale = GUIDANCE[preset]
  c.wan = ml_collections.ConfigDict(dict(
      model=model,                   # models/wan/family.py PRESETS
      dit_overrides=ml_collections.ConfigDict(),
      dtype='bfloat16', param_dtype='float32',
      remat_policy='full',
      attention=ml_collections.ConfigDict(dict(kernel='', block_q=512, block_kv=512, block_kv_compute=512,
                                               min_flash_len=4096, interpret=False)),
      checkpoint='',                 # orbax dir of the converted DiT ('' = random weights)
      latent_shape=(9, 30, 52),      # 33 frames at 240 x 416
      text_length=512,               # UMT5 tokens, zero-padded (WanPipeline's max_sequence_length)
      text_encoder='',               # a diffusers Wan2.1 pipeline folder, or 'tiny_random'
      text_seed=0,
      vae='wan21', vae_overrides=ml_collections.ConfigDict(), vae_checkpoint='', vae_seed=1, vae_batch=1,
  ))
  c.prompt = ml_collections.ConfigDict(dict(
      prompts='',                    # '' = data/ocr/flow_grpo_ocr_test.txt
      num_eval_prompts=128,
      guidance_rollout=cfg_scale,
      guidance_eval=cfg_scale,
      prompts_required=False,
      prompts_source='',
  ))
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=FSDP[model], context=1, tensor=1))

  c.require_inputs = True           # converted weights (and DDRL's records) or a one-line stop
  if smoke:
    common.shrink_for_smoke(c, preset)
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, context=1, tensor=1))
    w = c.wan
    w.model = 'tiny'
    w.dtype = 'float32'
    w.remat_policy = 'none'
    w.latent_shape = (2, 4, 4)       # 5 frames at 32 x 32
    w.text_length = 8
    w.text_encoder = 'tiny_random'
    c.prompt.num_eval_prompts = 4
    w.vae = 'tiny'
    w.vae_overrides = ml_collections.ConfigDict(dict(
        z_dim=16, latents_mean=tuple(_wan_stats()[0]), latents_std=tuple(_wan_stats()[1])))
    w.vae_batch = 4
    w.dit_overrides = ml_collections.ConfigDict(dict(text_dim=_tiny_text_dim()))
  return c


def _wan_stats():
  from ddrl_jax.models import video_vae  # pylint: disable=g-import-not-at-top
  return video_vae.WAN21_LATENTS_MEAN, video_vae.WAN21_LATENTS_STD


def _tiny_text_dim():
  """The tiny random UMT5's width (models/wan/text.py tiny_random)."""
  from ddrl_jax.models.wan import text  # pylint: disable=g-import-not-at-top
  return text.TINY_TEXT_DIM
