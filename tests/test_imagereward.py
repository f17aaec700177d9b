"""The ImageReward reward (ddrl_jax/rewards/imagereward.py) on a tiny random model in the released layout
(`save_tiny`: ImageReward.pt with blip.visual_encoder.* / blip.text_encoder.* / mlp.layers.* names,
med_config.json, a BERT vocab.txt).

Two references:
  * the `image-reward` 1.5 package itself (its BLIP VisionTransformer, med.BertModel, BLIP_Pretrain, MLP and
    ImageReward.score / inference_rank), imported from an unpacked wheel: $IMAGE_REWARD_SRC, /tmp/ir/src or
    /tmp/ir (the folder holding `ImageReward/`; `pip download --no-deps image-reward==1.5 -d /tmp/ir &&
    unzip /tmp/ir/image_reward-1.5-py3-none-any.whl -d /tmp/ir/src`). Skipped when there is none. Its
    imports need timm, fairscale and torchvision, which this environment lacks, and med.py imports three
    helpers that transformers 4.57 moved from modeling_utils to pytorch_utils; the test stands in for them
    while it imports the package (see `package`): timm's PatchEmbed (a strided Conv2d, flattened to tokens,
    no norm), DropPath (identity in eval mode), trunc_normal_ (torch's); fairscale's checkpoint_wrapper and
    torchvision's transforms are only named, never run (the package's preprocess is replaced by
    `pil_pixels`, torchvision's PIL path written out). Everything else that runs is the package's code.
  * an independent float64 numpy forward of the published architecture (always runs), on the checkpoint's
    own tensor names.
Also: the pixels against torchvision's PIL path, the tokenizer's ids ([CLS] first, not [ENC]), batching,
ViT-L + med_config's real layout, NaN for non-finite scores, one-line errors and input_problems."""
import contextlib
import copy
import importlib
import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip('torch')
Image = pytest.importorskip('PIL.Image')
special = pytest.importorskip('scipy.special')

# pylint: disable=g-import-not-at-top,g-bad-import-order
from ddrl_jax.rewards import imagereward as ir
from ddrl_jax.rewards import registry
# pylint: enable=g-import-not-at-top,g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME, TARGET = 'imagereward', 'ddrl_jax.rewards.imagereward:ImageReward'   # checked once registered
PROMPTS = ['a cat', '', 'a red dog sitting on the table ' * 6, 'The Photo of a BIG cat!', 'zebra [ENC] x']
MEAN, STD = np.array(ir.MEAN), np.array(ir.STD)
# med_config.json of THUDM/ImageReward (BLIP's).
REAL_MED = {'architectures': ['BertModel'], 'attention_probs_dropout_prob': 0.1, 'hidden_act': 'gelu',
            'hidden_dropout_prob': 0.1, 'hidden_size': 768, 'initializer_range': 0.02,
            'intermediate_size': 3072, 'layer_norm_eps': 1e-12, 'max_position_embeddings': 512,
            'model_type': 'bert', 'num_attention_heads': 12, 'num_hidden_layers': 12, 'pad_token_id': 0,
            'type_vocab_size': 2, 'vocab_size': 30524, 'encoder_width': 768, 'add_cross_attention': True}


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
  return ir.save_tiny(str(tmp_path_factory.mktemp('imagereward')), seed=1)


@pytest.fixture(scope='module')
def reward(tiny):
  return ir.ImageReward(**tiny, batch_size=3)


@pytest.fixture(scope='module')
def params(tiny):
  """The tiny checkpoint's tensors as float64 numpy (ImageReward.pt names), read here with torch.load."""
  state = torch.load(tiny['checkpoint'], map_location='cpu', weights_only=True)
  return {k: v.double().numpy() for k, v in state.items()}


