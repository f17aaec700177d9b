"""Cosmos-Reason1-7B-Reward: the physical-plausibility video judge of DDRL's reward server, run in PyTorch.

What it computes (nvidia-cosmos/cosmos-rl reward_service/cosmos_rl_reward/model/cosmos_reason1.py,
`CosmosReason1Reward`; weights HF nvidia/Cosmos-Reason1-7B-Reward, taken to be a Qwen2.5-VL-7B):
  frames   frames 0, s, 2s, ... with stride s = (T - 1) // 160 + 1 (at most 160 of T frames), trimmed to an
           even count n; the clip's frame rate becomes sample_fps = fps / s. Each frame is resized by PIL
           bicubic (uint8 to uint8) to `smart_resize` (factor 28) with at least 16 * 28**2 * 2 pixels and at
           most (9216 * 28**2 * 2) // n: about 9216 video tokens over the clip whatever its length (93 frames
           at 16 fps, 704x1280 -> 92 frames at 280x532 -> 46 x 10 x 19 = 8,740 tokens). The processor's own
           pass follows: smart_resize within its pixel bounds (the identity for these sizes under
           Qwen2.5-VL's bounds), /255, its mean/std, Qwen2.5-VL's (2 x 14 x 14)-patch layout.
           (qwen-vl-utils 0.0.10 / 0.0.11 first pass each frame through smart_resize within 4 * 28**2 ..
           16384 * 28**2 pixels, an identity here; 0.0.14 bounds each frame to 128 * 28**2 .. 768 * 28**2
           pixels instead, which enlarges frames under 100,352 pixels: not reproduced. DDRL's 280x532
           frames are inside both.)
  prompt   a system turn, the rubric (physical failures to look for, each with an example; things that are
           not artifacts; answer with one word, "Yes" or "No"), then a user turn: the video, then the
           generation prompt itself (the reference defines a question, "does the video contain anomalies",
           but does not send it). Chat template with the generation prompt.
  model    transformers' Qwen2_5_VLForConditionalGeneration, its own forward with video_grid_thw and
           second_per_grid_ts, so the 3-D mRoPE video positions are the ones transformers computes for a
           real video input (see "Time positions"); the logits at the last position.
  score    l_yes, l_no: the logits of the first token of tokenizer.encode('Yes') and of 'No';
           no_score = softmax([l_yes, l_no])[1], the probability of "No" (no anomaly: higher is better);
           yes_score = 1 - no_score. The reference's `prediction` is 'Bad' when l_yes > l_no, else 'Good'.

Time positions. Qwen2.5-VL places the t-th temporal patch of a video at t * second_per_grid_ts *
vision_config.tokens_per_second, with second_per_grid_ts = temporal_patch / fps for the fps the processor is
given. The reference puts fps = sample_fps in the video message and forwards what
qwen_vl_utils.process_vision_info returns: qwen-vl-utils 0.0.10 and 0.0.11 return that fps for a video
given as a list of frames, 0.0.14 ignores it and returns 2.0 (it reads an unset `sample_fps` key); the
service pins neither qwen-vl-utils nor transformers. This module passes second_per_grid_ts =
temporal_patch / position_fps with position_fps = sample_fps by default (the reference's intent and its
result under 0.0.10 / 0.0.11); `position_fps=2.0` reproduces 0.0.14. The model turns that into positions,
so the installed transformers decides the rest, as it does for the reference: 4.57.6 casts
second_per_grid_t to int64 before scaling, so every fps above 2 (0.125 s per temporal patch at 16 fps)
puts all of a video's frames at one temporal position; versions that keep it a float place patch t at
floor(t * second_per_grid_ts * tokens_per_second).

The rubric: `RUBRIC` below has the reference's structure (the task, eight physical categories with an
example each, four non-artifacts to ignore, the one-word answer) in this project's own words. The model was
trained on the reference's exact text (SYSTEM_PROMPT in the cosmos-rl file above), so for scores that match
the release pass that text as `system_prompt=` (a file path or the string itself).

Checkpoints: a local Hugging Face folder, read with local_files_only: config.json (model_type qwen2_5_vl),
model.safetensors or model.safetensors.index.json and its shards, tokenizer.json (or vocab.json +
merges.txt), preprocessor_config.json (video_preprocessor_config.json first when present, as transformers'
video processor reads them) and a chat template (chat_template.jinja or chat_template.json as the processor
reads them, else the tokenizer's own).

Video sizes: any (M, F, H, W, 3) uint8 batch with F >= 2 and an aspect ratio of at most 200 scores; frames
are resized up or down (at least 16 * 28**2 * 2 pixels: 168 x 168 for small square frames).

Tiny checkpoint (smoke runs, tests): `save_tiny(folder)` writes a tiny random Qwen2.5-VL judge in the layout
above and returns the kwargs that build the reward on it (`make_reward('cosmos_reason1',
**cosmos_reason1.save_tiny(folder))`); see the section at the end and tiny_models.py.

The reference scores one video per call and returns -1.0 for every key when a video fails; here a failed
video gets NaN (with a logged warning) and batch_size > 1 scores right-padded batches, each row read at its
own last token. torch, transformers and PIL are imported when a model is built, never at module import.
Pip: torch, transformers, safetensors, pillow.
"""
import functools
import json
import logging
import os

