"""Text-to-video with Wan2.1 (the 'wan' family): FlowGRPO's OCR prompts, the OCR reward on decoded video
frames (FlowGRPO `general_ocr_wan2_1`).

Samples: (16, T, H, W) normalized Wan2.1-VAE latents (config.wan.latent_shape; (9, 30, 52) = 33 frames at
240 x 416 in the recipes). Rewards and evaluation decode them with the Wan VAE (jitted, in chunks of
config.wan.vae_batch per local device) into uint8 videos (M, F, H, W, 3), F = 1 + 4 (T - 1), H = 8 h,
W = 8 w, scored by the OCR readers against each prompt's quoted text: FlowGRPO's video OCR reward reads
every 4th frame and averages the frames that score > 0 (rewards/ocr.py video_mean='positive', set in
config.reward.kwargs.ocr; evaluation's Tesseract and RapidOCR readers read videos the same way).

Prompts: as sd3_ocr, `data/ocr/flow_grpo_ocr_test.txt` (FlowGRPO's OCR test prompts; its training split is
not public), the first config.wan.num_eval_prompts held out for evaluation, the rest training; config.wan.
prompts may name another file.

Conditions: 'text' (B, text_length, text_dim), diffusers' WanPipeline UMT5 prompt_embeds
(models/wan/text.py, zero-padded to text_length), 'index' (B,); under classifier-free guidance also
'guidance' (B,) and 'null_text' (the empty prompt, diffusers' default negative prompt). Each prompt is
encoded once per run and cached (host float32). The text encoder: config.wan.text_encoder, a diffusers Wan
pipeline folder (text_encoder/, tokenizer/) or 'tiny_random' (a tiny random UMT5 built in-process).

CFG policy (config.wan): rollouts and the policy-gradient pass at guidance_rollout (carried by the rollout's
own conditions), evaluation at guidance_eval, records (the DDRL data term) at guidance_rollout.

Evaluation: OCR accuracy of the held-out prompts' videos by Tesseract (the training reader) and RapidOCR
(the held-out judge), plus temporal_smoothness (rewards/basic.py, -mean |frame_{k+1} - frame_k| / 255) as
an extra metric. Data: DDRL's data term reads records (config.data.path): the base model's own samples from
`python -m ddrl_jax.data.synthesize`, or real videos encoded by `python -m ddrl_jax.data.prepare`.
"""
import numpy as np

from ddrl_jax.models.wan import vae as wan_vae
from ddrl_jax.rewards import basic as basic_rewards
from ddrl_jax.rewards import ocr as ocr_reward
from ddrl_jax.tasks import prompt_task

VAE_PRESETS = {'wan21': wan_vae.wan21, 'tiny': wan_vae.tiny}


def vae_config(c):
  if c.vae not in VAE_PRESETS:
    raise ValueError(f'config.wan.vae={c.vae!r}: unknown preset; known: {sorted(VAE_PRESETS)}')
  kw = dict(c.vae_overrides) if c.get('vae_overrides') else {}
  return VAE_PRESETS[c.vae](**kw)


def text_encoder(c):
  """The UMT5 encoder of config.wan.text_encoder: a diffusers Wan pipeline folder, or 'tiny_random'."""
  from ddrl_jax.models.wan import text as text_lib  # pylint: disable=g-import-not-at-top
  if c.text_encoder == 'tiny_random':
    return text_lib.tiny_random(seed=c.text_seed)
  if not c.text_encoder:
    raise ValueError("config.wan.text_encoder is empty: give a diffusers Wan2.1 pipeline folder (with "
                     "text_encoder/ and tokenizer/) or 'tiny_random'")
  return text_lib.WanTextEncoder.from_pretrained(prompt_task.resolve(c.text_encoder))


