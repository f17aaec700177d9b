"""The OCR text-rendering task: the generator's determinism, its held-out split and style range, the
real data's legibility to the OCR reward, and the task's conditions, data and records."""
import jax
import numpy as np

from configs import ocr_tiny
from ddrl_jax.rewards import make_reward
from ddrl_jax.tasks import ocr
from ddrl_jax.tasks import text_render as tr


def test_examples_are_a_pure_function_of_seed_index_split():
  a_text, a_img = tr.example(3, 17)
  b_text, b_img = tr.example(3, 17)
  assert a_text == b_text
  np.testing.assert_array_equal(a_img, b_img)
  c_text, c_img = tr.example(3, 18)
  assert (c_text, c_img.tobytes()) != (a_text, a_img.tobytes())
  assert a_img.shape == (tr.HEIGHT, tr.WIDTH, 3) and a_img.dtype == np.uint8


def test_held_out_strings_never_appear_in_training():
  train = {tr.example(0, i, 'train')[0] for i in range(3000)}
  held = {tr.example(0, i, 'heldout')[0] for i in range(500)}
  assert not train & held
  assert all(tr.split_of(t) == 'train' for t in train)
  assert all(tr.split_of(t) == 'heldout' for t in held)
  assert all(set(t) <= set(tr.ALPHABET) and tr.MIN_LEN <= len(t) <= tr.MAX_LEN for t in train | held)
  # The hash split holds out about 1 string in HELD_OUT_EVERY of all strings.
  rng = np.random.default_rng(0)
  sample = [''.join(rng.choice(list(tr.ALPHABET), 4)) for _ in range(4000)]
  frac = np.mean([tr.split_of(t) == 'heldout' for t in sample])
  assert abs(frac - 1 / tr.HELD_OUT_EVERY) < 0.02


def test_styles_vary_and_keep_contrast():
  _, images = tr.batch(0, range(200))
  backgrounds = images[:, :3, :3].reshape(200, -1, 3).mean(1)
  assert backgrounds.std(0).min() > 30                     # colours spread over the RGB range
  dark = (backgrounds.mean(1) < 128).mean()
  assert 0.2 < dark < 0.6                                  # both light-on-dark and dark-on-light
  for i in range(20):
    rng = np.random.default_rng([0, i, 0])
    tr.sample_text(rng, 'train')
    s = tr.sample_style(rng)
    assert min(abs(tr._luma(s.ink) - tr._luma(s.background)),
               abs(tr._luma(s.ink) - tr._luma(s.background_end))) >= 0.45
  assert tr.text_origin('ABC') % (tr.CELL // 2) == 0 and tr.text_origin('ABCDE') % (tr.CELL // 2) == 0


def test_real_renders_are_legible_to_the_ocr_reward():
  texts, images = tr.batch(0, range(64), 'heldout')
  scores = make_reward('ocr')(images, [tr.prompt_of(t) for t in texts])
  assert scores.mean() > 0.8, scores.mean()


def test_task_conditions_prompts_data_and_records():
  task = ocr.OCRTask(ocr_tiny.get_config())
  cond = task.conditions(jax.random.key(0), 6)
  assert cond.shape == (6, task.c.text_length) and cond.dtype == np.int32
  texts = task.texts_of(cond)
  assert all(tr.split_of(t) == 'train' for t in texts)
  assert task.prompts(cond) == [f'a sign that says "{t}"' for t in texts]
  held = task.texts_of(task.eval_conditions(jax.random.key(0), 6))
  assert all(tr.split_of(t) == 'heldout' for t in held)
  x0 = np.asarray(task.data(jax.random.key(1), cond))
  assert x0.shape == (6,) + task.sample_shape and -1 <= x0.min() and x0.max() <= 1
  images, finite = task.reward_inputs(x0, cond)
  assert images.dtype == np.uint8 and finite.all()
  scores = make_reward('ocr')(images, task.prompts(cond))
  assert scores.mean() > 0.6                               # data paired with its condition
  ids, x0_rec = task.from_records({'prompt': task.prompts(cond), 'sample': images}, None)
  np.testing.assert_array_equal(ids, cond)
  np.testing.assert_allclose(x0_rec, x0, atol=1 / 127.5)


# ------------------------------------------------------------------------------ evaluation metrics
def test_image_stats_recover_a_constructed_image():
  from ddrl_jax.tasks import ocr_metrics  # pylint: disable=g-import-not-at-top
  img = np.zeros((32, 96, 3), np.uint8)
  img[:] = (200, 220, 240)                                 # background
  img[10:22, 30:70] = (20, 10, 0)                          # a 12 x 40 block of ink
  s = dict(zip(ocr_metrics.STAT_NAMES, ocr_metrics.image_stats(img)))
  np.testing.assert_allclose([s['bg_r'], s['bg_g'], s['bg_b']], np.array([200, 220, 240]) / 255)
  np.testing.assert_allclose([s['ink_r'], s['ink_g'], s['ink_b']], np.array([20, 10, 0]) / 255)
  np.testing.assert_allclose(s['coverage'], 12 * 40 / (32 * 96))
  np.testing.assert_allclose([s['box_w'], s['box_h'], s['box_x'], s['box_y']],
                             [40 / 96, 12 / 32, 50 / 96, 16 / 32])
  flat = ocr_metrics.image_stats(np.full((8, 8, 3), 128, np.uint8))
  assert flat[7] == 0.0                                   # no ink on a flat image


def test_collapsed_styles_drift_more_and_are_less_diverse_than_data():
  from ddrl_jax.tasks import ocr_metrics  # pylint: disable=g-import-not-at-top
  texts, data = tr.batch(0, range(128), 'heldout')
  _, other = tr.batch(1, range(128), 'heldout')
  data_stats = ocr_metrics.batch_stats(data)
  # A reward hacker's output: every string black on white, no texture, no jitter.
  plain = tr.Style(background=(1, 1, 1), background_end=(1, 1, 1), angle=0.0, texture='none',
                   texture_strength=0.0, ink=(0, 0, 0), font=tr.FONTS[1], font_size=24, dx=0, dy=0,
                   noise=0.0)
  rng = np.random.default_rng(0)
  collapsed = np.stack([tr.render(t, plain, rng) for t in texts])
  hacked_stats = ocr_metrics.batch_stats(collapsed)
  drift_data = ocr_metrics.style_drift(ocr_metrics.batch_stats(other), data_stats)
  drift_hacked = ocr_metrics.style_drift(hacked_stats, data_stats)
  assert drift_hacked > 5 * drift_data, (drift_hacked, drift_data)
  div_data = ocr_metrics.group_diversity(ocr_metrics.batch_stats(other).reshape(32, 4, -1), data_stats)
  div_hacked = ocr_metrics.group_diversity(hacked_stats.reshape(32, 4, -1), data_stats)
  assert div_hacked < 0.5 * div_data, (div_hacked, div_data)
  # The Frechet distance itself: 0 for identical samples, the squared mean shift for shifted ones.
  a = np.random.default_rng(1).standard_normal((4000, 3))
  assert ocr_metrics.frechet_distance(a, a) < 1e-4
  np.testing.assert_allclose(ocr_metrics.frechet_distance(a, a + [2.0, 0, 0]), 4.0, rtol=1e-3)
