"""What the torch video rewards share (videoalign, cosmos_reason1, vbench).

  errors   `first_line` / `describe` of an exception for one-line messages; `CheckpointError`, the base of
           each reward's own, with `fail` (raises '<reward> checkpoint <path>: <what>') and the JSON readers
           that report through such a `fail`.
  inputs   `check_videos`: an (M, F, H, W, 3) uint8 batch with M prompts, as each reward's message states
           it; `video_plan`: a reward's sampling plan for such a batch, its errors naming the batch's shape.
  scoring  `score_batches` / `score_each`: rows of scores, batch by batch, a failing batch retried one video
           at a time and a failing video left NaN with `warn_unscored`'s logged warning.
  models   `torch_dtype` by name; `QwenVideoModel`, the part of a Qwen-VL video judge (Qwen2-VL for
           videoalign, Qwen2.5-VL for cosmos_reason1) that builds the model's inputs from frames and chat
           text as the processor does.

Each function that names a reward takes its name (e.g. 'videoalign'), so every message still says which
reward raised it. Nothing here imports torch at module import; the functions that need it import it when
called.
"""
import json
import os

import numpy as np


# ------------------------------------------------------------------------------------------ errors
def first_line(e):
  """The first line of an exception's message, at most 200 characters."""
  return (str(e).strip().splitlines() or [''])[0][:200]


def describe(e):
  """'<ExceptionType>: <first line of its message>'."""
  return f'{type(e).__name__}: {first_line(e)}'


class CheckpointError(ValueError):
  """A reward checkpoint that cannot be used; the message is one line naming the reward and the file.
  Each reward module raises its own subclass (videoalign.CheckpointError, cosmos_reason1.CheckpointError)."""


def fail(reward, path, what, error=CheckpointError):
  """Raises error(f'{reward} checkpoint {path}: {what}')."""
  raise error(f'{reward} checkpoint {path}: {what}')


def require_dir(path, fail_fn):
  """fail_fn(path, 'no such directory') unless path is a directory."""
  if not os.path.isdir(path):
    fail_fn(path, 'no such directory')


def require_file(path, fail_fn, what='missing'):
  """fail_fn(path, what) unless path is a file."""
  if not os.path.isfile(path):
    fail_fn(path, what)


def load_json(path, fail_fn):
  """The JSON value in the file `path`; fail_fn(path, 'cannot be read (...)') when it cannot be read or
  parsed (`fail_fn` raises: a reward's `fail` bound to its name)."""
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    fail_fn(path, f'cannot be read ({describe(e)})')


def read_json(path, fail_fn):
  """load_json of a file that must hold a JSON object (a dict); fail_fn(path, ...) otherwise."""
  data = load_json(path, fail_fn)
  if not isinstance(data, dict):
    fail_fn(path, 'is not a JSON object')
  return data


# ------------------------------------------------------------------------------------------ inputs
def check_options(key, keys, batch_size, reward):
  """ValueError naming `reward` unless key is one of `keys` and batch_size >= 1."""
  if key not in keys:
    raise ValueError(f'{reward}: key {key!r}; known: {keys}')
  if int(batch_size) < 1:
    raise ValueError(f'{reward}: batch_size {batch_size} < 1')


def check_prompt(prompt, reward):
  """ValueError naming `reward` unless prompt is a string."""
  if not isinstance(prompt, str):
    raise ValueError(f'{reward}: prompt {prompt!r} is not a string')


def check_videos(samples, prompts, reward, min_frames=0, min_side=0, label=None, prompts_optional=False):
  """`samples` as an array after checking it is (M, F, H, W, 3) uint8, with F >= min_frames and
  H, W >= min_side (both stated in the message when either is set), and with M prompts (not checked when
  prompts is None and prompts_optional). ValueError naming `label` (default `reward`) for the videos and
  `reward` for the prompts."""
  samples = np.asarray(samples)
  if (samples.dtype != np.uint8 or samples.ndim != 5 or samples.shape[-1] != 3
      or samples.shape[1] < min_frames or min(samples.shape[2:4]) < min_side):
    needs = f' with F >= {min_frames} and H, W >= {min_side}' if min_frames or min_side else ''
    raise ValueError(f'{label or reward} needs uint8 RGB videos (M, F, H, W, 3){needs}, got {samples.dtype} '
                     f'{samples.shape}')
  if not (prompts is None and prompts_optional) and len(prompts) != samples.shape[0]:
    raise ValueError(f'{reward}: {len(prompts)} prompts for {samples.shape[0]} videos {samples.shape}')
  return samples


def video_plan(samples, plan):
  """plan(F, H, W) for (M, F, H, W, 3) samples; a ValueError it raises comes back with the shape added."""
  _, f, h, w, _ = samples.shape
  try:
    return plan(f, h, w)
  except ValueError as e:
    raise ValueError(f'{e} (videos {samples.shape})') from e


