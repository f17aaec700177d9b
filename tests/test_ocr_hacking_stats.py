"""Reward-hacking statistics of tasks/ocr_metrics.py: texture energy, patch-grid energy and colour spread
on closed-form images, real renders and renders with the DanceGRPO-like patch-grid artefact."""
import numpy as np
import pytest

from ddrl_jax.tasks import ocr_metrics as om
from ddrl_jax.tasks import text_render as tr

H, W = tr.HEIGHT, tr.WIDTH


def grey(luma):
  """(M, H, W) values in [0, 1] -> (M, H, W, 3) uint8 grey images."""
  return np.repeat(np.round(np.clip(luma, 0, 1) * 255).astype(np.uint8)[..., None], 3, -1)


def grating(cycles_y, cycles_x):
  """(1, H, W, 3): a sinusoid with cycles_y / H and cycles_x / W cycles per pixel."""
  yy, xx = np.mgrid[0:H, 0:W]
  return grey(0.5 + 0.4 * np.cos(2 * np.pi * (cycles_y * yy / H + cycles_x * xx / W)))[None]


def test_flat_images_have_no_texture():
  flat = np.full((2, H, W, 3), 77, np.uint8)
  np.testing.assert_array_equal(om.texture_energy(flat), 0.0)
  np.testing.assert_array_equal(om.patch_grid_energy(flat), 0.0)


@pytest.mark.parametrize('cycles_y, cycles_x, texture, grid', [
    (0, 12, 0.0, 1.0),      # period 8 px along x (0.125 cycles/px): on the patch grid, low frequency
    (0, 6, 0.0, 0.0),       # period 16 px: neither
    (0, 30, 1.0, 0.0),      # period 3.2 px (0.3125 cycles/px): high frequency, off the patch grid
    (0, 36, 1.0, 1.0),      # 0.375 cycles/px = 3 / 8: a harmonic of the patch grid (period 8 px too)
    (8, 24, 1.0, 1.0),      # period 4 px in y and x (radius 0.35 cycles/px): both
])
def test_a_grating_has_its_energy_at_its_frequency(cycles_y, cycles_x, texture, grid):
  image = grating(cycles_y, cycles_x)
  np.testing.assert_allclose(om.texture_energy(image), [texture], atol=1e-3)
  np.testing.assert_allclose(om.patch_grid_energy(image), [grid], atol=1e-3)


def test_checkerboards_and_white_noise():
  yy, xx = np.mgrid[0:H, 0:W]
  checks8 = grey(((yy // 4 + xx // 4) % 2)[None] * 0.6 + 0.2)          # period 8 px: the patch grid
  np.testing.assert_allclose(om.patch_grid_energy(checks8), [1.0], atol=1e-9)
  np.testing.assert_allclose(om.texture_energy(grey(((yy + xx) % 2)[None])), [1.0], atol=1e-9)
  noise = grey(np.random.default_rng(0).uniform(size=(64, H, W)))
  chance = (8**2 - 1) / (H * W - 1)                                     # 0.021
  assert abs(om.patch_grid_energy(noise).mean() - chance) < 0.003
  # Parseval: the tiled mean patch is the DFT power at multiples of H/8 and W/8 cycles per image.
  luma = noise[0, ..., 0] / 255.0
  power = np.abs(np.fft.fft2(luma - luma.mean()))**2
  np.testing.assert_allclose(om.patch_grid_energy(noise[:1]),
                             [power[::H // 8, ::W // 8].sum() / power.sum()], rtol=1e-9)


def test_real_renders_score_low_and_a_patch_grid_is_detected():
  _, data = tr.batch(0, range(64), 'heldout')
  yy, xx = np.mgrid[0:H, 0:W]
  lines = ((yy % 8 == 0) | (xx % 8 == 0)).astype(np.float64)         # 1 px lines every 8 px
  gridded = np.clip(data + 255 * 0.15 * (lines - lines.mean())[..., None], 0, 255).astype(np.uint8)
  data_grid, hacked_grid = om.patch_grid_energy(data).mean(), om.patch_grid_energy(gridded).mean()
  assert data_grid < 0.1 and hacked_grid > 2 * data_grid, (data_grid, hacked_grid)
  data_texture, hacked_texture = om.texture_energy(data).mean(), om.texture_energy(gridded).mean()
  assert data_texture < 0.25 and hacked_texture > data_texture, (data_texture, hacked_texture)


def test_texture_statistics_reject_bad_input():
  with pytest.raises(ValueError, match='uint8'):
    om.texture_energy(np.zeros((1, H, W, 3), np.float32))
  with pytest.raises(ValueError, match=r'\(M, H, W, 3\)'):
    om.patch_grid_energy(np.zeros((H, W, 3), np.uint8))
  with pytest.raises(ValueError, match='multiple'):
    om.patch_grid_energy(np.zeros((1, 30, W, 3), np.uint8))


def test_colour_spread_is_one_for_data_and_zero_for_one_colour():
  texts, data = tr.batch(0, range(128), 'heldout')
  _, other = tr.batch(1, range(128), 'heldout')
  data_stats = om.batch_stats(data)
  assert om.colour_spread(data_stats, data_stats) == (1.0, 1.0, 1.0)
  # Independent references: background (columns 0-2) stretched 2x about its mean, ink (3-5) halved.
  stretched = data_stats.copy()
  for cols, factor in ((slice(0, 3), 2.0), (slice(3, 6), 0.5)):
    mean = data_stats[:, cols].mean(0)
    stretched[:, cols] = mean + factor * (data_stats[:, cols] - mean)
  np.testing.assert_allclose(om.colour_spread(stretched, data_stats), (2.0, 0.5, 1.25), rtol=1e-12)
  rms = lambda c: np.sqrt(np.trace(np.cov(c.T, bias=True)))      # sqrt(trace of the covariance)
  other_stats = om.batch_stats(other)
  want = [rms(other_stats[:, c]) / rms(data_stats[:, c]) for c in (slice(0, 3), slice(3, 6))]
  np.testing.assert_allclose(om.colour_spread(other_stats, data_stats)[:2], want, rtol=1e-10)
  np.testing.assert_allclose(om.colour_spread(np.repeat(data_stats[:1], 16, 0), data_stats), 0, atol=1e-12)
  background, ink, spread = om.colour_spread(om.batch_stats(other), data_stats)
  assert 0.85 < background < 1.15 and 0.85 < ink < 1.15 and spread == pytest.approx((background + ink) / 2)
  one_style = tr.Style(background=(0.8, 0.9, 1.0), background_end=(0.8, 0.9, 1.0), angle=0.0,
                       texture='none', texture_strength=0.0, ink=(0.1, 0.1, 0.2), font=tr.FONTS[0],
                       font_size=22, dx=0, dy=0, noise=0.0)
  rng = np.random.default_rng(0)
  collapsed = np.stack([tr.render(t, one_style, rng) for t in texts])
  # Only anti-aliased glyph edges (mixed colours on the ink side of Otsu's split) still vary.
  background, ink, spread = om.colour_spread(om.batch_stats(collapsed), data_stats)
  assert background < 0.02 and ink < 0.15 and spread < 0.1, (background, ink)
  np.testing.assert_allclose(om.colour_rms_spread([[0, 0, 0], [1, 1, 1]]), np.sqrt(3) / 2)
