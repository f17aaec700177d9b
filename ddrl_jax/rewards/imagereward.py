"""ImageReward (THUDM) image reward, run in PyTorch: BLIP's ViT-L/16 image tokens cross-attended by BLIP's
BERT text encoder over the prompt, the first token's feature through a linear MLP, z-scored.

Reference: PyPI `image-reward` 1.5 (`ImageReward/ImageReward.py`, `utils.py::load`, `models/BLIP/*`), as
flow_grpo's `imagereward_scorer.py` runs it (`inference_rank(prompt, [image])` per image; DiffusionNFT and
cosmos-rl `model/image_reward.py` run all B x B (image, prompt) pairs and keep the diagonal: the same
scores).
  weights   `ImageReward.pt` of THUDM/ImageReward: a plain state dict of the package's `ImageReward` module,
            loaded with strict=False: blip.visual_encoder.* (BLIP's ViT), blip.text_encoder.* (BLIP's
            med.BertModel, with its persistent embeddings.position_ids buffer), mlp.layers.{0,2,4,6,7}.*;
            blip.vision_proj / blip.text_proj are in the module and unused (ignored here too, as is anything
            outside those three prefixes). Missing or unexpected names inside them, or other shapes, are an
            error here (the reference would silently keep random weights).
  vision    BLIP_Pretrain(image_size=224, vit='large'): BLIP's timm-style ViT-L/16 (24 pre-norm blocks, width
            1024, 16 heads, fused qkv with bias, exact GELU, LayerNorm eps 1e-6, class token, learned
            positions, final norm on all tokens); drop path 0.1 is inactive in eval mode.
  text      med.BertModel(BertConfig.from_json_file(med_config.json), add_pooling_layer=False) with
            encoder_width set to the ViT width (1024; the file's own encoder_width is overridden, as
            BLIP_Pretrain does): BERT post-norm layers, each self-attention, cross-attention to all image
            tokens (mode 'multimodal', the default), feed-forward; absolute positions, no token types; masks
            (1 - m) * -10000. med_config.json of THUDM/ImageReward: vocab 30524, width 768, 12 layers, 12
            heads, eps 1e-12.
  tokens    BLIP's init_tokenizer: BertTokenizer('bert-base-uncased') plus the added '[DEC]' (bos) and '[ENC]'
            (additional special) tokens (ids 30522, 30523); prompt -> padding='max_length', truncation=True,
            max_length=35. The first token stays [CLS]: ImageReward's score / inference_rank (and its training
            code) do NOT write enc_token_id into input_ids[:, 0] as BLIP's ITM head does.
  pixels    the package's `_transform(224)` on a PIL image: torchvision Resize(224, BICUBIC) (PIL's bicubic
            resize of the uint8 image, short side 224, long side int(224 * long / short); none when already
            that size), CenterCrop(224) (offsets int(round(excess / 2)), half to even), RGB, ToTensor (/255),
            Normalize with the OpenAI CLIP mean / std.
  score     text_encoder(ids, mask, encoder_hidden_states=ViT tokens, encoder_attention_mask=ones)
            .last_hidden_state[:, 0] -> mlp (Linear 768-1024-128-64-16-1 with Dropouts, no activations) ->
            (x - 0.16717362830052426) / 1.0333394966054072. Each image with its own prompt.

Implementation: transformers' BLIP classes, which are ports of BLIP's code: `BlipVisionModel` (its
embeddings, pre-norm encoder layers and post_layernorm are BLIP's ViT op for op; qkv is fused as in BLIP)
and `BlipTextModel` (a port of med.BertModel: same module names, cross-attention in every layer whenever
encoder_hidden_states is given, the same -10000 self-attention mask), both eager attention only. The
checkpoint's names map onto them by `hf_name` (the text encoder's names are identical; the ViT's are
renamed: patch_embed.proj -> embeddings.patch_embedding, cls_token -> embeddings.class_embedding,
pos_embed -> embeddings.position_embedding, blocks.i.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}
-> encoder.layers.i.{layer_norm1, self_attn.qkv, self_attn.projection, layer_norm2, mlp.fc1, mlp.fc2},
norm -> post_layernorm). tests/test_imagereward.py checks the score against the package's own forward
(its BLIP modules and ImageReward.score on an unpacked wheel, when one is there) and an independent numpy
forward, on tiny random models.

Precision: float32 by default. dtype 'float16' / 'bfloat16' (CUDA only) runs the two towers under
torch.autocast at that dtype with float32 weights (the references cast the whole model instead); the
feature is cast to float32 before the MLP, which runs in float32.

Common with the other image rewards (clip_rewards.py): (M, H, W, 3) uint8 images (any size; all M the same)
and M string prompts -> (M,) float32; a non-finite score is NaN (logged); batches of `batch_size` images
per forward, a failing batch retried one image at a time, an image that still fails NaN (logged);
torch.inference_mode, eval mode; `device` None: 'cuda' when available, else 'cpu'. The model loads when the
reward is built, once per process for each (checkpoint, med_config, vision_cfg, device).

`vision_cfg` ({image_size, patch_size, width, layers, heads, mlp_ratio}; default VIT_LARGE) and the
med_config file build other sizes: the tiny random models of `save_tiny` for smoke runs and tests.

torch, transformers and PIL are imported when a reward is built, never at module import. Pip: torch,
transformers, pillow (no torchvision, timm, fairscale or image-reward).
"""
import contextlib
import copy
import json
import logging
import math
import os
import re