# ------------------------------------------------------------------------------------------ scoring
def warn_unscored(logger, label, i, e, what='reward'):
  """Logs that video i could not be scored: '<label>: video <i> could not be scored, its <what> is NaN
  (<ExceptionType>: <first line>)'."""
  logger.warning('%s: video %d could not be scored, its %s is NaN (%s: %s)', label, i, what,
                 type(e).__name__, first_line(e))


def score_each(out, indices, score, warn):
  """out[i] = score(i) for each i of `indices`; where score raises, out[i] is left as it is (NaN) and
  warn(i, e) is called. Returns out."""
  for i in indices:
    try:
      out[i] = score(i)
    except Exception as e:  # pylint: disable=broad-except
      warn(i, e)
  return out


def score_batches(count, batch_size, width, score, warn):
  """(count, width) float64 rows of `count` videos: score(indices) -> (len(indices), width) rows, called on
  consecutive batches of at most batch_size; a batch that raises is retried one video at a time (a batch of
  one is not retried), and a video that still raises keeps a NaN row and warn(i, e) is called."""
  out = np.full((count, width), np.nan)
  for start in range(0, count, batch_size):
    chunk = range(start, min(start + batch_size, count))
    try:
      out[start:chunk.stop] = score(chunk)
      continue
    except Exception as e:  # pylint: disable=broad-except
      if len(chunk) == 1:
        warn(chunk[0], e)
        continue
    score_each(out, chunk, lambda i: score([i]), warn)     # find the videos that failed the batch
  return out


# ------------------------------------------------------------------------------------------ models
def torch_dtype(name, reward):
  """The torch dtype called `name` ('bfloat16', 'float32' or 'float16'); ValueError naming `reward`
  otherwise."""
  import torch  # pylint: disable=g-import-not-at-top
  dtypes = {'bfloat16': torch.bfloat16, 'float32': torch.float32, 'float16': torch.float16}
  if name not in dtypes:
    raise ValueError(f'{reward}: dtype {name!r}; known: {sorted(dtypes)}')
  return dtypes[name]


class QwenVideoModel:
  """A transformers Qwen-VL model and its tokenizer (set to right padding), with what building its video
  inputs needs: patch, temporal_patch, merge (the vision config's), video_token (the placeholder the chat
  template writes once per video) and device. Subclasses set `reward` (the name in messages) and define
  `video_rows`."""

  reward = 'video'

  def __init__(self, model, tokenizer):
    self.model, self.tokenizer = model, tokenizer
    vision = model.config.vision_config
    self.patch, self.temporal_patch = vision.patch_size, vision.temporal_patch_size
    self.merge = vision.spatial_merge_size
    self.video_token = tokenizer.convert_ids_to_tokens(model.config.video_token_id)
    tokenizer.padding_side = 'right'
    self.device = next(model.parameters()).device

  def video_rows(self, frames):
    """(n, 3, h, w) float 0..255 frames -> (patch rows (t * gh * gw, 3 * temporal_patch * patch**2),
    grid (t, gh, gw))."""
    raise NotImplementedError

  def video_inputs(self, videos, prompts, chat_text):
    """The model's keyword inputs for a batch, as the processor builds them: for each (n, 3, h, w) video
    and its prompt, video_rows of the frames and chat_text(prompt) with its one video_token expanded to one
    per merged patch (t * gh * gw / merge**2); the texts tokenized with right padding. -> {'input_ids',
    'attention_mask': (B, L), 'pixel_values_videos': (all rows, row width), 'video_grid_thw': (B, 3)} on
    the model's device."""
    import torch  # pylint: disable=g-import-not-at-top
    pixels, grids, texts = [], [], []
    for frames, prompt in zip(videos, prompts):
      rows, grid = self.video_rows(frames)
      text = chat_text(prompt)
      if text.count(self.video_token) != 1:
        raise ValueError(f'{self.reward}: the chat text holds {text.count(self.video_token)} '
                         f'{self.video_token} tokens, not one')
      texts.append(text.replace(self.video_token, self.video_token * (int(np.prod(grid)) // self.merge**2)))
      pixels.append(rows)
      grids.append(grid)
    batch = self.tokenizer(texts, padding=True, return_tensors='pt')
    return dict(input_ids=batch['input_ids'].to(self.device),
                attention_mask=batch['attention_mask'].to(self.device),
                pixel_values_videos=torch.cat(pixels).to(self.device),
                video_grid_thw=torch.tensor(grids, dtype=torch.long, device=self.device))

  @staticmethod
  def run(forward):
    """forward() (inputs and model) under torch.inference_mode; its tensor as a float64 numpy array."""
    import torch  # pylint: disable=g-import-not-at-top
    with torch.inference_mode():
      out = forward()
    return out.float().cpu().numpy().astype(np.float64)
