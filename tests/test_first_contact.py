"""First contact with the full-size presets: without converted weights (or DDRL's records) every family's
full preset stops before anything is built, in one line naming each missing input and the command that
makes it; `:smoke` presets and `--config.require_inputs=False` (random weights on purpose) go on."""
import os
import subprocess
import sys

import pytest

from configs import cosmos2b
from configs import flux1_dev
from configs import sd35m
from configs import wan1_3b
from ddrl_jax import preflight
from ddrl_jax import tasks
from ddrl_jax import trainer as trainer_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (config spec, get_config, arg, the keys its missing-input line must name)
FULL = [
    ('configs/sd35m.py:flow_grpo', sd35m.get_config, 'flow_grpo',
     ('config.sd3.checkpoint', 'config.sd3.vae_checkpoint', 'config.sd3.text_encoders',
      '--model=sd35_medium', '--model=sd35_vae')),
    ('configs/sd35m.py:ddrl', sd35m.get_config, 'ddrl',
     ('config.sd3.checkpoint', 'config.sd3.vae_checkpoint')),
    ('configs/wan1_3b.py:flow_grpo', wan1_3b.get_config, 'flow_grpo',
     ('config.wan.checkpoint', 'config.wan.vae_checkpoint', 'config.wan.text_encoder', '--model=wan1_3b',
      '--model=wan21_vae')),
    ('configs/cosmos2b.py', cosmos2b.get_config, '',
     ('config.cosmos.checkpoint', 'config.cosmos.text_encoder', 'config.data.path')),
    ('configs/flux1_dev.py:dance_grpo', flux1_dev.get_config, 'dance_grpo',
     ('config.flux.checkpoint', 'config.flux.vae_checkpoint', 'config.flux.text_encoders',
      '--model=flux1_dev', '--model=flux1_vae', 'config.reward.kwargs.hpsv21.checkpoint',
      'config.prompt.prompts')),
]


@pytest.mark.parametrize('spec, get_config, arg, keys', FULL, ids=[f[0] for f in FULL])
def test_full_presets_name_every_missing_input_before_building(spec, get_config, arg, keys, tmp_path):
  config = get_config(arg) if arg else get_config()
  assert config.require_inputs
  with pytest.raises(preflight.MissingInputs) as e:
    trainer_lib.Trainer(config, str(tmp_path / 'run'))
  text = str(e.value)
  assert '\n' not in text and not os.path.exists(tmp_path / 'run')
  for key in keys:
    assert key in text, (key, text)
  if 'cosmos' not in spec:
    assert 'config.data.path' not in text   # DDRL's base samples are made by the trainer (data.base_samples)
  smoke = get_config((arg + '_smoke') if arg else 'smoke')
  assert not smoke.require_inputs
  import jax  # pylint: disable=g-import-not-at-top
  devices = jax.devices()[:smoke.batch_size * smoke.num_rollouts]
  trainer_lib.Trainer(smoke, str(tmp_path / 'smoke'), devices=devices)   # tiny random models: no stop
  config.require_inputs = False                                   # random weights on purpose: no stop
  assert tasks.get_task(config) is not None
  preflight.check(config, tasks.get_task(config))


def test_ddrl_without_base_samples_names_both_ways_to_data(tmp_path):
  config = sd35m.get_config('ddrl')
  assert config.data.base_samples == config.num_iterations * config.batch_size == 7200
  config.data.base_samples = 0
  with pytest.raises(preflight.MissingInputs) as e:
    trainer_lib.Trainer(config, str(tmp_path / 'run'))
  text = str(e.value)
  assert 'config.data.path' in text and '--config.data.base_samples=<N>' in text
  assert 'python -m ddrl_jax.data.synthesize' in text


