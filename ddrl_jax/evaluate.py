"""Evaluate a checkpoint: ``python -m ddrl_jax.evaluate --config=... --checkpoint=...``.

Video (config.task 'video', Cosmos-Predict2.5; tasks/video_eval.py): the paper's PAI-Bench evaluation on a
prompt file with categories (prompt, category, optional first frame for image-to-video):

  python -m ddrl_jax.evaluate --config=configs/cosmos2b.py --checkpoint=/runs/ddrl \
      --prompt_file=paibench.jsonl --baseline=base --out=/runs/ddrl/eval

samples every prompt at config.sampler.eval_num_steps (35) and config.cosmos.guidance_eval (7 for 2B),
scores the videos with config.cosmos.eval_rewards (VideoAlign's VQ/MQ/TA/mean/sum, VBench's five
dimensions and mean) per category, mode (t2v/i2v) and overall, for the checkpoint and, with --baseline
(e.g. 'base'), for a second model on the same seeds; writes table.md, one JSON line per model to
evaluation.jsonl, MP4s of the first --videos_per_category prompts of each category, base|trained
side-by-side MP4s and grid.png. --max_prompts cuts the file for a quick look.

Every other task (SD3.5 and Wan OCR, the toy mixture): the trainer's own evaluation at 'base' or a
workdir's latest checkpoint (the fixed held-out conditions, the evaluation sampler, the task's metrics for
the parameters and their EMA), one JSON row appended to --out and the sample grid beside it:

  python -m ddrl_jax.evaluate --config=configs/sd35m.py:ddrl $W --checkpoint=/runs/sd3_ddrl

The OCR toy task (configs/ocr_tiny.py; the rest of this docstring):

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
import sys
import time

from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from ddrl_jax import cli
from ddrl_jax import console
from ddrl_jax import parallel
from ddrl_jax import image_grid
from ddrl_jax import params_io
from ddrl_jax import tasks
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.models import lora as lora_lib
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


def load_params(config, checkpoint, ema=False):
  """(task, apply_fn, params) of 'base', a trainer workdir or a params-only export."""
  task = tasks.get_task(config)
  key = jax.random.fold_in(jax.random.key(config.seed), 0x6D6F64)
  if checkpoint == 'base':
    apply_fn, params = task.init_model(key)
    return task, apply_fn, params
  if os.path.isdir(os.path.join(checkpoint, 'checkpoints')):
    trainer = trainer_lib.Trainer(config, checkpoint)
    trainer.restore_or_init(read_only=True)
    params = trainer.state.ema_params if ema else trainer.state.params
    if params is None:
      raise ValueError(f'--ema: {checkpoint} holds no EMA parameters')
    return task, trainer.apply_fn, lora_lib.combine(params, trainer.state.frozen)
  apply_fn, template = task.abstract_params(key)
  template = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), template)
  return task, apply_fn, params_io.load_params(checkpoint, template, '--checkpoint')


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


def _define_flags():
  """Defined only when run as a script, so importing this module adds no global absl flags."""
  global _CONFIG, _CHECKPOINT, _EMA, _OUT, _PROMPTS, _PER_PROMPT
  global _PROMPT_FILE, _BASELINE, _MAX_PROMPTS, _PER_CATEGORY, _JUDGES, _SEED, _BATCH, _TABLE
  _PROMPT_FILE = flags.DEFINE_string('prompt_file', '', 'Video: prompt file (default config.cosmos.'
                                     'eval_prompts): JSONL of prompt, category, optional first_frame.')
  _BASELINE = flags.DEFINE_string('baseline', '', "Video: a second model on the same seeds ('base', a "
                                  'workdir or an export), shown side by side.')
  _MAX_PROMPTS = flags.DEFINE_integer('max_prompts', 0, 'Video: only the first this many prompts (0: all).')
  _PER_CATEGORY = flags.DEFINE_integer('videos_per_category', 2, 'Video: MP4s of this many prompts per '
                                       'category.')
  _TABLE = flags.DEFINE_string('table', '', 'Images: write the Table 4 layout (checkpoint, OCR, each judge) '
                               'of every --checkpoint here (markdown) and beside it as .json.')
  _JUDGES = flags.DEFINE_list('judges', None, 'Rewards to score the samples with (images: e.g. '
                              'clipscore,pickscore,imagereward, the paper\'s Table 4; video: default '
                              'config.cosmos.eval_rewards; kwargs from config.reward.kwargs).')
  _SEED = flags.DEFINE_integer('seed', 0, 'Video: sampling seed.')
  _BATCH = flags.DEFINE_integer('batch', 0, 'Video: prompts per sampling call (0: the data-parallel size).')
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'The OCR task config.')
  _CHECKPOINT = flags.DEFINE_string('checkpoint', 'base', "'base', a trainer workdir or an export; images: "
                                    'several, comma-separated, for one table (--table).')
  _EMA = flags.DEFINE_bool('ema', False, 'Use the EMA parameters of a trainer workdir.')
  _OUT = flags.DEFINE_string('out', None, 'JSONL file to append to.')
  _PROMPTS = flags.DEFINE_integer('prompts', 64, 'Held-out strings.')
  _PER_PROMPT = flags.DEFINE_integer('per_prompt', 4, 'Samples per held-out string.')


def evaluation_inputs(config, judges, prompt_file):
  """One-line problems with what a video evaluation reads: the model's weights (as the task lists them,
  less the training records and the prompt file given here), the prompt file, the judges' files."""
  from ddrl_jax import preflight  # pylint: disable=g-import-not-at-top
  task = tasks.get_task(config)
  inputs = [i for i in task.required_inputs() if i.key not in ('data.path', 'cosmos.eval_prompts')]
  inputs.append(preflight.Input('cosmos.eval_prompts', prompt_file, 'the prompt file (--prompt_file)'))
  found = [p for p in (i.problem() for i in inputs) if p] if config.get('require_inputs') else \
      [p for p in [inputs[-1].problem()] if p]
  kwargs = config.reward.get('kwargs') or {}
  for name in judges:
    found += registry.input_problems(name, dict(kwargs.get(name) or {}))
  return found


