"""Evaluating a Cosmos video model on a prompt file with categories, as the DDRL paper evaluates on PAI-Bench.

`python -m ddrl_jax.evaluate --config=configs/cosmos2b.py --checkpoint=WORKDIR --prompt_file=FILE
[--baseline=base] [--out=DIR]` (ddrl_jax/evaluate.py) calls the task's `evaluate_checkpoints`, which checks
every input first (the model's weights, the prompt file, the judges' files), then for the baseline and the
checkpoint calls `evaluate_prompt_file`, and writes table.md, one JSON line per model to evaluation.jsonl,
MP4s of the first --videos_per_category prompts of each category, base|trained side-by-side MP4s and
grid.png into DIR (default <checkpoint>/evaluation). `evaluate_prompt_file`:

  1. every entry of the prompt file (`data.prompt_file`: prompt, category, optional first frame) becomes one
     condition: image-to-video where it names an image, text-to-video otherwise;
  2. each is sampled once with the evaluation sampler (config.sampler.eval_num_steps, 35 in the presets)
     at config.cosmos.guidance_eval (Cosmos' classifier-free guidance against the negative prompt), with
     the same noise for every checkpoint (batch b uses fold_in(key(seed), b)), so a base and a trained
     model are compared on identical seeds;
  3. the decoded videos are scored by each judge (config.cosmos.eval_rewards, built from
     config.reward.kwargs): every column a reward reports (`scores`: VideoAlign's vq, mq, ta, mean and sum;
     VBench's five dimensions and their mean), NaN where a video could not be scored;
  4. `summarize` gives each column's mean overall, per mode (t2v, i2v), per category and per
     (category, mode), with the number of finite scores behind each, and `table_markdown` the
     category x column table.
"""
import collections
import json
import logging
import os
import time

import jax
import numpy as np

from ddrl_jax import cli
from ddrl_jax import parallel
from ddrl_jax import preflight
from ddrl_jax import update as update_lib
from ddrl_jax.data import prompt_file as prompt_file_lib
from ddrl_jax.rewards import judges as judges_lib
from ddrl_jax.tasks import video

ALL = 'all'


def score_columns(judges, videos, prompts):
  """{column: (M,) float64}: '<judge>/<column>' for judges with `scores` (every column), else '<judge>'."""
  out = {}
  for name, judge in judges.items():
    if hasattr(judge, 'scores'):
      for column, values in judge.scores(videos, prompts).items():
        out[f'{name}/{column}'] = np.asarray(values, np.float64)
    else:
      out[name] = np.asarray(judge(videos, prompts), np.float64)
  return out


def groups_of(entries):
  """{group name: row indices}: 'all', each mode ('t2v', 'i2v'), each category and each 'category/mode'
  that has rows."""
  groups = collections.defaultdict(list)
  for i, e in enumerate(entries):
    for g in (ALL, e.mode, e.category, f'{e.category}/{e.mode}'):
      groups[g].append(i)
  return dict(groups)


def summarize(columns, entries):
  """{'<column>' (all rows) or '<column>@<group>': mean, and 'n@<group>': rows in the group}: the means
  over finite scores of each column, per `groups_of` group."""
  out = {}
  for group, rows in groups_of(entries).items():
    suffix = '' if group == ALL else f'@{group}'
    out[f'n{suffix or "@" + ALL}'] = len(rows)
    for column, values in columns.items():
      out[f'{column}{suffix}'] = video._finite_mean(np.asarray(values)[rows])  # pylint: disable=protected-access
  return out


