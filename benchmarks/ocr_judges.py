"""Calibration of the OCR task's judges (issue 28) before they judge anything: each judge on real renders,
the base model's samples (at two noise seeds: the noise floor of drift from the base), and the samples of
the earlier method table (the tiles of its ocr_methods_<method>.png grids: collapsed DanceGRPO and
DiffusionNFT among them), with N-matched real-render and base rows, since Frechet distances grow as N
shrinks.

  JAX_PLATFORMS=cpu python benchmarks/ocr_judges.py [--out=benchmarks/ocr_judges.jsonl]

Judges: typicality (checkpoints/ocr_tiny_judge's null-text x0 MSE, mean and 95% t-interval over images),
fd_recognizer (Frechet distance to 1024 real renders in RapidOCR's recognizer features), style drift
from the base (the 12 colour/contrast statistics of ocr_metrics, against the base's 256 samples) and to
the data. Prints a markdown table; one JSON row per image set to --out.
"""
import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from configs import ocr_tiny
import ocr_table  # pylint: disable=g-bad-import-order  # benchmarks/ocr_table.py, beside this file
from ddrl_jax import evaluate as evaluate_lib
from ddrl_jax import xla_flags
from ddrl_jax.tasks import ocr_eval
from ddrl_jax.tasks import ocr_judges
from ddrl_jax.tasks import ocr_metrics
from ddrl_jax.tasks import text_render

HERE = os.path.dirname(os.path.abspath(__file__))
# The earlier table's grids (seed 0 at iteration 200, 8 held-out prompts x 4 samples, write_grid layout).
GRIDS = ('base', 'ddrl', 'flow_grpo', 'flow_grpo_exact_kl', 'dance_grpo', 'diffusion_nft', 'ddrl_reduced')


def grid_tiles(path, h=text_render.HEIGHT, w=text_render.WIDTH, pad=2):
  """(M, h, w, 3) uint8 tiles of an image_grid.write_grid PNG (white padding; empty cells dropped)."""
  from PIL import Image
  grid = np.asarray(Image.open(path).convert('RGB'))
  rows, cols = (grid.shape[0] + 0) // (h + pad), (grid.shape[1] + 0) // (w + pad)
  tiles = [grid[r * (h + pad):r * (h + pad) + h, c * (w + pad):c * (w + pad) + w]
           for r in range(rows) for c in range(cols)]
  return np.stack([t for t in tiles if t.shape == (h, w, 3) and t.min() < 255])


def base_samples(config, noise_seed, prompts=64, per_prompt=4):
  """(prompts * per_prompt, H, W, 3) samples of the shipped base for the evaluation's held-out texts."""
  task, apply_fn, params = evaluate_lib.load_params(config, 'base')
  rng = np.random.default_rng(0)
  held = [text_render.sample_text(rng, 'heldout') for _ in range(prompts)]
  texts = [t for t in held for _ in range(per_prompt)]
  images, finite = ocr_eval.sample_images(config, apply_fn, params, task, texts, noise_seed)
  return images[finite]


def judge_row(name, images, typicality, fd, base_stats, data_stats):
  t_mean, t_half = ocr_table.t_interval(typicality.per_image(images))
  stats = ocr_metrics.batch_stats(images)
  return dict(set=name, n=len(images), typicality=t_mean, typicality_half=t_half,
              typicality_outside=typicality.outside_fraction(images), fd_recognizer=fd(images),
              style_drift_from_base=ocr_metrics.style_drift(stats, base_stats),
              style_drift_to_data=ocr_metrics.style_drift(stats, data_stats),
              colour_spread=ocr_metrics.colour_spread(stats, data_stats)[2])


def main(argv=None):
  xla_flags.apply()
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--out', default=os.path.join(HERE, 'ocr_judges.jsonl'))
  p.add_argument('--judge', default=ocr_judges.JUDGE_CHECKPOINT)
  p.add_argument('--shifted_base', default='checkpoints/ocr_tiny_base_dark',
                 help='also calibrate on this base (skipped if missing)')
  args = p.parse_args(argv)
  config = ocr_tiny.get_config()
  typicality = ocr_judges.TypicalityJudge(config, args.judge)
  fd = ocr_judges.FrechetJudge()
  base0, base1 = base_samples(config, 0), base_samples(config, 1)
  base_stats = ocr_metrics.batch_stats(base0)
  data = text_render.batch(1, range(256), 'heldout')[1]           # evaluate_ocr's data set (seed + 1)
  data_stats = ocr_metrics.batch_stats(data)
  sets = [('real renders (held-out strings, seed 303)', text_render.batch(303, range(256), 'heldout')[1]),
          ('real renders, 32 (N-matched to the grids)', text_render.batch(404, range(32), 'heldout')[1]),
          ('real renders, dark text only (the shifted base\'s data)',
           text_render.batch(303, range(256), 'heldout', style='dark_text')[1]),
          ('base samples (noise seed 0: the reference of drift)', base0),
          ('base samples, noise seed 1 (drift noise floor)', base1),
          ('base samples, 32 (noise seed 1)', base1[:32])]
  shifted = args.shifted_base
  if shifted and os.path.exists(os.path.join(ocr_eval.ocr_task.REPO_ROOT, shifted)):
    c = ocr_tiny.get_config()
    c.ocr.base_checkpoint = shifted
    sets.append(('shifted base (dark text) samples', base_samples(c, 0)))
  for method in GRIDS:
    path = os.path.join(HERE, f'ocr_methods_{method}.png')
    if os.path.exists(path):
      sets.append((f'grid tiles: {method} (earlier table, iteration {0 if method == "base" else 200})',
                   grid_tiles(path)))
  meta = dict(date=time.strftime('%Y-%m-%d'), machine=f'{platform.machine()} {os.cpu_count()} cores',
              judge=args.judge)
  rows = []
  with open(args.out, 'w', encoding='utf-8') as f:
    for name, images in sets:
      row = dict(meta, **judge_row(name, images, typicality, fd, base_stats, data_stats))
      rows.append(row)
      f.write(json.dumps(row) + '\n')
      print(json.dumps({k: row[k] for k in ('set', 'n', 'typicality', 'fd_recognizer')}), flush=True)
  low, high = typicality.real_range()
  print(f'(real renders\' central 95% of typicality: [{low:.4f}, {high:.4f}])')
  print('| images | N | typicality (judge x0 MSE, 95% t) | outside real range | FD recognizer | '
        'style drift from base | style drift to data | colour spread |')
  print('|---|---|---|---|---|---|---|---|')
  for r in rows:
    print(f"| {r['set']} | {r['n']} | {r['typicality']:.4f} ± {r['typicality_half']:.4f} | "
          f"{r['typicality_outside']:.2f} | {r['fd_recognizer']:.2f} | {r['style_drift_from_base']:.2f} | {r['style_drift_to_data']:.2f} | "
          f"{r['colour_spread']:.2f} |")


if __name__ == '__main__':
  main()
