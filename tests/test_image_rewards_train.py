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


def test_image_reward_presets_carry_flow_grpos_recipes():
  """FlowGRPO's pickscore_sd3 / geneval_sd3: the OCR recipe's shape, the reward, the KL beta; DDRL on the
  same rewards with its base samples; the prompt file is a required input (it does not ship)."""
  ocr = sd35m.get_config('flow_grpo')
  for name, reward, kl in (('flow_grpo_pickscore', 'pickscore', 0.01), ('flow_grpo_geneval', 'geneval', 0.04)):
    c = sd35m.get_config(name)
    assert c.algorithm == 'flow_grpo' and dict(c.reward.fns) == {reward: 1.0} and c.rl.kl_beta == kl
    for key in ('num_iterations', 'batch_size', 'num_rollouts', 'sampler.num_steps', 'sampler.noise_level',
                'sampler.eval_num_steps', 'prompt.guidance_rollout', 'rl.clip_range', 'lora.rank'):
      a, b = c, ocr
      for part in key.split('.'):
        a, b = a[part], b[part]
      assert a == b, key
    assert c.prompt.prompts_required and 'dataset' in c.prompt.prompts_source or 'GenEval' in c.prompt.prompts_source
  d = sd35m.get_config('ddrl_pickscore')
  assert d.algorithm == 'ddrl' and dict(d.reward.fns) == {'pickscore': 1.0}
  assert d.data.base_samples == d.num_iterations * d.batch_size and d.prompt.guidance_rollout == 1.0
  assert not sd35m.get_config('flow_grpo_pickscore_smoke').prompt.prompts_required


def test_a_pickscore_preset_without_its_prompts_and_weights_names_them(tmp_path):
  from ddrl_jax import preflight  # pylint: disable=g-import-not-at-top
  with pytest.raises(preflight.MissingInputs) as e:
    trainer_lib.Trainer(sd35m.get_config('flow_grpo_pickscore'), str(tmp_path / 'run'))
  text = str(e.value)
  for words in ('config.prompt.prompts', 'dataset/pickscore/train.txt', 'config.sd3.checkpoint',
                'config.reward.kwargs.pickscore.checkpoint'):
    assert words in text, (words, text)


@pytest.mark.slow
def test_pickscore_smoke_trains_and_evaluates_with_its_reward(tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  files = clip_rewards.save_tiny(str(tmp_path / 'clip'))
  config = sd35m.get_config('flow_grpo_pickscore_smoke')
  config.reward.kwargs.pickscore.checkpoint = files['checkpoint']
  trainer = trainer_lib.Trainer(config, str(tmp_path / 'run'), devices=jax.devices()[:1])
  trainer.train(progress=False)
  rows = metrics_lib.read_metrics(tmp_path / 'run')
  train = [r for r in rows if 'loss' in r]
  assert len(train) == 2 and all(np.isfinite(r['reward/pickscore']) for r in train)
  last_eval = [r for r in rows if 'eval/reward/pickscore' in r][-1]
  assert abs(last_eval['eval/reward/pickscore']) <= 100 / 26 and 'eval/ocr' in last_eval
