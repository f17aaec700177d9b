"""HPSv2.1 (Human Preference Score v2.1) image reward, run in PyTorch: the cosine of an image and its prompt
under the HPSv2.1 fine-tune of open_clip's CLIP ViT-H-14.

Reference: PyPI `hpsv2` 1.2.0 `hpsv2/img_score.py` with its vendored open_clip fork (`hpsv2/src/open_clip`),
as flow_grpo's `hpsv2_scorer.py` runs it (cosmos-rl's `model/hpsv2.py`: the same model, fp32, batched):
  weights   `HPS_v2.1_compressed.pt` of xswu/HPSv2: a torch checkpoint whose key 'state_dict' holds the state
            dict of open_clip's `create_model('ViT-H-14')`, loaded strictly (a plain state dict file is read
            too). Shapes: embed 1024; vision 224 px, patch 14, 32 layers, width 1280, head width 80 (16
            heads); text context 77, vocab 49408, width 1024, 16 heads, 24 layers; exact (erf) GELU, not
            QuickGELU; LayerNorm eps 1e-5. The HPSv2.0 file (HPS_v2_compressed.pt) has the same layout.
  pixels    the fork's eval transform with light_augmentation=True: ToTensor (uint8 / 255, float32) FIRST,
            then `ResizeMaxSize(224)` on that float tensor: the longer side scaled to 224, each side
            round(side * 224 / longer), torchvision's tensor resize (bicubic, antialiased as torchvision
            >= 0.17 does by default, no clamping of the bicubic overshoot), then zero padding to 224 x 224,
            centred (left / top get the floor of half the excess); then the OpenAI CLIP mean / std. No centre
            crop, and no PIL resize (the resize runs on the float tensor, so nothing is rounded to uint8).
            The fork skips resize and pad when the longer side is already 224; a non-square image of that
            size then reaches the model unpadded and fails there: here it is padded like any other.
  text      open_clip's SimpleTokenizer (the OpenAI CLIP BPE, 49408 tokens) at the context length 77: start
            token, BPE of the cleaned (ftfy, html-unescaped, whitespace-collapsed) lower-cased prompt, end
            token; truncated to 77 with the end token last; zero padded. open_clip names its special tokens
            <start_of_text> / <end_of_text> (OpenAI's: <|startoftext|> / <|endoftext|>, the same ids); its
            spelling is the one recognised inside a prompt here, as in the reference.
  score     forward returns L2-normalised image and text features; HPS = image . text of each (image, own
            prompt) pair, the diagonal of image_features @ text_features.T, NO logit scale: a cosine in
            [-1, 1] (about 0.2-0.35 on real images). The checkpoint's logit_scale is loaded and unused.

Why not open_clip itself: `open-clip-torch` needs torchvision (its transforms, and timm's), and the PyPI
torchvision wheels need a CUDA torch: beside the CPU torch this project pins (2.13.0+cpu) torchvision fails
at import. The `hpsv2` wheel also lacks the BPE vocabulary file its tokenizer opens at import
(`bpe_simple_vocab_16e6.txt.gz`), so `import hpsv2.src.open_clip` fails unless the file is copied in. So
the model here is a plain-torch re-implementation of open_clip's CLIP with its VisionTransformer (class
token, pre-norm residual attention blocks, ln_post on the class token, no attentional pooler, no global
average pool, no layer scale, no patch dropout) and TextTransformer (causal mask, ln_final, the features at
the end token = the argmax of the ids), whose module names are open_clip's, so its state dict loads as it
is; the tokenizer is the OpenAI BPE of the `openai-clip` package (the BPE open_clip copied), with open_clip's
special-token spelling. tests/test_hps_reward.py checks it against an independent numpy forward of the
public formulas on a tiny random model.

Precision: float32 by default. dtype 'float16' / 'bfloat16' (CUDA only) runs the model under torch.autocast
at that dtype with float32 weights, as the reference's precision='amp' + torch.cuda.amp.autocast() (float16)
does. Features are cast to float32 before the normalisation and the dot product.

Common with the other image rewards (clip_rewards.py): (M, H, W, 3) uint8 images (any size; all M the same)
and M string prompts -> (M,) float32; a non-finite score is NaN (logged); batches of `batch_size` images per
forward (the reference scores one image at a time: only float rounding differs), a failing batch retried one
image at a time, an image that still fails NaN (logged); each batch's distinct prompts are encoded once;
torch.inference_mode, eval mode; `device` None: 'cuda' when available, else 'cpu'. The model loads when the
reward is built, once per process for each (checkpoint, model_cfg, device).

`model_cfg` (open_clip's model-config JSON layout: {'embed_dim', 'vision_cfg': {image_size, patch_size,
width, layers, head_width, mlp_ratio}, 'text_cfg': {context_length, vocab_size, width, heads, layers}};
missing keys take open_clip's CLIPVisionCfg / CLIPTextCfg defaults) builds another size, e.g. the tiny
random models of `save_tiny` for smoke runs and tests. Default: VIT_H_14.

No PIL. torch and the tokenizer's packages (openai-clip: ftfy, regex) are imported when a reward is built,
never at module import. Pip: torch, openai-clip==1.0.1 (no torchvision, no open-clip-torch, no hpsv2).
"""
import contextlib
import copy
import importlib.util
import math
import os

