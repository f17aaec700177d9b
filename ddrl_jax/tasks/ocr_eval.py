"""The OCR toy task's own checkpoint evaluation (configs/ocr_tiny.py), run by `python -m ddrl_jax.evaluate`:

  python -m ddrl_jax.evaluate --config=configs/ocr_tiny.py --checkpoint=base
  python -m ddrl_jax.evaluate --config=configs/ocr_tiny.py --checkpoint=/tmp/ocr_ddrl [--ema]
  python -m ddrl_jax.evaluate --config=configs/ocr_tiny.py --checkpoint=/tmp/ocr_pretrain/export

--checkpoint: 'base' (the config's base model), a trainer workdir (its latest checkpoint), or a
params-only export (ddrl_jax.pretrain). Appends one JSON line to --out (default:
<checkpoint dir or /tmp>/evaluation.jsonl) and writes an image grid beside it. Measures
(tasks/ocr_metrics.py for the style statistics):
  ocr_heldout, ocr_heldout_exact: OCR score / exact reads of K samples of each of P held-out strings,
    read by Tesseract, the training reader (rewards/ocr.py: OCRReward, config.reward.kwargs['ocr']);
  ocr_flowgrpo (n_flowgrpo): the quoted texts of FlowGRPO's OCR test prompts that the model can write
    (upper-cased, spaces removed, 3-5 characters of the task's alphabet);
  ocr_heldout_rapid, ocr_heldout_exact_rapid, ocr_flowgrpo_rapid: the same FlowGRPO score of the same
    images read by RapidOCR (PP-OCRv4, the reader family FlowGRPO trains with; RapidOCRReward), a
    judge the policy was not trained against;
  reader_gap: ocr_heldout - ocr_heldout_rapid, Tesseract minus RapidOCR on the same held-out images.
    Real renders score 0.88 with Tesseract and 1.00 with RapidOCR (a gap of -0.12): a gap rising above
    that over training is reward the policy wins from the training reader that the held-out reader
    does not confirm;
  heldout_diffusion_loss: the velocity MSE on real renders of held-out strings at a fixed grid of t
    and fixed noise (distance from the data manifold, comparable across checkpoints);
  style_drift: Frechet distance of the standardized style statistics of the generated held-out images
    from those of real renders of the same strings (data vs data with other styles: data_style_drift);
  diversity: mean pairwise style distance within a prompt's K samples (data_diversity: the same for K
    real renders of one string);
  texture_energy, patch_grid_energy: means over the generated held-out images of the fraction of the
    luma's energy above 0.25 cycles/px, and in its component periodic with the model's patch size
    (config.ocr.patch, 8 px: a patch-grid artefact); data_texture_energy, data_patch_grid_energy: the
    same of real renders of the same strings;
  colour_spread (colour_spread_background, colour_spread_ink): the spread of the generated images'
    background and ink colours relative to the data's (1: the data's variety, 0: one colour everywhere);
    data_colour_spread: the same for real renders in other styles;
  stat/<name>: means of each style statistic over the generated images.
All statistics are defined in tasks/ocr_metrics.py.
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from ddrl_jax import image_grid
from ddrl_jax import parallel
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.rewards import judges as judges_lib
from ddrl_jax.rewards import ocr as ocr_reward
from ddrl_jax.rewards import registry
from ddrl_jax.rl import diffusion_loss
from ddrl_jax.tasks import ocr as ocr_task
from ddrl_jax.tasks import ocr_metrics
from ddrl_jax.tasks import text_render

FLOWGRPO_PROMPTS = os.path.join(ocr_task.REPO_ROOT, 'data', 'ocr', 'flow_grpo_ocr_test.txt')


def flowgrpo_targets(path):
  """The quoted texts of FlowGRPO's OCR test prompts this task can write (see the module docstring)."""
  if not os.path.exists(path):
    return []
  out = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      text = ''.join(ocr_reward.target_text(line.strip()).split()).upper()
      if text_render.MIN_LEN <= len(text) <= text_render.MAX_LEN and set(text) <= set(
          text_render.ALPHABET):
        out.append(text)
  return out


def guidance_factor(config):
  """Network evaluations per model call: 2 with classifier-free guidance (conditional + null), else 1."""
  return 1 if config.ocr.guidance == 1.0 else 2


def nfe_per_image(config):
  """Network evaluations per sample: one model call per sampler step."""
  return int(config.sampler.num_steps) * guidance_factor(config)