import numpy as np

from ddrl_jax.rewards import clip_rewards
from ddrl_jax.rewards import video_common

logger = logging.getLogger(__name__)

REWARD = 'imagereward'
CHECKPOINT_HINT = 'ImageReward.pt of THUDM/ImageReward'
MED_CONFIG_HINT = 'med_config.json of THUDM/ImageReward'
TOKENIZER_HINT = 'a local bert-base-uncased folder with vocab.txt'
MAX_TOKENS = 35
SCORE_MEAN = 0.16717362830052426          # ImageReward.mean / .std
SCORE_STD = 1.0333394966054072
MEAN = (0.48145466, 0.4578275, 0.40821073)   # the package's _transform Normalize (OpenAI CLIP's)
STD = (0.26862954, 0.26130258, 0.27577711)
SPECIAL_TOKENS = ('[DEC]', '[ENC]')          # BLIP's added bos and additional special token
# create_vit('large', 224): VisionTransformer(img_size=224, patch_size=16, embed_dim=1024, depth=24,
# num_heads=16), mlp_ratio 4, qkv_bias, LayerNorm eps 1e-6.
VIT_LARGE = {'image_size': 224, 'patch_size': 16, 'width': 1024, 'layers': 24, 'heads': 16, 'mlp_ratio': 4.0}
VIT_LN_EPS = 1e-6
# transformers BertConfig's defaults, which BertConfig.from_json_file gives the fields a file leaves out.
MED_DEFAULTS = {'vocab_size': 30522, 'hidden_size': 768, 'num_hidden_layers': 12, 'num_attention_heads': 12,
                'intermediate_size': 3072, 'hidden_act': 'gelu', 'max_position_embeddings': 512,
                'layer_norm_eps': 1e-12, 'pad_token_id': 0, 'position_embedding_type': 'absolute',
                'add_cross_attention': False}
PREFIX_VISION, PREFIX_TEXT, PREFIX_MLP = 'blip.visual_encoder.', 'blip.text_encoder.', 'mlp.layers.'
POSITION_IDS = 'embeddings.position_ids'     # med.py's persistent buffer (transformers': not persistent)
VIT_TOP = {'cls_token': 'embeddings.class_embedding', 'pos_embed': 'embeddings.position_embedding',
           'patch_embed.proj.weight': 'embeddings.patch_embedding.weight',
           'patch_embed.proj.bias': 'embeddings.patch_embedding.bias',
           'norm.weight': 'post_layernorm.weight', 'norm.bias': 'post_layernorm.bias'}
VIT_BLOCK = {'norm1': 'layer_norm1', 'attn.qkv': 'self_attn.qkv', 'attn.proj': 'self_attn.projection',
             'norm2': 'layer_norm2', 'mlp.fc1': 'mlp.fc1', 'mlp.fc2': 'mlp.fc2'}
