"""Rewards: the OCR score against hand-computed answers and real Tesseract reads of rendered text, the
registry, multi-reward advantages, and the local worker pool's handling of crashes, hangs and garbage."""
import numpy as np
import pytest
from rendering import render  # tests/rendering.py

from ddrl_jax import rewards
from ddrl_jax import rl as rl_lib
from ddrl_jax.rewards import ocr
from ddrl_jax.rewards import pool as pool_lib
from ddrl_jax.rewards import wire


# --------------------------------------------------------------------------------------- OCR score
@pytest.mark.parametrize('a,b,d', [('kitten', 'sitting', 3), ('', 'abc', 3), ('abc', '', 3),
                                   ('flaw', 'lawn', 2), ('same', 'same', 0), ('ab', 'ba', 2)])
def test_levenshtein_known_distances(a, b, d):
  assert ocr.levenshtein(a, b) == d


def test_target_text_is_first_quoted_span_or_whole_prompt():
  assert ocr.target_text('A neon sign that says "Open Late" at night') == 'Open Late'
  assert ocr.target_text('a "b" and "c"') == 'b'
  assert ocr.target_text('no quotes here') == 'no quotes here'
  assert ocr.target_text('an unmatched " quote') == 'an unmatched " quote'


@pytest.mark.parametrize('recognized,prompt,score', [
    ('OPEN LATE\n', 'a sign "Open Late"', 1.0),                 # exact after normalization
    ('>> open late tonight', 'a sign "Open Late"', 1.0),         # substring counts as a full match
    ('0pen late', 'a sign "Open Late"', 1 - 1 / 8),              # one substitution out of 8 chars
    ('openlat', 'a sign "Open Late"', 1 - 1 / 8),                # one deletion
    ('', 'a sign "Open Late"', 0.0),                             # nothing read
    ('completely unrelated words', 'a sign "Open"', 0.0),        # distance capped at len(target)
    ('hello', 'hello', 1.0),                                     # unquoted prompt: whole prompt
])
def test_ocr_score_matches_flowgrpo_definition(recognized, prompt, score):
  np.testing.assert_allclose(ocr.ocr_score(recognized, prompt), score)


def test_ocr_reward_reads_rendered_text():
  reward = rewards.make_reward('ocr')
  images = np.stack([render('hello 42'), render('help'), render(''), render('DDRL jax')])
  prompts = ['a sign that says "hello 42"', 'a sign that says "hello"', 'a sign that says "abc"',
             'the words "ddrl jax"']
  scores = reward(images, prompts)
  assert scores.dtype == np.float32 and scores.shape == (4,)
  # 'help' for 'hello': recognized 'help' -> distance 2 of 5 (Tesseract reads these crisp glyphs).
  np.testing.assert_allclose(scores, [1.0, 1 - 2 / 5, 0.0, 1.0])


def test_ocr_reward_rejects_wrong_input():
  reward = rewards.make_reward('ocr')
  with pytest.raises(ValueError, match='uint8'):
    reward(np.zeros((1, 8, 8, 3), np.float32), ['"a"'])
  with pytest.raises(ValueError, match='prompts'):
    reward(np.zeros((2, 8, 8, 3), np.uint8), ['"a"'])
  with pytest.raises(ValueError, match='psm'):
    rewards.make_reward('ocr', psm='NOT_A_MODE')


# ---------------------------------------------------------------------------------------- registry
def test_registry_names_and_custom_rewards():
  assert {'ocr', 'linear', 'temporal_smoothness', 'debug_crash'} <= set(rewards.known_rewards())
  with pytest.raises(ValueError, match='unknown reward'):
    rewards.make_reward('no_such_reward')

  @rewards.register('test_brightness_squared')
  def _factory(scale=1.0):
    return lambda samples, prompts: scale * (samples.astype(np.float32).mean((1, 2, 3)) / 255)**2

  r = rewards.make_reward('test_brightness_squared', scale=2.0)
  np.testing.assert_allclose(r(np.full((2, 4, 4, 3), 255, np.uint8), ['', '']), [2.0, 2.0])
  with pytest.raises(ValueError, match='already registered'):
    rewards.register('ocr')(_factory)


