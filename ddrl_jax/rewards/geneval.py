"""GenEval's scoring rules on detector outputs, and a reward on them with a pluggable detector.

References: djghosh13/geneval evaluation/evaluate_images.py (`evaluate`, `evaluate_image`,
`relative_position`) and prompts/create_prompts.py (the metadata); DiffusionNFT / flow_grpo
flow_grpo/gen_eval.py (`evaluate_reward`: the training score and strict correctness); cosmos-rl's
model/gen_eval.py (the same rules in its reward service).

The detector is not here. GenEval's stack is Mask2Former Swin-S (mmdet 2.x on mmcv-full 1.x built with its
CUDA ops, checkpoint mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.pth, the 80 COCO classes) plus OpenAI
CLIP ViT-L/14 (open_clip) classifying each kept box's crop (masked on a #999 background) into COLORS; it
does not install here. `GenEvalReward` therefore needs a `detector` callable that returns detections; this
module implements and tests only the rules applied to them.

Inputs per image:
  metadata    {'tag': one of TAGS, 'include': [{'class': str, 'count': int >= 1, 'color': optional str,
              'position': optional (relation, index of an earlier include entry)}], 'exclude': optional
              [{'class': str, 'count': int}], 'prompt': optional str} (GenEval's evaluation_metadata.jsonl).
  detections  {class_name: [(box_xyxy, confidence, color_or_None), ...]}: every box the detector found, in
              pixels, with the colour its classifier gave the box's crop (None where none was asked for).

Rules (the original's constants):
  kept boxes  per class: confidence > 0.3 (> 0.9 when the tag is 'counting'), sorted by confidence (highest
              first; ties: the later detection first, as the original's reversed argsort orders them), at
              most 16; no NMS (the original's max_overlap 1.0 disables it). Classes with no box kept are
              absent.
  position    `relative_position(a, b)`: centres c, sizes d = (width, height), offset o = c_a - c_b; each
              axis's offset is shrunk towards 0 by 0.1 (d_a + d_b) on that axis (clipped at 0, sign kept):
              r = sign(o) max(|o| - 0.1 (d_a + d_b), 0). No relation if both |r| < 1e-3; otherwise, with
              (dx, dy) = r / |o| (the *unshrunk* offset's length), 'left of' if dx < -0.5, 'right of' if
              dx > 0.5, 'above' if dy < -0.5, 'below' if dy > 0.5 (image y grows downwards). A diagonal
              offset can hold two relations; a requirement holds when its relation is among them. Since r
              is divided by |o|, not by |r|, a purely horizontal offset is 'left of' / 'right of' only when
              |o_x| > 0.4 (w_a + w_b) (|o_x| - 0.1 (w_a + w_b) > 0.5 |o_x|), not as soon as it exceeds the
              slack.
  colour      the detection's colour label (the original's CLIP classifier belongs to the detector).

Results of `evaluate_detections(metadata, detections)`:
  correct         GenEval's own rule (evaluate_images.py `evaluate`): every include entry has at least
                  `count` kept boxes; its `count` most confident ones all have the colour asked for; each of
                  them is in the relation asked for to each of the target entry's `count` boxes (the target
                  entry itself satisfied); and every exclude entry has fewer than `count` kept boxes. Counts
                  are "at least" for every tag; GenEval's counting prompts are exact because their metadata
                  adds an exclude entry {'class', 'count': N + 1}.
  score           the training reward (gen_eval.py `evaluate_reward`): the mean of terms, per include entry:
                  count term  1 - |count - kept| / count (all kept boxes, up to 16: negative when more
                              than twice `count` are found, down to 1 - 15 / 1 = -14);
                  if kept != count and the entry asks for a colour or a position: one term 0;
                  otherwise colour term  1 - |count - boxes of that colour| / count (in [0, 1]);
                  position term (if the colour, when asked, holds)  1 if every (box, target box) pair is
                  in the relation, else 0; 0 if the target entry was not satisfied.
                  Excludes add no term.
  strict_correct  every include entry satisfied exactly (kept == count, all colours, all relations) and,
                  here, every exclude entry too (see below).
`summarize` turns a list of results into GenEval's accuracies (per tag, and the overall score: the mean
over tags).

Differences from gen_eval.py `evaluate_reward`, on purpose:
  * a failed position check there appends a 0 term and then, after its loop, a 1 term as well (its
    `rewards.append(1.0)` is not conditional), so a position prompt with both objects found once but
    misplaced scores (1 + 1 + 0 + 1) / 4 = 0.75 there and (1 + 1 + 0) / 3 = 2/3 here; here a position
    term is 1 or 0, once.
  * strict_correct also requires the exclude entries (the reference ignores them there). For GenEval's
    metadata the two agree: its only excludes are the counting prompts' N + 1, which an exact count of N
    already satisfies.
"""
import importlib
import importlib.util
import json
import math
import os

