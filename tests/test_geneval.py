"""GenEval's scoring rules (ddrl_jax/rewards/geneval.py) on synthetic detections: each tag, the confidence
thresholds (0.3, and 0.9 for counting), the 16-box cap, negative partial credit, the position rule and its
slack, colours, correct vs strict_correct, the summary, and the reward built around a pluggable detector
(and refused without one)."""
import json

import numpy as np
import pytest

from ddrl_jax.rewards import geneval as ge


def box(x, y, w=10, h=10):
  """A w x h box whose top-left corner is (x, y), as (x1, y1, x2, y2)."""
  return (x, y, x + w, y + h)


def det(x=0, y=0, conf=0.8, color=None, w=10, h=10):
  return (box(x, y, w, h), conf, color)


def ev(metadata, detections):
  return ge.evaluate_detections(metadata, detections)


def single(name='cat'):
  return {'tag': 'single_object', 'include': [{'class': name, 'count': 1}], 'prompt': f'a photo of a {name}'}


def two(a='cat', b='dog'):
  return {'tag': 'two_object', 'include': [{'class': a, 'count': 1}, {'class': b, 'count': 1}]}


def counting(n, name='cat', exclude=True):
  meta = {'tag': 'counting', 'include': [{'class': name, 'count': n}]}
  if exclude:     # GenEval's counting prompts carry this exclude entry (prompts/create_prompts.py)
    meta['exclude'] = [{'class': name, 'count': n + 1}]
  return meta


def colors(color, name='cat'):
  return {'tag': 'colors', 'include': [{'class': name, 'count': 1, 'color': color}]}


def color_attr(ca, cb, a='cat', b='dog'):
  return {'tag': 'color_attr', 'include': [{'class': a, 'count': 1, 'color': ca},
                                           {'class': b, 'count': 1, 'color': cb}]}


def position(relation, a='cat', b='dog'):
  """'a photo of a {a} {relation} a {b}': GenEval lists the target b first."""
  return {'tag': 'position', 'include': [{'class': b, 'count': 1},
                                         {'class': a, 'count': 1, 'position': (relation, 0)}]}


def result(score, correct, strict):
  return {'score': pytest.approx(score), 'correct': correct, 'strict_correct': strict}


# ------------------------------------------------------------------------------------------ tags
def test_single_object():
  assert ev(single(), {'cat': [det()]}) == result(1.0, True, True)
  assert ev(single(), {}) == result(0.0, False, False)
  assert ev(single(), {'dog': [det()]}) == result(0.0, False, False)       # other classes do not count


def test_two_object_at_least_for_correct_exact_for_strict():
  assert ev(two(), {'cat': [det()], 'dog': [det(50)]}) == result(1.0, True, True)
  # Two cats: GenEval's correct asks for at least one; the score and strict_correct for exactly one.
  assert ev(two(), {'cat': [det(), det(20)], 'dog': [det(50)]}) == result((0 + 1) / 2, True, False)
  assert ev(two(), {'cat': [det()]}) == result((1 + 0) / 2, False, False)


def test_counting_is_exact_through_the_exclude_entry():
  three = {'cat': [det(0, conf=0.95), det(20, conf=0.95), det(40, conf=0.95)]}
  assert ev(counting(3), three) == result(1.0, True, True)
  assert ev(counting(2), three) == result(1 - 1 / 2, False, False)        # the exclude {count: 3} fails
  assert ev(counting(2, exclude=False), three) == result(1 - 1 / 2, True, False)   # ">=" without it
  assert ev(counting(4), three) == result(1 - 1 / 4, False, False)


def test_colors():
  assert ev(colors('red'), {'cat': [det(color='red')]}) == result(1.0, True, True)
  assert ev(colors('red'), {'cat': [det(color='blue')]}) == result((1 + 0) / 2, False, False)
  # Count wrong: one 0 term for the colour, whatever the colours.
  assert ev(colors('red'), {'cat': [det(color='red'), det(20, color='red')]}) == result(
      (0 + 0) / 2, True, False)
  assert ev(colors('red'), {}) == result(0.0, False, False)


