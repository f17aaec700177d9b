"""The prompt task (ddrl_jax/tasks/prompt_task.py) on any family with a pipeline: the same task config runs
with SD3 and with Wan by changing config.model_family; the moved task names and keys answer in one line
with their new places; checkpoints of the old layout compare equal to the new one."""
import os
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from configs import sd35m
from configs import wan1_3b
from ddrl_jax import checkpoints
from ddrl_jax import cli
from ddrl_jax import moved_keys
from ddrl_jax import tasks
from ddrl_jax import trainer as trainer_lib
from ddrl_jax import metrics as metrics_lib
from ddrl_jax.tasks import prompt_task

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _both_families(family):
  """SD3's OCR smoke config with Wan's model section beside its own, running `family`: only the model
  keys (model_family, the LoRA targets, which name the model's layers) differ between the two runs."""
  c = sd35m.get_config('flow_grpo_smoke')
  w = wan1_3b.get_config('flow_grpo_smoke')
  c.wan = w.wan
  c.sharding.rules.update(dict(w.sharding.rules))
  c.model_family = family
  if family == 'wan':
    c.lora = w.lora
    c.reward.kwargs = w.reward.kwargs
  return c


@pytest.mark.parametrize('family', ['sd3', 'wan'])
def test_one_prompt_task_serves_both_families(family):
  task = tasks.get_task(_both_families(family))
  assert isinstance(task, prompt_task.PromptTask) and task.family.name == family
  cond = task.conditions(jax.random.key(0), 2)
  fields = {'sd3': {'text', 'pooled'}, 'wan': {'text'}}[family]
  assert set(cond) == fields | {f'null_{f}' for f in fields} | {'guidance', 'index'}
  assert {k: v.shape for k, v in task.abstract_conditions(2).items()} == {k: v.shape for k, v in cond.items()}
  media, finite = task.decode(np.zeros((2,) + task.sample_shape, np.float32))
  want = {'sd3': (2, 64, 64, 3), 'wan': (2, 5, 32, 32, 3)}[family]
  assert media.shape == want and media.dtype == np.uint8 and finite.all()
  assert task.prompts(cond) == [task.train_prompts[i] for i in np.asarray(cond['index'])]


@pytest.mark.slow
@pytest.mark.parametrize('family', ['sd3', 'wan'])
def test_the_same_task_config_trains_with_either_family(family, tmp_path):
  c = _both_families(family)
  c.num_iterations = 1
  c.eval_every = 1
  trainer = trainer_lib.Trainer(c, str(tmp_path / 'run'), devices=jax.devices()[:1])
  trainer.train(progress=False)
  rows = metrics_lib.read_metrics(tmp_path / 'run')
  assert any(np.isfinite(r.get('loss', np.nan)) for r in rows)
  assert any('eval/ocr' in r for r in rows)
  assert any('eval/temporal_smoothness' in r for r in rows) == (family == 'wan')


def test_a_family_without_a_pipeline_is_named():
  c = sd35m.get_config('flow_grpo_smoke')
  from configs import ocr_tiny  # pylint: disable=g-import-not-at-top
  c.ocr = ocr_tiny.get_config().ocr
  c.model_family = 'cosmos_t2i'
  with pytest.raises(ValueError, match="model_family='cosmos_t2i': the prompt task needs a family with a "
                     'text-to-media pipeline'):
    tasks.get_task(c)


@pytest.mark.parametrize('task', sorted(moved_keys.MOVED_TASKS))
def test_a_moved_task_name_says_where_it_went(task):
  c = ml_collections.ConfigDict(dict(task=task))
  with pytest.raises(cli.UsageError, match=f"config.task='{task}' is now config.task='prompt_task' with "
                     f"config.model_family='{moved_keys.MOVED_TASKS[task]}'"):
    tasks.task_class(c)


def test_moved_keys_map_to_the_prompt_section():
  assert moved_keys.new_place('sd3.prompts') == 'prompt.prompts'
  assert moved_keys.new_place('wan.guidance_eval') == 'prompt.guidance_eval'
  assert moved_keys.new_place('sd3.resolution') is None and moved_keys.new_place('prompt.prompts') is None


def _old_layout(config):
  """A config dict as main wrote it before the prompt task: task 'sd3_ocr'/'wan_t2v', model_family '',
  the prompt keys inside the model's section."""
  d = config.to_dict()
  family = d['model_family']
  old = {v: k for k, v in moved_keys.MOVED_TASKS.items()}[family]
  d['task'], d['model_family'] = old, ''
  prompt = d.pop('prompt')
  for key in ('prompts_required', 'prompts_source'):     # set only by the image-reward recipes then
    if prompt[key] in (False, ''):
      del prompt[key]
  d[family].update(prompt)
  return d


@pytest.mark.parametrize('module,preset', [(sd35m, 'ddrl_smoke'), (wan1_3b, 'flow_grpo_smoke')])
def test_a_checkpoint_of_the_old_layout_compares_equal(module, preset):
  current = module.get_config(preset)
  assert checkpoints.config_differences(_old_layout(current), current.to_dict()) == ([], [])
  changed = module.get_config(preset)
  changed.prompt.num_eval_prompts += 1          # a real difference is still one
  _, unsafe = checkpoints.config_differences(_old_layout(current), changed.to_dict())
  assert [k for k, _, _ in unsafe] == ['prompt.num_eval_prompts']


def test_a_moved_key_on_the_command_line_names_its_new_place(tmp_path):
  run = subprocess.run([sys.executable, '-m', 'ddrl_jax.train', '--config=configs/sd35m.py:flow_grpo_smoke',
                        '--config.sd3.prompts=my_prompts.txt', f'--workdir={tmp_path / "run"}'], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert run.returncode == 2, run.stderr[-2000:]
  errors = [l for l in run.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and 'config.sd3.prompts moved to config.prompt.prompts' in errors[0], run.stderr
  assert 'Traceback' not in run.stderr and not os.path.exists(tmp_path / 'run')