import numpy as np

from ddrl_jax.rewards import video_common
from ddrl_jax.rewards import videoalign

logger = logging.getLogger(__name__)

KEYS = ('no_score', 'yes_score')
COLUMNS = ('no_score', 'yes_score', 'yes_logit', 'no_logit')
ANSWERS = ('Yes', 'No')

# Frame sampling and sizes (the reference's _process_video_inputs; Qwen2.5-VL patch 14, merge 2).
MAX_FRAMES = 160
TEMPORAL_PATCH = 2
SIZE_FACTOR = 28
TOKEN_BUDGET = 9216
MAX_PIXELS = TOKEN_BUDGET * SIZE_FACTOR**2 * TEMPORAL_PATCH    # over all frames: 14,450,688
MIN_PIXELS = 16 * SIZE_FACTOR**2 * TEMPORAL_PATCH              # per frame: 25,088
# transformers' Qwen2-VL video processor defaults, for a preprocessor config that gives no pixel bounds.
PROCESSOR_MIN_PIXELS = 128 * 28 * 28
PROCESSOR_MAX_PIXELS = 768 * 28 * 28


class CheckpointError(video_common.CheckpointError):
  """A Cosmos-Reason1 reward checkpoint that cannot be used; the message is one line naming the file."""


# _fail(path, what) raises CheckpointError('cosmos_reason1 checkpoint <path>: <what>').
_fail = functools.partial(video_common.fail, 'cosmos_reason1', error=CheckpointError)


