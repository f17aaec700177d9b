"""Text rendered with PIL, for OCR tests."""
import numpy as np
from PIL import Image
from PIL import ImageDraw
from PIL import ImageFont


def render(text, size=(256, 48), font_size=28, ink=0, paper=255):
  """A (H, W, 3) uint8 image of `text` in PIL's scalable default font."""
  img = Image.new('RGB', size, (paper,) * 3)
  ImageDraw.Draw(img).text((8, 6), text, fill=(ink,) * 3, font=ImageFont.load_default(size=font_size))
  return np.asarray(img)