def test_correct_reads_the_colour_of_the_most_confident_boxes():
  # Two cats: the most confident is blue. correct checks the top `count` = 1 box only.
  dets = {'cat': [det(0, conf=0.6, color='red'), det(20, conf=0.8, color='blue')]}
  assert ev(colors('red'), dets) == result(0.0, False, False)
  dets = {'cat': [det(0, conf=0.8, color='red'), det(20, conf=0.6, color='blue')]}
  assert ev(colors('red'), dets) == result(0.0, True, False)


def test_color_attr():
  dets = {'cat': [det(color='white')], 'dog': [det(50, color='brown')]}
  assert ev(color_attr('white', 'brown'), dets) == result(1.0, True, True)
  assert ev(color_attr('white', 'black'), dets) == result((1 + 1 + 1 + 0) / 4, False, False)
  assert ev(color_attr('red', 'black'), dets) == result((1 + 0 + 1 + 0) / 4, False, False)


def test_missing_colour_label_is_an_error():
  with pytest.raises(ValueError, match="no colour label .* asks for 'red'"):
    ev(colors('red'), {'cat': [det(color=None)]})


def test_position():
  cat_left = {'cat': [det(0, 0)], 'dog': [det(30, 0)]}
  assert ev(position('left of'), cat_left) == result(1.0, True, True)
  # Misplaced: one position term 0 (gen_eval.py also appends a 1 there: 0.75; see the module docstring).
  assert ev(position('right of'), cat_left) == result(2 / 3, False, False)
  assert ev(position('above'), cat_left) == result(2 / 3, False, False)
  # The target missing: its count term 0 and the position term 0.
  assert ev(position('left of'), {'cat': [det()]}) == result((0 + 1 + 0) / 3, False, False)
  # The object itself missing: its count term 0 and one 0 term for its position.
  assert ev(position('left of'), {'dog': [det()]}) == result((1 + 0 + 0) / 3, False, False)
  # Every (object, target) pair must hold: two dogs, the cat between them.
  meta = position('left of')
  meta['include'][0]['count'] = 2
  between = {'cat': [det(30, 0)], 'dog': [det(0, 0), det(60, 0)]}
  assert ev(meta, between) == result(2 / 3, False, False)
  assert ev(meta, {'cat': [det(0, 0)], 'dog': [det(30, 0), det(60, 0)]}) == result(1.0, True, True)


@pytest.mark.parametrize('offset,relations', [
    # Boxes 10 x 10: the slack is 0.1 * (10 + 10) = 2 on each axis.
    ((-11, 0), {'left of'}),
    ((11, 0), {'right of'}),
    ((0, -11), {'above'}),             # image y grows downwards
    ((0, 11), {'below'}),
    ((-1.5, 0), set()),                # within the slack: no relation at all
    ((-3, 0), set()),                  # revised -1, dx = -1 / 3: past the slack, still not 'left of'
    ((-4, 0), set()),                  # revised -2, dx = -0.5: not < -0.5
    ((-4.1, 0), {'left of'}),          # revised -2.1, dx = -0.512 (|o| > 0.4 (w_a + w_b))
    ((-10, -10), {'left of', 'above'}),    # diagonal: both
    ((-10, 3), {'left of'}),           # revised (-8, 1): dy = 1 / |(-10, 3)| = 0.1
    ((0, 0), set()),
])
def test_relative_position_slack(offset, relations):
  a = box(50 + offset[0], 50 + offset[1])
  assert ge.relative_position(a, box(50, 50)) == relations


def test_relative_position_slack_scales_with_the_boxes():
  # The same centre offset of 30: 'left of' between 10-wide boxes, nothing between 80-wide ones
  # (30 - 0.1 * 160 = 14; 14 / 30 < 0.5) and 'left of' again between 20-wide ones (30 - 4 = 26).
  assert ge.relative_position(box(0, 0, 10), box(30, 0, 10)) == {'left of'}
  assert ge.relative_position(box(0, 0, 80), box(30, 0, 80)) == set()
  assert ge.relative_position(box(0, 0, 20), box(30, 0, 20)) == {'left of'}
  # Heights set the vertical slack only.
  assert ge.relative_position(box(0, 0, 10, 200), box(30, 0, 10, 200)) == {'left of'}