def main_video(config, ckpt):
  """The video evaluation of the module docstring; returns the JSON rows written."""
  from ddrl_jax.data import prompt_file as prompt_file_lib  # pylint: disable=g-import-not-at-top
  from ddrl_jax.tasks import video_eval  # pylint: disable=g-import-not-at-top
  path = _PROMPT_FILE.value or config.cosmos.get('eval_prompts', '')
  judges = list(_JUDGES.value or config.cosmos.get('eval_rewards', ()))
  check_judge_names(judges, '--judges or config.cosmos.eval_rewards')
  found = evaluation_inputs(config, judges, path)
  if found:
    raise cli.UsageError('the evaluation needs inputs it was not given: ' + '; '.join(found),
                         'set them with --config.<key>=... or the flags named')
  try:
    entries = prompt_file_lib.read_prompt_file(path)
  except prompt_file_lib.PromptFileError as e:
    raise cli.UsageError(str(e), 'see ddrl_jax/data/prompt_file.py for the layouts') from e
  entries = entries[:_MAX_PROMPTS.value] if _MAX_PROMPTS.value else entries
  config.require_inputs = False          # checked above, less the training data
  out_dir = _OUT.value or os.path.join(ckpt if os.path.isdir(ckpt) else '/tmp', 'evaluation')
  judge_objs = video_eval.make_judges(config, judges)
  rows, baseline_videos, trained_videos = [], None, None
  for label, which in (('baseline', _BASELINE.value), ('checkpoint', ckpt)):
    if not which:
      continue
    t0 = time.perf_counter()
    task, apply_fn, params = load_params(config, which, _EMA.value and label == 'checkpoint')
    summary, _, videos = video_eval.evaluate_prompt_file(
        config, task, apply_fn, params, entries, judge_objs, seed=_SEED.value, batch=_BATCH.value)
    if label == 'baseline':
      baseline_videos = videos
    else:
      trained_videos = videos
    columns = sorted(k for k in summary if '@' not in k and k not in ('finite_fraction',))
    table = video_eval.table_markdown(summary, entries, columns, label=which)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'table.md'), 'a') as f:
      f.write(f'\n### {label}: {which}\n\n{table}\n')
    row = dict(model=label, checkpoint=which, ema=bool(_EMA.value and label == 'checkpoint'),
               prompt_file=path, num_prompts=len(entries), seed=_SEED.value,
               steps=int(config.sampler.get('eval_num_steps', 0) or config.sampler.num_steps),
               guidance=float(config.cosmos.get('guidance_eval', 0.0)),
               seconds=time.perf_counter() - t0, **summary)
    with open(os.path.join(out_dir, 'evaluation.jsonl'), 'a') as f:
      f.write(json.dumps(row) + '\n')
    print(table)
    rows.append(row)
  video_eval.write_examples(out_dir, entries, video_eval.example_rows(entries, _PER_CATEGORY.value),
                            trained_videos, config.eval_video_fps, baseline=baseline_videos)
  print(json.dumps({'out': out_dir, 'rows': len(rows)}))
  return rows


