"""Image grids written to a workdir, for samples people would rather look at than read about."""
import io

import numpy as np

from ddrl_jax import storage


def write_grid(path, images_u8, columns=8):
  """(M, H, W, 3) uint8 -> one PNG grid at `path` (local or a bucket URL)."""
  m, h, w, _ = images_u8.shape
  rows = -(-m // columns)
  grid = np.full((rows * (h + 2), columns * (w + 2), 3), 255, np.uint8)
  for i, img in enumerate(images_u8):
    r, col = divmod(i, columns)
    grid[r * (h + 2):r * (h + 2) + h, col * (w + 2):col * (w + 2) + w] = img
  _write_png(path, grid)


def _write_png(path, image_u8):
  """(H, W, 3) uint8 -> a PNG at `path` (local or a bucket URL)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  buffer = io.BytesIO()
  Image.fromarray(image_u8).save(buffer, format='PNG')
  storage.write_bytes(str(path), buffer.getvalue())


def labelled_rows(rows, caption_height=14):
  """[(label, (N_i, H, W, 3) uint8)] -> one (R * (caption_height + H + 2), max(N_i) * (W + 2), 3) uint8
  image: each row its label on a white band above its images, left to right."""
  from PIL import Image, ImageDraw  # pylint: disable=g-import-not-at-top
  if not rows:
    raise ValueError('labelled_rows needs at least one row')
  h, w = rows[0][1].shape[1:3]
  if any(images.shape[1:] != (h, w, 3) for _, images in rows):
    raise ValueError(f'every row needs (N, {h}, {w}, 3) images; got '
                     f'{[images.shape for _, images in rows]}')
  band = caption_height + h + 2
  canvas = Image.new('RGB', (max(len(images) for _, images in rows) * (w + 2), len(rows) * band),
                     'white')
  draw = ImageDraw.Draw(canvas)
  for r, (label, images) in enumerate(rows):
    draw.text((2, r * band + 1), label, fill='black')
    for c, img in enumerate(images):
      canvas.paste(Image.fromarray(np.asarray(img, np.uint8)), (c * (w + 2), r * band + caption_height))
  return np.asarray(canvas)


def write_labelled_rows(path, rows, caption_height=14):
  """`labelled_rows(rows)` as a PNG at `path` (local or a bucket URL)."""
  _write_png(path, labelled_rows(rows, caption_height))