def sample_images(config, apply_fn, params, task, texts, seed=0):
  """(len(texts), H, W, 3) uint8 images of the config's sampler and a (len(texts),) finite mask; the
  batch is padded to a multiple of the data-parallel size and cut back."""
  mesh = parallel.make_mesh(config.mesh, jax.devices())
  sample = trainer_lib.make_sample_fn(trainer_lib.make_sampler(config), apply_fn, task.sample_shape,
                                      mesh, plan=parallel.ShardingPlan.for_model(config, mesh, task.family))
  padded = list(texts) + [texts[-1]] * (-len(texts) % parallel.data_parallel_size(mesh))
  cond = jax.device_put(jnp.asarray(task.ids_of(padded)), parallel.batch_sharding(mesh))
  samples = np.asarray(sample(params, cond, jax.random.key(seed))).reshape(
      (len(padded),) + task.sample_shape)[:len(texts)]
  return task.reward_inputs(samples, None)


def heldout_diffusion_loss(task, apply_fn, params, num=128, seed=7):
  """Mean velocity MSE on `num` held-out real renders at t = 0.1, 0.2, ..., 0.9 with fixed noise."""
  texts, images = text_render.batch(seed, range(num), 'heldout')
  x0 = jnp.asarray(ocr_task.to_pixels(images))
  ids = jnp.asarray(task.ids_of(texts))
  loss = jax.jit(lambda p, n, t: diffusion_loss.velocity_loss(apply_fn, p, x0, n, t, ids,
                                                              jnp.ones_like(t)).mean())
  rng = np.random.default_rng(seed)
  values = []
  for t in np.linspace(0.1, 0.9, 9):
    noise = jnp.asarray(rng.standard_normal(x0.shape).astype(np.float32))
    values.append(float(loss(params, noise, jnp.full((num,), t, jnp.float32))))
  return float(np.mean(values))


def evaluate_ocr(config, apply_fn, params, task, *, prompts=64, per_prompt=4, seed=0,
                 reference_stats=None, return_stats=False, judges=None, samples_path=None,
                 reward_judges=None):
  """The metrics of the module docstring and a (P, K) grid of images.

  reference_stats: (M, S) image statistics of another model's samples of the same prompts and seed
  (e.g. the base model's, from return_stats=True); adds `style_drift_from_reference`, the style change
  that training caused, next to `style_drift` (the distance to the data).
  return_stats: also return this model's (M, S) statistics.
  judges: {metric name: fn((M, H, W, 3) uint8 held-out samples) -> float} (e.g. tasks/ocr_judges.py's).
  samples_path: where to write the held-out samples and their texts (np.savez_compressed: images, texts),
  so judges can score them later (`load_samples`; benchmarks/ocr_table.py --rejudge).
  reward_judges: {name: reward(images, prompts) -> (M,)} (registered rewards, e.g. clipscore, pickscore):
  `judge/<name>` is their mean over the held-out samples with their prompts (`judge_columns`).
  """
  tesseract = ocr_reward.OCRReward(**dict(config.reward.kwargs.get('ocr', {})))
  rapid = ocr_reward.RapidOCRReward(**dict(config.reward.kwargs.get('ocr_rapid', {})))
  rng = np.random.default_rng(seed)
  held = [text_render.sample_text(rng, 'heldout') for _ in range(prompts)]
  fgrpo = flowgrpo_targets(FLOWGRPO_PROMPTS)
  texts = [t for t in held for _ in range(per_prompt)] + fgrpo
  images, finite = sample_images(config, apply_fn, params, task, texts, seed)
  reward_prompts = [text_render.prompt_of(t) for t in texts]
  n_held = len(held) * per_prompt
  out = {}
  for suffix, reader in (('', tesseract), ('_rapid', rapid)):
    scores = np.where(finite, reader(images, reward_prompts), 0.0)
    out[f'ocr_heldout{suffix}'] = float(scores[:n_held].mean())
    out[f'ocr_heldout_exact{suffix}'] = float((scores[:n_held] == 1).mean())
    out[f'ocr_flowgrpo{suffix}'] = float(scores[n_held:].mean()) if fgrpo else float('nan')
  out['reader_gap'] = out['ocr_heldout'] - out['ocr_heldout_rapid']
  generated = images[:n_held]
  gen_stats = ocr_metrics.batch_stats(generated)
  _, data_images = text_render.batch(seed + 1, range(n_held), 'heldout')
  data_stats = ocr_metrics.batch_stats(data_images)
  _, other_images = text_render.batch(seed + 2, range(n_held), 'heldout')
  other_stats = ocr_metrics.batch_stats(other_images)
  group_rng = np.random.default_rng(seed + 3)
  data_groups = np.stack([ocr_metrics.batch_stats(np.stack([
      text_render.render(t, text_render.sample_style(group_rng), group_rng) for _ in range(per_prompt)]))
      for t in held])
  patch = int(config.ocr.patch)
  background_spread, ink_spread, spread = ocr_metrics.colour_spread(gen_stats, data_stats)
  out.update(
      n_flowgrpo=len(fgrpo),
      heldout_diffusion_loss=heldout_diffusion_loss(task, apply_fn, params),
      style_drift=ocr_metrics.style_drift(gen_stats, data_stats),
      data_style_drift=ocr_metrics.style_drift(other_stats, data_stats),
      diversity=ocr_metrics.group_diversity(gen_stats.reshape(prompts, per_prompt, -1), data_stats),
      data_diversity=ocr_metrics.group_diversity(data_groups, data_stats),
      texture_energy=float(ocr_metrics.texture_energy(generated).mean()),
      data_texture_energy=float(ocr_metrics.texture_energy(data_images).mean()),
      patch_grid_energy=float(ocr_metrics.patch_grid_energy(generated, patch).mean()),
      data_patch_grid_energy=float(ocr_metrics.patch_grid_energy(data_images, patch).mean()),
      colour_spread=spread, colour_spread_background=background_spread, colour_spread_ink=ink_spread,
      data_colour_spread=ocr_metrics.colour_spread(other_stats, data_stats)[2],
      finite_fraction=float(finite.mean()), nfe_per_image=nfe_per_image(config))
  if reference_stats is not None:
    out['style_drift_from_reference'] = ocr_metrics.style_drift(gen_stats, reference_stats)
  for name, judge in (judges or {}).items():
    out[name] = float(judge(generated))
  out.update(registry.judge_columns(reward_judges, generated, reward_prompts[:n_held]))
  if samples_path:
    save_samples(samples_path, generated, texts[:n_held])
  out.update({f'stat/{n}': float(v) for n, v in zip(ocr_metrics.STAT_NAMES, gen_stats.mean(0))})
  grid = sample_grid(images, prompts, per_prompt)
  return (out, grid, gen_stats) if return_stats else (out, grid)