import numpy as np

NAME = 'geneval'
TAGS = ('single_object', 'two_object', 'counting', 'colors', 'position', 'color_attr')
COLORS = ('red', 'orange', 'yellow', 'green', 'blue', 'purple', 'pink', 'brown', 'black', 'white')
RELATIONS = ('left of', 'right of', 'above', 'below')
THRESHOLD = 0.3              # a box counts if its confidence is above this,
COUNTING_THRESHOLD = 0.9     # or above this for the 'counting' tag
MAX_OBJECTS = 16             # boxes kept per class
POSITION_THRESHOLD = 0.1     # the slack of relative_position, times the two boxes' sizes
KEYS = ('score', 'correct', 'strict_correct')
# What the original detector stack needs (for the message of a reward built without a detector).
DETECTOR_STACK = ('mmdet 2.x with mmcv-full 1.x built with CUDA ops, the Mask2Former Swin-S COCO checkpoint '
                  '(mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.pth) and open_clip ViT-L-14 (OpenAI '
                  'weights) for the colours')


class DetectorUnavailable(RuntimeError):
  """The reward was built without a detector; the message is one line naming what the original needs."""


# ------------------------------------------------------------------------------------------ metadata
def check_metadata(metadata):
  """ValueError (one line, naming the prompt when there is one) unless `metadata` is usable."""
  where = f'{NAME} metadata' + (f' of {metadata["prompt"]!r}' if isinstance(metadata, dict)
                                and 'prompt' in metadata else '')
  if not isinstance(metadata, dict) or metadata.get('tag') not in TAGS:
    raise ValueError(f'{where}: tag must be one of {TAGS}, got '
                     f'{metadata.get("tag") if isinstance(metadata, dict) else type(metadata).__name__!r}')
  include = metadata.get('include')
  if not isinstance(include, (list, tuple)) or not include:
    raise ValueError(f'{where}: include must be a non-empty list of requirements')
  for i, req in enumerate(include):
    if not isinstance(req, dict) or not isinstance(req.get('class'), str):
      raise ValueError(f'{where}: include[{i}] needs a class name')
    if not isinstance(req.get('count'), int) or req['count'] < 1:
      raise ValueError(f'{where}: include[{i}].count must be an integer >= 1, got {req.get("count")!r}')
    if 'position' in req:
      position = req['position']
      if (not isinstance(position, (list, tuple)) or len(position) != 2 or position[0] not in RELATIONS
          or not isinstance(position[1], int) or not 0 <= position[1] < i):
        raise ValueError(f'{where}: include[{i}].position must be (one of {RELATIONS}, the index of an '
                         f'earlier include entry), got {position!r}')
  for i, req in enumerate(metadata.get('exclude') or ()):
    if not isinstance(req, dict) or not isinstance(req.get('class'), str) or not isinstance(
        req.get('count'), int):
      raise ValueError(f'{where}: exclude[{i}] needs a class name and an integer count')


# ------------------------------------------------------------------------------------------ detections
def confidence_threshold(tag):
  """The confidence a box must exceed to count: 0.9 for 'counting', 0.3 otherwise."""
  return COUNTING_THRESHOLD if tag == 'counting' else THRESHOLD