def evaluate_in_run_form(config, checkpoint, out=None, judges=None):
  """Any other task (SD3.5 and Wan OCR, the toy mixture, ...): the trainer's own evaluation (the fixed
  held-out conditions, the evaluation sampler, the task's metrics, of the parameters and of their EMA)
  at 'base' or at a trainer workdir's latest checkpoint. Appends one JSON row to `out` (default
  <workdir>/evaluation.jsonl, or /tmp for 'base') and copies the sample grid beside it; returns the row.
  judges: {name: reward} scoring the evaluation's images with their prompts (`judge/<name>` columns)."""
  import shutil  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  from ddrl_jax import storage  # pylint: disable=g-import-not-at-top
  from ddrl_jax import preflight  # pylint: disable=g-import-not-at-top
  is_base = checkpoint == 'base'
  if not is_base and not storage.exists(os.path.join(storage.absolute(checkpoint), 'checkpoints')):
    raise cli.UsageError(f"--checkpoint={checkpoint}: not a trainer workdir (no checkpoints/ in it)",
                         "pass 'base' or the --workdir of a training run")
  preflight.check_model_then_skip(config, cli.config_spec(sys.argv) or 'the config')
  with tempfile.TemporaryDirectory() as scratch:
    trainer = trainer_lib.Trainer(config, scratch if is_base else checkpoint)
    step = trainer.restore_or_init(read_only=True)
    if not is_base and step == 0 and not trainer.checkpoints.steps():
      raise cli.UsageError(f'--checkpoint={checkpoint}: its checkpoints/ holds no checkpoint yet',
                           'wait for the first save (config.checkpoint_every) or pass base')
    trainer._build()  # pylint: disable=protected-access  (the evaluation sampler and reward service)
    try:
      t0 = time.perf_counter()
      metrics = trainer.evaluate(step, judges=judges)
    finally:
      trainer.close_rewards()
    out = out or os.path.join('/tmp' if is_base else checkpoint, 'evaluation.jsonl')
    row = dict(checkpoint=checkpoint, step=step, seconds=time.perf_counter() - t0,
               **{k: float(v) for k, v in metrics.items()})
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, 'a') as f:
      f.write(json.dumps(row) + '\n')
    if trainer.last_samples and os.path.exists(trainer.last_samples):
      grid = os.path.splitext(out)[0] + f'_{len(open(out).readlines()):03d}.png'
      shutil.copyfile(trainer.last_samples, grid)
      row['grid'] = grid
  return row