VIT_TOP_INV = {v: k for k, v in VIT_TOP.items()}
VIT_BLOCK_INV = {v: k for k, v in VIT_BLOCK.items()}


class CheckpointError(video_common.CheckpointError):
  """An ImageReward file that cannot be used; one line naming the reward and the file."""


def _fail(path, what):
  video_common.fail(REWARD, path, what, error=CheckpointError)


def _path(value):
  return os.path.abspath(os.path.expanduser(value)) if value else None


# ------------------------------------------------------------------------------------------ config
def vision_config(vision_cfg=None):
  """The ViT config ({image_size, patch_size, width, layers, heads, mlp_ratio}) of `vision_cfg` (None:
  VIT_LARGE; missing keys VIT_LARGE's); ValueError (one line, naming the reward) otherwise."""
  given = dict(VIT_LARGE if vision_cfg is None else vision_cfg)
  odd = sorted(set(given) - set(VIT_LARGE))
  if odd:
    raise ValueError(f'{REWARD}: vision_cfg.{odd[0]} is not supported (only {sorted(VIT_LARGE)})')
  try:
    cfg = {k: type(v)(given.get(k, v)) for k, v in VIT_LARGE.items()}
  except (TypeError, ValueError) as e:
    raise ValueError(f'{REWARD}: vision_cfg {given!r} is not numeric ({video_common.first_line(e)})') from e
  if min(cfg.values()) <= 0 or cfg['image_size'] % cfg['patch_size'] or cfg['width'] % cfg['heads']:
    raise ValueError(f"{REWARD}: vision_cfg: image_size {cfg['image_size']} must be a multiple of patch_size "
                     f"{cfg['patch_size']} and width {cfg['width']} of heads {cfg['heads']}, all positive")
  return cfg


def read_med_config(path):
  """The text encoder's fields of a med_config.json (BERT config; missing fields BertConfig's defaults).
  CheckpointError (one line) when it cannot be read or describes what is not implemented here."""
  where = f'{REWARD} med_config {path}'

  def fail(_, what):
    raise CheckpointError(f'{where}: {what}')

  if not path or not os.path.isfile(path):
    fail(path, f'no such file ({MED_CONFIG_HINT})')
  data = video_common.read_json(path, fail)
  cfg = {k: data.get(k, v) for k, v in MED_DEFAULTS.items()}
  if not cfg['add_cross_attention']:
    raise CheckpointError(f"{where}: add_cross_attention is not true (BLIP's text encoder cross-attends)")
  if cfg['position_embedding_type'] != 'absolute':
    raise CheckpointError(f"{where}: position_embedding_type {cfg['position_embedding_type']!r} is not "
                          "supported (only 'absolute')")
  ints = ('vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attention_heads', 'intermediate_size',
          'max_position_embeddings')
  try:
    for k in ints:
      cfg[k] = int(cfg[k])
    cfg['layer_norm_eps'] = float(cfg['layer_norm_eps'])
  except (TypeError, ValueError) as e:
    raise CheckpointError(f'{where}: {video_common.first_line(e)}') from e
  if min(cfg[k] for k in ints) <= 0 or cfg['hidden_size'] % cfg['num_attention_heads']:
    raise CheckpointError(f"{where}: hidden_size {cfg['hidden_size']} is not a multiple of "
                          f"num_attention_heads {cfg['num_attention_heads']} (or a size is not positive)")
  if cfg['max_position_embeddings'] < MAX_TOKENS:
    raise CheckpointError(f"{where}: max_position_embeddings {cfg['max_position_embeddings']} < "
                          f'{MAX_TOKENS} (the prompt length)')
  return cfg


