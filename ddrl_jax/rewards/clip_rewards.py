"""CLIP image rewards, run in PyTorch: PickScore, CLIPScore and the LAION aesthetic predictor.

Each reward scores (M, H, W, 3) uint8 images (any size; all M the same) with M prompts and returns (M,)
float32, NaN where a score is not finite or its image could not be scored (logged). Models are transformers
`CLIPModel`s read from LOCAL Hugging Face folders (config.json + weights); the tokenizer and the image
processor come from the same folder or from `processor=` (nothing is downloaded).

  pickscore (yuvalkirstain/PickScore README; flow_grpo pickscore_scorer.py): PickScore_v1 (CLIP ViT-H/14)
      with the laion/CLIP-ViT-H-14-laion2B-s32B-b79K processor. Images through the folder's
      CLIPImageProcessor: PIL bicubic resize of the short side to 224, centre crop 224, /255, CLIP mean/std.
      Text: padding to the batch's longest, truncation at 77 tokens. Score: exp(logit_scale) x cos(text
      feature, image feature) of each (prompt, image) pair, / 26 (flow_grpo's, DiffusionNFT's and
      cosmos-rl's "norm to 0-1"; the raw PickScore is ~18-24 on real images).
  clipscore, clipscore_flowgrpo (flow_grpo clip_scorer.py, from RE-N-Y/imscore):
      openai/clip-vit-large-patch14. Images /255 as float, then the processor's settings as torchvision
      tensor transforms: Resize(shortest_edge) BILINEAR on the tensor (antialiased, see
      TENSOR_RESIZE_ANTIALIAS), CenterCrop, Normalize; NOT the processor's PIL bicubic path. Text: padding to
      77 ('max_length'), truncation. Score: logits_per_image's diagonal, exp(logit_scale) x cos (= 100 cos
      for the release), divided by 100 (`clipscore`: the cosine, the scale of the DDRL paper's Table 4, base
      model 0.321) or by 30 (`clipscore_flowgrpo`: flow_grpo's reward scale).
  laion_aesthetic (christophschuhmann/improved-aesthetic-predictor simple_inference.py; flow_grpo
      aesthetic_scorer.py): CLIP ViT-L/14 `get_image_features` on the processor's pixels (as pickscore),
      L2-normalised, through the MLP Linear(768, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2),
      Linear(128, 64), Dropout(0.1), Linear(64, 16), Linear(16, 1): no activations, so the head is one
      affine map of the unit feature (`affine_head`, `aesthetic_bound`). Weights:
      sac+logos+ava1-l14-linearMSE.pth, a torch state dict with keys layers.{0,2,4,6,7}.{weight,bias}. The
      raw output is the reward (~1-10, the AVA rating scale). Prompts are not used. (The HF processor's
      centre crop floors half the excess where the original script's torchvision crop rounds it half to
      even: an odd excess shifts the crop one pixel; flow_grpo's HF path is the one reproduced.)

Common: batches of `batch_size` images per forward pass (a failing batch is retried one image at a time),
torch.inference_mode, eval mode, float32 by default (`dtype='bfloat16'` or 'float16' only on CUDA; features
are cast to float32 before the normalisation and the scores), `device` None: 'cuda' when available, else
'cpu'. Models load when a reward is built, once per process for each (folder, processor, device, dtype).
An empty prompt is allowed (CLIP encodes it as start + end tokens); a prompt that is not a string is an
error.

Tiny folders (smoke runs, tests): `save_tiny(folder)` writes a tiny random CLIP folder (and an aesthetic
head) and returns the kwargs that build a reward on it.

torch, transformers and PIL are imported when a model is built, never at module import. Pip: torch,
transformers, pillow (no torchvision).
"""
import logging
import math
import os

import numpy as np

from ddrl_jax.rewards import video_common

logger = logging.getLogger(__name__)

