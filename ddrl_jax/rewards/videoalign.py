"""VideoAlign (VideoReward, KwaiVGI): the VQ / MQ / TA video reward of DDRL, run in PyTorch.

What it computes (KwaiVGI/VideoAlign: inference.py, trainer.py `Qwen2VLRewardModelBT`, vision_process.py,
data.py `DataConfig`, utils.py `load_model_from_checkpoint`, prompt_template.py):
  frames   nframes = even-rounded clamp(F / fps * 2, 4, floor_even(min(768, F))) frames, picked at
           linspace(0, F - 1, nframes).round() (93 frames at 16 fps -> 12); each resized to the
           `smart_resize` size (sides multiples of 28, at most 200704 and at least 128 * 28**2 pixels;
           704x1280 -> 308x588, 480x832 -> 336x588) by antialiased bicubic interpolation, rounded back to
           0..255 as the reference's uint8 resize does; then /255, the processor's mean/std, and Qwen2-VL's
           (2 x 14 x 14)-patch layout.
  prompt   one user turn, the video first, then a rubric in three blocks (Visual Quality, Motion Quality,
           Text Alignment), each ending with its special token `<|VQ_reward|>`, `<|MQ_reward|>`,
           `<|TA_reward|>`; the user's prompt appears only in the Text Alignment block. Chat template with
           the generation prompt; right padding.
  model    Qwen2-VL (transformers `Qwen2VLForConditionalGeneration`) with the three tokens added to its
           tokenizer, the embeddings resized to the tokenizer, and `rm_head = Linear(hidden, output_dim,
           bias=False)` on the final (post-norm) hidden state, read at the three special tokens:
           [B, 3, output_dim], its diagonal when output_dim == 3, flattened when 1: raw VQ, MQ, TA. As in
           the reference's forward, the decoder gets sequential positions (0, 1, 2, ... on all three mRoPE
           sections), not Qwen2-VL's 3-D video positions.
  score    each raw logit z-scored with `inference_config` of model_config.json (defaults, when the file
           has none: VQ 3.6757 / 2.2476, MQ 1.1646 / 1.3811, TA 2.8105 / 2.5121 (mean / std), the values
           two third-party ports of the release quote, not read from the release here). Columns: vq, mq,
           ta, their mean (the DDRL paper's number) and their sum (the reference's "Overall").

The rubric: `RUBRIC` below has the reference's structure (three blocks, their sub-criteria, the special
tokens, the prompt line, each block closed by END) in this project's own words. The released model was
trained on the reference's exact wording (KwaiVGI/VideoAlign prompt_template.py,
DETAILED_PROMPT_WITH_SPECIAL_TOKEN), so for scores that match the release pass that text as
`prompt_template=` (a file path or the template string itself, with `{text_prompt}` where the prompt goes).

Checkpoints: the released layout (HF KwaiVGI/VideoReward): a directory with model_config.json and
checkpoint-<step>/ folders, the highest step taken, each holding either model.pth (the full state dict) or
adapter_model.safetensors (PEFT LoRA) + non_lora_state_dict.pth. The model was wrapped by PEFT before it
was saved, so keys look like `base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`; they are
mapped to this transformers version's module names and LoRA is merged as W += (alpha / r) B A.

Video sizes: any (M, F, H, W, 3) uint8 batch with F >= 2 and an aspect ratio of at most 200 scores; frames
are resized up or down to the smart_resize size (at least min_pixels, 128 * 28**2 by default: 336 x 336 for
square frames, whatever their size).

Tiny checkpoints (smoke runs, tests): `save_tiny(folder)` writes a tiny random Qwen2-VL base folder and a
reward checkpoint in the released LoRA layout on it, and returns the kwargs that build the reward on them
(`make_reward('videoalign', **videoalign.save_tiny(folder))`, local files only; ~0.05 s per 32 x 32
video on one CPU core); see the `save_tiny` section at the end and tiny_models.py.

torch and transformers are imported when a model is built, never at module import (the plain install has
neither). Pip: torch, transformers, safetensors (and peft only for the tests' LoRA comparison).
"""
import functools
import glob
import json
import logging
import math
import os
import re

import numpy as np

from ddrl_jax.rewards import video_common

logger = logging.getLogger(__name__)

DIMS = ('VQ', 'MQ', 'TA')
SPECIAL_TOKENS = ('<|VQ_reward|>', '<|MQ_reward|>', '<|TA_reward|>')
KEYS = ('mean', 'sum', 'vq', 'mq', 'ta')
# (mean, std) of each raw logit; used when model_config.json has no inference_config (see the docstring).
DEFAULT_NORM = {'VQ': (3.6757, 2.2476), 'MQ': (1.1646, 1.3811), 'TA': (2.8105, 2.5121)}

# Frame sampling and sizes (vision_process.py with DataConfig.fps = 2, train.sh's max_frame_pixels).
SAMPLE_FPS = 2.0
FRAME_FACTOR = 2
MIN_FRAMES = 4
MAX_FRAMES = 768
SIZE_FACTOR = 28                  # patch 14 x spatial merge 2
MIN_PIXELS = 128 * 28 * 28
MAX_PIXELS = 200704               # 448 ** 2
MAX_ASPECT = 200
# Qwen2-VL's image processor defaults (OpenAI CLIP); load_model takes the base model's preprocessor values.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class CheckpointError(video_common.CheckpointError):
  """A VideoAlign checkpoint that cannot be used; the message is one line naming the file."""


# _fail(path, what) raises CheckpointError('videoalign checkpoint <path>: <what>').
_fail = functools.partial(video_common.fail, 'videoalign', error=CheckpointError)


