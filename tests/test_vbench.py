"""VBench reward (ddrl_jax/rewards/vbench.py) on tiny random backbones (`vbench.save_tiny`), saved in the
reference checkpoint formats and read back by the reward's loaders: each dimension's score against an
independent computation of its formula (numpy on features from a separate model: transformers' ViT for DINO,
the saved TorchScript CLIP archives themselves, AMT-S run by hand, pyiqa's own MUSIQ), the preprocessing
(sizes, crops, the 512 rule, the AMT padding), DINO's +0.1 positional interpolation against an explicit
bicubic, the AMT frame pairing, input and weights errors, NaN for a failing video, the registry names,
that the module imports without torch, and save_tiny's weights scoring small videos through the registry.

Needs the reward's own packages (openai-clip 1.0.1; vbench 0.1.5 installed with --no-deps, for AMT-S) and
pyiqa 0.1.16 (installed with --no-deps), the MUSIQ reference: its archs import torchvision, which cannot be
imported beside this CPU torch, so its musiq_arch is loaded with a stand-in torchvision (never called) and
without running the pyiqa/__init__.py chain."""
import functools
import importlib
import importlib.util
import logging
import math
import os
import shutil
import subprocess
import sys
import time
import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

# The references that cannot be pip dependencies of the test extra (--no-deps installs, see .ci/run): skip
# without them, or fail where DDRL_REQUIRE_VBENCH is set (CI).
for _module, _install in (('vbench', 'pip install --no-deps vbench==0.1.5'),
                          ('pyiqa', 'pip install --no-deps pyiqa==0.1.16')):
  if importlib.util.find_spec(_module) is None:
    if os.environ.get('DDRL_REQUIRE_VBENCH'):
      pytest.fail(f'{_module} is not installed ({_install}; .ci/run installs it)', pytrace=False)
    pytest.skip(f'{_module} is not installed ({_install})', allow_module_level=True)

# pylint: disable=g-import-not-at-top,g-bad-import-order
from ddrl_jax import rewards
from ddrl_jax.rewards import vbench as vb
# pylint: enable=g-import-not-at-top,g-bad-import-order

F = torch.nn.functional
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
CLIP_NORM = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
DINO_DEPTH = vb.TINY_DINO['depth']


# -------------------------------------------------------------------------------------- references
@functools.lru_cache(maxsize=None)
def pyiqa_modules():
  """(pyiqa.archs.musiq_arch, pyiqa.data.multiscale_trans_util), imported with bare parent packages and a
  stand-in torchvision (arch_util imports torchvision.transforms at module level and never uses it here)."""
  spec = importlib.util.find_spec('pyiqa')
  assert spec is not None, 'these tests compare against pyiqa: pip install --no-deps pyiqa==0.1.16'
  root = spec.submodule_search_locations[0]
  stand_ins = {}
  for name in ('pyiqa', 'pyiqa.archs', 'pyiqa.utils', 'pyiqa.data'):
    module = types.ModuleType(name)
    module.__path__ = [os.path.join(root, *name.split('.')[1:])]
    stand_ins[name] = module
  if 'torchvision' not in sys.modules:
    tv = types.ModuleType('torchvision')
    tv.transforms = types.ModuleType('torchvision.transforms')
    stand_ins.update({'torchvision': tv, 'torchvision.transforms': tv.transforms})
  sys.modules.update(stand_ins)
  try:
    return (importlib.import_module('pyiqa.archs.musiq_arch'),
            importlib.import_module('pyiqa.data.multiscale_trans_util'))
  finally:
    for name, module in stand_ins.items():
      if sys.modules.get(name) is module:
        del sys.modules[name]


def consistency_np(features):
  """The consistency formula in numpy float64 on (F, D) features."""
  f = np.asarray(features, np.float64)
  f = f / np.linalg.norm(f, axis=-1, keepdims=True)
  previous = np.sum(f[:-1] * f[1:], axis=-1)
  first = f[1:] @ f[0]
  return np.mean((np.maximum(previous, 0) + np.maximum(first, 0)) / 2)


