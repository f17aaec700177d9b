"""The JAX HPSv2.1 reward (ddrl_jax/rewards/hps_jax.py, `hpsv21_jax`) against the torch one (hps.py,
`hpsv21`) on the tiny random open_clip-layout checkpoint of `hps.save_tiny` ({'state_dict': ...} in a torch
file, as the released HPS_v2.1_compressed.pt), float32.

Layout: the open_clip names and shapes the JAX loader expects are hps.build_model's state dict (tiny and
ViT-H-14), and they fill every ClipModel parameter once. Pixels: torch's antialiased bicubic weights are
reproduced bit for bit, and the device pixels (longer side resized, centred zero padding, mean / std) equal
hps.pixels to float32 round-off, down- and upscaling, portrait and landscape. Scores: equal to hpsv21 within
1e-5 relative at two image shapes (one non-square: padding) and four prompts (empty, truncated, cleaned),
end to end and on hps' own pixels; the measured numbers are printed (-s). Sharded on a (data 2, fsdp 4)
mesh of the 8 CPU devices (tests/conftest.py) = one device within 1e-6. Bad files, kwargs and inputs: one
line naming the reward; a non-finite score is NaN.
"""
import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip('torch')

# pylint: disable=g-import-not-at-top,g-bad-import-order
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ddrl_jax.rewards import clip_jax as cj
from ddrl_jax.rewards import hps
from ddrl_jax.rewards import hps_jax
from ddrl_jax.rewards import registry
# pylint: enable=g-import-not-at-top,g-bad-import-order

NAME, TARGET = 'hpsv21_jax', 'ddrl_jax.rewards.hps_jax:HPSv21Jax'
RTOL = 1e-5                                               # the bar for torch parity (float32)
PROMPTS = ['a cat', '', 'a dog ' * 40, 'A Photo of  a CAT!']    # empty; truncated at 77 tokens; cleaned
SIZE = hps.TINY_CFG['vision_cfg']['image_size']           # 32


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
  return hps.save_tiny(str(tmp_path_factory.mktemp('hps_jax')), seed=1)


@pytest.fixture(scope='module')
def reference(tiny):
  return hps.HPSv21(**tiny, batch_size=4)


@pytest.fixture(scope='module')
def reward(tiny):
  return hps_jax.HPSv21Jax(**tiny, batch_size=4)


