"""The HPSv2.1 reward (ddrl_jax/rewards/hps.py) on a tiny random open_clip-layout checkpoint (`save_tiny`:
{'state_dict': ...} in a torch file, as the released HPS_v2.1_compressed.pt).

The reference is independent of the reward's torch code: the public formulas of open_clip's CLIP (ViT with
class token, pre-norm residual blocks, exact GELU, ln_post on the class token; causal text transformer,
ln_final, the end token's features; L2 normalisation; the diagonal of image . text, no logit scale) in
float64 numpy, on pixels made here with PIL's float ('F' mode) bicubic resize, which is the antialiased
bicubic filter torchvision >= 0.17 applies to the float tensors of the hpsv2 fork's ResizeMaxSize, then
centred zero padding and the OpenAI mean / std. Also: the padding and its difference from a centre-crop
path, the tokenizer's known ids, ViT-H-14's state dict layout, NaN for non-finite scores, one-line errors
and input_problems."""
import copy
import math
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip('torch')
Image = pytest.importorskip('PIL.Image')
special = pytest.importorskip('scipy.special')

# pylint: disable=g-import-not-at-top,g-bad-import-order
from ddrl_jax.rewards import hps
from ddrl_jax.rewards import registry
# pylint: enable=g-import-not-at-top,g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME, TARGET = 'hpsv21', 'ddrl_jax.rewards.hps:HPSv21'   # the registry line (checked once it is there)
PROMPTS = ['a cat', '', 'a dog ' * 40, 'A Photo of  a CAT!']    # empty; truncated at 77 tokens; cleaned
MEAN, STD = np.array(hps.MEAN), np.array(hps.STD)
START, END = 49406, 49407


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
  return hps.save_tiny(str(tmp_path_factory.mktemp('hps')), seed=1)


@pytest.fixture(scope='module')
def reward(tiny):
  return hps.HPSv21(**tiny, batch_size=3)


@pytest.fixture(scope='module')
def params(tiny):
  """The tiny checkpoint's tensors as float64 numpy, read here with torch.load."""
  state = torch.load(tiny['checkpoint'], map_location='cpu', weights_only=True)['state_dict']
  return {k: v.double().numpy() for k, v in state.items()}


def images(m=4, h=41, w=57, seed=0):
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


# ------------------------------------------------------------------------------------------ reference
def pil_resize_pad(x, size):
  """(m, h, w, 3) uint8 -> (m, 3, size, size) float64 in [0, 1] (+ overshoot): the longer side to size by
  PIL's float bicubic resize of each channel (sides rounded), zero padding with the floor of half the excess
  left / top."""
  m, h, w, _ = x.shape
  scale = size / max(h, w)
  nh, nw = round(h * scale), round(w * scale)
  top, left = (size - nh) // 2, (size - nw) // 2
  out = np.zeros((m, 3, size, size))
  for i in range(m):
    for c in range(3):
      ch = Image.fromarray(x[i, :, :, c].astype(np.float32) / 255.0)
      if (nh, nw) != (h, w):
        ch = ch.resize((nw, nh), Image.BICUBIC)
      out[i, c, top:top + nh, left:left + nw] = np.asarray(ch)
  return out


def normalize(x):
  return (x - MEAN[:, None, None]) / STD[:, None, None]


def layer_norm(x, p, name):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + 1e-5) * p[f'{name}.weight'] + p[f'{name}.bias']


def attention(x, p, name, heads, mask):
  """nn.MultiheadAttention's formula on (L, D): in_proj, per head softmax(q k^T / sqrt(d) + mask) v,
  out_proj."""
  length, width = x.shape
  d = width // heads
  q, k, v = np.split(x @ p[f'{name}.in_proj_weight'].T + p[f'{name}.in_proj_bias'], 3, axis=-1)
  out = np.empty_like(x)
  for h in range(heads):
    s = slice(h * d, (h + 1) * d)
    logits = q[:, s] @ k[:, s].T / math.sqrt(d) + mask
    a = np.exp(logits - logits.max(-1, keepdims=True))
    out[:, s] = (a / a.sum(-1, keepdims=True)) @ v[:, s]
  return out @ p[f'{name}.out_proj.weight'].T + p[f'{name}.out_proj.bias']