def input_problems(kwargs):
  """One-line problems with what the reward built with `kwargs` needs (checkpoint and med_config files, a
  tokenizer folder with vocab.txt, vision_cfg), found without loading any model."""
  kwargs = dict(kwargs or {})
  problems = []
  for key, hint, isfile in (('checkpoint', CHECKPOINT_HINT, True), ('med_config', MED_CONFIG_HINT, True),
                            ('tokenizer', TOKENIZER_HINT, False)):
    path = _path(kwargs.get(key))
    if not path:
      problems.append(f'{REWARD}: config.reward.kwargs.{REWARD}.{key} is not set ({hint})')
    elif isfile and not os.path.isfile(path):
      problems.append(f'{REWARD} {key} {path}: no such file ({hint})')
    elif not isfile and not os.path.isfile(os.path.join(path, 'vocab.txt')):
      problems.append(f'{REWARD} tokenizer {path}: no vocab.txt ({hint})')
    elif key == 'med_config':
      try:
        read_med_config(path)
      except CheckpointError as e:
        problems.append(video_common.first_line(e))
  try:
    vision_config(kwargs.get('vision_cfg'))
  except ValueError as e:
    problems.append(video_common.first_line(e))
  return problems


# ------------------------------------------------------------------------------------------ tokenizer
class Tokenizer:
  """BLIP's init_tokenizer on a local bert-base-uncased folder: BertTokenizer plus '[DEC]' (bos_token) and
  '[ENC]' (additional special token). tokenizer(prompts) -> (input_ids, attention_mask), (B, 35) int64,
  padding='max_length', truncation=True, the first token [CLS] (as ImageReward scores; not [ENC])."""

  def __init__(self, folder):
    import transformers  # pylint: disable=g-import-not-at-top
    if not folder or not os.path.isfile(os.path.join(folder, 'vocab.txt')):
      raise CheckpointError(f'{REWARD} tokenizer {folder}: no vocab.txt ({TOKENIZER_HINT})')
    try:
      tok = transformers.BertTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f'{REWARD} tokenizer {folder}: cannot be loaded as a BertTokenizer '
                            f'({video_common.describe(e)})') from e
    tok.add_special_tokens({'bos_token': SPECIAL_TOKENS[0]})
    tok.add_special_tokens({'additional_special_tokens': [SPECIAL_TOKENS[1]]})
    self.tokenizer = tok
    self.enc_token_id = tok.additional_special_tokens_ids[0]    # unused by ImageReward's scoring
    self.size = len(tok)

  def __call__(self, prompts, device='cpu'):
    batch = self.tokenizer(list(prompts), padding='max_length', truncation=True, max_length=MAX_TOKENS,
                           return_tensors='pt')
    return batch['input_ids'].to(device), batch['attention_mask'].to(device)


_TOKENIZERS = {}


def shared_tokenizer(folder):
  if folder not in _TOKENIZERS:
    _TOKENIZERS[folder] = Tokenizer(folder)
  return _TOKENIZERS[folder]


# ------------------------------------------------------------------------------------------ pixels
def pil_resized(samples, size):
  """(M, H, W, 3) uint8 -> (M, h, w, 3) uint8: torchvision's Resize(size, BICUBIC) of each PIL image (PIL's
  bicubic resize, the short side to `size`, the long side int(size * long / short); unchanged when the image
  is already that size)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  height, width = samples.shape[1:3]
  new_h, new_w = clip_rewards.resize_size(height, width, size)
  if (new_h, new_w) == (height, width):
    return samples
  return np.stack([np.asarray(Image.fromarray(np.ascontiguousarray(x)).resize((new_w, new_h),
                                                                               Image.BICUBIC))
                   for x in samples])


def pixels(samples, size, device='cpu'):
  """(M, H, W, 3) uint8 -> (M, 3, size, size) float32 torch: the package's _transform(size): PIL bicubic
  resize of the short side, torchvision's centre crop, /255, (x - MEAN) / STD."""
  import torch  # pylint: disable=g-import-not-at-top
  x = torch.from_numpy(np.ascontiguousarray(pil_resized(samples, size))).to(device).permute(0, 3, 1, 2)
  x = clip_rewards.center_crop(x, (size, size)).float() / 255.0
  mean, std = (x.new_tensor(v).view(1, 3, 1, 1) for v in (MEAN, STD))
  return (x - mean) / std


