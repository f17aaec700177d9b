"""`python -m ddrl_jax.evaluate` reaches a task's own checkpoint evaluation through the task interface
('checkpoint_evaluation' and a `CheckpointRequest` carrying the command's flags), names a task that has
none, and the OCR and video tasks' evaluations behind it keep their contracts."""
import json
import sys
import types

import numpy as np
import pytest
from test_trainer import apply_overrides  # tests/test_trainer.py

from configs import cosmos2b
from configs import ocr_tiny
from configs import toy2d
from ddrl_jax import cli
from ddrl_jax import evaluate as evaluate_lib
from ddrl_jax import tasks
from ddrl_jax.tasks import base


class _RecordingTask:
  """A task from outside the library that evaluates checkpoints its own way and records what it got."""
  capabilities = frozenset({'checkpoint_evaluation'})
  DEFAULT_FAMILY = ''
  seen = []

  def __init__(self, config):
    self.config = config

  def evaluate_checkpoints(self, request):
    type(self).seen.append(request)
    return [{'checkpoint': c, 'step': i, 'ocr_heldout': 0.5 + i, 'judge/a': 1.0}
            for i, c in enumerate(request.checkpoints)]


@pytest.fixture
def recording_task(monkeypatch):
  module = types.ModuleType('ddrl_jax.tasks.recording_standin')
  module.TASK = _RecordingTask
  monkeypatch.setitem(sys.modules, 'ddrl_jax.tasks.recording_standin', module)
  _RecordingTask.seen = []
  config = toy2d.get_config()
  config.task = 'recording_standin'
  return config


def test_a_task_with_its_own_evaluation_gets_every_flag_and_the_table_is_written(recording_task, tmp_path):
  table = tmp_path / 'eval' / 'table4.md'
  rows = evaluate_lib.run(recording_task, ['base', '/runs/a'], judges=['a'], out=str(tmp_path / 'o.jsonl'),
                          ema=True, table=str(table), prompts=3, per_prompt=2, prompt_file='p.jsonl',
                          max_prompts=7, baseline='base', videos_per_category=1, seed=5, batch=4)
  (request,) = _RecordingTask.seen
  assert request == base.CheckpointRequest(
      checkpoints=('base', '/runs/a'), load=request.load, out=str(tmp_path / 'o.jsonl'), ema=True,
      judges=('a',), prompts=3, per_prompt=2, prompt_file='p.jsonl', max_prompts=7, baseline='base',
      videos_per_category=1, seed=5, batch=4)
  assert callable(request.load) and [r['checkpoint'] for r in rows] == ['base', '/runs/a']
  lines = table.read_text().splitlines()
  assert lines[0] == '| checkpoint | step | OCR | a |'
  assert lines[2:] == ['| base | 0 | 0.5000 | 1.0000 |', '| /runs/a | 1 | 1.5000 | 1.0000 |']
  assert json.loads((tmp_path / 'eval' / 'table4.json').read_text()) == rows


def test_a_task_without_its_own_evaluation_says_so_by_name():
  task = tasks.get_task(toy2d.get_config())
  assert 'checkpoint_evaluation' not in task.capabilities
  with pytest.raises(base.Unsupported, match=r"task 'toy2d' \(Toy2D\) cannot evaluate checkpoints"):
    task.evaluate_checkpoints(base.CheckpointRequest(checkpoints=('base',), load=None))


@pytest.mark.slow
def test_the_ocr_task_evaluates_each_checkpoint_into_a_row_and_a_grid(tmp_path):
  config = apply_overrides(ocr_tiny.get_config(), {'batch_size': 4, 'num_rollouts': 2, 'eval_every': -1})
  task = tasks.get_task(config)
  loaded = []

  def load(which, ema):
    loaded.append((which, ema))
    return evaluate_lib.load_params(config, 'base')

  out = tmp_path / 'rows.jsonl'
  rows = task.evaluate_checkpoints(base.CheckpointRequest(
      checkpoints=('base', 'again'), load=load, out=str(out), prompts=2, per_prompt=2))
  assert loaded == [('base', False), ('again', False)]
  assert [r['checkpoint'] for r in rows] == ['base', 'again']
  assert [json.loads(line) for line in out.read_text().splitlines()] == rows
  assert rows[0]['ocr_heldout'] == rows[1]['ocr_heldout']        # same weights, same seed
  assert 0.0 <= rows[0]['ocr_heldout'] <= 1.0 and np.isfinite(rows[0]['heldout_diffusion_loss'])
  assert (tmp_path / 'rows_001.png').exists() and (tmp_path / 'rows_002.png').exists()


def test_the_video_task_takes_one_checkpoint_and_a_baseline():
  task = tasks.get_task(cosmos2b.get_config('smoke'))
  assert 'checkpoint_evaluation' in task.capabilities
  with pytest.raises(cli.UsageError, match=r"takes one checkpoint, got \['a', 'b'\]"):
    task.evaluate_checkpoints(base.CheckpointRequest(checkpoints=('a', 'b'), load=None))