MAX_TOKENS = 77                          # CLIP's context length; the references truncate there
PICKSCORE_DIVISOR = 26.0
CLIPSCORE_DIVISOR = 100.0                # exp(logit_scale) of the release: the cosine
CLIPSCORE_FLOWGRPO_DIVISOR = 30.0
# Torchvision's Resize on tensors antialiases by default since torchvision 0.17 (antialias=True; 0.15-0.16
# defaulted to None, i.e. False for tensors, with a warning). The references run torchvision 0.21
# (flow_grpo's setup.py pin), so their CLIPScore pixels are antialiased bilinear: downscaling averages over
# the whole footprint (PIL's triangle filter, which torch's antialias=True reproduces), not over the 2 x 2
# neighbours.
TENSOR_RESIZE_ANTIALIAS = True
AESTHETIC_LAYERS = (0, 2, 4, 6, 7)       # the Linear layers of the Sequential (1, 3, 5 are Dropouts)
AESTHETIC_WIDTHS = (1024, 128, 64, 16, 1)
AESTHETIC_DROPOUTS = (0.2, 0.2, 0.1)
WEIGHT_FILES = ('model.safetensors', 'model.safetensors.index.json', 'pytorch_model.bin',
                'pytorch_model.bin.index.json')
TOKENIZER_FILES = (('tokenizer.json',), ('vocab.json', 'merges.txt'))
CLIP_L14 = 'openai/clip-vit-large-patch14'
HINTS = {'pickscore': 'yuvalkirstain/PickScore_v1 (processor=: laion/CLIP-ViT-H-14-laion2B-s32B-b79K)',
         'clipscore': CLIP_L14, 'clipscore_flowgrpo': CLIP_L14, 'laion_aesthetic': CLIP_L14}


class CheckpointError(video_common.CheckpointError):
  """A CLIP folder or aesthetic head that cannot be used; one line naming the reward and the file."""


def _fail(reward, path, what):
  video_common.fail(reward, path, what, error=CheckpointError)


# ------------------------------------------------------------------------------------------ files
def folder_problems(reward, folder, model=True, processor=True):
  """One-line problems with a local CLIP folder, without loading it: a directory holding config.json of a
  'clip' model and its weights (model), preprocessor_config.json and tokenizer files (processor)."""
  where = f'{reward} checkpoint {folder}'
  if not os.path.isdir(folder):
    return [f'{where}: no such directory']
  problems = []
  if model:
    path = os.path.join(folder, 'config.json')
    if not os.path.isfile(path):
      problems.append(f'{where}: no config.json (a Hugging Face CLIPModel folder, e.g. {HINTS[reward]})')
    else:
      try:
        config = video_common.read_json(path, lambda p, w: _fail(reward, p, w))
      except CheckpointError as e:
        problems.append(str(e))
      else:
        if config.get('model_type') != 'clip':
          problems.append(f"{where}: config.json is not a CLIPModel's (model_type "
                          f"{config.get('model_type')!r}, not 'clip')")
    if not any(os.path.isfile(os.path.join(folder, f)) for f in WEIGHT_FILES):
      problems.append(f'{where}: no weights (none of {", ".join(WEIGHT_FILES)})')
  if processor:
    if not os.path.isfile(os.path.join(folder, 'preprocessor_config.json')):
      problems.append(f'{where}: no preprocessor_config.json (the CLIP image processor)')
    if not any(all(os.path.isfile(os.path.join(folder, f)) for f in files) for files in TOKENIZER_FILES):
      problems.append(f'{where}: no tokenizer (tokenizer.json, or vocab.json and merges.txt)')
  return problems


def clip_problems(reward, checkpoint, processor):
  """folder_problems of the model folder and of the processor folder (the same one by default)."""
  if processor == checkpoint:
    return folder_problems(reward, checkpoint)
  return (folder_problems(reward, checkpoint, processor=False)
          + folder_problems(reward, processor, model=False))


def _path(value):
  return os.path.abspath(os.path.expanduser(value)) if value else None


def reward_input_problems(reward, kwargs, head=False):
  """One-line problems with the files reward `reward` built with `kwargs` needs (checkpoint=, processor=
  and, with head, head=), found without loading them."""
  checkpoint = _path(kwargs.get('checkpoint'))
  if not checkpoint:
    return [f'{reward}: config.reward.kwargs.{reward}.checkpoint is not set (a local Hugging Face '
            f'CLIPModel folder of {HINTS[reward]})']
  problems = clip_problems(reward, checkpoint, _path(kwargs.get('processor')) or checkpoint)
  if head:
    path = _path(kwargs.get('head'))
    if not path:
      problems.append(f'{reward}: config.reward.kwargs.{reward}.head is not set (the aesthetic MLP, '
                      'sac+logos+ava1-l14-linearMSE.pth)')
    elif not os.path.isfile(path):
      problems.append(f'{reward} head {path}: no such file')
  return problems


