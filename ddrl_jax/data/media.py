"""Reading images and videos as uint8 frames and fitting them to a task's media shape.

Every loader returns (F, H, W, 3) uint8 RGB frames (F = 1 for a still image):
  .png .jpg .jpeg .webp .bmp .gif  PIL; animated GIF / PNG / WebP give all their frames.
  .npy                             np.load(allow_pickle=False) of uint8 (H, W, 3) or (F, H, W, 3).
  .mp4 .webm .mov .avi .mkv        imageio's ffmpeg plugin (pip install imageio imageio-ffmpeg).
Errors are MediaError (a ValueError) whose message starts with the file's path.
"""
import itertools
import os

import numpy as np

IMAGE_EXTENSIONS = ('.png', '.jpg', '.jpeg', '.webp', '.bmp', '.gif')
VIDEO_EXTENSIONS = ('.mp4', '.webm', '.mov', '.avi', '.mkv')
MEDIA_EXTENSIONS = IMAGE_EXTENSIONS + ('.npy',) + VIDEO_EXTENSIONS


class MediaError(ValueError):
  """A media file that cannot be read or fitted; the message starts with its path."""


def _load_pil(path, max_frames):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  with Image.open(path) as img:
    count = min(getattr(img, 'n_frames', 1), max_frames or np.iinfo(np.int32).max)
    frames = []
    for i in range(count):
      img.seek(i)
      frames.append(np.asarray(img.convert('RGB'), np.uint8))
  return np.stack(frames)


def _load_npy(path):
  array = np.load(path, allow_pickle=False)
  if array.dtype != np.uint8 or array.ndim not in (3, 4) or array.shape[-1] != 3:
    raise MediaError(f'{path}: expected uint8 (H, W, 3) or (F, H, W, 3), got {array.shape} {array.dtype}')
  return array[None] if array.ndim == 3 else array


def _load_video(path, max_frames):
  try:
    import imageio.v3 as iio  # pylint: disable=g-import-not-at-top
    import imageio_ffmpeg  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise MediaError(f'{path}: reading {os.path.splitext(path)[1]} videos needs imageio with ffmpeg '
                     f"(pip install -e '.[video]'): {e}") from e
  frames = list(itertools.islice(iio.imiter(path, plugin='FFMPEG'), max_frames))
  if not frames:
    raise MediaError(f'{path}: no frames')
  return np.stack([np.asarray(f, np.uint8)[..., :3] for f in frames])


def load_media(path, max_frames=None):
  """(F, H, W, 3) uint8 frames of an image or video file (at most max_frames when given)."""
  ext = os.path.splitext(path)[1].lower()
  try:
    if ext == '.npy':
      frames = _load_npy(path)
    elif ext in IMAGE_EXTENSIONS:
      frames = _load_pil(path, max_frames)
    elif ext in VIDEO_EXTENSIONS:
      frames = _load_video(path, max_frames)
    else:
      raise MediaError(f'{path}: unknown media type {ext!r}; known: {MEDIA_EXTENSIONS}')
  except MediaError:
    raise
  except Exception as e:  # PIL, numpy and ffmpeg raise many types  # pylint: disable=broad-except
    raise MediaError(f'{path}: cannot read ({type(e).__name__}: {e})') from e
  return frames[:max_frames] if max_frames else frames


def center_crop_resize(frame, height, width):
  """(h, w, 3) uint8 -> (height, width, 3): the centred crop of the target aspect ratio, resized."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  h, w = frame.shape[:2]
  if w * height > h * width:                      # too wide: crop the width
    cw = max(1, round(h * width / height))
    frame = frame[:, (w - cw) // 2:(w - cw) // 2 + cw]
  elif w * height < h * width:                    # too tall: crop the height
    ch = max(1, round(w * height / width))
    frame = frame[(h - ch) // 2:(h - ch) // 2 + ch]
  if frame.shape[:2] == (height, width):
    return np.ascontiguousarray(frame)
  img = Image.fromarray(np.ascontiguousarray(frame)).resize((width, height), Image.Resampling.BICUBIC)
  return np.asarray(img, np.uint8)


def fit_media(frames, media_shape, where, *, pad_frames=False, repeat_images=False):
  """(F', H', W', 3) uint8 -> media_shape (F, H, W, 3) uint8.

  Takes the first F frames, then center-crops and resizes each. A still image (F' = 1) for a video
  shape (F > 1) is an error unless repeat_images (F copies); a video with 1 < F' < F frames is an
  error unless pad_frames (its last frame repeated). Errors name `where` (the file).
  """
  f, h, w, _ = media_shape
  n = frames.shape[0]
  if n < f:
    if n == 1 and not repeat_images:
      raise MediaError(f'{where}: a still image, but the task wants {f}-frame videos '
                       '(pass --repeat_images to use it as a static video)')
    if n > 1 and not pad_frames:
      raise MediaError(f'{where}: {n} frames, the task needs {f} (pass --pad_frames to repeat the last)')
    frames = np.concatenate([frames, np.repeat(frames[-1:], f - n, axis=0)])
  return np.stack([center_crop_resize(frame, h, w) for frame in frames[:f]])