def check_judge_names(names, where):
  """One line naming the judges that are not registered rewards."""
  unknown = [n for n in names if n not in registry.known_rewards()]
  if unknown:
    raise cli.UsageError(f'unknown judges {unknown} ({where}); known: {registry.known_rewards()}',
                         'name registered rewards')


def image_judges(config, names):
  """{name: reward} of registered rewards used as image judges, built from config.reward.kwargs; an
  unknown name or a judge's missing files is one line."""
  from ddrl_jax import preflight  # pylint: disable=g-import-not-at-top
  check_judge_names(names, '--judges')
  kwargs = config.reward.get('kwargs') or {}
  problems = [p for n in names for p in registry.input_problems(n, dict(kwargs.get(n) or {}))]
  if problems:
    raise preflight.MissingInputs('the judges need inputs they were not given: ' + '; '.join(problems),
                                  'set them with --config.reward.kwargs.<judge>.<key>=...')
  return {n: registry.make_reward(n, **dict(kwargs.get(n) or {})) for n in names}


def table4_markdown(rows, judges):
  """The paper's Table 4 layout: one row per checkpoint, OCR then each judge's mean (the parameters'
  evaluation; `eval_ema/` columns are in the JSON rows)."""
  def value(row, key):
    for k in (f'eval/{key}', key):
      if k in row:
        return row[k]
    return float('nan')
  ocr_key = 'ocr' if any('eval/ocr' in r for r in rows) else 'ocr_heldout'
  head = ['checkpoint', 'step', 'OCR'] + list(judges)
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for row in rows:
    cells = [str(row['checkpoint']), str(row.get('step', '-')), f'{value(row, ocr_key):.4f}']
    cells += [f'{value(row, "judge/" + j):.4f}' for j in judges]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def _evaluate_ocr_checkpoint(config, ckpt, out, judges):
  task, apply_fn, params = load_params(config, ckpt, _EMA.value)
  t0 = time.perf_counter()
  metrics, grid = evaluate_ocr(config, apply_fn, params, task, prompts=_PROMPTS.value,
                               per_prompt=_PER_PROMPT.value, reward_judges=judges)
  out = out or os.path.join(ckpt if os.path.isdir(ckpt) else '/tmp', 'evaluation.jsonl')
  row = dict(checkpoint=ckpt, ema=_EMA.value, seconds=time.perf_counter() - t0, **metrics)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, 'a') as f:
    f.write(json.dumps(row) + '\n')
  image_grid.write_grid(os.path.splitext(out)[0] + f'_{len(open(out).readlines()):03d}.png', grid,
                        columns=_PER_PROMPT.value)
  return row


def main(argv):
  del argv
  console.setup()
  config, ckpt = _CONFIG.value, _CHECKPOINT.value
  if config.task == 'video':
    main_video(config, ckpt)
    return
  from ddrl_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  if config.task == 'ocr':
    config_lib.validate(config, jax.device_count())
  checkpoints = [c.strip() for c in ckpt.split(',') if c.strip()]
  names = list(_JUDGES.value or ())
  judges = image_judges(config, names) if names else None
  rows = []
  for which in checkpoints:
    row = (_evaluate_ocr_checkpoint(config, which, _OUT.value, judges) if config.task == 'ocr' else
           evaluate_in_run_form(config, which, _OUT.value, judges))
    print(json.dumps(row))
    rows.append(row)
  if _TABLE.value:
    os.makedirs(os.path.dirname(os.path.abspath(_TABLE.value)), exist_ok=True)
    with open(_TABLE.value, 'w') as f:
      f.write(table4_markdown(rows, names) + '\n')
    with open(os.path.splitext(_TABLE.value)[0] + '.json', 'w') as f:
      json.dump(rows, f, indent=1)
    print(table4_markdown(rows, names))


if __name__ == '__main__':
  from ddrl_jax import xla_flags  # pylint: disable=g-import-not-at-top
  xla_flags.apply()       # before any JAX backend starts
  _define_flags()
  cli.run(main, required=('config',))