def pickscore_input_problems(kwargs):
  return reward_input_problems('pickscore', kwargs)


def clipscore_input_problems(kwargs):
  return reward_input_problems('clipscore', kwargs)


def clipscore_flowgrpo_input_problems(kwargs):
  return reward_input_problems('clipscore_flowgrpo', kwargs)


def aesthetic_input_problems(kwargs):
  return reward_input_problems('laion_aesthetic', kwargs, head=True)


# ------------------------------------------------------------------------------------------ inputs
def check_images(samples, prompts, reward, prompts_optional=False):
  """`samples` as an array after checking it is (M, H, W, 3) uint8 with M string prompts (prompts may be
  None when prompts_optional). ValueError naming `reward`."""
  samples = np.asarray(samples)
  if samples.dtype != np.uint8 or samples.ndim != 4 or samples.shape[-1] != 3 or 0 in samples.shape[1:3]:
    raise ValueError(f'{reward} needs uint8 RGB images (M, H, W, 3), got {samples.dtype} {samples.shape}')
  if prompts is None and prompts_optional:
    return samples
  if prompts is None or len(prompts) != samples.shape[0]:
    raise ValueError(f'{reward}: {None if prompts is None else len(prompts)} prompts for '
                     f'{samples.shape[0]} images {samples.shape}')
  for p in prompts:
    video_common.check_prompt(p, reward)
  return samples


def check_device_dtype(device, dtype, reward):
  """(device string, torch dtype): device None -> 'cuda' when available, else 'cpu'; dtype 'float32', or
  'bfloat16' / 'float16' on CUDA only."""
  import torch  # pylint: disable=g-import-not-at-top
  device = str(device) if device is not None else ('cuda' if torch.cuda.is_available() else 'cpu')
  torch_dtype = video_common.torch_dtype(dtype, reward)
  if torch_dtype != torch.float32 and torch.device(device).type != 'cuda':
    raise ValueError(f'{reward}: dtype {dtype!r} runs on CUDA only; {device!r} takes float32')
  return device, torch_dtype


# ------------------------------------------------------------------------------------------ pixels
def processor_pixels(image_processor, samples):
  """(M, H, W, 3) uint8 -> (M, 3, S, S) float32 torch pixels from the CLIPImageProcessor (PIL images, as
  the references pass them: PIL bicubic resize, centre crop, /255, mean/std)."""
  import torch  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  images = [Image.fromarray(np.ascontiguousarray(x)) for x in samples]
  return torch.as_tensor(np.asarray(image_processor(images=images, return_tensors='np')['pixel_values']))


def resize_size(height, width, size):
  """(h, w) torchvision's Resize(size) gives a height x width image: size an int, the short side (the long
  side scaled and truncated); a (h, w) pair, exactly that."""
  if not isinstance(size, int):
    return tuple(int(s) for s in size)
  if width <= height:
    return int(size * height / width), size
  return size, int(size * width / height)


def processor_size(size):
  """The torchvision size imscore's get_size makes of a processor's size dict: {'shortest_edge': s} -> s
  (the short side), {'height', 'width'} -> (h, w), an int s -> (s, s)."""
  if isinstance(size, int):
    return (size, size)
  if 'height' in size and 'width' in size:
    return (int(size['height']), int(size['width']))
  if 'shortest_edge' in size:
    return int(size['shortest_edge'])
  raise ValueError(f'invalid processor size {size!r}')


def resize_bilinear(x, size, antialias=TENSOR_RESIZE_ANTIALIAS):
  """(N, C, H, W) float -> (N, C, *size): torchvision's Resize(BILINEAR) of a float tensor (half-pixel
  centres, no clamping; antialiased when downscaling, as torchvision >= 0.17 does by default, see
  TENSOR_RESIZE_ANTIALIAS); unchanged when already that size."""
  import torch  # pylint: disable=g-import-not-at-top
  if tuple(x.shape[-2:]) == tuple(size):
    return x
  return torch.nn.functional.interpolate(x, size=tuple(size), mode='bilinear', align_corners=False,
                                         antialias=antialias)