# ------------------------------------------------------------------------------------------ frames
def round_even(x):
  return FRAME_FACTOR * round(x / FRAME_FACTOR)


def num_frames(total, video_fps, sample_fps=SAMPLE_FPS):
  """How many of `total` frames (shot at video_fps) the reward reads: total / video_fps * sample_fps,
  clamped to [4, the even floor of min(768, total)], rounded to even, at most `total`."""
  if total < FRAME_FACTOR:
    raise ValueError(f'videoalign: a video needs at least {FRAME_FACTOR} frames, got {total}')
  lo = FRAME_FACTOR * math.ceil(MIN_FRAMES / FRAME_FACTOR)
  hi = FRAME_FACTOR * math.floor(min(MAX_FRAMES, total) / FRAME_FACTOR)
  n = round_even(min(max(total / video_fps * sample_fps, lo), hi))
  return min(n, total)


def frame_indices(total, n):
  """(n,) int64: linspace(0, total - 1, n) rounded half to even, in float32 as torch.linspace computes it."""
  import torch  # pylint: disable=g-import-not-at-top
  return torch.linspace(0, total - 1, n).round().long().numpy()


def smart_resize(height, width, factor=SIZE_FACTOR, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS):
  """(h, w), both multiples of `factor`, near height x width in aspect, with min_pixels <= h w <= max_pixels
  (rounded to the nearest multiple first; scaled down with floor or up with ceil when out of bounds)."""
  if max(height, width) / min(height, width) > MAX_ASPECT:
    raise ValueError(f'videoalign: frames of {height}x{width} exceed the aspect ratio limit {MAX_ASPECT}')
  h = max(factor, factor * round(height / factor))
  w = max(factor, factor * round(width / factor))
  if h * w > max_pixels:
    beta = math.sqrt(height * width / max_pixels)
    h = factor * math.floor(height / beta / factor)
    w = factor * math.floor(width / beta / factor)
  elif h * w < min_pixels:
    beta = math.sqrt(min_pixels / (height * width))
    h = factor * math.ceil(height * beta / factor)
    w = factor * math.ceil(width * beta / factor)
  return h, w


def resize_frames(frames, height, width, quantize=True):
  """(F, H, W, 3) uint8 -> (F, 3, height, width) float32 torch tensor of 0..255 values: antialiased bicubic
  (torch's, PIL's kernel), then clamped and rounded to integers (quantize), as torchvision's resize of the
  reference's uint8 frames returns them."""
  import torch  # pylint: disable=g-import-not-at-top
  x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
  if x.shape[-2:] == (height, width):
    return x
  y = torch.nn.functional.interpolate(x, size=(height, width), mode='bicubic', align_corners=False,
                                      antialias=True)
  return y.clamp(0, 255).round() if quantize else y


def sampling_plan(num_total, height, width, video_fps, sample_fps=SAMPLE_FPS, min_pixels=MIN_PIXELS,
                  max_pixels=MAX_PIXELS, factor=SIZE_FACTOR):
  """(frame indices (n,), (h, w)) the reward reads from a num_total x height x width video."""
  n = num_frames(num_total, video_fps, sample_fps)
  return frame_indices(num_total, n), smart_resize(height, width, factor, min_pixels, max_pixels)


def check_videos(samples, prompts):
  """`samples` as an array after checking it is (M, F, H, W, 3) uint8 with M prompts."""
  return video_common.check_videos(samples, prompts, 'videoalign')