def test_temporal_smoothness_and_linear_values():
  static = np.full((1, 4, 2, 2, 3), 100, np.uint8)
  flicker = np.zeros((1, 4, 2, 2, 3), np.uint8)
  flicker[:, 1::2] = 255
  r = rewards.make_reward('temporal_smoothness')(np.concatenate([static, flicker]), ['', ''])
  np.testing.assert_allclose(r, [0.0, -1.0])
  lin = rewards.make_reward('linear', w=(1.0, 0.5))
  np.testing.assert_allclose(lin(np.array([[2.0, 4.0]]), ['']), [4.0])


# ---------------------------------------------------------------------------- multi-reward advantages
def _numpy_group_adv(r, n, eps=1e-4, clip=5.0):
  g = r.reshape(-1, n)
  return np.clip((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + eps),
                 -clip, clip).reshape(-1)


def test_multi_reward_advantages_against_numpy():
  rng = np.random.RandomState(0)
  r = rng.normal(size=(12, 2)).astype(np.float32)
  r[:, 1] *= 10                                      # a reward on another scale
  w = np.array([1.0, 3.0], np.float32)
  single = lambda x: rl_lib.group_advantages(x, 4)
  mean = rl_lib.multi_reward_advantages(r, w, single, 'advantage_mean')
  want = (_numpy_group_adv(r[:, 0], 4) * 1 + _numpy_group_adv(r[:, 1], 4) * 3) / 4
  np.testing.assert_allclose(mean, want, rtol=1e-5, atol=1e-5)
  summed = rl_lib.multi_reward_advantages(r, w, single, 'weighted_sum')
  np.testing.assert_allclose(summed, _numpy_group_adv(r @ w, 4), rtol=1e-5, atol=1e-5)
  # One failed reward fails the sample for every reward: advantage 0, and for every reward the
  # failed slot is filled with the mean of the group's valid samples (group_advantages' rule).
  r[5, 1] = np.nan
  adv = np.asarray(rl_lib.multi_reward_advantages(r, w, single, 'advantage_mean'))
  assert adv[5] == 0.0
  filled = r[4:8].copy()
  filled[1] = filled[[0, 2, 3]].mean(0)
  per = [(filled[0, i] - filled[:, i].mean()) / (filled[:, i].std(ddof=1) + 1e-4) for i in (0, 1)]
  np.testing.assert_allclose(adv[4], (per[0] + 3 * per[1]) / 4, rtol=1e-4)
  with pytest.raises(ValueError, match='combine'):
    rl_lib.multi_reward_advantages(r, w, single, 'max')


# ------------------------------------------------------------------------------------------- wire
def test_wire_round_trip_and_refuses_pickle():
  msg = {'a': np.arange(6, dtype=np.int16).reshape(2, 3), 'b': ['x', 'y'], 'c': 1.5}
  out = wire.unpack(wire.pack(msg))
  np.testing.assert_array_equal(out['a'], msg['a'])
  assert out['a'].dtype == np.int16 and out['b'] == ['x', 'y'] and out['c'] == 1.5
  with pytest.raises(wire.WireError, match='object array'):
    wire.pack({'a': np.array([{'x': 1}], dtype=object)})
  import pickle  # pylint: disable=g-import-not-at-top
  import msgpack  # pylint: disable=g-import-not-at-top
  evil = msgpack.packb({'a': msgpack.ExtType(1, pickle.dumps(np.array([object()], dtype=object)))})
  with pytest.raises(wire.WireError, match='npy'):
    wire.unpack(evil)
  with pytest.raises(wire.WireError):
    wire.unpack(b'\xc1 not msgpack')
  with pytest.raises(wire.WireError, match='shape'):
    wire.check_scores(np.zeros(3), 2)
  with pytest.raises(wire.WireError, match='numeric'):
    wire.check_scores(['a', 'b'], 2)