def center_crop(x, size):
  """(..., H, W) -> (..., h, w): torchvision's CenterCrop((h, w)): zero-padded first where the image is
  smaller (the odd pixel after), offsets int(round(excess / 2)) (half to even)."""
  import torch  # pylint: disable=g-import-not-at-top
  h, w = size
  height, width = x.shape[-2:]
  if h > height or w > width:
    pad_w, pad_h = max(w - width, 0), max(h - height, 0)
    x = torch.nn.functional.pad(x, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2))
    height, width = x.shape[-2:]
  top, left = int(round((height - h) / 2.0)), int(round((width - w) / 2.0))
  return x[..., top:top + h, left:left + w]


def tensor_pixels(image_processor, samples, device='cpu'):
  """(M, H, W, 3) uint8 -> (M, 3, S, S) float32 torch pixels as flow_grpo's CLIPScore makes them: /255, then
  the processor's resize (bilinear on the tensor), centre crop and mean/std as torchvision transforms, each
  where the processor's do_* flag is set."""
  import torch  # pylint: disable=g-import-not-at-top
  cfg = image_processor.to_dict()
  x = torch.from_numpy(np.ascontiguousarray(samples)).to(device).permute(0, 3, 1, 2).float() / 255.0
  if cfg.get('do_resize'):
    x = resize_bilinear(x, resize_size(*x.shape[-2:], processor_size(cfg['size'])))
  if cfg.get('do_center_crop'):
    x = center_crop(x, processor_size(cfg['crop_size']))
  if cfg.get('do_normalize'):
    mean, std = (x.new_tensor(cfg[k]).view(1, 3, 1, 1) for k in ('image_mean', 'image_std'))
    x = (x - mean) / std
  return x


def output_size(image_processor):
  """(h, w) of the processor's pixels: its crop, else its fixed resize; None when neither fixes it."""
  cfg = image_processor.to_dict()
  if cfg.get('do_center_crop'):
    return processor_size(cfg['crop_size'])
  size = processor_size(cfg['size']) if cfg.get('do_resize') else None
  return size if isinstance(size, tuple) else None


# ------------------------------------------------------------------------------------------ features
def features(out):
  """The (B, D) projected features of get_image_features / get_text_features: the tensor itself, or the
  pooled output of the output object newer transformers versions return."""
  import torch  # pylint: disable=g-import-not-at-top
  if isinstance(out, torch.Tensor):
    return out
  for name in ('image_embeds', 'text_embeds', 'pooler_output'):
    value = getattr(out, name, None)
    if isinstance(value, torch.Tensor):
      return value
  return out[0]


def unit(x):
  """(B, D) -> float32 rows divided by their L2 norms."""
  x = x.float()
  return x / x.norm(p=2, dim=-1, keepdim=True)


def text_inputs(tokenizer, prompts, padding, device):
  """{'input_ids', 'attention_mask'}: (B, L) on device; truncated at MAX_TOKENS, padded by `padding`
  (True: the batch's longest, 'max_length': MAX_TOKENS)."""
  batch = tokenizer(list(prompts), padding=padding, truncation=True, max_length=MAX_TOKENS,
                    return_tensors='pt')
  return {'input_ids': batch['input_ids'].to(device), 'attention_mask': batch['attention_mask'].to(device)}


def pair_logits(model, pixel_values, texts):
  """(B,) float32 exp(logit_scale) * cos(text feature i, image feature i): the diagonal of CLIP's
  logits_per_image for B (image, prompt) pairs."""
  dtype = next(model.parameters()).dtype
  image = unit(features(model.get_image_features(pixel_values=pixel_values.to(dtype))))
  text = unit(features(model.get_text_features(**texts)))
  return model.logit_scale.float().exp() * (image * text).sum(-1)


def finite_or_nan(scores, reward):
  """(M,) float32 with each non-finite score NaN (logged)."""
  scores = np.asarray(scores, np.float32).reshape(-1)
  bad = ~np.isfinite(scores)
  if bad.any():
    logger.warning('%s: %d of %d scores are not finite; they are NaN', reward, int(bad.sum()), scores.size)
    scores = np.where(bad, np.float32(np.nan), scores)
  return scores