def images(m=4, h=41, w=57, seed=0):
  """(m, h, w, 3) uint8: gradients, noise and a white band (sharp edges: bicubic overshoot)."""
  rng = np.random.RandomState(seed)
  yy, xx = np.mgrid[0:h, 0:w]
  base = np.stack([xx / w, yy / h, (xx + yy) / (h + w)], -1) * 180
  x = np.clip(base[None] + rng.randint(0, 70, (m, h, w, 3)), 0, 255).astype(np.uint8)
  x[:, :, : max(w // 4, 1)] = 255
  return x


def rel(a, b):
  """max |a - b| relative to the largest |b| (a cosine near 0 makes the elementwise ratio meaningless)."""
  b = np.asarray(b, np.float64)
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def elementwise(a, b):
  b = np.asarray(b, np.float64)
  return float(np.max(np.abs(np.asarray(a, np.float64) - b) / np.abs(b)))


def one_line(excinfo, *words):
  msg = str(excinfo.value)
  assert '\n' not in msg, msg
  for w in words:
    assert w in msg, (w, msg)


# ------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize('model_cfg', [hps.TINY_CFG, None], ids=['tiny', 'vit_h_14'])
def test_layout_is_hps_state_dict_and_fills_every_parameter(model_cfg):
  """checkpoint_layout = the names and shapes of hps.build_model's state dict (ViT-H-14: 686 tensors); each
  tensor maps onto ClipModel parameters of the right shapes, and every parameter (each layer of the stacked
  ones) is filled exactly once. Checked on broadcast views: nothing of ViT-H-14's size is allocated."""
  config = hps_jax.clip_config(model_cfg)
  layout = hps_jax.checkpoint_layout(config)
  assert layout == {k: tuple(v.shape) for k, v in hps.build_model(model_cfg).state_dict().items()}
  flat = cj.flat_shapes(config)
  count = {p: 0 for p in flat}
  for name, shape in layout.items():
    view = np.broadcast_to(np.float32(0), shape)
    for path, idx, array in hps_jax._targets(name, view):  # pylint: disable=protected-access
      want = flat[path].shape if idx is None else flat[path].shape[1:]
      assert tuple(array.shape) == tuple(want), (name, path)
      count[path] += 1
  assert all(n == (flat[p].shape[0] if 'layers' in p else 1) for p, n in count.items()), count
  if model_cfg is None:
    assert len(layout) == 686
    v, t = config.vision, config.text
    assert (v.hidden_size, v.intermediate_size, v.num_layers, v.num_heads) == (1280, 5120, 32, 16)
    assert (t.hidden_size, t.intermediate_size, t.num_layers, t.num_heads) == (1024, 4096, 24, 16)
    assert v.hidden_act == t.hidden_act == 'gelu' and v.layer_norm_eps == 1e-5
    assert (config.image_size, config.patch_size, config.projection_dim, config.vocab_size,
            config.max_positions) == (224, 14, 1024, 49408, 77)
    assert config.eos_token_id == 2        # ClipModel's argmax-of-the-ids pooling (open_clip's)


def test_weights_are_the_checkpoints(tiny, tmp_path):
  """The fused in_proj rows land in q, k, v (transposed), conv1 in the (c, i, j)-ordered patch kernel, the
  projections as they are; a plain state dict file (no 'state_dict' key) gives the same parameters."""
  state = torch.load(tiny['checkpoint'], weights_only=True)['state_dict']
  config = hps_jax.clip_config(tiny['model_cfg'])
  params = hps_jax.load_params(tiny['checkpoint'], config)
  w = state['visual.transformer.resblocks.1.attn.in_proj_weight'].numpy()
  d = w.shape[1]
  for i, proj in enumerate(('q_proj', 'k_proj', 'v_proj')):
    got = params[('vision_model', 'encoder', 'layers', 'self_attn', proj, 'kernel')][1]
    np.testing.assert_array_equal(got, w[i * d:(i + 1) * d].T)
  conv = state['visual.conv1.weight'].numpy()
  np.testing.assert_array_equal(params[('vision_model', 'embeddings', 'patch_embedding', 'kernel')],
                                conv.reshape(conv.shape[0], -1).T)
  np.testing.assert_array_equal(params[('text_projection', 'kernel')], state['text_projection'].numpy())
  np.testing.assert_array_equal(params[('text_model', 'encoder', 'layers', 'mlp', 'fc2', 'kernel')][0],
                                state['transformer.resblocks.0.mlp.c_proj.weight'].numpy().T)
  plain = str(tmp_path / 'plain.pt')
  torch.save(state, plain)
  again = hps_jax.load_params(plain, config)
  assert again.keys() == params.keys() and all(np.array_equal(again[k], params[k]) for k in params)


# ------------------------------------------------------------------------------------------ pixels
@pytest.mark.parametrize('n_in,n_out', [(57, 32), (41, 23), (13, 21), (1000, 224), (333, 224), (7, 224)])
def test_bicubic_weights_are_torchs_bit_for_bit(n_in, n_out):
  """torch_aa_matrix(kind='bicubic') = the float32 weights torch's interpolate(mode='bicubic',
  antialias=True) applies (read off a one-hot input), down and up."""
  x = torch.zeros(1, n_in, 1, n_in)
  x[0, torch.arange(n_in), 0, torch.arange(n_in)] = 1
  y = torch.nn.functional.interpolate(x, size=(1, n_out), mode='bicubic', align_corners=False, antialias=True)
  np.testing.assert_array_equal(cj.torch_aa_matrix(n_in, n_out, 'bicubic'), y[0, :, 0].numpy().T)


@pytest.mark.parametrize('shape', [(41, 57), (57, 41), (20, 13), (100, 37), (64, 64), (32, 21)])
def test_pixels_equal_hps(shape):
  """device_resize_pad / device_pixels = hps.resize_pad / hps.pixels (channels last) to float32 round-off
  (the resize as matmuls, XLA's x * (1 / c) for x / c), down- and upscaling; the zero padding is centred
  (41 x 57 -> 23 rows: 4 above, 5 below); nothing clamped; the longer side at 32: padded only."""
  x = images(m=2, h=shape[0], w=shape[1], seed=2)
  want = hps.resize_pad(x, SIZE).numpy().transpose(0, 2, 3, 1)
  got = np.asarray(hps_jax.device_resize_pad(jnp.asarray(x), SIZE))
  assert got.shape == want.shape == (2, SIZE, SIZE, 3)
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  np.testing.assert_array_equal(got == 0, want == 0)
  px = np.asarray(jax.jit(hps_jax.device_pixels, static_argnums=1)(x, SIZE))
  print(f'{shape}: pixels max |jax - torch| {np.abs(px - hps.pixels(x, SIZE).numpy().transpose(0, 2, 3, 1)).max():.1e}')
  np.testing.assert_allclose(px, hps.pixels(x, SIZE).numpy().transpose(0, 2, 3, 1), atol=3e-6, rtol=0)
  if shape == (41, 57):
    assert np.all(got[:, :4] == 0) and np.all(got[:, 27:] == 0) and np.all(np.abs(got[:, 4]).sum(-1) > 0)
    assert got.max() > 1.0                 # bicubic overshoot at the white band, kept
  if shape == (32, 21):                    # 5 columns left, 6 right; the pixels themselves x / 255
    np.testing.assert_allclose(got[:, :, 5:26], x / np.float32(255), atol=1e-7, rtol=0)
    assert np.all(got[:, :, :5] == 0) and np.all(got[:, :, 26:] == 0)


# ------------------------------------------------------------------------------------------ parity
def test_parity_with_torch_hpsv21(tiny, reference, reward):
  """hpsv21_jax = hpsv21 within 1e-5 of the largest score (fp32) at a non-square (41 x 57: padded rows) and
  a square (96 x 96) shape, four prompts; also on hps' own pixels (preprocess='host', scores_from_pixels).
  The measured differences (~1e-6 of the scale: float32 round-off, as torch's own batch-size changes) are
  printed (-s)."""
  worst = 0.0
  for shape, seed in (((41, 57), 3), ((96, 96), 6)):
    x = images(m=4, h=shape[0], w=shape[1], seed=seed)
    want = reference(x, PROMPTS)
    got = reward(x, PROMPTS)
    assert got.dtype == np.float32 and got.shape == (4,)
    r = rel(got, want)
    worst = max(worst, r)
    print(f'{shape}: hpsv21_jax vs hpsv21: max |diff| / max |score| {r:.2e}, max abs {np.abs(got - want).max():.2e}, '
          f'max elementwise rel {elementwise(got, want):.2e} (scores {np.round(want, 4).tolist()})')
    assert r <= RTOL, (got, want)
    assert np.std(want) > 1e-2                  # the scores vary: a wrong pairing or pixel path would show
    pixels = hps.pixels(x, SIZE).numpy().transpose(0, 2, 3, 1)
    on_torch_pixels = jax.jit(reward.scores_from_pixels)(reward.params, pixels, reward.tokenize(PROMPTS))
    print(f'{shape}: on hps.pixels: max |diff| / max |score| {rel(on_torch_pixels, want):.2e}')
    assert rel(on_torch_pixels, want) <= RTOL
  assert rel(reward(x[::-1], PROMPTS), reference(x[::-1], PROMPTS)) <= RTOL   # other (image, prompt) pairs
  host = hps_jax.HPSv21Jax(**tiny, batch_size=4, preprocess='host')
  assert rel(host(x, PROMPTS), reference(x, PROMPTS)) <= RTOL
  print(f'worst relative difference {worst:.2e}')


def test_tokens_are_hps(reference, reward):
  ids = reward.tokenize(PROMPTS)
  assert ids.dtype == np.int32 and ids.shape == (4, 77)
  np.testing.assert_array_equal(ids, reference.tokenizer(PROMPTS).numpy())
  assert reward.tokenize([]).shape == (0, 77)


# ------------------------------------------------------------------------------------------ sharding, jit
def test_sharded_equals_one_device(tiny, reward):
  """On a (data 2, fsdp 4) mesh of the 8 CPU devices, the weights FSDP-sharded over 'fsdp' and the batch
  over 'data': equal to the one-device reward within 1e-6 (one shape: one compile each)."""
  assert jax.device_count() >= 8, 'tests/conftest.py sets jax_num_cpu_devices=8'
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ('data', 'fsdp'))
  sharded = hps_jax.HPSv21Jax(**tiny, batch_size=4, mesh=mesh, fsdp_axis='fsdp')
  kernel = sharded.params['clip']['vision_model']['encoder']['layers']['mlp']['fc1']['kernel'].get_value()
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, 'fsdp')
  x = images(m=4, seed=4)
  prompts = ['two dogs'] + PROMPTS[1:]
  np.testing.assert_allclose(sharded(x, prompts), reward(x, prompts), rtol=1e-6, atol=1e-6)