def transformer(x, p, prefix, layers, heads, mask):
  for i in range(layers):
    b = f'{prefix}.resblocks.{i}'
    x = x + attention(layer_norm(x, p, f'{b}.ln_1'), p, f'{b}.attn', heads, mask)
    h = layer_norm(x, p, f'{b}.ln_2') @ p[f'{b}.mlp.c_fc.weight'].T + p[f'{b}.mlp.c_fc.bias']
    h = 0.5 * h * (1 + special.erf(h / math.sqrt(2)))          # exact GELU
    x = x + h @ p[f'{b}.mlp.c_proj.weight'].T + p[f'{b}.mlp.c_proj.bias']
  return x


def image_features(px, p, cfg):
  """(3, S, S) normalised pixels -> (D,): patches through conv1 (no bias), class token, positions, ln_pre,
  blocks, ln_post of the class token, @ proj."""
  v = cfg['vision_cfg']
  patch, grid = v['patch_size'], v['image_size'] // v['patch_size']
  w = p['visual.conv1.weight'].reshape(v['width'], -1)
  rows = [px[:, r * patch:(r + 1) * patch, c * patch:(c + 1) * patch].reshape(-1)
          for r in range(grid) for c in range(grid)]                 # row-major grid, as conv's flatten
  x = np.concatenate([p['visual.class_embedding'][None], np.stack(rows) @ w.T])
  x = x + p['visual.positional_embedding']
  x = transformer(layer_norm(x, p, 'visual.ln_pre'), p, 'visual.transformer', v['layers'],
                  v['width'] // v['head_width'], 0.0)
  return layer_norm(x[0], p, 'visual.ln_post') @ p['visual.proj']


def text_features(tokens, p, cfg):
  """(L,) ids -> (D,): embeddings + positions, causal blocks, ln_final, the row of the largest id (the end
  token) @ text_projection."""
  t = cfg['text_cfg']
  n = len(tokens)
  x = p['token_embedding.weight'][tokens] + p['positional_embedding'][:n]
  mask = np.triu(np.full((n, n), -np.inf), 1)
  x = layer_norm(transformer(x, p, 'transformer', t['layers'], t['heads'], mask), p, 'ln_final')
  return x[int(np.argmax(tokens))] @ p['text_projection']


def reference_scores(x, prompts, p, cfg, tokenizer):
  """cos(image i, prompt i) per pair, in float64 numpy."""
  px = normalize(pil_resize_pad(x, cfg['vision_cfg']['image_size']))
  tokens = tokenizer(prompts).numpy()
  out = []
  for i in range(len(prompts)):
    a, b = image_features(px[i], p, cfg), text_features(tokens[i], p, cfg)
    out.append(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
  return np.array(out)


# ------------------------------------------------------------------------------------------ pixels
@pytest.mark.parametrize('shape', [(41, 57), (57, 41), (20, 13), (100, 37), (64, 64)])
def test_resize_pad_is_pil_bicubic_with_centred_zero_pad(shape):
  """resize_pad = PIL's float bicubic of the longer side to 32 (down and up), zero padding centred (an odd
  excess: the extra row / column after); nothing clamped."""
  x = images(m=2, h=shape[0], w=shape[1], seed=2)
  ours = hps.resize_pad(x, 32).double().numpy()
  np.testing.assert_allclose(ours, pil_resize_pad(x, 32), atol=3e-6)
  if shape == (41, 57):             # 41 * 32 / 57 = 23.02 -> 23 rows, 9 of padding: 4 above, 5 below
    assert np.all(ours[:, :, :4] == 0) and np.all(ours[:, :, 27:] == 0)
    assert np.all(np.abs(ours[:, :, 4]).sum(-1) > 0) and np.all(np.abs(ours[:, :, 26]).sum(-1) > 0)
    assert ours.max() > 1.0         # bicubic overshoot at the white band, kept as the reference does
    px = hps.pixels(x, 32).double().numpy()
    np.testing.assert_allclose(px[:, :, :4], np.broadcast_to((-MEAN / STD)[None, :, None, None],
                                                             (2, 3, 4, 32)), rtol=1e-6)


def test_longer_side_at_size_is_padded_only():
  """An image whose longer side is already the size keeps its pixels (no resize); only padded (the hpsv2
  fork would leave it unpadded and the model would fail on it)."""
  x = images(m=1, h=32, w=21, seed=4)
  ours = hps.resize_pad(x, 32).numpy()
  np.testing.assert_array_equal(ours[0, :, :, 5:26], x[0].transpose(2, 0, 1) / np.float32(255.0))
  assert np.all(ours[..., :5] == 0) and np.all(ours[..., 26:] == 0)


def test_pad_path_differs_from_centre_crop():
  """The reward's pixels (longer side + pad) are not those of CLIP's usual short side + centre crop."""
  x = images(m=1, h=41, w=57, seed=5)
  ours = hps.resize_pad(x, 32)[0].numpy()
  ch = [np.asarray(Image.fromarray(x[0, :, :, c].astype(np.float32) / 255).resize((44, 32), Image.BICUBIC))
        for c in range(3)]
  crop = np.stack(ch)[:, :, 6:38]
  assert np.abs(ours - crop).mean() > 0.1


# ------------------------------------------------------------------------------------------ tokens
def test_tokenizer_ids():
  """open_clip's tokenize on the CLIP BPE: known ids, cleaning and lower-casing, zero padding, truncation at
  77 with the end token last, open_clip's spelling of the special tokens inside a prompt."""
  tok = hps.shared_tokenizer(77)
  ids = tok(['a photo of a cat', '', 'A  PHOTO of a cat', 'cat ' * 100, '<start_of_text>', '<|startoftext|>'])
  assert ids.shape == (6, 77) and ids.dtype == torch.long
  assert ids[0, :7].tolist() == [START, 320, 1125, 539, 320, 2368, END] and not ids[0, 7:].any()
  assert ids[1, :3].tolist() == [START, END, 0]
  assert torch.equal(ids[2], ids[0])
  assert ids[3, 0] == START and ids[3, -1] == END and (ids[3, 1:-1] == 2368).all()
  assert ids[4, :3].tolist() == [START, START, END]
  assert ids[5, 1] != START and ids[5].max() == END


# ------------------------------------------------------------------------------------------ scores
def test_parity_with_numpy_reference(tiny, reward, params):
  """The reward = the float64 numpy forward of open_clip's CLIP on PIL-made pixels; one image per call and
  batches of 3 give the same."""
  x = images(m=4, h=41, w=57, seed=3)
  got = reward(x, PROMPTS)
  want = reference_scores(x, PROMPTS, params, tiny['model_cfg'], reward.tokenizer)
  assert got.dtype == np.float32 and got.shape == (4,)
  np.testing.assert_allclose(got, want, atol=2e-5)
  assert np.std(want) > 1e-2                       # the scores vary: a wrong pairing or pixel path would show
  one = hps.HPSv21(**tiny, batch_size=1)(x, PROMPTS)
  np.testing.assert_allclose(one, got, atol=1e-6)
  square = images(m=2, h=96, w=96, seed=6)
  np.testing.assert_allclose(reward(square, PROMPTS[:2]),
                             reference_scores(square, PROMPTS[:2], params, tiny['model_cfg'],
                                              reward.tokenizer), atol=2e-5)


def test_diagonal_without_logit_scale(tiny, reward, tmp_path):
  """Each image is scored with its own prompt (the diagonal of the cosine matrix), and logit_scale does not
  enter: a checkpoint with another logit_scale scores the same; every score is a cosine."""
  x = images(m=3, seed=7)
  prompts = ['a cat', 'a red car', 'two dogs']
  with torch.no_grad():
    image, text = reward.model(hps.pixels(x, 32), reward.tokenizer(prompts))
  matrix = (image @ text.T).numpy()
  np.testing.assert_allclose(reward(x, prompts), np.diag(matrix), atol=1e-6)
  np.testing.assert_allclose(reward(x, prompts[::-1]), np.diag(matrix[:, ::-1]), atol=1e-6)
  state = torch.load(tiny['checkpoint'], weights_only=True)
  state['state_dict']['logit_scale'] = torch.tensor(1.0)
  path = str(tmp_path / 'scale.pt')
  torch.save(state, path)
  np.testing.assert_allclose(hps.HPSv21(checkpoint=path, model_cfg=tiny['model_cfg'])(x, prompts),
                             reward(x, prompts), atol=1e-7)
  assert np.all(np.abs(reward(x, prompts)) <= 1)


def test_plain_state_dict_file(tiny, reward, tmp_path):
  """A file holding the state dict itself (no 'state_dict' key) loads too."""
  path = str(tmp_path / 'plain.pt')
  torch.save(torch.load(tiny['checkpoint'], weights_only=True)['state_dict'], path)
  x = images(m=2, seed=8)
  np.testing.assert_allclose(hps.HPSv21(checkpoint=path, model_cfg=tiny['model_cfg'])(x, PROMPTS[:2]),
                             reward(x, PROMPTS[:2]), atol=1e-7)


def test_non_finite_and_failing_images_are_nan(tiny, reward, tmp_path, monkeypatch):
  """A non-finite score is NaN; an image whose scoring raises is NaN alone (its batch retried one by one)."""
  state = torch.load(tiny['checkpoint'], weights_only=True)
  state['state_dict']['visual.proj'][0, 0] = float('inf')
  path = str(tmp_path / 'inf.pt')
  torch.save(state, path)
  got = hps.HPSv21(checkpoint=path, model_cfg=tiny['model_cfg'])(images(m=2), ['a', 'b'])
  assert got.shape == (2,) and np.isnan(got).all()
  x = images(m=4, seed=9)
  x[2] = 7
  good = reward(x, PROMPTS)
  raw = hps.HPSv21.raw

  def fragile(self, samples, prompts):
    if (samples == 7).all(axis=(1, 2, 3)).any():
      raise RuntimeError('boom')
    return raw(self, samples, prompts)

  monkeypatch.setattr(hps.HPSv21, 'raw', fragile)
  got = reward(x, PROMPTS)
  assert np.isnan(got[2]) and not np.isnan(np.delete(got, 2)).any()
  np.testing.assert_allclose(np.delete(got, 2), np.delete(good, 2), atol=1e-6)


# ------------------------------------------------------------------------------------------ ViT-H-14
def test_vit_h_14_layout():
  """The default model is open_clip's ViT-H-14: its state dict names and shapes (686 tensors, 986,109,441
  numbers), built on the meta device."""
  assert hps.model_config() == {
      'embed_dim': 1024,
      'vision_cfg': {'image_size': 224, 'layers': 32, 'width': 1280, 'head_width': 80, 'patch_size': 14,
                     'mlp_ratio': 4.0},
      'text_cfg': {'context_length': 77, 'vocab_size': 49408, 'width': 1024, 'heads': 16, 'layers': 24}}
  state = hps.build_model().state_dict()
  shapes = {k: tuple(v.shape) for k, v in state.items()}
  assert len(shapes) == 686 and sum(math.prod(s) for s in shapes.values()) == 986_109_441
  for name, shape in {'visual.conv1.weight': (1280, 3, 14, 14), 'visual.class_embedding': (1280,),
                      'visual.positional_embedding': (257, 1280), 'visual.proj': (1280, 1024),
                      'visual.transformer.resblocks.31.attn.in_proj_weight': (3840, 1280),
                      'visual.transformer.resblocks.31.mlp.c_fc.weight': (5120, 1280),
                      'visual.ln_post.bias': (1280,), 'token_embedding.weight': (49408, 1024),
                      'positional_embedding': (77, 1024), 'text_projection': (1024, 1024),
                      'transformer.resblocks.23.attn.out_proj.weight': (1024, 1024),
                      'transformer.resblocks.23.mlp.c_proj.weight': (1024, 4096), 'ln_final.weight': (1024,),
                      'logit_scale': ()}.items():
    assert shapes[name] == shape, name


# ------------------------------------------------------------------------------------------ errors
def test_bad_inputs_one_line(reward):
  x = images(m=2)
  for bad in (x.astype(np.float32), x[..., 0], x[:, :, :, :2], np.zeros((2, 0, 5, 3), np.uint8)):
    with pytest.raises(ValueError) as e:
      reward(bad, ['a', 'b'])
    one_line(e, 'hpsv21', 'uint8 RGB images (M, H, W, 3)')
  with pytest.raises(ValueError) as e:
    reward(x, ['a'])
  one_line(e, 'hpsv21', '1 prompts for 2 images')
  with pytest.raises(ValueError) as e:
    reward(x, ['a', None])
  one_line(e, 'hpsv21', 'not a string')
  assert reward(x[:0], []).shape == (0,)


def test_bad_kwargs_and_files_one_line(tiny, tmp_path):
  """No checkpoint, batch_size 0, half precision on CPU, an unsupported model_cfg field, a missing file, a
  file that is no state dict, a state dict missing / adding names or with other shapes, the tiny file read
  as ViT-H-14."""
  cfg = tiny['model_cfg']
  for kwargs, words in (({}, ['no checkpoint', 'HPS_v2.1_compressed.pt']),
                        ({**tiny, 'batch_size': 0}, ['batch_size 0']),
                        ({**tiny, 'dtype': 'bfloat16', 'device': 'cpu'}, ['CUDA']),
                        ({**tiny, 'model_cfg': {**cfg, 'vision_cfg': {**cfg['vision_cfg'],
                                                                      'attentional_pool': True}}},
                         ['vision_cfg.attentional_pool is not supported'])):
    with pytest.raises(ValueError) as e:
      hps.HPSv21(**kwargs)
    one_line(e, 'hpsv21', *words)
  missing = str(tmp_path / 'nowhere.pt')
  with pytest.raises(hps.CheckpointError) as e:
    hps.HPSv21(checkpoint=missing, model_cfg=cfg)
  one_line(e, f'hpsv21 checkpoint {missing}: no such file')
  junk = str(tmp_path / 'junk.pt')
  torch.save([1, 2], junk)
  with pytest.raises(hps.CheckpointError) as e:
    hps.HPSv21(checkpoint=junk, model_cfg=cfg)
  one_line(e, 'hpsv21 checkpoint', 'not a state dict')
  state = torch.load(tiny['checkpoint'], weights_only=True)['state_dict']
  odd = dict(state)
  del odd['visual.proj'], odd['ln_final.bias']
  odd['visual.head.weight'] = torch.zeros(2)
  path = str(tmp_path / 'odd.pt')
  torch.save({'state_dict': odd}, path)
  with pytest.raises(hps.CheckpointError) as e:
    hps.HPSv21(checkpoint=path, model_cfg=cfg)
  one_line(e, 'hpsv21 checkpoint', 'does not match the model_cfg CLIP', "2 missing (e.g. 'ln_final.bias')",
           "1 unexpected (e.g. 'visual.head.weight')")
  wide = dict(state, text_projection=torch.zeros(32, 8))
  torch.save({'state_dict': wide}, path)
  with pytest.raises(hps.CheckpointError) as e:
    hps.HPSv21(checkpoint=path, model_cfg=cfg)
  one_line(e, "1 shapes differ, e.g. 'text_projection' (32, 8), not (32, 16)")
  with pytest.raises(hps.CheckpointError) as e:
    hps.HPSv21(checkpoint=tiny['checkpoint'])
  one_line(e, 'hpsv21 checkpoint', 'does not match the open_clip ViT-H-14 CLIP', 'missing')


def test_input_problems(tiny, tmp_path):
  """input_problems finds an unset or missing checkpoint and a bad model_cfg without loading anything."""
  assert hps.input_problems(tiny) == []
  assert hps.input_problems({}) == [
      'hpsv21: config.reward.kwargs.hpsv21.checkpoint is not set (HPS_v2.1_compressed.pt of xswu/HPSv2)']
  missing = str(tmp_path / 'nowhere.pt')
  assert hps.input_problems({'checkpoint': missing}) == [
      f'hpsv21 checkpoint {missing}: no such file (HPS_v2.1_compressed.pt of xswu/HPSv2)']
  bad = copy.deepcopy(tiny)
  bad['model_cfg']['text_cfg']['vocab_size'] = 1000
  problems = hps.input_problems(bad)
  assert len(problems) == 1 and 'vocab_size 1000 < 49408' in problems[0]
  assert hps.bpe_path() is not None
  if NAME in registry.BUILTIN:
    assert registry.BUILTIN[NAME] == TARGET
    assert registry.INPUT_CHECKS[NAME] == 'ddrl_jax.rewards.hps:input_problems'
    assert registry.score_bound(NAME) == (-1.0, 1.0)
    assert registry.input_problems(NAME, {'checkpoint': missing})
    assert isinstance(registry.make_reward(NAME, **tiny), hps.HPSv21)


def test_module_imports_without_torch():
  code = ('import sys; sys.modules["torch"] = sys.modules["transformers"] = sys.modules["PIL"] = None; '
          'import ddrl_jax.rewards.hps as m; print(m.input_problems({}))')
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert 'hpsv21' in out.stdout
