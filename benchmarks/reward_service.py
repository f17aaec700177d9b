"""Reward-service benchmarks: OCR throughput, and the overlap of rewards with the data gradient.

  python benchmarks/reward_service.py [--images=512] [--iterations=6] [--out=benchmarks/reward_service.jsonl]

1. OCR throughput (images/s) of the real Tesseract reward on rendered words, scored inline (one thread)
   and by WorkerPool with 1 and 2 processes, after a warm-up (worker start-up excluded).
2. One training iteration of configs/cosmos2b.py:smoke (tiny DiT + tiny Wan VAE, 8 groups x 2 rollouts,
   decoded 5x32x32 videos) with its temporal-smoothness reward and with the OCR reward on the decoded
   frames, scored by 2 worker processes: mean times of rollout+submit, data gradient, the wait for the
   rewards after it, and the update; `overlap` is the fraction of iterations whose rewards were still
   pending when the data gradient finished. Compile iterations (the first) are excluded.
"""
import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
from PIL import Image
from PIL import ImageDraw
from PIL import ImageFont

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddrl_jax import rewards  # pylint: disable=g-import-not-at-top,wrong-import-position


def rendered_words(num, size, seed=0):
  rng = np.random.RandomState(seed)
  letters = 'abcdefghijklmnopqrstuvwxyz0123456789'
  font = ImageFont.load_default(size=int(size[1] * 0.6))
  images, prompts = [], []
  for _ in range(num):
    word = ''.join(rng.choice(list(letters), rng.randint(3, 7)))
    img = Image.new('RGB', size, (255, 255, 255))
    ImageDraw.Draw(img).text((4, size[1] // 8), word, fill=(0, 0, 0), font=font)
    images.append(np.asarray(img))
    prompts.append(f'a sign that says "{word}"')
  return np.stack(images), prompts


def ocr_throughput(num):
  rows = []
  for size in ((128, 32), (256, 48)):
    images, prompts = rendered_words(num, size)
    for workers in (0, 1, 2):
      pool = (rewards.InlinePool({'ocr': {}}) if workers == 0 else
              rewards.WorkerPool({'ocr': {}}, workers, chunk_timeout_s=600))
      with pool:
        pool.submit(images[:8], prompts[:8], chunk_size=4).result(600)      # warm-up
        t0 = time.perf_counter()
        result = pool.submit(images, prompts, chunk_size=16).result(600)
        dt = time.perf_counter() - t0
      rows.append(dict(bench='ocr_throughput', width=size[0], height=size[1], workers=workers,
                       images=num, seconds=dt, images_per_s=num / dt,
                       mean_score=float(np.nanmean(result.scores['ocr'])),
                       failed=int(sum(result.failures.values()))))
      print(rows[-1], flush=True)
  return rows


def overlap(iterations):
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from configs import cosmos2b  # pylint: disable=g-import-not-at-top
  from ddrl_jax import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  rows = []
  for name, fns, kwargs in (('temporal_smoothness', {'temporal_smoothness': 1.0}, {}),
                            ('ocr_on_frames', {'ocr': 1.0}, {'ocr': {'frame_stride': 1}})):
    c = cosmos2b.get_config('smoke')
    c.num_iterations, c.checkpoint_every, c.eval_every = iterations, 10**6, -1
    c.mesh.data = jax.device_count()
    c.reward.fns = ml_collections.ConfigDict(fns)
    c.reward.kwargs = ml_collections.ConfigDict(kwargs)
    c.reward.workers, c.reward.chunk_size = 2, 4
    with tempfile.TemporaryDirectory() as workdir:
      trainer = trainer_lib.Trainer(c, workdir)
      trainer.restore_or_init()
      trainer._build()  # pylint: disable=protected-access
      times = []
      for it in range(iterations):
        times.append(trainer.train_iteration(it))
      trainer.close_rewards()
    keys = ('time_rollout_and_submit', 'time_data_grad', 'time_reward_wait', 'time_update',
            'time_reward_overlap')
    steady = times[1:]
    row = dict(bench='overlap', reward=name, iterations=len(steady),
               **{k: float(np.mean([t[k] for t in steady])) for k in keys})
    rows.append(row)
    print(row, flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--images', type=int, default=512)
  parser.add_argument('--iterations', type=int, default=6)
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'reward_service.jsonl'))
  args = parser.parse_args()
  meta = dict(date=time.strftime('%Y-%m-%d'), machine=f'{platform.machine()} {os.cpu_count()} cores',
              command=' '.join(['python'] + sys.argv))
  rows = ocr_throughput(args.images) + overlap(args.iterations)
  with open(args.out, 'w') as f:
    for r in rows:
      f.write(json.dumps(dict(meta, **r)) + '\n')


if __name__ == '__main__':
  main()