def test_scores_lower_under_jit_from_abstract_shapes(reward):
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), reward.params)
  lowered = jax.jit(reward.scores).lower(params, jax.ShapeDtypeStruct((4, 48, 64, 3), jnp.uint8),
                                         jax.ShapeDtypeStruct((4, 77), jnp.int32))
  assert lowered.out_info.shape == (4,) and lowered.out_info.dtype == jnp.float32


# ------------------------------------------------------------------------------------------ NaN, errors
def test_non_finite_scores_are_nan(tiny, tmp_path):
  state = torch.load(tiny['checkpoint'], weights_only=True)
  state['state_dict']['visual.proj'][0, 0] = float('inf')
  path = str(tmp_path / 'inf.pt')
  torch.save(state, path)
  got = hps_jax.HPSv21Jax(checkpoint=path, model_cfg=tiny['model_cfg'], batch_size=4)(images(), PROMPTS)
  assert got.shape == (4,) and got.dtype == np.float32 and np.isnan(got).all()


def test_bad_kwargs_and_files_one_line(tiny, tmp_path):
  """No checkpoint, batch_size 0, float16, torch's device kwarg, an unknown preprocess, an unsupported
  model_cfg field, a missing file, a file that is no state dict, a state dict missing / adding names or with
  other shapes, the tiny file read as ViT-H-14, an unknown mesh axis: one line each, naming hpsv21_jax."""
  cfg = tiny['model_cfg']
  for kwargs, words in (({}, ['no checkpoint', 'HPS_v2.1_compressed.pt']),
                        ({**tiny, 'batch_size': 0}, ['batch_size 0']),
                        ({**tiny, 'dtype': 'float16'}, ["dtype 'float16'"]),
                        ({**tiny, 'device': 'cuda'}, ['mesh=']),
                        ({**tiny, 'preprocess': 'pil'}, ["preprocess 'pil'"]),
                        ({**tiny, 'model_cfg': {**cfg, 'vision_cfg': {**cfg['vision_cfg'],
                                                                      'attentional_pool': True}}},
                         ['vision_cfg.attentional_pool is not supported'])):
    with pytest.raises(ValueError) as e:
      hps_jax.HPSv21Jax(**kwargs)
    one_line(e, 'hpsv21_jax', *words)
    assert str(e.value).startswith('hpsv21_jax')
  missing = str(tmp_path / 'nowhere.pt')
  with pytest.raises(hps_jax.CheckpointError) as e:
    hps_jax.HPSv21Jax(checkpoint=missing, model_cfg=cfg)
  one_line(e, f'hpsv21_jax checkpoint {missing}: no such file')
  junk = str(tmp_path / 'junk.pt')
  torch.save([1, 2], junk)
  with pytest.raises(hps_jax.CheckpointError) as e:
    hps_jax.HPSv21Jax(checkpoint=junk, model_cfg=cfg)
  one_line(e, f'hpsv21_jax checkpoint {junk}', 'not a state dict')
  state = torch.load(tiny['checkpoint'], weights_only=True)['state_dict']
  odd = dict(state)
  del odd['visual.proj'], odd['ln_final.bias']
  odd['visual.head.weight'] = torch.zeros(2)
  path = str(tmp_path / 'odd.pt')
  torch.save({'state_dict': odd}, path)
  with pytest.raises(hps_jax.CheckpointError) as e:
    hps_jax.HPSv21Jax(checkpoint=path, model_cfg=cfg)
  one_line(e, f'hpsv21_jax checkpoint {path}', 'does not match the model_cfg CLIP',
           "2 missing (e.g. 'ln_final.bias')", "1 unexpected (e.g. 'visual.head.weight')")
  wide = dict(state, text_projection=torch.zeros(32, 8))
  torch.save({'state_dict': wide}, path)
  with pytest.raises(hps_jax.CheckpointError) as e:
    hps_jax.HPSv21Jax(checkpoint=path, model_cfg=cfg)
  one_line(e, 'hpsv21_jax checkpoint', "1 shapes differ, e.g. 'text_projection' (32, 8), not (32, 16)")
  with pytest.raises(hps_jax.CheckpointError) as e:
    hps_jax.HPSv21Jax(checkpoint=tiny['checkpoint'])
  one_line(e, 'hpsv21_jax checkpoint', 'does not match the open_clip ViT-H-14 CLIP', 'missing')
  assert isinstance(e.value, hps.CheckpointError)
  mesh = Mesh(np.asarray(jax.devices()[:2]), ('data',))
  with pytest.raises(ValueError) as e:
    hps_jax.HPSv21Jax(**tiny, mesh=mesh, data_axis='batch')
  one_line(e, 'hpsv21_jax', "no mesh axis 'batch'")
  with pytest.raises(ValueError) as e:
    hps_jax.HPSv21Jax(checkpoint=missing, model_cfg=cfg, mesh=mesh, fsdp_axis='fsdp')   # before any file is read
  one_line(e, 'hpsv21_jax', "fsdp_axis 'fsdp': no mesh axis 'fsdp'")