# ------------------------------------------------------------------------------------------ frames
def frame_stride(total):
  """The step between the frames read from a `total`-frame video: the smallest that reads at most 160."""
  return max(1, (total - 1) // MAX_FRAMES + 1)


def frame_indices(total):
  """(n,) int64 frames read: 0, s, 2s, ... below `total` (s = frame_stride), trimmed to an even count."""
  idx = np.arange(0, total, frame_stride(total))
  idx = idx[:len(idx) - len(idx) % TEMPORAL_PATCH]
  if not len(idx):
    raise ValueError(f'cosmos_reason1: a video needs at least {TEMPORAL_PATCH} frames, got {total}')
  return idx


def frame_pixels(nframes):
  """(min_pixels, max_pixels) of each of nframes frames: the clip's budget split evenly (integer division)."""
  return MIN_PIXELS, MAX_PIXELS // nframes


def sampling_plan(total, height, width, fps):
  """(frame indices (n,), (h, w), sample_fps) for a `total` x height x width video shot at fps."""
  if max(height, width) > videoalign.MAX_ASPECT * min(height, width):
    raise ValueError(f'cosmos_reason1: frames of {height}x{width} exceed the aspect ratio limit '
                     f'{videoalign.MAX_ASPECT}')
  idx = frame_indices(total)
  size = videoalign.smart_resize(height, width, SIZE_FACTOR, *frame_pixels(len(idx)))
  return idx, size, fps / frame_stride(total)


def check_videos(samples, prompts):
  """`samples` as an array after checking it is (M, F, H, W, 3) uint8 with M prompts."""
  return video_common.check_videos(samples, prompts, 'cosmos_reason1')


def video_tokens(nframes, height, width, patch=14, temporal_patch=TEMPORAL_PATCH, merge=2):
  """Language-model tokens of nframes frames of height x width: one per merge x merge block of
  (temporal_patch x patch x patch) patches."""
  t = -(-nframes // temporal_patch)
  return t * (height // patch) * (width // patch) // merge**2


def resize_frames(frames, height, width):
  """(n, H, W, 3) uint8 -> (n, 3, height, width) float32 torch tensor of 0..255 integers: PIL bicubic on
  each uint8 frame, as the reference resizes (an unchanged size returns the frame as it is)."""
  import torch  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  out = np.stack([np.asarray(Image.fromarray(np.ascontiguousarray(f)).resize(
      (width, height), Image.Resampling.BICUBIC)) for f in frames])
  return torch.from_numpy(out).permute(0, 3, 1, 2).float()


def processor_resize(frames, min_pixels, max_pixels, factor=SIZE_FACTOR):
  """The video processor's own pass over (n, 3, h, w) 0..255 frames: the smart_resize size within its
  pixel bounds, reached by antialiased bicubic on uint8 (torchvision's) when it differs from (h, w)."""
  h, w = frames.shape[-2:]
  size = videoalign.smart_resize(h, w, factor, min_pixels, max_pixels)
  if size == (h, w):
    return frames
  uint8 = frames.permute(0, 2, 3, 1).round().clamp(0, 255).byte().numpy()
  return videoalign.resize_frames(uint8, *size)


# ------------------------------------------------------------------------------------------ prompt
RUBRIC = """You are a careful video reviewer. Your job is to spot artifacts and anomalies in the video, that is, anything that could not happen in the real world. Watch the whole clip closely and pay attention to:

* Gravity (e.g. an object with nothing holding it up should fall, not hover)
* Collision (e.g. solid objects should not pass into or through one another)
* Object interaction (e.g. nothing should start moving with nothing acting on it)
* Fluid dynamics (e.g. water should not flow through a solid wall)
* Object permanence (e.g. objects should not pop into or out of existence or abruptly change shape)
* Common sense (e.g. objects should look like things that could actually be used)
* Cause and effect (e.g. a door should not swing open with no visible cause)
* Human motion (e.g. bodies should not warp, and joints should not bend in ways no body can)

These are not artifacts, so leave them out of your judgement:

* An animated or cartoon look is not an artifact in itself.
* There is no audio; do not reason about sound.
* Disregard lighting, shadows, blur and camera effects.
* Do not judge by the general impression, the artistic style or the background.

Start your answer with one word: "Yes" or "No"."""


def load_system_prompt(system_prompt=None):
  """The system turn's text: RUBRIC (None), the contents of the file `system_prompt` names (one trailing
  newline dropped), or the string itself (a string without whitespace must name a file)."""
  if system_prompt is None:
    return RUBRIC
  if not isinstance(system_prompt, str) or not system_prompt.strip():
    raise ValueError(f'cosmos_reason1 system_prompt: {system_prompt!r} is neither a file nor a non-empty '
                     'string')
  if not os.path.isfile(system_prompt):
    if not any(c.isspace() for c in system_prompt):    # one word: a path mistyped, not a rubric
      raise ValueError(f'cosmos_reason1 system_prompt {system_prompt}: no such file')
    return system_prompt
  try:
    with open(system_prompt, encoding='utf-8') as f:
      text = f.read()
  except (OSError, ValueError) as e:
    raise ValueError(f'cosmos_reason1 system_prompt {system_prompt}: cannot be read '
                     f'({video_common.describe(e)})') from None
  text = text[:-1] if text.endswith('\n') else text
  if not text.strip():
    raise ValueError(f'cosmos_reason1 system_prompt {system_prompt}: the file is empty')
  return text


def chat_messages(prompt, system=RUBRIC):
  """A system turn with the rubric, then a user turn: the video, then the generation prompt."""
  video_common.check_prompt(prompt, 'cosmos_reason1')
  return [{'role': 'system', 'content': system},
          {'role': 'user', 'content': [{'type': 'video'}, {'type': 'text', 'text': prompt}]}]


def answer_ids(tokenizer):
  """(yes id, no id): the first token of tokenizer.encode of each word, without special tokens."""
  ids = [tokenizer.encode(word, add_special_tokens=False) for word in ANSWERS]
  if not all(ids) or ids[0][0] == ids[1][0]:
    raise ValueError(f'cosmos_reason1: the tokenizer encodes {ANSWERS} as {ids}; the score needs two '
                     'distinct first tokens')
  return ids[0][0], ids[1][0]


# ------------------------------------------------------------------------------------------ scores
def score_table(logits):
  """(M, 2) logits (yes, no) -> {'no_score', 'yes_score', 'yes_logit', 'no_logit'}: each (M,) float32;
  no_score = softmax([yes, no])[1]. NaN rows stay NaN."""
  logits = np.asarray(logits, np.float64).reshape(-1, 2)
  yes, no = logits[:, 0], logits[:, 1]
  with np.errstate(invalid='ignore'):    # NaN rows
    no_score = np.exp(no - np.logaddexp(yes, no))
  out = {'no_score': no_score, 'yes_score': 1.0 - no_score, 'yes_logit': yes, 'no_logit': no}
  return {k: v.astype(np.float32) for k, v in out.items()}


# ------------------------------------------------------------------------------------------ checkpoints
def _read_json(path):
  """The JSON object in `path`; CheckpointError naming the file when it cannot be read or is not one."""
  return video_common.read_json(path, _fail)


def _first(folder, names):
  for name in names:
    if os.path.isfile(os.path.join(folder, name)):
      return os.path.join(folder, name)
  return None


def checkpoint_files(folder):
  """{'config', 'weights' (a list), 'tokenizer', 'processor', 'chat_template' (None: the tokenizer's)}:
  the paths of a checkpoint folder's pieces; CheckpointError naming the first piece missing."""
  video_common.require_dir(folder, _fail)
  config = os.path.join(folder, 'config.json')
  video_common.require_file(config, _fail)
  weights = _first(folder, ['model.safetensors'])
  if weights is not None:
    weights = [weights]
  else:
    index = _first(folder, ['model.safetensors.index.json'])
    if index is None:
      _fail(folder, 'holds neither model.safetensors nor model.safetensors.index.json')
    shards = sorted(set((_read_json(index).get('weight_map') or {}).values()))
    if not shards:
      _fail(index, 'has no weight_map')
    weights = [os.path.join(folder, s) for s in shards]
    missing = [w for w in weights if not os.path.isfile(w)]
    if missing:
      _fail(missing[0], f'missing ({len(missing)} of the {len(weights)} shards model.safetensors.index.json '
                        'lists)')
  tokenizer = _first(folder, ['tokenizer.json', 'vocab.json'])
  if tokenizer is None:
    _fail(os.path.join(folder, 'tokenizer.json'), 'missing (nor vocab.json + merges.txt)')
  if tokenizer.endswith('vocab.json') and not os.path.isfile(os.path.join(folder, 'merges.txt')):
    _fail(os.path.join(folder, 'merges.txt'), 'missing (vocab.json needs it)')
  processor = _first(folder, ['video_preprocessor_config.json', 'preprocessor_config.json'])
  if processor is None:
    _fail(os.path.join(folder, 'preprocessor_config.json'), 'missing')
  template = _first(folder, ['chat_template.jinja', 'chat_template.json'])
  return dict(config=config, weights=weights, tokenizer=tokenizer, processor=processor,
              chat_template=template)


def processor_settings(cfg):
  """(mean, std, (min_pixels, max_pixels)) of a preprocessor config dict, as transformers' Qwen2-VL video
  processor reads it: min_pixels / max_pixels, else size's shortest_edge / longest_edge, else its defaults."""
  cfg = cfg.get('video_processor', cfg)
  size = cfg.get('size') or {}
  lo = cfg.get('min_pixels') or size.get('shortest_edge') or PROCESSOR_MIN_PIXELS
  hi = cfg.get('max_pixels') or size.get('longest_edge') or PROCESSOR_MAX_PIXELS
  mean = tuple(cfg.get('image_mean') or videoalign.CLIP_MEAN)
  std = tuple(cfg.get('image_std') or videoalign.CLIP_STD)
  return mean, std, (int(lo), int(hi))


def read_chat_template(folder, path, tokenizer):
  """The chat template: chat_template.jinja's text or chat_template.json's 'chat_template' (`path`), else
  the tokenizer's own."""
  if path is None:
    if not tokenizer.chat_template:
      _fail(folder, 'has no chat template (chat_template.jinja, chat_template.json or the tokenizer\'s)')
    return tokenizer.chat_template
  if path.endswith('.jinja'):
    try:
      with open(path, encoding='utf-8') as f:
        return f.read()
    except (OSError, ValueError) as e:
      _fail(path, f'cannot be read ({video_common.describe(e)})')
  template = _read_json(path).get('chat_template')
  if not isinstance(template, str) or not template:
    _fail(path, 'holds no chat_template string')
  return template


def torch_dtype(name):
  """The torch dtype called `name` ('bfloat16', 'float32' or 'float16'); ValueError otherwise."""
  return video_common.torch_dtype(name, 'cosmos_reason1')


# ------------------------------------------------------------------------------------------ model
class CosmosReason1Model(video_common.QwenVideoModel):
  """The judge of one checkpoint with its tokenizer, chat template and pixel settings (see `load_model`).

  `logits(videos, prompts, position_fps, system)`: a list of (n, 3, h, w) float 0..255 frame tensors (one
  video each, from `resize_frames`), their prompts and the fps their time positions use -> (B, 2) float64
  logits of (Yes, No) at each row's last token."""

  reward = 'cosmos_reason1'

  def __init__(self, model, tokenizer, chat_template, processor_config=None):
    super().__init__(model, tokenizer)
    self.chat_template = chat_template
    self.mean, self.std, self.pixel_bounds = processor_settings(processor_config or {})
    self.yes_id, self.no_id = answer_ids(tokenizer)

  def video_rows(self, frames):
    """(n, 3, h, w) float 0..255 frames -> the processor's resize (processor_resize), then Qwen2.5-VL's
    patch rows and grid (videoalign.patchify)."""
    frames = processor_resize(frames, *self.pixel_bounds, factor=self.patch * self.merge)
    return videoalign.patchify(frames, self.mean, self.std, self.patch, self.temporal_patch, self.merge)

  def chat_text(self, prompt, system=RUBRIC):
    """The prompt as text: chat template on chat_messages, with the generation prompt."""
    return self.tokenizer.apply_chat_template(chat_messages(prompt, system), chat_template=self.chat_template,
                                              tokenize=False, add_generation_prompt=True)

  def inputs(self, videos, prompts, position_fps, system=RUBRIC):
    """The model's keyword inputs for a batch, as the processor builds them: one `video_token` per merged
    patch in place of the template's one, the patch rows, video_grid_thw and second_per_grid_ts
    (temporal_patch / fps, float32)."""
    import torch  # pylint: disable=g-import-not-at-top
    inputs = self.video_inputs(videos, prompts, lambda prompt: self.chat_text(prompt, system))
    inputs['second_per_grid_ts'] = torch.tensor(
        [self.temporal_patch / float(position_fps)] * inputs['input_ids'].shape[0], dtype=torch.float32,
        device=self.device)
    return inputs

  def answer_logits(self, inputs):
    """(B, 2) logits of (Yes, No) at each row's last token (right padding): the model's own forward up to
    the final hidden states, then lm_head at those positions only (not over the whole sequence)."""
    import torch  # pylint: disable=g-import-not-at-top
    out = self.model.model(**inputs, use_cache=False, return_dict=True)
    last = inputs['attention_mask'].sum(1) - 1
    hidden = out.last_hidden_state[torch.arange(last.shape[0], device=last.device), last]
    return self.model.lm_head(hidden)[:, [self.yes_id, self.no_id]]

  def logits(self, videos, prompts, position_fps, system=RUBRIC):
    return self.run(lambda: self.answer_logits(self.inputs(videos, prompts, position_fps, system)))


def load_model(checkpoint, device='cpu', dtype='bfloat16', attn_implementation='sdpa'):
  """A CosmosReason1Model from a local Hugging Face folder (see the module docstring), local files only."""
  import transformers  # pylint: disable=g-import-not-at-top
  files = checkpoint_files(checkpoint)
  model_type = _read_json(files['config']).get('model_type')
  if model_type != 'qwen2_5_vl':
    _fail(files['config'], f'has model_type {model_type!r}, not qwen2_5_vl (Qwen2.5-VL)')
  processor_config = _read_json(files['processor'])
  try:
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
  except Exception as e:  # pylint: disable=broad-except  (bad JSON, missing merges, ...)
    _fail(files['tokenizer'], f'cannot be loaded ({video_common.describe(e)})')
  try:
    answer_ids(tokenizer)
  except ValueError as e:
    _fail(files['tokenizer'], str(e))
  template = read_chat_template(checkpoint, files['chat_template'], tokenizer)
  weights = files['weights'][0] if len(files['weights']) == 1 else os.path.join(
      checkpoint, 'model.safetensors.index.json')
  try:
    model, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch_dtype(dtype), attn_implementation=attn_implementation, local_files_only=True,
        output_loading_info=True)
  except Exception as e:  # pylint: disable=broad-except  (truncated safetensors, bad config, ...)
    _fail(weights, f'cannot be loaded ({video_common.describe(e)})')
  tied = {'lm_head.weight'} if getattr(model.config, 'tie_word_embeddings', False) else set()
  missing = [k for k in info.get('missing_keys', ()) if k not in tied]
  if missing or info.get('mismatched_keys'):
    bad = missing or [m[0] if isinstance(m, tuple) else m for m in info['mismatched_keys']]
    _fail(weights, f'{len(bad)} model parameters are missing or mis-shaped (e.g. {bad[0]!r})')
  model.to(device).eval()
  return CosmosReason1Model(model, tokenizer, template, processor_config)


def input_problems(kwargs):
  """One-line problems with CosmosReason1Reward(**kwargs)'s checkpoint folder, found without loading it."""
  checkpoint = kwargs.get('checkpoint')
  if not checkpoint:
    return ['cosmos_reason1: config.reward.kwargs.cosmos_reason1.checkpoint is not set (a local folder of '
            'nvidia/Cosmos-Reason1-7B-Reward)']
  try:
    checkpoint_files(os.path.abspath(os.path.expanduser(checkpoint)))
  except (ValueError, OSError) as e:
    return [str(e).splitlines()[0]]
  return []


@functools.lru_cache(maxsize=None)
def shared_model(checkpoint, device, dtype, attn_implementation):
  """load_model, once per process for each set of arguments."""
  return load_model(checkpoint, device, dtype, attn_implementation)


# ------------------------------------------------------------------------------------------ reward
class CosmosReason1Reward:
  """reward(samples, prompts) -> (M,) float32 Cosmos-Reason1 scores of (M, F, H, W, 3) uint8 videos.

  Args:
    checkpoint: a local Hugging Face folder of nvidia/Cosmos-Reason1-7B-Reward (see the module docstring).
    device, dtype: where and in what the model runs ('bfloat16', the reference's, 'float32' or 'float16').
    key: the column returned: 'no_score' (P("No"), the probability of no anomaly) or 'yes_score'.
    fps: the frame rate the samples were made at (16 for DDRL's 93-frame Cosmos videos).
    batch_size: videos per forward pass (the reference: 1); a failed batch is retried one video at a time.
    system_prompt: the rubric text or a file holding it; default RUBRIC (this project's wording; pass the
      reference's SYSTEM_PROMPT for scores that match the release).
    position_fps: the fps behind second_per_grid_ts; default each video's sample_fps (fps / stride);
      2.0 reproduces the reference under qwen-vl-utils 0.0.14 (see "Time positions").
    attn_implementation: transformers' attention ('sdpa'; the reference runs 'flash_attention_2').
  A video that cannot be scored gets NaN in every column, with a logged warning.
  """

  def __init__(self, checkpoint, device='cpu', dtype='bfloat16', key='no_score', fps=16.0, batch_size=1,
               system_prompt=None, position_fps=None, attn_implementation='sdpa'):
    video_common.check_options(key, KEYS, batch_size, 'cosmos_reason1')
    if not float(fps) > 0 or (position_fps is not None and not float(position_fps) > 0):
      raise ValueError(f'cosmos_reason1: fps {fps} and position_fps {position_fps} must be positive')
    torch_dtype(dtype)
    self.key, self.fps, self.batch_size = key, float(fps), int(batch_size)
    self.position_fps = None if position_fps is None else float(position_fps)
    self.system = load_system_prompt(system_prompt)
    self.judge = shared_model(os.path.abspath(checkpoint), device, dtype, attn_implementation)

  def plan(self, samples):
    """(frame indices, (h, w), sample_fps) for (M, F, H, W, 3) samples; ValueError when none fits them."""
    return video_common.video_plan(samples, lambda f, h, w: sampling_plan(f, h, w, self.fps))

  def logits(self, samples, prompts):
    """(M, 2) float64 logits of (Yes, No); NaN rows for videos that could not be scored."""
    samples = check_videos(samples, prompts)
    idx, (h, w), sample_fps = self.plan(samples)
    position_fps = self.position_fps or sample_fps
    return video_common.score_batches(
        samples.shape[0], self.batch_size, 2,
        lambda which: self._score(samples, prompts, which, idx, h, w, position_fps),
        functools.partial(video_common.warn_unscored, logger, 'cosmos_reason1'))

  def _score(self, samples, prompts, which, idx, h, w, position_fps):
    videos = [resize_frames(samples[i][idx], h, w) for i in which]
    return self.judge.logits(videos, [prompts[i] for i in which], position_fps, self.system)

  def scores(self, samples, prompts):
    """{'no_score', 'yes_score', 'yes_logit', 'no_logit'}: (M,) float32 each, NaN for videos that could
    not be scored."""
    return score_table(self.logits(samples, prompts))

  def __call__(self, samples, prompts):
    return self.scores(samples, prompts)[self.key]


# ------------------------------------------------------------------------------------------ tiny checkpoint
# A tiny random checkpoint in the release's layout, for smoke runs and tests (see `save_tiny`).
TINY_CORPUS = ('a red ball rolls off a table and falls', 'a glass of water tips over')


def tiny_tokenizer(chat_template=None):
  """A small byte-level BPE tokenizer trained on the rubric and the answers ('Yes' and 'No' are single
  tokens), with Qwen's special tokens; `chat_template` (None: none, as the release's tokenizer, whose
  template lives in chat_template.json)."""
  from ddrl_jax.rewards import tiny_models  # pylint: disable=g-import-not-at-top
  return tiny_models.qwen_tokenizer([RUBRIC] * 3 + ['Yes\nNo\nYes. No.'] * 20 + list(TINY_CORPUS),
                                    chat_template=chat_template)


def tiny_config(tokenizer):
  """A Qwen2_5_VLConfig of a tiny model: the language model of tiny_models.tiny_text_config and a two-block
  vision tower of width 32 (window attention in block 0, full in block 1; patch 14, merge 2, temporal patch
  2 and tokens_per_second 2, as the 7B release)."""
  import transformers  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import tiny_models  # pylint: disable=g-import-not-at-top
  vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                fullatt_block_indexes=[1], tokens_per_second=2)
  return transformers.Qwen2_5_VLConfig(text_config=tiny_models.tiny_text_config(), vision_config=vision,
                                       tie_word_embeddings=True, **tiny_models.qwen_token_ids(tokenizer))


def save_tiny(folder, seed=0):
  """Writes a tiny random Qwen2.5-VL judge to `folder` in the release's layout (config.json,
  model.safetensors, tokenizer with single-token 'Yes' and 'No', preprocessor_config.json with the
  release's pixel bounds, chat_template.json) and returns the CosmosReason1Reward keyword arguments that
  load it (local files only): {'checkpoint', 'dtype': 'float32', 'fps': 16.0}.

  ~0.2M parameters; the answers' embedding rows are scaled up so the two logits stand apart from the rest
  of the random vocabulary. Any video of at least 2 frames scores (frames are resized to at least
  16 * 28**2 * 2 pixels, 168 x 168 for square ones); a (4, 5, 32, 32, 3) batch takes well under a second on
  a CPU. Needs torch, transformers, tokenizers and safetensors."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from transformers.models.qwen2_vl import image_processing_qwen2_vl  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import tiny_models  # pylint: disable=g-import-not-at-top
  tokenizer = tiny_tokenizer()
  with tiny_models.seeded(seed):
    model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_config(tokenizer))
  with torch.no_grad():   # answers far from the rest of the vocabulary's random logits
    model.get_input_embeddings().weight[list(answer_ids(tokenizer)), :] *= 8
  model.save_pretrained(folder)
  tokenizer.save_pretrained(folder)
  image_processing_qwen2_vl.Qwen2VLImageProcessor(max_pixels=12845056).save_pretrained(folder)
  with open(os.path.join(folder, 'chat_template.json'), 'w', encoding='utf-8') as f:
    json.dump({'chat_template': tiny_models.QWEN_CHAT_TEMPLATE}, f)
  return {'checkpoint': os.path.abspath(folder), 'dtype': 'float32', 'fps': 16.0}
