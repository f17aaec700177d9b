"""Cosmos-Reason1 reward (ddrl_jax/rewards/cosmos_reason1.py) on a tiny random Qwen2.5-VL: frame stride,
trimming and pixel budget against the reference's rule and qwen_vl_utils.smart_resize, the score against
an independent run of the transformers model on processor-built inputs, the time-position input, the reward
end to end with per-video NaN, one-line errors for bad inputs and checkpoints, and the checkpoint of
`cosmos_reason1.save_tiny` (the tiny judge every test here runs on) scoring small videos by the registry.

qwen-vl-utils 0.0.8 is what is installed (its smart_resize is the same in 0.0.10, 0.0.11 and 0.0.14); it
imports torchvision at module level, so without a working torchvision it is imported with a stand-in, as
tests/test_videoalign.py does (smart_resize never touches it). transformers' Qwen2.5-VL video processor
needs torchvision too, so the independent inputs come from its image processor's video path (the same
resize, rescale, normalisation and patch layout) and the placeholder expansion the processor performs."""
import functools
import json
import logging
import os
import re
import shutil
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
from PIL import Image
from safetensors.torch import load_file
from safetensors.torch import save_file
from transformers.models.qwen2_vl import image_processing_qwen2_vl

from ddrl_jax import rewards
from ddrl_jax.rewards import cosmos_reason1 as cr
from ddrl_jax.rewards import tiny_models
# pylint: enable=g-import-not-at-top,g-bad-import-order

PROMPTS = list(cr.TINY_CORPUS)


# -------------------------------------------------------------------------------------- helpers
@functools.lru_cache(maxsize=None)
def qwen_smart_resize():
  """qwen_vl_utils.vision_process.smart_resize, with a stand-in torchvision when the real one is absent."""
  try:
    from qwen_vl_utils import vision_process as vp  # pylint: disable=g-import-not-at-top
    return vp.smart_resize
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
  return vp.smart_resize


