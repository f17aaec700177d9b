"""CLIP image rewards (ddrl_jax/rewards/clip_rewards.py) on a tiny random CLIP folder (`save_tiny`: config,
safetensors weights, a tiny CLIP BPE tokenizer, a CLIPImageProcessor with 32 x 32 crops).

Each reward against an independent computation of its public formula: transformers' CLIPProcessor and
CLIPModel run directly (get_image_features / get_text_features, normalised, times exp(logit_scale), the
divisor); PickScore and the aesthetic head on the processor's PIL-bicubic pixels, CLIPScore on pixels made
here with PIL's float ('F' mode) bilinear resize, which is the antialiased bilinear filter torchvision >= 0.17
applies to tensors (torchvision itself, when importable). The two pixel paths differ on a non-square image,
so a swap would fail. Also: the aesthetic MLP in numpy, the scales by name, NaN for non-finite scores,
one-line errors and input_problems."""
import importlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
Image = pytest.importorskip('PIL.Image')

# pylint: disable=g-import-not-at-top,g-bad-import-order
from ddrl_jax.rewards import clip_rewards as cr
from ddrl_jax.rewards import registry
# pylint: enable=g-import-not-at-top,g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-5
PROMPTS = ['a cat', '', 'a dog ' * 40]        # an empty prompt and one truncated at 77 tokens
# The registry lines these rewards are meant to be added under (checked against registry.py once there).
NAMES = {'pickscore': 'ddrl_jax.rewards.clip_rewards:PickScore',
         'clipscore': 'ddrl_jax.rewards.clip_rewards:CLIPScore',
         'clipscore_flowgrpo': 'ddrl_jax.rewards.clip_rewards:CLIPScoreFlowGRPO',
         'laion_aesthetic': 'ddrl_jax.rewards.clip_rewards:LAIONAesthetic'}
DIVISORS = {'pickscore': 26.0, 'clipscore': 100.0, 'clipscore_flowgrpo': 30.0}


def factory(name):
  module, attr = NAMES[name].split(':')
  return getattr(importlib.import_module(module), attr)


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
  return cr.save_tiny(str(tmp_path_factory.mktemp('clip')))


@pytest.fixture(scope='module')
def reference(tiny):
  """(CLIPModel, CLIPProcessor) loaded here, apart from the rewards' shared models."""
  folder = tiny['checkpoint']
  return (transformers.CLIPModel.from_pretrained(folder, local_files_only=True).eval(),
          transformers.CLIPProcessor.from_pretrained(folder, local_files_only=True))


def images(m=3, h=40, w=57, seed=0):
  """(m, h, w, 3) uint8: smooth gradients plus noise (non-square: the pixel paths differ)."""
  rng = np.random.RandomState(seed)
  yy, xx = np.mgrid[0:h, 0:w]
  base = np.stack([xx / w, yy / h, (xx + yy) / (h + w)], -1) * 200
  return np.clip(base[None] + rng.randint(0, 56, (m, h, w, 3)), 0, 255).astype(np.uint8)


def logits(model, pixels, texts):
  """exp(logit_scale) * cos per (image i, text i) pair, from CLIPModel's public methods."""
  with torch.no_grad():
    i = model.get_image_features(pixel_values=pixels)
    t = model.get_text_features(**texts)
    i = i / i.norm(p=2, dim=-1, keepdim=True)
    t = t / t.norm(p=2, dim=-1, keepdim=True)
    return (model.logit_scale.exp() * (t @ i.T)).diag().numpy()


def pil_bilinear_pixels(x, size, crop, mean, std):
  """(m, h, w, 3) uint8 -> (m, 3, crop, crop): /255, the short side to `size` by PIL's float bilinear
  (antialiased) resize of each channel, torchvision's centre crop offsets by hand, mean/std."""
  m, h, w, _ = x.shape
  nh, nw = (int(size * h / w), size) if w <= h else (size, int(size * w / h))
  top, left = int(round((nh - crop) / 2)), int(round((nw - crop) / 2))
  out = np.empty((m, 3, crop, crop), np.float32)
  for i in range(m):
    for c in range(3):
      ch = Image.fromarray(x[i, :, :, c].astype(np.float32) / 255.0).resize((nw, nh), Image.BILINEAR)
      out[i, c] = (np.asarray(ch)[top:top + crop, left:left + crop] - mean[c]) / std[c]
  return torch.from_numpy(out)


def one_line(excinfo, *words):
  msg = str(excinfo.value)
  assert '\n' not in msg, msg
  for w in words:
    assert w in msg, (w, msg)


