"""benchmarks/gpu_step.py, the one-device DDRL iteration benchmark, run in-process at --tiny size on the
CPU."""
import importlib.util
import json
import math
import os

import jax
import pytest

from ddrl_jax import tasks

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks',
                     'gpu_step.py')


@pytest.fixture(scope='module')
def gpu_step():
  spec = importlib.util.spec_from_file_location('gpu_step', _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_tiny_run_prints_one_json_line_with_positive_times(gpu_step, capsys):
  report = gpu_step.main(['--tiny', '--iterations=1'])
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 1 and json.loads(lines[0]) == json.loads(json.dumps(report))
  assert 'error' not in report, report.get('error')
  for key in ('device_kind', 'platform', 'shape', 'compile_s', 'aot_bytes', 'peak_bytes', 'memory_source',
              'flops_per_iteration', 'flops_breakdown', 'achieved_flops_per_s', 'peak_flops_per_s',
              'time_rollout_s', 'time_data_grad_s', 'time_update_s', 'time_iteration_s',
              'iterations_timed', 'warmup_excluded', 'stopped_early', 'wall_s', 'loss_finite'):
    assert key in report, key
  assert report['platform'] == 'cpu' and report['device_kind'] == 'cpu'
  for key in ('time_rollout_s', 'time_data_grad_s', 'time_update_s', 'time_iteration_s',
              'achieved_flops_per_s', 'peak_bytes', 'flops_per_iteration'):
    assert math.isfinite(report[key]) and report[key] > 0, key
  assert report['time_iteration_s'] == pytest.approx(
      report['time_rollout_s'] + report['time_data_grad_s'] + report['time_update_s'], rel=0.5)
  assert report['iterations_timed'] == 1 and report['warmup_excluded'] and not report['stopped_early']
  assert report['peak_flops_per_s'] is None and 'mfu' not in report         # no peak for a CPU
  assert report['memory_source'] == 'memory_analysis'
  assert report['loss_finite'] and report['nfe_rollout'] == 5               # T = 4 + cosmos' clean call
  # Per slot: 5 rollout calls + 3 x 2 trained steps (policy) + 3 x 2 (data term, 'full').
  shape = report['shape']
  assert shape['train_steps'] == [0, 2] and shape['groups'] * shape['rollouts'] == 2
  assert report['flops_per_iteration'] == pytest.approx(17 * 2 * report['forward_flops_per_sample'])
  f = 2 * report['forward_flops_per_sample']                      # 2 slots
  assert report['flops_breakdown'] == pytest.approx(dict(rollout=5 * f, policy=6 * f, reference=0,
                                                         data=6 * f))
  # One timed iteration: its parts add up to it, and the throughput is its FLOPs over its time.
  assert report['time_iteration_s'] == pytest.approx(
      report['time_rollout_s'] + report['time_data_grad_s'] + report['time_update_s'], rel=1e-9)
  assert report['achieved_flops_per_s'] == pytest.approx(
      report['flops_per_iteration'] / report['time_iteration_s'], rel=1e-9)
  # XLA's bytes: the peak is the largest function's; the update's arguments hold the train state (the
  # parameters, their EMA and Adam's two moments, float32).
  assert report['peak_bytes'] == max(report['aot_bytes'].values())
  config = gpu_step.make_config(gpu_step.parse_args(['--tiny']), 'cpu')
  _, abstract = tasks.get_task(config).abstract_params(jax.random.key(0))
  param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
  assert report['aot_bytes']['update'] > 4 * param_bytes > 0, (report['aot_bytes'], param_bytes)


def test_budget_stops_before_the_runs_and_still_reports(gpu_step, capsys):
  report = gpu_step.main(['--tiny', '--budget_s=0'])
  capsys.readouterr()
  assert report['stopped_early'] and 'error' not in report
  assert 'compile_s' not in report and 'time_iteration_s' not in report
  assert report['shape']['model'] == 'tiny'



def test_no_accelerator_is_a_clear_error(gpu_step, capsys):
  report = gpu_step.main([])
  assert json.loads(capsys.readouterr().out)['error'] == report['error']
  assert 'no accelerator' in report['error'] and "'cpu'" in report['error'] and '--tiny' in report['error']


def test_shape_flags_are_checked(gpu_step):
  assert gpu_step.latent_shape(29, 480, 832) == (8, 60, 104)
  assert gpu_step.latent_shape(93, 720, 1280) == (24, 90, 160)      # the recipe's latent
  with pytest.raises(ValueError, match='--frames=30'):
    gpu_step.latent_shape(30, 480, 832)
  with pytest.raises(ValueError, match='--height=100'):
    gpu_step.latent_shape(29, 100, 832)
  assert gpu_step.parse_steps('', 20) == tuple(range(0, 19, 2))
  with pytest.raises(ValueError, match='--train_steps'):
    gpu_step.parse_steps('0,x', 20)
  with pytest.raises(SystemExit):
    gpu_step.parse_args(['--topology=v5p-8'])                         # compile-only targets only


@pytest.mark.slow
@pytest.mark.parametrize('spec,family', [('configs/sd35m.py:flow_grpo_smoke', 'sd3'),
                                         ('configs/flux1_dev.py:flow_grpo_smoke', 'flux')])
def test_another_family_runs_through_config(gpu_step, capsys, spec, family):
  """--config takes any family's recipe (SD3.5 and FLUX with LoRA: adapters trained, the base frozen)."""
  report = gpu_step.main([f'--config={spec}', '--tiny', '--iterations=1'])
  capsys.readouterr()
  assert 'error' not in report, report.get('error')
  assert report['shape']['family'] == family and report['shape']['lora_rank'] == 4
  assert report['loss_finite'] and report['time_iteration_s'] > 0