import numpy as np

from ddrl_jax.rewards import clip_rewards
from ddrl_jax.rewards import video_common


REWARD = 'hpsv21'
CHECKPOINT_HINT = 'HPS_v2.1_compressed.pt of xswu/HPSv2'
PIP_CLIP = 'pip install openai-clip==1.0.1'
# open_clip's model_configs/ViT-H-14.json.
VIT_H_14 = {'embed_dim': 1024,
            'vision_cfg': {'image_size': 224, 'layers': 32, 'width': 1280, 'head_width': 80,
                           'patch_size': 14},
            'text_cfg': {'context_length': 77, 'vocab_size': 49408, 'width': 1024, 'heads': 16, 'layers': 24}}
# open_clip's CLIPVisionCfg / CLIPTextCfg defaults of the fields implemented here.
VISION_DEFAULTS = {'image_size': 224, 'layers': 12, 'width': 768, 'head_width': 64, 'patch_size': 16,
                   'mlp_ratio': 4.0}
TEXT_DEFAULTS = {'context_length': 77, 'vocab_size': 49408, 'width': 512, 'heads': 8, 'layers': 12}
MEAN = (0.48145466, 0.4578275, 0.40821073)      # open_clip's OPENAI_DATASET_MEAN / STD
STD = (0.26862954, 0.26130258, 0.27577711)
PAD_FILL = 0.0                                   # ResizeMaxSize's fill, on the [0, 1] tensor (black)
LN_EPS = 1e-5
BPE_FILE = 'bpe_simple_vocab_16e6.txt.gz'        # in the openai-clip package (`clip/`)
BPE_VOCAB = 49408
SPECIALS = ('<start_of_text>', '<end_of_text>')  # open_clip's spelling; OpenAI's below, same ids
OPENAI_SPECIALS = ('<|startoftext|>', '<|endoftext|>')
TOKEN_PATTERN = (r"<start_of_text>|<end_of_text>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]"
                 r"|[^\s\p{L}\p{N}]+")


class CheckpointError(video_common.CheckpointError):
  """An HPS checkpoint that cannot be used; one line naming the reward and the file."""


def _fail(path, what, reward=REWARD):
  video_common.fail(reward, path, what, error=CheckpointError)


def _path(value):
  return os.path.abspath(os.path.expanduser(value)) if value else None


