"""Style statistics of rendered-text images, and the drift and diversity measures built on them.

Each (H, W, 3) uint8 image is split into ink and background by Otsu's threshold on luma (the minority
side is the ink), and described by STAT_NAMES:
  background RGB, ink RGB (means over their pixels, in [0, 1]), contrast |luma(ink) - luma(bg)|,
  ink coverage (fraction of ink pixels), and the ink bounding box: width, height, centre x, centre y
  (fractions of the image size).
Style drift of generated images from data is the Frechet distance between Gaussian fits of their
statistics, each statistic first standardized by the data's mean and std (so every statistic counts in
units of the data's own spread). Diversity within a prompt's group is the mean pairwise Euclidean
distance between the group's standardized statistics; a collapsed generator has ~0.
"""
import numpy as np
from scipy import linalg

STAT_NAMES = ('bg_r', 'bg_g', 'bg_b', 'ink_r', 'ink_g', 'ink_b', 'contrast', 'coverage',
              'box_w', 'box_h', 'box_x', 'box_y')


def _luma(rgb):
  return rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114


def otsu_threshold(values):
  """The threshold on (N,) values in [0, 1] maximizing the between-class variance (256 bins)."""
  hist, edges = np.histogram(values, bins=256, range=(0.0, 1.0))
  p = hist.astype(np.float64) / max(hist.sum(), 1)
  centers = (edges[:-1] + edges[1:]) / 2
  w0 = np.cumsum(p)
  m0 = np.cumsum(p * centers)
  total = m0[-1]
  with np.errstate(divide='ignore', invalid='ignore'):
    between = (total * w0 - m0)**2 / (w0 * (1 - w0))
  between[~np.isfinite(between)] = -1
  return float(edges[int(np.argmax(between)) + 1])


def image_stats(image):
  """(H, W, 3) uint8 -> (len(STAT_NAMES),) float64 style statistics (see the module docstring)."""
  rgb = np.asarray(image, np.float64) / 255.0
  luma = _luma(rgb)
  above = luma > otsu_threshold(luma.ravel())
  ink = above if above.mean() <= 0.5 else ~above
  if not ink.any() or ink.all():                      # a flat image: no ink at all
    mean = rgb.reshape(-1, 3).mean(0)
    return np.concatenate([mean, mean, [0.0, 0.0, 0.0, 0.0, 0.5, 0.5]])
  bg_rgb, ink_rgb = rgb[~ink].mean(0), rgb[ink].mean(0)
  ys, xs = np.nonzero(ink)
  h, w = ink.shape
  box = [(xs.max() - xs.min() + 1) / w, (ys.max() - ys.min() + 1) / h,
         (xs.max() + xs.min() + 1) / 2 / w, (ys.max() + ys.min() + 1) / 2 / h]
  contrast = abs(_luma(ink_rgb) - _luma(bg_rgb))
  return np.concatenate([bg_rgb, ink_rgb, [contrast, ink.mean()], box])


def batch_stats(images):
  """(M, H, W, 3) uint8 -> (M, len(STAT_NAMES))."""
  return np.stack([image_stats(img) for img in images])


def standardizer(data_stats):
  """(mean, std) of the data's statistics (std floored so a constant statistic cannot blow up)."""
  return data_stats.mean(0), np.maximum(data_stats.std(0), 1e-3)


def frechet_distance(a, b):
  """Frechet distance between Gaussian fits of (M, D) and (K, D) samples."""
  mu_a, mu_b = a.mean(0), b.mean(0)
  ridge = 1e-6 * np.eye(a.shape[1])             # keeps sqrtm defined for collapsed (singular) samples
  cov_a, cov_b = np.cov(a, rowvar=False) + ridge, np.cov(b, rowvar=False) + ridge
  covmean = np.real(linalg.sqrtm(cov_a @ cov_b))
  return float(((mu_a - mu_b)**2).sum() + np.trace(cov_a + cov_b - 2 * covmean))


def style_drift(generated_stats, data_stats):
  """Frechet distance of the standardized statistics (0 = the data's style distribution)."""
  mean, std = standardizer(data_stats)
  return frechet_distance((generated_stats - mean) / std, (data_stats - mean) / std)


def group_diversity(group_stats, data_stats):
  """Mean pairwise distance within groups: group_stats (G, K, D) standardized by the data's spread."""
  _, std = standardizer(data_stats)
  z = group_stats / std
  diff = z[:, :, None] - z[:, None, :]
  dist = np.sqrt((diff**2).sum(-1))
  k = z.shape[1]
  return float(dist.sum((1, 2)).mean() / (k * (k - 1)))