def kept_objects(detections, tag, max_objects=MAX_OBJECTS):
  """{class: [(box (4,) float64 xyxy, confidence, colour), ...]}: each class's boxes with confidence above
  confidence_threshold(tag), most confident first (ties: later detections first), at most max_objects;
  classes left with none are dropped. No NMS."""
  threshold = confidence_threshold(tag)
  kept = {}
  for name, boxes in (detections or {}).items():
    boxes = list(boxes)
    rows = []
    for j, det in enumerate(boxes):
      if len(det) != 3:
        raise ValueError(f'{NAME}: detection {j} of {name!r} must be (box_xyxy, confidence, color_or_None), '
                         f'got {len(det)} items')
      box = np.asarray(det[0], np.float64).reshape(-1)
      if box.shape[0] < 4:
        raise ValueError(f'{NAME}: detection {j} of {name!r} has a box of {box.shape[0]} numbers, not 4')
      rows.append((box[:4], float(det[1]), det[2]))
    if not rows:
      continue
    confidence = np.array([r[1] for r in rows])
    order = np.argsort(confidence, kind='stable')[::-1]
    order = [k for k in order if confidence[k] > threshold][:max_objects]
    if order:
      kept[name] = [rows[k] for k in order]
  return kept


def relative_position(box_a, box_b, threshold=POSITION_THRESHOLD):
  """The relations (a subset of RELATIONS) of box A to box B, both (x1, y1, x2, y2); see the module
  docstring for the rule (the original's, with its slack of `threshold` times the two boxes' sizes)."""
  boxes = np.array([np.asarray(box_a, np.float64)[:4], np.asarray(box_b, np.float64)[:4]]).reshape(2, 2, 2)
  center_a, center_b = boxes.mean(axis=-2)
  dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
  offset = center_a - center_b
  revised = np.maximum(np.abs(offset) - threshold * (dim_a + dim_b), 0) * np.sign(offset)
  if np.all(np.abs(revised) < 1e-3):
    return set()
  dx, dy = revised / np.linalg.norm(offset)
  relations = set()
  if dx < -0.5:
    relations.add('left of')
  if dx > 0.5:
    relations.add('right of')
  if dy < -0.5:
    relations.add('above')
  if dy > 0.5:
    relations.add('below')
  return relations


def colours_of(objects, req):
  """The colour labels of `objects` (kept boxes of req's class); ValueError if one has none."""
  colours = [colour for _, _, colour in objects]
  if any(c is None for c in colours):
    raise ValueError(f'{NAME}: a kept {req["class"]!r} box has no colour label but the metadata asks for '
                     f'{req["color"]!r}: the detector must classify the colours of the classes asked for')
  return colours


def in_relation(objects, targets, relation):
  """Whether every box of `objects` is in `relation` to every box of `targets`."""
  return all(relation in relative_position(obj[0], target[0]) for obj in objects for target in targets)


# ------------------------------------------------------------------------------------------ rules
def geneval_correct(metadata, objects):
  """GenEval's `correct` (evaluate_images.py `evaluate`) of kept objects (see kept_objects)."""
  correct = True
  groups = []                     # per include entry: its matched boxes, or None
  for req in metadata['include']:
    want = req['count']
    found = objects.get(req['class'], [])[:want]
    matched = len(found) >= want
    if matched and 'color' in req:
      matched = colours_of(found, req).count(req['color']) >= want
    if matched and 'position' in req:
      relation, target = req['position']
      matched = groups[target] is not None and in_relation(found, groups[target], relation)
    groups.append(found if matched else None)
    correct = correct and matched
  for req in metadata.get('exclude') or ():
    if len(objects.get(req['class'], [])) >= req['count']:
      correct = False
  return correct


