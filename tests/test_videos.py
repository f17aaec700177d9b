"""Evaluation videos: MP4 files (ddrl_jax/video_io.py) and the TensorBoard GIF the trainer writes."""
import glob
import io
import os
import struct
import sys

import numpy as np
import pytest

from configs import cosmos2b
from ddrl_jax import checkpoints as checkpoints_lib
from ddrl_jax import config as config_lib
from ddrl_jax import console
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import trainer as trainer_lib
from ddrl_jax import video_io

pytest.importorskip('imageio_ffmpeg')


def _video(f, h, w, seed=0):
  """A smooth moving gradient with a little noise: what a codec keeps well, unlike pure noise."""
  t, y, x = np.meshgrid(np.arange(f), np.arange(h), np.arange(w), indexing='ij')
  base = np.stack([(x * 255 / max(w - 1, 1) + 20 * t) % 256, y * 255 / max(h - 1, 1),
                   128 + 60 * np.sin((x + y + 3 * t) / 5.0)], -1)
  noise = np.random.default_rng(seed).normal(0, 4, base.shape)
  return np.clip(base + noise, 0, 255).astype(np.uint8)


def _events(logdir):
  """Every Event of the tfevents files under logdir (the TFRecord framing: length, crc, data, crc)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  out = []
  for path in sorted(glob.glob(os.path.join(str(logdir), 'events.out.tfevents.*'))):
    data = open(path, 'rb').read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack('<Q', data[pos:pos + 8])
      out.append(event_pb2.Event.FromString(data[pos + 12:pos + 12 + length]))
      pos += 12 + length + 4
  return out


def _images(logdir):
  """{(tag, step): Summary.Image} of the event files."""
  return {(v.tag, e.step): v.image for e in _events(logdir) for v in e.summary.value
          if v.HasField('image')}


def _gif_frames(encoded):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  img = Image.open(io.BytesIO(encoded))
  assert img.format == 'GIF'
  return img.n_frames, img.size


# ------------------------------------------------------------------------------------------- video_io
@pytest.mark.parametrize('shape', [(5, 32, 32), (7, 48, 64), (3, 31, 45)])
def test_mp4_round_trip_keeps_frames_size_and_pixels(tmp_path, shape):
  f, h, w = shape
  video = _video(f, h, w)
  path = tmp_path / 'sub' / 'clip.mp4'
  video_io.write_mp4(path, video, fps=8)
  assert path.exists() and os.listdir(tmp_path / 'sub') == ['clip.mp4']    # no temporary left
  back = video_io.read_mp4(path)
  assert back.dtype == np.uint8
  # Even sizes as they are; an odd height or width one more, by edge replication (never resized).
  assert back.shape == (f, h + h % 2, w + w % 2, 3)
  err = np.abs(back[:, :h, :w].astype(np.float32) - video)
  assert err.mean() < 6.0, err.mean()             # H.264 is lossy; crf 10 keeps it close
  if h % 2:
    pad_err = np.abs(back[:, h, :w].astype(np.float32) - video[:, h - 1])
    assert pad_err.mean() < 8.0, pad_err.mean()   # the padded row repeats the last one


def test_pad_to_even_repeats_the_edge():
  video = np.arange(2 * 3 * 5 * 3, dtype=np.uint8).reshape(2, 3, 5, 3)
  padded = video_io.pad_to_even(video)
  assert padded.shape == (2, 4, 6, 3)
  np.testing.assert_array_equal(padded[:, :3, :5], video)
  np.testing.assert_array_equal(padded[:, 3, :5], video[:, 2])
  np.testing.assert_array_equal(padded[:, :3, 5], video[:, :, 4])
  even = video[:, :2, :4]
  assert video_io.pad_to_even(even) is even


def test_write_mp4_rejects_what_is_not_uint8_frames(tmp_path):
  with pytest.raises(ValueError, match=r'uint8 \(F, H, W, 3\)'):
    video_io.write_mp4(tmp_path / 'a.mp4', np.zeros((5, 8, 8, 3), np.float32))
  with pytest.raises(ValueError, match=r'uint8 \(F, H, W, 3\)'):
    video_io.write_mp4(tmp_path / 'a.mp4', np.zeros((8, 8, 3), np.uint8))


def test_mp4_without_imageio_ffmpeg_names_the_install(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'imageio_ffmpeg', None)     # import fails as if not installed
  with pytest.raises(ImportError, match=r"pip install -e '\.\[video\]'"):
    video_io.write_mp4(tmp_path / 'a.mp4', _video(2, 8, 8))
  with pytest.raises(ImportError, match=r"pip install -e '\.\[video\]'"):
    video_io.read_mp4(tmp_path / 'a.mp4')


def test_gif_and_tiling():
  videos = np.stack([_video(5, 16, 12, seed=i) for i in range(3)])
  tiled = video_io.tile_videos(videos)
  assert tiled.shape == (5, 16, 3 * 12 + 2 * 2, 3)
  np.testing.assert_array_equal(tiled[:, :, 14:26], videos[1])
  assert _gif_frames(video_io.gif_bytes(tiled, fps=8)) == (5, (40, 16))


def test_metric_writer_puts_an_animated_gif_in_tensorboard(tmp_path):
  writer = metrics_lib.MetricWriter(tmp_path)
  writer.write(3, {'eval/reward': 0.5})
  writer.write_videos(3, {'eval/videos': _video(5, 16, 24)}, fps=8)
  writer.close()
  images = _images(tmp_path / 'tensorboard')
  assert set(images) == {('eval/videos', 3)}
  image = images['eval/videos', 3]
  assert (image.height, image.width, image.colorspace) == (16, 24, 3)
  assert _gif_frames(image.encoded_image_string) == (5, (24, 16))
  metrics_lib.NullWriter().write_videos(3, {'eval/videos': _video(5, 16, 24)}, fps=8)   # no-op


# --------------------------------------------------------------------------------------- the trainer
class _FakeVideoTask:
  """What write_samples reads of a video task: samples are already the uint8 videos."""
  sample_shape = (5, 30, 32, 3)

  def reward_inputs(self, samples, cond):
    del cond
    return np.asarray(samples, np.uint8), np.ones(len(samples), bool)


def _bare_trainer(workdir, **overrides):
  """A Trainer with only what evaluation's writing reads (no model is built)."""
  config = cosmos2b.get_config('smoke')
  config.update(overrides)
  trainer = object.__new__(trainer_lib.Trainer)
  trainer.config, trainer.workdir, trainer.task = config, str(workdir), _FakeVideoTask()
  trainer.last_samples = trainer.last_videos = None
  trainer.eval_videos, trainer._warned_mp4 = {}, False     # pylint: disable=protected-access
  return trainer