def patchify(frames, mean, std, patch=14, temporal_patch=2, merge=2):
  """(n, 3, h, w) float 0..255 frames -> (t * gh * gw, 3 * temporal_patch * patch**2) float32 rows in
  Qwen2-VL's order (merge x merge blocks of patches contiguous), and the grid (t, gh, gw).

  Pixels are /255 and normalised by mean/std per channel; n is padded to a multiple of temporal_patch with
  copies of the last frame (the processor's rule)."""
  import torch  # pylint: disable=g-import-not-at-top
  x = (frames.float() / 255.0 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
  if x.shape[0] % temporal_patch:
    x = torch.cat([x, x[-1:].expand(temporal_patch - x.shape[0] % temporal_patch, -1, -1, -1)])
  n, c, h, w = x.shape
  t, gh, gw = n // temporal_patch, h // patch, w // patch
  x = x.reshape(t, temporal_patch, c, gh // merge, merge, patch, gw // merge, merge, patch)
  x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
  return x.reshape(t * gh * gw, c * temporal_patch * patch * patch), (t, gh, gw)


# ------------------------------------------------------------------------------------------ prompt
RUBRIC = """
You will rate a generated video on three separate criteria: Visual Quality, Motion Quality and Text Alignment. Judge each criterion on its own, on a scale from 0 (worst) to 10 (best).

**Visual Quality:**
Rate how good the frames look as still images, leaving motion aside. Consider:
- **Plausibility:** no anatomical or logical mistakes, such as malformed bodies or impossible scenes.
- **Sharpness:** the picture is crisp and easy to read, with no blurred or smeared regions.
- **Detail:** textures, materials, lighting and fine elements such as hair, fabric and shadows are rich and convincing.
- **Aesthetics:** colour, composition, mood and depth of field are pleasing, balanced and creative.
- **Safety:** no harmful or inappropriate content (violent, adult or political material); a video with such content gets the lowest score.

Give the rating of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**
Rate how the video moves. Consider:
- **Stability:** consecutive frames agree: no sudden jumps, no flickering colours or textures, no body parts that come and go.
- **Naturalness:** movement obeys physics; cloth, hair and faces move as they would in reality (blinking, speaking).
- **Smoothness:** motion and camera changes are fluid and transitions are seamless.
- **Integration:** moving subjects blend into the background, without halos, artifacts or a cut-out look.
- **Motion clarity:** moving regions stay sharp instead of blurred or jittery.
- **Amount of motion:** a video that barely moves gets a low motion score.

Give the rating of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**
Rate how faithfully the video follows the text prompt. Consider:
- **Subjects:** the people, animals and objects match the prompt in number, appearance and behaviour.
- **Actions:** gestures, poses and expressions match the actions the prompt describes, in kind, size and direction.
- **Setting:** the background and location fit the prompt; some stylistic freedom is fine.
- **Style:** a style or art form named in the prompt is followed.
- **Camera:** camera moves (following, panning, refocusing) match what the prompt asks for.

Text prompt: {text_prompt}
Give the rating of Text Alignment: <|TA_reward|>
END
"""

PROMPT_FIELD = '{text_prompt}'


def load_template(prompt_template=None):
  """The rubric text: RUBRIC (None), the contents of the file `prompt_template` names, or the string itself.
  It must hold `{text_prompt}` once and each special token once, in the order VQ, MQ, TA."""
  if prompt_template is None:
    return RUBRIC
  text = prompt_template
  if os.path.isfile(prompt_template):
    with open(prompt_template, encoding='utf-8') as f:
      text = f.read()
  where = [text.find(t) for t in SPECIAL_TOKENS]
  if (text.count(PROMPT_FIELD) != 1 or any(text.count(t) != 1 for t in SPECIAL_TOKENS)
      or where != sorted(where)):
    raise ValueError(f'videoalign prompt_template: {prompt_template[:80]!r} is neither a file nor a '
                     f'template holding {PROMPT_FIELD} once and {", ".join(SPECIAL_TOKENS)} once each, '
                     'in that order')
  return text


def build_prompt(prompt, template=RUBRIC):
  """The rubric with the user's prompt in its Text Alignment block (plain substitution, no str.format)."""
  video_common.check_prompt(prompt, 'videoalign')
  return template.replace(PROMPT_FIELD, prompt)


def chat_messages(text):
  """One user turn: the video, then the rubric text."""
  return [{'role': 'user', 'content': [{'type': 'video'}, {'type': 'text', 'text': text}]}]


# ------------------------------------------------------------------------------------------ scores
def norm_from_config(model_config):
  """{dim: (mean, std)} from model_config.json's inference_config, else DEFAULT_NORM."""
  cfg = (model_config or {}).get('inference_config')
  if not cfg:
    return dict(DEFAULT_NORM)
  return {d: (float(cfg[f'{d}_mean']), float(cfg[f'{d}_std'])) for d in DIMS}


def score_table(raw, norm=None):
  """(M, 3) raw logits (VQ, MQ, TA) -> {'vq', 'mq', 'ta', 'mean', 'sum'}: each (M,) float32; the three
  z-scored with norm {dim: (mean, std)} (None: raw), mean and sum over them."""
  raw = np.asarray(raw, np.float64).reshape(-1, 3)
  if norm is not None:
    mean = np.array([norm[d][0] for d in DIMS])
    std = np.array([norm[d][1] for d in DIMS])
    raw = (raw - mean) / std
  out = {d.lower(): raw[:, i] for i, d in enumerate(DIMS)}
  out['mean'] = raw.mean(1)
  out['sum'] = raw.sum(1)
  return {k: v.astype(np.float32) for k, v in out.items()}


# ------------------------------------------------------------------------------------------ checkpoints
def read_model_config(checkpoint_dir):
  """model_config.json of a VideoAlign checkpoint directory, as a dict."""
  video_common.require_dir(checkpoint_dir, _fail)
  path = os.path.join(checkpoint_dir, 'model_config.json')
  video_common.require_file(path, _fail, 'missing (the released layout has model_config.json beside '
                            'checkpoint-*/)')
  return video_common.read_json(path, _fail)


def find_checkpoint(checkpoint_dir, step=None):
  """The checkpoint-<step> folder: the given step, else the highest step (numerically)."""
  video_common.require_dir(checkpoint_dir, _fail)
  steps = {}
  for path in glob.glob(os.path.join(checkpoint_dir, 'checkpoint-*')):
    tail = os.path.basename(path)[len('checkpoint-'):]
    if tail.isdigit() and os.path.isdir(path):
      steps[int(tail)] = path
  if not steps:
    _fail(checkpoint_dir, 'has no checkpoint-<step> folder')
  if step is None:
    return steps[max(steps)]
  if int(step) not in steps:
    _fail(checkpoint_dir, f'has no checkpoint-{step} (steps: {sorted(steps)})')
  return steps[int(step)]


def input_problems(kwargs):
  """One-line problems with VideoAlignReward(**kwargs)'s checkpoint, found without loading it (the
  trainer's preflight: a missing checkpoint stops a run before anything is built)."""
  checkpoint = kwargs.get('checkpoint')
  if not checkpoint:
    return ['videoalign: config.reward.kwargs.videoalign.checkpoint is not set (the VideoReward release '
            'folder, model_config.json + checkpoint-<step>/, e.g. KwaiVGI/VideoReward)']
  try:
    find_checkpoint(os.path.abspath(os.path.expanduser(checkpoint)), kwargs.get('step'))
  except (ValueError, OSError) as e:
    return [str(e).splitlines()[0]]
  return []


def _load_torch(path):
  import torch  # pylint: disable=g-import-not-at-top
  try:
    state = torch.load(path, map_location='cpu', weights_only=True)
  except Exception as e:  # pylint: disable=broad-except  (truncated zip, pickle errors, ...)
    _fail(path, f'cannot be read ({video_common.describe(e)})')
  return _check_state(path, state)


def _load_safetensors(path):
  from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top
  try:
    state = load_file(path, device='cpu')
  except Exception as e:  # pylint: disable=broad-except
    _fail(path, f'cannot be read ({video_common.describe(e)})')
  return _check_state(path, state)


def _check_state(path, state):
  import torch  # pylint: disable=g-import-not-at-top
  if not isinstance(state, dict) or not state:
    _fail(path, f'is not a state dict of tensors (got {type(state).__name__})')
  bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
  if bad:
    _fail(path, f'is not a state dict of tensors ({len(bad)} entries are not, e.g. {bad[0]!r})')
  return state


_ADAPTER = re.compile(r'\.(lora_[AB])\.[^.]+\.weight$')    # lora_A.<adapter>.weight in a full state dict
_MODULES_TO_SAVE = re.compile(r'\.modules_to_save\.[^.]+\.')


def canonical_key(key):
  """A checkpoint key as this transformers version names the parameter (None: a key to drop).

  Strips PEFT's wrapping (`base_model.model.`, `.base_layer`, adapter names, `modules_to_save.<name>`;
  drops `original_module` copies) and maps older transformers' Qwen2-VL names (4.45, the reference's pin:
  `model.layers...`, `visual...`) to `model.language_model...`, `model.visual...`. LoRA keys come back as
  `<module>.lora_A.weight` / `<module>.lora_B.weight`."""
  if '.original_module.' in key:
    return None
  if key.startswith('base_model.model.'):
    key = key[len('base_model.model.'):]
  key = key.replace('.base_layer.', '.')
  key = _MODULES_TO_SAVE.sub('.', key)
  key = _ADAPTER.sub(r'.\1.weight', key)
  if key.startswith('visual.'):
    key = 'model.' + key
  elif key.startswith('model.') and not key.startswith(('model.language_model.', 'model.visual.')):
    key = 'model.language_model.' + key[len('model.'):]
  return key


def split_lora(path, state):
  """{canonical key: tensor} of the plain weights and {weight key: {'A': a, 'B': b}} of the LoRA pairs."""
  plain, lora = {}, {}
  for key, value in state.items():
    name = canonical_key(key)
    if name is None:
      continue
    m = re.match(r'(.*)\.(lora_[AB])\.weight$', name)
    if m:
      lora.setdefault(m.group(1) + '.weight', {})[m.group(2)[-1]] = value
    elif 'lora_' in name:
      _fail(path, f'holds {key!r}, a kind of LoRA weight this loader does not merge (only Linear LoRA)')
    else:
      plain[name] = value
  for key, pair in lora.items():
    if set(pair) != {'A', 'B'}:
      _fail(path, f'LoRA of {key!r} has only lora_{"".join(pair)}')
  return plain, lora


def lora_scale(checkpoint_path, model_config):
  """alpha / r (alpha / sqrt(r) with rsLoRA) from the checkpoint's adapter_config.json, else from
  model_config.json's peft_lora_config."""
  path = os.path.join(checkpoint_path, 'adapter_config.json')
  if os.path.isfile(path):
    cfg = video_common.load_json(path, _fail)
    if cfg.get('rank_pattern') or cfg.get('alpha_pattern'):
      _fail(path, 'uses per-module rank_pattern/alpha_pattern, which this loader does not merge')
    r, alpha, rs = cfg.get('r'), cfg.get('lora_alpha'), cfg.get('use_rslora', False)
  else:
    path = 'model_config.json'
    cfg = (model_config or {}).get('peft_lora_config') or {}
    r, alpha, rs = cfg.get('lora_r'), cfg.get('lora_alpha'), cfg.get('use_rslora', False)
  if not r or alpha is None:
    _fail(path, 'gives no LoRA r and alpha (needed to merge the adapter)')
  return float(alpha) / (math.sqrt(r) if rs else float(r))


def read_checkpoint(checkpoint_path, model_config=None):
  """(layout 'full' | 'lora', plain weights {canonical key: tensor}, LoRA pairs, scale) of one
  checkpoint-<step> folder (model.pth, or adapter_model.safetensors + non_lora_state_dict.pth)."""
  full = os.path.join(checkpoint_path, 'model.pth')
  adapter = os.path.join(checkpoint_path, 'adapter_model.safetensors')
  non_lora = os.path.join(checkpoint_path, 'non_lora_state_dict.pth')
  if os.path.isfile(full):
    plain, lora = split_lora(full, _load_torch(full))
    return 'full', plain, lora, (lora_scale(checkpoint_path, model_config) if lora else 1.0)
  if not os.path.isfile(adapter):
    _fail(checkpoint_path, 'holds neither model.pth nor adapter_model.safetensors')
  video_common.require_file(non_lora, _fail, 'missing (a LoRA checkpoint needs it beside '
                            'adapter_model.safetensors)')
  plain_a, lora = split_lora(adapter, _load_safetensors(adapter))
  plain, lora_b = split_lora(non_lora, _load_torch(non_lora))
  if lora_b:
    _fail(non_lora, f'holds LoRA weights (e.g. {next(iter(lora_b))!r}); they belong in the adapter file')
  if not lora:
    _fail(adapter, 'holds no lora_A / lora_B weights')
  plain.update(plain_a)    # modules PEFT saved beside the LoRA pairs (modules_to_save)
  return 'lora', plain, lora, lora_scale(checkpoint_path, model_config)


def apply_checkpoint(model, source, layout, plain, lora, scale):
  """Copies the weights into `model` (in its dtype) and merges each LoRA pair, W += scale * B @ A in
  float32. Every key must name a parameter of the same shape; a full checkpoint must cover the model
  (the tied lm_head aside), a LoRA one must hold rm_head and the embeddings (the added tokens' rows)."""
  import torch  # pylint: disable=g-import-not-at-top
  params = model.state_dict()
  unknown = [k for k in list(plain) + list(lora) if k not in params]
  if unknown:
    _fail(source, f'{len(unknown)} keys do not match the model (e.g. {unknown[0]!r})')
  for k, v in plain.items():
    if tuple(v.shape) != tuple(params[k].shape):
      _fail(source, f'{k!r} has shape {tuple(v.shape)}, the model {tuple(params[k].shape)}')
  for k, pair in lora.items():
    out_f, in_f = params[k].shape
    if pair['A'].ndim != 2 or pair['B'].ndim != 2 or pair['A'].shape[1] != in_f or \
        pair['B'].shape[0] != out_f or pair['B'].shape[1] != pair['A'].shape[0]:
      _fail(source, f'LoRA of {k!r} has A {tuple(pair["A"].shape)} and B {tuple(pair["B"].shape)}, '
                    f'the weight {(out_f, in_f)}')
  tied = {'lm_head.weight'} if getattr(model.config, 'tie_word_embeddings', False) else set()
  if layout == 'full':
    missing = [k for k in params if k not in plain and k not in tied]
    if missing:
      _fail(source, f'{len(missing)} model parameters are missing (e.g. {missing[0]!r})')
  else:
    needed = [k for k in ('rm_head.weight', 'model.language_model.embed_tokens.weight') if k not in plain]
    if needed:
      _fail(source, f'does not hold {needed[0]!r} (the reward head and the special tokens\' embeddings)')
  with torch.no_grad():
    for k, v in plain.items():
      params[k].copy_(v.to(params[k].dtype))
    for k, pair in lora.items():
      w = params[k]
      w.copy_((w.float() + scale * (pair['B'].float() @ pair['A'].float())).to(w.dtype))


# ------------------------------------------------------------------------------------------ model
def special_positions(input_ids, special_ids):
  """(B, 3) positions of the three special tokens in each row of (B, L) input_ids; each must occur once."""
  import torch  # pylint: disable=g-import-not-at-top
  cols = []
  for tok, tid in zip(SPECIAL_TOKENS, special_ids):
    hits = input_ids == tid
    counts = hits.sum(1)
    if (counts != 1).any():
      raise ValueError(f'videoalign: {tok} occurs {counts.tolist()} times in the rows, not once')
    cols.append(hits.int().argmax(1))
  return torch.stack(cols, 1)


def pool_special(hidden, input_ids, special_ids, rm_head):
  """(B, L, D) final hidden states -> (B, 3) raw VQ, MQ, TA: rm_head at the three special tokens
  ([B, 3, output_dim]), its diagonal when output_dim is 3, its only column when 1."""
  import torch  # pylint: disable=g-import-not-at-top
  pos = special_positions(input_ids, special_ids)
  rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None]
  logits = rm_head(hidden[rows, pos])                     # (B, 3, output_dim)
  if logits.shape[-1] == 3:
    return logits.diagonal(dim1=1, dim2=2)
  if logits.shape[-1] == 1:
    return logits[..., 0]
  raise ValueError(f'videoalign: rm_head has output_dim {logits.shape[-1]}; the reward reads 1 or 3')


def sequential_positions(input_ids):
  """(3, B, L) position ids 0, 1, 2, ... on every mRoPE section (the reference's forward passes none)."""
  import torch  # pylint: disable=g-import-not-at-top
  b, n = input_ids.shape
  return torch.arange(n, device=input_ids.device).view(1, 1, n).expand(3, b, n)


def raw_rewards(model, special_ids, input_ids, attention_mask, pixel_values_videos, video_grid_thw):
  """(B, 3) raw VQ, MQ, TA logits of a Qwen2VLForConditionalGeneration with an `rm_head`."""
  out = model.model(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=sequential_positions(input_ids),
                    pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
                    use_cache=False, return_dict=True)
  return pool_special(out.last_hidden_state, input_ids, special_ids, model.rm_head)


def add_reward_tokens(model, tokenizer, output_dim):
  """The reference's model surgery: the three special tokens added to the tokenizer, the embeddings
  resized to len(tokenizer), and `rm_head` (bias-free Linear on the hidden size) attached. Returns the
  three token ids."""
  import torch  # pylint: disable=g-import-not-at-top
  tokenizer.add_special_tokens({'additional_special_tokens': list(SPECIAL_TOKENS)})
  model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
  hidden = model.config.text_config.hidden_size
  model.rm_head = torch.nn.Linear(hidden, output_dim, bias=False).to(model.dtype)
  return tuple(tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)))