def sample_grid(images, prompts, per_prompt):
  """The (P * per_prompt, H, W, 3) images of an evaluation's grid: its first P = min(8, prompts) held-out
  prompts, from images that start with the held-out samples (prompt-major)."""
  return images[:min(8, prompts) * per_prompt]


def save_samples(path, images, texts):
  """Writes (M, H, W, 3) uint8 images and their M texts (np.savez_compressed), atomically."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + '.tmp.npz'
  np.savez_compressed(tmp, images=np.asarray(images, np.uint8), texts=np.asarray(texts))
  os.replace(tmp, path)


def load_samples(path):
  """(images (M, H, W, 3) uint8, texts list) written by `save_samples`."""
  with np.load(path) as f:
    return f['images'], [str(t) for t in f['texts']]


def evaluate_checkpoints(config, request):
  """The module docstring's evaluation of each of request.checkpoints (held-out strings, the FlowGRPO
  test prompts, the style statistics, request.judges beside OCR): one JSON row per checkpoint appended to
  request.out (default <checkpoint dir or /tmp>/evaluation.jsonl), its sample grid beside it; the rows."""
  from ddrl_jax import config as config_lib  # pylint: disable=g-import-not-at-top  (config imports tasks)
  config_lib.validate(config, jax.device_count())
  judges = judges_lib.build(config, request.judges) if request.judges else None
  rows = []
  for ckpt in request.checkpoints:
    task, apply_fn, params = request.load(ckpt, request.ema)
    t0 = time.perf_counter()
    metrics, grid = evaluate_ocr(config, apply_fn, params, task, prompts=request.prompts,
                                 per_prompt=request.per_prompt, reward_judges=judges)
    out = request.out or os.path.join(ckpt if os.path.isdir(ckpt) else '/tmp', 'evaluation.jsonl')
    row = dict(checkpoint=ckpt, ema=request.ema, seconds=time.perf_counter() - t0, **metrics)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, 'a') as f:
      f.write(json.dumps(row) + '\n')
    image_grid.write_grid(os.path.splitext(out)[0] + f'_{len(open(out).readlines()):03d}.png', grid,
                          columns=request.per_prompt)
    rows.append(row)
  return rows
