"""VideoAlign reward (ddrl_jax/rewards/videoalign.py) on a tiny random Qwen2-VL: frame sampling and sizes
against qwen_vl_utils, the resize against PIL, the patch layout against transformers' Qwen2-VL image
processor, the special-token head against the transformers model's own hidden states, the LoRA merge
against peft's, the normalisation, checkpoint selection and errors, the reward end to end, and the tiny
checkpoint of `videoalign.save_tiny` (its LoRA layout against peft, its scores through the registry).

qwen-vl-utils is pinned to 0.0.8: its smart_nframes rounds to an even count as KwaiVGI/VideoAlign's
vendored vision_process.py does (0.0.9 and later floor, which gives 10 frames, not 12, for DDRL's 93 frames
at 16 fps). It imports torchvision at module level for its video readers; where no working torchvision is
installed (the PyPI torchvision wheels need a CUDA torch), it is imported with a stand-in, since
smart_nframes and smart_resize never touch it."""
import functools
import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
import time
import types
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

# pylint: disable=g-import-not-at-top,g-bad-import-order
import peft
from safetensors.torch import load_file
from safetensors.torch import save_file
from transformers.models.qwen2_vl import image_processing_qwen2_vl

from ddrl_jax import rewards
from ddrl_jax.rewards import videoalign as va
# pylint: enable=g-import-not-at-top,g-bad-import-order

SMALL = 4 * 28 * 28      # min_pixels that keeps 56 x 56 frames at 56 x 56 (fast tests)


# -------------------------------------------------------------------------------------- helpers
@functools.lru_cache(maxsize=None)
def vision_process():
  """qwen_vl_utils.vision_process, with a stand-in torchvision when the real one cannot be imported."""
  version = importlib.metadata.version('qwen-vl-utils')
  assert version == '0.0.8', f'these tests compare against qwen-vl-utils 0.0.8, found {version}'
  try:
    from qwen_vl_utils import vision_process as vp  # pylint: disable=g-import-not-at-top
    return vp
  except (ImportError, RuntimeError):
    pass
  for name in [m for m in sys.modules if m.startswith(('qwen_vl_utils', 'torchvision'))]:
    del sys.modules[name]
  tv = types.ModuleType('torchvision')
  tv.__version__ = '0.0'
  tv.io = types.ModuleType('torchvision.io')
  tv.transforms = types.ModuleType('torchvision.transforms')
  tv.transforms.InterpolationMode = types.SimpleNamespace(BICUBIC='bicubic')
  stand_in = {'torchvision': tv, 'torchvision.io': tv.io, 'torchvision.transforms': tv.transforms}
  with mock.patch.dict(sys.modules, stand_in):
    from qwen_vl_utils import vision_process as vp  # pylint: disable=g-import-not-at-top
  return vp


@pytest.fixture(scope='module')
def base_dir(tmp_path_factory):
  """A tiny random Qwen2-VL base model directory: weights, tokenizer, preprocessor config."""
  return va.save_tiny_base(str(tmp_path_factory.mktemp('qwen2vl_tiny')))


def current_key(key):
  """A transformers 4.45 parameter name (the reference's pin) as this transformers version names it."""
  if key.startswith('visual.'):
    return 'model.' + key
  if key.startswith('model.'):
    return 'model.language_model.' + key[len('model.'):]
  return key


def direct_inputs(config, special_ids, grid, seed=0, lengths=(40, 31)):
  """Hand-made input_ids (B=2, right padding): text, the video block, text with the three special tokens
  in order, text; plus random pixel rows for `grid` (t, gh, gw) per video."""
  rng = np.random.RandomState(seed)
  n_video = grid[0] * grid[1] * grid[2] // 4
  rows = []
  for n in lengths:
    words = list(rng.randint(10, 500, size=n))
    a, b, c = sorted(rng.choice(np.arange(3, n - 2), 3, replace=False))
    ids = (words[:2] + [config.vision_start_token_id] + [config.video_token_id] * n_video
           + [config.vision_end_token_id] + words[2:a] + [special_ids[0]] + words[a:b] + [special_ids[1]]
           + words[b:c] + [special_ids[2]] + words[c:])
    rows.append(ids)
  width = max(len(r) for r in rows)
  input_ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
  mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
  dim = 3 * 2 * 14 * 14
  pixels = torch.tensor(rng.normal(size=(2 * grid[0] * grid[1] * grid[2], dim)), dtype=torch.float32)
  return dict(input_ids=input_ids, attention_mask=mask, pixel_values_videos=pixels,
              video_grid_thw=torch.tensor([grid, grid]))