def reward_terms(metadata, objects):
  """(terms, strict): gen_eval.py `evaluate_reward`'s terms of kept objects (one position term, see the
  module docstring) and whether every include entry is satisfied exactly."""
  terms, strict = [], True
  groups = []
  for req in metadata['include']:
    want = req['count']
    found = objects.get(req['class'], [])
    terms.append(1.0 - abs(want - len(found)) / want)
    ok = len(found) == want
    if not ok:
      if 'color' in req or 'position' in req:
        terms.append(0.0)
    else:
      if 'color' in req:
        matching = colours_of(found, req).count(req['color'])
        terms.append(1.0 - abs(want - matching) / want)
        ok = matching == want
      if 'position' in req and ok:
        relation, target = req['position']
        ok = groups[target] is not None and in_relation(found, groups[target], relation)
        terms.append(1.0 if ok else 0.0)
    groups.append(found if ok else None)
    strict = strict and ok
  return terms, strict


def evaluate_detections(metadata, detections):
  """{'score': float, 'correct': bool, 'strict_correct': bool} of one image's detections (every box the
  detector found, {class: [(box_xyxy, confidence, color_or_None), ...]}) under its GenEval metadata."""
  check_metadata(metadata)
  objects = kept_objects(detections, metadata['tag'])
  terms, strict = reward_terms(metadata, objects)
  excluded = any(len(objects.get(req['class'], [])) >= req['count'] for req in metadata.get('exclude') or ())
  return {'score': float(np.mean(terms)) if terms else 0.0,
          'correct': bool(geneval_correct(metadata, objects)),
          'strict_correct': bool(strict and not excluded)}


def summarize(tags, results, key='correct'):
  """GenEval's accuracies of `results` (evaluate_detections' dicts; NaN-free) for images of `tags`:
  {tag: the fraction of its images with results[key] true, ..., 'overall': the mean over the tags
  present} (GenEval's "Overall score", summary_scores.py)."""
  by_tag = {}
  for tag, result in zip(tags, results):
    by_tag.setdefault(tag, []).append(float(bool(result[key])))
  out = {tag: float(np.mean(values)) for tag, values in by_tag.items()}
  out['overall'] = float(np.mean(list(out.values()))) if out else math.nan
  return out


# ------------------------------------------------------------------------------------------ reward
def load_metadata(path):
  """{prompt: metadata} from a GenEval evaluation_metadata.jsonl (one JSON object with a 'prompt' per
  line); ValueError naming the file and line for a bad line or a prompt given two different metadata."""
  by_prompt = {}
  with open(path, encoding='utf-8') as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        metadata = json.loads(line)
        if not isinstance(metadata, dict) or not isinstance(metadata.get('prompt'), str):
          raise ValueError('a JSON object with a "prompt" string is needed')
        check_metadata(metadata)
      except ValueError as e:      # json.JSONDecodeError is one
        raise ValueError(f'{NAME} metadata {path}:{n}: {str(e).splitlines()[0]}') from None
      prompt = metadata['prompt']
      if by_prompt.get(prompt, metadata) != metadata:
        raise ValueError(f'{NAME} metadata {path}:{n}: prompt {prompt!r} appears with two different metadata')
      by_prompt[prompt] = metadata
  return by_prompt


def _detector_problems(detector):
  if detector is None:
    return [f'{NAME}: no detector: GenEval\'s needs {DETECTOR_STACK}, which this install lacks; pass '
            f'detector="module:callable" returning detections (see ddrl_jax.rewards.geneval)']
  if isinstance(detector, str):
    module, _, attr = detector.partition(':')
    if not attr:
      return [f'{NAME}: detector={detector!r} must be "module:callable"']
    try:
      found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
      found = False
    if not found:
      return [f'{NAME}: detector module {module!r} cannot be found']
  elif not callable(detector):
    return [f'{NAME}: detector must be a callable or "module:callable", got {type(detector).__name__}']
  return []


def input_problems(kwargs):
  """One-line problems with GenEvalReward(**kwargs)'s metadata file and detector; nothing is loaded."""
  problems = []
  path = kwargs.get('metadata_file')
  if not path:
    problems.append(f'{NAME}: config.reward.kwargs.{NAME}.metadata_file is not set (GenEval\'s '
                    'evaluation_metadata.jsonl, or any JSONL of metadata with a "prompt" each)')
  elif not os.path.isfile(os.path.expanduser(path)):
    problems.append(f'{NAME}: metadata_file {path}: no such file')
  return problems + _detector_problems(kwargs.get('detector'))


