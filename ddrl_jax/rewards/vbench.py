"""VBench's five quality dimensions as video rewards and evaluation metrics, run in PyTorch.

The DDRL paper's VBench reward is the mean of these five per-video scores. Each one is computed as
Vchitect/VBench computes its per-video value (`video_results[i]['video_results']`, not the dimension's
frame-weighted aggregate), on the in-memory uint8 frames (VBench decodes mp4 files, so offline VBench numbers
also carry the codec's loss):

  subject_consistency (vbench/subject_consistency.py): DINO ViT-B/16 (`dino_vitbase16_pretrain.pth`) CLS
      feature after the final norm, one per frame. Frames: short side resized to 224 (bilinear, no
      antialias, no crop; 704x1280 -> 224x407), /255, ImageNet mean/std. A non-square frame interpolates the
      14x14 positional grid as facebookresearch/dino vision_transformer.py does: bicubic with the *scale
      factor* (target + 0.1) / 14, so the sampling positions differ slightly from a resize to the target size.
  background_consistency (vbench/background_consistency.py): OpenAI CLIP ViT-B/32 (`ViT-B-32.pt`)
      `encode_image`. Frames: short side to 224 (bicubic, no antialias), centre crop 224 (offsets rounded
      half to even, as torchvision's), /255, CLIP mean/std.
    Both consistencies: features L2-normalised; for frames i >= 1, (max(0, cos(f_{i-1}, f_i)) +
      max(0, cos(f_0, f_i))) / 2; the mean over the F - 1 frames.
  motion_smoothness (vbench/motion_smoothness.py): the AMT-S frame interpolator (`amt-s.pth`, its
      `state_dict`; corr_radius 3, corr_lvls 4, num_flows 3) predicts the midpoint of each pair of
      consecutive even frames (0, 2, 4, ...; inputs /255, replicate-padded to multiples of 16, embt 0.5);
      each prediction, cropped back and cast to uint8 (x 255, clipped, truncated), is compared with the real
      odd frame between its pair: score = (255 - mean |pred - real|) / 255, the mean over pairs. With an even
      frame count the last odd frame has no pair and is not read (VBench pairs them the same way). Frames
      need both sides > 112: smaller ones leave AMT-S's coarsest correlation level (1/64 of the padded
      frame) at most 1 pixel wide, where its sampler divides by zero (VBench would score the NaN frames as
      garbage; here that is a ValueError).
  aesthetic_quality (vbench/aesthetic_quality.py): OpenAI CLIP ViT-L/14 (`ViT-L-14.pt`) `encode_image` in
      float32, L2-normalised, through the LAION aesthetic predictor v1 (`sa_0_4_vit_l_14_linear.pth`, one
      Linear(768, 1); LAION-AI/aesthetic-predictor), /10 per frame; the mean over frames. Frames as for
      background_consistency.
  imaging_quality (vbench/imaging_quality.py, preprocessing mode 'longer'): MUSIQ with the SPAQ weights
      (`musiq_spaq_ckpt-358bb6af.pth`). Frames whose longer side exceeds 512 are resized (bilinear, no
      antialias) to int(h * 512 / max) x int(w * 512 / max), then /255; MUSIQ maps them to [-1, 1], adds
      bicubic rescalings with longer sides 224 and 384 to the original, cuts each scale into 32x32 patches
      (TF 'SAME' zero padding) with hashed 10x10 spatial and scale indices, pads the two rescaled scales to
      7**2 and 12**2 tokens, and regresses the MOS (~0-100) from the CLS token. Per-frame MOS; the mean
      over frames; /100. (VBench leaves its per-video values of this dimension on the 0-100 scale and
      divides only the dimension's average by 100; here each video is divided, so all five share 0-1.)

The backbones and why (torchvision cannot be imported beside the CPU torch this project pins, since the PyPI
torchvision wheels need a CUDA torch; `timm`, the `clip` package's `__init__`, `vbench`'s `__init__` and
`pyiqa`'s archs all import it):
  CLIP (b, d)  OpenAI's own `clip.model.build_model` (PyPI `openai-clip`, the package VBench requires), read
               from the JIT archive's state dict as `clip.load(..., jit=False)` does: fp16 weights, cast to
               float32 on CPU (on CUDA they stay fp16, as in VBench). `clip/model.py` is imported without
               running `clip/__init__.py` (which imports torchvision for its transforms).
  AMT-S (c)    the reference network itself, `vbench.third_party.amt.networks.AMT-S` (PyPI `vbench==0.1.5`
               installed with --no-deps), imported without running `vbench/__init__.py` (which needs decord
               and torchvision); its own InputPadder, img2tensor and tensor2img. VBench's reduced-scale
               path for GPUs under ~7 GB (at 720p) is not reproduced: the scale is always 1, as on larger
               GPUs (and on CPU).
  DINO (a)     a functional ViT in this file over the checkpoint's own tensors (blocks of pre-norm attention
               and GELU MLP, LayerNorm eps 1e-6, CLS after the final norm), with DINO's +0.1 interpolation.
  MUSIQ (e)    a functional MUSIQ in this file over the checkpoint's own tensors, following
               chaofengc/IQA-PyTorch pyiqa/archs/musiq_arch.py and pyiqa/data/multiscale_trans_util.py
               (weight-standardised ResNet stem with TF 'SAME' padding, hashed spatial and scale embeddings,
               masked attention with -1e3 on padding, CLS head; several classes: the MOS of the softmax).
               Both are tested against independent references (transformers' ViT, pyiqa's MUSIQ).
  Attention heads are not stored in a checkpoint: DINO and MUSIQ use width / 64 (12 for ViT-B, 6 for MUSIQ).

Frames are batched (`batch_size` per forward; VBench runs DINO and MUSIQ one frame at a time, CLIP-B/32 on all
frames and CLIP-L/14 in batches of 32), which changes results only by float rounding. Per-video work runs
under torch.no_grad on `device`.

Weights: `weights_dir` holds the reference files under their reference names, either flat or in VBench's own
cache layout (dino_model/, clip_model/, aesthetic_model/emb_reader/, amt_model/, pyiqa_model/); default
$VBENCH_CACHE_DIR or ~/.cache/vbench, as VBench. Files are checked when the reward is built and loaded on its
first use, once per process. torch and the packages above are imported only then: this module imports with
numpy alone. Pip: torch, openai-clip==1.0.1, imageio (AMT's utils import it), and
`pip install --no-deps vbench==0.1.5` (its declared dependencies pin transformers==4.33.2 and numpy<2).

Video sizes: every dimension needs F >= 2 frames, motion_smoothness F >= 3 and H, W >= 113 (see above);
`accepted_dimensions(F, H, W)` lists the dimensions that take a size. Tiny weights (smoke runs, tests):
`save_tiny(folder, dimensions=...)` writes random weights of the dimensions under the reference names and
returns the reward's kwargs (`make_reward('vbench', **vbench.save_tiny(folder))`); for small frames pass
`dimensions=accepted_dimensions(F, H, W)`, which leaves motion_smoothness out below 113 pixels. It needs
the same packages as the reward (vbench's AMT-S network for motion_smoothness), not pyiqa.
"""
import functools
import importlib
import importlib.util
import logging
import math
import os
import sys
import types
import warnings