# ------------------------------------------------------------------------------------------ CLIP folders
class ClipBundle:
  """A CLIPModel in eval mode on its device, with its tokenizer and CLIPImageProcessor."""

  def __init__(self, model, tokenizer, image_processor):
    self.model, self.tokenizer, self.image_processor = model, tokenizer, image_processor
    self.device = next(model.parameters()).device
    self.projection_dim = int(model.config.projection_dim)


def load_clip(reward, checkpoint, processor, device, dtype):
  """ClipBundle of the CLIPModel folder `checkpoint` (processor: the tokenizer and image processor's folder)
  on device in dtype; CheckpointError (one line) when a file is missing or does not fit the model."""
  import transformers  # pylint: disable=g-import-not-at-top
  problems = clip_problems(reward, checkpoint, processor)
  if problems:
    raise CheckpointError(problems[0])
  try:
    model, info = transformers.CLIPModel.from_pretrained(checkpoint, dtype=dtype, local_files_only=True,
                                                         output_loading_info=True)
  except Exception as e:  # pylint: disable=broad-except  (shape mismatches, unreadable files, ...)
    _fail(reward, checkpoint, f'cannot be loaded as a CLIPModel ({video_common.describe(e)})')
  missing = sorted(info.get('missing_keys') or ())
  if missing:
    _fail(reward, checkpoint, f'does not match its CLIPModel config: {len(missing)} weights missing, e.g. '
          f'{missing[0]!r}')
  try:
    tokenizer = transformers.AutoTokenizer.from_pretrained(processor, local_files_only=True)
    image_processor = transformers.CLIPImageProcessor.from_pretrained(processor, local_files_only=True)
  except Exception as e:  # pylint: disable=broad-except
    _fail(reward, processor, f'has no usable CLIP tokenizer / image processor ({video_common.describe(e)})')
  text_vocab = model.config.text_config.vocab_size
  if len(tokenizer) > text_vocab:
    _fail(reward, processor, f'has a tokenizer of {len(tokenizer)} tokens for a text model of {text_vocab} '
          f'({checkpoint})')
  image_size = model.config.vision_config.image_size
  if output_size(image_processor) != (image_size, image_size):
    _fail(reward, processor, f'makes {output_size(image_processor)} pixels; the vision model of '
          f'{checkpoint} takes ({image_size}, {image_size})')
  model.to(device).eval()
  return ClipBundle(model, tokenizer, image_processor)


_SHARED = {}


def shared_clip(reward, checkpoint, processor, device, dtype):
  """load_clip, once per process for each (checkpoint, processor, device, dtype)."""
  key = (checkpoint, processor, device, str(dtype))
  if key not in _SHARED:
    _SHARED[key] = load_clip(reward, checkpoint, processor, device, dtype)
  return _SHARED[key]


# ------------------------------------------------------------------------------------------ aesthetic head
def read_aesthetic_head(path, reward='laion_aesthetic'):
  """{name: float32 tensor} of the aesthetic MLP's state dict (torch.load with weights_only=True): keys
  layers.{0,2,4,6,7}.{weight,bias}, widths (D ->) 1024, 128, 64, 16, 1 chained. CheckpointError (one line)
  otherwise."""
  import torch  # pylint: disable=g-import-not-at-top
  where = f'{reward} head {path}'
  if not os.path.isfile(path):
    raise CheckpointError(f'{where}: no such file')
  try:
    state = torch.load(path, map_location='cpu', weights_only=True)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'{where}: cannot be read ({video_common.describe(e)})') from e
  if not isinstance(state, dict):
    raise CheckpointError(f'{where}: is not a state dict (got {type(state).__name__})')
  expected = [f'layers.{i}.{p}' for i in AESTHETIC_LAYERS for p in ('weight', 'bias')]
  if sorted(state) != sorted(expected):
    odd = sorted(set(state) ^ set(expected))
    raise CheckpointError(f'{where}: is not the aesthetic MLP (keys {expected[0]} ... {expected[-1]}); '
                          f'{odd[0]!r} {"unexpected" if odd[0] in state else "missing"}')
  dim = state['layers.0.weight'].shape[-1]
  for i, width in zip(AESTHETIC_LAYERS, AESTHETIC_WIDTHS):
    w, b = state[f'layers.{i}.weight'], state[f'layers.{i}.bias']
    if tuple(w.shape) != (width, dim) or tuple(b.shape) != (width,):
      raise CheckpointError(f'{where}: layers.{i} is {tuple(w.shape)} + {tuple(b.shape)}, not ({width}, '
                            f'{dim}) + ({width},)')
    dim = width
  return {k: v.float() for k, v in state.items()}