# ------------------------------------------------------------------------------------------ config
def model_config(model_cfg=None):
  """The full config ({'embed_dim', 'vision_cfg', 'text_cfg'}, plain ints / floats) of `model_cfg` (None:
  VIT_H_14), open_clip's defaults filled in; ValueError (one line, naming the reward) for a field that is
  not implemented here or a shape that does not fit."""
  cfg = copy.deepcopy(VIT_H_14 if model_cfg is None else dict(model_cfg))
  odd = sorted(set(cfg) - {'embed_dim', 'vision_cfg', 'text_cfg'})
  if odd or 'embed_dim' not in cfg:
    raise ValueError(f'{REWARD}: model_cfg needs embed_dim, vision_cfg, text_cfg'
                     + (f'; {odd[0]!r} is not supported' if odd else ''))
  out = {'embed_dim': int(cfg['embed_dim'])}
  for part, defaults in (('vision_cfg', VISION_DEFAULTS), ('text_cfg', TEXT_DEFAULTS)):
    given = dict(cfg.get(part) or {})
    odd = sorted(set(given) - set(defaults))
    if odd:
      raise ValueError(f'{REWARD}: model_cfg {part}.{odd[0]} is not supported (only {sorted(defaults)}: '
                       f"open_clip's plain ViT / text transformer)")
    out[part] = {k: type(v)(given.get(k, v)) if k != 'image_size' else given.get(k, v)
                 for k, v in defaults.items()}
  vision, text = out['vision_cfg'], out['text_cfg']
  size = vision['image_size']
  if isinstance(size, (list, tuple)):
    if len(size) != 2 or size[0] != size[1]:
      raise ValueError(f'{REWARD}: model_cfg vision_cfg.image_size {size!r} is not square')
    size = size[0]
  vision['image_size'] = int(size)
  if vision['image_size'] % vision['patch_size'] or vision['width'] % vision['head_width']:
    raise ValueError(f"{REWARD}: model_cfg vision_cfg: image_size {vision['image_size']} must be a multiple "
                     f"of patch_size {vision['patch_size']} and width {vision['width']} of head_width "
                     f"{vision['head_width']}")
  if text['width'] % text['heads']:
    raise ValueError(f"{REWARD}: model_cfg text_cfg: width {text['width']} is not a multiple of heads "
                     f"{text['heads']}")
  if text['vocab_size'] < BPE_VOCAB:
    raise ValueError(f"{REWARD}: model_cfg text_cfg.vocab_size {text['vocab_size']} < {BPE_VOCAB}, the CLIP "
                     f"BPE's ids")
  if text['context_length'] < 2:
    raise ValueError(f"{REWARD}: model_cfg text_cfg.context_length {text['context_length']} < 2")
  return out


# ------------------------------------------------------------------------------------------ files
def bpe_path():
  """The OpenAI CLIP BPE vocabulary inside the installed openai-clip package (found without importing
  it: `clip/__init__` imports torchvision); None when it is not there."""
  spec = importlib.util.find_spec('clip')
  for folder in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(folder, BPE_FILE)
    if os.path.isfile(path):
      return path
  return None


def input_problems(kwargs):
  """One-line problems with what the reward built with `kwargs` needs (the checkpoint file, model_cfg, the
  BPE vocabulary of openai-clip), found without loading anything."""
  kwargs = dict(kwargs or {})
  problems = []
  checkpoint = _path(kwargs.get('checkpoint'))
  if not checkpoint:
    problems.append(f'{REWARD}: config.reward.kwargs.{REWARD}.checkpoint is not set ({CHECKPOINT_HINT})')
  elif not os.path.isfile(checkpoint):
    problems.append(f'{REWARD} checkpoint {checkpoint}: no such file ({CHECKPOINT_HINT})')
  try:
    model_config(kwargs.get('model_cfg'))
  except (ValueError, TypeError) as e:
    problems.append(video_common.first_line(e))
  if bpe_path() is None:
    problems.append(f'{REWARD}: no CLIP BPE vocabulary (clip/{BPE_FILE}; {PIP_CLIP})')
  return problems