# ---------------------------------------------------------------------------- frames and sizes
@pytest.mark.parametrize('total,fps', [(93, 16), (121, 24), (8, 16), (16, 8), (300, 30), (33, 16),
                                       (5, 30), (2, 16), (3, 1), (2000, 1), (49, 8), (81, 16), (17, 2)])
def test_num_frames_matches_qwen_vl_utils(total, fps):
  want = vision_process().smart_nframes({'fps': 2.0}, total_frames=total, video_fps=fps)
  assert va.num_frames(total, fps) == want


def test_ddrl_video_reads_12_frames_at_these_indices():
  assert va.num_frames(93, 16.0) == 12
  np.testing.assert_array_equal(va.frame_indices(93, 12), np.round(np.linspace(0, 92, 12)))
  np.testing.assert_array_equal(va.frame_indices(93, 12), [0, 8, 17, 25, 33, 42, 50, 59, 67, 75, 84, 92])
  for total, n in [(8, 4), (121, 10), (300, 40), (17, 4)]:
    np.testing.assert_array_equal(va.frame_indices(total, n), np.round(np.linspace(0, total - 1, n)))
  with pytest.raises(ValueError, match='at least 2 frames'):
    va.num_frames(1, 16)


@pytest.mark.parametrize('h,w', [(704, 1280), (480, 832), (56, 56), (720, 1280), (1080, 1920),
                                 (100, 3000), (28, 28), (512, 512), (33, 47), (448, 448), (2000, 30)])
def test_smart_resize_matches_qwen_vl_utils(h, w):
  want = vision_process().smart_resize(h, w, factor=28, min_pixels=128 * 28 * 28, max_pixels=200704)
  assert va.smart_resize(h, w) == want


def test_smart_resize_known_sizes_and_aspect_limit():
  assert va.smart_resize(704, 1280) == (308, 588)
  assert va.smart_resize(480, 832) == (336, 588)
  with pytest.raises(ValueError, match='aspect'):
    va.smart_resize(10, 2100)
  with pytest.raises(ValueError, match='aspect'):
    vision_process().smart_resize(10, 2100)