def aesthetic_mlp(state):
  """The aesthetic MLP (Sequential of Linear and Dropout, no activations) with `state`, in eval mode."""
  import torch  # pylint: disable=g-import-not-at-top
  nn = torch.nn
  dims = (state['layers.0.weight'].shape[-1],) + AESTHETIC_WIDTHS
  linears = [nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])]
  drops = [nn.Dropout(p) for p in AESTHETIC_DROPOUTS]
  mlp = nn.Sequential(linears[0], drops[0], linears[1], drops[1], linears[2], drops[2], *linears[3:])
  mlp.load_state_dict({k[len('layers.'):]: v for k, v in state.items()})    # the reference's `self.layers`
  return mlp.eval()


def affine_head(state):
  """(w (D,), b) float64 numpy of the aesthetic MLP as the one affine map it is: mlp(x) = w . x + b."""
  w, b = None, 0.0
  for i in AESTHETIC_LAYERS:
    wi = state[f'layers.{i}.weight'].double().numpy()
    bi = state[f'layers.{i}.bias'].double().numpy()
    w, b = (wi, bi) if w is None else (wi @ w, wi @ b + bi)
  return w.reshape(-1), float(np.asarray(b).reshape(-1)[0])


def aesthetic_bound(state):
  """(low, high): every score the head can give a unit-norm feature, b -/+ ||w|| (its affine form)."""
  w, b = affine_head(state)
  return b - float(np.linalg.norm(w)), b + float(np.linalg.norm(w))


# ------------------------------------------------------------------------------------------ rewards
class _ClipReward:
  """Shared construction and batching of the CLIP rewards (subclasses set `reward` and `raw`).

  Args:
    checkpoint: local Hugging Face CLIPModel folder (config.json, weights).
    processor: folder of the tokenizer and image processor (default: checkpoint).
    device: torch device; None: 'cuda' when available, else 'cpu'.
    dtype: 'float32' (default), or 'bfloat16' / 'float16' on CUDA.
    batch_size: images per forward pass; a failing batch is retried one image at a time.
  """

  reward = 'clip'
  prompts_optional = False

  def __init__(self, checkpoint, processor=None, device=None, dtype='float32', batch_size=32):
    if int(batch_size) < 1:
      raise ValueError(f'{self.reward}: batch_size {batch_size} < 1')
    if not checkpoint:
      raise ValueError(f'{self.reward}: no checkpoint (a local CLIPModel folder of {HINTS[self.reward]})')
    self.batch_size = int(batch_size)
    self.device, torch_dtype = check_device_dtype(device, dtype, self.reward)
    checkpoint = _path(checkpoint)
    processor = _path(processor) or checkpoint
    self.clip = shared_clip(self.reward, checkpoint, processor, self.device, torch_dtype)

  def raw(self, samples, prompts):
    """(B,) float scores of a batch (uint8 images, their prompts)."""
    raise NotImplementedError

  def __call__(self, samples, prompts):
    return score_images(self.raw, samples, prompts, self.reward, self.batch_size, self.prompts_optional)


def score_images(raw, samples, prompts, reward, batch_size, prompts_optional=False):
  """(M,) float32 scores of a torch reward's `raw(images (B, H, W, 3) uint8, prompts) -> (B,) tensor`,
  in batches under inference mode: a batch that fails is retried image by image, and an image that still
  fails, or scores non-finite, is NaN with a warning (shared by the image rewards)."""
  import torch  # pylint: disable=g-import-not-at-top
  samples = check_images(samples, prompts, reward, prompts_optional)

  def score(which):
    with torch.inference_mode():
      out = raw(samples[list(which)], None if prompts is None else [prompts[i] for i in which])
    return out.float().cpu().numpy().reshape(-1, 1)

  def warn(i, e):
    logger.warning('%s: image %d could not be scored, its reward is NaN (%s)', reward, i,
                   video_common.describe(e))

  out = video_common.score_batches(samples.shape[0], batch_size, 1, score, warn)
  return finite_or_nan(out[:, 0], reward)