def torch_dtype(name):
  """The torch dtype called `name` ('bfloat16', 'float32' or 'float16'); ValueError otherwise."""
  return video_common.torch_dtype(name, 'videoalign')


class VideoAlignModel(video_common.QwenVideoModel):
  """The reward model of one checkpoint, with its tokenizer and pixel settings (see `load_model`).

  `raw(videos, prompts)`: a list of (n, 3, h, w) float 0..255 frame tensors (one video each, from
  `resize_frames`) and their prompts -> (B, 3) float64 raw VQ, MQ, TA."""

  reward = 'videoalign'

  def __init__(self, model, tokenizer, special_ids, model_config, mean=CLIP_MEAN, std=CLIP_STD,
               template=RUBRIC):
    super().__init__(model, tokenizer)
    self.special_ids = special_ids
    self.model_config = model_config or {}
    self.mean, self.std, self.template = tuple(mean), tuple(std), template

  def video_rows(self, frames):
    """(n, 3, h, w) float 0..255 frames -> Qwen2-VL's patch rows and grid (see `patchify`)."""
    return patchify(frames, self.mean, self.std, self.patch, self.temporal_patch, self.merge)

  def chat_text(self, prompt):
    """The prompt as text: the chat template on chat_messages of the rubric holding it, with the
    generation prompt."""
    return self.tokenizer.apply_chat_template(chat_messages(build_prompt(prompt, self.template)),
                                              tokenize=False, add_generation_prompt=True)

  def inputs(self, videos, prompts):
    """The model's keyword inputs for a batch (the processor's job in the reference)."""
    return self.video_inputs(videos, prompts, self.chat_text)

  def raw(self, videos, prompts):
    return self.run(lambda: raw_rewards(self.model, self.special_ids, **self.inputs(videos, prompts)))


