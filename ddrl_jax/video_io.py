"""Evaluation videos people can watch: MP4 files (H.264) and animated GIFs for TensorBoard.

write_mp4 encodes uint8 (F, H, W, 3) frames with imageio-ffmpeg's bundled ffmpeg (`pip install -e
'.[video]'`) as H.264 (libx264) in yuv420p, the pixel format every player plays. yuv420p stores colour at
half resolution, so its width and height must be even: a frame with an odd height or width is padded by
one row or column repeating its last one (edge replication), never resized; the file is then at most one
pixel taller and wider than the frames. (imageio-ffmpeg by default resizes frames to a multiple of 16
with only a warning; this module pads to even itself and turns that off.)

gif_bytes encodes the same frames as an animated GIF (PIL), which TensorBoard's image dashboard plays:
tensorboardX's add_video needs moviepy, so `metrics.MetricWriter.write_videos` puts these bytes in an
image summary itself, as add_video would.
"""
import contextlib
import io
import os
import tempfile
import warnings

import numpy as np

from ddrl_jax import storage

INSTALL = "pip install -e '.[video]'"


def _imageio_ffmpeg():
  try:
    import imageio_ffmpeg  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f'writing and reading MP4 videos needs imageio-ffmpeg ({INSTALL}): {e}') from e
  return imageio_ffmpeg


@contextlib.contextmanager
def _ffmpeg_starts():
  """Where imageio-ffmpeg's generators start ffmpeg (subprocess: a fork then exec at once), without
  JAX's warning that fork and its threads do not mix: nothing of JAX runs in the child."""
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', message=r'os\.fork\(\) was called', category=RuntimeWarning)
    yield


def _check_video(video_u8):
  video = np.asarray(video_u8)
  if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3 or not video.shape[0]:
    raise ValueError(f'expected uint8 (F, H, W, 3) frames with F >= 1, got {video.shape} {video.dtype}')
  return video


def pad_to_even(video_u8):
  """(F, H, W, 3) -> (F, H + H % 2, W + W % 2, 3): an odd height or width gets one more row or column,
  a copy of the last one (yuv420p needs even sizes)."""
  _, h, w, _ = video_u8.shape
  if h % 2 == 0 and w % 2 == 0:
    return video_u8
  return np.pad(video_u8, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode='edge')


def write_mp4(path, video_u8, fps=8, quality=8):
  """Writes uint8 (F, H, W, 3) RGB frames to `path` (local or a bucket URL) as an H.264 yuv420p MP4 at
  `fps` frames per second. Odd heights or widths are padded to even by edge replication (see the module
  docstring). quality: imageio-ffmpeg's 1..10 (8: x264 crf 10, nearly lossless; small files at
  evaluation sizes). Raises ImportError naming the install when imageio-ffmpeg is missing."""
  imageio_ffmpeg = _imageio_ffmpeg()
  video = np.ascontiguousarray(pad_to_even(_check_video(video_u8)))
  _, h, w, _ = video.shape
  path = str(path)
  remote = storage.is_remote(path)
  if remote:
    fd, local = tempfile.mkstemp(suffix='.mp4')
    os.close(fd)
  else:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    local = f'{path}.tmp{os.getpid()}.mp4'     # renamed into place: a reader never sees half a file
  try:
    gen = imageio_ffmpeg.write_frames(
        local, (w, h), pix_fmt_in='rgb24', pix_fmt_out='yuv420p', fps=float(fps), quality=quality,
        codec='libx264', macro_block_size=1, ffmpeg_log_level='error')
    with _ffmpeg_starts():
      gen.send(None)
    for frame in video:
      gen.send(frame)
    gen.close()
    if remote:
      with open(local, 'rb') as f:
        storage.write_bytes(path, f.read())
    else:
      os.replace(local, path)
  finally:
    if os.path.exists(local):
      os.remove(local)


def read_mp4(path):
  """The frames of a video file as uint8 (F, H, W, 3) RGB (a local path)."""
  imageio_ffmpeg = _imageio_ffmpeg()
  reader = imageio_ffmpeg.read_frames(str(path), pix_fmt='rgb24')
  with _ffmpeg_starts():
    meta = reader.__next__()
  w, h = meta['size']
  frames = [np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader]
  if not frames:
    raise ValueError(f'{path}: no frames')
  return np.stack(frames)


def gif_bytes(video_u8, fps=8):
  """An animated GIF (looping) of uint8 (F, H, W, 3) frames, as bytes (PIL; palette quantized)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  video = _check_video(video_u8)
  images = [Image.fromarray(f) for f in video]
  buffer = io.BytesIO()
  images[0].save(buffer, format='GIF', save_all=True, append_images=images[1:],
                 duration=max(1, round(1000 / fps)), loop=0, disposal=1)
  return buffer.getvalue()


def tile_videos(videos_u8, gap=2):
  """(N, F, H, W, 3) -> (F, H, N * (W + gap) - gap, 3): the videos side by side, white between them."""
  n, f, h, w, _ = videos_u8.shape
  out = np.full((f, h, n * (w + gap) - gap, 3), 255, np.uint8)
  for i, v in enumerate(videos_u8):
    out[:, :, i * (w + gap):i * (w + gap) + w] = v
  return out