@pytest.mark.parametrize('h,w,out_h,out_w', [(704, 1280, 308, 588), (56, 56, 336, 336), (64, 96, 28, 56)])
def test_resize_is_antialiased_bicubic_like_pil(h, w, out_h, out_w):
  """torch's antialiased bicubic (the reference's torchvision resize) is PIL's bicubic filter: compared on
  float images before rounding; the returned frames are those values clamped and rounded."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  frames = np.random.RandomState(0).randint(0, 256, (1, h, w, 3), dtype=np.uint8)
  exact = va.resize_frames(frames, out_h, out_w, quantize=False)
  assert exact.shape == (1, 3, out_h, out_w)
  pil = np.stack([np.asarray(Image.fromarray(frames[0, :, :, c].astype(np.float32), 'F')
                             .resize((out_w, out_h), Image.BICUBIC)) for c in range(3)])
  np.testing.assert_allclose(exact[0].numpy(), pil, atol=0.02)
  np.testing.assert_array_equal(va.resize_frames(frames, out_h, out_w), exact.clamp(0, 255).round())
  flat = np.full((2, h, w, 3), 77, np.uint8)
  assert (va.resize_frames(flat, out_h, out_w) == 77).all()


@pytest.mark.parametrize('n,h,w', [(4, 56, 84), (3, 84, 56)])
def test_patchify_matches_qwen2vl_image_processor(n, h, w):
  """Rows and grid as transformers' (slow) Qwen2-VL processor lays out a video of 0..255 integer-valued
  float frames (its own resize is the identity on sizes that are multiples of 28 within its pixel bounds,
  as the reward's frames always are)."""
  frames = torch.tensor(np.random.RandomState(1).randint(0, 256, (n, 3, h, w)), dtype=torch.float32)
  rows, grid = va.patchify(frames, va.CLIP_MEAN, va.CLIP_STD)
  proc = image_processing_qwen2_vl.Qwen2VLImageProcessor()
  with mock.patch.object(image_processing_qwen2_vl.logger, 'warning'):   # "videos are deprecated here"
    want = proc.preprocess(images=None, videos=[[f.permute(1, 2, 0).numpy() for f in frames]],
                           return_tensors='np')
  assert tuple(want['video_grid_thw'][0]) == grid == ((n + 1) // 2, h // 14, w // 14)
  np.testing.assert_allclose(rows.numpy(), want['pixel_values_videos'], atol=1e-5)


# ------------------------------------------------------------------------------------------ prompt
def test_prompt_has_three_blocks_with_the_user_prompt_only_in_text_alignment():
  text = va.build_prompt('a red fox runs through snow')
  starts = [text.index(f'**{name}:**') for name in ('Visual Quality', 'Motion Quality', 'Text Alignment')]
  ends = [text.index(t) for t in va.SPECIAL_TOKENS]
  assert starts[0] < ends[0] < starts[1] < ends[1] < starts[2] < ends[2]
  assert all(text.count(t) == 1 for t in va.SPECIAL_TOKENS)
  assert text.count('a red fox runs through snow') == 1
  assert starts[2] < text.index('a red fox') < ends[2]
  assert text.count('END') == 3
  assert '{text_prompt}' not in text and va.build_prompt('{x} }{') .count('{x} }{') == 1


def test_prompt_template_from_string_or_file_and_bad_templates(tmp_path):
  custom = 'Q <|VQ_reward|> M <|MQ_reward|> prompt: {text_prompt} <|TA_reward|>'
  want = 'Q <|VQ_reward|> M <|MQ_reward|> prompt: cat <|TA_reward|>'
  assert va.build_prompt('cat', va.load_template(custom)) == want
  path = tmp_path / 'rubric.txt'
  path.write_text(custom)
  assert va.load_template(str(path)) == custom
  for bad in ['no fields at all', custom.replace('{text_prompt}', ''), custom.replace('<|MQ_reward|>', ''),
              'A <|MQ_reward|> B <|VQ_reward|> {text_prompt} <|TA_reward|>', str(tmp_path / 'missing.txt')]:
    with pytest.raises(ValueError, match='prompt_template'):
      va.load_template(bad)
  with pytest.raises(ValueError, match='not a string'):
    va.build_prompt(None)


def test_chat_text_puts_the_video_first_then_the_rubric():
  tokenizer = va.tiny_tokenizer()
  text = tokenizer.apply_chat_template(va.chat_messages(va.build_prompt('a cat')), tokenize=False,
                                       add_generation_prompt=True)
  assert text.index('<|video_pad|>') < text.index('Visual Quality') < text.index('a cat')
  assert text.endswith('<|im_start|>assistant\n') and text.count('<|im_start|>user') == 1


# ------------------------------------------------------------------------------------------ head
@pytest.mark.parametrize('output_dim', [1, 3])
def test_head_reads_rm_head_at_the_special_tokens(base_dir, output_dim):
  """raw_rewards against the transformers model's own last (post-norm) hidden state at the three special
  tokens, with the head applied by hand; rows are right-padded and each row equals its unbatched score."""
  model, _, ids = va.tiny_reward_model(base_dir, output_dim)
  batch = direct_inputs(model.config, ids, grid=(2, 4, 4))
  positions = va.sequential_positions(batch['input_ids'])
  with torch.no_grad():
    got = va.raw_rewards(model, ids, **batch).numpy()
    out = model(**batch, position_ids=positions, output_hidden_states=True)
  last = out.hidden_states[-1].numpy()
  w = model.rm_head.weight.detach().numpy()           # (output_dim, hidden)
  want = np.zeros((2, 3))
  for b in range(2):
    for j, tid in enumerate(ids):
      (pos,) = np.nonzero(batch['input_ids'][b].numpy() == tid)[0]
      logits = last[b, pos] @ w.T
      want[b, j] = logits[j] if output_dim == 3 else logits[0]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  n_rows = int(batch['video_grid_thw'][0].prod())
  for b in range(2):
    width = int(batch['attention_mask'][b].sum())
    one = dict(input_ids=batch['input_ids'][b:b + 1, :width],
               attention_mask=batch['attention_mask'][b:b + 1, :width],
               pixel_values_videos=batch['pixel_values_videos'][b * n_rows:(b + 1) * n_rows],
               video_grid_thw=batch['video_grid_thw'][b:b + 1])
    with torch.no_grad():
      np.testing.assert_allclose(va.raw_rewards(model, ids, **one).numpy()[0], got[b], rtol=1e-5, atol=1e-5)


def test_head_rejects_missing_or_repeated_special_tokens(base_dir):
  model, _, ids = va.tiny_reward_model(base_dir)
  batch = direct_inputs(model.config, ids, grid=(2, 4, 4))
  batch['input_ids'][1][batch['input_ids'][1] == ids[1]] = 11
  with pytest.raises(ValueError, match='MQ_reward'):
    with torch.no_grad():
      va.raw_rewards(model, ids, **batch)


# ------------------------------------------------------------------------------------------ LoRA
@pytest.mark.parametrize('variant', ['adapter', 'adapter_legacy_partial', 'full_peft_keys'])
def test_lora_merge_matches_peft(base_dir, tmp_path, variant):
  """A PEFT LoRA (r=4, alpha=8, random A and B) on the reward model, saved as the reference saves it, then
  loaded by load_model: merged weights and raw rewards equal peft's merge_and_unload() to 1e-5.
  Variants: adapter_model.safetensors + adapter_config.json + the whole non-LoRA state (this transformers'
  names); the same with transformers 4.45 names, only rm_head, embeddings and vision tower in the non-LoRA
  state (the rest from the base) and r/alpha from model_config.json; a full model.pth of the PEFT model."""
  model, _, ids = va.tiny_reward_model(base_dir)
  torch.manual_seed(3)
  lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(va.LORA_TARGETS),
                                init_lora_weights=False, task_type='CAUSAL_LM')
  wrapped = peft.get_peft_model(model, lora_config)
  ckpt = str(tmp_path / 'ckpt')
  step_dir = os.path.join(ckpt, 'checkpoint-12')
  va.write_model_config(ckpt, lora={'r': 4, 'alpha': 8})
  legacy = variant == 'adapter_legacy_partial'
  prefix = 'base_model.model.'
  rename = (lambda k: prefix + va.legacy_key(k[len(prefix):])) if legacy else (lambda k: k)
  if variant == 'full_peft_keys':
    os.makedirs(step_dir)
    torch.save({k: v.clone() for k, v in wrapped.state_dict().items()}, os.path.join(step_dir, 'model.pth'))
  else:
    wrapped.save_pretrained(step_dir, save_embedding_layers=False)
    non_lora = {k: p.detach().clone() for k, p in wrapped.named_parameters() if 'lora_' not in k}
    if legacy:
      keep = ('rm_head', 'embed_tokens', 'visual')
      non_lora = {k: v for k, v in non_lora.items() if any(s in k for s in keep)}
      adapter = os.path.join(step_dir, 'adapter_model.safetensors')
      save_file({rename(k): v for k, v in load_file(adapter).items()}, adapter)
      os.remove(os.path.join(step_dir, 'adapter_config.json'))
    torch.save({rename(k): v for k, v in non_lora.items()}, os.path.join(step_dir, 'non_lora_state_dict.pth'))
  mine = va.load_model(ckpt, base_model=base_dir, dtype='float32')
  merged = wrapped.merge_and_unload()
  want = merged.state_dict()
  got = mine.model.state_dict()
  assert set(got) == set(want)
  for k, v in want.items():
    np.testing.assert_allclose(got[k].numpy(), v.numpy(), rtol=1e-5, atol=1e-5, err_msg=k)
  batch = direct_inputs(merged.config, ids, grid=(2, 2, 2))
  with torch.no_grad():
    np.testing.assert_allclose(va.raw_rewards(mine.model, mine.special_ids, **batch).numpy(),
                               va.raw_rewards(merged, ids, **batch).numpy(), rtol=1e-5, atol=1e-5)
  assert mine.special_ids == ids


# ---------------------------------------------------------------------------------- normalisation
def test_normalisation_mean_and_sum():
  raw = np.array([[3.6757, 1.1646, 2.8105], [5.9233, -0.2165, 7.8347], [np.nan, 0.0, 0.0]])
  out = va.score_table(raw, va.DEFAULT_NORM)
  np.testing.assert_allclose(out['vq'][:2], [0.0, 1.0], atol=1e-6)
  np.testing.assert_allclose(out['mq'][:2], [0.0, -1.0], atol=1e-6)
  np.testing.assert_allclose(out['ta'][:2], [0.0, 2.0], atol=1e-6)
  np.testing.assert_allclose(out['sum'][:2], [0.0, 2.0], atol=1e-5)
  np.testing.assert_allclose(out['mean'][:2], [0.0, 2 / 3], atol=1e-5)
  assert np.isnan(out['vq'][2]) and np.isnan(out['mean'][2]) and np.isnan(out['sum'][2])
  assert not np.isnan(out['mq'][2])
  assert all(v.dtype == np.float32 and v.shape == (3,) for v in out.values())
  np.testing.assert_allclose(va.score_table(raw[:2], None)['sum'], raw[:2].sum(1), rtol=1e-6)
  cfg = {'inference_config': {'VQ_mean': 1.0, 'VQ_std': 2.0, 'MQ_mean': 0.0, 'MQ_std': 1.0,
                              'TA_mean': -1.0, 'TA_std': 0.5}}
  assert va.norm_from_config(cfg) == {'VQ': (1.0, 2.0), 'MQ': (0.0, 1.0), 'TA': (-1.0, 0.5)}
  assert va.norm_from_config({}) == va.DEFAULT_NORM
  np.testing.assert_allclose(va.score_table([[3.0, 2.0, 0.0]], va.norm_from_config(cfg))['ta'], [2.0])


# ------------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_selection_takes_the_highest_step(tmp_path):
  for name in ['checkpoint-2', 'checkpoint-10', 'checkpoint-9', 'checkpoint-best', 'runs']:
    (tmp_path / name).mkdir()
  (tmp_path / 'checkpoint-99').write_text('a file, not a folder')
  assert va.find_checkpoint(str(tmp_path)) == str(tmp_path / 'checkpoint-10')
  assert va.find_checkpoint(str(tmp_path), step=9) == str(tmp_path / 'checkpoint-9')
  with pytest.raises(va.CheckpointError, match='no checkpoint-3'):
    va.find_checkpoint(str(tmp_path), step=3)


def one_line_error(fn, *names):
  with pytest.raises(va.CheckpointError) as e:
    fn()
  message = str(e.value)
  assert '\n' not in message and all(n in message for n in names), message
  return message


def test_bad_checkpoints_fail_with_one_line_naming_the_file(base_dir, tmp_path):
  load = lambda path: (lambda: va.load_model(str(path), base_model=base_dir, dtype='float32'))
  one_line_error(load(tmp_path / 'nowhere'), 'nowhere', 'no such directory')
  empty = tmp_path / 'empty'
  empty.mkdir()
  one_line_error(load(empty), 'model_config.json', 'missing')
  va.write_model_config(str(empty))
  one_line_error(load(empty), 'empty', 'no checkpoint-<step>')
  (empty / 'checkpoint-1').mkdir()
  one_line_error(load(empty), 'checkpoint-1', 'neither model.pth nor adapter_model.safetensors')

  model, _, _ = va.tiny_reward_model(base_dir)
  good = str(tmp_path / 'good')
  va.write_model_config(good)
  path = va.save_full_checkpoint(good, model, step=7)
  va.load_model(good, base_model=base_dir, dtype='float32')          # loads
  blob = open(path, 'rb').read()
  with open(path, 'wb') as f:
    f.write(blob[:len(blob) // 2])
  one_line_error(load(good), 'model.pth', 'cannot be read')

  state = {va.legacy_key(k): v for k, v in model.state_dict().items()}
  for name, change, what in [
      ('extra', lambda s: s.update({'model.layers.0.mlp.extra.weight': torch.zeros(2)}), 'do not match'),
      ('missing', lambda s: s.pop('model.norm.weight'), 'missing'),
      ('shape', lambda s: s.update({'rm_head.weight': torch.zeros(3, 64)}), 'shape (3, 64)'),
      ('not_tensors', lambda s: s.update({'model.norm.weight': [1.0]}), 'not a state dict of tensors')]:
    bad = dict(state)
    change(bad)
    ckpt = str(tmp_path / name)
    va.write_model_config(ckpt)
    os.makedirs(os.path.join(ckpt, 'checkpoint-3'))
    torch.save(bad, os.path.join(ckpt, 'checkpoint-3', 'model.pth'))
    one_line_error(load(ckpt), 'checkpoint-3', what)

  lora = tmp_path / 'lora' / 'checkpoint-4'
  lora.mkdir(parents=True)
  va.write_model_config(str(lora.parent), lora={'r': 4, 'alpha': 8})
  (lora / 'adapter_model.safetensors').write_bytes(b'\x00\x01 not a safetensors file')
  one_line_error(load(lora.parent), 'non_lora_state_dict.pth', 'missing')
  torch.save({'base_model.model.rm_head.weight': torch.zeros(1, 64)}, lora / 'non_lora_state_dict.pth')
  one_line_error(load(lora.parent), 'adapter_model.safetensors', 'cannot be read')


# ------------------------------------------------------------------------------------------ reward
@pytest.fixture(scope='module')
def released(base_dir, tmp_path_factory):
  """A checkpoint directory in the released layout (model.pth with transformers 4.45 names)."""
  model, _, _ = va.tiny_reward_model(base_dir, output_dim=1, seed=5)
  ckpt = str(tmp_path_factory.mktemp('videoreward'))
  va.write_model_config(ckpt)
  va.save_full_checkpoint(ckpt, model, step=11352)
  return ckpt


def test_reward_end_to_end(released, base_dir, caplog):
  """Random 8-frame 56x56 videos at 16 fps through the registry: 4 frames read, resized to 336x336 by the
  default pixel floor; finite (2,) scores; a video whose scoring fails (its prompt holds a special token
  itself) gets NaN and a warning, while the other keeps its score."""
  reward = rewards.make_reward('videoalign', checkpoint=released, base_model=base_dir, dtype='float32',
                               batch_size=2)
  videos = np.random.RandomState(0).randint(0, 256, (2, 8, 56, 56, 3), dtype=np.uint8)
  indices, size = reward.plan(videos)
  assert list(indices) == [0, 2, 5, 7] and size == (336, 336)
  scores = reward(videos, ['a red fox runs through snow', 'a cat'])
  assert scores.shape == (2,) and scores.dtype == np.float32 and np.isfinite(scores).all()
  with caplog.at_level(logging.WARNING, logger='ddrl_jax.rewards.videoalign'):
    failed = reward(videos, ['a red fox runs through snow', 'two <|TA_reward|> cats'])
  assert np.isnan(failed[1]) and failed[0] == pytest.approx(scores[0], abs=1e-5)
  assert 'video 1 could not be scored' in caplog.text


def test_reward_keys_batches_and_bad_inputs(released, base_dir):
  make = lambda **kw: rewards.make_reward('videoalign', checkpoint=released, base_model=base_dir,
                                          min_pixels=SMALL, **{'dtype': 'float32', **kw})
  videos = np.random.RandomState(1).randint(0, 256, (3, 6, 56, 56, 3), dtype=np.uint8)
  prompts = ['a', 'b', 'c']
  one, three = make(batch_size=1), make(batch_size=3)
  assert one.vam is three.vam                              # one model per process
  table = three.scores(videos, prompts)
  np.testing.assert_allclose(table['sum'], table['vq'] + table['mq'] + table['ta'], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(table['mean'], table['sum'] / 3, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(one.scores(videos, prompts)['sum'], table['sum'], rtol=1e-5, atol=1e-5)
  for key in va.KEYS:
    keyed = make(key=key)
    with mock.patch.object(keyed, 'scores', return_value=table):
      np.testing.assert_array_equal(keyed(videos, prompts), table[key])
  half = make(dtype='bfloat16', batch_size=3)(videos, prompts)
  assert half.dtype == np.float32 and np.isfinite(half).all()
  np.testing.assert_allclose(half, table['mean'], atol=0.3)   # bf16 rounding of a random model
  raw = make(normalize=False).scores(videos, prompts)
  np.testing.assert_allclose(table['vq'], (raw['vq'] - 3.6757) / 2.2476, rtol=1e-4, atol=1e-5)
  for bad in [videos[0], videos.astype(np.float32), np.zeros((3, 6, 56, 56, 4), np.uint8),
              np.zeros((3, 1, 56, 56, 3), np.uint8), np.zeros((3, 6, 10, 2100, 3), np.uint8)]:
    with pytest.raises(ValueError, match=re.escape(str(bad.shape))):
      one(bad, prompts)
  with pytest.raises(ValueError, match='prompts'):
    one(videos, ['a'])
  with pytest.raises(ValueError, match='key'):
    make(key='overall')


def test_shared_scoring_retries_a_failed_batch_one_video_at_a_time():
  """video_common.score_batches (the loop of videoalign's and cosmos_reason1's rewards): a failing batch is
  retried video by video, a failing batch of one is not retried; failures stay NaN and are reported."""
  from ddrl_jax.rewards import video_common  # pylint: disable=g-import-not-at-top
  calls, warned = [], []

  def score(which):
    calls.append(list(which))
    if 1 in which or 4 in which:
      raise RuntimeError('bad video')
    return np.array([[float(i), -float(i)] for i in which])

  out = video_common.score_batches(5, 2, 2, score, lambda i, e: warned.append((i, str(e))))
  assert calls == [[0, 1], [0], [1], [2, 3], [4]]
  assert warned == [(1, 'bad video'), (4, 'bad video')]
  np.testing.assert_array_equal(out[[0, 2, 3]], [[0, 0], [2, -2], [3, -3]])
  assert np.isnan(out[[1, 4]]).all() and out.dtype == np.float64
  assert issubclass(va.CheckpointError, video_common.CheckpointError)


def test_module_imports_without_torch():
  code = ('import sys; sys.modules.update(torch=None, transformers=None, safetensors=None); '
          'from ddrl_jax.rewards import videoalign; print(videoalign.num_frames(93, 16))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60, check=True)
  assert out.stdout.strip() == '12'


# ------------------------------------------------------------------------------------------ tiny checkpoint
@pytest.fixture(scope='module')
def tiny_kwargs(tmp_path_factory):
  return va.save_tiny(str(tmp_path_factory.mktemp('videoalign_tiny')))


def test_save_tiny_lora_layout_is_what_peft_reads(tiny_kwargs):
  """save_tiny's checkpoint (LoRA layout, transformers 4.45 names) read back by peft: the reward model
  built on the base, its non-LoRA weights from non_lora_state_dict.pth, the adapter from adapter_config.json
  and adapter_model.safetensors through peft; merge_and_unload equals load_model's merge."""
  base, ckpt = tiny_kwargs['base_model'], tiny_kwargs['checkpoint']
  step = va.find_checkpoint(ckpt)
  assert sorted(os.listdir(step)) == ['adapter_config.json', 'adapter_model.safetensors',
                                      'non_lora_state_dict.pth']
  with open(os.path.join(ckpt, 'model_config.json')) as f:
    assert json.load(f)['model_config']['model_name_or_path'] == base
  model, _, ids = va.tiny_reward_model(base, seed=99)                 # its own random head, replaced below
  prefix = 'base_model.model.'
  non_lora = {current_key(k[len(prefix):]): v for k, v in torch.load(
      os.path.join(step, 'non_lora_state_dict.pth'), weights_only=True).items()}
  assert {k.split('.')[0] for k in non_lora} == {'model', 'rm_head'}
  missing, unexpected = model.load_state_dict(non_lora, strict=False)
  assert not unexpected and 'rm_head.weight' not in missing
  wrapped = peft.get_peft_model(model, peft.LoraConfig.from_pretrained(step))
  adapter = {prefix + current_key(k[len(prefix):]): v
             for k, v in load_file(os.path.join(step, 'adapter_model.safetensors')).items()}
  result = peft.set_peft_model_state_dict(wrapped, adapter)
  assert not result.unexpected_keys
  assert len(adapter) == 2 * 7 * 2                                    # A and B, 7 Linears, 2 layers
  merged = wrapped.merge_and_unload().state_dict()
  mine = va.load_model(ckpt, base_model=base, dtype='float32')
  got = mine.model.state_dict()
  assert set(got) == set(merged) and mine.special_ids == ids
  for k, v in merged.items():
    np.testing.assert_allclose(got[k].numpy(), v.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
  plain = va.tiny_reward_model(base)[0].state_dict()
  q = 'model.language_model.layers.0.self_attn.q_proj.weight'
  assert np.abs(got[q].numpy() - plain[q].numpy()).max() > 1e-3      # the LoRA changed the weights


def test_save_tiny_scores_small_videos_through_the_registry(tiny_kwargs, record_property):
  """The reward on save_tiny's kwargs alone (local folders), on (4, 5, 32, 32, 3) and the smallest videos it
  takes (2 frames of 1 x 1: frames are upscaled to the 128 * 28**2 pixel floor). The time is reported."""
  assert set(tiny_kwargs) == {'checkpoint', 'base_model', 'dtype', 'fps'}
  assert all(os.path.isdir(tiny_kwargs[k]) for k in ('checkpoint', 'base_model'))
  reward = rewards.make_reward('videoalign', **tiny_kwargs)
  videos = np.random.RandomState(2).randint(0, 256, (4, 5, 32, 32, 3), dtype=np.uint8)
  prompts = ['a red fox runs through snow', 'a cat', 'a dog', 'rain']
  assert [list(reward.plan(videos)[0]), reward.plan(videos)[1]] == [[0, 1, 3, 4], (336, 336)]
  reward(videos[:1], prompts[:1])                                    # warm up
  start = time.perf_counter()
  scores = reward(videos, prompts)
  seconds = time.perf_counter() - start
  record_property('videoalign_seconds_4x5x32x32', seconds)
  print(f'videoalign save_tiny: (4, 5, 32, 32, 3) scored in {seconds:.2f} s')
  assert scores.shape == (4,) and scores.dtype == np.float32 and np.isfinite(scores).all()
  assert len(set(scores.tolist())) == 4
  smallest = reward(np.zeros((1, 2, 1, 1, 3), np.uint8), ['a'])
  assert np.isfinite(smallest).all()