@pytest.mark.parametrize('spec', ['configs/sd35m.py:flow_grpo', 'configs/wan1_3b.py:dance_grpo'])
def test_train_cli_one_error_line(spec, tmp_path):
  run = subprocess.run([sys.executable, '-m', 'ddrl_jax.train', f'--config={spec}',
                        f'--workdir={tmp_path / "run"}'], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert run.returncode == 2, run.stderr[-2000:]
  errors = [l for l in run.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and 'needs inputs it was not given' in errors[0] and ':smoke' in errors[0]
  assert 'Traceback' not in run.stderr and not os.path.exists(tmp_path / 'run')


def test_a_family_without_its_config_section_is_one_line(tmp_path):
  run = subprocess.run([sys.executable, '-m', 'ddrl_jax.train', '--config=configs/sd35m.py:flow_grpo_smoke',
                        '--config.model_family=wan', f'--workdir={tmp_path / "run"}'], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert run.returncode == 2, run.stderr[-2000:]
  errors = [l for l in run.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and "config.model_family='wan': this config has no config.wan section" in errors[0]
  assert 'Traceback' not in run.stderr and not os.path.exists(tmp_path / 'run')


def test_lora_targets_that_match_nothing_are_one_line_and_leave_no_workdir(tmp_path):
  run = subprocess.run([sys.executable, '-m', 'ddrl_jax.train', '--config=configs/ocr_tiny.py',
                        '--config.lora.rank=4', "--config.lora.targets=('nomatch',)",
                        f'--workdir={tmp_path / "run"}'], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert run.returncode == 2, run.stderr[-2000:]
  errors = [l for l in run.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and "config.lora.targets ['nomatch'] match no dense layer" in errors[0]
  assert 'dit.blocks.self_attn.q_proj' in errors[0]           # the layers it could have named
  assert 'Traceback' not in run.stderr and not os.path.exists(tmp_path / 'run')


def test_a_train_state_larger_than_the_host_is_refused_before_building(tmp_path, monkeypatch):
  """The state's bytes per device, from shapes and shardings only: refused in one line naming the numbers
  and the options when the devices' share exceeds the memory; skip_memory_check builds anyway."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  config = cosmos2b.get_config('smoke')
  devices = jax.devices()[:1]
  config.mesh.data = 1
  trainer = trainer_lib.Trainer(config, str(tmp_path / 'run'), devices=devices)
  monkeypatch.setattr(trainer_lib, 'host_available_bytes', lambda: 1000)
  with pytest.raises(trainer_lib.MemoryCheckError) as e:
    trainer.restore_or_init()
  assert 'the train state alone needs' in e.value.what and 'GiB of host memory available' in e.value.what
  assert 'skip_memory_check' in e.value.fix and trainer.state is None
  # The per-device count: parameters (fp32), two Adam moments and the EMA, exactly 4 x the parameters
  # plus the optimizer's counters, computed independently from the parameter shapes.
  abstract = jax.eval_shape(lambda: trainer.task.init_model(jax.random.key(0))[1])
  params = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  config.skip_memory_check = True
  trainer2 = trainer_lib.Trainer(config, str(tmp_path / 'run2'), devices=devices)
  assert trainer2.restore_or_init() == 0
  measured = trainer_lib.state_bytes_per_device(
      jax.eval_shape(lambda s: s, trainer2.state), trainer2.state_shardings)
  assert 4 * params <= measured <= 4 * params + 4096, (measured, params)


def test_a_step_that_does_not_fit_is_refused_by_its_compiled_memory(tmp_path):
  """The step check compiles the loop's own functions for the run's devices (here 2 CPU devices):
  its peaks are aot's for the same config and devices, a memory limit below the largest peak is refused
  in one line naming each function over it, and the result is kept per config in the workdir."""
  import jax  # pylint: disable=g-import-not-at-top
  from ddrl_jax import aot  # pylint: disable=g-import-not-at-top
  config = sd35m.get_config('flow_grpo_smoke')
  config.mesh.data = 2
  devices = jax.devices()[:2]
  trainer = trainer_lib.Trainer(config, str(tmp_path / 'run'), devices=devices)
  trainer.restore_or_init()
  rows = trainer.check_step_memory(memory_bytes=2**40)
  assert [r['fn'] for r in rows] == list(aot.FUNCTIONS) and all(r['fits'] for r in rows)
  reference = {r['fn']: r['peak_bytes'] for r in aot.compile_report(config, 'cpu-2')}
  assert {r['fn']: r['peak_bytes'] for r in rows} == reference
  assert os.path.exists(tmp_path / 'run' / 'memory_check.json')
  largest = max(reference.values())
  with pytest.raises(trainer_lib.MemoryCheckError) as e:
    trainer.check_step_memory(memory_bytes=largest - 1)
  assert 'the step does not fit: per device' in e.value.what and 'skip_memory_check' in e.value.fix
  worst = max(reference, key=reference.get)
  assert f'{worst} is the largest' in e.value.what
  assert all((f'{fn} ' in e.value.what) == (peak > largest - 1) for fn, peak in reference.items())
  # The same config and memory again (a resumed run): the kept rows, nothing compiled.
  import unittest.mock  # pylint: disable=g-import-not-at-top
  with unittest.mock.patch.object(aot, 'compile_report', side_effect=AssertionError('compiled again')):
    assert trainer.check_step_memory(memory_bytes=2**40) == rows


def test_a_config_the_task_cannot_be_built_from_is_validated_first(tmp_path):
  """A full preset with an unknown algorithm: validate's one line naming the key, not a traceback from
  the input check that would need the algorithm."""
  config = sd35m.get_config('flow_grpo')
  config.algorithm = 'nope'
  from ddrl_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  with pytest.raises(config_lib.ConfigError, match="config.algorithm='nope': unknown algorithm"):
    trainer_lib.Trainer(config, str(tmp_path / 'run'))
