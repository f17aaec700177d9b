"""Judges of data-typicality for the OCR task: what the paper means by reward hacking (samples leaving the
data manifold), measured by networks that neither trained the policy nor score the reward.

- `TypicalityJudge`: the denoising error, on generated images, of an independent diffusion model pretrained
  on the renders with another seed (another initialization and another render stream; shipped as
  `checkpoints/ocr_tiny_judge`). The x0 MSE of its null-text (unconditional) prediction at t = 0.1 ... 0.9
  with fixed noise, per image: high for textures the renders never have (grids, noise), but also low for
  images smoother than the renders (flat tiles, noise-free samples), so `outside_fraction` (the share of
  images outside real renders' central 95%) is its two-sided form. Unconditional, so it does not score
  whether the text is the prompt's (that is the reward's job).
- `RecognizerFeatures` + `ocr_metrics.frechet_distance`: a Frechet distance to real renders in the features of
  RapidOCR's PP-OCRv4 recognizer (the ONNX model inside the rapidocr-onnxruntime wheel): the (T, C) sequence
  that feeds its CTC classifier, mean-pooled over T. It sees glyph shapes, blur and texture, which the
  hand-made style statistics (`ocr_metrics`) do not.
- `FrechetJudge`: that distance against a fixed set of real renders (held-out strings, seed 101).

benchmarks/ocr_judges.py calibrates them on real renders, the base model and collapsed samples.
"""
import functools
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np

from ddrl_jax.tasks import ocr as ocr_task
from ddrl_jax.tasks import ocr_metrics
from ddrl_jax.tasks import text_render

JUDGE_CHECKPOINT = 'checkpoints/ocr_tiny_judge'
FEATURE_NODE = 'transpose_51.tmp_0'      # (B, T, C) input of the recognizer's CTC classifier (PP-OCRv4)
REC_HEIGHT = 48                          # the recognizer's input height (rapidocr's rec_img_shape)


class TypicalityJudge:
  """Per-image denoising error of an independently pretrained model (see the module docstring).

  config: an OCR task config whose model matches the judge checkpoint (configs/ocr_tiny.py);
  checkpoint: a params export of ddrl_jax.pretrain (relative paths from the repository root);
  range_renders: how many real renders `real_range` (hence `outside_fraction`) is measured on."""

  def __init__(self, config, checkpoint=JUDGE_CHECKPOINT, times=tuple(np.linspace(0.1, 0.9, 9)), seed=11,
               batch=256, range_renders=1024):
    from ddrl_jax import tasks  # pylint: disable=g-import-not-at-top  (tasks imports this package)
    config = config.copy_and_resolve_references()
    path = checkpoint if os.path.isabs(checkpoint) else os.path.join(ocr_task.REPO_ROOT, checkpoint)
    if not os.path.exists(path):
      raise FileNotFoundError(f'typicality judge {checkpoint!r} does not exist; pretrain it with '
                              '`python -m ddrl_jax.pretrain --config=configs/ocr_tiny.py '
                              '--config.pretrain.seed=1 --config.ocr.data_seed=1` (benchmarks/ocr_judges.py)')
    config.ocr.base_checkpoint, config.ocr.require_base = path, True
    config.lora.rank = 0
    self.task = tasks.get_task(config)
    self.apply_fn, self.params = self.task.init_model(jax.random.key(0))
    self.times, self.seed, self.batch = tuple(float(t) for t in times), seed, batch
    self.range_renders = range_renders
    self._errors = jax.jit(self._errors_of)

  def _errors_of(self, params, x0, noise):
    """(len(times), B) x0 MSE of the null-text prediction; x0, noise (len(times), B, 3, H, W)."""
    null = jnp.zeros((x0.shape[1], self.task.c.text_length), jnp.int32)

    def one(x0_t, noise_t, t):
      tb = jnp.full((x0_t.shape[0],), t, jnp.float32)
      x_t = (1.0 - t) * x0_t + t * noise_t
      v = self.apply_fn(params, x_t, tb, null)
      x0_hat = x_t - t * v                 # rectified flow: v = noise - x0
      return ((x0_hat - x0_t)**2).reshape(x0_t.shape[0], -1).mean(-1)

    return jnp.stack([one(x0[i], noise[i], t) for i, t in enumerate(self.times)])

  def per_image(self, images_u8):
    """(M,) mean over the judge's times of the x0 MSE, for (M, H, W, 3) uint8 images (the last set's
    values are kept: the mean and `outside_fraction` of one evaluation share one pass)."""
    images_u8 = np.ascontiguousarray(images_u8, np.uint8)
    key = hashlib.sha1(images_u8.tobytes()).hexdigest() + str(images_u8.shape)
    if getattr(self, '_last', (None,))[0] != key:
      self._last = (key, self._per_image(images_u8))
    return self._last[1]

  def _per_image(self, images_u8):
    x0 = ocr_task.to_pixels(images_u8)
    out = []
    for start in range(0, len(x0), self.batch):
      chunk = x0[start:start + self.batch]
      # Image i's noise depends on i alone: the same images give the same values in any batching.
      noise = np.stack([np.random.default_rng([self.seed, i]).standard_normal(
          (len(self.times),) + chunk.shape[1:]) for i in range(start, start + len(chunk))], 1)
      noise = noise.astype(np.float32)
      out.append(np.asarray(self._errors(self.params, jnp.broadcast_to(chunk, noise.shape), noise)).mean(0))
    return np.concatenate(out)

  def __call__(self, images_u8):
    return float(self.per_image(images_u8).mean())

  def real_range(self, num=None):
    """(low, high): the central 95% of the per-image error on `num` (default `range_renders`) real
    renders (held-out strings, seed 101), cached. The error alone is one-sided: smooth images (flat
    collapse, or a base model's noise-free samples) score below real renders, which carry pixel noise
    and texture."""
    if getattr(self, '_range', None) is None:
      values = self.per_image(reference_renders(num or self.range_renders))
      self._range = tuple(float(q) for q in np.quantile(values, (0.025, 0.975)))
    return self._range

  def outside_fraction(self, images_u8):
    """The share of images whose error lies outside `real_range()` (about 0.05 for real renders): a
    two-sided test of looking like the data, blind to which side."""
    low, high = self.real_range()
    values = self.per_image(images_u8)
    return float(((values < low) | (values > high)).mean())