def test_bad_inputs_one_line(reward):
  x = images(m=2)
  for bad in (x.astype(np.float32), x[..., 0], x[:, :, :, :2], np.zeros((2, 0, 5, 3), np.uint8)):
    with pytest.raises(ValueError) as e:
      reward(bad, ['a', 'b'])
    one_line(e, 'hpsv21_jax', 'uint8 RGB images (M, H, W, 3)')
  with pytest.raises(ValueError) as e:
    reward(x, ['a'])
  one_line(e, 'hpsv21_jax', '1 prompts for 2 images')
  with pytest.raises(ValueError) as e:
    reward(x, ['a', None])
  one_line(e, 'hpsv21_jax', 'not a string')
  out = reward(x[:0], [])
  assert out.shape == (0,) and out.dtype == np.float32


def test_input_problems_and_registry(tiny, tmp_path):
  """input_problems = hps' in this reward's name; the registry builds it, in process, bounded as a cosine."""
  assert hps_jax.input_problems(tiny) == []
  assert hps_jax.input_problems({}) == [
      'hpsv21_jax: config.reward.kwargs.hpsv21_jax.checkpoint is not set (HPS_v2.1_compressed.pt of xswu/HPSv2)']
  missing = str(tmp_path / 'nowhere.pt')
  assert hps_jax.input_problems({'checkpoint': missing}) == [
      f'hpsv21_jax checkpoint {missing}: no such file (HPS_v2.1_compressed.pt of xswu/HPSv2)']
  bad = copy.deepcopy(tiny)
  bad['model_cfg']['text_cfg']['vocab_size'] = 1000
  problems = hps_jax.input_problems(bad)
  assert len(problems) == 1 and problems[0].startswith('hpsv21_jax: ') and 'vocab_size 1000 < 49408' in problems[0]
  assert registry.BUILTIN[NAME] == TARGET
  assert registry.INPUT_CHECKS[NAME] == 'ddrl_jax.rewards.hps_jax:input_problems'
  assert registry.score_bound(NAME) == (-1.0, 1.0) and NAME in registry.IN_PROCESS
  assert registry.input_problems(NAME, {'checkpoint': missing})
  assert isinstance(registry.make_reward(NAME, **tiny), hps_jax.HPSv21Jax)