# ------------------------------------------------------------------------------------------ thresholds
def test_threshold_point_three():
  assert ev(single(), {'cat': [det(conf=0.31)]})['correct']
  assert ev(single(), {'cat': [det(conf=0.3)]}) == result(0.0, False, False)        # strictly above
  # Low-confidence duplicates are dropped before counting.
  assert ev(single(), {'cat': [det(conf=0.8), det(20, conf=0.2)]}) == result(1.0, True, True)


def test_threshold_point_nine_for_counting():
  dets = {'cat': [det(0, conf=0.95), det(20, conf=0.92), det(40, conf=0.5)]}
  assert ev(counting(2), dets) == result(1.0, True, True)           # the 0.5 box is not counted
  assert ev(counting(3), dets) == result(1 - 1 / 3, False, False)
  assert ev(counting(2), {'cat': [det(0, conf=0.95), det(20, conf=0.9)]}) == result(0.5, False, False)
  # The same boxes under another tag use 0.3: three cats.
  meta = {'tag': 'two_object', 'include': [{'class': 'cat', 'count': 2}]}
  assert ev(meta, dets) == result(1 - 1 / 2, True, False)


def test_sixteen_boxes_per_class_and_negative_credit():
  many = {'cat': [det(20 * i, conf=0.4 + 0.01 * i) for i in range(20)]}
  kept = ge.kept_objects(many, 'single_object')['cat']
  assert len(kept) == 16
  np.testing.assert_allclose([k[1] for k in kept], [0.4 + 0.01 * i for i in range(19, 3, -1)])
  # One cat asked for, 16 kept: 1 - 15 / 1, the lowest score there is.
  assert ev(single(), many) == result(-14.0, True, False)
  assert ev(two(), {'cat': [det(), det(20), det(40)], 'dog': [det(60)]}) == result((-1 + 1) / 2, True,
                                                                                    False)
  assert ev(counting(2), {'cat': [det(20 * i, conf=0.99) for i in range(5)]}) == result(
      1 - 3 / 2, False, False)


def test_kept_objects_order_and_no_nms():
  dets = {'cat': [det(0, conf=0.5), det(0, conf=0.7), det(0, conf=0.5, color='x'), det(1, conf=0.1)],
          'dog': [det(conf=0.2)], 'cow': []}
  kept = ge.kept_objects(dets, 'single_object')
  assert list(kept) == ['cat']                      # classes with nothing kept are absent
  # Identical boxes all stay (no NMS); ties: the later detection first (the original's reversed argsort).
  assert [(k[1], k[2]) for k in kept['cat']] == [(0.7, None), (0.5, 'x'), (0.5, None)]
  with pytest.raises(ValueError, match='must be \\(box_xyxy, confidence, color_or_None\\)'):
    ge.kept_objects({'cat': [((0, 0, 1, 1), 0.5)]}, 'single_object')


@pytest.mark.parametrize('metadata,match', [
    ({'tag': 'shapes', 'include': [{'class': 'cat', 'count': 1}]}, 'tag must be one of'),
    ({'tag': 'single_object', 'include': []}, 'include must be a non-empty list'),
    ({'tag': 'single_object', 'include': [{'class': 'cat', 'count': 0}]}, 'count must be an integer >= 1'),
    ({'tag': 'position', 'include': [{'class': 'cat', 'count': 1, 'position': ('left of', 0)}]},
     'earlier include entry'),
    ({'tag': 'position', 'include': [{'class': 'dog', 'count': 1},
                                     {'class': 'cat', 'count': 1, 'position': ('near', 0)}]}, 'position'),
])
def test_bad_metadata_is_one_line(metadata, match):
  with pytest.raises(ValueError, match=match) as info:
    ev(metadata, {})
  assert '\n' not in str(info.value)


def test_summarize():
  tags = ['single_object', 'single_object', 'counting', 'position']
  results = [result(1, True, True), result(0, False, False), result(0.5, True, False),
             result(0, False, False)]
  assert ge.summarize(tags, results) == {'single_object': 0.5, 'counting': 1.0, 'position': 0.0,
                                         'overall': pytest.approx(0.5)}
  assert ge.summarize(tags, results, 'strict_correct')['overall'] == pytest.approx((0.5 + 0 + 0) / 3)


