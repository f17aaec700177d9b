"""FLUX.1-dev with LoRA on image rewards (task prompt_task, model family flux).

    python -m ddrl_jax.train --config=configs/flux1_dev.py:flow_grpo --workdir=...
    python -m ddrl_jax.train --config=configs/flux1_dev.py:dance_grpo --workdir=...
    python -m ddrl_jax.train --config=configs/flux1_dev.py:ddrl --workdir=...
    python -m ddrl_jax.aot --config=configs/flux1_dev.py:flow_grpo --topology=v5p-16 --search_micro_batch

Weights: convert a diffusers FLUX.1-dev folder once (`python -m ddrl_jax.models.convert --source=<folder>
--model=flux1_dev --out=...` and `--model=flux1_vae`), point config.flux.checkpoint and
config.flux.vae_checkpoint at the outputs and config.flux.text_encoders at the folder (CLIP-L and T5 with
their tokenizers). The rewards' weights (PickScore, HPSv2.1, CLIP) and the prompt file are inputs too:
config.reward.kwargs.<reward>.* and config.prompt.prompts; a run without them stops in one line.

FLUX.1-dev is guidance-distilled: every preset feeds the guidance scale 3.5 to the guidance embedding
(rollouts, the policy-gradient pass and evaluation), one forward, no classifier-free branch. The sampler's
time shift is FluxPipeline's resolution-dependent one (`models.flux.family.resolution_shift`) unless a
recipe fixes its own.

Presets, each following one public recipe:
  flow_grpo:  yifan123/flow_grpo config/grpo.py `pickscore_flux` (+ config/base.py, scripts/train_flux.py):
              PickScore, 512 x 512, 6 sampler steps in training and 28 in evaluation (at noise 0), the
              flow SDE at noise_level 0.9, guidance 3.5, group 24, KL beta 0, clip 1e-4, lr 3e-4, LoRA r32
              a64 (gaussian init) on the attention projections, bf16. Difference: one rollout batch of 24
              groups per optimizer step (FlowGRPO accumulates over its GPUs' batches of 3).
  dance_grpo: XueZeyue/DanceGRPO scripts/finetune/finetune_flux_grpo.sh + fastvideo/train_grpo_flux.py with
              the LoRA setting its README gives for FLUX: HPSv2.1 and CLIP score rewards (the DanceGRPO paper's FLUX rewards), 720
              x 720, 12 steps of its SDE at eta 0.3 with shift 3, group 12, a random 60% of the 11 trained
              transitions per rollout, no KL, lr 3e-4, LoRA r128 a256 on to_q/to_k/to_v/to_out.0, bf16,
              guidance 3.5. Difference: one prompt group per data-parallel position in each step,
              4 groups per optimizer step (DanceGRPO: 1 prompt per GPU, grad_accum 4).
  ddrl:       the DDRL paper's image setting (arXiv 2512.04332 section 4.2: regularized with the base model's
              own samples) on flow_grpo's shape and reward: data_beta 0.067 on the path-KL weighting (cosmos-rl's
              0.01 at the same total weight) on config.data.base_samples made
              by the trainer on its first run, the data term at every other trained step with the
              condition dropped 20% of the time.

':smoke' (':flow_grpo_smoke', ':dance_grpo_smoke', ':ddrl_smoke') keeps each recipe's algorithm, sampler
and LoRA targets and shrinks the rest for a 2-core CPU: the tiny transformer and VAE with random weights,
tiny random CLIP-L + T5 built in-process, 64 x 64 images, 4 steps, 2 groups of 2, and the OCR reward on
the shipped OCR prompts (the image rewards' weights do not ship; their paths are tested elsewhere).
"""
import ml_collections

from configs import common

PRESETS = ('flow_grpo', 'dance_grpo', 'ddrl')
GUIDANCE = 3.5                     # FLUX.1-dev's distilled guidance in both recipes
# flow_grpo's LoRA targets for FLUX (scripts/train_flux.py: attn.to_q/k/v, to_out.0, add_q/k/v_proj,
# to_add_out) as module paths of models/flux/transformer.py: the double blocks' joint attention and the
# single blocks' q/k/v (they have no output projection).
FLOW_GRPO_TARGETS = (r'transformer_blocks\.attn\.(to_q|to_k|to_v|to_out|add_q_proj|add_k_proj|add_v_proj|'
                     r'to_add_out)', r'single_transformer_blocks\.attn\.(to_q|to_k|to_v)')
# DanceGRPO's FLUX LoRA targets: to_q, to_k, to_v, to_out.0 of every attention.
DANCE_GRPO_TARGETS = (r'transformer_blocks\.attn\.(to_q|to_k|to_v|to_out)',
                      r'single_transformer_blocks\.attn\.(to_q|to_k|to_v)')


def _split(arg):
  smoke = arg == 'smoke' or arg.endswith('_smoke')
  preset = arg[:-len('_smoke')] if arg.endswith('_smoke') else arg
  preset = preset if preset not in ('', 'smoke') else 'flow_grpo'
  if preset not in PRESETS:
    raise ValueError(f'unknown config arg {arg!r}; known: {PRESETS}, each optionally with _smoke')
  return preset, smoke


