"""Checkpoints written before the pipeline moved into the families resume under today's code and configs:
runs of one iteration each, written by commit 6f70489 (the last commit with the 'sd3_ocr' task, the prompt
keys in config.sd3 and cosmos-rl's conventions spelled 'cosmos') and kept in tests/fixtures/old_checkpoints/
(two LoRA runs, SD3 and the OCR task, and a Cosmos smoke run), are resumed to a second iteration."""
import os
import shutil

import jax
import numpy as np
import pytest

from configs import cosmos2b
from configs import ocr_tiny
from configs import sd35m
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import trainer as trainer_lib

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'old_checkpoints')


def _sd3():
  return sd35m.get_config('flow_grpo_smoke')


def _ocr():
  c = ocr_tiny.get_config('ddrl')
  c.lora.rank = 4
  # The data term the run was written with (the presets' default before issue 45 chose path_kl at 0.03).
  c.rl.data_weighting, c.rl.data_beta = 'cosmos_rl', 0.01
  return c


@pytest.mark.slow
@pytest.mark.parametrize('name,make', [('sd3_flow_grpo_smoke_lora', _sd3), ('ocr_tiny_ddrl_lora4', _ocr),
                                       ('cosmos2b_smoke', lambda: cosmos2b.get_config('smoke'))])
def test_a_checkpoint_of_the_old_layout_resumes(name, make, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(os.path.join(FIXTURES, name), workdir / 'checkpoints' / '1')
  config = make()
  # The old runs' command-line overrides (num_iterations 1 then, 2 now: a key that may change).
  config.num_iterations, config.checkpoint_every, config.eval_every = 2, 1, 0
  trainer = trainer_lib.Trainer(config, str(workdir), devices=jax.devices()[:1])
  assert trainer.restore_or_init() == 1          # resumed, not started again
  trainer.train(progress=False)
  rows = [r for r in metrics_lib.read_metrics(workdir) if 'loss' in r]
  assert [r['step'] for r in rows] == [2] and np.isfinite(rows[0]['loss'])