# ------------------------------------------------------------------------------------------ reward
def metadata_file(tmp_path, metadatas):
  path = tmp_path / 'evaluation_metadata.jsonl'
  path.write_text(''.join(json.dumps(m) + '\n' for m in metadatas))
  return str(path)


DETECTIONS = {'a photo of a cat': {'cat': [det()]},
              'a photo of two dogs': {'dog': [det(conf=0.95), det(20, conf=0.95), det(40, conf=0.95)]},
              'a photo of a red cup': None}


def fake_detector(images, metadatas):
  """Canned detections by prompt (None: an image the detector could not read)."""
  assert images.dtype == np.uint8 and images.shape[0] == len(metadatas)
  return [DETECTIONS[m['prompt']] for m in metadatas]


def make_fake_detector(scale=1.0):
  del scale
  return fake_detector


METADATA = [dict(single(), prompt='a photo of a cat'),
            dict(counting(2, 'dog'), prompt='a photo of two dogs'),
            dict(colors('red', 'cup'), prompt='a photo of a red cup')]


def test_reward_needs_a_detector(tmp_path):
  path = metadata_file(tmp_path, METADATA)
  with pytest.raises(ge.DetectorUnavailable) as info:
    ge.GenEvalReward(metadata_file=path)
  message = str(info.value)
  assert '\n' not in message
  for needed in ('mmdet 2.x', 'mmcv-full 1.x', 'CUDA', 'Mask2Former', 'open_clip', 'detector='):
    assert needed in message
  problems = ge.input_problems({'metadata_file': path})
  assert len(problems) == 1 and 'Mask2Former' in problems[0]
  assert ge.input_problems({'metadata_file': path, 'detector': 'test_geneval:fake_detector'}) == []
  assert len(ge.input_problems({'detector': 'no_such_module_xyz:f'})) == 2
  assert 'no such file' in ge.input_problems({'metadata_file': str(tmp_path / 'x.jsonl'),
                                              'detector': fake_detector})[0]


@pytest.mark.parametrize('detector,kwargs', [(fake_detector, None),
                                             ('test_geneval:fake_detector', None),
                                             ('test_geneval:make_fake_detector', {'scale': 2.0})])
def test_reward_with_a_detector(tmp_path, detector, kwargs):
  path = metadata_file(tmp_path, METADATA)
  prompts = ['a photo of a cat', 'a photo of two dogs', 'a photo of a red cup']
  images = np.zeros((3, 8, 8, 3), np.uint8)
  reward = ge.GenEvalReward(metadata_file=path, detector=detector, detector_kwargs=kwargs)
  scores = reward.scores(images, prompts)
  np.testing.assert_allclose(scores['score'], [1.0, 0.5, np.nan])
  np.testing.assert_allclose(scores['correct'], [1.0, 0.0, np.nan])
  np.testing.assert_allclose(scores['strict_correct'], [1.0, 0.0, np.nan])
  out = reward(images, prompts)
  assert out.dtype == np.float32 and out.shape == (3,)
  np.testing.assert_allclose(ge.GenEvalCorrect(metadata_file=path, detector=detector,
                                               detector_kwargs=kwargs)(images[:2], prompts[:2]), [1, 0])
  with pytest.raises(ValueError, match="prompt 'a photo of a bird' is not in the metadata file"):
    reward(images[:1], ['a photo of a bird'])
  with pytest.raises(ValueError, match=r'geneval needs uint8 images \(M, H, W, 3\)'):
    reward(images[..., 0], prompts)


def test_metadata_file_errors(tmp_path):
  bad = tmp_path / 'bad.jsonl'
  bad.write_text(json.dumps(dict(single(), prompt='p')) + '\n{"tag": "single_object"}\n')
  with pytest.raises(ValueError, match='bad.jsonl:2: a JSON object with a "prompt"'):
    ge.load_metadata(str(bad))
  bad.write_text(json.dumps(dict(single(), prompt='p')) + '\n' + json.dumps(dict(single('dog'), prompt='p')))
  with pytest.raises(ValueError, match="bad.jsonl:2: prompt 'p' appears with two different metadata"):
    ge.load_metadata(str(bad))