def reference_frames(total):
  """The reference's rule, restated: every ((T - 1) // 160 + 1)-th frame from 0, minus one if odd."""
  stride = max(1, (total - 1) // 160 + 1)
  idx = list(range(0, total, stride))
  if len(idx) % 2:
    idx = idx[:-1]
  return idx, stride


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """A tiny random Qwen2.5-VL folder laid out as the release: weights, tokenizer, preprocessor config and
  chat_template.json."""
  kwargs = cr.save_tiny(str(tmp_path_factory.mktemp('reason1_tiny')))
  assert kwargs == {'checkpoint': kwargs['checkpoint'], 'dtype': 'float32', 'fps': 16.0}
  return kwargs['checkpoint']


def videos(m=2, frames=8, size=56, seed=0):
  return np.random.RandomState(seed).randint(0, 256, (m, frames, size, size, 3), dtype=np.uint8)


def independent_no_score(path, video, prompt, fps, system=cr.RUBRIC):
  """P("No") computed without the module: the reference's frames and PIL resize, transformers' image
  processor for the pixels, the chat template and the processor's placeholder expansion for the text,
  second_per_grid_ts = 2 / sample_fps as the processor derives it, then the model's forward and a softmax
  of the two answer logits at the last position. Returns (no_score, (yes logit, no logit))."""
  tokenizer = transformers.AutoTokenizer.from_pretrained(path)
  model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
  idx, stride = reference_frames(len(video))
  h, w = qwen_smart_resize()(video.shape[1], video.shape[2], factor=28, min_pixels=16 * 28 * 28 * 2,
                             max_pixels=9216 * 28 * 28 * 2 // len(idx))
  frames = [Image.fromarray(video[i]).resize((w, h), Image.BICUBIC) for i in idx]
  processor = image_processing_qwen2_vl.Qwen2VLImageProcessor.from_pretrained(path)
  with mock.patch.object(image_processing_qwen2_vl.logger, 'warning'):   # "videos are deprecated here"
    pixels = processor.preprocess(images=None, videos=[[np.asarray(f) for f in frames]], return_tensors='pt')
  sample_fps = fps / stride
  messages = [{'role': 'system', 'content': system},
              {'role': 'user', 'content': [{'type': 'video', 'video': frames, 'fps': sample_fps},
                                           {'type': 'text', 'text': prompt}]}]
  with open(os.path.join(path, 'chat_template.json')) as f:
    template = json.load(f)['chat_template']
  text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=True)
  n_tokens = int(pixels['video_grid_thw'][0].prod()) // 4
  text = text.replace('<|video_pad|>', '<|video_pad|>' * n_tokens)
  batch = tokenizer([text], return_tensors='pt')
  with torch.no_grad():
    logits = model(**batch, pixel_values_videos=pixels['pixel_values_videos'],
                   video_grid_thw=pixels['video_grid_thw'],
                   second_per_grid_ts=torch.tensor([2 / sample_fps])).logits[0, -1]
  yes = tokenizer.encode('Yes', add_special_tokens=False)[0]
  no = tokenizer.encode('No', add_special_tokens=False)[0]
  pair = torch.stack([logits[yes], logits[no]])
  return torch.softmax(pair, 0)[1].item(), pair.numpy()


def make(checkpoint, **kw):
  return rewards.make_reward('cosmos_reason1', checkpoint=checkpoint, **{'dtype': 'float32', **kw})


# ---------------------------------------------------------------------------- frames and sizes
@pytest.mark.parametrize('total', [2, 3, 8, 93, 121, 160, 161, 162, 200, 321, 322, 1000])
def test_frames_follow_the_reference_rule(total):
  idx, stride = reference_frames(total)
  assert cr.frame_stride(total) == stride
  np.testing.assert_array_equal(cr.frame_indices(total), idx)
  assert len(idx) % 2 == 0 and len(idx) <= 160 and idx[0] == 0
  _, _, sample_fps = cr.sampling_plan(total, 480, 832, 24.0)
  assert sample_fps == 24.0 / stride


def test_frame_counts_and_strides_for_known_lengths():
  assert [(t, cr.frame_stride(t), len(cr.frame_indices(t))) for t in (93, 160, 161, 200, 321, 1000)] == [
      (93, 1, 92), (160, 1, 160), (161, 2, 80), (200, 2, 100), (321, 3, 106), (1000, 7, 142)]
  np.testing.assert_array_equal(cr.frame_indices(200)[:4], [0, 2, 4, 6])
  assert cr.frame_indices(200)[-1] == 198
  for bad in (0, 1):
    with pytest.raises(ValueError, match='at least 2 frames'):
      cr.frame_indices(bad)


@pytest.mark.parametrize('n', [2, 8, 80, 92, 142, 160])
def test_pixel_budget(n):
  assert cr.frame_pixels(n) == (16 * 28 * 28 * 2, 9216 * 28 * 28 * 2 // n)
  assert cr.frame_pixels(n)[1] >= cr.frame_pixels(n)[0]


@pytest.mark.parametrize('total,h,w', [(93, 704, 1280), (93, 480, 832), (200, 704, 1280), (8, 56, 56),
                                       (2, 704, 1280), (321, 720, 1280), (33, 1080, 1920), (57, 100, 3000)])
def test_sizes_match_qwen_vl_utils(total, h, w):
  idx, size, _ = cr.sampling_plan(total, h, w, 16.0)
  lo, hi = 16 * 28 * 28 * 2, 9216 * 28 * 28 * 2 // len(idx)
  assert size == qwen_smart_resize()(h, w, factor=28, min_pixels=lo, max_pixels=hi)
  assert size[0] % 28 == 0 and size[1] % 28 == 0 and lo <= size[0] * size[1] <= hi
  assert cr.video_tokens(len(idx), *size) <= 9216


def test_ddrl_video_is_92_frames_at_280x532_and_8740_tokens():
  idx, size, sample_fps = cr.sampling_plan(93, 704, 1280, 16.0)
  np.testing.assert_array_equal(idx, np.arange(92))
  assert size == (280, 532) and sample_fps == 16.0
  assert size == qwen_smart_resize()(704, 1280, factor=28, min_pixels=25088, max_pixels=14450688 // 92)
  assert cr.video_tokens(92, *size) == 46 * 10 * 19 == 8740
  processor = image_processing_qwen2_vl.Qwen2VLImageProcessor(max_pixels=12845056)
  frames = np.zeros((2, 280, 532, 3), np.uint8)
  with mock.patch.object(image_processing_qwen2_vl.logger, 'warning'):
    grid = processor.preprocess(images=None, videos=[list(frames)], return_tensors='np')['video_grid_thw'][0]
  assert tuple(grid) == (1, 20, 38) and cr.video_tokens(2, 280, 532) == 1 * 20 * 38 // 4
  with pytest.raises(ValueError, match='aspect'):
    cr.sampling_plan(8, 10, 2100, 16.0)


def test_resize_is_pil_bicubic_and_the_processor_pass():
  frames = videos(1, 2, 56)[0]
  got = cr.resize_frames(frames, 168, 112)
  want = np.stack([np.asarray(Image.fromarray(f).resize((112, 168), Image.BICUBIC)) for f in frames])
  assert got.shape == (2, 3, 168, 112) and got.dtype == torch.float32
  np.testing.assert_array_equal(got.permute(0, 2, 3, 1).numpy(), want)
  np.testing.assert_array_equal(cr.resize_frames(frames, 56, 56).permute(0, 2, 3, 1).numpy(), frames)
  big = cr.resize_frames(frames, 168, 168)
  assert cr.processor_resize(big, 3136, 12845056) is big          # the release's bounds: identity
  small = cr.processor_resize(big, 3136, 28 * 28 * 16)             # a tighter max_pixels shrinks it
  assert small.shape == (2, 3, 112, 112)
  assert cr.processor_settings({'min_pixels': 10, 'max_pixels': 20})[2] == (10, 20)
  assert cr.processor_settings({'size': {'shortest_edge': 1, 'longest_edge': 2}})[2] == (1, 2)
  mean, std, bounds = cr.processor_settings({})
  assert bounds == (128 * 28 * 28, 768 * 28 * 28) and len(mean) == len(std) == 3


# ------------------------------------------------------------------------------------------ prompt
def test_rubric_structure_and_chat_text():
  cats = ['Gravity', 'Collision', 'Object interaction', 'Fluid dynamics', 'Object permanence',
          'Common sense', 'Cause and effect', 'Human motion']
  where = [cr.RUBRIC.index(f'* {c} (e.g. ') for c in cats]
  assert where == sorted(where)
  tail = cr.RUBRIC[where[-1]:]
  assert tail.count('\n* ') == 4 and cr.RUBRIC.rstrip().endswith('"Yes" or "No".')
  tokenizer = cr.tiny_tokenizer(tiny_models.QWEN_CHAT_TEMPLATE)
  text = tokenizer.apply_chat_template(cr.chat_messages('a cat'), tokenize=False, add_generation_prompt=True)
  assert text.startswith('<|im_start|>system\n' + cr.RUBRIC + '<|im_end|>\n<|im_start|>user\n')
  assert text.endswith('<|vision_start|><|video_pad|><|vision_end|>a cat<|im_end|>\n<|im_start|>assistant\n')
  assert [tokenizer.tokenize(w) for w in cr.ANSWERS] == [['Yes'], ['No']]


def test_system_prompt_from_string_or_file(tmp_path):
  assert cr.load_system_prompt() == cr.RUBRIC
  assert cr.load_system_prompt('Judge it. Say Yes or No.') == 'Judge it. Say Yes or No.'
  path = tmp_path / 'rubric.txt'
  path.write_text('Line one.\nAnswer "Yes" or "No".\n')
  assert cr.load_system_prompt(str(path)) == 'Line one.\nAnswer "Yes" or "No".'
  for bad, what in [('', 'neither'), (3, 'neither'), (str(tmp_path / 'missing.txt'), 'no such file')]:
    with pytest.raises(ValueError, match=what):
      cr.load_system_prompt(bad)
  (tmp_path / 'empty.txt').write_text('\n')
  with pytest.raises(ValueError, match='empty'):
    cr.load_system_prompt(str(tmp_path / 'empty.txt'))


def test_score_table():
  table = cr.score_table([[0.0, 0.0], [1.0, 3.0], [np.nan, 1.0], [800.0, -800.0]])
  np.testing.assert_allclose(table['no_score'][:2], [0.5, 1 / (1 + np.exp(-2.0))], rtol=1e-6)
  np.testing.assert_allclose(table['yes_score'][:2], 1 - table['no_score'][:2], rtol=1e-6)
  assert np.isnan(table['no_score'][2]) and np.isnan(table['yes_logit'][2]) and table['no_logit'][2] == 1
  assert table['no_score'][3] == 0.0 and table['yes_score'][3] == 1.0
  assert all(v.dtype == np.float32 and v.shape == (4,) for v in table.values())
  assert set(table) == set(cr.COLUMNS)


# ------------------------------------------------------------------------------------------ score
def test_no_score_matches_an_independent_forward(checkpoint):
  """float32: each video's (Yes, No) logits and no_score equal the transformers model's own forward on
  inputs built without the module (see independent_no_score), to 1e-5; a batch of two equals them too."""
  clips = videos(2, 8, 56, seed=3)
  one, two = make(checkpoint, batch_size=1), make(checkpoint, batch_size=2)
  got1, got2 = one.scores(clips, PROMPTS), two.scores(clips, PROMPTS)
  for i in range(2):
    want, pair = independent_no_score(checkpoint, clips[i], PROMPTS[i], 16.0)
    np.testing.assert_allclose([got1['yes_logit'][i], got1['no_logit'][i]], pair, rtol=1e-5, atol=1e-5)
    assert got1['no_score'][i] == pytest.approx(want, abs=1e-5)
    assert got2['no_score'][i] == pytest.approx(want, abs=1e-5)
  assert abs(got1['no_score'][0] - got1['no_score'][1]) > 1e-4     # the two videos are told apart


def test_long_video_is_strided_and_scored_like_the_reference(checkpoint):
  """170 frames at 24 fps: stride 2, 84 frames, sample_fps 12; the same parity with the independent run."""
  clip = videos(1, 170, 28, seed=4)
  reward = make(checkpoint, fps=24.0)
  idx, size, sample_fps = reward.plan(clip)
  assert len(idx) == 84 and sample_fps == 12.0 and size == (168, 168)
  got = reward.scores(clip, PROMPTS[:1])['no_score'][0]
  assert got == pytest.approx(independent_no_score(checkpoint, clip[0], PROMPTS[0], 24.0)[0], abs=1e-5)


def test_time_positions_follow_position_fps(checkpoint):
  """second_per_grid_ts reaches the model's get_rope_index as 2 / sample_fps (default) or 2 / position_fps;
  the temporal positions it yields are transformers' (int-truncated in 4.57.6, floor(t * s * 2) where s
  stays a float), and changing them changes the score."""
  clips = videos(1, 16, 56, seed=5)
  seen = []
  inner = cr.shared_model(os.path.abspath(checkpoint), 'cpu', 'float32', 'sdpa').model.model
  original = inner.get_rope_index

  def spy(*args, **kwargs):
    out = original(*args, **kwargs)
    seen.append((kwargs['second_per_grid_ts'].tolist(), out[0]))
    return out

  with mock.patch.object(inner, 'get_rope_index', side_effect=spy):
    default = make(checkpoint).scores(clips, PROMPTS[:1])['no_score']
    slow = make(checkpoint, position_fps=2.0).scores(clips, PROMPTS[:1])['no_score']
  (s16, pos16), (s2, pos2) = seen
  assert s16 == [pytest.approx(2 / 16)] and s2 == [pytest.approx(1.0)]
  video_id = inner.config.video_token_id
  tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
  chat = tokenizer.apply_chat_template(cr.chat_messages(PROMPTS[0]),
                                       chat_template=tiny_models.QWEN_CHAT_TEMPLATE, tokenize=False,
                                       add_generation_prompt=True)
  ids = tokenizer(chat.replace('<|video_pad|>', '<|video_pad|>' * 288), return_tensors='pt')['input_ids']
  where = (ids[0] == video_id).nonzero()[:, 0]
  t16 = pos16[0, 0, where].reshape(8, 36)      # 8 temporal patches of 6 x 6 merged tokens
  t2 = pos2[0, 0, where].reshape(8, 36)
  assert (t16 == t16[:, :1]).all() and (t2 == t2[:, :1]).all()
  steps16 = (t16[:, 0] - t16[0, 0]).tolist()
  truncated, floored = [0] * 8, [int(t * 0.125 * 2) for t in range(8)]
  assert steps16 in (truncated, floored)
  if tuple(int(v) for v in transformers.__version__.split('.')[:2]) == (4, 57):
    assert steps16 == truncated            # 4.57.6 casts second_per_grid_t to int64: 0.125 -> 0
  assert (t2[:, 0] - t2[0, 0]).tolist() == [2 * t for t in range(8)]   # t * (2 / 2.0) * tokens_per_second
  assert abs(default[0] - slow[0]) > 1e-6


# ------------------------------------------------------------------------------------------ reward
def test_reward_end_to_end_and_per_video_nan(checkpoint, caplog):
  """Random (2, 8, 56, 56, 3) videos through the registry: 8 frames read, upscaled to 168x168 by the pixel
  floor; finite scores in (0, 1); a video whose text holds a second video placeholder, or whose forward
  raises, gets NaN and a warning while the other keeps its score."""
  reward = make(checkpoint, batch_size=2)
  clips = videos()
  idx, size, sample_fps = reward.plan(clips)
  assert list(idx) == list(range(8)) and size == (168, 168) and sample_fps == 16.0
  scores = reward(clips, PROMPTS)
  assert scores.shape == (2,) and scores.dtype == np.float32
  assert np.isfinite(scores).all() and ((scores > 0) & (scores < 1)).all()
  with caplog.at_level(logging.WARNING, logger='ddrl_jax.rewards.cosmos_reason1'):
    failed = reward(clips, [PROMPTS[0], 'two <|video_pad|> clips'])
  assert np.isnan(failed[1]) and failed[0] == pytest.approx(scores[0], abs=1e-5)
  assert 'video 1 could not be scored' in caplog.text

  single = make(checkpoint)
  original = single.judge.answer_logits
  calls = []

  def flaky(inputs):
    calls.append(1)
    if len(calls) == 1:
      raise RuntimeError('out of memory\nsecond line')
    return original(inputs)

  caplog.clear()
  with mock.patch.object(single.judge, 'answer_logits', side_effect=flaky), \
      caplog.at_level(logging.WARNING, logger='ddrl_jax.rewards.cosmos_reason1'):
    table = single.scores(clips, PROMPTS)
  assert np.isnan(table['no_score'][0]) and np.isnan(table['yes_logit'][0])
  assert table['no_score'][1] == pytest.approx(scores[1], abs=1e-5)
  assert 'video 0 could not be scored' in caplog.text and 'RuntimeError: out of memory' in caplog.text


def test_keys_batches_dtypes_and_one_model(checkpoint):
  clips = videos(3, 4, 56, seed=1)
  prompts = ['a', 'b', 'c']
  one, three = make(checkpoint), make(checkpoint, batch_size=2, key='yes_score')
  assert one.judge is three.judge                          # one model per process
  table = one.scores(clips, prompts)
  np.testing.assert_allclose(three(clips, prompts), table['yes_score'], atol=1e-5)
  np.testing.assert_allclose(table['yes_score'], 1 - table['no_score'], atol=1e-6)
  np.testing.assert_array_equal(one(clips, prompts), table['no_score'])
  half = make(checkpoint, dtype='bfloat16')(clips, prompts)
  assert half.dtype == np.float32 and np.isfinite(half).all() and ((half > 0) & (half < 1)).all()
  np.testing.assert_allclose(half, table['no_score'], atol=0.1)   # bf16 rounding of a random model
  custom = make(checkpoint, system_prompt='Is anything physically wrong? Answer Yes or No.')
  assert abs(custom(clips, prompts) - table['no_score']).max() > 1e-6


def test_bad_inputs_raise_one_line_errors(checkpoint):
  reward = make(checkpoint)
  clips = videos(2, 4, 56)
  for bad in [clips[0], clips.astype(np.float32), np.zeros((2, 4, 56, 56, 4), np.uint8),
              np.zeros((2, 1, 56, 56, 3), np.uint8), np.zeros((2, 4, 10, 2100, 3), np.uint8)]:
    with pytest.raises(ValueError, match=re.escape(str(bad.shape))) as e:
      reward(bad, PROMPTS)
    assert '\n' not in str(e.value)
  with pytest.raises(ValueError, match='prompts'):
    reward(clips, ['a'])
  for kw, what in [({'key': 'prediction'}, 'key'), ({'batch_size': 0}, 'batch_size'),
                   ({'dtype': 'int8'}, 'dtype'), ({'fps': 0}, 'fps'), ({'position_fps': -1}, 'fps'),
                   ({'system_prompt': 'nofile'}, 'no such')]:
    with pytest.raises(ValueError, match=what):
      make(checkpoint, **kw)


def one_line_error(path, *names):
  with pytest.raises(cr.CheckpointError) as e:
    cr.load_model(str(path), dtype='float32')
  message = str(e.value)
  assert '\n' not in message and all(n in message for n in names), message
  return message


def test_bad_checkpoints_fail_with_one_line_naming_the_file(checkpoint, tmp_path):
  one_line_error(tmp_path / 'nowhere', 'nowhere', 'no such directory')

  def copy(name, drop=(), change=None):
    path = tmp_path / name
    shutil.copytree(checkpoint, path)
    for f in drop:
      os.remove(path / f)
    if change:
      change(path)
    return path

  for f, what in [('config.json', 'missing'), ('model.safetensors', 'neither model.safetensors'),
                  ('tokenizer.json', 'missing'), ('preprocessor_config.json', 'missing')]:
    one_line_error(copy('no_' + f, [f]), f, what)
  one_line_error(copy('no_template', ['chat_template.json']), 'no_template', 'no chat template')
  garbage = lambda f, data=b'{not json': lambda p: (p / f).write_bytes(data)
  one_line_error(copy('bad_config', change=garbage('config.json')), 'config.json', 'cannot be read')
  one_line_error(copy('bad_pre', change=garbage('preprocessor_config.json')), 'preprocessor_config.json',
                 'cannot be read')
  one_line_error(copy('bad_tpl', change=garbage('chat_template.json', b'{"x": 1}')), 'chat_template.json',
                 'no chat_template')

  def truncate(p):
    blob = (p / 'model.safetensors').read_bytes()
    (p / 'model.safetensors').write_bytes(blob[:len(blob) // 2])
  one_line_error(copy('truncated', change=truncate), 'model.safetensors', 'cannot be loaded')

  def other_type(p):
    cfg = json.loads((p / 'config.json').read_text())
    cfg['model_type'] = 'qwen2_vl'
    (p / 'config.json').write_text(json.dumps(cfg))
  one_line_error(copy('qwen2vl', change=other_type), 'config.json', 'not qwen2_5_vl')

  def wider(p):
    cfg = json.loads((p / 'config.json').read_text())
    cfg['text_config']['intermediate_size'] = 96
    (p / 'config.json').write_text(json.dumps(cfg))
  one_line_error(copy('mismatch', change=wider), 'model.safetensors')

  def drop_norm(p):
    state = load_file(str(p / 'model.safetensors'))
    del state['model.norm.weight']        # transformers saves Qwen2.5-VL under its older key names
    save_file(state, str(p / 'model.safetensors'), metadata={'format': 'pt'})
  one_line_error(copy('missing_key', change=drop_norm), 'model.safetensors', 'missing or mis-shaped',
                 'norm.weight')

  def shard_index(p):
    os.rename(p / 'model.safetensors', p / 'model-00001-of-00002.safetensors')
    (p / 'model.safetensors.index.json').write_text(json.dumps({'weight_map': {
        'a': 'model-00001-of-00002.safetensors', 'b': 'model-00002-of-00002.safetensors'}}))
  one_line_error(copy('shards', change=shard_index), 'model-00002-of-00002.safetensors', 'missing')


def test_module_imports_without_torch():
  code = ('import sys; sys.modules.update(torch=None, transformers=None, safetensors=None, PIL=None); '
          'from ddrl_jax.rewards import cosmos_reason1 as cr; '
          'print(cr.video_tokens(92, *cr.sampling_plan(93, 704, 1280, 16.0)[1]))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60, check=True)
  assert out.stdout.strip() == '8740'


def test_save_tiny_scores_small_videos_through_the_registry(tmp_path, record_property):
  """The reward on save_tiny's kwargs alone (a fresh folder), on (4, 5, 32, 32, 3) and the smallest videos
  it takes (2 frames of 1 x 1: frames are upscaled to the 16 * 28**2 * 2 pixel floor). The time is
  reported."""
  kwargs = cr.save_tiny(str(tmp_path / 'reason1'), seed=1)
  assert set(kwargs) == {'checkpoint', 'dtype', 'fps'}
  assert set(cr.checkpoint_files(kwargs['checkpoint'])) >= {'config', 'weights', 'tokenizer', 'processor'}
  reward = rewards.make_reward('cosmos_reason1', **kwargs)
  clips = videos(4, 5, 32, seed=6)
  prompts = PROMPTS + ['a cat', 'rain']
  idx, size, _ = reward.plan(clips)
  assert list(idx) == [0, 1, 2, 3] and size == (168, 168)
  reward(clips[:1], prompts[:1])                                    # warm up
  start = time.perf_counter()
  scores = reward(clips, prompts)
  seconds = time.perf_counter() - start
  record_property('cosmos_reason1_seconds_4x5x32x32', seconds)
  print(f'cosmos_reason1 save_tiny: (4, 5, 32, 32, 3) scored in {seconds:.2f} s')
  assert scores.shape == (4,) and scores.dtype == np.float32 and np.isfinite(scores).all()
  assert ((scores > 0) & (scores < 1)).all() and len(set(scores.tolist())) == 4
  assert np.isfinite(reward(np.zeros((1, 2, 1, 1, 3), np.uint8), ['a'])).all()
