"""The second OCR judge: RapidOCR (PP-OCRv4 ONNX models inside the rapidocr-onnxruntime wheel, offline)
reads real renders and scores them with the same FlowGRPO text score as Tesseract."""
import numpy as np
import pytest

from ddrl_jax import rewards
from ddrl_jax.rewards import ocr
from ddrl_jax.tasks import text_render as tr

PLAIN = tr.Style(background=(0.95, 0.95, 0.9), background_end=(0.95, 0.95, 0.9), angle=0.0, texture='none',
                 texture_strength=0.0, ink=(0.05, 0.05, 0.1), font=tr.FONTS[0], font_size=22, dx=0, dy=0,
                 noise=0.0)


def plain(text):
  return tr.render(text, PLAIN, np.random.default_rng(0))


def test_rapidocr_reads_real_renders():
  texts, images = tr.batch(0, range(8), 'heldout')
  scores = rewards.make_reward('ocr_rapid')(images, [tr.prompt_of(t) for t in texts])
  assert scores.dtype == np.float32 and scores.shape == (8,)
  assert (scores == 1).sum() >= 7, (texts, scores)


def test_rapidocr_gives_the_flowgrpo_score():
  reward = ocr.RapidOCRReward()
  images = np.stack([plain('KM5'), plain('KM5'), plain('KM5'), np.full_like(plain('A'), 240)])
  prompts = ['a sign that says "KM5"', 'a sign that says "km 58"', 'a sign that says "XT"',
             'a sign that says "KM5"']
  # read 'km5': the target itself; one insertion short of 'km58' (1 - 1/4); nothing of 'xt' (distance
  # 3 >= 2, capped); a blank page reads nothing.
  np.testing.assert_allclose(reward(images, prompts), [1.0, 0.75, 0.0, 0.0])
  assert reward.read(plain('HEX7')).upper() == 'HEX7'
  video = np.stack([plain('KM5')] * 3 + [np.full_like(plain('A'), 240)])[None]      # (1, 4, H, W, 3)
  np.testing.assert_allclose(ocr.RapidOCRReward(frame_stride=2)(video, ['"KM5"']), [1.0])
  np.testing.assert_allclose(ocr.RapidOCRReward(frame_stride=1)(video, ['"KM5"']), [0.75])


def test_rapidocr_engine_is_built_once_with_one_thread():
  assert ocr.rapidocr_engine() is ocr.rapidocr_engine()
  engine = ocr.rapidocr_engine()
  assert engine.text_det.infer.session.get_session_options().intra_op_num_threads == 1
  assert not engine.use_cls and engine.text_score == 0.5


def test_rapidocr_rejects_wrong_input():
  reward = rewards.make_reward('ocr_rapid')
  with pytest.raises(ValueError, match='uint8'):
    reward(np.zeros((1, 32, 96, 3), np.float32), ['"a"'])
  with pytest.raises(ValueError, match='uint8'):
    reward(np.zeros((32, 96), np.uint8), ['"a"'])
  with pytest.raises(ValueError, match='prompts'):
    reward(np.zeros((2, 32, 96, 3), np.uint8), ['"a"'])
  with pytest.raises(ValueError, match=r'\(H, W, 3\)'):
    reward(np.zeros((1, 32, 96, 2), np.uint8), ['"a"'])
  with pytest.raises(ValueError, match='upscale'):
    ocr.RapidOCRReward(upscale=0)
