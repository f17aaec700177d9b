"""The Cosmos video task's text conditioning: config.cosmos.text='reason1' runs the Cosmos-Reason1 encoder
(models.reason1_text) from config.cosmos.text_encoder; 'bytes' is the smoke stand-in."""
import numpy as np
import pytest

from configs import cosmos2b
from ddrl_jax import tasks
from ddrl_jax.models import reason1_text as r1


@pytest.fixture(scope='module')
def encoder_folder(tmp_path_factory):
  return r1.save_tiny(str(tmp_path_factory.mktemp('reason1')))   # 2 layers x 16 = the tiny DiT's 32


def _task(**cosmos):
  config = cosmos2b.get_config('smoke')
  config.cosmos.update(cosmos)
  return tasks.get_task(config)


def test_reason1_conditions_are_the_encoders_embeddings(encoder_folder, caplog):
  task = _task(text='reason1', text_encoder=encoder_folder)
  prompts = ['a red square moving to the right', 'a long prompt ' * 20]
  got = task.encode_prompts(prompts)
  assert got.shape == (2, 16, 32) and got.dtype == np.float32     # smoke: 16 tokens, 2 x 16 features
  want = r1.Reason1TextEncoder.from_pretrained(encoder_folder, max_length=16).encode(prompts).embeddings
  np.testing.assert_allclose(got, np.asarray(want), rtol=1e-6, atol=1e-6)
  assert task.num_truncated_prompts == 2 and 'were truncated' in caplog.text   # chats over 16 tokens
  # Records without stored embeddings are encoded on the fly, and the built-in prompts too.
  cond, _ = task.from_records(dict(sample=np.zeros((2,) + task.sample_shape, np.float32),
                                   prompt=prompts), key=np.zeros((2,), np.uint32))
  np.testing.assert_allclose(np.asarray(cond['text']), got, rtol=1e-6, atol=1e-6)
  assert task.prompt_embeddings().shape == (8, 16, 32)


def test_reason1_settings_that_cannot_work_are_named(encoder_folder):
  with pytest.raises(ValueError, match=r"config.cosmos.text='reason1' needs config.cosmos.text_encoder"):
    _task(text='reason1').encode_prompts(['x'])
  with pytest.raises(ValueError, match=r"gives 32-wide embeddings \(2 layers x 16\); the DiT takes 48"):
    task = _task(text='reason1', text_encoder=encoder_folder,
                 dit_overrides=dict(crossattn_in=48))
    task.encode_prompts(['x'])
  with pytest.raises(ValueError, match=r"config.cosmos.text='t5'; known: \('reason1', 'bytes'\)"):
    _task(text='t5')


def test_batch_metrics_count_text_and_image_to_video_groups():
  task = _task()
  assert task.batch_metrics(dict(num_cond=np.asarray([0, 1, 1, 0, 1]))) == dict(cond_i2v=3.0, cond_t2v=2.0)