import numpy as np

from ddrl_jax.rewards import video_common

logger = logging.getLogger(__name__)

DIMENSIONS = ('subject_consistency', 'background_consistency', 'motion_smoothness', 'aesthetic_quality',
              'imaging_quality')
KEYS = ('mean',) + DIMENSIONS
# (file name, the sub-folder VBench's cache keeps it in) for each dimension.
WEIGHT_FILES = {
    'subject_consistency': (('dino_vitbase16_pretrain.pth', 'dino_model'),),
    'background_consistency': (('ViT-B-32.pt', 'clip_model'),),
    'motion_smoothness': (('amt-s.pth', 'amt_model'),),
    'aesthetic_quality': (('ViT-L-14.pt', 'clip_model'),
                          ('sa_0_4_vit_l_14_linear.pth', os.path.join('aesthetic_model', 'emb_reader'))),
    'imaging_quality': (('musiq_spaq_ckpt-358bb6af.pth', 'pyiqa_model'),),
}
MIN_FRAMES = {d: 2 for d in DIMENSIONS}
MIN_FRAMES['motion_smoothness'] = 3      # two even frames and the odd one between them
# AMT-S samples its coarsest correlation level (1/64 of the padded frame) dividing by (size - 1): a side
# padded to 64 or less gives NaN there (VBench would cast it to uint8 garbage), so sides must exceed 112.
MIN_SIDE = {d: 1 for d in DIMENSIONS}
MIN_SIDE['motion_smoothness'] = 113

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
INPUT_SIZE = 224              # DINO's short side; CLIP's short side and crop
HEAD_DIM = 64                 # width / heads of DINO ViT-B/16 and MUSIQ (not stored in the checkpoints)
DINO_EPS = 1e-6
AMT_DIVISOR = 16
AMT_NETWORK = 'vbench.third_party.amt.networks.AMT-S'
AMT_UTILS = 'vbench.third_party.amt.utils.utils'
AMT_CONFIG = dict(corr_radius=3, corr_lvls=4, num_flows=3)    # vbench/third_party/amt/cfgs/AMT-S.yaml
MUSIQ_MAX_SIDE = 512
MUSIQ_LONGER_SIDES = (224, 384)
MUSIQ_MASK_FILL = -1e3        # the reference fills masked attention logits with -1e3, not -inf
PIP = {'clip': 'pip install openai-clip==1.0.1', 'vbench': 'pip install --no-deps vbench==0.1.5'}


class WeightsError(ValueError):
  """A weights file that is there but cannot be used; the message is one line naming it and the dimension."""


# ---------------------------------------------------------------------------------------- imports
def import_submodule(name):
  """Imports `name` (e.g. 'clip.model') without running its top-level package's `__init__.py`.

  The `__init__` of `clip` and of `vbench` import torchvision (and vbench's decord) for code these rewards
  never call. The top package is stood in for by a bare module with the installed package's path while the
  submodule and its own imports load; the submodules stay registered under their real names.
  """
  top = name.split('.')[0]
  if top in sys.modules:
    return importlib.import_module(name)
  spec = importlib.util.find_spec(top)
  if spec is None or not spec.submodule_search_locations:
    raise ImportError(f'no module named {top!r}' + (f' ({PIP[top]})' if top in PIP else ''))
  stand_in = types.ModuleType(top)
  stand_in.__path__ = list(spec.submodule_search_locations)
  sys.modules[top] = stand_in
  try:
    return importlib.import_module(name)
  finally:
    if sys.modules.get(top) is stand_in:
      del sys.modules[top]


# ---------------------------------------------------------------------------------- preprocessing
def short_side_size(height, width, size=INPUT_SIZE):
  """(h, w) with the short side `size` and the long side scaled and truncated (torchvision's Resize(int))."""
  if width <= height:
    return int(size * height / width), size
  return size, int(size * width / height)


def center_crop_offsets(height, width, size=INPUT_SIZE):
  """(top, left) of torchvision's CenterCrop(size): half the excess, rounded half to even."""
  return int(round((height - size) / 2.0)), int(round((width - size) / 2.0))


def musiq_size(height, width, max_side=MUSIQ_MAX_SIDE):
  """(h, w) VBench's 'longer' mode feeds MUSIQ: unchanged unless the longer side exceeds max_side, else
  both sides scaled by max_side / longer side and truncated."""
  if max(height, width) <= max_side:
    return height, width
  scale = max_side / max(height, width)
  return int(scale * height), int(scale * width)


def frames_tensor(frames, device):
  """(F, H, W, 3) uint8 -> (F, 3, H, W) float32 torch tensor of 0..255 values on `device`."""
  import torch  # pylint: disable=g-import-not-at-top
  return torch.from_numpy(np.ascontiguousarray(frames)).to(device).permute(0, 3, 1, 2).float()


def resize(x, size, mode):
  """(N, C, H, W) float -> (N, C, *size): torch interpolation without antialiasing or clamping (torchvision's
  Resize of a float tensor with antialias=False); unchanged when already that size."""
  import torch  # pylint: disable=g-import-not-at-top
  if tuple(x.shape[-2:]) == tuple(size):
    return x
  return torch.nn.functional.interpolate(x, size=tuple(size), mode=mode, align_corners=False,
                                         antialias=False)


def normalize(x, mean, std):
  """(N, 3, H, W) -> (x - mean) / std per channel."""
  m = x.new_tensor(mean).view(1, 3, 1, 1)
  s = x.new_tensor(std).view(1, 3, 1, 1)
  return (x - m) / s


def dino_inputs(x):
  """(F, 3, H, W) float 0..255 -> DINO's input: short side 224 (bilinear), /255, ImageNet mean/std."""
  x = resize(x, short_side_size(*x.shape[-2:]), 'bilinear')
  return normalize(x / 255.0, IMAGENET_MEAN, IMAGENET_STD)


def clip_inputs(x):
  """(F, 3, H, W) float 0..255 -> (F, 3, 224, 224) CLIP input: short side 224 (bicubic), centre crop, /255,
  CLIP mean/std."""
  x = resize(x, short_side_size(*x.shape[-2:]), 'bicubic')
  top, left = center_crop_offsets(*x.shape[-2:])
  x = x[..., top:top + INPUT_SIZE, left:left + INPUT_SIZE]
  return normalize(x / 255.0, CLIP_MEAN, CLIP_STD)


def musiq_inputs(x):
  """(F, 3, H, W) float 0..255 -> MUSIQ's input in [0, 1], longer side at most 512 (bilinear)."""
  return resize(x, musiq_size(*x.shape[-2:]), 'bilinear') / 255.0


def batches(x, size):
  """Consecutive chunks of at most `size` rows of x."""
  return [x[i:i + size] for i in range(0, x.shape[0], size)]