# ------------------------------------------------------------------------------------------ tokenizer
class Tokenizer:
  """open_clip's `tokenize` (its SimpleTokenizer at context_length): the BPE of openai-clip's
  clip.simple_tokenizer with open_clip's special tokens. tokenizer(prompts) -> (B, context_length) int64."""

  def __init__(self, context_length=77):
    path = bpe_path()
    if path is None:
      raise ImportError(f'{REWARD}: no CLIP BPE vocabulary (clip/{BPE_FILE}; {PIP_CLIP})')
    import regex  # pylint: disable=g-import-not-at-top
    from ddrl_jax.rewards import vbench  # pylint: disable=g-import-not-at-top
    simple = vbench.import_submodule('clip.simple_tokenizer')
    bpe = simple.SimpleTokenizer(path)
    for new, old in zip(SPECIALS, OPENAI_SPECIALS):
      bpe.encoder[new] = bpe.encoder.pop(old)
      bpe.cache.pop(old, None)
      bpe.cache[new] = new
    bpe.decoder = {v: k for k, v in bpe.encoder.items()}
    bpe.pat = regex.compile(TOKEN_PATTERN, regex.IGNORECASE)
    self.bpe = bpe
    self.context_length = int(context_length)
    self.start, self.end = (bpe.encoder[s] for s in SPECIALS)
    self.vocab_size = len(bpe.encoder)

  def ids(self, prompt):
    """The token ids of one prompt: start, BPE, end; truncated to context_length with the end token last."""
    tokens = [self.start] + self.bpe.encode(prompt) + [self.end]
    if len(tokens) > self.context_length:
      tokens = tokens[:self.context_length]
      tokens[-1] = self.end
    return tokens

  def __call__(self, prompts):
    import torch  # pylint: disable=g-import-not-at-top
    out = torch.zeros(len(prompts), self.context_length, dtype=torch.long)
    for i, prompt in enumerate(prompts):
      tokens = self.ids(prompt)
      out[i, :len(tokens)] = torch.tensor(tokens)
    return out


_TOKENIZERS = {}


def shared_tokenizer(context_length=77):
  """Tokenizer(context_length), once per process."""
  if context_length not in _TOKENIZERS:
    _TOKENIZERS[context_length] = Tokenizer(context_length)
  return _TOKENIZERS[context_length]


# ------------------------------------------------------------------------------------------ pixels
def resize_pad(samples, size, device='cpu'):
  """(M, H, W, 3) uint8 -> (M, 3, size, size) float32 torch in [0, 1] plus bicubic overshoot: uint8 / 255,
  the longer side resized to `size` (each side round(side * size / longer); torchvision's tensor bicubic
  resize with antialias, not clamped), zero padding centred (floor of half the excess left / top). An image
  whose longer side is already `size` is only padded."""
  import torch  # pylint: disable=g-import-not-at-top
  x = torch.from_numpy(np.ascontiguousarray(samples)).to(device).permute(0, 3, 1, 2).float() / 255.0
  height, width = x.shape[-2:]
  scale = size / float(max(height, width))
  if scale != 1.0:
    new = (round(height * scale), round(width * scale))
    x = torch.nn.functional.interpolate(x, size=new, mode='bicubic', align_corners=False, antialias=True)
  pad_h, pad_w = size - x.shape[-2], size - x.shape[-1]
  return torch.nn.functional.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2),
                                 value=PAD_FILL)


def pixels(samples, size, device='cpu'):
  """resize_pad, then (x - MEAN) / STD: the model's (M, 3, size, size) float32 input."""
  x = resize_pad(samples, size, device)
  mean, std = (x.new_tensor(v).view(1, 3, 1, 1) for v in (MEAN, STD))
  return (x - mean) / std