class WanT2V(prompt_task.PromptTask):
  """Wan2.1 text-to-video on FlowGRPO's OCR prompts (see the module docstring)."""

  DEFAULT_FAMILY = 'wan'
  SECTION = 'wan'
  CONVERT_VAE = 'wan21_vae'
  WEIGHTS_SOURCE = '<diffusers Wan2.1-T2V folder>'
  TEXT_FIELDS = {'text': 'text_embedding'}
  SHAPE_KEY = 'config.wan.latent_shape'
  DECODE_PERM = (0, 2, 3, 4, 1)          # (M, 3, F, H, W) -> (M, F, H, W, 3)
  capabilities = frozenset({'records', 'media', 'aot'})

  def __init__(self, config):
    super().__init__(config)
    c = self.c = config.wan
    self.dit = self.family.dit
    self.vae_cfg = vae_config(c)
    if self.vae_cfg.z_dim != self.dit.in_channels:
      raise ValueError(f'config.wan: VAE z_dim {self.vae_cfg.z_dim} != DiT in_channels {self.dit.in_channels}')
    lt, lh, lw = c.latent_shape
    _, ph, pw = self.dit.patch_size
    if lh % ph or lw % pw:
      raise ValueError(f'config.wan.latent_shape={tuple(c.latent_shape)}: H and W must be multiples of the '
                       f'patch {(ph, pw)}')
    self.sample_shape = (self.dit.in_channels, lt, lh, lw)
    tf, sf = self.vae_cfg.temporal_factor, self.vae_cfg.spatial_factor
    self.video_shape = (3, 1 + tf * (lt - 1), sf * lh, sf * lw)
    self._init_prompts()
    self._smoothness = basic_rewards.TemporalSmoothness()

  # ----------------------------------------------------------------------------------- hooks
  def _make_encoder(self):
    return text_encoder(self.c)

  def _encode(self, encoder, prompts):
    text = np.asarray(encoder.encode(prompts, max_sequence_length=self.c.text_length), np.float32)
    if text.shape[1:] != (self.c.text_length, self.dit.text_dim):
      raise ValueError(f'config.wan.text_encoder gives embeddings of shape {text.shape[1:]}; the DiT needs '
                       f'{(self.c.text_length, self.dit.text_dim)} (config.wan.text_length, text_dim)')
    return dict(text_embedding=text)

  def text_shapes(self):
    return dict(text=(self.c.text_length, self.dit.text_dim))

  def _build_vae(self):
    import flax.nnx as nnx  # pylint: disable=g-import-not-at-top
    return wan_vae.WanVAE(self.vae_cfg, rngs=nnx.Rngs(self.c.vae_seed))

  def _media_to_pixels(self, media_u8):
    """(B, F, H, W, 3) uint8 -> (B, 3, F, H, W) float32 in [-1, 1]."""
    return np.transpose(media_u8.astype(np.float32) / 127.5 - 1.0, (0, 4, 1, 2, 3))

  @property
  def media_shape(self):
    """(F, H, W, 3): the uint8 video the VAE encodes into one (16, T, H/8, W/8) latent."""
    _, frames, height, width = self.video_shape
    return (frames, height, width, 3)

  # -------------------------------------------------------------------- evaluation
  def _make_readers(self):
    """(Tesseract, RapidOCR) with config.reward.kwargs' options; the judge reads videos as the training
    reader does (its frame_stride and video_mean, unless config.reward.kwargs.ocr_rapid sets them)."""
    kwargs = self.config.reward.kwargs
    ocr_kw = dict(kwargs.get('ocr', {}))
    video = {k: ocr_kw[k] for k in ('frame_stride', 'video_mean') if k in ocr_kw}
    return (ocr_reward.OCRReward(**ocr_kw),
            ocr_reward.RapidOCRReward(**dict(video, **dict(kwargs.get('ocr_rapid', {})))))

  def evaluate(self, samples, key, cond=None):
    """OCR accuracy (Tesseract and RapidOCR) of the decoded videos of the held-out prompts, and their
    temporal smoothness (mean over the finite videos)."""
    del key
    videos, finite = self.decode(samples)
    smooth = np.asarray(self._smoothness(videos, None), np.float64)[finite]
    out = dict(finite_fraction=float(finite.mean()))
    if cond is not None:
      out = self.ocr_metrics(videos, finite, cond)
    out['temporal_smoothness'] = float(smooth.mean()) if smooth.size else float('nan')
    return out


TASK = WanT2V