# ------------------------------------------------------------------------------------------ names
def hf_name(name):
  """The transformers name of an ImageReward.pt tensor: ('vision' | 'text' | 'mlp', name there), or None
  for what the reward does not use (blip.vision_proj, blip.text_proj, other prefixes, position_ids).
  A ViT name that is not BLIP's maps to ('vision', None)."""
  if name.startswith(PREFIX_VISION):
    rest = name[len(PREFIX_VISION):]
    m = re.fullmatch(r'blocks\.(\d+)\.(norm1|attn\.qkv|attn\.proj|norm2|mlp\.fc[12])\.(weight|bias)', rest)
    if m:
      return 'vision', f'encoder.layers.{m[1]}.{VIT_BLOCK[m[2]]}.{m[3]}'
    return 'vision', VIT_TOP.get(rest)
  if name.startswith(PREFIX_TEXT):
    rest = name[len(PREFIX_TEXT):]
    return None if rest == POSITION_IDS else ('text', rest)
  if name.startswith(PREFIX_MLP):
    return 'mlp', name[len(PREFIX_MLP):]
  return None


def ir_name(part, name):
  """The ImageReward.pt name of a transformers tensor name of `part` (inverse of hf_name)."""
  if part == 'text':
    return PREFIX_TEXT + name
  if part == 'mlp':
    return PREFIX_MLP + name
  m = re.fullmatch(r'encoder\.layers\.(\d+)\.(.+)\.(weight|bias)', name)
  if m:
    return f'{PREFIX_VISION}blocks.{m[1]}.{VIT_BLOCK_INV[m[2]]}.{m[3]}'
  return PREFIX_VISION + VIT_TOP_INV[name]


# ------------------------------------------------------------------------------------------ model
def hf_configs(med, vision):
  """(BlipVisionConfig, BlipTextConfig) of the med_config fields and the ViT config; the text encoder's
  cross-attention width is the ViT's (BLIP_Pretrain's encoder_width = vision_width)."""
  import transformers  # pylint: disable=g-import-not-at-top
  vcfg = transformers.BlipVisionConfig(
      hidden_size=vision['width'], intermediate_size=int(vision['width'] * vision['mlp_ratio']),
      num_hidden_layers=vision['layers'], num_attention_heads=vision['heads'],
      image_size=vision['image_size'], patch_size=vision['patch_size'], hidden_act='gelu',
      layer_norm_eps=VIT_LN_EPS, attention_dropout=0.0)
  tcfg = transformers.BlipTextConfig(
      vocab_size=med['vocab_size'], hidden_size=med['hidden_size'], encoder_hidden_size=vision['width'],
      intermediate_size=med['intermediate_size'], num_hidden_layers=med['num_hidden_layers'],
      num_attention_heads=med['num_attention_heads'], max_position_embeddings=med['max_position_embeddings'],
      hidden_act=med['hidden_act'], layer_norm_eps=med['layer_norm_eps'], pad_token_id=med['pad_token_id'],
      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, is_decoder=True, use_cache=False)
  for cfg in (vcfg, tcfg):
    cfg._attn_implementation = 'eager'    # pylint: disable=protected-access  (the only one they have)
  return vcfg, tcfg