# ------------------------------------------------------------------------------------------ pixels
@pytest.mark.parametrize('shape,size', [((40, 57), (32, 45)), ((57, 40), (45, 32)), ((20, 27), (32, 43))])
def test_tensor_resize_is_pil_bilinear(shape, size):
  """resize_bilinear (torch, antialias=True) = PIL's float bilinear resize (down and up); without the
  antialiasing a downscale differs."""
  assert cr.resize_size(*shape, 32) == size
  x = np.random.RandomState(1).rand(3, *shape).astype(np.float32)
  ours = cr.resize_bilinear(torch.from_numpy(x)[None], size)[0].numpy()
  pil = np.stack([np.asarray(Image.fromarray(c).resize(size[::-1], Image.BILINEAR)) for c in x])
  np.testing.assert_allclose(ours, pil, atol=2e-6)
  if shape[0] > size[0]:
    plain = cr.resize_bilinear(torch.from_numpy(x)[None], size, antialias=False)[0].numpy()
    assert np.abs(plain - pil).max() > 1e-2


def test_center_crop_offsets():
  """torchvision's CenterCrop: int(round(excess / 2)), half to even (13 -> 6, 11 -> 6); zero padding with
  the odd pixel after when the crop is larger."""
  x = torch.arange(45.0).view(1, 1, 1, 45).expand(1, 1, 32, 45)
  assert cr.center_crop(x, (32, 32))[0, 0, 0, 0].item() == 6
  assert cr.center_crop(x[..., :43], (32, 32))[0, 0, 0, 0].item() == 6
  padded = cr.center_crop(torch.ones(1, 1, 2, 3), (5, 4))
  assert padded.shape == (1, 1, 5, 4) and padded.sum().item() == 6
  assert padded[0, 0, 1:3, 0:3].sum().item() == 6


def test_tensor_pixels_match_torchvision(tiny):
  """tensor_pixels = flow_grpo's torchvision Compose (Resize, CenterCrop, Normalize) on x / 255."""
  tv = pytest.importorskip('torchvision.transforms')
  proc = transformers.CLIPImageProcessor.from_pretrained(tiny['checkpoint'])
  x = images()
  tform = tv.Compose([tv.Resize(32), tv.CenterCrop((32, 32)), tv.Normalize(proc.image_mean, proc.image_std)])
  want = tform(torch.from_numpy(x).permute(0, 3, 1, 2) / 255.0)
  np.testing.assert_allclose(cr.tensor_pixels(proc, x).numpy(), want.numpy(), atol=1e-5)


# ------------------------------------------------------------------------------------------ parity
def test_pickscore_parity(tiny, reference):
  """PickScore = exp(logit_scale) * cos / 26 on the processor's (PIL bicubic) pixels, prompts padded to the
  batch's longest, truncated at 77; batches of 2 for 3 images."""
  model, proc = reference
  x = images()
  pixels = proc(images=[Image.fromarray(i) for i in x], return_tensors='pt')['pixel_values']
  texts = proc(text=PROMPTS, padding=True, truncation=True, max_length=77, return_tensors='pt')
  want = logits(model, pixels, dict(texts)) / 26
  got = factory('pickscore')(checkpoint=tiny['checkpoint'], batch_size=2)(x, PROMPTS)
  assert got.dtype == np.float32 and got.shape == (3,)
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-7)


def test_clipscore_parity_and_pixel_paths_differ(tiny, reference):
  """CLIPScore = logits_per_image's diagonal on tensor-bilinear pixels, prompts padded to 77, / 100 and / 30;
  the PIL-bicubic pixels differ on this non-square image, and scoring them would miss the tolerance."""
  model, proc = reference
  x = images()
  bilinear = pil_bilinear_pixels(x, 32, 32, proc.image_processor.image_mean, proc.image_processor.image_std)
  bicubic = proc(images=[Image.fromarray(i) for i in x], return_tensors='pt')['pixel_values']
  assert (bilinear - bicubic).abs().max().item() > 0.05
  np.testing.assert_allclose(cr.tensor_pixels(proc.image_processor, x).numpy(), bilinear.numpy(), atol=1e-5)
  texts = dict(proc(text=PROMPTS, padding='max_length', truncation=True, return_tensors='pt'))
  assert texts['input_ids'].shape == (3, 77)
  with torch.no_grad():
    forward = model(pixel_values=bilinear, **texts).logits_per_image.diagonal().numpy()
  want = logits(model, bilinear, texts)
  np.testing.assert_allclose(forward, want, rtol=RTOL, atol=1e-6)
  swapped = logits(model, bicubic, texts)
  assert np.abs(swapped - want).max() > 100 * RTOL * np.abs(want).max()
  for name in ('clipscore', 'clipscore_flowgrpo'):
    got = factory(name)(checkpoint=tiny['checkpoint'], batch_size=2)(x, PROMPTS)
    np.testing.assert_allclose(got, want / DIVISORS[name], rtol=RTOL, atol=1e-7)