@pytest.mark.slow
def test_bfloat16_and_failing_images(tiny, reward, monkeypatch):
  """bfloat16 weights and matmuls stay close to float32 (0.03); an image whose scoring raises is NaN alone
  (its batch retried one image at a time)."""
  x = images(m=4, seed=9)
  good = reward(x, PROMPTS)
  half = hps_jax.HPSv21Jax(**tiny, dtype='bfloat16', batch_size=4)
  assert half.params['clip']['text_projection']['kernel'].get_value().dtype == jnp.bfloat16
  np.testing.assert_allclose(half(x, PROMPTS), good, atol=0.03)
  x[2] = 7
  good = reward(x, PROMPTS)
  chunk = hps_jax.HPSv21Jax._score_chunk    # pylint: disable=protected-access

  def fragile(self, samples, ids):
    if (samples == 7).all(axis=(1, 2, 3)).any():
      raise RuntimeError('boom')
    return chunk(self, samples, ids)

  monkeypatch.setattr(hps_jax.HPSv21Jax, '_score_chunk', fragile)
  got = reward(x, PROMPTS)
  assert np.isnan(got[2]) and not np.isnan(np.delete(got, 2)).any()
  np.testing.assert_allclose(np.delete(got, 2), np.delete(good, 2), atol=1e-6)
  assert math.isfinite(float(np.nanmax(np.abs(got))))
