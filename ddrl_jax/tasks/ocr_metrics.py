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

Reward-hacking statistics (the artefacts of the DanceGRPO samples in benchmarks/ocr_table_dance_grpo.png:
one pale colour everywhere and a grid texture on the model's 8 px patch grid):
  texture energy (per image, in [0, 1]): the fraction of the luma's AC energy (2-D DFT power of the luma
    with its mean removed) at radial frequencies above half the Nyquist frequency, 0.25 cycles/px
    (periods under 4 px). 0 for a flat image, 1 for a checkerboard of 1 px squares; real renders ~0.14
    (text edges, pixel noise and the data's speckle texture put energy there too).
  patch-grid energy (per image, in [0, 1]): the fraction of the luma's variance in its component that is
    periodic with the patch size in both x and y (the mean patch tiled over the image; by Parseval, the
    DFT power at multiples of 1/patch cycles/px in both directions, DC excluded). 0 for a flat image, 1
    for one patch tiled; white noise gives (patch^2 - 1) / (H W - 1), 0.02 at 32 x 96; real renders
    ~0.05 (their 'checks' texture also has an 8 px period), the DanceGRPO samples ~0.29.
  colour spread (per set of images): the RMS distance of the background colours from their mean (the
    square root of the trace of their RGB covariance), over the images of an evaluation, divided by the
    same of the data's images; likewise the ink colours; colour spread is the mean of the two ratios:
    ~1 for the data's variety of colours, 0 when every image has the same colours.
"""
import numpy as np
from scipy import linalg

STAT_NAMES = ('bg_r', 'bg_g', 'bg_b', 'ink_r', 'ink_g', 'ink_b', 'contrast', 'coverage',
              'box_w', 'box_h', 'box_x', 'box_y')
BACKGROUND, INK = slice(0, 3), slice(3, 6)   # the colour columns of STAT_NAMES


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


# ------------------------------------------------------------------------------ hacking statistics
def _centred_luma(images):
  """(M, H, W, 3) uint8 -> (M, H, W) float64 luma in [0, 1] minus each image's mean."""
  images = np.asarray(images)
  if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
    raise ValueError(f'texture statistics need uint8 RGB images (M, H, W, 3), got {images.dtype} '
                     f'{images.shape}')
  luma = _luma(images.astype(np.float64) / 255.0)
  return luma - luma.mean((1, 2), keepdims=True)


def _fraction(part, total):
  """part / total, 0 where total is 0 (a flat image has no AC energy)."""
  flat = total <= 1e-12
  return np.where(flat, 0.0, part / np.where(flat, 1.0, total))


def texture_energy(images, cutoff=0.25):
  """(M, H, W, 3) uint8 -> (M,) fraction in [0, 1] of each luma's AC energy at radial frequencies above
  `cutoff` cycles/px (module docstring)."""
  luma = _centred_luma(images)
  power = np.abs(np.fft.fft2(luma))**2
  fy, fx = np.meshgrid(np.fft.fftfreq(luma.shape[1]), np.fft.fftfreq(luma.shape[2]), indexing='ij')
  high = np.hypot(fy, fx) > cutoff
  return _fraction(power[:, high].sum(-1), power.sum((1, 2)))


def patch_grid_energy(images, patch=8):
  """(M, H, W, 3) uint8, H and W multiples of `patch` -> (M,) fraction in [0, 1] of each luma's variance
  in its patch-periodic component, the mean patch tiled (module docstring)."""
  luma = _centred_luma(images)
  m, h, w = luma.shape
  if h % patch or w % patch:
    raise ValueError(f'patch_grid_energy: image size {h} x {w} is not a multiple of the patch {patch}')
  mean_patch = luma.reshape(m, h // patch, patch, w // patch, patch).mean((1, 3))
  periodic = (h // patch) * (w // patch) * (mean_patch**2).sum((1, 2))
  return _fraction(periodic, (luma**2).sum((1, 2)))


def colour_rms_spread(colours):
  """(M, 3) RGB colours -> their RMS distance from their mean, sqrt(trace of the covariance)."""
  colours = np.asarray(colours, np.float64)
  return float(np.sqrt(((colours - colours.mean(0))**2).sum(-1).mean()))


def colour_spread(generated_stats, data_stats):
  """(background ratio, ink ratio, their mean): the RMS spread of the background and ink colours of
  (M, S) generated image statistics, each relative to that of (K, S) data statistics (module docstring)."""
  ratios = [colour_rms_spread(generated_stats[:, part]) / max(colour_rms_spread(data_stats[:, part]), 1e-6)
            for part in (BACKGROUND, INK)]
  return ratios[0], ratios[1], float(np.mean(ratios))