def _fake_evaluation(trainer, videos):
  def evaluate(step):
    for name in ('eval', 'eval_ema'):
      trainer.write_samples(name, step, videos, {'index': np.arange(len(videos))})
    return {'eval/reward': 0.25}
  return evaluate


def test_evaluation_writes_mp4s_grid_and_tensorboard_video(tmp_path):
  videos = np.stack([_video(5, 30, 32, seed=i) for i in range(6)])
  trainer = _bare_trainer(tmp_path, eval_videos=3, eval_video_fps=4)
  trainer.evaluate = _fake_evaluation(trainer, videos)
  writer = metrics_lib.MetricWriter(tmp_path)
  for step in (0, 7):
    trainer._evaluate_and_write(writer, step)     # pylint: disable=protected-access
  writer.close()
  samples = tmp_path / 'samples'
  names = sorted(os.listdir(samples))
  assert names == sorted([f'{n}_{s:06d}.png' for n in ('eval', 'eval_ema') for s in (0, 7)] +
                         [f'{n}_{s:06d}_{i}.mp4' for n in ('eval', 'eval_ema') for s in (0, 7)
                          for i in range(3)])
  back = video_io.read_mp4(samples / 'eval_000007_2.mp4')
  assert back.shape == (5, 30, 32, 3)
  assert np.abs(back.astype(np.float32) - videos[2]).mean() < 6.0
  assert trainer.last_videos == str(samples / 'eval_ema_000007_*.mp4')
  assert trainer.eval_videos == {}
  images = _images(tmp_path / 'tensorboard')
  assert set(images) == {(f'{n}/videos', s) for n in ('eval', 'eval_ema') for s in (0, 7)}
  image = images['eval/videos', 7]
  assert (image.height, image.width) == (30, 3 * 32 + 2 * 2)
  assert _gif_frames(image.encoded_image_string) == (5, (100, 30))
  table = console.summary_table({'reward_mean': 0.1}, str(tmp_path), samples=trainer.last_samples,
                                videos=trainer.last_videos)
  assert 'eval_ema_000007_*.mp4' in table


