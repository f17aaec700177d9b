"""Rendered short strings in varied styles: the data of the OCR text-rendering task (tasks/ocr.py).

Legibility is made learnable on a CPU and the style left rich enough to be worth hacking:
  * text: 3-5 characters from ALPHABET (digits and capitals Tesseract reads reliably in this font: 0 and 9
    are left out, Tesseract read them right 53% and 88% of the time), in a monospace
    font (DejaVu Sans Mono, shipped inside matplotlib) with one character per CELL-pixel-wide cell, the
    cells aligned to the model's patches (left-aligned half a cell in: character k is always in cell k);
  * style: background colour with a linear gradient at a random angle, a texture (none, stripes,
    checks or speckle), ink colour at a guaranteed contrast from the background (light-on-dark or
    dark-on-light), font size and weight, a small global position jitter, and pixel noise.
Everything is a pure function of (seed, index, split): `example(seed, i, 'train')` is the same on every
machine. Strings are split by a hash, so held-out strings never appear in training (`split_of`).
"""
import dataclasses
import functools
import os
import zlib

import numpy as np
from PIL import Image
from PIL import ImageDraw
from PIL import ImageFont

ALPHABET = '12345678ACEHKMPRTX'
HEIGHT, WIDTH, CELL = 32, 96, 16        # six 16-px cells; 8-px patches split each cell in two
MIN_LEN, MAX_LEN = 3, 5
HELD_OUT_EVERY = 8                      # 1 string in 8 (by hash) is held out
TEXTURES = ('none', 'stripes', 'checks', 'speckle')
FONTS = ('DejaVuSansMono.ttf', 'DejaVuSansMono-Bold.ttf')
# Style subsets (config.ocr.pretrain_style): 'all' is the data; 'dark_text' keeps only dark ink on a light
# background (60% of 'all'), the style a shifted base model is pretrained on (benchmarks/ocr_table.py).
STYLE_SUBSETS = ('all', 'dark_text')


def split_of(text):
  """'heldout' for 1 string in HELD_OUT_EVERY (CRC32 of the text), else 'train'."""
  return 'heldout' if zlib.crc32(text.encode()) % HELD_OUT_EVERY == 0 else 'train'


def sample_text(rng, split):
  """A random string of `split` ('train' or 'heldout'), 3-5 characters of ALPHABET."""
  while True:
    n = rng.integers(MIN_LEN, MAX_LEN + 1)
    text = ''.join(rng.choice(list(ALPHABET), n))
    if split_of(text) == split:
      return text


@dataclasses.dataclass(frozen=True)
class Style:
  background: tuple        # RGB in [0, 1] at one end of the gradient
  background_end: tuple    # ... and at the other
  angle: float             # gradient direction, radians
  texture: str             # one of TEXTURES
  texture_strength: float  # amplitude in [0, 1] intensity units
  ink: tuple               # RGB in [0, 1]
  font: str                # one of FONTS
  font_size: int
  dx: int                  # global offset of the text, pixels
  dy: int
  noise: float             # std of additive Gaussian pixel noise


def _luma(rgb):
  return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]


def sample_style(rng, subset='all'):
  """A random style with |luma(ink) - luma(background)| >= 0.45 at every point of the gradient, from
  `subset` (STYLE_SUBSETS; 'dark_text' draws the same random numbers, only the polarity is forced)."""
  if subset not in STYLE_SUBSETS:
    raise ValueError(f'style subset {subset!r} is unknown; known: {STYLE_SUBSETS}')
  dark_text = rng.random() < 0.6 or subset == 'dark_text'
  base = rng.uniform(0.6, 1.0, 3) if dark_text else rng.uniform(0.0, 0.35, 3)
  end = np.clip(base + rng.uniform(-0.15, 0.15, 3), 0, 1)
  while True:
    ink = rng.uniform(0.0, 0.3, 3) if dark_text else rng.uniform(0.7, 1.0, 3)
    if min(abs(_luma(ink) - _luma(base)), abs(_luma(ink) - _luma(end))) >= 0.45:
      break
  return Style(background=tuple(base), background_end=tuple(end), angle=float(rng.uniform(0, np.pi)),
               texture=str(rng.choice(TEXTURES)), texture_strength=float(rng.uniform(0.02, 0.08)),
               ink=tuple(ink), font=str(rng.choice(FONTS)), font_size=int(rng.integers(20, 25)),
               dx=int(rng.integers(-2, 3)), dy=int(rng.integers(-2, 3)),
               noise=float(rng.uniform(0.0, 0.03)))


@functools.lru_cache(maxsize=None)
def _font(name, size):
  import matplotlib  # pylint: disable=g-import-not-at-top  (ships DejaVu Sans Mono)
  path = os.path.join(os.path.dirname(matplotlib.__file__), 'mpl-data', 'fonts', 'ttf', name)
  return ImageFont.truetype(path, size)


def _background(style, rng):
  yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float32)
  u = (xx * np.cos(style.angle) + yy * np.sin(style.angle))
  u = (u - u.min()) / max(float(np.ptp(u)), 1e-6)
  bg = (1 - u)[..., None] * np.asarray(style.background) + u[..., None] * np.asarray(style.background_end)
  s = style.texture_strength
  if style.texture == 'stripes':
    bg += s * np.sin(2 * np.pi * u * rng.uniform(4, 10))[..., None]
  elif style.texture == 'checks':
    bg += s * (((xx // 4 + yy // 4) % 2) * 2 - 1)[..., None]
  elif style.texture == 'speckle':
    bg += s * rng.standard_normal((HEIGHT, WIDTH, 1)) * 1.5
  return bg


def text_origin(text):
  """x of the first cell: left-aligned one half-cell in, so character k always sits in cell k (its
  patches do not depend on the string's length, which makes the text-to-patch mapping easy to learn)."""
  del text
  return CELL // 2


def render(text, style, rng):
  """(HEIGHT, WIDTH, 3) uint8 image of `text` in `style`; `rng` draws texture and noise."""
  bg = _background(style, rng)
  mask = Image.new('L', (WIDTH, HEIGHT), 0)
  draw = ImageDraw.Draw(mask)
  font = _font(style.font, style.font_size)
  x0 = text_origin(text) + style.dx
  for k, ch in enumerate(text):                 # one glyph per cell, centred in it
    left, top, right, bottom = draw.textbbox((0, 0), ch, font=font)
    x = x0 + k * CELL + (CELL - (right - left)) / 2 - left
    y = (HEIGHT - (bottom - top)) / 2 - top + style.dy
    draw.text((x, y), ch, fill=255, font=font)
  alpha = np.asarray(mask, np.float32)[..., None] / 255.0
  img = (1 - alpha) * bg + alpha * np.asarray(style.ink)
  img += style.noise * rng.standard_normal(img.shape)
  return np.round(np.clip(img, 0, 1) * 255).astype(np.uint8)


def example(seed, index, split='train', style='all'):
  """(text, (HEIGHT, WIDTH, 3) uint8 image): example `index` of `split` in a style of the subset
  `style`, a pure function of its args."""
  rng = np.random.default_rng([seed, index, 0 if split == 'train' else 1])
  text = sample_text(rng, split)
  return text, render(text, sample_style(rng, style), rng)


def batch(seed, indices, split='train', style='all'):
  """(list of texts, (B, HEIGHT, WIDTH, 3) uint8) of several examples."""
  texts, images = zip(*(example(seed, int(i), split, style) for i in indices))
  return list(texts), np.stack(images)


def prompt_of(text):
  """The reward's prompt for a rendered string (FlowGRPO style: the target in double quotes)."""
  return f'a sign that says "{text}"'