def resolve_detector(detector, detector_kwargs=None):
  """The detector callable: `detector` itself, or the attribute "module:attr" names; called with
  detector_kwargs to build it when they are given."""
  problems = _detector_problems(detector)
  if problems:
    raise (DetectorUnavailable if detector is None else ValueError)(problems[0])
  if isinstance(detector, str):
    module, _, attr = detector.partition(':')
    detector = getattr(importlib.import_module(module), attr)
  return detector(**detector_kwargs) if detector_kwargs else detector


class GenEvalReward:
  """reward(samples, prompts) -> (M,) float32 GenEval results of (M, H, W, 3) uint8 images: the training
  score (key='score', in [-14, 1]) or the 0/1 correct / strict_correct (evaluation).

  Args:
    metadata_file: GenEval's evaluation_metadata.jsonl (or any JSONL of metadata with a 'prompt' each):
      each sample's metadata is the one of its prompt; a prompt not in the file is a ValueError.
    detector: a callable detector(images (M, H, W, 3) uint8, metadatas: list of M dicts) -> list of M
      detections dicts ({class: [(box_xyxy, confidence, color_or_None), ...]}, every box found, colours
      classified for the classes whose requirements name one) or None for an image it could not read
      (scored NaN); or "module:attr" naming one. Without it the reward cannot be built
      (DetectorUnavailable: GenEval's own detector does not install here).
    detector_kwargs: if given, detector(**detector_kwargs) builds the callable.
    key: the column returned: 'score', 'correct' or 'strict_correct'.
  """

  def __init__(self, metadata_file=None, detector=None, detector_kwargs=None, key='score'):
    if key not in KEYS:
      raise ValueError(f'{NAME}: key={key!r}; known: {KEYS}')
    self.detector = resolve_detector(detector, detector_kwargs)
    problems = input_problems({'metadata_file': metadata_file, 'detector': self.detector})
    if problems:
      raise ValueError(problems[0])
    self.metadata = load_metadata(os.path.expanduser(metadata_file))
    self.key = key

  def metadata_of(self, prompt):
    if prompt not in self.metadata:
      raise ValueError(f'{NAME}: prompt {prompt!r} is not in the metadata file')
    return self.metadata[prompt]

  def scores(self, samples, prompts):
    """{'score', 'correct', 'strict_correct': (M,) float32} (the last two 0 / 1; NaN where the detector
    returned None)."""
    samples = np.asarray(samples)
    if samples.dtype != np.uint8 or samples.ndim != 4 or samples.shape[-1] != 3:
      raise ValueError(f'{NAME} needs uint8 images (M, H, W, 3), got {samples.dtype} {samples.shape}')
    if len(prompts) != samples.shape[0]:
      raise ValueError(f'{NAME}: {len(prompts)} prompts for {samples.shape[0]} samples')
    metadatas = [self.metadata_of(p) for p in prompts]
    detections = list(self.detector(samples, metadatas)) if samples.shape[0] else []
    if len(detections) != samples.shape[0]:
      raise ValueError(f'{NAME}: the detector returned {len(detections)} results for {samples.shape[0]} '
                       'images')
    out = {k: np.full((samples.shape[0],), np.nan, np.float32) for k in KEYS}
    for i, (metadata, found) in enumerate(zip(metadatas, detections)):
      if found is None:
        continue
      for k, v in evaluate_detections(metadata, found).items():
        out[k][i] = float(v)
    return out

  def __call__(self, samples, prompts):
    return self.scores(samples, prompts)[self.key]


def GenEvalCorrect(**kwargs):  # pylint: disable=invalid-name  (a factory named like the others)
  """GenEvalReward with key='correct' (GenEval's accuracy per image, 0 or 1)."""
  return GenEvalReward(key='correct', **kwargs)


def GenEvalStrictCorrect(**kwargs):  # pylint: disable=invalid-name
  """GenEvalReward with key='strict_correct' (exact counts, 0 or 1)."""
  return GenEvalReward(key='strict_correct', **kwargs)