def get_config(arg='flow_grpo'):
  from ddrl_jax.models.flux import family as flux_family  # pylint: disable=g-import-not-at-top
  preset, smoke = _split(arg)
  c = common.base_config()
  c.task = 'prompt_task'
  c.model_family = 'flux'
  common.use_family_rules(c, 'flux')
  common.apply_algorithm_preset(c, preset)
  c.seed = 0
  c.num_iterations = 300
  c.log_every = 1
  c.checkpoint_every = 20
  c.eval_every = 20
  c.eval_samples = 128
  resolution = 720 if preset == 'dance_grpo' else 512

  s, rl, o = c.sampler, c.rl, c.optim
  s.eval_deterministic = True
  o.b1, o.b2, o.eps, o.weight_decay = 0.9, 0.999, 1e-8, 1e-4
  o.warmup_steps = 0
  o.grad_clip = 1.0
  o.learning_rate = 3e-4            # both recipes' LoRA learning rate
  rl.log_ratio = 'gaussian'
  if preset == 'dance_grpo':
    c.batch_size, c.num_rollouts = 4, 12
    s.kind, s.num_steps, s.eta, s.shift = 'dance_sde', 12, 0.3, 3.0
    s.eval_num_steps = 28
    rl.train_fraction = 0.6
    rl.adv_clip = 5.0
    c.lora.rank, c.lora.alpha, c.lora.init = 128, 256, 'gaussian'
    c.lora.targets = DANCE_GRPO_TARGETS
    o.ema_power_s = None           # DanceGRPO's LoRA script keeps no EMA
    c.reward.fns = ml_collections.ConfigDict({'hpsv21': 1.0, 'clipscore': 1.0})
  else:
    c.batch_size, c.num_rollouts = 24, 24
    s.kind, s.num_steps, s.noise_level = 'flow_sde', 6, 0.9
    s.shift = flux_family.resolution_shift(resolution)
    s.eval_num_steps = 28
    rl.kl_beta = 0.0 if preset == 'flow_grpo' else rl.kl_beta
    rl.clip_range = 1e-4
    rl.adv_clip = 5.0
    c.lora.rank, c.lora.alpha, c.lora.init = 32, 64, 'gaussian'
    c.lora.targets = FLOW_GRPO_TARGETS
    o.ema_power_s = 0.1
    c.reward.fns = ml_collections.ConfigDict({'pickscore': 1.0})
  if preset == 'ddrl':
    # cosmos-rl's 0.01 x its t^2 + (1-t)^2 weight, carried on the path-KL weighting (the default): 0.01 x
    # 2.168 / 0.324 over these trained steps.
    rl.data_beta = 0.067
    rl.data_loss_steps = 'full'
    rl.data_noise = 'fresh'          # the base's samples: no rollout noise belongs to them
    rl.cond_dropout = 0.2
    rl.adv_normalization = 'flow_grpo'
    rl.train_steps = tuple(range(0, 5, 2))    # every other step of the 6
    c.data.base_samples = c.num_iterations * c.batch_size

  c.reward.workers = 8
  c.reward.chunk_size = 16
  c.reward.kwargs.pickscore = ml_collections.ConfigDict(dict(checkpoint='', processor=''))
  c.reward.kwargs.hpsv21 = ml_collections.ConfigDict(dict(checkpoint=''))
  c.reward.kwargs.clipscore = ml_collections.ConfigDict(dict(checkpoint=''))

  c.flux = ml_collections.ConfigDict(dict(
      model='flux1_dev',             # models/flux/family.py PRESETS
      dit_overrides=ml_collections.ConfigDict(),
      dtype='bfloat16', param_dtype='float32',
      remat_policy='full',
      attention=ml_collections.ConfigDict(dict(kernel='', block_q=512, block_kv=512, block_kv_compute=512,
                                               min_flash_len=4096, interpret=False)),
      checkpoint='',                 # orbax dir of converted transformer params ('' = random weights)
      vae='flux1', vae_overrides=ml_collections.ConfigDict(), vae_checkpoint='', vae_seed=1, vae_batch=4,
      text_encoders='',              # a diffusers FLUX.1 pipeline folder, or 'tiny_random'
      text_seed=0,
      max_sequence_length=128 if preset != 'dance_grpo' else 512,   # flow_grpo trains with 128 T5 tokens
      resolution=resolution,
  ))
  c.prompt = ml_collections.ConfigDict(dict(
      prompts='',
      num_eval_prompts=128,
      guidance_rollout=GUIDANCE,
      guidance_eval=GUIDANCE,
      prompts_required=True,         # the recipes' prompt sets do not ship
      prompts_source=("flow_grpo's dataset/pickscore/train.txt (Pick-a-Pic captions)" if preset != 'dance_grpo'
                      else "DanceGRPO's prompts.txt (its HPS training prompts)"),
  ))
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, context=1, tensor=1))
  c.require_inputs = True

  if smoke:
    common.shrink_for_smoke(c, preset)
    if preset == 'ddrl':
      c.rl.train_steps = (0, 2)
    f = c.flux
    f.model, f.dtype, f.remat_policy = 'tiny', 'float32', 'none'
    f.vae, f.text_encoders, f.max_sequence_length, f.resolution = 'tiny', 'tiny_random', 8, 64
    f.vae_batch = 4
    if preset != 'dance_grpo':
      c.sampler.shift = flux_family.resolution_shift(64)
    c.reward.fns = ml_collections.ConfigDict({'ocr': 1.0})
    c.prompt.update(prompts='', prompts_required=False, prompts_source='', num_eval_prompts=4)
  return c