def images(m=5, h=41, w=57, seed=0):
  """(m, h, w, 3) uint8: gradients, noise and a white band (sharp edges: bicubic overshoot)."""
  rng = np.random.RandomState(seed)
  yy, xx = np.mgrid[0:h, 0:w]
  base = np.stack([xx / w, yy / h, (xx + yy) / (h + w)], -1) * 180
  x = np.clip(base[None] + rng.randint(0, 70, (m, h, w, 3)), 0, 255).astype(np.uint8)
  x[:, :, : max(w // 4, 1)] = 255
  return x


def one_line(excinfo, *words):
  msg = str(excinfo.value)
  assert '\n' not in msg, msg
  for w in words:
    assert w in msg, (w, msg)


# ------------------------------------------------------------------------------------------ pixels
def pil_image_pixels(img, size):
  """torchvision's Resize(size, BICUBIC), CenterCrop(size), ToTensor, Normalize on a PIL image, written out:
  PIL bicubic to short side `size` (long side truncated; no resize when already that size), crop offsets
  int(round(excess / 2)) -> (3, size, size) float64."""
  w, h = img.size
  nw, nh = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
  if (nw, nh) != (w, h):
    img = img.resize((nw, nh), Image.BICUBIC)
  top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
  a = np.asarray(img.convert('RGB').crop((left, top, left + size, top + size)), np.float64) / 255.0
  return ((a - MEAN) / STD).transpose(2, 0, 1)


def pil_pixels(x, size):
  return np.stack([pil_image_pixels(Image.fromarray(a), size) for a in x])


@pytest.mark.parametrize('shape', [(41, 57), (57, 41), (20, 22), (32, 45), (64, 64), (32, 32), (7, 90)])
def test_pixels_are_torchvision_pil_path(shape):
  """Upscaling, downscaling, an odd crop excess (3: offset 2, half to even), short side already 32."""
  x = images(m=2, h=shape[0], w=shape[1], seed=3)
  got = ir.pixels(x, 32).numpy()
  assert got.shape == (2, 3, 32, 32) and got.dtype == np.float32
  np.testing.assert_allclose(got, pil_pixels(x, 32), atol=2e-6)


def test_crop_rounds_half_to_even():
  """(20, 22) -> 32 x 35: excess 3, torchvision's offset round(1.5) = 2 (a floor would give 1)."""
  x = images(m=1, h=20, w=22, seed=4)
  resized = ir.pil_resized(x, 32)
  assert resized.shape == (1, 32, 35, 3)
  want = (resized[0, :, 2:34].astype(np.float64) / 255.0 - MEAN) / STD
  np.testing.assert_allclose(ir.pixels(x, 32).numpy()[0], want.transpose(2, 0, 1), atol=2e-6)


# ------------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_ids(tiny, reward):
  """BERT uncased wordpieces, [CLS] first (ImageReward does not write [ENC] there), [SEP], padded with 0 to
  35, truncated to 35 with [SEP] last; [DEC] / [ENC] added after the vocabulary and matched in text."""
  with open(os.path.join(tiny['tokenizer'], 'vocab.txt'), encoding='utf-8') as f:
    vocab = {t: i for i, t in enumerate(f.read().split())}
  tok = reward.tokenizer
  assert tok.size == len(vocab) + 2 == json.load(open(tiny['med_config']))['vocab_size']
  dec, enc = len(vocab), len(vocab) + 1
  assert tok.enc_token_id == enc and tok.tokenizer.convert_tokens_to_ids('[DEC]') == dec
  ids, mask = tok(['The CATs sitting!', '', 'zebra [ENC]', 'cat ' * 50])
  assert ids.shape == mask.shape == (4, 35) and ids.dtype == torch.long
  cls, sep, unk = vocab['[CLS]'], vocab['[SEP]'], vocab['[UNK]']
  want = [cls, vocab['the'], vocab['cat'], vocab['##s'], vocab['sit'], vocab['##ting'], vocab['!'], sep]
  assert ids[0, :8].tolist() == want and ids[0, 8:].eq(0).all() and mask[0].sum() == 8
  assert ids[1, :2].tolist() == [cls, sep] and mask[1].sum() == 2
  assert ids[2, :4].tolist() == [cls, unk, enc, sep]
  assert ids[3].tolist() == [cls] + [vocab['cat']] * 33 + [sep] and mask[3].all()


# ------------------------------------------------------------------------------------------ numpy reference
def np_ln(x, w, b, eps):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * w + b


def np_gelu(x):
  return 0.5 * x * (1.0 + special.erf(x / math.sqrt(2.0)))


def np_attention(q, k, v, heads, bias=0.0):
  """softmax(q k^T / sqrt(d) + bias) v per head; q (B, L, D), k / v (B, N, D)."""
  b, _, d = q.shape
  hd = d // heads
  split = lambda t: t.reshape(b, -1, heads, hd).transpose(0, 2, 1, 3)
  s = split(q) @ split(k).transpose(0, 1, 3, 2) / math.sqrt(hd) + bias
  s = np.exp(s - s.max(-1, keepdims=True))
  return ((s / s.sum(-1, keepdims=True)) @ split(v)).transpose(0, 2, 1, 3).reshape(b, -1, d)


def np_score(p, x, ids, mask, vision, med):
  """The published forward in float64: BLIP's ViT (pre-norm, eps 1e-6) -> BERT layers (self-attention,
  cross-attention to all image tokens, feed-forward; post-norm) -> token 0 -> MLP -> z-score."""
  lin = lambda t, name: t @ p[name + '.weight'].T + p[name + '.bias']
  v, t = 'blip.visual_encoder.', 'blip.text_encoder.'
  b, size, patch, width = x.shape[0], vision['image_size'], vision['patch_size'], vision['width']
  g = size // patch
  rows = x.reshape(b, 3, g, patch, g, patch).transpose(0, 2, 4, 1, 3, 5).reshape(b, g * g, -1)
  h = rows @ p[v + 'patch_embed.proj.weight'].reshape(width, -1).T + p[v + 'patch_embed.proj.bias']
  h = np.concatenate([np.broadcast_to(p[v + 'cls_token'], (b, 1, width)), h], 1) + p[v + 'pos_embed']
  for i in range(vision['layers']):
    blk = f'{v}blocks.{i}.'
    y = np_ln(h, p[blk + 'norm1.weight'], p[blk + 'norm1.bias'], 1e-6)
    q, k, val = np.split(lin(y, blk + 'attn.qkv'), 3, axis=-1)
    h = h + lin(np_attention(q, k, val, vision['heads']), blk + 'attn.proj')
    y = np_ln(h, p[blk + 'norm2.weight'], p[blk + 'norm2.bias'], 1e-6)
    h = h + lin(np_gelu(lin(y, blk + 'mlp.fc1')), blk + 'mlp.fc2')
  image = np_ln(h, p[v + 'norm.weight'], p[v + 'norm.bias'], 1e-6)
  eps, heads = med['layer_norm_eps'], med['num_attention_heads']
  e = p[t + 'embeddings.word_embeddings.weight'][ids] + p[t + 'embeddings.position_embeddings.weight'][
      :ids.shape[1]]
  h = np_ln(e, p[t + 'embeddings.LayerNorm.weight'], p[t + 'embeddings.LayerNorm.bias'], eps)
  bias = (1.0 - mask[:, None, None, :]) * -10000.0
  for i in range(med['num_hidden_layers']):
    layer = f'{t}encoder.layer.{i}.'
    for part, keys, extra in (('attention', None, bias), ('crossattention', image, 0.0)):
      src = h if keys is None else keys
      a = np_attention(lin(h, f'{layer}{part}.self.query'), lin(src, f'{layer}{part}.self.key'),
                       lin(src, f'{layer}{part}.self.value'), heads, extra)
      h = np_ln(lin(a, f'{layer}{part}.output.dense') + h, p[f'{layer}{part}.output.LayerNorm.weight'],
                p[f'{layer}{part}.output.LayerNorm.bias'], eps)
    y = lin(np_gelu(lin(h, layer + 'intermediate.dense')), layer + 'output.dense')
    h = np_ln(y + h, p[layer + 'output.LayerNorm.weight'], p[layer + 'output.LayerNorm.bias'], eps)
  y = h[:, 0]
  for i in (0, 2, 4, 6, 7):
    y = lin(y, f'mlp.layers.{i}')
  return (y[:, 0] - 0.16717362830052426) / 1.0333394966054072


def test_parity_with_numpy_reference(tiny, reward, params):
  x = images(m=5, seed=2)
  got = reward(x, PROMPTS)
  ids, mask = (t.numpy() for t in reward.tokenizer(PROMPTS))
  want = np_score(params, pil_pixels(x, 32), ids, mask.astype(np.float64), tiny['vision_cfg'],
                  ir.read_med_config(tiny['med_config']))
  assert got.shape == (5,) and got.dtype == np.float32 and np.ptp(want) > 0.05, (got, want)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_batching_and_own_prompt_pairing(tiny, reward):
  """Batch size does not change a score; each image is scored with its own prompt (the diagonal)."""
  x = images(m=5, seed=5)
  got = reward(x, PROMPTS)
  np.testing.assert_allclose(ir.ImageReward(**tiny, batch_size=1)(x, PROMPTS), got, atol=2e-6)
  np.testing.assert_allclose(ir.ImageReward(**tiny, batch_size=5)(x, PROMPTS), got, atol=2e-6)
  order = [3, 1, 4, 0, 2]
  np.testing.assert_allclose(reward(x[order], [PROMPTS[i] for i in order]), got[order], atol=2e-6)
  swapped = reward(x, PROMPTS[::-1])
  assert not np.allclose(swapped, got, atol=1e-4)


# ------------------------------------------------------------------------------------------ package
def package_root():
  for root in (os.environ.get('IMAGE_REWARD_SRC'), '/tmp/ir/src', '/tmp/ir'):
    if root and os.path.isfile(os.path.join(root, 'ImageReward', 'models', 'BLIP', 'med.py')):
      return root
  return None


def _stand_ins(nn):
  """{module name: module} standing in for what the package imports and this environment lacks."""

  class PatchEmbed(nn.Module):
    """timm's PatchEmbed (flatten, no norm): Conv2d(patch, stride patch) -> (B, grid**2, embed_dim)."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768):
      super().__init__()
      self.img_size, self.patch_size = (img_size, img_size), (patch_size, patch_size)
      self.grid_size = (img_size // patch_size, img_size // patch_size)
      self.num_patches = self.grid_size[0] * self.grid_size[1]
      self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
      self.norm = nn.Identity()

    def forward(self, x):
      assert tuple(x.shape[-2:]) == self.img_size, x.shape
      return self.norm(self.proj(x).flatten(2).transpose(1, 2))

  class DropPath(nn.Module):
    """timm's DropPath in eval mode (the only mode used here): the identity."""

    def __init__(self, drop_prob=0.0):
      super().__init__()
      self.drop_prob = drop_prob

    def forward(self, x):
      assert not self.training
      return x

  def never(*args, **kwargs):
    raise AssertionError(f'stand-in called: {args} {kwargs}')

  class Named:
    def __init__(self, *args, **kwargs):
      del args, kwargs

    __call__ = never

  def module(name, **attrs):
    m = types.ModuleType(name)
    m.__path__ = []
    m.__stand_in__ = True
    m.__dict__.update(attrs)
    return m

  return {
      'timm': module('timm'), 'timm.models': module('timm.models'),
      'timm.models.vision_transformer': module('timm.models.vision_transformer', _cfg=never,
                                               PatchEmbed=PatchEmbed),
      'timm.models.registry': module('timm.models.registry', register_model=lambda f: f),
      'timm.models.layers': module('timm.models.layers', trunc_normal_=torch.nn.init.trunc_normal_,
                                   DropPath=DropPath),
      'timm.models.helpers': module('timm.models.helpers', named_apply=never, adapt_input_conv=never),
      'timm.models.hub': module('timm.models.hub', download_cached_file=never),
      'fairscale': module('fairscale'), 'fairscale.nn': module('fairscale.nn'),
      'fairscale.nn.checkpoint': module('fairscale.nn.checkpoint'),
      'fairscale.nn.checkpoint.checkpoint_activations': module(
          'fairscale.nn.checkpoint.checkpoint_activations', checkpoint_wrapper=never),
      'torchvision': module('torchvision'),
      'torchvision.transforms': module('torchvision.transforms', Compose=Named, Resize=Named,
                                       CenterCrop=Named, ToTensor=Named, Normalize=Named,
                                       InterpolationMode=types.SimpleNamespace(BICUBIC='bicubic')),
  }


@contextlib.contextmanager
def package_modules(root):
  """The package's ImageReward.ImageReward, BLIP.blip, BLIP.blip_pretrain and BLIP.vit modules, imported
  from `root` with the stand-ins; sys.modules and transformers are restored afterwards."""
  import transformers.modeling_utils as modeling_utils
  import transformers.pytorch_utils as pytorch_utils
  with pytest.MonkeyPatch.context() as mp:
    for name, mod in _stand_ins(torch.nn).items():
      mp.setitem(sys.modules, name, mod)
    for name in ('apply_chunking_to_forward', 'find_pruneable_heads_and_indices', 'prune_linear_layer'):
      mp.setattr(modeling_utils, name, getattr(pytorch_utils, name), raising=False)
    for pkg in ('ImageReward', 'ImageReward.models', 'ImageReward.models.BLIP'):   # skip the __init__s
      stub = types.ModuleType(pkg)
      stub.__path__ = [os.path.join(root, *pkg.split('.'))]
      mp.setitem(sys.modules, pkg, stub)
    mp.syspath_prepend(root)
    try:
      names = ('ImageReward.models.BLIP.vit', 'ImageReward.models.BLIP.med', 'ImageReward.models.BLIP.blip',
               'ImageReward.models.BLIP.blip_pretrain', 'ImageReward.ImageReward')
      yield types.SimpleNamespace(**{n.rsplit('.', 1)[1]: importlib.import_module(n) for n in names})
    finally:
      for name in [n for n in sys.modules if n == 'ImageReward' or n.startswith('ImageReward.')]:
        del sys.modules[name]


@pytest.fixture(scope='module')
def package(tiny):
  """The package's ImageReward module built on the tiny files: its real ImageReward.__init__ and
  BLIP_Pretrain.__init__ (med_config read by BertConfig.from_json_file, encoder_width set to the ViT's,
  med.BertModel without pooler, init_tokenizer) with create_vit giving the tiny VisionTransformer of the
  package (drop path 0.1, as 'large') and bert-base-uncased read from the tiny vocabulary; MLP(32) for the
  hard-coded MLP(768); then utils.load's torch.load + load_state_dict(strict=False), eval."""
  root = package_root()
  if root is None:
    pytest.skip('no unpacked image-reward 1.5 wheel ($IMAGE_REWARD_SRC, /tmp/ir/src or /tmp/ir)')
  vision = tiny['vision_cfg']
  try:
    with package_modules(root) as pkg, pytest.MonkeyPatch.context() as mp:
      base = pkg.blip.BertTokenizer

      class LocalBert(base):
        @classmethod
        def from_pretrained(cls, name, *args, **kwargs):
          assert name == 'bert-base-uncased', name
          return base.from_pretrained(tiny['tokenizer'], *args, **kwargs)

      def create_vit(vit, image_size, *args):
        assert (vit, image_size) == ('large', 224)
        del args
        return pkg.vit.VisionTransformer(
            img_size=vision['image_size'], patch_size=vision['patch_size'], embed_dim=vision['width'],
            depth=vision['layers'], num_heads=vision['heads'], mlp_ratio=vision['mlp_ratio'],
            drop_path_rate=0.1), vision['width']

      mp.setattr(pkg.blip, 'BertTokenizer', LocalBert)
      mp.setattr(pkg.blip_pretrain, 'create_vit', create_vit)
      model = pkg.ImageReward.ImageReward(med_config=tiny['med_config'], device='cpu')
      model.mlp = pkg.ImageReward.MLP(model.blip.text_encoder.config.hidden_size)
      msg = model.load_state_dict(torch.load(tiny['checkpoint'], map_location='cpu'), strict=False)
  except ImportError as e:
    pytest.skip(f'the image-reward package does not import here: {e}')
  assert not msg.missing_keys and not msg.unexpected_keys, msg
  model.eval()
  model.preprocess = lambda img: torch.from_numpy(pil_image_pixels(img, vision['image_size'])).float()
  return model


def test_parity_with_package(reward, package):
  """The package's ImageReward.score (flow_grpo's path: one image, its prompt) and inference_rank over all
  prompts (cosmos-rl / DiffusionNFT: B x B, the diagonal), float32."""
  x = images(m=5, seed=6)
  got = reward(x, PROMPTS)
  pil = [Image.fromarray(a) for a in x]
  with torch.no_grad():
    want = np.array([package.score(p, img) for p, img in zip(PROMPTS, pil)])
    _, grid = package.inference_rank(PROMPTS, pil)
  ids = package.blip.tokenizer(PROMPTS, padding='max_length', truncation=True, max_length=35,
                               return_tensors='pt').input_ids
  assert torch.equal(reward.tokenizer(PROMPTS)[0], ids)
  assert np.ptp(want) > 0.05, want
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got, np.diagonal(np.reshape(grid, (5, 5))), rtol=1e-5, atol=1e-6)
  print('max relative difference to the package:', float(np.max(np.abs(got - want) / np.abs(want))))
  import transformers.modeling_utils as modeling_utils   # the stand-ins are gone again
  left = [n for n, m in list(sys.modules.items())
          if isinstance(m, types.ModuleType) and vars(m).get('__stand_in__') is True]
  assert not left, left
  assert 'ImageReward' not in sys.modules and not hasattr(modeling_utils, 'prune_linear_layer')


# ------------------------------------------------------------------------------------------ layout
def test_vit_large_and_med_config_layout(tmp_path):
  """The default model: ViT-L/16 at 224 and THUDM's med_config.json: 620 tensors (position_ids and the
  unused projections aside), 446,206,689 numbers, in ImageReward.pt's names; built on the meta device."""
  path = tmp_path / 'med_config.json'
  path.write_text(json.dumps(REAL_MED))
  med = ir.read_med_config(str(path))
  assert ir.vision_config() == ir.VIT_LARGE
  shapes = ir.checkpoint_names(med)
  assert len(shapes) == 620 and sum(math.prod(s) for s in shapes.values()) == 446_206_689
  v, t = 'blip.visual_encoder.', 'blip.text_encoder.'
  for name, shape in {v + 'cls_token': (1, 1, 1024), v + 'pos_embed': (1, 197, 1024),
                      v + 'patch_embed.proj.weight': (1024, 3, 16, 16),
                      v + 'blocks.23.attn.qkv.weight': (3072, 1024), v + 'blocks.23.attn.proj.bias': (1024,),
                      v + 'blocks.0.mlp.fc1.weight': (4096, 1024), v + 'norm.weight': (1024,),
                      t + 'embeddings.word_embeddings.weight': (30524, 768),
                      t + 'embeddings.position_embeddings.weight': (512, 768),
                      t + 'encoder.layer.11.crossattention.self.key.weight': (768, 1024),
                      t + 'encoder.layer.11.crossattention.output.LayerNorm.bias': (768,),
                      t + 'encoder.layer.0.attention.self.query.weight': (768, 768),
                      t + 'encoder.layer.5.output.dense.weight': (768, 3072),
                      'mlp.layers.0.weight': (1024, 768), 'mlp.layers.7.weight': (1, 16)}.items():
    assert shapes[name] == shape, name
  for name in shapes:
    part, hf = ir.hf_name(name)
    assert ir.ir_name(part, hf) == name
  assert ir.hf_name(t + 'embeddings.position_ids') is None and ir.hf_name('blip.text_proj.weight') is None


# ------------------------------------------------------------------------------------------ failures
def test_non_finite_and_failing_images_are_nan(tiny, reward, tmp_path, monkeypatch):
  state = torch.load(tiny['checkpoint'], weights_only=True)
  state['mlp.layers.7.bias'][0] = float('inf')
  path = str(tmp_path / 'inf.pt')
  torch.save(state, path)
  got = ir.ImageReward(**dict(tiny, checkpoint=path))(images(m=2), ['a', 'b'])
  assert got.shape == (2,) and np.isnan(got).all()
  x = images(m=5, seed=9)
  x[2] = 7
  good = reward(x, PROMPTS)
  raw = ir.ImageReward.raw

  def fragile(self, samples, prompts):
    if (samples == 7).all(axis=(1, 2, 3)).any():
      raise RuntimeError('boom')
    return raw(self, samples, prompts)

  monkeypatch.setattr(ir.ImageReward, 'raw', fragile)
  got = reward(x, PROMPTS)
  assert np.isnan(got[2]) and not np.isnan(np.delete(got, 2)).any()
  np.testing.assert_allclose(np.delete(got, 2), np.delete(good, 2), atol=2e-6)


def test_bad_inputs_one_line(reward):
  x = images(m=2)
  for bad in (x.astype(np.float32), x[..., 0], x[:, :, :, :2], np.zeros((2, 0, 5, 3), np.uint8)):
    with pytest.raises(ValueError) as e:
      reward(bad, ['a', 'b'])
    one_line(e, 'imagereward', 'uint8 RGB images (M, H, W, 3)')
  with pytest.raises(ValueError) as e:
    reward(x, ['a'])
  one_line(e, 'imagereward', '1 prompts for 2 images')
  with pytest.raises(ValueError) as e:
    reward(x, ['a', None])
  one_line(e, 'imagereward', 'not a string')
  assert reward(x[:0], []).shape == (0,)


def test_bad_kwargs_and_files_one_line(tiny, tmp_path):
  for kwargs, words in (({}, ['no checkpoint', 'ImageReward.pt']),
                        ({**tiny, 'med_config': None}, ['no med_config']),
                        ({**tiny, 'tokenizer': ''}, ['no tokenizer', 'bert-base-uncased']),
                        ({**tiny, 'batch_size': 0}, ['batch_size 0']),
                        ({**tiny, 'dtype': 'bfloat16', 'device': 'cpu'}, ['CUDA']),
                        ({**tiny, 'vision_cfg': {**tiny['vision_cfg'], 'qkv_bias': False}},
                         ['vision_cfg.qkv_bias is not supported'])):
    with pytest.raises(ValueError) as e:
      ir.ImageReward(**kwargs)
    one_line(e, 'imagereward', *words)
  missing = str(tmp_path / 'nowhere.pt')
  with pytest.raises(ir.CheckpointError) as e:
    ir.ImageReward(**dict(tiny, checkpoint=missing))
  one_line(e, f'imagereward checkpoint {missing}: no such file')
  junk = str(tmp_path / 'junk.pt')
  torch.save({'model': {'a': torch.zeros(1)}}, junk)      # BLIP's own checkpoint layout
  with pytest.raises(ir.CheckpointError) as e:
    ir.ImageReward(**dict(tiny, checkpoint=junk))
  one_line(e, 'imagereward checkpoint', 'not a state dict')
  state = torch.load(tiny['checkpoint'], weights_only=True)
  odd = dict(state)
  del odd['mlp.layers.7.bias'], odd['blip.visual_encoder.norm.bias']
  odd['blip.visual_encoder.head.weight'] = torch.zeros(2)
  odd['blip.itm_head.weight'] = torch.zeros(2)             # outside the used prefixes: ignored
  path = str(tmp_path / 'odd.pt')
  torch.save(odd, path)
  with pytest.raises(ir.CheckpointError) as e:
    ir.ImageReward(**dict(tiny, checkpoint=path))
  one_line(e, 'imagereward checkpoint', "2 missing (e.g. 'blip.visual_encoder.norm.bias')",
           "1 unexpected (e.g. 'blip.visual_encoder.head.weight')")
  torch.save(dict(state, **{'mlp.layers.0.weight': torch.zeros(1024, 8)}), path)
  with pytest.raises(ir.CheckpointError) as e:
    ir.ImageReward(**dict(tiny, checkpoint=path))
  one_line(e, "1 shapes differ, e.g. 'mlp.layers.0.weight' (1024, 8), not (1024, 32)")
  with pytest.raises(ir.CheckpointError) as e:
    ir.ImageReward(**dict(tiny, vision_cfg=None))
  one_line(e, 'imagereward checkpoint', 'does not match the ViT-L/16 + med_config ImageReward', 'missing')
  bad_med = tmp_path / 'med.json'
  bad_med.write_text(json.dumps(dict(json.load(open(tiny['med_config'])), add_cross_attention=False)))
  with pytest.raises(ir.CheckpointError) as e:
    ir.ImageReward(**dict(tiny, med_config=str(bad_med)))
  one_line(e, f'imagereward med_config {bad_med}', 'add_cross_attention')
  for text, words in (('[1]', 'is not a JSON object'), ('{', 'cannot be read')):
    bad_med.write_text(text)
    with pytest.raises(ir.CheckpointError) as e:
      ir.ImageReward(**dict(tiny, med_config=str(bad_med)))
    one_line(e, f'imagereward med_config {bad_med}: {words}')
  with pytest.raises(ir.CheckpointError) as e:
    ir.ImageReward(**dict(tiny, med_config=missing))
  one_line(e, f'imagereward med_config {missing}: no such file')
  small = tmp_path / 'small.json'
  small.write_text(json.dumps(dict(json.load(open(tiny['med_config'])), vocab_size=10)))
  with pytest.raises(ir.CheckpointError) as e:
    ir.ImageReward(**dict(tiny, med_config=str(small)))
  vocab = len(ir.TINY_BERT_TOKENS) + len(ir.TINY_WORDS) + 2
  one_line(e, 'imagereward checkpoint', f"'blip.text_encoder.embeddings.word_embeddings.weight' ({vocab}, 32), "
           'not (10, 32)')


def test_extra_unused_tensors_are_ignored(tiny, reward, tmp_path):
  """As the reference's strict=False: tensors outside visual_encoder / text_encoder / mlp are not read."""
  state = torch.load(tiny['checkpoint'], weights_only=True)
  state['blip.itm_head.weight'] = torch.zeros(2, 32)
  del state['blip.text_proj.weight'], state['blip.text_encoder.embeddings.position_ids']
  path = str(tmp_path / 'extra.pt')
  torch.save(state, path)
  x = images(m=2, seed=8)
  np.testing.assert_allclose(ir.ImageReward(**dict(tiny, checkpoint=path))(x, PROMPTS[:2]),
                             reward(x, PROMPTS[:2]), atol=1e-7)


def test_input_problems(tiny, tmp_path):
  assert ir.input_problems(tiny) == []
  assert ir.input_problems({}) == [
      'imagereward: config.reward.kwargs.imagereward.checkpoint is not set (ImageReward.pt of '
      'THUDM/ImageReward)',
      'imagereward: config.reward.kwargs.imagereward.med_config is not set (med_config.json of '
      'THUDM/ImageReward)',
      'imagereward: config.reward.kwargs.imagereward.tokenizer is not set (a local bert-base-uncased folder '
      'with vocab.txt)']
  missing = str(tmp_path / 'nowhere')
  problems = ir.input_problems({'checkpoint': missing, 'med_config': missing, 'tokenizer': missing,
                                'vision_cfg': {'image_size': 30, 'patch_size': 16}})
  assert problems == [f'imagereward checkpoint {missing}: no such file (ImageReward.pt of THUDM/ImageReward)',
                      f'imagereward med_config {missing}: no such file (med_config.json of '
                      'THUDM/ImageReward)',
                      f'imagereward tokenizer {missing}: no vocab.txt (a local bert-base-uncased folder with '
                      'vocab.txt)',
                      problems[3]]
  assert 'image_size 30 must be a multiple of patch_size 16' in problems[3]
  if NAME in registry.BUILTIN:
    assert registry.BUILTIN[NAME] == TARGET
    assert registry.INPUT_CHECKS[NAME] == 'ddrl_jax.rewards.imagereward:input_problems'
    assert registry.score_bound(NAME) == (-10.0, 10.0)
    assert registry.input_problems(NAME, {'checkpoint': missing})
    assert isinstance(registry.make_reward(NAME, **copy.deepcopy(tiny)), ir.ImageReward)


def test_module_imports_without_torch():
  code = ('import sys; sys.modules["torch"] = sys.modules["transformers"] = sys.modules["PIL"] = None; '
          'import ddrl_jax.rewards.imagereward as m; print(m.input_problems({}))')
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert 'imagereward' in out.stdout
