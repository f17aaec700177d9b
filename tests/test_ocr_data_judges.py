"""The data-typicality judges of issue 28 (ddrl_jax/tasks/ocr_judges.py): the Frechet distance against
closed forms, RapidOCR's recognizer features separating real renders from corrupted ones, and the
typicality judge (an independently pretrained model's denoising error) ranking real renders below
off-manifold images. benchmarks/ocr_judges.py calibrates both on model samples (RESULTS.md)."""
import numpy as np
import pytest

from configs import ocr_tiny
from ddrl_jax.tasks import ocr_judges
from ddrl_jax.tasks import ocr_metrics
from ddrl_jax.tasks import text_render




def test_frechet_distance_closed_forms():
  """ocr_metrics.frechet_distance (shared by style drift and the recognizer judge) on closed forms."""
  rng = np.random.default_rng(0)
  a = rng.standard_normal((400, 6))
  assert ocr_metrics.frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
  shift = np.arange(6) * 0.1
  assert ocr_metrics.frechet_distance(a, a + shift) == pytest.approx(float(shift @ shift), rel=1e-5)
  # Isotropic scaling c: the covariance term is tr(S) (1 - c)^2.
  cov = np.cov(a, rowvar=False)
  assert ocr_metrics.frechet_distance(a, 3.0 * a) == pytest.approx(
      float(np.sum((a.mean(0) * 2) ** 2) + np.trace(cov) * 4.0), rel=1e-6)
  from scipy import linalg  # pylint: disable=g-import-not-at-top
  b = rng.standard_normal((300, 6)) @ rng.standard_normal((6, 6)) + 0.5
  sa, sb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
  want = np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(sa + sb - 2 * linalg.sqrtm(sa @ sb).real)
  assert ocr_metrics.frechet_distance(a, b) == pytest.approx(float(want), rel=1e-6)


def _corrupted(images, rng):
  """An 8-px line grid (the DanceGRPO artefact) and pixel noise, each on a copy."""
  grid = images.copy()
  grid[:, ::8, :] = 255
  grid[:, :, ::8] = 255
  noisy = np.clip(images + rng.normal(0, 60, images.shape), 0, 255).astype(np.uint8)
  return grid, noisy


def test_recognizer_frechet_separates_real_renders_from_corrupted_ones():
  rng = np.random.default_rng(1)
  reference = text_render.batch(101, range(192), 'heldout')[1]
  judge = ocr_judges.FrechetJudge(reference)
  assert judge.reference.shape == (192, 120)
  other = text_render.batch(202, range(192), 'heldout')[1]
  grid, noisy = _corrupted(other, rng)
  floor, fd_grid, fd_noise = judge(other), judge(grid), judge(noisy)
  print(f'FD: other real renders {floor:.2f}, 8-px grid {fd_grid:.2f}, noise {fd_noise:.2f}')
  assert fd_grid > 5 * floor and fd_noise > 5 * floor
  again = ocr_judges.FrechetJudge(reference_features=judge.reference)
  assert again(other) == pytest.approx(floor, rel=1e-9)                 # deterministic, cacheable


def test_typicality_ranks_real_renders_below_off_manifold_images():
  """With the shipped base as the judge (any model pretrained on the renders serves): the denoising error
  of real renders is below that of the same renders with an 8-px grid or pixel noise, per image in most
  cases and on average; the same images give the same values."""
  judge = ocr_judges.TypicalityJudge(ocr_tiny.get_config(), checkpoint='checkpoints/ocr_tiny_base')
  rng = np.random.default_rng(2)
  real = text_render.batch(303, range(64), 'heldout')[1]
  grid, noisy = _corrupted(real, rng)
  r, g, n = judge.per_image(real), judge.per_image(grid), judge.per_image(noisy)
  print(f'typicality: real {r.mean():.4f}, grid {g.mean():.4f}, noise {n.mean():.4f}')
  assert r.shape == (64,) and r.mean() < g.mean() and r.mean() < n.mean()
  assert (r < g).mean() > 0.8 and (r < n).mean() > 0.8
  np.testing.assert_allclose(judge.per_image(real[:8]), r[:8], rtol=1e-5)   # batching: round-off only
  # The two-sided form: real renders fall outside real renders' central 95% about 5% of the time.
  low, high = judge.real_range(num=256)
  assert low < np.median(r) < high
  assert judge.outside_fraction(real) < 0.15 and judge.outside_fraction(grid) > 0.5
  flat = np.full_like(real, 200)
  assert judge.outside_fraction(flat) > 0.9                   # too smooth is off the manifold too
  with pytest.raises(FileNotFoundError, match='pretrain'):
    ocr_judges.TypicalityJudge(ocr_tiny.get_config(), checkpoint='checkpoints/no_such_judge')


def test_calibration_reads_back_the_tiles_of_a_written_grid(tmp_path):
  """benchmarks/ocr_judges.py judges the earlier table's samples from its PNG grids: the tiles it cuts
  are the images image_grid.write_grid wrote (empty cells of the last row dropped)."""
  import os  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks'))
  import ocr_judges as calibration  # pylint: disable=g-import-not-at-top
  from ddrl_jax import image_grid  # pylint: disable=g-import-not-at-top
  images = np.random.default_rng(0).integers(0, 250, (5, text_render.HEIGHT, text_render.WIDTH, 3), np.uint8)
  image_grid.write_grid(str(tmp_path / 'g.png'), images, columns=4)
  np.testing.assert_array_equal(calibration.grid_tiles(str(tmp_path / 'g.png')), images)
