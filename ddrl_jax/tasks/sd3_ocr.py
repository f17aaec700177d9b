"""Text rendering with Stable Diffusion 3.5 (the 'sd3' family): FlowGRPO's OCR prompts, the OCR reward on
decoded images (FlowGRPO `general_ocr_sd3`, DiffusionNFT `sd3_ocr`, the DDRL paper's Table 4).

Samples: (16, R/8, R/8) normalized SD3-VAE latents of R x R images (config.sd3.resolution, 512 in the
recipes). Rewards and evaluation decode them with the SD3 VAE (jitted, in chunks of config.sd3.vae_batch)
into uint8 images scored by the OCR readers against each prompt's quoted text.

Prompts: `data/ocr/flow_grpo_ocr_test.txt` (FlowGRPO's 1017 OCR test prompts; its training split is not
public). The first config.sd3.num_eval_prompts are held out for evaluation, the rest are the training
prompts (disjoint). config.sd3.prompts may name another file (one prompt a line).

Conditions (a dict of (B, ...) arrays): 'text' (B, 77 + max_sequence_length, joint_dim) and 'pooled'
(B, pooled_dim), SD3's CLIP-L/G + T5 conditioning (models/sd3/text.py), 'index' (B,) the prompt's
row in the training + held-out prompt list (-1 for a record's prompt that is not in it); under classifier-free guidance also
'guidance' (B,) and the empty prompt's 'null_text', 'null_pooled' (models/sd3/family.py). Each prompt is
encoded once per run and cached (host float32).

CFG policy (config.sd3): rollouts and the policy-gradient re-evaluation of the rollouts sample with
guidance_rollout (the rollout's own conditions carry it, so the two always agree), evaluation with
guidance_eval; records (the DDRL data term) get guidance_rollout too (with the DDRL preset both are 1).

Data: DDRL's data term reads records (config.data.path), e.g. the base model's own samples written by
`python -m ddrl_jax.data.synthesize` (the paper's Table 4 regularizes SD3.5-M with them), or real images
encoded by `python -m ddrl_jax.data.prepare`; records may carry the text and pooled embeddings.
"""
import numpy as np

from ddrl_jax.models.sd3 import family as sd3_family
from ddrl_jax.models.sd3 import vae as sd3_vae
from ddrl_jax.tasks import ocr as ocr_task
from ddrl_jax.tasks import prompt_task

DEFAULT_PROMPTS = prompt_task.DEFAULT_PROMPTS
VAE_PRESETS = {'sd35': sd3_vae.sd35, 'tiny': sd3_vae.tiny}


def read_prompts(path):
  """Non-empty lines of a prompt file (relative paths from the repository root)."""
  return prompt_task.read_prompts(path, 'config.sd3.prompts')


def vae_config(c):
  if c.vae not in VAE_PRESETS:
    raise ValueError(f'config.sd3.vae={c.vae!r}: unknown preset; known: {sorted(VAE_PRESETS)}')
  kw = dict(c.vae_overrides) if c.get('vae_overrides') else {}
  return VAE_PRESETS[c.vae](**kw)


def text_encoders(c):
  """The SD3 text encoders of config.sd3.text_encoders: a diffusers pipeline folder, or 'tiny_random'
  (tiny random CLIP-L/G + T5 built in-process, for the CPU smoke run)."""
  from ddrl_jax.models.sd3 import text as text_lib  # pylint: disable=g-import-not-at-top
  if c.text_encoders == 'tiny_random':
    return text_lib.tiny_random(seed=c.text_seed)
  if not c.text_encoders:
    raise ValueError('config.sd3.text_encoders is empty: give a diffusers SD3.5 pipeline folder (with '
                     "text_encoder/, text_encoder_2/, text_encoder_3/ and tokenizers) or 'tiny_random'")
  return text_lib.SD3TextEncoders.from_pretrained(prompt_task.resolve(c.text_encoders))