@functools.lru_cache(maxsize=1)
def _feature_session(threads):
  """An onnxruntime session of the PP-OCRv4 recognizer with FEATURE_NODE as its output."""
  import onnx  # pylint: disable=g-import-not-at-top
  import onnxruntime as ort  # pylint: disable=g-import-not-at-top
  import rapidocr_onnxruntime  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.dirname(rapidocr_onnxruntime.__file__), 'models', 'ch_PP-OCRv4_rec_infer.onnx')
  model = onnx.load(path)
  if not any(FEATURE_NODE in n.output for n in model.graph.node):
    raise ValueError(f'{path}: no node {FEATURE_NODE!r}; the recognizer is not the PP-OCRv4 one this judge '
                     'was built for (rapidocr-onnxruntime==1.4.4)')
  del model.graph.output[:]
  model.graph.output.append(onnx.helper.make_tensor_value_info(FEATURE_NODE, onnx.TensorProto.FLOAT, None))
  options = ort.SessionOptions()
  options.intra_op_num_threads = threads
  options.inter_op_num_threads = 1
  return ort.InferenceSession(model.SerializeToString(), options, providers=['CPUExecutionProvider'])


def recognizer_inputs(images_u8):
  """(M, H, W, 3) uint8 -> (M, 3, 48, 48 W / H) float32 in [-1, 1], as rapidocr feeds its recognizer
  (height 48, the aspect kept; the channels as given, like the reward's reader)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  images_u8 = np.asarray(images_u8)
  h, w = images_u8.shape[1:3]
  width = int(round(w * REC_HEIGHT / h))
  resized = np.stack([np.asarray(Image.fromarray(im).resize((width, REC_HEIGHT), Image.BILINEAR))
                      for im in images_u8]).astype(np.float32)
  return np.transpose(resized / 127.5 - 1.0, (0, 3, 1, 2))


class RecognizerFeatures:
  """(M, C) features of images: RapidOCR's recognizer sequence features, mean-pooled over time."""

  def __init__(self, threads=1, batch=8):     # batch 8: 28 ms per image here, batch 64: 43
    self.threads, self.batch = threads, batch

  def __call__(self, images_u8):
    session = _feature_session(self.threads)
    x = recognizer_inputs(images_u8)
    feats = [session.run([FEATURE_NODE], {'x': x[i:i + self.batch]})[0].mean(1)
             for i in range(0, len(x), self.batch)]
    return np.concatenate(feats).astype(np.float64)


def reference_renders(num=1024, seed=101):
  """(num, H, W, 3) uint8 real renders of held-out strings: the Frechet reference set."""
  return text_render.batch(seed, range(num), 'heldout')[1]


class FrechetJudge:
  """Frechet distance of images to `reference` real renders in RecognizerFeatures' space."""

  def __init__(self, reference=None, features=None, reference_features=None):
    """reference: (M, H, W, 3) uint8 real renders (default `reference_renders()`), or their
    precomputed `reference_features` (M, C)."""
    self.features = features or RecognizerFeatures()
    if reference_features is None:
      reference_features = self.features(reference_renders() if reference is None else reference)
    self.reference = np.asarray(reference_features, np.float64)

  def __call__(self, images_u8):
    return ocr_metrics.frechet_distance(self.features(images_u8), self.reference)