# ------------------------------------------------------------------------------------------ model
def _modules():
  """The model's torch.nn classes (defined when torch is first needed)."""
  import collections  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  nn = torch.nn

  class Block(nn.Module):
    """open_clip's ResidualAttentionBlock: x + attn(ln_1(x)), then x + mlp(ln_2(x)) (c_fc, GELU, c_proj)."""

    def __init__(self, width, heads, mlp_ratio):
      super().__init__()
      self.ln_1 = nn.LayerNorm(width, eps=LN_EPS)
      self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
      self.ln_2 = nn.LayerNorm(width, eps=LN_EPS)
      hidden = int(width * mlp_ratio)
      self.mlp = nn.Sequential(collections.OrderedDict([
          ('c_fc', nn.Linear(width, hidden)), ('gelu', nn.GELU()), ('c_proj', nn.Linear(hidden, width))]))

    def forward(self, x, attn_mask=None):
      y = self.ln_1(x)
      x = x + self.attn(y, y, y, need_weights=False, attn_mask=attn_mask)[0]
      return x + self.mlp(self.ln_2(x))

  class Transformer(nn.Module):

    def __init__(self, width, layers, heads, mlp_ratio=4.0):
      super().__init__()
      self.resblocks = nn.ModuleList([Block(width, heads, mlp_ratio) for _ in range(layers)])

    def forward(self, x, attn_mask=None):
      for block in self.resblocks:
        x = block(x, attn_mask)
      return x

  class Visual(nn.Module):
    """open_clip's VisionTransformer (class-token pooling): conv1 patches, class token, positions, ln_pre,
    transformer, ln_post of the class token, @ proj."""

    def __init__(self, embed_dim, image_size, patch_size, width, layers, head_width, mlp_ratio):
      super().__init__()
      grid = image_size // patch_size
      self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
      self.class_embedding = nn.Parameter(torch.zeros(width))
      self.positional_embedding = nn.Parameter(torch.zeros(grid * grid + 1, width))
      self.ln_pre = nn.LayerNorm(width, eps=LN_EPS)
      self.transformer = Transformer(width, layers, width // head_width, mlp_ratio)
      self.ln_post = nn.LayerNorm(width, eps=LN_EPS)
      self.proj = nn.Parameter(torch.zeros(width, embed_dim))

    def forward(self, x):
      x = self.conv1(x.to(self.conv1.weight.dtype)).flatten(2).transpose(1, 2)      # (B, grid**2, width)
      cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
      x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)
      x = self.transformer(self.ln_pre(x))
      return self.ln_post(x[:, 0]) @ self.proj

  class HPSModel(nn.Module):
    """open_clip's CLIP (module names and state dict as open_clip's): visual, and the text tower's
    token_embedding, positional_embedding, transformer, ln_final, text_projection; logit_scale (unused)."""

    def __init__(self, cfg):
      super().__init__()
      vision, text = cfg['vision_cfg'], cfg['text_cfg']
      self.visual = Visual(cfg['embed_dim'], **vision)
      self.context_length = text['context_length']
      self.token_embedding = nn.Embedding(text['vocab_size'], text['width'])
      self.positional_embedding = nn.Parameter(torch.zeros(text['context_length'], text['width']))
      self.transformer = Transformer(text['width'], text['layers'], text['heads'])
      self.ln_final = nn.LayerNorm(text['width'], eps=LN_EPS)
      self.text_projection = nn.Parameter(torch.zeros(text['width'], cfg['embed_dim']))
      self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def encode_image(self, pixel_values):
      return self.visual(pixel_values)

    def encode_text(self, tokens):
      n = tokens.shape[1]
      x = self.token_embedding(tokens) + self.positional_embedding[:n]
      mask = torch.full((n, n), float('-inf'), device=x.device).triu_(1)     # causal
      x = self.ln_final(self.transformer(x, mask.to(x.dtype)))
      return x[torch.arange(x.shape[0], device=x.device), tokens.argmax(dim=-1)] @ self.text_projection

    def forward(self, pixel_values, tokens):
      """(unit image features (B, D), unit text features (B, D)), float32."""
      image = torch.nn.functional.normalize(self.encode_image(pixel_values).float(), dim=-1)
      text = torch.nn.functional.normalize(self.encode_text(tokens).float(), dim=-1)
      return image, text

  return HPSModel