class PickScore(_ClipReward):
  """reward(samples, prompts) -> (M,) float32 PickScore / 26 of (M, H, W, 3) uint8 images (see the module
  docstring); kwargs of _ClipReward (checkpoint: PickScore_v1, processor: CLIP-ViT-H-14-laion2B's)."""

  reward = 'pickscore'
  divisor = PICKSCORE_DIVISOR

  def raw(self, samples, prompts):
    c = self.clip
    pixels = processor_pixels(c.image_processor, samples).to(c.device)
    return pair_logits(c.model, pixels, text_inputs(c.tokenizer, prompts, True, c.device)) / self.divisor


class CLIPScore(_ClipReward):
  """reward(samples, prompts) -> (M,) float32 CLIPScore of (M, H, W, 3) uint8 images on the cosine scale
  (logits_per_image / 100; see the module docstring); kwargs of _ClipReward (checkpoint:
  openai/clip-vit-large-patch14)."""

  reward = 'clipscore'
  divisor = CLIPSCORE_DIVISOR

  def raw(self, samples, prompts):
    c = self.clip
    pixels = tensor_pixels(c.image_processor, samples, c.device)
    texts = text_inputs(c.tokenizer, prompts, 'max_length', c.device)
    return pair_logits(c.model, pixels, texts) / self.divisor


class CLIPScoreFlowGRPO(CLIPScore):
  """CLIPScore on flow_grpo's reward scale: logits_per_image / 30 (100 cos / 30 for the release)."""

  reward = 'clipscore_flowgrpo'
  divisor = CLIPSCORE_FLOWGRPO_DIVISOR


class LAIONAesthetic(_ClipReward):
  """reward(samples, prompts) -> (M,) float32 LAION aesthetic scores of (M, H, W, 3) uint8 images (prompts
  unused, may be None).

  Args: those of _ClipReward (checkpoint: openai/clip-vit-large-patch14), and
    head: the aesthetic MLP's state dict file (sac+logos+ava1-l14-linearMSE.pth); its input width must equal
      the CLIP's projection_dim (768). The head runs in float32 whatever `dtype`.
  """

  reward = 'laion_aesthetic'
  prompts_optional = True

  def __init__(self, checkpoint, head, processor=None, device=None, dtype='float32', batch_size=32):
    if not head:
      raise ValueError(f'{self.reward}: no head (the aesthetic MLP file, sac+logos+ava1-l14-linearMSE.pth)')
    state = read_aesthetic_head(_path(head), self.reward)
    super().__init__(checkpoint, processor, device, dtype, batch_size)
    dim = state['layers.0.weight'].shape[-1]
    if dim != self.clip.projection_dim:
      raise CheckpointError(f'{self.reward} head {_path(head)}: takes {dim}-dim features; the CLIP of '
                            f'{_path(checkpoint)} projects to {self.clip.projection_dim}')
    self.mlp = aesthetic_mlp(state).to(self.clip.device)

  def raw(self, samples, prompts):
    del prompts
    c = self.clip
    pixels = processor_pixels(c.image_processor, samples).to(c.device, next(c.model.parameters()).dtype)
    return self.mlp(unit(features(c.model.get_image_features(pixel_values=pixels))))[:, 0]


# ------------------------------------------------------------------------------------------ tiny folders
TINY_SPECIALS = ('<|startoftext|>', '<|endoftext|>')
TINY_MERGES = (('a', 't</w>'), ('c', 'at</w>'), ('d', 'o'), ('do', 'g</w>'))
TINY_IMAGE = 32


