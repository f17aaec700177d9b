"""The paper's video job at toy size, end to end on the CPU: Cosmos smoke DDRL on records prepared from a
captioned folder (T2V and I2V groups mixed by config.cosmos.i2v_prob), text from a tiny random
Cosmos-Reason1 encoder, rewarded by tiny random VideoAlign and VBench models through the reward service's
worker processes, every model read from disk by its real loader."""
import json
import os

import numpy as np
import pytest

from configs import cosmos2b
from ddrl_jax import tasks
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.data import prepare
from ddrl_jax.models import reason1_text
from ddrl_jax.tasks import video

pytest.importorskip('torch')
if os.environ.get('DDRL_REQUIRE_VBENCH') is None:
  pytest.importorskip('vbench', reason='pip install --no-deps vbench==0.1.5')


def _captioned_folder(root, count, frames, size):
  """`count` moving-square videos as .npy (F, H, W, 3) uint8 with sidecar .txt captions."""
  os.makedirs(root)
  for i in range(count):
    clip = video.render_square_video(i, frames, size, size)             # (3, F, H, W) in [-1, 1]
    pixels = np.round((np.transpose(clip, (1, 2, 3, 0)) + 1) * 127.5).astype(np.uint8)
    np.save(os.path.join(root, f'clip{i:02d}.npy'), pixels)
    with open(os.path.join(root, f'clip{i:02d}.txt'), 'w') as f:
      f.write(video.PROMPTS[i % len(video.PROMPTS)][0])
  return root


@pytest.mark.slow
def test_smoke_run_with_reason1_text_videoalign_and_vbench_through_the_service(tmp_path):
  from ddrl_jax.rewards import vbench            # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import videoalign        # pylint: disable=g-import-not-at-top
  config = cosmos2b.get_config('smoke')
  config.cosmos.text = 'reason1'
  config.cosmos.text_encoder = reason1_text.save_tiny(str(tmp_path / 'reason1'))
  task = tasks.get_task(config)
  f, h, w, _ = task.media_shape
  source = _captioned_folder(str(tmp_path / 'captioned'), 16, f, h)
  summary = prepare.prepare(source, str(tmp_path / 'records'), task, text='none')
  assert summary['num_records'] == 16, summary

  config.data.path = str(tmp_path / 'records')
  config.reward.fns = {'videoalign': 1.0, 'vbench': 1.0}
  config.reward.kwargs = {
      'videoalign': videoalign.save_tiny(str(tmp_path / 'videoalign')),
      # 32-pixel videos: AMT-S needs >= 113 pixels a side, so the smoke leaves motion smoothness out.
      'vbench': vbench.save_tiny(str(tmp_path / 'vbench'), dimensions=vbench.accepted_dimensions(f, h, w))}
  assert 'motion_smoothness' not in config.reward.kwargs.vbench.dimensions
  config.reward.workers = 2                         # worker processes: the local reward service
  config.reward.chunk_timeout_s = 300.0
  trainer = trainer_lib.Trainer(config, str(tmp_path / 'run'))
  trainer.train(progress=False)
  rows = [json.loads(l) for l in open(tmp_path / 'run' / 'metrics.jsonl')]
  train = [r for r in rows if 'loss' in r]
  assert [r['step'] for r in train] == [1, 2]
  for r in train:
    assert r['failed_rewards'] == 0, r
    assert np.isfinite(r['reward_mean']) and np.isfinite(r['loss']), r
    assert np.isfinite(r['reward/videoalign']) and 0 < r['reward/vbench'] <= 1, r
    assert r['cond_i2v'] + r['cond_t2v'] == config.batch_size, r
  assert sum(r['cond_i2v'] for r in train) > 0 and sum(r['cond_t2v'] for r in train) > 0
  evaluation, = [r for r in rows if 'eval/reward/videoalign' in r]   # the end's, scored by the service
  for name in ('videoalign', 'vbench'):
    assert np.isfinite(evaluation[f'eval/reward/{name}']), evaluation
    assert np.isfinite(evaluation[f'eval/reward/{name}/t2v']) or np.isfinite(
        evaluation[f'eval/reward/{name}/i2v']), evaluation


@pytest.mark.slow
@pytest.mark.parametrize('preset', ['dance_grpo_smoke', 'flow_grpo_smoke'])
def test_baseline_presets_train_at_toy_size(tmp_path, preset):
  """The Table 1 baselines' recipes (cosmos-rl's sampler, no data term; FlowGRPO with its KL to the
  frozen base) run end to end on the stand-ins."""
  config = cosmos2b.get_config(preset)
  config.num_iterations = 1
  trainer = trainer_lib.Trainer(config, str(tmp_path / 'run'))
  last = trainer.train(progress=False)
  assert np.isfinite(last['loss']) and 'data_loss' not in last, last
  assert (trainer.state.ref_params is not None) == (preset == 'flow_grpo_smoke')