def build_model(model_cfg=None, device='meta'):
  """An HPSModel of model_config(model_cfg) (parameters on `device`; 'meta': no memory, for loading)."""
  import torch  # pylint: disable=g-import-not-at-top
  cfg = model_config(model_cfg)
  with torch.device(device):
    return _modules()(cfg)


def check_layout(path, state, expected, what, reward=REWARD):
  """CheckpointError (one line naming `reward` and the file) unless `state` {name: tensor} holds exactly
  the names of `expected` {name: shape} at those shapes."""
  missing = sorted(set(expected) - set(state))
  unexpected = sorted(set(state) - set(expected))
  if missing or unexpected:
    parts = [f'{len(missing)} missing (e.g. {missing[0]!r})' if missing else '',
             f'{len(unexpected)} unexpected (e.g. {unexpected[0]!r})' if unexpected else '']
    _fail(path, f'does not match the {what} CLIP: ' + ', '.join(p for p in parts if p), reward)
  shapes = [k for k in expected if tuple(state[k].shape) != expected[k]]
  if shapes:
    k = shapes[0]
    _fail(path, f'does not match the {what} CLIP: {len(shapes)} shapes differ, e.g. {k!r} '
          f'{tuple(state[k].shape)}, not {expected[k]}', reward)


def read_state_dict(path, reward=REWARD):
  """{name: float32 tensor} of an HPS checkpoint file (torch.load, weights_only=True): its 'state_dict' (the
  released files' layout) or, without that key, the file's dict itself. CheckpointError (one line naming
  `reward` and the file)."""
  import torch  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(path):
    _fail(path, f'no such file ({CHECKPOINT_HINT})', reward)
  try:
    data = torch.load(path, map_location='cpu', weights_only=True)
  except Exception as e:  # pylint: disable=broad-except
    _fail(path, f'cannot be read ({video_common.describe(e)})', reward)
  state = data.get('state_dict', data) if isinstance(data, dict) else data
  if not isinstance(state, dict) or not state:
    _fail(path, f'is not a state dict (got {type(state).__name__})', reward)
  odd = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
  if odd:
    _fail(path, f'is not a state dict ({odd[0]!r} is a {type(state[odd[0]]).__name__}, not a tensor)', reward)
  return {k: v.float() for k, v in state.items()}


def load_model(path, model_cfg=None, device='cpu'):
  """The HPSModel of model_cfg with the checkpoint's weights, on device, eval mode. CheckpointError (one
  line) when the file's names or shapes are not the model's (open_clip ViT-H-14 unless model_cfg)."""
  state = read_state_dict(path)
  model = build_model(model_cfg)
  expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
  what = 'open_clip ViT-H-14' if model_cfg is None else 'model_cfg'
  check_layout(path, state, expected, what)
  model.load_state_dict(state, strict=True, assign=True)
  return model.to(device).eval()


_SHARED = {}


def shared_model(path, model_cfg, device):
  """load_model, once per process for each (checkpoint, model_cfg, device)."""
  key = (path, repr(model_config(model_cfg)), device)
  if key not in _SHARED:
    _SHARED[key] = load_model(path, model_cfg, device)
  return _SHARED[key]


