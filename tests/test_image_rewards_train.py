"""SD3.5 (tiny) trains on a weighted pair of rewards, OCR and CLIPScore, each column logged: through the reward
service with the PyTorch CLIPScore and in-process with the JAX one (issue 47's smoke criterion)."""
import numpy as np
import pytest

from configs import sd35m
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.rewards import clip_rewards


@pytest.mark.slow
@pytest.mark.parametrize('judge', ['clipscore', 'clipscore_jax'])
def test_sd3_smoke_trains_on_ocr_and_clipscore_weighted(judge, tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  files = clip_rewards.save_tiny(str(tmp_path / 'clip'))
  config = sd35m.get_config('flow_grpo_smoke')
  config.reward.fns = {'ocr': 1.0, judge: 0.5}
  config.reward.kwargs[judge] = {'checkpoint': files['checkpoint']}
  config.reward.combine = 'weighted_sum'        # FlowGRPO's multi-reward form
  config.reward.workers = 0                     # in this process: the JAX reward shares the devices
  trainer = trainer_lib.Trainer(config, str(tmp_path / 'run'), devices=jax.devices()[:1])
  assert list(trainer.reward_mesh().devices.flat) == jax.devices()[:1]     # the JAX reward's devices
  trainer.train(progress=False)
  rows = [r for r in metrics_lib.read_metrics(tmp_path / 'run') if 'loss' in r]
  assert len(rows) == config.num_iterations
  for row in rows:
    assert np.isfinite(row[f'reward/{judge}']) and -1.0 <= row[f'reward/{judge}'] <= 1.0
    assert 0.0 <= row['reward/ocr'] <= 1.0 and row['failed_rewards'] == 0
    assert np.isfinite(row['loss'])