def test_aesthetic_parity(tiny, reference):
  """The LAION head = the numpy MLP (no activations) on L2-normalised image features of the processor's
  pixels; its affine form and bound agree."""
  model, proc = reference
  x = images()
  pixels = proc(images=[Image.fromarray(i) for i in x], return_tensors='pt')['pixel_values']
  with torch.no_grad():
    f = model.get_image_features(pixel_values=pixels).double().numpy()
  f /= np.linalg.norm(f, axis=-1, keepdims=True)
  state = torch.load(tiny['head'], weights_only=True)
  h = f
  for i in (0, 2, 4, 6, 7):
    h = h @ state[f'layers.{i}.weight'].double().numpy().T + state[f'layers.{i}.bias'].double().numpy()
  got = factory('laion_aesthetic')(**tiny, batch_size=2)(x, None)
  np.testing.assert_allclose(got, h[:, 0], rtol=RTOL)
  w, b = cr.affine_head(cr.read_aesthetic_head(tiny['head']))
  np.testing.assert_allclose(f @ w + b, h[:, 0], rtol=1e-9)
  low, high = cr.aesthetic_bound(cr.read_aesthetic_head(tiny['head']))
  assert np.all((low <= got) & (got <= high))
  np.testing.assert_allclose(factory('laion_aesthetic')(**tiny)(x, PROMPTS), got, rtol=RTOL)


# ------------------------------------------------------------------------------------------ scales
def test_scales_by_name(tiny):
  """pickscore / 26, clipscore / 100 (the cosine when exp(logit_scale) = 100, as the tiny model's and the
  release's), clipscore_flowgrpo / 30 of the same logits; batch size and the registry (once the names are
  added there) change nothing."""
  x = images(seed=3)
  scores = {n: factory(n)(checkpoint=tiny['checkpoint'], batch_size=3)(x, PROMPTS) for n in DIVISORS}
  for n in DIVISORS:
    assert factory(n).divisor == DIVISORS[n]
  np.testing.assert_allclose(scores['clipscore'] * 100, scores['clipscore_flowgrpo'] * 30, rtol=RTOL)
  assert np.all(np.abs(scores['clipscore']) <= 1)
  one = factory('pickscore')(checkpoint=tiny['checkpoint'], batch_size=1)(x, PROMPTS)
  np.testing.assert_allclose(one, scores['pickscore'], rtol=RTOL, atol=1e-7)
  for name, target in NAMES.items():
    if name in registry.BUILTIN:
      assert registry.BUILTIN[name] == target
      assert registry.INPUT_CHECKS.get(name, '').startswith('ddrl_jax.rewards.clip_rewards:')


def test_non_finite_scores_are_nan(tmp_path):
  """exp(logit_scale) overflowing float32 gives infinite logits: NaN scores, not an error."""
  folder = cr.save_tiny_clip(str(tmp_path / 'hot'), logit_scale=1000.0)
  for name in ('pickscore', 'clipscore'):
    got = factory(name)(checkpoint=folder)(images(m=2), ['a cat', 'a dog'])
    assert got.shape == (2,) and np.isnan(got).all()


# ------------------------------------------------------------------------------------------ errors
def test_bad_inputs_one_line(tiny):
  reward = factory('pickscore')(checkpoint=tiny['checkpoint'])
  x = images(m=2)
  for bad in (x.astype(np.float32), x[..., 0], x[:, :, :, :2], np.zeros((2, 0, 5, 3), np.uint8)):
    with pytest.raises(ValueError) as e:
      reward(bad, ['a', 'b'])
    one_line(e, 'pickscore', 'uint8 RGB images (M, H, W, 3)')
  with pytest.raises(ValueError) as e:
    reward(x, ['a'])
  one_line(e, 'pickscore', '1 prompts for 2 images')
  with pytest.raises(ValueError) as e:
    reward(x, ['a', None])
  one_line(e, 'pickscore', 'not a string')
  with pytest.raises(ValueError) as e:
    factory('laion_aesthetic')(**tiny)(x, ['a'])
  one_line(e, 'laion_aesthetic', 'prompts')
  with pytest.raises(ValueError) as e:
    factory('clipscore')(checkpoint=tiny['checkpoint'], device='cpu', dtype='bfloat16')
  one_line(e, 'clipscore', 'CUDA')
  assert reward(x[:0], []).shape == (0,)