def _chat_template(tokenizer, base_model):
  """Sets the tokenizer's chat template to the base model's processor template (chat_template.json, which
  the reference's processor applies) when the base model has one; else keeps the tokenizer's own."""
  from transformers.utils import cached_file  # pylint: disable=g-import-not-at-top
  try:
    path = cached_file(base_model, 'chat_template.json', _raise_exceptions_for_missing_entries=False)
  except OSError:
    path = None
  if path is not None:
    with open(path, encoding='utf-8') as f:
      tokenizer.chat_template = json.load(f)['chat_template']
  if not tokenizer.chat_template:
    raise ValueError(f'videoalign: base model {base_model} has no chat template')


def load_model(checkpoint, base_model=None, device='cpu', dtype='bfloat16', step=None,
               attn_implementation='sdpa', prompt_template=None):
  """A VideoAlignModel from a released-layout checkpoint directory on top of the base Qwen2-VL
  (`base_model`: a local directory or hub id; default model_config.json's model_name_or_path)."""
  import transformers  # pylint: disable=g-import-not-at-top
  from transformers.models.qwen2_vl import image_processing_qwen2_vl  # pylint: disable=g-import-not-at-top
  template = load_template(prompt_template)
  model_config = read_model_config(checkpoint)
  path = find_checkpoint(checkpoint, step)
  layout, plain, lora, scale = read_checkpoint(path, model_config)
  mcfg = model_config.get('model_config') or {}
  base_model = base_model or mcfg.get('model_name_or_path')
  if not base_model:
    raise ValueError('videoalign: no base_model given and model_config.json names none')
  if mcfg.get('reward_token', 'special') != 'special' or mcfg.get('use_special_tokens') is False:
    _fail(os.path.join(checkpoint, 'model_config.json'), 'is not a special-token reward model '
          f'(reward_token={mcfg.get("reward_token")!r}, use_special_tokens={mcfg.get("use_special_tokens")})')
  tokenizer = transformers.AutoTokenizer.from_pretrained(base_model)
  _chat_template(tokenizer, base_model)
  processor = image_processing_qwen2_vl.Qwen2VLImageProcessor.from_pretrained(base_model)
  model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
      base_model, dtype=torch_dtype(dtype), attn_implementation=attn_implementation)
  special_ids = add_reward_tokens(model, tokenizer, int(mcfg.get('output_dim', 1)))
  source = path if layout == 'lora' else os.path.join(path, 'model.pth')
  apply_checkpoint(model, source, layout, plain, lora, scale)
  model.to(device).eval()
  return VideoAlignModel(model, tokenizer, special_ids, model_config, processor.image_mean,
                         processor.image_std, template)