def _modules():
  """The model's torch.nn class (defined when torch is first needed)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  class ImageRewardModel(torch.nn.Module):
    """vision (BlipVisionModel), text (BlipTextModel with cross-attention, no pooler), mlp (Sequential)."""

    def __init__(self, med, vision):
      super().__init__()
      vcfg, tcfg = hf_configs(med, vision)
      self.vision = transformers.BlipVisionModel(vcfg)
      self.text = transformers.BlipTextModel(tcfg, add_pooling_layer=False)
      nn = torch.nn
      dims = (med['hidden_size'],) + clip_rewards.AESTHETIC_WIDTHS
      lin = [nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])]
      drops = [nn.Dropout(p) for p in clip_rewards.AESTHETIC_DROPOUTS]
      self.mlp = nn.Sequential(lin[0], drops[0], lin[1], drops[1], lin[2], drops[2], *lin[3:])

    def features(self, pixel_values, input_ids, attention_mask):
      """(B, hidden) last_hidden_state[:, 0] of the text encoder over the prompt and the image tokens."""
      image = self.vision(pixel_values=pixel_values).last_hidden_state
      image_atts = torch.ones(image.shape[:-1], dtype=torch.long, device=image.device)
      out = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image,
                      encoder_attention_mask=image_atts, return_dict=True)
      return out.last_hidden_state[:, 0, :]

    def head(self, features):
      """(B,) float32 z-scored rewards of (B, hidden) features (the MLP in float32)."""
      return ((self.mlp(features.float()) - SCORE_MEAN) / SCORE_STD)[:, 0]

    def forward(self, pixel_values, input_ids, attention_mask):
      return self.head(self.features(pixel_values, input_ids, attention_mask))

  return ImageRewardModel


def build_model(med, vision=None, device='meta'):
  """An ImageRewardModel of the med_config fields `med` and vision_config(vision) on `device` ('meta': no
  memory, for loading)."""
  import torch  # pylint: disable=g-import-not-at-top
  with torch.device(device):
    return _modules()(med, vision_config(vision))


def checkpoint_names(med, vision=None):
  """{ImageReward.pt name: shape} of the tensors the reward reads (position_ids and the unused projections
  left out), from a meta model."""
  model = build_model(med, vision)
  return {ir_name(part, k): tuple(v.shape) for part in ('vision', 'text', 'mlp')
          for k, v in getattr(model, part).state_dict().items()}


def read_state_dict(path):
  """{name: tensor} of an ImageReward.pt file (torch.load, weights_only=True; a plain state dict).
  CheckpointError (one line)."""
  import torch  # pylint: disable=g-import-not-at-top
  if not path or not os.path.isfile(path):
    _fail(path, f'no such file ({CHECKPOINT_HINT})')
  try:
    state = torch.load(path, map_location='cpu', weights_only=True)
  except Exception as e:  # pylint: disable=broad-except
    _fail(path, f'cannot be read ({video_common.describe(e)})')
  if not isinstance(state, dict) or not state:
    _fail(path, f'is not a state dict (got {type(state).__name__})')
  odd = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
  if odd:
    _fail(path, f'is not a state dict ({odd[0]!r} is a {type(state[odd[0]]).__name__}, not a tensor)')
  return state


def load_model(path, med_config, vision_cfg=None, device='cpu'):
  """The ImageRewardModel with the checkpoint's weights on device, eval mode. CheckpointError (one line)
  when the file's names or shapes do not match the med_config / vision_cfg model."""
  import torch  # pylint: disable=g-import-not-at-top
  med = read_med_config(med_config)
  state = read_state_dict(path)
  model = build_model(med, vision_cfg)
  what = 'ViT-L/16' if vision_cfg is None else 'vision_cfg'
  parts = {'vision': {}, 'text': {}, 'mlp': {}}
  unexpected, ignored = [], []
  for name, value in state.items():
    target = hf_name(name)
    if target is None:
      ignored.append(name)
    elif target[1] is None:
      unexpected.append(name)
    else:
      parts[target[0]][target[1]] = value
  expected = {ir_name(part, k): (part, k, tuple(v.shape)) for part in parts
              for k, v in getattr(model, part).state_dict().items()}
  unexpected += [ir_name(part, k) for part in parts for k in parts[part]
                 if ir_name(part, k) not in expected]
  missing = sorted(set(expected) - {ir_name(p, k) for p in parts for k in parts[p]})
  if missing or unexpected:
    msg = [f'{len(missing)} missing (e.g. {missing[0]!r})' if missing else '',
           f'{len(unexpected)} unexpected (e.g. {sorted(unexpected)[0]!r})' if unexpected else '']
    _fail(path, f'does not match the {what} + med_config ImageReward: ' + ', '.join(m for m in msg if m))
  shapes = [n for n, (p, k, s) in expected.items() if tuple(parts[p][k].shape) != s]
  if shapes:
    n = shapes[0]
    p, k, s = expected[n]
    _fail(path, f'does not match the {what} + med_config ImageReward: {len(shapes)} shapes differ, e.g. '
          f'{n!r} {tuple(parts[p][k].shape)}, not {s}')
  positions = state.get(PREFIX_TEXT + POSITION_IDS)
  count = med['max_position_embeddings']
  arange = torch.arange(count).expand((1, -1))
  if positions is not None and (tuple(positions.shape) != (1, count) or not torch.equal(positions.long(),
                                                                                         arange)):
    _fail(path, f'{PREFIX_TEXT}{POSITION_IDS} is not arange({count}) (position ids are not supported)')
  if ignored:
    logger.debug('%s: %d unused tensors of %s ignored (e.g. %s)', REWARD, len(ignored), path, ignored[0])
  for part, tensors in parts.items():
    getattr(model, part).load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True,
                                         assign=True)
  # transformers' position_ids buffer is not persistent: it is still on meta.
  model.text.embeddings.register_buffer('position_ids', arange.clone(), persistent=False)
  meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
  if meta:
    _fail(path, f'leaves {meta[0]!r} unset')
  return model.to(device).eval()