def test_bad_files_one_line(tiny, tmp_path):
  """Missing folder, a folder without config / of another model, weights that miss layers of the config,
  a processor whose crop does not fit the model, a head of the wrong width or layout."""
  missing = str(tmp_path / 'nowhere')
  with pytest.raises(cr.CheckpointError) as e:
    factory('pickscore')(checkpoint=missing)
  one_line(e, 'pickscore checkpoint', missing, 'no such directory')
  empty = tmp_path / 'empty'
  empty.mkdir()
  with pytest.raises(cr.CheckpointError) as e:
    factory('clipscore')(checkpoint=str(empty))
  one_line(e, 'clipscore checkpoint', 'no config.json')
  deeper = shutil.copytree(tiny['checkpoint'], tmp_path / 'deeper')
  config = json.loads((deeper / 'config.json').read_text())
  config['text_config']['num_hidden_layers'] = 2
  (deeper / 'config.json').write_text(json.dumps(config))
  with pytest.raises(cr.CheckpointError) as e:
    factory('clipscore')(checkpoint=str(deeper))
  one_line(e, 'clipscore checkpoint', 'weights missing')
  config['model_type'] = 'siglip'
  (deeper / 'config.json').write_text(json.dumps(config))
  with pytest.raises(cr.CheckpointError) as e:
    factory('clipscore')(checkpoint=str(deeper))
  one_line(e, "model_type 'siglip'")
  big = tmp_path / 'big_crop'
  shutil.copytree(tiny['checkpoint'], big)
  transformers.CLIPImageProcessor(size={'shortest_edge': 48}, crop_size=48).save_pretrained(str(big))
  with pytest.raises(cr.CheckpointError) as e:
    factory('pickscore')(checkpoint=tiny['checkpoint'], processor=str(big))
  one_line(e, 'pickscore checkpoint', '(48, 48)', '(32, 32)')
  wide = str(tmp_path / 'head768.pth')
  torch.save(cr.tiny_aesthetic_state(768), wide)
  with pytest.raises(cr.CheckpointError) as e:
    factory('laion_aesthetic')(checkpoint=tiny['checkpoint'], head=wide)
  one_line(e, 'laion_aesthetic head', 'takes 768-dim features', 'projects to 16')
  plain = str(tmp_path / 'plain.pth')
  torch.save({k.replace('layers.', ''): v for k, v in cr.tiny_aesthetic_state(16).items()}, plain)
  with pytest.raises(cr.CheckpointError) as e:
    factory('laion_aesthetic')(checkpoint=tiny['checkpoint'], head=plain)
  one_line(e, 'laion_aesthetic head', 'not the aesthetic MLP')
  with pytest.raises(cr.CheckpointError) as e:
    factory('laion_aesthetic')(checkpoint=tiny['checkpoint'], head=missing)
  one_line(e, 'laion_aesthetic head', 'no such file')


def test_input_problems(tiny, tmp_path):
  """input_problems finds missing kwargs, folders, files and heads without loading anything."""
  assert cr.pickscore_input_problems(tiny) == []
  assert cr.clipscore_input_problems(tiny) == cr.clipscore_flowgrpo_input_problems(tiny) == []
  assert cr.aesthetic_input_problems(tiny) == []
  assert cr.pickscore_input_problems({})[0].startswith('pickscore: config.reward.kwargs.pickscore.checkpoint')
  missing = str(tmp_path / 'nowhere')
  assert cr.clipscore_input_problems({'checkpoint': missing}) == [
      f'clipscore checkpoint {missing}: no such directory']
  problems = cr.aesthetic_input_problems({'checkpoint': tiny['checkpoint'], 'head': missing})
  assert problems == [f'laion_aesthetic head {missing}: no such file']
  assert 'head is not set' in cr.aesthetic_input_problems({'checkpoint': tiny['checkpoint']})[0]
  bare = tmp_path / 'bare'
  shutil.copytree(tiny['checkpoint'], bare)
  for f in ('vocab.json', 'preprocessor_config.json', 'model.safetensors'):
    os.remove(bare / f)
  problems = cr.pickscore_input_problems({'checkpoint': str(bare)})
  assert len(problems) == 3 and all(p.startswith(f'pickscore checkpoint {bare}: no ') for p in problems)
  assert cr.pickscore_input_problems({'checkpoint': tiny['checkpoint'], 'processor': str(bare)}) == [
      f'pickscore checkpoint {bare}: no preprocessor_config.json (the CLIP image processor)',
      f'pickscore checkpoint {bare}: no tokenizer (tokenizer.json, or vocab.json and merges.txt)']
  for name in NAMES:
    if name in registry.INPUT_CHECKS:
      assert registry.input_problems(name, {'checkpoint': missing})


def test_module_imports_without_torch():
  code = ('import sys; sys.modules["torch"] = sys.modules["transformers"] = sys.modules["PIL"] = None; '
          'import ddrl_jax.rewards.clip_rewards as m; print(m.aesthetic_input_problems({}))')
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert 'laion_aesthetic' in out.stdout