@functools.lru_cache(maxsize=None)
def shared_model(checkpoint, base_model, device, dtype, step, attn_implementation, prompt_template):
  """load_model, once per process for each set of arguments."""
  return load_model(checkpoint, base_model, device, dtype, step, attn_implementation, prompt_template)


# ------------------------------------------------------------------------------------------ reward
class VideoAlignReward:
  """reward(samples, prompts) -> (M,) float32 VideoAlign scores of (M, F, H, W, 3) uint8 videos.

  Args:
    checkpoint: the released-layout directory (model_config.json + checkpoint-*/).
    base_model: Qwen2-VL directory or hub id (tokenizer, preprocessor config, base weights); default
      model_config.json's model_name_or_path (Qwen/Qwen2-VL-2B-Instruct for the release).
    device, dtype: where and in what the model runs ('bfloat16', 'float32' or 'float16'). The reference
      runs bf16 (VideoAlign) or fp16 (cosmos-rl); LoRA is merged in float32 before the cast.
    key: the column returned: 'mean' (of the three z-scores; the DDRL paper's number), 'sum' (the
      reference's Overall), 'vq', 'mq' or 'ta'.
    fps: the frame rate the samples were made at (16 for DDRL's 93-frame Cosmos videos).
    batch_size: videos per forward pass; a failed batch is retried one video at a time.
    sample_fps, max_pixels, min_pixels: frame sampling and size limits; default model_config.json's
      data_config (fps, max_frame_pixels), else 2 fps and 200704 pixels; min_pixels 128 * 28**2.
    normalize: z-score with the checkpoint's inference_config (else DEFAULT_NORM); False: raw logits.
    prompt_template: rubric text or a file holding it (see the module docstring); default RUBRIC.
    step: a checkpoint step to load instead of the highest.
  A video that cannot be scored gets NaN in every column, with a logged warning.
  """

  def __init__(self, checkpoint, base_model=None, device='cpu', dtype='bfloat16', key='mean', fps=16.0,
               batch_size=1, sample_fps=None, max_pixels=None, min_pixels=MIN_PIXELS, normalize=True,
               prompt_template=None, step=None, attn_implementation='sdpa'):
    video_common.check_options(key, KEYS, batch_size, 'videoalign')
    torch_dtype(dtype)
    self.key, self.fps, self.batch_size = key, float(fps), int(batch_size)
    self.vam = shared_model(os.path.abspath(checkpoint), base_model, device, dtype, step,
                            attn_implementation, prompt_template)
    data = self.vam.model_config.get('data_config') or {}
    if data.get('sample_type', 'uniform') != 'uniform' or data.get('num_frames') is not None:
      logger.warning('videoalign: the checkpoint was trained with sample_type=%r, num_frames=%r; this '
                     'reward samples uniformly at sample_fps', data.get('sample_type'),
                     data.get('num_frames'))
    self.sample_fps = float(sample_fps or data.get('fps') or SAMPLE_FPS)
    self.max_pixels = int(max_pixels or data.get('max_frame_pixels') or MAX_PIXELS)
    self.min_pixels = int(min_pixels)
    self.norm = norm_from_config(self.vam.model_config) if normalize else None

  def plan(self, samples):
    """(frame indices, (h, w)) for (M, F, H, W, 3) samples; ValueError when no plan fits them."""
    factor = self.vam.patch * self.vam.merge
    return video_common.video_plan(samples, lambda f, h, w: sampling_plan(
        f, h, w, self.fps, self.sample_fps, self.min_pixels, self.max_pixels, factor))

  def raw(self, samples, prompts):
    """(M, 3) float64 raw logits; NaN rows for videos that could not be scored."""
    samples = check_videos(samples, prompts)
    idx, (h, w) = self.plan(samples)
    return video_common.score_batches(samples.shape[0], self.batch_size, 3,
                                      lambda which: self._score(samples, prompts, which, idx, h, w),
                                      functools.partial(video_common.warn_unscored, logger, 'videoalign'))

  def _score(self, samples, prompts, which, idx, h, w):
    videos = [resize_frames(samples[i][idx], h, w) for i in which]
    return self.vam.raw(videos, [prompts[i] for i in which])

  def scores(self, samples, prompts):
    """{'vq', 'mq', 'ta', 'mean', 'sum'}: (M,) float32 each, NaN for videos that could not be scored."""
    return score_table(self.raw(samples, prompts), self.norm)

  def __call__(self, samples, prompts):
    return self.scores(samples, prompts)[self.key]