# ------------------------------------------------------------------------------------ worker pool
IMAGES = np.random.RandomState(0).randint(0, 255, (12, 6, 6, 3), dtype=np.uint8)
EXPECTED = IMAGES.reshape(12, -1).astype(np.float32).mean(-1) / 255


def test_pool_isolates_crash_hang_and_garbage_per_chunk():
  specs = {'mean_intensity': {}, 'debug_crash': {'trigger': 'boom'},
           'debug_garbage': {'trigger': 'junk'}, 'debug_sleep': {'seconds': 30, 'trigger': 'slow'}}
  prompts = ['ok'] * 4 + ['boom'] * 2 + ['junk'] * 2 + ['slow'] * 2 + ['ok'] * 2
  with rewards.WorkerPool(specs, 2, chunk_timeout_s=2.0) as pool:
    result = pool.submit(IMAGES, prompts, chunk_size=2).result(60)
    bad = np.zeros(12, bool)
    bad[4:6] = bad[8:10] = True                    # crashed and hung chunks: every reward NaN
    for name in specs:
      got = result.scores[name]
      assert np.isnan(got[bad]).all(), name
      ok = ~bad & ~((name == 'debug_garbage') & (np.arange(12) // 2 == 3))
      np.testing.assert_allclose(got[ok], EXPECTED[ok], rtol=1e-6, err_msg=name)
    assert np.isnan(result.scores['debug_garbage'][6:8]).all()
    np.testing.assert_allclose(result.scores['mean_intensity'][6:8], EXPECTED[6:8], rtol=1e-6)
    # Entries (sample x reward): 2 crashed and 2 hung samples x 4 rewards, 2 wrongly shaped scores.
    assert {k: v for k, v in result.failures.items() if v} == {'timeout': 8, 'crash': 8, 'wrong_length': 2}
    assert result.num_failed == 6
    assert any('exited with code 13' in e for e in result.errors)
    assert pool.stats['crash'] == 1 and pool.stats['timeout'] == 1
    # The pool replaced its workers and keeps scoring.
    again = pool.submit(IMAGES, ['ok'] * 12, chunk_size=5).result(60)
    np.testing.assert_allclose(again.scores['mean_intensity'], EXPECTED, rtol=1e-6)
    assert sum(again.failures.values()) == 0


def test_pool_reports_a_chunk_still_scoring_at_least_every_wait_interval(monkeypatch, caplog):
  """A hung worker is not silent until its chunk timeout: a 'still scoring' line every WAIT_LOG_S."""
  import logging  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(pool_lib, 'WAIT_LOG_S', 0.5)
  caplog.set_level(logging.WARNING, logger=pool_lib.__name__)
  with rewards.WorkerPool({'debug_sleep': {'seconds': 30, 'trigger': 'slow'}}, 1, chunk_timeout_s=3.0) as pool:
    result = pool.submit(IMAGES[:2], ['slow', 'slow'], chunk_size=2).result(60)
  assert result.failures['timeout'] == 2
  times = [r.created for r in caplog.records if 'still scoring a chunk of 2 sample(s)' in r.getMessage()]
  assert len(times) >= 3, caplog.text                      # at ~0.5, 1, 1.5, ... s of a 3 s timeout
  assert np.diff(times).max() < 1.5, np.diff(times)


@pytest.mark.parametrize('kind, counted', [
    ('strings', 'non_numeric'), ('nested', 'wrong_length'), ('shape', 'wrong_length'), ('nan', 'nan'),
    ('inf', 'inf'), ('bool', 'bool'), ('huge', 'out_of_range'), ('huge64', 'out_of_range')])
def test_pool_bad_scores_are_nan_and_counted_by_kind(kind, counted):
  """Every bad value is NaN (never a score that looks valid: a bool is not 1.0, 1e30 is not kept, 1e300
  does not become inf) and counted under its kind, once per sample, with a message naming it."""
  pool = rewards.InlinePool({'debug_garbage': {'kind': kind}, 'mean_intensity': {}})
  result = pool.submit(IMAGES[:3], ['x'] * 3).result(10)
  assert np.isnan(result.scores['debug_garbage']).all()
  np.testing.assert_allclose(result.scores['mean_intensity'], EXPECTED[:3], rtol=1e-6)
  assert {k: v for k, v in result.failures.items() if v} == {counted: 3}
  assert result.num_failed == 3
  assert list(rewards.errors_by_kind(result.errors)) == [counted]


def test_score_bounds_default_to_the_reference_scale_and_can_be_set():
  pool = rewards.InlinePool({'linear': {'w': (1.0, 1.0)}})
  points = np.array([[0.5, 0.5], [3e5, 3e5], [-2.0, 0.0]], np.float32)
  result = pool.submit(points, ['a'] * 3).result(10)           # |r| <= 1e6 by default for 'linear'
  assert np.isfinite(result.scores['linear']).all()
  result = pool.submit(points, ['a'] * 3, bounds={'linear': (-1.0, 5.0)}).result(10)
  assert np.isnan(result.scores['linear']).tolist() == [False, True, True]
  assert result.failures['out_of_range'] == 2 and 'bound (-1.0, 5.0)' in result.errors[0]
  from ddrl_jax.rewards import registry  # pylint: disable=g-import-not-at-top
  assert registry.score_bound('ocr') == (0.0, 1.0) and registry.score_bound('vbench') == (-1.0, 1.0)


def test_pool_reward_exception_is_counted_not_raised():
  pool = rewards.InlinePool({'linear': {'w': (1.0, 2.0)}})
  result = pool.submit(IMAGES[:2], ['', '']).result(10)      # images, not (M, 2) points
  assert np.isnan(result.scores['linear']).all() and result.failures['error'] == 2   # 2 samples
  assert 'do not match' in result.errors[0]


def test_pool_unbuildable_reward_is_a_service_error():
  with rewards.WorkerPool({'mean_intensity': {'no_such_arg': 1}}, 1) as pool:
    job = pool.submit(IMAGES[:2], ['', ''])
    with pytest.raises(rewards.RewardServiceError, match='MeanIntensity.*takes no arguments'):
      job.result(60)


def test_job_result_timeout_returns_nan_and_does_not_hang():
  with rewards.WorkerPool({'debug_sleep': {'seconds': 30}}, 1, chunk_timeout_s=60) as pool:
    result = pool.submit(IMAGES[:2], ['', '']).result(timeout=3)
  assert np.isnan(result.scores['debug_sleep']).all()
  assert result.failures['timeout'] == 2            # both samples' entries


def test_spec_from_config_names_bad_keys():
  import ml_collections  # pylint: disable=g-import-not-at-top
  from configs import common  # pylint: disable=g-import-not-at-top
  c = common.base_config().reward
  with pytest.raises(ValueError, match='fns is empty'):
    rewards.RewardSpec.from_config(c)
  c.fns = ml_collections.ConfigDict({'ocr': 1.0, 'nope': 1.0})
  with pytest.raises(ValueError, match="unknown reward 'nope'"):
    rewards.RewardSpec.from_config(c)
  c.fns = ml_collections.ConfigDict({'ocr': 0.0})
  with pytest.raises(ValueError, match='weights must be > 0'):
    rewards.RewardSpec.from_config(c)
  c.fns = ml_collections.ConfigDict({'ocr': 1.0})
  c.kwargs = ml_collections.ConfigDict({'nope': {'w': (1.0,)}})
  with pytest.raises(ValueError, match=r"names unknown rewards: \['nope'\]"):
    rewards.RewardSpec.from_config(c)
  c.kwargs = ml_collections.ConfigDict({'ocr': {'upscale': 2}, 'linear': {'w': (1.0,)}})
  spec = rewards.RewardSpec.from_config(c)      # a known reward's kwargs for evaluation: kept out
  assert spec.names == ['ocr'] and spec.kwargs == {'ocr': {'upscale': 2}}
  c.kwargs = ml_collections.ConfigDict({'ocr': {'upscale': 2}})
  spec = rewards.RewardSpec.from_config(c)
  assert spec.names == ['ocr'] and spec.kwargs == {'ocr': {'upscale': 2}}
  assert pool_lib.split_chunks(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