class SD3OCR(prompt_task.PromptTask):
  """SD3.5 on FlowGRPO's OCR prompts (see the module docstring; prompt_task.PromptTask has the prompt
  split, the cached embeddings, the conditions, records and the chunked VAE)."""

  DEFAULT_FAMILY = 'sd3'
  SECTION = 'sd3'
  TEXT_ENCODER_KEY = 'text_encoders'
  CONVERT_VAE = 'sd35_vae'
  WEIGHTS_SOURCE = '<diffusers SD3.5 folder>'
  TEXT_FIELDS = {'text': 'text_embedding', 'pooled': 'pooled_embedding'}
  SHAPE_KEY = 'config.sd3.resolution'
  DECODE_PERM = (0, 2, 3, 1)             # (M, 3, H, W) -> (M, H, W, 3)
  capabilities = frozenset({'records', 'media', 'aot'})

  def __init__(self, config):
    super().__init__(config)
    c = self.c = config.sd3
    self.dit = self.family.dit
    self.vae_cfg = vae_config(c)
    factor = self.vae_cfg.spatial_factor
    if c.resolution % (factor * self.dit.patch_size):
      raise ValueError(f'config.sd3.resolution={c.resolution}: not a multiple of the VAE factor {factor} '
                       f'x patch {self.dit.patch_size}')
    if self.vae_cfg.latent_channels != self.dit.in_channels:
      raise ValueError(f'config.sd3: VAE latent channels {self.vae_cfg.latent_channels} != MMDiT '
                       f'in_channels {self.dit.in_channels}')
    side = c.resolution // factor
    self.sample_shape = (self.dit.in_channels, side, side)
    self._init_prompts()
    self.text_length = sd3_family.text_tokens(c)

  # ----------------------------------------------------------------------------------- hooks
  def _make_encoder(self):
    return text_encoders(self.c)

  def _encode(self, encoder, prompts):
    text, pooled = encoder.encode(prompts, max_sequence_length=self.c.max_sequence_length)
    return dict(text_embedding=text, pooled_embedding=pooled)

  def text_shapes(self):
    return dict(text=(self.text_length, self.dit.joint_attention_dim), pooled=(self.dit.pooled_projection_dim,))

  def _build_vae(self):
    import flax.nnx as nnx  # pylint: disable=g-import-not-at-top
    return sd3_vae.SD3VAE(self.vae_cfg, rngs=nnx.Rngs(self.c.vae_seed))

  def _media_to_pixels(self, media_u8):
    return ocr_task.to_pixels(media_u8[:, 0])

  @property
  def media_shape(self):
    """(1, R, R, 3): the uint8 image the VAE encodes into one latent."""
    return (1, self.c.resolution, self.c.resolution, 3)

  # -------------------------------------------------------------------- evaluation
  @property
  def eval_scores_with_rewards(self):
    """A run training on rewards other than OCR (the PickScore / GenEval presets) is also evaluated by
    them: the trainer passes `evaluate` a scorer of the run's rewards."""
    return set(self.config.reward.fns) != {'ocr'}

  def evaluate(self, samples, key, cond=None, score=None):
    """OCR accuracy (Tesseract and RapidOCR) of the decoded samples of the held-out prompts; with `score`
    (fn(images, prompts) -> {reward: (M,)}), also reward/<name>: the mean of each of the run's rewards
    over the finite samples it could score."""
    del key
    images, finite = self.decode(samples)
    if cond is None:
      return dict(finite_fraction=float(finite.mean()))
    out = self.ocr_metrics(images, finite, cond)
    if score is not None:
      for name, values in score(images, self.prompts(cond)).items():
        values = np.where(finite, np.asarray(values, np.float64), np.nan)
        ok = np.isfinite(values)
        out[f'reward/{name}'] = float(values[ok].mean()) if ok.any() else float('nan')
    return out


TASK = SD3OCR