def table_markdown(summary, entries, columns, label=''):
  """A markdown table: one row per category (then t2v, i2v and all), one column per score column."""
  categories = sorted({e.category for e in entries})
  modes = sorted({e.mode for e in entries})
  head = f'| {label or "category"} | n | ' + ' | '.join(columns) + ' |'
  lines = [head, '|' + '---|' * (len(columns) + 2)]
  for group in categories + modes + [ALL]:
    suffix = '' if group == ALL else f'@{group}'
    cells = [f'{summary.get(c + suffix, float("nan")):.4f}' for c in columns]
    lines.append(f'| {group} | {summary["n@" + group]} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def sample_videos(config, task, apply_fn, params, entries, *, seed=0, batch=0):
  """(uint8 videos (M, F, H, W, 3), finite (M,) bool) of every entry, sampled as the module docstring
  says; `batch` conditions per call (0: the mesh's data-parallel size), padded to a multiple of it."""
  mesh = parallel.make_mesh(config.mesh, jax.devices())
  plan = parallel.ShardingPlan.for_model(config, mesh, task.family)
  dp = parallel.data_parallel_size(mesh)
  batch = max(dp, (batch or dp) // dp * dp)
  sample = update_lib.make_sample_fn(update_lib.make_eval_sampler(config), apply_fn, task.sample_shape,
                                     mesh, plan=plan, cast_params=getattr(task, 'cast_params', None))
  guidance = float(config.cosmos.get('guidance_eval', 0.0))
  videos, finite = [], []
  for b, start in enumerate(range(0, len(entries), batch)):
    rows = list(range(start, min(start + batch, len(entries))))
    padded = rows + [rows[-1]] * (batch - len(rows))
    cond = task.with_guidance(task.prompt_file_conditions(padded, table=entries), guidance)
    cond = jax.device_put(cond, plan.batch())
    out = sample(params, cond, jax.random.fold_in(jax.random.key(seed), b))
    latents = np.asarray(jax.device_get(out), np.float32).reshape((batch,) + task.sample_shape)
    v, ok = task.decode(latents[:len(rows)])
    videos.append(np.asarray(v))
    finite.append(np.asarray(ok, bool))
  return np.concatenate(videos), np.concatenate(finite)


def evaluate_prompt_file(config, task, apply_fn, params, entries, judges, *, seed=0, batch=0):
  """(summary (see `summarize`), columns {column: (M,)}, videos (M, F, H, W, 3) uint8) of one model."""
  videos, finite = sample_videos(config, task, apply_fn, params, entries, seed=seed, batch=batch)
  columns = score_columns(judges, videos, [e.prompt for e in entries])
  columns = {k: np.where(finite, v, np.nan) for k, v in columns.items()}
  summary = summarize(columns, entries)
  summary['finite_fraction'] = float(finite.mean())
  return summary, columns, videos


def example_rows(entries, per_category):
  """Row indices of the first `per_category` entries of each category (in file order)."""
  seen = collections.Counter()
  rows = []
  for i, e in enumerate(entries):
    if seen[e.category] < per_category:
      seen[e.category] += 1
      rows.append(i)
  return rows


def video_name(entries, row):
  e = entries[row]
  safe = ''.join(ch if ch.isalnum() else '_' for ch in e.category)[:32]
  return f'{row:04d}_{safe}_{e.mode}'


def _write_mp4(path, video, fps, paths):
  """Writes one MP4 and records its path; without imageio-ffmpeg logs why (once per call site's loop)."""
  from ddrl_jax import video_io  # pylint: disable=g-import-not-at-top
  try:
    video_io.write_mp4(path, video, fps)
    paths.append(path)
    return True
  except ImportError as e:
    logging.warning('no MP4s of the evaluation (pip install -e .[video]): %s', e)
    return False


def write_examples(out_dir, entries, rows, videos, fps, baseline=None):
  """MP4s of the example rows under out_dir/videos/ (the trained model's; with `baseline` videos also
  a side-by-side MP4, baseline left, under out_dir/side_by_side/) and a PNG grid: one row per example,
  the first, middle and last frames (baseline's first, when given). Returns the written paths."""
  from ddrl_jax import image_grid  # pylint: disable=g-import-not-at-top
  paths, frames = [], []
  mp4 = True
  for row in rows:
    name = video_name(entries, row)
    clip = videos[row]
    mp4 = mp4 and _write_mp4(os.path.join(out_dir, 'videos', name + '.mp4'), clip, fps, paths)
    picks = [0, clip.shape[0] // 2, clip.shape[0] - 1]
    if baseline is not None:
      both = np.concatenate([baseline[row], clip], axis=2)     # (F, H, 2W, 3)
      mp4 = mp4 and _write_mp4(os.path.join(out_dir, 'side_by_side', name + '.mp4'), both, fps, paths)
      frames += [baseline[row][p] for p in picks]
    frames += [clip[p] for p in picks]
  if frames:
    grid = os.path.join(out_dir, 'grid.png')
    image_grid.write_grid(grid, np.stack(frames), 6 if baseline is not None else 3)
    paths.append(grid)
  return paths


def evaluation_inputs(task, judges, prompt_file):
  """One-line problems with what a video evaluation reads: the model's weights (as the task lists them,
  less the training records and the prompt file given here), the prompt file, the judges' files."""
  config = task.config
  inputs = [i for i in task.required_inputs() if i.key not in ('data.path', 'cosmos.eval_prompts')]
  inputs.append(preflight.Input('cosmos.eval_prompts', prompt_file, 'the prompt file (--prompt_file)'))
  found = [p for p in (i.problem() for i in inputs) if p] if config.get('require_inputs') else \
      [p for p in [inputs[-1].problem()] if p]
  return found + judges_lib.input_problems(config, judges)


def evaluate_checkpoints(task, request):
  """The module docstring's evaluation of request.baseline (if set) and request.checkpoints[0] on the
  same seeds, for the video task `task`; returns the JSON rows written."""
  config = task.config
  if len(request.checkpoints) != 1:
    raise cli.UsageError(f'--checkpoint: the video evaluation takes one checkpoint, got '
                         f'{list(request.checkpoints)}', 'compare a second model with --baseline')
  ckpt = request.checkpoints[0]
  path = request.prompt_file or config.cosmos.get('eval_prompts', '')
  judges = list(request.judges or config.cosmos.get('eval_rewards', ()))
  judges_lib.check_names(judges, '--judges or config.cosmos.eval_rewards')
  found = evaluation_inputs(task, judges, path)
  if found:
    raise cli.UsageError('the evaluation needs inputs it was not given: ' + '; '.join(found),
                         'set them with --config.<key>=... or the flags named')
  try:
    entries = prompt_file_lib.read_prompt_file(path)
  except prompt_file_lib.PromptFileError as e:
    raise cli.UsageError(str(e), 'see ddrl_jax/data/prompt_file.py for the layouts') from e
  entries = entries[:request.max_prompts] if request.max_prompts else entries
  config.require_inputs = False          # checked above, less the training data
  out_dir = request.out or os.path.join(ckpt if os.path.isdir(ckpt) else '/tmp', 'evaluation')
  judge_objs = judges_lib.build(config, judges, '--judges or config.cosmos.eval_rewards')
  rows, baseline_videos, trained_videos = [], None, None
  for label, which in (('baseline', request.baseline), ('checkpoint', ckpt)):
    if not which:
      continue
    t0 = time.perf_counter()
    ema = bool(request.ema and label == 'checkpoint')
    task, apply_fn, params = request.load(which, ema)
    summary, _, videos = evaluate_prompt_file(config, task, apply_fn, params, entries, judge_objs,
                                              seed=request.seed, batch=request.batch)
    if label == 'baseline':
      baseline_videos = videos
    else:
      trained_videos = videos
    columns = sorted(k for k in summary if '@' not in k and k not in ('finite_fraction',))
    table = table_markdown(summary, entries, columns, label=which)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'table.md'), 'a') as f:
      f.write(f'\n### {label}: {which}\n\n{table}\n')
    row = dict(model=label, checkpoint=which, ema=ema, prompt_file=path, num_prompts=len(entries),
               seed=request.seed,
               steps=int(config.sampler.get('eval_num_steps', 0) or config.sampler.num_steps),
               guidance=float(config.cosmos.get('guidance_eval', 0.0)),
               seconds=time.perf_counter() - t0, **summary)
    with open(os.path.join(out_dir, 'evaluation.jsonl'), 'a') as f:
      f.write(json.dumps(row) + '\n')
    print(table)
    rows.append(row)
  write_examples(out_dir, entries, example_rows(entries, request.videos_per_category), trained_videos,
                 config.eval_video_fps, baseline=baseline_videos)
  print(json.dumps({'out': out_dir, 'rows': len(rows)}))
  return rows