# ------------------------------------------------------------------------------------------ tiny checkpoints
# Tiny random checkpoints in the released layout, for smoke runs and tests (see `save_tiny`).
LORA_TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
TINY_LORA = {'r': 4, 'alpha': 8}
TINY_STEP = 100
RELEASE_BASE = 'Qwen/Qwen2-VL-2B-Instruct'


def tiny_tokenizer():
  """A small byte-level BPE tokenizer trained on the rubric, with Qwen2-VL's special tokens and a chat
  template."""
  from ddrl_jax.rewards import tiny_models  # pylint: disable=g-import-not-at-top
  return tiny_models.qwen_tokenizer([RUBRIC] * 3 + ['a red fox runs through snow'],
                                    chat_template=tiny_models.QWEN_CHAT_TEMPLATE)


def tiny_config(tokenizer):
  """A Qwen2VLConfig of a tiny model: the language model of tiny_models.tiny_text_config and a one-block
  vision tower of width 32 (patch 14, merge 2, temporal patch 2, as the release)."""
  import transformers  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import tiny_models  # pylint: disable=g-import-not-at-top
  vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2)
  return transformers.Qwen2VLConfig(text_config=tiny_models.tiny_text_config(), vision_config=vision,
                                    tie_word_embeddings=True, **tiny_models.qwen_token_ids(tokenizer))


def save_tiny_base(path, seed=0):
  """Writes a tiny random Qwen2-VL base model folder (config and safetensors weights, tokenizer with its
  chat template, preprocessor config) to `path`; returns path."""
  import transformers  # pylint: disable=g-import-not-at-top
  from transformers.models.qwen2_vl import image_processing_qwen2_vl  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import tiny_models  # pylint: disable=g-import-not-at-top
  tokenizer = tiny_tokenizer()
  with tiny_models.seeded(seed):
    model = transformers.Qwen2VLForConditionalGeneration(tiny_config(tokenizer))
  model.save_pretrained(path)
  tokenizer.save_pretrained(path)
  image_processing_qwen2_vl.Qwen2VLImageProcessor().save_pretrained(path)
  return path


def tiny_reward_model(base, output_dim=1, seed=1):
  """The reference's construction on a (tiny) base model folder: the three tokens added, the embeddings
  resized, a random rm_head and random rows for the added tokens. Returns (model, tokenizer, special ids),
  the model float32 in eval mode."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  tokenizer = transformers.AutoTokenizer.from_pretrained(base, local_files_only=True)
  model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
      base, dtype=torch.float32, local_files_only=True).eval()
  ids = add_reward_tokens(model, tokenizer, output_dim)
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    model.rm_head.weight.copy_(torch.randn(model.rm_head.weight.shape, generator=gen))
    emb = model.get_input_embeddings().weight
    emb[list(ids)] = torch.randn(len(ids), emb.shape[1], generator=gen)
  return model, tokenizer, ids


def write_model_config(path, output_dim=1, lora=None, inference=None, data=None, base_model=RELEASE_BASE):
  """Writes `path`/model_config.json as the release lays it out: model_config (base model, output_dim,
  special-token reward), data_config (default: the release's 2 fps, 200704 pixels, uniform sampling),
  peft_lora_config (lora: {'r', 'alpha'} or None) and, when given, inference_config (the normalisation)."""
  lora = lora or {}
  cfg = {'model_config': {'model_name_or_path': base_model, 'output_dim': output_dim,
                          'use_special_tokens': True, 'reward_token': 'special'},
         'data_config': data or {'fps': SAMPLE_FPS, 'max_frame_pixels': MAX_PIXELS, 'sample_type': 'uniform',
                                 'num_frames': None, 'eval_dim': list(DIMS),
                                 'prompt_template_type': 'detailed_special'},
         'peft_lora_config': {'lora_enable': bool(lora), 'lora_r': lora.get('r'),
                              'lora_alpha': lora.get('alpha'), 'use_rslora': False}}
  if inference:
    cfg['inference_config'] = inference
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, 'model_config.json'), 'w', encoding='utf-8') as f:
    json.dump(cfg, f, indent=2)


def legacy_key(key):
  """This transformers version's parameter name as transformers 4.45 (the reference's pin) named it."""
  key = key.replace('model.language_model.', 'model.')
  return key.replace('model.visual.', 'visual.')


def save_full_checkpoint(checkpoint, model, step=TINY_STEP, legacy=True):
  """Writes `model`'s whole state dict as checkpoint/checkpoint-<step>/model.pth (transformers 4.45 names
  when legacy); returns the file's path."""
  import torch  # pylint: disable=g-import-not-at-top
  os.makedirs(os.path.join(checkpoint, f'checkpoint-{step}'), exist_ok=True)
  state = {(legacy_key(k) if legacy else k): v.clone() for k, v in model.state_dict().items()}
  path = os.path.join(checkpoint, f'checkpoint-{step}', 'model.pth')
  torch.save(state, path)
  return path


