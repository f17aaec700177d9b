"""Image grids written to a workdir, for samples people would rather look at than read about."""
import io

import numpy as np

from ddrl_jax import storage


def write_grid(path, images_u8, columns=8):
  """(M, H, W, 3) uint8 -> one PNG grid at `path` (local or a bucket URL)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  m, h, w, _ = images_u8.shape
  rows = -(-m // columns)
  grid = np.full((rows * (h + 2), columns * (w + 2), 3), 255, np.uint8)
  for i, img in enumerate(images_u8):
    r, col = divmod(i, columns)
    grid[r * (h + 2):r * (h + 2) + h, col * (w + 2):col * (w + 2) + w] = img
  buffer = io.BytesIO()
  Image.fromarray(grid).save(buffer, format='PNG')
  storage.write_bytes(str(path), buffer.getvalue())