_SHARED = {}


def shared_model(path, med_config, vision_cfg, device):
  """load_model, once per process for each (checkpoint, med_config, vision_cfg, device)."""
  key = (path, med_config, repr(vision_config(vision_cfg)), device)
  if key not in _SHARED:
    _SHARED[key] = load_model(path, med_config, vision_cfg, device)
  return _SHARED[key]


# ------------------------------------------------------------------------------------------ reward
class ImageReward:
  """reward(samples, prompts) -> (M,) float32 ImageReward scores of (M, H, W, 3) uint8 images and M prompts
  (see the module docstring), NaN where not scorable.

  Args:
    checkpoint: ImageReward.pt (a state dict of the package's ImageReward module).
    med_config: med_config.json (BLIP's BERT config) of THUDM/ImageReward.
    tokenizer: a local bert-base-uncased folder (vocab.txt; tokenizer_config.json read when there).
    device: torch device; None: 'cuda' when available, else 'cpu'.
    dtype: 'float32' (default), or 'bfloat16' / 'float16' on CUDA (autocast, float32 weights).
    batch_size: images per forward pass; a failing batch is retried one image at a time.
    vision_cfg: the ViT's {image_size, patch_size, width, layers, heads, mlp_ratio} (None: ViT-L/16 at
      224); for tiny test models.
  """

  reward = REWARD

  def __init__(self, checkpoint=None, med_config=None, tokenizer=None, device=None, dtype='float32',
               batch_size=32, vision_cfg=None):
    if int(batch_size) < 1:
      raise ValueError(f'{REWARD}: batch_size {batch_size} < 1')
    for value, key, hint in ((checkpoint, 'checkpoint', CHECKPOINT_HINT),
                             (med_config, 'med_config', MED_CONFIG_HINT), (tokenizer, 'tokenizer',
                                                                           TOKENIZER_HINT)):
      if not value:
        raise ValueError(f'{REWARD}: no {key} ({hint})')
    self.batch_size = int(batch_size)
    self.vision = vision_config(vision_cfg)
    self.device, self.dtype = clip_rewards.check_device_dtype(device, dtype, REWARD)
    self.tokenizer = shared_tokenizer(_path(tokenizer))
    self.model = shared_model(_path(checkpoint), _path(med_config), vision_cfg, self.device)
    vocab = self.model.text.config.vocab_size
    if self.tokenizer.size > vocab:
      raise CheckpointError(f'{REWARD} tokenizer {_path(tokenizer)}: {self.tokenizer.size} tokens (with '
                            f'[DEC], [ENC]) for a text encoder of {vocab} ({_path(med_config)})')
    self.image_size = self.vision['image_size']

  def raw(self, samples, prompts):
    """(B,) float32 torch scores of a batch (uint8 images, their prompts)."""
    import torch  # pylint: disable=g-import-not-at-top
    x = pixels(samples, self.image_size, self.device)
    ids, mask = self.tokenizer(prompts, self.device)
    autocast = (contextlib.nullcontext() if self.dtype == torch.float32
                else torch.autocast(torch.device(self.device).type, dtype=self.dtype))
    with autocast:
      features = self.model.features(x, ids, mask)
    return self.model.head(features)

  def __call__(self, samples, prompts):
    return clip_rewards.score_images(self.raw, samples, prompts, REWARD, self.batch_size)


# ------------------------------------------------------------------------------------------ tiny models
TINY_VISION = {'image_size': 32, 'patch_size': 16, 'width': 32, 'layers': 2, 'heads': 2, 'mlp_ratio': 2.0}
TINY_WORDS = ('a', 'the', 'cat', 'dog', 'photo', 'of', 'red', 'blue', 'on', 'table', 'big', '!', ',', '.',
              '##s', 'sit', '##ting')