def tiny_tokenizer_files(folder):
  """Writes vocab.json and merges.txt of a tiny CLIP BPE (the 256 byte symbols alone and word-final, a few
  merges, start and end tokens last) to `folder`; returns the vocabulary size."""
  import json  # pylint: disable=g-import-not-at-top
  from transformers.models.clip import tokenization_clip  # pylint: disable=g-import-not-at-top
  symbols = list(tokenization_clip.bytes_to_unicode().values())
  vocab = symbols + [s + '</w>' for s in symbols] + [a + b for a, b in TINY_MERGES] + list(TINY_SPECIALS)
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, 'vocab.json'), 'w', encoding='utf-8') as f:
    json.dump({t: i for i, t in enumerate(vocab)}, f)
  with open(os.path.join(folder, 'merges.txt'), 'w', encoding='utf-8') as f:
    f.write('#version: 0.2\n' + ''.join(f'{a} {b}\n' for a, b in TINY_MERGES))
  return len(vocab)


def tiny_config(vocab_size, projection_dim=16, image_size=TINY_IMAGE):
  """A CLIPConfig of a tiny CLIP: one layer of width 32 per tower, patch 8, 77 text positions; the text
  model's start / end ids the tiny tokenizer's last two."""
  import transformers  # pylint: disable=g-import-not-at-top
  text = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, max_position_embeddings=MAX_TOKENS, bos_token_id=vocab_size - 2,
              eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1)
  vision = dict(image_size=image_size, patch_size=8, hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=2)
  return transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim,
                                 logit_scale_init_value=math.log(100.0))


def save_tiny_clip(folder, seed=0, projection_dim=16, image_size=TINY_IMAGE, logit_scale=None):
  """Writes a tiny random CLIPModel folder (config, safetensors weights, CLIP tokenizer, CLIPImageProcessor
  with short side and crop image_size) to `folder`; exp(logit_scale) 100 unless given. Returns folder."""
  import transformers  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import tiny_models  # pylint: disable=g-import-not-at-top
  vocab_size = tiny_tokenizer_files(folder)
  tokenizer = transformers.CLIPTokenizer(os.path.join(folder, 'vocab.json'),
                                         os.path.join(folder, 'merges.txt'), model_max_length=MAX_TOKENS)
  with tiny_models.seeded(seed):
    model = transformers.CLIPModel(tiny_config(vocab_size, projection_dim, image_size)).eval()
  if logit_scale is not None:
    model.logit_scale.data.fill_(float(logit_scale))
  model.save_pretrained(folder)
  tokenizer.save_pretrained(folder)
  processor = transformers.CLIPImageProcessor(size={'shortest_edge': image_size},
                                              crop_size={'height': image_size, 'width': image_size})
  processor.save_pretrained(folder)
  return folder


def tiny_aesthetic_state(dim, seed=0):
  """A random aesthetic MLP state dict (layers.{0,2,4,6,7}) for dim-wide features; Linear weights of std
  1 / sqrt(fan_in), biases of std 0.1, the last bias 5 (mid-scale)."""
  import torch  # pylint: disable=g-import-not-at-top
  g = torch.Generator().manual_seed(seed)
  dims, state = (dim,) + AESTHETIC_WIDTHS, {}
  for i, a, b in zip(AESTHETIC_LAYERS, dims[:-1], dims[1:]):
    state[f'layers.{i}.weight'] = torch.randn(b, a, generator=g) / math.sqrt(a)
    state[f'layers.{i}.bias'] = torch.randn(b, generator=g) * 0.1
  state['layers.7.bias'] += 5.0
  return state


def save_tiny(folder, seed=0):
  """Writes a tiny random CLIP folder (folder/clip, see save_tiny_clip) and an aesthetic head for it
  (folder/aesthetic_head.pth) and returns {'checkpoint', 'head'}: pickscore, clipscore and
  clipscore_flowgrpo take {'checkpoint'} (pass dtype / device as wanted), laion_aesthetic both. Any image
  size scores (the processor resizes to 32 x 32)."""
  import torch  # pylint: disable=g-import-not-at-top
  clip = save_tiny_clip(os.path.join(folder, 'clip'), seed)
  head = os.path.join(folder, 'aesthetic_head.pth')
  torch.save(tiny_aesthetic_state(16, seed + 1), head)
  return {'checkpoint': os.path.abspath(clip), 'head': os.path.abspath(head)}