# ------------------------------------------------------------------------------------------ reward
class HPSv21:
  """reward(samples, prompts) -> (M,) float32 HPSv2.1 of (M, H, W, 3) uint8 images and M prompts: the
  cosine of the unit image and text features (see the module docstring), NaN where not scorable.

  Args:
    checkpoint: HPS_v2.1_compressed.pt (a torch file with 'state_dict'), or a plain state dict file.
    device: torch device; None: 'cuda' when available, else 'cpu'.
    dtype: 'float32' (default), or 'bfloat16' / 'float16' on CUDA (autocast, float32 weights).
    batch_size: images per forward pass; a failing batch is retried one image at a time.
    model_cfg: open_clip model config (None: ViT-H-14); for tiny test models.
  """

  reward = REWARD

  def __init__(self, checkpoint=None, device=None, dtype='float32', batch_size=32, model_cfg=None):
    if int(batch_size) < 1:
      raise ValueError(f'{REWARD}: batch_size {batch_size} < 1')
    if not checkpoint:
      raise ValueError(f'{REWARD}: no checkpoint ({CHECKPOINT_HINT})')
    self.batch_size = int(batch_size)
    self.cfg = model_config(model_cfg)
    self.device, self.dtype = clip_rewards.check_device_dtype(device, dtype, REWARD)
    self.tokenizer = shared_tokenizer(self.cfg['text_cfg']['context_length'])
    self.model = shared_model(_path(checkpoint), model_cfg, self.device)
    self.image_size = self.cfg['vision_cfg']['image_size']

  def raw(self, samples, prompts):
    """(B,) float32 torch cosines of a batch (uint8 images, their prompts); each distinct prompt is encoded
    once."""
    import torch  # pylint: disable=g-import-not-at-top
    unique = sorted(set(prompts))
    index = torch.tensor([unique.index(p) for p in prompts], device=self.device)
    x = pixels(samples, self.image_size, self.device)
    tokens = self.tokenizer(unique).to(self.device)
    autocast = (contextlib.nullcontext() if self.dtype == torch.float32
                else torch.autocast(torch.device(self.device).type, dtype=self.dtype))
    with autocast:
      image = self.model.encode_image(x)
      text = self.model.encode_text(tokens)
    image = torch.nn.functional.normalize(image.float(), dim=-1)
    text = torch.nn.functional.normalize(text.float(), dim=-1)[index]
    return (image * text).sum(-1)

  def __call__(self, samples, prompts):
    return clip_rewards.score_images(self.raw, samples, prompts, REWARD, self.batch_size)


# ------------------------------------------------------------------------------------------ tiny models
TINY_CFG = {'embed_dim': 16,
            'vision_cfg': {'image_size': 32, 'layers': 2, 'width': 32, 'head_width': 16, 'patch_size': 8},
            'text_cfg': {'context_length': 77, 'vocab_size': BPE_VOCAB, 'width': 32, 'heads': 2, 'layers': 2}}


def tiny_state(model_cfg=None, seed=0):
  """{name: float32 tensor}: a random state dict of the model of model_cfg (default TINY_CFG): weights of
  std 1 / sqrt(fan in) (embeddings 0.5, LayerNorm scales 1 + 0.1 noise, biases 0.1), so that features vary."""
  import torch  # pylint: disable=g-import-not-at-top
  g = torch.Generator().manual_seed(seed)
  model = build_model(TINY_CFG if model_cfg is None else model_cfg)
  state = {}
  for name, value in model.state_dict().items():
    shape = tuple(value.shape)
    noise = torch.randn(shape, generator=g)
    if name.endswith('logit_scale'):
      state[name] = torch.tensor(math.log(100.0))
    elif 'ln_' in name and name.endswith('.weight'):
      state[name] = 1.0 + 0.1 * noise
    elif name.endswith('bias'):
      state[name] = 0.1 * noise
    elif 'embedding' in name:
      state[name] = 0.5 * noise
    elif name.endswith('conv1.weight'):
      state[name] = noise / math.sqrt(float(np.prod(shape[1:])))
    elif name.endswith('proj') or name.endswith('projection'):
      state[name] = noise / math.sqrt(shape[0])
    else:
      state[name] = noise / math.sqrt(shape[-1])
  return state


def save_tiny(folder, seed=0):
  """Writes a tiny random HPS checkpoint ({'state_dict': ...} as the released file, TINY_CFG) to
  folder/hps_tiny.pt and returns the kwargs that build the reward on it ({'checkpoint', 'model_cfg'})."""
  import torch  # pylint: disable=g-import-not-at-top
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, 'hps_tiny.pt')
  torch.save({'state_dict': tiny_state(TINY_CFG, seed)}, path)
  return {'checkpoint': os.path.abspath(path), 'model_cfg': copy.deepcopy(TINY_CFG)}