# ------------------------------------------------------------------------------------ consistency
def consistency(features):
  """VBench's consistency of one video from its (F, D) frame features (F >= 2): the features are
  L2-normalised; each frame i >= 1 scores (max(0, cos(f_{i-1}, f_i)) + max(0, cos(f_0, f_i))) / 2; the
  mean over the F - 1 frames. The cosines are taken in the features' dtype, as the reference does."""
  import torch  # pylint: disable=g-import-not-at-top
  f = torch.nn.functional.normalize(features, dim=-1, p=2)
  cos = torch.nn.functional.cosine_similarity
  previous = cos(f[:-1], f[1:], dim=-1).double().cpu().numpy()
  first = cos(f[:1].expand_as(f[1:]), f[1:], dim=-1).double().cpu().numpy()
  return float(np.mean((np.maximum(previous, 0.0) + np.maximum(first, 0.0)) / 2))


# ------------------------------------------------------------------------------------ transformer
def attention(q, k, v, heads, mask=None):
  """Softmax attention of (B, N, D) queries, keys, values split into `heads`; mask (B, N) of 0/1 sets
  the logits between any masked token and any other to MUSIQ_MASK_FILL. -> (B, N, D)."""
  b, n, d = q.shape
  split = lambda t: t.reshape(b, n, heads, d // heads).permute(0, 2, 1, 3)
  q, k, v = split(q), split(k), split(v)
  logits = (q @ k.transpose(-2, -1)) * (d // heads)**-0.5
  if mask is not None:
    pair = mask.reshape(b, 1, n, 1) * mask.reshape(b, 1, 1, n)
    logits = logits.masked_fill(pair == 0, MUSIQ_MASK_FILL)
  return (logits.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, d)


def layer_norm(x, p, name, eps):
  import torch  # pylint: disable=g-import-not-at-top
  return torch.nn.functional.layer_norm(x, x.shape[-1:], p[f'{name}.weight'], p[f'{name}.bias'], eps)


def linear(x, p, name):
  import torch  # pylint: disable=g-import-not-at-top
  return torch.nn.functional.linear(x, p[f'{name}.weight'], p.get(f'{name}.bias'))


def mlp(x, p, name):
  import torch  # pylint: disable=g-import-not-at-top
  return linear(torch.nn.functional.gelu(linear(x, p, f'{name}.fc1')), p, f'{name}.fc2')


# ------------------------------------------------------------------------------------------- DINO
def dino_pos_embed(pos_embed, height, width, patch):
  """DINO's positional embedding (1, 1 + rows * cols, D) for a height x width input, from the stored
  (1, 1 + n, D) square grid: unchanged for the stored square size, else the grid is resized bicubically
  with scale factors ((height // patch + 0.1) / sqrt(n), (width // patch + 0.1) / sqrt(n)). The 0.1 keeps
  floor(sqrt(n) * scale) from falling one short; since the scale (not the size) sets the sampling
  positions, it also shifts them slightly."""
  import torch  # pylint: disable=g-import-not-at-top
  n = pos_embed.shape[1] - 1
  rows, cols = height // patch, width // patch
  if rows * cols == n and height == width:
    return pos_embed
  side = int(math.sqrt(n))
  grid = pos_embed[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
  grid = torch.nn.functional.interpolate(grid, scale_factor=((rows + 0.1) / side, (cols + 0.1) / side),
                                         mode='bicubic')
  if tuple(grid.shape[-2:]) != (rows, cols):
    raise ValueError(f'DINO positional grid {tuple(grid.shape[-2:])} for {height}x{width} inputs')
  grid = grid.permute(0, 2, 3, 1).reshape(1, rows * cols, -1)
  return torch.cat([pos_embed[:, :1], grid], dim=1)


def dino_depth(params):
  return len({k.split('.')[1] for k in params if k.startswith('blocks.')})


def dino_features(params, x):
  """(B, 3, H, W) normalised frames -> (B, D) DINO CLS features after the final norm."""
  import torch  # pylint: disable=g-import-not-at-top
  kernel = params['patch_embed.proj.weight']
  patch, dim = kernel.shape[-1], kernel.shape[0]
  heads = dim // HEAD_DIM
  t = torch.nn.functional.conv2d(x, kernel, params['patch_embed.proj.bias'], stride=patch)
  t = t.flatten(2).transpose(1, 2)
  t = torch.cat([params['cls_token'].expand(x.shape[0], -1, -1), t], dim=1)
  t = t + dino_pos_embed(params['pos_embed'], x.shape[-2], x.shape[-1], patch)
  for i in range(dino_depth(params)):
    name = f'blocks.{i}'
    y = layer_norm(t, params, f'{name}.norm1', DINO_EPS)
    q, k, v = linear(y, params, f'{name}.attn.qkv').chunk(3, dim=-1)
    t = t + linear(attention(q, k, v, heads), params, f'{name}.attn.proj')
    t = t + mlp(layer_norm(t, params, f'{name}.norm2', DINO_EPS), params, f'{name}.mlp')
  return layer_norm(t, params, 'norm', DINO_EPS)[:, 0]


DINO_KEYS = ('cls_token', 'pos_embed', 'patch_embed.proj.weight', 'patch_embed.proj.bias', 'norm.weight',
             'norm.bias')


# ------------------------------------------------------------------------------------------ MUSIQ
def hashed_positions(grid, count_h, count_w):
  """(count_h * count_w,) float indices into MUSIQ's grid x grid spatial embedding, row-major: each patch
  row and column is mapped onto the grid by nearest-neighbour resampling (torch's 'nearest')."""
  import torch  # pylint: disable=g-import-not-at-top
  g = torch.arange(grid, dtype=torch.float32).view(1, 1, grid)
  rows = torch.nn.functional.interpolate(g, size=count_h, mode='nearest').view(-1)
  cols = torch.nn.functional.interpolate(g, size=count_w, mode='nearest').view(-1)
  return (rows[:, None] * grid + cols[None, :]).reshape(-1)


def scale_tokens(x, patch, grid, scale_id, max_len=None):
  """(B, 3, H, W) -> (B, L, 3 * patch**2 + 3): the image cut into patch x patch tiles after TF 'SAME' zero
  padding (split evenly, the odd pixel after), each flattened channel-first, then its hashed position, the
  scale id and 1 (valid). With max_len, zero rows are appended (or tiles dropped) to exactly max_len."""
  import torch  # pylint: disable=g-import-not-at-top
  b, c, h, w = x.shape
  count_h, count_w = math.ceil(h / patch), math.ceil(w / patch)
  pad_h, pad_w = count_h * patch - h, count_w * patch - w
  x = torch.nn.functional.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
  tiles = x.reshape(b, c, count_h, patch, count_w, patch).permute(0, 2, 4, 1, 3, 5)
  tiles = tiles.reshape(b, count_h * count_w, c * patch * patch)
  pos = hashed_positions(grid, count_h, count_w).to(x)
  extra = torch.stack([pos, torch.full_like(pos, scale_id), torch.ones_like(pos)], dim=-1)
  tokens = torch.cat([tiles, extra.expand(b, -1, -1)], dim=-1)
  if max_len is not None:
    tokens = torch.nn.functional.pad(tokens, (0, 0, 0, max(0, max_len - tokens.shape[1])))[:, :max_len]
  return tokens


def musiq_tokens(x, patch=32, grid=10, longer_sides=MUSIQ_LONGER_SIDES):
  """(B, 3, H, W) in [-1, 1] -> (B, L, 3 * patch**2 + 3) multi-scale tokens: for each longer side s
  (ascending; scale ids 0, 1, ...) the image resized bicubically to round(H s / max) x round(W s / max),
  padded to ceil(s / patch)**2 tokens; then the original image, all its tiles, with the last scale id."""
  import torch  # pylint: disable=g-import-not-at-top
  h, w = x.shape[-2:]
  parts = []
  for scale_id, side in enumerate(sorted(longer_sides)):
    ratio = side / max(h, w)
    size = (round(h * ratio), round(w * ratio))
    resized = torch.nn.functional.interpolate(x, size=size, mode='bicubic', align_corners=False)
    parts.append(scale_tokens(resized, patch, grid, scale_id, math.ceil(side / patch)**2))
  parts.append(scale_tokens(x, patch, grid, len(longer_sides)))
  return torch.cat(parts, dim=1)


def same_pad(x, kernel, stride):
  """TF 'SAME' zero padding of (N, C, H, W) for a square kernel (the odd pixel goes after)."""
  import torch  # pylint: disable=g-import-not-at-top
  pads = []
  for size in (x.shape[-1], x.shape[-2]):
    total = (math.ceil(size / stride) - 1) * stride + kernel - size
    pads += [total // 2, total - total // 2]
  return torch.nn.functional.pad(x, pads)


def standardized(weight):
  """Weight standardisation of a conv kernel (O, I, kh, kw): zero mean, unit (unbiased) std + 1e-5."""
  weight = weight - weight.mean((1, 2, 3), keepdim=True)
  return weight / (weight.std((1, 2, 3), keepdim=True) + 1e-5)


def std_conv(x, params, name, stride=1):
  import torch  # pylint: disable=g-import-not-at-top
  kernel = params[f'{name}.weight:standardized']
  return torch.nn.functional.conv2d(same_pad(x, kernel.shape[-1], stride), kernel, None, stride)


def group_norm(x, params, name, eps):
  import torch  # pylint: disable=g-import-not-at-top
  return torch.nn.functional.group_norm(x, 32, params[f'{name}.weight'], params[f'{name}.bias'], eps)


def musiq_stem(params, tiles):
  """(N, 3, p, p) tiles -> (N, 4 * 64, p / 4, p / 4): the weight-standardised ResNet root, max-pool and one
  bottleneck block with projection (GroupNorm(32) everywhere)."""
  import torch  # pylint: disable=g-import-not-at-top
  relu = torch.relu
  x = relu(group_norm(std_conv(tiles, params, 'conv_root', 2), params, 'gn_root', 1e-6))
  x = torch.nn.functional.max_pool2d(same_pad(x, 3, 2), 3, 2)
  shortcut = group_norm(std_conv(x, params, 'block1.conv_proj'), params, 'block1.gn_proj', 1e-4)
  y = relu(group_norm(std_conv(x, params, 'block1.conv1'), params, 'block1.gn1', 1e-4))
  y = relu(group_norm(std_conv(y, params, 'block1.conv2'), params, 'block1.gn2', 1e-4))
  y = group_norm(std_conv(y, params, 'block1.conv3'), params, 'block1.gn3', 1e-4)
  return relu(y + shortcut)


def musiq_config(params):
  """The architecture a MUSIQ state dict holds: patch, hidden, layers, heads, grid, scales, classes."""
  stem_out = params['block1.conv3.weight'].shape[0]
  hidden, flat = params['embedding.weight'].shape
  token_patch = int(round(math.sqrt(flat / stem_out)))
  prefix = 'transformer_encoder.transformer.encoderblock_'
  return dict(
      patch=4 * token_patch, hidden=hidden, heads=hidden // HEAD_DIM,
      layers=len({k[len(prefix):].split('.')[0] for k in params if k.startswith(prefix)}),
      grid=int(round(math.sqrt(params['transformer_encoder.posembed_input.position_emb'].shape[1]))),
      scales=params['transformer_encoder.scaleembed_input.scale_emb'].shape[0],
      classes=musiq_head(params)[0].shape[0])


def musiq_head(params):
  """(weight, bias) of MUSIQ's head (a Linear, or Linear + Softmax saved as `head.0`)."""
  name = 'head' if 'head.weight' in params else 'head.0'
  return params[f'{name}.weight'], params[f'{name}.bias']


def musiq_scores(params, cfg, x):
  """(B, 3, H, W) frames in [0, 1] -> (B,) MUSIQ mean opinion scores."""
  import torch  # pylint: disable=g-import-not-at-top
  tokens = musiq_tokens((x - 0.5) * 2, cfg['patch'], cfg['grid'], MUSIQ_LONGER_SIDES)
  b, n, _ = tokens.shape
  positions, scale_ids, mask = tokens[..., -3].long(), tokens[..., -2].long(), tokens[..., -1]
  tiles = tokens[..., :-3].reshape(b * n, 3, cfg['patch'], cfg['patch'])
  feats = musiq_stem(params, tiles).permute(0, 2, 3, 1).reshape(b, n, -1)   # channels last, as TF
  enc = 'transformer_encoder'
  t = linear(feats, params, 'embedding')
  t = t + params[f'{enc}.posembed_input.position_emb'][0][positions]
  t = t + params[f'{enc}.scaleembed_input.scale_emb'][scale_ids]
  t = torch.cat([params[f'{enc}.cls'].expand(b, -1, -1), t], dim=1)
  mask = torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)
  for i in range(cfg['layers']):
    name = f'{enc}.transformer.encoderblock_{i}'
    y = layer_norm(t, params, f'{name}.norm1', 1e-6)
    q, k, v = (linear(y, params, f'{name}.attention.{part}') for part in ('query', 'key', 'value'))
    t = t + linear(attention(q, k, v, cfg['heads'], mask), params, f'{name}.attention.out')
    t = t + mlp(layer_norm(t, params, f'{name}.norm2', 1e-6), params, f'{name}.mlp')
  t = layer_norm(t, params, f'{enc}.encoder_norm', 1e-6)
  q = torch.nn.functional.linear(t[:, 0], *musiq_head(params))
  if cfg['classes'] == 1:
    return q[:, 0]
  bins = torch.arange(1, cfg['classes'] + 1, dtype=q.dtype, device=q.device)
  return (q.softmax(dim=-1) * bins).sum(dim=-1)


MUSIQ_STD_CONVS = ('conv_root', 'block1.conv1', 'block1.conv2', 'block1.conv3', 'block1.conv_proj')


# ---------------------------------------------------------------------------------------- weights
def default_weights_dir():
  """VBench's own weights cache: $VBENCH_CACHE_DIR, else ~/.cache/vbench."""
  return os.environ.get('VBENCH_CACHE_DIR') or os.path.join(os.path.expanduser('~'), '.cache', 'vbench')


def weight_paths(dimension, weights_dir):
  """The dimension's weights files in weights_dir (flat or VBench's cache layout); FileNotFoundError with
  a one-line message naming the first one missing."""
  paths = []
  for name, subdir in WEIGHT_FILES[dimension]:
    candidates = [os.path.join(weights_dir, name), os.path.join(weights_dir, subdir, name)]
    found = [p for p in candidates if os.path.isfile(p)]
    if not found:
      raise FileNotFoundError(f'vbench {dimension}: weights file {name} not found in {weights_dir} '
                              f'(nor in {os.path.join(weights_dir, subdir)})')
    paths.append(found[0])
  return tuple(paths)


def input_problems(kwargs, dimensions=None):
  """One-line problems with the weights files VBenchReward(**kwargs) (or one dimension's reward) needs,
  found without loading them."""
  dimensions = dimensions or kwargs.get('dimensions') or DIMENSIONS
  dimensions = (dimensions,) if isinstance(dimensions, str) else tuple(dimensions)
  weights_dir = os.path.abspath(os.path.expanduser(kwargs.get('weights_dir') or default_weights_dir()))
  problems = []
  for dimension in dimensions:
    if dimension not in DIMENSIONS:
      problems.append(f'vbench: unknown dimension {dimension!r}; known: {DIMENSIONS}')
      continue
    try:
      weight_paths(dimension, weights_dir)
    except FileNotFoundError as e:
      problems.append(str(e) + ' (config.reward.kwargs.<reward>.weights_dir)')
  return problems


def _unusable(dimension, path, what):
  return WeightsError(f'vbench {dimension}: {path} {what}')


def read_checkpoint(path, dimension):
  """torch.load of a weights file on CPU (tensors only first; full unpickling, as the reference loaders
  do, only for a file that holds other objects). WeightsError when it cannot be read."""
  import torch  # pylint: disable=g-import-not-at-top
  try:
    try:
      return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # pylint: disable=broad-except
      if 'weights_only' not in str(e):
        raise
      return torch.load(path, map_location='cpu', weights_only=False)
  except Exception as e:  # pylint: disable=broad-except  (truncated zip, bad pickle, ...)
    raise _unusable(dimension, path, f'cannot be read, truncated? ({video_common.describe(e)})') from e


def tensor_dict(state, path, dimension, required=()):
  """{name: tensor} of a loaded state dict (a 'module.' prefix dropped); WeightsError if it is not one or
  lacks a required key."""
  import torch  # pylint: disable=g-import-not-at-top
  if not isinstance(state, dict) or not state:
    raise _unusable(dimension, path, f'is not a state dict (got {type(state).__name__})')
  out = {}
  for k, v in state.items():
    if isinstance(v, torch.Tensor):
      out[k[len('module.'):] if k.startswith('module.') else k] = v
  missing = [k for k in required if k not in out]
  if missing:
    raise _unusable(dimension, path, f'is not the expected checkpoint: no {missing[0]!r} '
                    f'({len(out)} tensors, e.g. {next(iter(out), None)!r})')
  return out


def load_dino(path, device, dimension='subject_consistency'):
  params = tensor_dict(read_checkpoint(path, dimension), path, dimension, DINO_KEYS)
  return {k: v.float().to(device) for k, v in params.items()}


def load_clip(path, device, dimension):
  """OpenAI CLIP from a JIT archive (or a plain state dict) as clip.load(jit=False) builds it: fp16
  weights, cast to float32 on CPU."""
  import torch  # pylint: disable=g-import-not-at-top
  clip_model = import_submodule('clip.model')
  try:
    with warnings.catch_warnings():    # TorchScript's deprecation notice: the released files are TorchScript
      warnings.simplefilter('ignore', DeprecationWarning)
      state = torch.jit.load(path, map_location='cpu').state_dict()
  except Exception:  # pylint: disable=broad-except  (not a TorchScript archive: clip.load's fallback)
    state = read_checkpoint(path, dimension)
  state = tensor_dict(state, path, dimension, ('visual.proj', 'text_projection'))
  try:
    model = clip_model.build_model(dict(state)).to(device)
  except (KeyError, RuntimeError, ValueError, IndexError) as e:
    raise _unusable(dimension, path, f'is not an OpenAI CLIP checkpoint ({video_common.describe(e)})') from e
  if torch.device(device).type == 'cpu':
    model.float()
  return model.eval()


def load_aesthetic(clip_path, head_path, device, dimension='aesthetic_quality'):
  """(CLIP ViT-L/14, (weight (1, D), bias (1,)) of the LAION v1 linear head) on device, float32 head."""
  model = load_clip(clip_path, device, dimension)
  head = tensor_dict(read_checkpoint(head_path, dimension), head_path, dimension, ('weight', 'bias'))
  weight, bias = head['weight'].float().to(device), head['bias'].float().to(device)
  dim = model.visual.output_dim
  if weight.shape != (1, dim) or bias.shape != (1,):
    raise _unusable(dimension, head_path, f'holds a head of shape {tuple(weight.shape)}, not (1, {dim}) '
                    'for this CLIP')
  return model, (weight, bias)


def load_amt(path, device, dimension='motion_smoothness'):
  """VBench's AMT-S network with `ckpt['state_dict']`, in eval mode on device."""
  network = import_submodule(AMT_NETWORK)
  model = network.Model(**AMT_CONFIG)
  ckpt = read_checkpoint(path, dimension)
  if not isinstance(ckpt, dict) or 'state_dict' not in ckpt:
    raise _unusable(dimension, path, "has no 'state_dict' entry (AMT checkpoints keep the weights there)")
  try:
    model.load_state_dict(tensor_dict(ckpt['state_dict'], path, dimension))
  except RuntimeError as e:
    raise _unusable(dimension, path, f'does not fit AMT-S ({video_common.first_line(e)})') from e
  return model.to(device).eval()


def load_musiq(path, device, dimension='imaging_quality'):
  """(params with standardised conv kernels, config) of a MUSIQ state dict, float32 on device."""
  params = tensor_dict(read_checkpoint(path, dimension), path, dimension,
                       ('embedding.weight', 'block1.conv3.weight', 'transformer_encoder.cls',
                        'transformer_encoder.posembed_input.position_emb',
                        'transformer_encoder.scaleembed_input.scale_emb'))
  params = {k: v.float().to(device) for k, v in params.items()}
  cfg = musiq_config(params)
  if cfg['scales'] != len(MUSIQ_LONGER_SIDES) + 1:
    raise _unusable(dimension, path, f"has {cfg['scales']} scale embeddings; MUSIQ here uses "
                    f'{len(MUSIQ_LONGER_SIDES) + 1} (longer sides {MUSIQ_LONGER_SIDES} and the original)')
  for name in MUSIQ_STD_CONVS:   # the kernels are standardised on every call in the reference: once here
    params[f'{name}.weight:standardized'] = standardized(params[f'{name}.weight'])
  return params, cfg


@functools.lru_cache(maxsize=None)
def shared_model(dimension, paths, device):
  """The dimension's model(s) loaded from `paths` on `device`, once per process."""
  if dimension == 'subject_consistency':
    return load_dino(paths[0], device)
  if dimension == 'background_consistency':
    return load_clip(paths[0], device, dimension)
  if dimension == 'motion_smoothness':
    return load_amt(paths[0], device)
  if dimension == 'aesthetic_quality':
    return load_aesthetic(paths[0], paths[1], device)
  if dimension == 'imaging_quality':
    return load_musiq(paths[0], device)
  raise ValueError(f'vbench: unknown dimension {dimension!r}; known: {DIMENSIONS}')


# -------------------------------------------------------------------------------- per-video scores
def subject_consistency(params, frames, device, batch_size=32):
  """(F, H, W, 3) uint8 -> VBench subject consistency (DINO CLS features)."""
  import torch  # pylint: disable=g-import-not-at-top
  x = dino_inputs(frames_tensor(frames, device))
  return consistency(torch.cat([dino_features(params, b) for b in batches(x, batch_size)]))


def background_consistency(model, frames, device, batch_size=32):
  """(F, H, W, 3) uint8 -> VBench background consistency (CLIP ViT-B/32 image features)."""
  import torch  # pylint: disable=g-import-not-at-top
  x = clip_inputs(frames_tensor(frames, device))
  return consistency(torch.cat([model.encode_image(b) for b in batches(x, batch_size)]))


def aesthetic_quality(model_and_head, frames, device, batch_size=32):
  """(F, H, W, 3) uint8 -> VBench aesthetic quality: the mean over frames of the LAION v1 head on the
  normalised float32 CLIP ViT-L/14 features, /10."""
  import torch  # pylint: disable=g-import-not-at-top
  model, (weight, bias) = model_and_head
  scores = []
  for b in batches(clip_inputs(frames_tensor(frames, device)), batch_size):
    feats = torch.nn.functional.normalize(model.encode_image(b).to(torch.float32), dim=-1, p=2)
    scores.append(torch.nn.functional.linear(feats, weight, bias).squeeze(-1))
  return float(torch.mean(torch.cat(scores) / 10))


def imaging_quality(params_and_cfg, frames, device, batch_size=32):
  """(F, H, W, 3) uint8 -> VBench imaging quality: the mean over frames of MUSIQ's MOS, /100."""
  import torch  # pylint: disable=g-import-not-at-top
  params, cfg = params_and_cfg
  x = musiq_inputs(frames_tensor(frames, device))
  mos = torch.cat([musiq_scores(params, cfg, b) for b in batches(x, batch_size)])
  return float(np.mean(mos.double().cpu().numpy())) / 100.0


def amt_midpoints(model, frames, device):
  """(F, H, W, 3) uint8 -> (ceil(F / 2) - 1, H, W, 3) uint8: AMT-S's midpoint of each pair of consecutive
  even frames (0 and 2, 2 and 4, ...), padded to multiples of 16 for the network and cropped back."""
  import torch  # pylint: disable=g-import-not-at-top
  utils = import_submodule(AMT_UTILS)
  evens = [utils.img2tensor(f).to(device) for f in frames[0::2]]
  padder = utils.InputPadder(evens[0].shape, AMT_DIVISOR)
  evens = [padder.pad(e) for e in evens]
  embt = torch.tensor(0.5, dtype=torch.float32, device=device).view(1, 1, 1, 1)
  mids = []
  for a, b in zip(evens[:-1], evens[1:]):
    pred = model(a, b, embt, scale_factor=1.0, eval=True)['imgt_pred']
    if not bool(torch.isfinite(pred).all()):
      raise RuntimeError(f'AMT-S predicted non-finite pixels for {tuple(frames.shape)} frames')
    mids.append(utils.tensor2img(padder.unpad(pred)))
  return np.stack(mids)


def motion_smoothness(model, frames, device, batch_size=None):
  """(F, H, W, 3) uint8, F >= 3 -> VBench motion smoothness: (255 - mean |midpoint - real odd frame|) / 255,
  each odd frame against AMT-S's midpoint of the even frames around it."""
  del batch_size    # one pair per forward pass, as the reference
  mids = amt_midpoints(model, frames, device)
  odd = frames[1::2][:len(mids)]     # an even F leaves the last odd frame without a pair
  diffs = [np.abs(m.astype(np.int16) - o.astype(np.int16)).mean() for m, o in zip(mids, odd)]
  return (255.0 - float(np.mean(diffs))) / 255.0


SCORERS = {
    'subject_consistency': subject_consistency,
    'background_consistency': background_consistency,
    'motion_smoothness': motion_smoothness,
    'aesthetic_quality': aesthetic_quality,
    'imaging_quality': imaging_quality,
}


# ----------------------------------------------------------------------------------------- reward
def check_videos(samples, prompts, dimensions):
  """`samples` as an array after checking it is (M, F, H, W, 3) uint8 with enough frames for `dimensions`
  (and M prompts when prompts are given)."""
  return video_common.check_videos(samples, prompts, 'vbench', max(MIN_FRAMES[d] for d in dimensions),
                                   max(MIN_SIDE[d] for d in dimensions),
                                   label=f'vbench ({", ".join(dimensions)})', prompts_optional=True)


class VBenchReward:
  """reward(samples, prompts) -> (M,) float32 VBench scores of (M, F, H, W, 3) uint8 videos.

  Args:
    dimensions: which of DIMENSIONS to compute (default all five; the DDRL paper's reward is their mean).
    weights_dir: the folder with the reference weights files (see the module docstring); default VBench's
      cache ($VBENCH_CACHE_DIR or ~/.cache/vbench). Missing files raise FileNotFoundError here; the models
      load on first use, once per process.
    device: torch device for every model ('cpu', 'cuda', 'cuda:1', ...). On CUDA the CLIP models run in
      fp16 as in VBench; on CPU everything is float32.
    key: the column returned by __call__: 'mean' (of `dimensions`) or one of them.
    batch_size: frames per forward pass of DINO, CLIP and MUSIQ (AMT-S runs one frame pair at a time).
  A video whose scoring raises gets NaN in that dimension (and so in 'mean'), with a logged warning.
  `scores` returns every column, for evaluation tables. `prompts` are not used by any dimension.
  """

  def __init__(self, dimensions=DIMENSIONS, weights_dir=None, device='cpu', key='mean', batch_size=32):
    if isinstance(dimensions, str):
      dimensions = (dimensions,)
    self.dimensions = tuple(dimensions)
    unknown = [d for d in self.dimensions if d not in DIMENSIONS]
    if unknown or not self.dimensions or len(set(self.dimensions)) != len(self.dimensions):
      raise ValueError(f'vbench: dimensions {self.dimensions}; choose distinct ones of {DIMENSIONS}')
    video_common.check_options(key, ('mean',) + self.dimensions, batch_size, 'vbench')
    self.key, self.device, self.batch_size = key, str(device), int(batch_size)
    self.weights_dir = os.path.abspath(os.path.expanduser(weights_dir or default_weights_dir()))
    self.paths = {d: weight_paths(d, self.weights_dir) for d in self.dimensions}

  def model(self, dimension):
    return shared_model(dimension, self.paths[dimension], self.device)

  def scores(self, samples, prompts=None):
    """{'mean' and each dimension: (M,) float32} for (M, F, H, W, 3) uint8 videos; NaN where a video
    could not be scored."""
    samples = check_videos(samples, prompts, self.dimensions)
    out = {dimension: self._column(dimension, samples) for dimension in self.dimensions}
    out['mean'] = np.mean([out[d] for d in self.dimensions], axis=0)
    return {k: v.astype(np.float32) for k, v in out.items()}

  def _column(self, dimension, samples):
    """(M,) float64 scores of one dimension for (M, F, H, W, 3) samples, one video at a time under
    torch.no_grad; NaN, with a logged warning, for a video whose scoring raises."""
    import torch  # pylint: disable=g-import-not-at-top
    model = self.model(dimension)      # a weights problem raises here, for every video alike

    def score(i):
      with torch.no_grad():
        return SCORERS[dimension](model, samples[i], self.device, self.batch_size)

    warn = lambda i, e: video_common.warn_unscored(logger, f'vbench {dimension}', i, e, 'score')
    return video_common.score_each(np.full((samples.shape[0],), np.nan), range(samples.shape[0]), score,
                                   warn)

  def __call__(self, samples, prompts):
    return self.scores(samples, prompts)[self.key]


def _one_dimension(dimension):
  def factory(**kwargs):
    return VBenchReward(dimensions=(dimension,), key=dimension, **kwargs)
  factory.__name__ = factory.__qualname__ = ''.join(p.title() for p in dimension.split('_'))
  factory.__doc__ = f'VBenchReward of {dimension} alone (same keyword arguments, less dimensions and key).'
  return factory


SubjectConsistency = _one_dimension('subject_consistency')
BackgroundConsistency = _one_dimension('background_consistency')
MotionSmoothness = _one_dimension('motion_smoothness')
AestheticQuality = _one_dimension('aesthetic_quality')
ImagingQuality = _one_dimension('imaging_quality')


# ------------------------------------------------------------------------------------------ tiny weights
# Tiny random weights in the reference files' formats, for smoke runs and tests (see `save_tiny`).
TINY_DINO = dict(dim=128, depth=2)                       # 2 heads of HEAD_DIM
TINY_CLIP = dict(embed_dim=32, image_resolution=INPUT_SIZE, vision_layers=1, vision_width=64,
                 context_length=8, vocab_size=100, transformer_width=64, transformer_heads=1,
                 transformer_layers=1)
TINY_CLIP_PATCH = {'background_consistency': 32, 'aesthetic_quality': 14}    # ViT-B/32, ViT-L/14
# MUSIQ: 2 heads of HEAD_DIM; a stem half the reference's width (pyiqa fixes it at 64, its resnet_token_dim):
# the stem runs on every pixel of the 224- and 384-side rescalings whatever the frame size, and at width 64
# it alone takes ~0.2 s per frame on a CPU core, at 32 (GroupNorm's 32 groups allow no less) ~0.05 s.
TINY_MUSIQ = dict(hidden=128, mlp_dim=256, layers=2, stem=32)


def accepted_dimensions(frames, height, width, dimensions=DIMENSIONS):
  """The dimensions (of `dimensions`, in order) that score videos of frames x height x width: every one
  takes F >= 2 frames of any size except motion_smoothness, which needs F >= 3 and H, W >= 113 (AMT-S).
  E.g. smoke runs on 32 x 32 videos: VBenchReward(dimensions=accepted_dimensions(5, 32, 32), ...)."""
  return tuple(d for d in dimensions
               if frames >= MIN_FRAMES[d] and min(height, width) >= MIN_SIDE[d])


def tiny_dino_state(seed=0, dim=TINY_DINO['dim'], depth=TINY_DINO['depth']):
  """A DINO ViT state dict (patch 16, 14 x 14 positional grid, as dino_vitbase16_pretrain.pth) of width
  `dim` and `depth` blocks with random weights."""
  import torch  # pylint: disable=g-import-not-at-top
  g = torch.Generator().manual_seed(seed)
  r = lambda *s, std=0.05: torch.randn(*s, generator=g) * std
  d = dim
  state = {'cls_token': r(1, 1, d, std=0.5), 'pos_embed': r(1, 197, d, std=0.5),
           'patch_embed.proj.weight': r(d, 3, 16, 16, std=0.03), 'patch_embed.proj.bias': r(d),
           'norm.weight': 1 + r(d), 'norm.bias': r(d)}
  for i in range(depth):
    b = f'blocks.{i}.'
    state.update({b + 'norm1.weight': 1 + r(d), b + 'norm1.bias': r(d), b + 'attn.qkv.weight': r(3 * d, d),
                  b + 'attn.qkv.bias': r(3 * d), b + 'attn.proj.weight': r(d, d), b + 'attn.proj.bias': r(d),
                  b + 'norm2.weight': 1 + r(d), b + 'norm2.bias': r(d), b + 'mlp.fc1.weight': r(4 * d, d),
                  b + 'mlp.fc1.bias': r(4 * d), b + 'mlp.fc2.weight': r(d, 4 * d), b + 'mlp.fc2.bias': r(d)})
  return state


def tiny_clip(patch, seed=0):
  """An OpenAI CLIP (clip.model.CLIP; 224 input, width 64, one layer per tower, embedding 32, vision patch
  `patch`) with random weights that are fp16-exact, as the released archives' are (so clip's fp16 round
  trip changes nothing). Needs openai-clip."""
  import torch  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import tiny_models  # pylint: disable=g-import-not-at-top
  with tiny_models.seeded(seed):
    model = import_submodule('clip.model').CLIP(vision_patch_size=patch, **TINY_CLIP)
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(p.half().float())
  return model.eval()


def save_clip_archive(model, path):
  """Writes a CLIP as the released ViT-*.pt files are: a TorchScript archive (traced encode_image) whose
  state dict holds both towers."""
  import torch  # pylint: disable=g-import-not-at-top
  example = torch.zeros(1, 3, model.visual.input_resolution, model.visual.input_resolution)
  with warnings.catch_warnings():    # tracer and deprecation notes about TorchScript itself
    warnings.simplefilter('ignore')
    torch.jit.save(torch.jit.trace_module(model, {'encode_image': example}), path)


def musiq_shapes(hidden=TINY_MUSIQ['hidden'], mlp_dim=TINY_MUSIQ['mlp_dim'], layers=TINY_MUSIQ['layers'],
                 stem=TINY_MUSIQ['stem'], patch=32, grid=10, scales=len(MUSIQ_LONGER_SIDES) + 1, classes=1):
  """{name: shape} of a MUSIQ state dict as pyiqa's musiq_arch.MUSIQ lays it out (the SPAQ file's layout;
  the release: hidden 384, mlp_dim 1152, 14 layers, stem 64): the weight-standardised ResNet stem (root
  conv 7x7 and one bottleneck block of width `stem` with a 4 * stem projection, GroupNorm each), the patch
  embedding, the encoder (hashed grid x grid spatial and `scales` scale embeddings, CLS, pre-norm blocks)
  and the head (Linear; Linear + Softmax saved as `head.0` when classes > 1). The loader reads all of
  these sizes from the shapes (heads: hidden / 64)."""
  out = 4 * stem
  shapes = {'conv_root.weight': (stem, 3, 7, 7), 'gn_root.weight': (stem,), 'gn_root.bias': (stem,)}
  for name, (o, i, k) in {'conv1': (stem, stem, 1), 'conv2': (stem, stem, 3), 'conv3': (out, stem, 1),
                          'conv_proj': (out, stem, 1)}.items():
    norm = 'gn' + name[4:] if name != 'conv_proj' else 'gn_proj'
    shapes.update({f'block1.{name}.weight': (o, i, k, k), f'block1.{norm}.weight': (o,),
                   f'block1.{norm}.bias': (o,)})
  shapes.update({'embedding.weight': (hidden, out * (patch // 4)**2), 'embedding.bias': (hidden,)})
  enc = 'transformer_encoder'
  shapes.update({f'{enc}.posembed_input.position_emb': (1, grid * grid, hidden),
                 f'{enc}.scaleembed_input.scale_emb': (scales, hidden), f'{enc}.cls': (1, 1, hidden),
                 f'{enc}.encoder_norm.weight': (hidden,), f'{enc}.encoder_norm.bias': (hidden,)})
  for i in range(layers):
    b = f'{enc}.transformer.encoderblock_{i}'
    for norm in ('norm1', 'norm2'):
      shapes.update({f'{b}.{norm}.weight': (hidden,), f'{b}.{norm}.bias': (hidden,)})
    for part in ('query', 'key', 'value', 'out'):
      shapes.update({f'{b}.attention.{part}.weight': (hidden, hidden),
                     f'{b}.attention.{part}.bias': (hidden,)})
    shapes.update({f'{b}.mlp.fc1.weight': (mlp_dim, hidden), f'{b}.mlp.fc1.bias': (mlp_dim,),
                   f'{b}.mlp.fc2.weight': (hidden, mlp_dim), f'{b}.mlp.fc2.bias': (hidden,)})
  head = 'head' if classes == 1 else 'head.0'
  shapes.update({f'{head}.weight': (classes, hidden), f'{head}.bias': (classes,)})
  return shapes


def tiny_musiq_state(seed=0, **kwargs):
  """A random MUSIQ state dict of musiq_shapes(**kwargs) (default TINY_MUSIQ): Linear weights with std
  1 / sqrt(fan_in), norms' scales near 1, biases and embeddings of std 0.05, conv kernels standard normal
  (they are weight-standardised anyway); a one-class head's bias 50, so the MOS lands mid-scale (0-100)."""
  import torch  # pylint: disable=g-import-not-at-top
  g = torch.Generator().manual_seed(seed)
  state = {}
  for name, shape in musiq_shapes(**kwargs).items():
    x = torch.randn(*shape, generator=g)
    leaf = name.split('.')[-1]
    if leaf == 'bias' or leaf in ('position_emb', 'scale_emb', 'cls'):
      x = x * 0.05
    elif leaf == 'weight' and ('gn' in name or 'norm' in name):
      x = 1 + x * 0.05
    elif len(shape) == 2:
      x = x / math.sqrt(shape[1])
    if name == 'head.bias':
      x = x + 50.0
    state[name] = x
  return state


def save_tiny(folder, seed=0, dimensions=DIMENSIONS):
  """Writes random weights of each of `dimensions` to `folder` under the reference file names and
  returns the VBenchReward keyword arguments that load them: {'weights_dir': folder, 'dimensions': ...}.

  Files: dino_vitbase16_pretrain.pth (a width-128, 2-block DINO), ViT-B-32.pt and ViT-L-14.pt (TorchScript
  CLIPs of width 64, one layer per tower), sa_0_4_vit_l_14_linear.pth (the Linear(32, 1) head for that
  CLIP), musiq_spaq_ckpt-358bb6af.pth (MUSIQ of width 128, 2 layers and a stem of width 32, in pyiqa's
  layout, see musiq_shapes and TINY_MUSIQ) flat in the folder, and amt_model/amt-s.pth (AMT-S at full
  size, ~3M parameters, in VBench's cache layout). Needs what the reward needs: torch, openai-clip and,
  for motion_smoothness, vbench's AMT-S network (`pip install --no-deps vbench==0.1.5`); not pyiqa.

  Sizes: motion_smoothness needs frames of at least 113 x 113 (and F >= 3); the other four score any
  F >= 2 video. Smoke runs on small frames leave it out: save_tiny(folder,
  dimensions=accepted_dimensions(F, H, W)) writes and returns only the dimensions that accept F x H x W
  videos. On one CPU core a (4, 5, 32, 32, 3) batch scores in ~1.6 s with the other four (MUSIQ's stem on
  its fixed 224- and 384-side rescalings takes most of it, whatever the frame size); all five score a
  (4, 5, 113, 113, 3) batch in ~2.5 s."""
  import torch  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import tiny_models  # pylint: disable=g-import-not-at-top
  if isinstance(dimensions, str):
    dimensions = (dimensions,)
  dimensions = tuple(dimensions)
  unknown = [d for d in dimensions if d not in DIMENSIONS]
  if unknown or not dimensions:
    raise ValueError(f'vbench save_tiny: dimensions {dimensions}; choose of {DIMENSIONS}')
  os.makedirs(folder, exist_ok=True)
  path = lambda name: os.path.join(folder, name)
  if 'subject_consistency' in dimensions:
    torch.save(tiny_dino_state(seed), path('dino_vitbase16_pretrain.pth'))
  if 'background_consistency' in dimensions:
    save_clip_archive(tiny_clip(TINY_CLIP_PATCH['background_consistency'], seed + 1), path('ViT-B-32.pt'))
  if 'aesthetic_quality' in dimensions:
    save_clip_archive(tiny_clip(TINY_CLIP_PATCH['aesthetic_quality'], seed + 2), path('ViT-L-14.pt'))
    g = torch.Generator().manual_seed(seed + 3)
    head = {'weight': torch.randn(1, TINY_CLIP['embed_dim'], generator=g),
            'bias': torch.randn(1, generator=g)}
    torch.save(head, path('sa_0_4_vit_l_14_linear.pth'))
  if 'motion_smoothness' in dimensions:
    with tiny_models.seeded(seed + 4):
      amt = import_submodule(AMT_NETWORK).Model(**AMT_CONFIG)
    os.makedirs(path('amt_model'), exist_ok=True)
    torch.save({'state_dict': amt.state_dict(), 'epoch': 1}, os.path.join(folder, 'amt_model', 'amt-s.pth'))
  if 'imaging_quality' in dimensions:
    torch.save(tiny_musiq_state(seed + 5), path('musiq_spaq_ckpt-358bb6af.pth'))
  return {'weights_dir': os.path.abspath(folder), 'dimensions': dimensions}