def save_lora_checkpoint(checkpoint, model, step=TINY_STEP, r=TINY_LORA['r'], alpha=TINY_LORA['alpha'],
                         seed=2, targets=LORA_TARGETS, base_model=RELEASE_BASE):
  """Writes checkpoint/checkpoint-<step>/ in the released LoRA layout (as a PEFT-wrapped model under
  transformers 4.45 is saved, without needing peft): adapter_model.safetensors with random lora_A / lora_B
  pairs (rank r) on the language model's `targets` Linears, adapter_config.json (r, lora_alpha), and
  non_lora_state_dict.pth with the trained non-LoRA weights of `model` (rm_head, the embeddings with the
  added tokens' rows, the vision tower); the rest comes from the base model. Returns the folder."""
  import torch  # pylint: disable=g-import-not-at-top
  from safetensors.torch import save_file  # pylint: disable=g-import-not-at-top
  step_dir = os.path.join(checkpoint, f'checkpoint-{step}')
  os.makedirs(step_dir, exist_ok=True)
  prefix = 'base_model.model.'
  gen = torch.Generator().manual_seed(seed)
  adapter = {}
  for name, module in model.named_modules():
    if (isinstance(module, torch.nn.Linear) and name.split('.')[-1] in targets
        and name.startswith('model.language_model.')):
      out_f, in_f = module.weight.shape
      key = prefix + legacy_key(name)
      adapter[f'{key}.lora_A.weight'] = torch.randn(r, in_f, generator=gen) / math.sqrt(in_f)
      adapter[f'{key}.lora_B.weight'] = torch.randn(out_f, r, generator=gen) * 0.02
  save_file({k: v.contiguous() for k, v in adapter.items()},
            os.path.join(step_dir, 'adapter_model.safetensors'), metadata={'format': 'pt'})
  config = {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'base_model_name_or_path': base_model, 'r': r,
            'lora_alpha': alpha, 'lora_dropout': 0.0, 'use_rslora': False, 'bias': 'none',
            'target_modules': sorted(targets), 'fan_in_fan_out': False, 'init_lora_weights': True,
            'modules_to_save': None, 'rank_pattern': {}, 'alpha_pattern': {}}
  with open(os.path.join(step_dir, 'adapter_config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=2)
  keep = ('rm_head.', 'embed_tokens.', 'model.visual.')
  non_lora = {prefix + legacy_key(k): v.detach().clone() for k, v in model.named_parameters()
              if any(s in k for s in keep)}
  torch.save(non_lora, os.path.join(step_dir, 'non_lora_state_dict.pth'))
  return step_dir


def save_tiny(folder, seed=0, layout='lora', output_dim=1):
  """Writes a tiny random VideoAlign reward model under `folder` and returns the VideoAlignReward keyword
  arguments that load it (local files only): {'checkpoint', 'base_model', 'dtype': 'float32', 'fps': 16.0}.

  folder/base: a tiny Qwen2-VL base (see save_tiny_base; ~0.2M parameters); folder/videoreward: the released
  layout, model_config.json (naming the base folder) + checkpoint-100/ with either the LoRA layout
  (layout='lora', the release's: adapter_model.safetensors + non_lora_state_dict.pth) or a full model.pth
  (layout='full'). Any video of at least 2 frames scores (frames are resized to at least 128 * 28**2
  pixels, 336 x 336 for square ones); a (4, 5, 32, 32, 3) batch takes well under a second on a CPU.
  Needs torch, transformers, tokenizers and safetensors (not peft)."""
  if layout not in ('lora', 'full'):
    raise ValueError(f'videoalign save_tiny: layout {layout!r}; known: lora, full')
  base = save_tiny_base(os.path.join(folder, 'base'), seed)
  model, _, _ = tiny_reward_model(base, output_dim, seed + 1)
  checkpoint = os.path.join(folder, 'videoreward')
  write_model_config(checkpoint, output_dim, lora=TINY_LORA if layout == 'lora' else None,
                     base_model=os.path.abspath(base))
  if layout == 'lora':
    save_lora_checkpoint(checkpoint, model, seed=seed + 2, base_model=os.path.abspath(base))
  else:
    save_full_checkpoint(checkpoint, model)
  return {'checkpoint': os.path.abspath(checkpoint), 'base_model': os.path.abspath(base), 'dtype': 'float32',
          'fps': 16.0}