def test_eval_videos_zero_writes_only_the_grid(tmp_path):
  videos = np.stack([_video(5, 30, 32, seed=i) for i in range(2)])
  trainer = _bare_trainer(tmp_path, eval_videos=0)
  trainer.evaluate = _fake_evaluation(trainer, videos)
  writer = metrics_lib.MetricWriter(tmp_path)
  trainer._evaluate_and_write(writer, 1)          # pylint: disable=protected-access
  writer.close()
  assert sorted(os.listdir(tmp_path / 'samples')) == ['eval_000001.png', 'eval_ema_000001.png']
  assert _images(tmp_path / 'tensorboard') == {}


def test_without_imageio_ffmpeg_training_goes_on_with_a_warning(tmp_path, monkeypatch, caplog):
  monkeypatch.setitem(sys.modules, 'imageio_ffmpeg', None)
  videos = np.stack([_video(5, 30, 32, seed=i) for i in range(2)])
  trainer = _bare_trainer(tmp_path)
  trainer.evaluate = _fake_evaluation(trainer, videos)
  writer = metrics_lib.MetricWriter(tmp_path)
  trainer._evaluate_and_write(writer, 1)          # pylint: disable=protected-access
  writer.close()
  assert not glob.glob(str(tmp_path / 'samples' / '*.mp4'))
  assert [r.message for r in caplog.records].count(
      "no MP4s of the evaluation videos: writing and reading MP4 videos needs imageio-ffmpeg "
      "(pip install -e '.[video]'): import of imageio_ffmpeg halted; None in sys.modules") == 1
  assert set(_images(tmp_path / 'tensorboard')) == {('eval/videos', 1), ('eval_ema/videos', 1)}


def test_video_keys_are_validated_and_safe_to_change():
  config = cosmos2b.get_config('smoke')
  assert (config.eval_videos, config.eval_video_fps) == (4, 8)
  for key, value in (('eval_videos', -1), ('eval_video_fps', 0)):
    bad = cosmos2b.get_config('smoke')
    bad[key] = value
    with pytest.raises(config_lib.ConfigError, match=key):
      config_lib.validate(bad, 8)
  saved, now = config.to_dict(), config.to_dict()
  del saved['eval_videos'], saved['eval_video_fps']
  now['eval_videos'], now['eval_video_fps'] = 0, 24
  safe, unsafe = checkpoints_lib.config_differences(saved, now)
  assert unsafe == [] and {k for k, *_ in safe} == {'eval_videos', 'eval_video_fps'}


@pytest.mark.slow
def test_cosmos_smoke_run_writes_watchable_mp4s(tmp_path):
  """configs/cosmos2b.py:smoke for one iteration: its end-of-run evaluation writes 4 MP4s per parameter
  set, each the smoke video's 5 frames at 32x32, and the TensorBoard GIF."""
  config = cosmos2b.get_config('smoke')
  config.num_iterations = 1
  trainer = trainer_lib.Trainer(config, tmp_path)
  trainer.train(progress=False)
  mp4s = sorted(glob.glob(str(tmp_path / 'samples' / 'eval_000001_*.mp4')))
  assert [os.path.basename(p) for p in mp4s] == [f'eval_000001_{i}.mp4' for i in range(4)]
  for path in mp4s:
    video = video_io.read_mp4(path)
    assert video.shape == (5, 32, 32, 3) and video.dtype == np.uint8
  assert (tmp_path / 'samples' / 'eval_000001.png').exists()
  images = _images(tmp_path / 'tensorboard')
  tags = {t for t, s in images if s == 1}
  assert 'eval/videos' in tags, sorted(images)
  image = images['eval/videos', 1]
  assert _gif_frames(image.encoded_image_string) == (5, (4 * 32 + 3 * 2, 32))