def cubic_matrix(n_in, n_out, scale):
  """(n_out, n_in) weights of torch's bicubic resampling (A = -0.75, align_corners=False, edge indices
  clamped) when the scale factor `scale` (not the size) sets the sampling positions."""
  a = -0.75

  def kernel(t):
    t = abs(t)
    if t <= 1:
      return ((a + 2) * t - (a + 3)) * t * t + 1
    return ((a * t - 5 * a) * t + 8 * a) * t - 4 * a if t < 2 else 0.0

  m = np.zeros((n_out, n_in))
  for d in range(n_out):
    src = (d + 0.5) / scale - 0.5
    base = math.floor(src)
    for k in range(-1, 3):
      m[d, min(max(base + k, 0), n_in - 1)] += kernel(src - (base + k))
  return m


def normalized(x, norm):
  mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in norm)
  return (x - mean) / std


def frames_float(video):
  """(F, H, W, 3) uint8 -> (F, 3, H, W) float32 0..255."""
  return torch.from_numpy(video).permute(0, 3, 1, 2).float()


def random_videos(seed, shape):
  rng = np.random.default_rng(seed)
  return rng.integers(0, 256, shape, dtype=np.uint8)


def smooth_videos(seed, m, f, h, w):
  """(m, f, h, w, 3) uint8: a random low-resolution pattern, upsampled and drifting a little per frame."""
  rng = np.random.default_rng(seed)
  base = rng.uniform(0, 255, (m, 1, 3, h // 4 + 2, w // 4 + 2)).astype(np.float32)
  out = []
  for i in range(f):
    frame = F.interpolate(torch.from_numpy(base[:, 0]), size=(h + 8, w + 8), mode='bilinear')
    out.append(frame[:, :, i:i + h, i:i + w].permute(0, 2, 3, 1).numpy())
  return np.stack(out, 1).round().clip(0, 255).astype(np.uint8)


# ------------------------------------------------------------------------------ tiny backbones
def pyiqa_musiq(hidden, mlp_dim, layers, stem, classes=1):
  """pyiqa's MUSIQ (eval mode, as VBench sets it) of these sizes, random; a stem narrower than pyiqa's fixed
  64 is built from pyiqa's own modules (its forward reads no width)."""
  musiq_arch, _ = pyiqa_modules()
  model = musiq_arch.MUSIQ(pretrained=False, num_class=classes, hidden_size=hidden, mlp_dim=mlp_dim,
                           num_heads=hidden // 64, num_layers=layers)
  if stem != 64:
    model.conv_root = musiq_arch.StdConv(3, stem, 7, 2, bias=False)
    model.gn_root = torch.nn.GroupNorm(32, stem, eps=1e-6)
    model.block1 = musiq_arch.Bottleneck(stem, 4 * stem)
    model.embedding = torch.nn.Linear(4 * stem * (model.patch_size // 4)**2, hidden)
  model.training = False
  return model


def hf_vit(state, image_size, pos_embed):
  """transformers' ViTModel holding the DINO weights, with `pos_embed` as its (fixed-size) positions."""
  d = state['cls_token'].shape[-1]
  cfg = transformers.ViTConfig(hidden_size=d, num_hidden_layers=DINO_DEPTH, num_attention_heads=d // 64,
                               intermediate_size=4 * d, hidden_act='gelu', layer_norm_eps=1e-6,
                               image_size=image_size, patch_size=16, qkv_bias=True,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                               attn_implementation='eager')
  model = transformers.ViTModel(cfg, add_pooling_layer=False).eval()
  hf = {'embeddings.cls_token': state['cls_token'], 'embeddings.position_embeddings': pos_embed,
        'embeddings.patch_embeddings.projection.weight': state['patch_embed.proj.weight'],
        'embeddings.patch_embeddings.projection.bias': state['patch_embed.proj.bias'],
        'layernorm.weight': state['norm.weight'], 'layernorm.bias': state['norm.bias']}
  for i in range(DINO_DEPTH):
    b, h = f'blocks.{i}.', f'encoder.layer.{i}.'
    for kind in ('weight', 'bias'):
      q, k, v = state[b + 'attn.qkv.' + kind].chunk(3)
      hf.update({h + 'attention.attention.query.' + kind: q, h + 'attention.attention.key.' + kind: k,
                 h + 'attention.attention.value.' + kind: v,
                 h + 'attention.output.dense.' + kind: state[b + 'attn.proj.' + kind],
                 h + 'layernorm_before.' + kind: state[b + 'norm1.' + kind],
                 h + 'layernorm_after.' + kind: state[b + 'norm2.' + kind],
                 h + 'intermediate.dense.' + kind: state[b + 'mlp.fc1.' + kind],
                 h + 'output.dense.' + kind: state[b + 'mlp.fc2.' + kind]})
  model.load_state_dict(hf, strict=True)
  return model


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
  """Every dimension's weights from vbench.save_tiny (random and tiny, AMT-S at full size; the AMT
  checkpoint in VBench's cache layout, amt_model/, the rest flat), and references read back from the files
  without the reward's loaders: the DINO and head tensors, the TorchScript CLIP archives, AMT-S and pyiqa's
  MUSIQ with the saved state dicts (strict)."""
  folder = tmp_path_factory.mktemp('vbench_weights')
  kwargs = vb.save_tiny(str(folder))
  assert kwargs == {'weights_dir': str(folder), 'dimensions': vb.DIMENSIONS}
  t = types.SimpleNamespace(dir=kwargs['weights_dir'])
  load = lambda name: torch.load(folder / name, weights_only=True)
  t.dino = load('dino_vitbase16_pretrain.pth')
  with warnings.catch_warnings():    # TorchScript's deprecation notice: the released files are TorchScript
    warnings.simplefilter('ignore', DeprecationWarning)
    t.clip_b, t.clip_l = torch.jit.load(folder / 'ViT-B-32.pt'), torch.jit.load(folder / 'ViT-L-14.pt')
  t.head = load('sa_0_4_vit_l_14_linear.pth')
  t.amt = vb.import_submodule(vb.AMT_NETWORK).Model(**vb.AMT_CONFIG).eval()
  t.amt.load_state_dict(load(os.path.join('amt_model', 'amt-s.pth'))['state_dict'])
  t.musiq = pyiqa_musiq(**vb.TINY_MUSIQ)
  t.musiq.load_state_dict(load('musiq_spaq_ckpt-358bb6af.pth'), strict=True)
  return t


def reward(tiny, *dimensions, **kwargs):
  return vb.VBenchReward(dimensions=dimensions or vb.DIMENSIONS, weights_dir=tiny.dir, **kwargs)


# --------------------------------------------------------------------------------- preprocessing
def test_preprocessing_sizes_and_crops():
  assert vb.short_side_size(704, 1280) == (224, 407)
  assert vb.short_side_size(1280, 704) == (407, 224)
  assert vb.short_side_size(480, 832) == (224, 388)
  assert vb.short_side_size(224, 224) == (224, 224)
  # torchvision's CenterCrop rounds half the excess half to even: 183 / 2 -> 92, 181 / 2 -> 90.
  assert vb.center_crop_offsets(224, 407) == (0, 92)
  assert vb.center_crop_offsets(224, 405) == (0, 90)
  assert vb.center_crop_offsets(388, 224) == (82, 0)
  # MUSIQ ('longer' mode): only a longer side above 512 is resized, both sides truncated.
  assert vb.musiq_size(704, 1280) == (281, 512)
  assert vb.musiq_size(512, 300) == (512, 300)
  assert vb.musiq_size(300, 400) == (300, 400)
  assert vb.musiq_size(513, 100) == (512, 99)


def test_frame_transforms_match_explicit_torch_ops():
  video = random_videos(0, (2, 30, 50, 3))
  x = frames_float(video)
  # DINO: bilinear to 224 x 373 (no crop), /255, ImageNet mean/std.
  want = normalized(F.interpolate(x, (224, 373), mode='bilinear', align_corners=False) / 255, IMAGENET)
  np.testing.assert_allclose(vb.dino_inputs(x).numpy(), want.numpy(), atol=1e-6)
  # CLIP: bicubic to 224 x 373 (no antialias, no clamp), columns 74..297 (149 / 2 = 74.5 -> 74), CLIP norm.
  resized = F.interpolate(x, (224, 373), mode='bicubic', align_corners=False)
  want = normalized(resized[..., 74:298] / 255, CLIP_NORM)
  got = vb.clip_inputs(x)
  assert got.shape == (2, 3, 224, 224)
  np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)
  assert resized.min() < 0 or resized.max() > 255   # bicubic overshoot is kept, as for VBench's floats
  # MUSIQ: 40 x 600 -> 34 x 512 bilinear, then /255; 30 x 50 passes through.
  tall = frames_float(random_videos(1, (1, 40, 600, 3)))
  want = F.interpolate(tall, (34, 512), mode='bilinear', align_corners=False) / 255
  np.testing.assert_allclose(vb.musiq_inputs(tall).numpy(), want.numpy(), atol=1e-7)
  np.testing.assert_array_equal(vb.musiq_inputs(x).numpy(), (x / 255).numpy())


# ------------------------------------------------------------------------------------------ DINO
def test_dino_position_interpolation_is_bicubic_with_the_plus_0_1_scale():
  pos = torch.randn(1, 197, 8, generator=torch.Generator().manual_seed(0))
  got = vb.dino_pos_embed(pos, 224, 407, 16)                    # a 14 x 25 grid
  assert got.shape == (1, 1 + 14 * 25, 8)
  grid = pos[0, 1:].reshape(14, 14, 8).double().numpy()
  rows, cols = cubic_matrix(14, 14, 14.1 / 14), cubic_matrix(14, 25, 25.1 / 14)
  want = np.einsum('ri,cj,ijd->rcd', rows, cols, grid).reshape(-1, 8)
  np.testing.assert_allclose(got[0, 1:].numpy(), want, atol=2e-5)
  np.testing.assert_array_equal(got[0, 0].numpy(), pos[0, 0].numpy())
  # The offset moves the sampling points: a plain resize to 14 x 25 differs.
  by_size = F.interpolate(pos[:, 1:].reshape(1, 14, 14, 8).permute(0, 3, 1, 2), size=(14, 25), mode='bicubic')
  assert np.abs(by_size.permute(0, 2, 3, 1).reshape(-1, 8).numpy() - want).max() > 1e-3
  # The stored square size is used as stored; another square size is interpolated too (DINO's rule).
  assert vb.dino_pos_embed(pos, 224, 224, 16) is pos
  assert vb.dino_pos_embed(pos, 240, 240, 16).shape == (1, 1 + 15 * 15, 8)


@pytest.mark.parametrize('height,width,hf_size', [(32, 56, (224, 384)), (32, 32, (224, 224))])
def test_subject_consistency_matches_transformers_vit(tiny, height, width, hf_size):
  videos = smooth_videos(0, 2, 3, height, width)
  got = reward(tiny, 'subject_consistency').scores(videos)['subject_consistency']
  params = vb.load_dino(os.path.join(tiny.dir, 'dino_vitbase16_pretrain.pth'), 'cpu')
  want = []
  for video in videos:
    x = frames_float(video)
    size = (224, 224 * width // height)
    x = normalized(F.interpolate(x, size, mode='bilinear', align_corners=False) / 255, IMAGENET)
    pos = vb.dino_pos_embed(tiny.dino['pos_embed'], *size, 16)
    # 224 x 392 has a 14 x 24 grid, the last 8 columns unused: transformers' ViT sees them cropped.
    with torch.no_grad():
      ref = hf_vit(tiny.dino, hf_size, pos)(x[..., :hf_size[1]]).last_hidden_state[:, 0]
      ours = vb.dino_features(params, x)
    np.testing.assert_allclose(ours.numpy(), ref.numpy(), atol=2e-5)
    want.append(consistency_np(ref.numpy()))
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert 0.0 < got.min() and got.max() < 1.0


def test_consistency_formula_floors_each_cosine_at_zero():
  f = torch.tensor([[1.0, 0.0], [0.6, 0.8], [-0.6, 0.8]]) * torch.tensor([[3.0], [0.5], [2.0]])
  # frame 1: (0.6 + 0.6) / 2; frame 2: (cos(f1, f2) = 0.28, cos(f0, f2) = -0.6 -> 0) / 2.
  np.testing.assert_allclose(vb.consistency(f), (0.6 + 0.14) / 2, atol=1e-7)
  np.testing.assert_allclose(consistency_np(f.numpy()), (0.6 + 0.14) / 2, atol=1e-12)


def test_constant_video_is_fully_consistent(tiny):
  video = np.full((1, 4, 24, 40, 3), 77, np.uint8)
  video[..., 1] = 200
  got = reward(tiny, 'subject_consistency', 'background_consistency').scores(video)
  np.testing.assert_allclose(got['subject_consistency'], [1.0], atol=1e-6)
  np.testing.assert_allclose(got['background_consistency'], [1.0], atol=1e-6)


# ------------------------------------------------------------------------------------------ CLIP
def clip_features(model, video):
  """Frame features of the tiny CLIP on VBench's CLIP preprocessing, done here by hand: bicubic to 224 x
  403 for 40 x 72 frames, columns 90..313 (179 / 2 = 89.5 -> 90)."""
  x = F.interpolate(frames_float(video), (224, 403), mode='bicubic', align_corners=False)[..., 90:314]
  with torch.no_grad():
    return model.encode_image(normalized(x / 255, CLIP_NORM)).numpy()


def test_background_consistency_matches_clip_features(tiny):
  videos = smooth_videos(1, 2, 3, 40, 72)
  got = reward(tiny, 'background_consistency').scores(videos)['background_consistency']
  want = [consistency_np(clip_features(tiny.clip_b, v)) for v in videos]
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert got.max() < 1.0


def test_aesthetic_quality_is_the_laion_head_on_normalised_clip_features(tiny):
  videos = random_videos(2, (2, 3, 40, 72, 3))
  got = reward(tiny, 'aesthetic_quality').scores(videos)['aesthetic_quality']
  w, b = tiny.head['weight'].numpy().astype(np.float64), tiny.head['bias'].numpy().astype(np.float64)
  want = []
  for video in videos:
    f = clip_features(tiny.clip_l, video).astype(np.float64)
    f /= np.linalg.norm(f, axis=-1, keepdims=True)
    want.append(np.mean((f @ w.T + b)[:, 0] / 10))
  np.testing.assert_allclose(got, want, atol=1e-6)


def test_clip_loads_a_plain_state_dict_too_and_stays_fp16_exact(tiny, tmp_path):
  torch.save(tiny.clip_b.state_dict(), tmp_path / 'ViT-B-32.pt')     # clip.load's non-JIT fallback
  model = vb.load_clip(str(tmp_path / 'ViT-B-32.pt'), 'cpu', 'background_consistency')
  x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
  with torch.no_grad():
    np.testing.assert_allclose(model.encode_image(x).numpy(), tiny.clip_b.encode_image(x).numpy(), atol=1e-5)
  assert next(model.visual.parameters()).dtype == torch.float32      # cast back to float32 on CPU


# ------------------------------------------------------------------------------------- AMT-S
def amt_reference(model, video):
  """(score, midpoints) by hand: even frames /255 replicate-padded to multiples of 16 (split evenly, the
  odd pixel after), AMT-S at t = 0.5, cropped, x 255 clipped and truncated to uint8, against the odd
  frames."""
  h, w = video.shape[1:3]
  ph, pw = (-h) % 16, (-w) % 16
  pads = (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2)
  prep = lambda f: F.pad(torch.from_numpy(f).permute(2, 0, 1)[None].float() / 255, pads, mode='replicate')
  evens, odds = video[0::2], video[1::2]
  diffs, mids = [], []
  for i in range(len(evens) - 1):
    with torch.no_grad():
      out = model(prep(evens[i]), prep(evens[i + 1]), torch.full((1, 1, 1, 1), 0.5), scale_factor=1.0,
                  eval=True)['imgt_pred']
    mid = (out[0, :, pads[2]:pads[2] + h, pads[0]:pads[0] + w] * 255).permute(1, 2, 0).numpy()
    mids.append(mid.clip(0, 255).astype(np.uint8))
    diffs.append(np.abs(mids[-1].astype(np.float64) - odds[i]).mean())
  return (255 - np.mean(diffs)) / 255, mids


def test_motion_smoothness_matches_amt_run_by_hand_and_pads_to_16(tiny):
  video = smooth_videos(2, 1, 3, 113, 120)[0]        # padded to 128 x 128: (7, 8) rows, (4, 4) columns
  loaded = reward(tiny, 'motion_smoothness').model('motion_smoothness')    # from amt_model/amt-s.pth
  shapes = []

  def spy(a, b, embt, **kwargs):
    shapes.append((tuple(a.shape), tuple(b.shape), float(embt), kwargs))
    return loaded(a, b, embt, **kwargs)

  with torch.no_grad():
    got = vb.motion_smoothness(spy, video, 'cpu')
  want, mids = amt_reference(tiny.amt, video)
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert 0.0 < got < 1.0
  assert shapes == [((1, 3, 128, 128), (1, 3, 128, 128), 0.5, dict(scale_factor=1.0, eval=True))]
  # An odd frame equal to AMT-S's midpoint of its neighbours scores exactly 1.
  video[1] = mids[0]
  with torch.no_grad():
    assert vb.motion_smoothness(loaded, video, 'cpu') == 1.0
  nan_model = lambda a, b, embt, **kwargs: {'imgt_pred': torch.full_like(a, float('nan'))}
  with pytest.raises(RuntimeError, match='non-finite'):
    vb.amt_midpoints(nan_model, video, 'cpu')


def test_motion_smoothness_pairs_even_frames_as_vbench():
  """With a stand-in interpolator (the mean of its two frames): the midpoints of frames 0-2, 2-4, ... are
  compared with frames 1, 3, ...; an even F leaves its last odd frame unread."""
  average = lambda a, b, embt, **kwargs: {'imgt_pred': (a + b) / 2}
  video = random_videos(7, (5, 20, 30, 3))
  mids = vb.amt_midpoints(average, video, 'cpu')
  assert mids.shape == (2, 20, 30, 3)
  video[1] = mids[0]
  video[3] = np.where(mids[1] < 128, mids[1] + 10, mids[1] - 10)       # off by exactly 10 everywhere
  np.testing.assert_allclose(vb.motion_smoothness(average, video, 'cpu'), (255 - (0 + 10) / 2) / 255)
  assert vb.motion_smoothness(average, video[:4], 'cpu') == 1.0       # F = 4: frame 3 is not read
  assert vb.motion_smoothness(average, video[:3], 'cpu') == 1.0


# ------------------------------------------------------------------------------------------ MUSIQ
def test_musiq_tokens_equal_pyiqa_multiscale_patches():
  _, multiscale = pyiqa_modules()
  for h, w in ((37, 70), (34, 512), (300, 200)):
    x = torch.rand(2, 3, h, w, generator=torch.Generator().manual_seed(h)) * 2 - 1
    want = multiscale.get_multiscale_patches(x, 32, 32, 10, [224, 384], -1)
    got = vb.musiq_tokens(x)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize('height,width', [(40, 600), (24, 40)])
def test_imaging_quality_matches_pyiqa_musiq(tiny, height, width):
  videos = random_videos(5, (1, 2, height, width, 3))
  got = reward(tiny, 'imaging_quality').scores(videos)['imaging_quality']
  size = vb.musiq_size(height, width)
  x = F.interpolate(frames_float(videos[0]), size, mode='bilinear', align_corners=False) / 255
  with torch.no_grad():
    mos = [float(tiny.musiq(frame[None])) for frame in x]     # VBench scores one frame at a time
  np.testing.assert_allclose(got, [np.mean(mos) / 100], atol=1e-6)
  assert len(set(mos)) == 2


def test_musiq_loader_reads_the_architecture_from_the_state_dict(tiny):
  params, cfg = vb.load_musiq(os.path.join(tiny.dir, 'musiq_spaq_ckpt-358bb6af.pth'), 'cpu')
  assert cfg == dict(patch=32, hidden=128, heads=2, layers=2, grid=10, scales=3, classes=1)
  assert params['conv_root.weight:standardized'].shape == (vb.TINY_MUSIQ['stem'], 3, 7, 7)


@pytest.mark.parametrize('sizes', [dict(hidden=384, mlp_dim=1152, layers=2, stem=64),
                                   dict(hidden=64, mlp_dim=32, layers=1, stem=64, classes=10),
                                   vb.TINY_MUSIQ])
def test_musiq_shapes_are_pyiqas_state_dict(sizes):
  """musiq_shapes (what save_tiny writes) against pyiqa's MUSIQ: the release's widths (its 14 layers cut to
  2), a 10-class head (Linear + Softmax, `head.0`), and the tiny sizes with their narrower stem."""
  want = {k: tuple(v.shape) for k, v in pyiqa_musiq(**sizes).state_dict().items()}
  assert vb.musiq_shapes(**sizes) == want


# ---------------------------------------------------------------------------------- the reward
def test_reward_columns_registry_names_and_mean(tiny):
  videos = smooth_videos(6, 2, 3, 113, 113)
  prompts = ['a', 'b']
  r = rewards.make_reward('vbench', weights_dir=tiny.dir)
  table = r.scores(videos, prompts)
  assert set(table) == {'mean', *vb.DIMENSIONS}
  for column in table.values():
    assert column.shape == (2,) and column.dtype == np.float32 and np.isfinite(column).all()
  np.testing.assert_allclose(table['mean'], np.mean([table[d] for d in vb.DIMENSIONS], 0), rtol=1e-6)
  np.testing.assert_array_equal(r(videos, prompts), table['mean'])
  for dimension in vb.DIMENSIONS:
    single = rewards.make_reward(f'vbench_{dimension}', weights_dir=tiny.dir)
    assert single.dimensions == (dimension,) and single.key == dimension
    if dimension != 'motion_smoothness':     # (the slowest; its reward path is the same)
      np.testing.assert_allclose(single(videos, prompts), table[dimension], atol=1e-6)
  keyed = rewards.make_reward('vbench', weights_dir=tiny.dir, key='imaging_quality',
                              dimensions=['imaging_quality', 'aesthetic_quality'])
  np.testing.assert_allclose(keyed(videos, prompts), table['imaging_quality'], atol=1e-6)
  assert 'torchvision' not in sys.modules and 'vbench' not in sys.modules and 'clip' not in sys.modules


def test_bad_inputs_raise_naming_the_shape(tiny):
  r = reward(tiny)
  bad = [(np.zeros((1, 3, 8, 8, 3), np.float32), 'float32'),
         (np.zeros((1, 8, 8, 3), np.uint8), r'\(1, 8, 8, 3\)'),
         (np.zeros((1, 3, 8, 8, 4), np.uint8), r'\(1, 3, 8, 8, 4\)'),
         (np.zeros((1, 2, 8, 8, 3), np.uint8), 'F >= 3'),
         (np.zeros((1, 3, 112, 200, 3), np.uint8), r'H, W >= 113, got uint8 \(1, 3, 112, 200, 3\)')]
  for samples, words in bad:
    with pytest.raises(ValueError, match=words):
      r(samples, [''])
  with pytest.raises(ValueError, match='F >= 2'):
    reward(tiny, 'subject_consistency')(np.zeros((1, 1, 8, 8, 3), np.uint8), [''])
  with pytest.raises(ValueError, match=r'\(1, 2, 0, 8, 3\)'):
    reward(tiny, 'subject_consistency')(np.zeros((1, 2, 0, 8, 3), np.uint8), [''])
  two = reward(tiny, 'background_consistency')(np.zeros((1, 2, 8, 8, 3), np.uint8), [''])
  np.testing.assert_allclose(two, [1.0], atol=1e-6)                 # F = 2 suffices without AMT
  with pytest.raises(ValueError, match='2 prompts for 1 videos'):
    r(np.zeros((1, 3, 113, 113, 3), np.uint8), ['', ''])
  for kwargs, words in [(dict(dimensions=('sharpness',)), 'sharpness'), (dict(key='overall'), 'overall'),
                        (dict(dimensions=('imaging_quality',), key='aesthetic_quality'), 'aesthetic_quality'),
                        (dict(batch_size=0), 'batch_size')]:
    with pytest.raises(ValueError, match=words):
      vb.VBenchReward(weights_dir=tiny.dir, **kwargs)


def test_missing_and_unreadable_weights_name_the_file_and_dimension(tiny, tmp_path):
  with pytest.raises(FileNotFoundError,
                     match='subject_consistency: weights file dino_vitbase16_pretrain.pth not found'):
    vb.VBenchReward(weights_dir=str(tmp_path))
  with pytest.raises(FileNotFoundError, match='aesthetic_quality: weights file sa_0_4_vit_l_14_linear.pth'):
    shutil.copy(os.path.join(tiny.dir, 'ViT-L-14.pt'), tmp_path / 'ViT-L-14.pt')
    vb.VBenchReward(dimensions=['aesthetic_quality'], weights_dir=str(tmp_path))
  video = np.zeros((1, 3, 16, 16, 3), np.uint8)
  for dimension, name in [('imaging_quality', 'musiq_spaq_ckpt-358bb6af.pth'),
                          ('background_consistency', 'ViT-B-32.pt')]:
    source = os.path.join(tiny.dir, name)
    with open(source, 'rb') as f, open(tmp_path / name, 'wb') as g:
      g.write(f.read()[:os.path.getsize(source) // 2])
    r = vb.VBenchReward(dimensions=[dimension], weights_dir=str(tmp_path))
    with pytest.raises(vb.WeightsError, match=f'{dimension}: .*{name} cannot be read, truncated') as e:
      r(video, [''])
    assert '\n' not in str(e.value)
  torch.save(tiny.amt.state_dict(), tmp_path / 'amt-s.pth')           # the weights, not {'state_dict': ...}
  with pytest.raises(vb.WeightsError, match="motion_smoothness: .*amt-s.pth has no 'state_dict'"):
    vb.VBenchReward(dimensions=['motion_smoothness'], weights_dir=str(tmp_path))(
        np.zeros((1, 3, 113, 113, 3), np.uint8), [''])
  torch.save({'weight': torch.zeros(1, 768), 'bias': torch.zeros(1)}, tmp_path / 'sa_0_4_vit_l_14_linear.pth')
  with pytest.raises(vb.WeightsError, match=r'aesthetic_quality: .* head of shape \(1, 768\), not \(1, 32\)'):
    vb.VBenchReward(dimensions=['aesthetic_quality'], weights_dir=str(tmp_path))(video, [''])


def test_a_video_that_fails_gets_nan_and_a_warning(tiny, monkeypatch, caplog):
  score = vb.SCORERS['imaging_quality']

  def flaky(model, frames, device, batch_size):
    if frames.mean() > 128:
      raise RuntimeError('out of memory\nsecond line')
    return score(model, frames, device, batch_size)

  monkeypatch.setitem(vb.SCORERS, 'imaging_quality', flaky)
  videos = np.stack([np.full((3, 16, 16, 3), 40, np.uint8), np.full((3, 16, 16, 3), 200, np.uint8)])
  with caplog.at_level(logging.WARNING, logger=vb.__name__):
    table = reward(tiny, 'imaging_quality', 'subject_consistency').scores(videos)
  assert np.isfinite(table['imaging_quality'][0]) and np.isnan(table['imaging_quality'][1])
  assert np.isfinite(table['subject_consistency']).all()
  assert np.isfinite(table['mean'][0]) and np.isnan(table['mean'][1])
  assert ('vbench imaging_quality: video 1 could not be scored, its score is NaN (RuntimeError: '
          'out of memory)') in caplog.text


def test_module_and_reward_build_without_torch(tiny):
  code = ('import sys; sys.modules["torch"] = None\n'
          'from ddrl_jax import rewards\n'
          'from ddrl_jax.rewards import vbench\n'
          f'r = rewards.make_reward("vbench", weights_dir={tiny.dir!r})\n'
          'assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]\n'
          'print(sorted(r.paths))\n')
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       check=False)
  assert out.returncode == 0, out.stderr
  assert 'subject_consistency' in out.stdout


def test_save_tiny_scores_small_videos_through_the_registry(tmp_path, record_property):
  """save_tiny for the dimensions that take 32 x 32 videos (all but motion_smoothness, which needs sides of
  113): only their files are written, and the registry's 'vbench' on the returned kwargs scores
  (4, 5, 32, 32, 3) videos with their mean. The time is reported."""
  dimensions = vb.accepted_dimensions(5, 32, 32)
  assert dimensions == tuple(d for d in vb.DIMENSIONS if d != 'motion_smoothness')
  assert vb.accepted_dimensions(5, 113, 120) == vb.DIMENSIONS
  assert vb.accepted_dimensions(2, 113, 113) == dimensions
  kwargs = vb.save_tiny(str(tmp_path / 'weights'), seed=1, dimensions=dimensions)
  assert kwargs == {'weights_dir': str(tmp_path / 'weights'), 'dimensions': dimensions}
  assert not os.path.exists(tmp_path / 'weights' / 'amt_model')
  reward = rewards.make_reward('vbench', **kwargs)
  videos = random_videos(8, (4, 5, 32, 32, 3))
  prompts = ['a', 'b', 'c', 'd']
  reward(videos[:1, :2], prompts[:1])                               # warm up (loads the models)
  start = time.perf_counter()
  table = reward.scores(videos, prompts)
  seconds = time.perf_counter() - start
  record_property('vbench_seconds_4x5x32x32', seconds)
  print(f'vbench save_tiny ({len(dimensions)} dimensions): (4, 5, 32, 32, 3) scored in {seconds:.2f} s')
  assert set(table) == {'mean', *dimensions}
  assert all(np.isfinite(v).all() and v.shape == (4,) for v in table.values())
  np.testing.assert_allclose(table['mean'], np.mean([table[d] for d in dimensions], 0), rtol=1e-6)
  with pytest.raises(FileNotFoundError, match='amt-s.pth'):
    rewards.make_reward('vbench', weights_dir=kwargs['weights_dir'])
