"""OCR text rendering: a small text-to-image Cosmos DiT post-trained with the real OCR reward.

Images are 32 x 96 RGB renders of 3-5 character strings (tasks/text_render.py), modelled in pixel space
as (3, 32, 96) in [-1, 1] by `models.cosmos.t2i.CosmosT2I`, conditioned on the string's bytes.

Conditions: (B, text_length) int32 byte ids of the target string; its prompt (for the reward) is
'a sign that says "<string>"', recovered from the ids. Training strings and held-out strings are
disjoint (text_render.split_of); `conditions` draws training strings, `eval_conditions` held-out ones.
Data: each condition's string rendered again with a fresh random style (real data), or records
(config.data.path; e.g. samples of the base model written by ddrl_jax.data.synthesize).
Base model: the family loads config.ocr.base_checkpoint (written by ddrl_jax.pretrain) when it exists,
else starts from random weights.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

from ddrl_jax.models import text as text_lib
from ddrl_jax.rewards import ocr as ocr_reward
from ddrl_jax.tasks import base
from ddrl_jax.tasks import text_render

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def to_pixels(images_u8):
  """(B, H, W, 3) uint8 -> (B, 3, H, W) float32 in [-1, 1]."""
  return np.transpose(np.asarray(images_u8, np.float32) / 127.5 - 1.0, (0, 3, 1, 2))


def to_uint8(samples):
  """(B, 3, H, W) float in [-1, 1] -> ((B, H, W, 3) uint8, finite (B,) bool)."""
  samples = np.asarray(samples, np.float32)
  finite = np.isfinite(samples).reshape(samples.shape[0], -1).all(-1)
  u8 = np.round((np.nan_to_num(samples) + 1.0) * 127.5).clip(0, 255).astype(np.uint8)
  return np.transpose(u8, (0, 2, 3, 1)), finite


def readers_of(config):
  """(Tesseract, RapidOCR) readers with config.reward.kwargs' options for 'ocr' and 'ocr_rapid'."""
  kwargs = config.reward.kwargs
  return (ocr_reward.OCRReward(**dict(kwargs.get('ocr', {}))),
          ocr_reward.RapidOCRReward(**dict(kwargs.get('ocr_rapid', {}))))


def ocr_metrics_of(images, finite, prompts, readers):
  """OCR accuracy of (M, H, W, 3) uint8 images of `prompts` by the training reader (Tesseract: ocr,
  ocr_exact) and the held-out judge (RapidOCR: ocr_rapid, ocr_exact_rapid); reader_gap = ocr - ocr_rapid;
  non-finite samples score 0."""
  out = {}
  for suffix, reader in zip(('', '_rapid'), readers):
    scores = np.where(finite, reader(images, prompts), 0.0)
    out[f'ocr{suffix}'] = float(scores.mean())
    out[f'ocr_exact{suffix}'] = float((scores == 1).mean())
  out['reader_gap'] = out['ocr'] - out['ocr_rapid']
  out['finite_fraction'] = float(finite.mean())
  return out


