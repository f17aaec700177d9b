"""Registered rewards as evaluation judges (the paper's Table 4: OCR with ClipScore, PickScore and
ImageReward beside it): their columns in the trainer's evaluation and in the OCR evaluation, the NaN count,
and the table over several checkpoints."""
import numpy as np
import pytest
from test_trainer import apply_overrides  # tests/test_trainer.py

from configs import ocr_tiny
from ddrl_jax import cli
from ddrl_jax import evaluate as evaluate_lib
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.rewards import clip_rewards
from ddrl_jax.rewards import judges as judges_lib
from ddrl_jax.rewards import registry
from ddrl_jax.tasks import ocr_eval


class _Fixed:
  """A judge that returns given scores (NaN marks an unscorable sample)."""

  def __init__(self, values):
    self.values = np.asarray(values, np.float64)
    self.seen = None

  def __call__(self, images, prompts):
    self.seen = (np.asarray(images).shape, list(prompts))
    return self.values[:len(prompts)]


def test_judge_columns_are_means_of_the_scored_samples_and_count_the_rest():
  images = np.zeros((4, 8, 8, 3), np.uint8)
  out = registry.judge_columns({'a': _Fixed([1.0, np.nan, 3.0, 5.0]), 'b': _Fixed([np.nan] * 4)},
                               images, ['p'] * 4)
  assert out == {'judge/a': 3.0, 'judge/a_failed': 1, 'judge/b': out['judge/b'], 'judge/b_failed': 4}
  assert np.isnan(out['judge/b'])


def test_table4_lists_ocr_then_each_judge_per_checkpoint():
  rows = [{'checkpoint': 'base', 'step': 0, 'eval/ocr': 0.25, 'eval/judge/clipscore': 0.321,
           'eval/judge/pickscore': 0.865},
          {'checkpoint': '/runs/ddrl', 'step': 300, 'eval/ocr': 0.8, 'eval/judge/clipscore': 0.32}]
  table = evaluate_lib.table4_markdown(rows, ['clipscore', 'pickscore']).splitlines()
  assert table[0] == '| checkpoint | step | OCR | clipscore | pickscore |'
  assert table[2] == '| base | 0 | 0.2500 | 0.3210 | 0.8650 |'
  assert table[3] == '| /runs/ddrl | 300 | 0.8000 | 0.3200 | nan |'


def _ocr_config():
  c = ocr_tiny.get_config()
  return apply_overrides(c, {'batch_size': 4, 'num_rollouts': 2, 'eval_samples': 8, 'eval_every': -1})


def test_the_trainers_evaluation_scores_its_samples_with_the_judges(tmp_path):
  """On the OCR task: the judges see the decoded evaluation images with their prompts, and a real
  (tiny random) CLIPScore's column equals that reward on the same images."""
  files = clip_rewards.save_tiny(str(tmp_path / 'clip'))
  clipscore = registry.make_reward('clipscore', checkpoint=files['checkpoint'])
  fixed = _Fixed(np.arange(64, dtype=np.float64))
  trainer = trainer_lib.Trainer(_ocr_config(), str(tmp_path / 'run'))
  trainer.restore_or_init()
  trainer._build()  # pylint: disable=protected-access
  try:
    metrics = trainer.evaluate(0, judges={'fixed': fixed, 'clipscore': clipscore})
  finally:
    trainer.close_rewards()
  shape, prompts = fixed.seen
  assert shape[1:] == (32, 96, 3) and len(prompts) == shape[0] == 8
  assert metrics['eval/judge/fixed'] == pytest.approx(np.arange(8).mean())
  assert metrics['eval/judge/fixed_failed'] == 0 and metrics['eval/judge/clipscore_failed'] == 0
  assert -1.0 <= metrics['eval/judge/clipscore'] <= 1.0 and 'eval/ocr' in metrics


def test_the_ocr_evaluation_reports_the_judges_on_the_held_out_samples(tmp_path):
  files = clip_rewards.save_tiny(str(tmp_path / 'clip'))
  judges = {'clipscore': registry.make_reward('clipscore', checkpoint=files['checkpoint']),
            'pickscore': registry.make_reward('pickscore', checkpoint=files['checkpoint'])}
  c = _ocr_config()
  task, apply_fn, params = evaluate_lib.load_params(c, 'base')
  metrics, _ = ocr_eval.evaluate_ocr(c, apply_fn, params, task, prompts=2, per_prompt=2,
                                     reward_judges=judges)
  assert set(metrics) >= {'judge/clipscore', 'judge/pickscore', 'judge/clipscore_failed'}
  assert -1.0 <= metrics['judge/clipscore'] <= 1.0
  assert abs(metrics['judge/pickscore']) <= 100 / 26


def test_unknown_or_unprovided_judges_are_one_line():
  c = _ocr_config()
  with pytest.raises(cli.UsageError, match="unknown judges \\['nope'\\]"):
    judges_lib.build(c, ['nope'])
  with pytest.raises(cli.UsageError, match='the judges need inputs they were not given: '
                     'clipscore: config.reward.kwargs.clipscore.checkpoint is not set'):
    judges_lib.build(c, ['clipscore'])
