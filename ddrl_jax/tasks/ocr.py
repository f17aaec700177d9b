"""OCR text rendering: a small text-to-image Cosmos DiT post-trained with the real OCR reward.

Images are 32 x 96 RGB renders of 3-5 character strings (tasks/text_render.py), modelled in pixel space
as (3, 32, 96) in [-1, 1] by `models.cosmos_t2i.CosmosT2I`, conditioned on the string's bytes.

Conditions: (B, text_length) int32 byte ids of the target string; its prompt (for the reward) is
'a sign that says "<string>"', recovered from the ids. Training strings and held-out strings are
disjoint (text_render.split_of); `conditions` draws training strings, `eval_conditions` held-out ones.
Data: each condition's string rendered again with a fresh random style (real data), or records
(config.data.path; e.g. samples of the base model written by ddrl_jax.data.synthesize).
Base model: `init_model` loads config.ocr.base_checkpoint (written by ddrl_jax.pretrain) when it exists,
else starts from random weights.
"""
import os

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from ddrl_jax import params_io
from ddrl_jax.models import cosmos_dit
from ddrl_jax.models import lora as lora_lib
from ddrl_jax.models import cosmos_t2i
from ddrl_jax.models import text as text_lib
from ddrl_jax.rewards import ocr as ocr_reward
from ddrl_jax.tasks import text_render

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_config(c):
  """T2IConfig from config.ocr."""
  dit = cosmos_dit.CosmosDiTConfig(
      in_channels=3, model_channels=c.width, num_blocks=c.depth, num_heads=c.heads,
      mlp_ratio=c.mlp_ratio, adaln_lora_dim=c.adaln_lora_dim, patch=(1, c.patch, c.patch),
      crossattn_in=c.text_dim, context_dim=c.width, rope_h_ratio=1.0, rope_w_ratio=1.0,
      rope_t_ratio=1.0, remat_policy='none',
      # Learned absolute positions: character k is drawn in cell k, which a query can only find by its
      # absolute column (RoPE makes self-attention relative). Without them the text was ignored for
      # thousands of steps (benchmarks/RESULTS.md).
      extra_pos_embed=True, extra_pos_max_size=(1, text_render.HEIGHT // c.patch, text_render.WIDTH // c.patch),
      # Sinusoids of 1000 t (DiT's scale): at Cosmos' scale of t in [0, 1] the embedding's fastest
      # frequency is 1 radian per unit t, too coarse for a small model to tell t = 0.05 from 0.1.
      timestep_scale=1000.0)
  return cosmos_t2i.T2IConfig(dit=dit, text_length=c.text_length)


def make_apply_fn(graphdef, min_t, guidance=1.0):
  """apply_fn(params, x_t (B, 3, H, W), t (B,), ids (B, L)) -> velocity.

  The network predicts the clean image x0_hat (x-prediction) and the velocity is
  v = (x_t - x0_hat) / max(t, min_t). In pixel space an 8 x 8 x 3 patch has 192 values but the model
  is 128 wide: it cannot pass per-pixel noise through, which predicting v = noise - x0 directly
  needs at large t (its samples stayed noisy), while the clean image lies on a low-dimensional
  manifold that it can represent ("let denoising models denoise", Li & He 2025).
  guidance != 1: classifier-free guidance, x0_hat = x0_null + guidance (x0_cond - x0_null), with the
  null condition (all byte ids 0) the model learned through condition dropout; one forward of 2B.
  """
  def apply_fn(params, x_t, t, cond):
    params = jax.tree.map(lambda a: a, params)     # NNX Variables at this trace level (see video.py)
    model = nnx.merge(graphdef, params)
    if guidance == 1.0:
      x0_hat = model(x_t, t, cond)
    else:
      both = model(jnp.concatenate([x_t, x_t]), jnp.concatenate([jnp.reshape(t, (-1,))] * 2),
                   jnp.concatenate([cond, jnp.zeros_like(cond)]))
      x0_cond, x0_null = jnp.split(both, 2)
      x0_hat = x0_null + guidance * (x0_cond - x0_null)
    tb = jnp.maximum(jnp.reshape(t, (-1,) + (1,) * (x_t.ndim - 1)), min_t)
    return (x_t - x0_hat) / tb
  return apply_fn


def to_pixels(images_u8):
  """(B, H, W, 3) uint8 -> (B, 3, H, W) float32 in [-1, 1]."""
  return np.transpose(np.asarray(images_u8, np.float32) / 127.5 - 1.0, (0, 3, 1, 2))


def to_uint8(samples):
  """(B, 3, H, W) float in [-1, 1] -> ((B, H, W, 3) uint8, finite (B,) bool)."""
  samples = np.asarray(samples, np.float32)
  finite = np.isfinite(samples).reshape(samples.shape[0], -1).all(-1)
  u8 = np.round((np.nan_to_num(samples) + 1.0) * 127.5).clip(0, 255).astype(np.uint8)
  return np.transpose(u8, (0, 2, 3, 1)), finite


def resolve(path):
  """A config path, relative paths taken from the repository root (where the README's commands run)."""
  return path if not path or os.path.isabs(path) else os.path.join(REPO_ROOT, path)


class OCRTask:
  """The task for the trainer (see the module docstring)."""

  sample_shape = (3, text_render.HEIGHT, text_render.WIDTH)

  def __init__(self, config):
    self.config = config
    self.lora = lora_lib.from_config(config)
    self.c = config.ocr
    self.model_cfg = model_config(self.c)

  # ----------------------------------------------------------------------------------- model
  def _build(self, key, adapters=True):
    """The model of `key`; with config.lora's adapters (their own key) unless adapters=False."""
    model = cosmos_t2i.CosmosT2I(self.model_cfg, rngs=nnx.Rngs(key))
    if adapters:
      lora_lib.attach(model, self.lora, lora_lib.adapter_key(key))
    return model

  def init_model(self, key):
    """(apply_fn, params): the base checkpoint config.ocr.base_checkpoint; random weights when it is ''
    (or missing and config.ocr.require_base is False); config.lora's adapters added to it."""
    _, params = self.init_untrained(key)
    path = resolve(self.c.base_checkpoint)
    if path and os.path.exists(path):
      params = params_io.load_params(path, params, 'config.ocr.base_checkpoint')
    elif path and self.c.require_base:
      raise FileNotFoundError(f'config.ocr.base_checkpoint={self.c.base_checkpoint!r} does not exist; '
                              f'train it with python -m ddrl_jax.pretrain --config=configs/ocr_tiny.py')
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: self._build(key, adapters=False)))
    model = nnx.merge(graphdef, params)
    lora_lib.attach(model, self.lora, lora_lib.adapter_key(key))
    graphdef, params = nnx.split(model)
    return make_apply_fn(graphdef, self.c.min_t, self.c.guidance), params

  @property
  def compute_dtype(self):
    return jnp.dtype(self.model_cfg.dit.dtype).name

  def forward_flops_per_sample(self):
    """Model FLOPs of one apply_fn call on one (3, H, W) image: the DiT on one frame of H x W pixels with
    text_length byte tokens (`cosmos_dit.forward_flops`), twice with classifier-free guidance (one
    forward of 2B); the byte embedding is a lookup."""
    _, h, w = self.sample_shape
    _, parts = cosmos_dit.forward_flops(self.model_cfg.dit, latent=(1, h, w),
                                        text_tokens=self.c.text_length)
    return float(sum(parts.values())) * (1 if self.c.guidance == 1.0 else 2)

  def init_untrained(self, key):
    """(apply_fn, random params) without adapters: what ddrl_jax.pretrain starts from."""
    graphdef, params = nnx.split(self._build(key, adapters=False))
    return make_apply_fn(graphdef, self.c.min_t, self.c.guidance), params

  def abstract_params(self, key):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: self._build(key)))
    return make_apply_fn(graphdef, self.c.min_t, self.c.guidance), params

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
    """Batch `step` of the deterministic pretraining stream: (x0 (B, 3, H, W), ids (B, L))."""
    texts, images = text_render.batch(self.c.data_seed, range(step * batch, (step + 1) * batch))
    return to_pixels(images), self.ids_of(texts)

  # --------------------------------------------------------------------------------- rewards
  def reward_inputs(self, samples, cond):
    """(M, 3, H, W) samples -> ((M, H, W, 3) uint8 images, finite (M,))."""
    del cond
    return to_uint8(samples)

  def evaluate(self, samples, key, cond=None):
    """OCR accuracy of (M, 3, H, W) samples of `cond` (the trainer passes the eval conditions), read by
    the training reader (Tesseract: ocr, ocr_exact) and by the held-out judge (RapidOCR: ocr_rapid,
    ocr_exact_rapid); reader_gap = ocr - ocr_rapid on the same images."""
    del key
    images, finite = to_uint8(samples)
    if cond is None:
      return dict(finite_fraction=float(finite.mean()))
    kwargs = self.config.reward.kwargs
    readers = getattr(self, '_readers', None) or (
        ocr_reward.OCRReward(**dict(kwargs.get('ocr', {}))),
        ocr_reward.RapidOCRReward(**dict(kwargs.get('ocr_rapid', {}))))
    self._readers = readers
    prompts = self.prompts(cond)
    out = {}
    for suffix, reader in zip(('', '_rapid'), readers):
      scores = np.where(finite, reader(images, prompts), 0.0)
      out[f'ocr{suffix}'] = float(scores.mean())
      out[f'ocr_exact{suffix}'] = float((scores == 1).mean())
    out['reader_gap'] = out['ocr'] - out['ocr_rapid']
    out['finite_fraction'] = float(finite.mean())
    return out

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