class OCRTask(base.FamilyTask):
  """The task for the trainer (see the module docstring). The model is the 'cosmos_t2i' family
  (models/cosmos/family.py), its base the checkpoint config.ocr.base_checkpoint."""

  DEFAULT_FAMILY = 'cosmos_t2i'
  capabilities = frozenset({'records', 'pretrain', 'checkpoint_evaluation'})
  sample_shape = (3, text_render.HEIGHT, text_render.WIDTH)

  def __init__(self, config):
    super().__init__(config)
    self.c = config.ocr
    self._readers = None         # (Tesseract, RapidOCR), built at the first evaluation

  # ------------------------------------------------------------------------------ conditions
  def ids_of(self, texts):
    ids, _ = text_lib.encode_bytes(list(texts), self.c.text_length)
    return ids

  def texts_of(self, ids):
    ids = np.asarray(ids)
    return [bytes(int(b) for b in row if 0 < b < text_lib.PAD_BYTE).decode('utf-8', 'replace')
            for row in ids]

  def _texts(self, key, num, split):
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    return [text_render.sample_text(rng, split) for _ in range(num)]

  def conditions(self, key, batch):
    """(B, text_length) int32 ids of B random training strings."""
    return jnp.asarray(self.ids_of(self._texts(key, batch, 'train')))

  def eval_conditions(self, key, batch):
    """(B, text_length) int32 ids of B random held-out strings."""
    return jnp.asarray(self.ids_of(self._texts(key, batch, 'heldout')))

  def prompts(self, cond):
    return [text_render.prompt_of(t) for t in self.texts_of(cond)]

  def data(self, key, cond):
    """(B, 3, H, W) real renders of each condition's string, each in a fresh random style."""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    images = [text_render.render(t, text_render.sample_style(rng), rng) for t in self.texts_of(cond)]
    return jnp.asarray(to_pixels(np.stack(images)))

  def pretrain_batch(self, step, batch):
    """Batch `step` of the deterministic pretraining stream: (x0 (B, 3, H, W), ids (B, L)), in the
    styles of config.ocr.pretrain_style (text_render.STYLE_SUBSETS; the RL data term always uses 'all')."""
    texts, images = text_render.batch(self.c.data_seed, range(step * batch, (step + 1) * batch),
                                      style=self.c.get('pretrain_style', 'all'))
    return to_pixels(images), self.ids_of(texts)

  # --------------------------------------------------------------------------------- rewards
  def reward_inputs(self, samples, cond):
    """(M, 3, H, W) samples -> ((M, H, W, 3) uint8 images, finite (M,))."""
    del cond
    return to_uint8(samples)

  def evaluate_checkpoints(self, request):
    """FlowGRPO's OCR test prompts, the style statistics and the judges of each checkpoint (ocr_eval.py)."""
    from ddrl_jax.tasks import ocr_eval  # pylint: disable=g-import-not-at-top  (it imports the trainer)
    return ocr_eval.evaluate_checkpoints(self.config, request)

  def evaluate(self, samples, key, cond=None):
    """OCR accuracy of (M, 3, H, W) samples of `cond` (the trainer passes the eval conditions), read by
    the training reader (Tesseract: ocr, ocr_exact) and by the held-out judge (RapidOCR: ocr_rapid,
    ocr_exact_rapid); reader_gap = ocr - ocr_rapid on the same images."""
    del key
    images, finite = to_uint8(samples)
    if cond is None:
      return dict(finite_fraction=float(finite.mean()))
    self._readers = self._readers or readers_of(self.config)
    return ocr_metrics_of(images, finite, self.prompts(cond), self._readers)

  # ------------------------------------------------------------------------------- records
  def from_records(self, batch, key):
    """Records (prompt, sample (3, H, W) float in [-1, 1] or (H, W, 3) uint8) -> (ids, x0)."""
    del key
    sample = np.asarray(batch['sample'])
    x0 = to_pixels(sample) if sample.dtype == np.uint8 else sample.astype(np.float32)
    if x0.shape[1:] != self.sample_shape:
      raise ValueError(f'config.data.path: records hold samples of shape {sample.shape[1:]}, the OCR '
                       f'task needs {self.sample_shape} (float) or {self.sample_shape[1:] + (3,)} uint8')
    texts = [ocr_reward.target_text(p) for p in batch['prompt']]
    return jnp.asarray(self.ids_of(texts)), jnp.asarray(x0)

  def prompt_set(self, num=512, seed=1):
    """Training-split prompts for ddrl_jax.data.synthesize."""
    rng = np.random.default_rng(seed)
    return [text_render.prompt_of(text_render.sample_text(rng, 'train')) for _ in range(num)]

  def conditions_from_prompts(self, prompts, key):
    del key
    return jnp.asarray(self.ids_of([ocr_reward.target_text(p) for p in prompts]))

  def record_of(self, sample, prompt, text=True):
    """A record of one generated (3, H, W) sample, stored as the uint8 image the reward would see."""
    del text
    images, _ = to_uint8(np.asarray(sample, np.float32)[None])
    return dict(prompt=prompt, sample=images[0])


TASK = OCRTask