TINY_BERT_TOKENS = ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')


def tiny_med_config(vocab_size):
  """A tiny med_config (BLIP's med_config.json layout): width 32, 2 layers, 2 heads, 40 positions."""
  return {'architectures': ['BertModel'], 'attention_probs_dropout_prob': 0.1, 'hidden_act': 'gelu',
          'hidden_dropout_prob': 0.1, 'hidden_size': 32, 'initializer_range': 0.02, 'intermediate_size': 64,
          'layer_norm_eps': 1e-12, 'max_position_embeddings': 40, 'model_type': 'bert',
          'num_attention_heads': 2, 'num_hidden_layers': 2, 'pad_token_id': 0, 'type_vocab_size': 2,
          'vocab_size': vocab_size, 'encoder_width': 768, 'add_cross_attention': True}


def tiny_state(med, vision=None, seed=0):
  """{ImageReward.pt name: float32 tensor}: random weights for the model of `med` / `vision` (default
  TINY_VISION) in the released file's layout (with text position_ids and the unused vision_proj /
  text_proj): std 1 / sqrt(fan in), embeddings 0.5, LayerNorm scales 1 + 0.1 noise, biases 0.1."""
  import torch  # pylint: disable=g-import-not-at-top
  vision = vision_config(TINY_VISION if vision is None else vision)
  g = torch.Generator().manual_seed(seed)
  state = {}
  for name, shape in checkpoint_names(med, vision).items():
    noise = torch.randn(shape, generator=g)
    if re.search(r'(norm\d?|LayerNorm|layer_norm\d)\.weight$', name):
      state[name] = 1.0 + 0.1 * noise
    elif name.endswith('bias'):
      state[name] = 0.1 * noise
    elif name.endswith(('cls_token', 'pos_embed', '_embeddings.weight')):
      state[name] = 0.5 * noise
    else:
      state[name] = noise / math.sqrt(float(np.prod(shape[1:])))
  state[PREFIX_TEXT + POSITION_IDS] = torch.arange(med['max_position_embeddings']).expand((1, -1)).clone()
  embed = 256
  for part, width in (('vision_proj', vision['width']), ('text_proj', med['hidden_size'])):
    state[f'blip.{part}.weight'] = torch.randn(embed, width, generator=g) / math.sqrt(width)
    state[f'blip.{part}.bias'] = torch.zeros(embed)
  return state


def save_tiny(folder, seed=0):
  """Writes a tiny random ImageReward to `folder`: ImageReward.pt (released layout, TINY_VISION),
  med_config.json and a BERT vocabulary (tokenizer/vocab.txt: BERT's special tokens and TINY_WORDS; [DEC]
  and [ENC] are added on load, as BLIP does). Returns the kwargs that build the reward on them
  ({'checkpoint', 'med_config', 'tokenizer', 'vision_cfg'}); any image size scores (resized to 32 x 32)."""
  import torch  # pylint: disable=g-import-not-at-top
  tokenizer = os.path.join(folder, 'tokenizer')
  os.makedirs(tokenizer, exist_ok=True)
  vocab = list(TINY_BERT_TOKENS) + list(TINY_WORDS)
  with open(os.path.join(tokenizer, 'vocab.txt'), 'w', encoding='utf-8') as f:
    f.write(''.join(t + '\n' for t in vocab))
  with open(os.path.join(tokenizer, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump({'do_lower_case': True}, f)
  med = tiny_med_config(len(vocab) + len(SPECIAL_TOKENS))
  med_path = os.path.join(folder, 'med_config.json')
  with open(med_path, 'w', encoding='utf-8') as f:
    json.dump(med, f, indent=2)
  path = os.path.join(folder, 'ImageReward.pt')
  torch.save(tiny_state(read_med_config(med_path), TINY_VISION, seed), path)
  return {'checkpoint': os.path.abspath(path), 'med_config': os.path.abspath(med_path),
          'tokenizer': os.path.abspath(tokenizer), 'vision_cfg': copy.deepcopy(TINY_VISION)}
