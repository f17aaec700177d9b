"""DDRL on the base model's own samples without a manual step (config.data.base_samples): the trainer
samples them into its workdir before the first update, a killed synthesis resumes shard by shard to the
same records, and the records are the base model's (equal to data.synthesize's on the same plan)."""
import json
import os

import numpy as np
import pytest
from test_trainer import small_config  # tests/test_trainer.py

from ddrl_jax import cli
from ddrl_jax import config as config_lib
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.data import records as records_lib
from ddrl_jax.data import synthesis
from ddrl_jax.data import synthesize


def _base_config(num=24, **overrides):
  c = small_config('ddrl', num_iterations=2, eval_every=-1, **overrides)
  c.data.base_samples = num
  return c


def _samples(path):
  return np.stack([r['sample'] for r in records_lib.read_all(path)])


class _Killed(Exception):
  pass


def _write(trainer, out, todo, sample_fn, **kw):
  return synthesis.write_samples(trainer.task, sample_fn, trainer_lib.model_params(trainer.state),
                                 trainer.mesh, str(out), todo, seed=3, batch=8, records_per_shard=8,
                                 described=dict(model='test'), progress=False, **kw)


def _sample_fn(trainer):
  return trainer_lib.make_sample_fn(trainer_lib.make_eval_sampler(trainer.config), trainer.apply_fn,
                                    trainer.task.sample_shape, trainer.mesh, plan=trainer.plan)


def test_a_killed_synthesis_resumes_to_the_same_records(tmp_path):
  trainer = trainer_lib.Trainer(_base_config(), tmp_path / 'run')
  trainer.restore_or_init()
  todo = synthesis.prompts_round_robin(trainer.task.prompt_set(), 20)
  real = _sample_fn(trainer)
  whole = _write(trainer, tmp_path / 'whole', todo, real)
  assert whole['num_records'] == 20 and len(whole['shards']) == 3 and whole['resumed_samples'] == 0

  calls = []

  def dies_in_the_second_shard(*args):
    calls.append(1)
    if len(calls) == 2:
      raise _Killed()
    return real(*args)

  with pytest.raises(_Killed):
    _write(trainer, tmp_path / 'killed', todo, dies_in_the_second_shard)
  left = sorted(os.listdir(tmp_path / 'killed'))
  assert left == ['data-00000-of-00003.array_record', synthesis.PROGRESS]   # no partial, no manifest
  assert not synthesis.is_complete(tmp_path / 'killed')
  again = _write(trainer, tmp_path / 'killed', todo, real)
  assert again['resumed_samples'] == 8 and again['num_records'] == 20
  np.testing.assert_array_equal(_samples(str(tmp_path / 'killed')), _samples(str(tmp_path / 'whole')))
  # A finished set is returned as it is; another plan in the same folder is refused, naming the change.
  assert _write(trainer, tmp_path / 'whole', todo, real)['num_records'] == 20
  with pytest.raises(synthesis.PlanMismatch, match='num_samples: 20 -> 12'):
    _write(trainer, tmp_path / 'killed', todo[:12], real)
  calls.clear()
  with pytest.raises(synthesis.PlanMismatch, match='seed: 3 -> 4'):     # a killed one, too
    with pytest.raises(_Killed):
      _write(trainer, tmp_path / 'half', todo, dies_in_the_second_shard)
    synthesis.write_samples(trainer.task, real, trainer_lib.model_params(trainer.state), trainer.mesh,
                            str(tmp_path / 'half'), todo, seed=4, batch=8, records_per_shard=8,
                            described=dict(model='test'), progress=False)


def test_shards_of_unknown_origin_are_not_overwritten(tmp_path):
  records_lib.write_shards([dict(prompt='', sample=np.zeros(2, np.float32))], str(tmp_path / 'd'))
  trainer = trainer_lib.Trainer(_base_config(), tmp_path / 'run')
  trainer.restore_or_init()
  with pytest.raises(synthesis.PlanMismatch, match='not written by a synthesis'):
    _write(trainer, tmp_path / 'd', [''] * 4, _sample_fn(trainer))


def test_first_run_samples_the_base_then_trains_on_them_and_resumes(tmp_path):
  c = _base_config(num=24)
  run = tmp_path / 'run'
  trainer = trainer_lib.Trainer(c, run)
  assert trainer.loader is None and trainer.base_samples_dir == str(run / 'base_samples')
  trainer.train(progress=False)
  manifest = records_lib.read_manifest(str(run / 'base_samples'))
  assert manifest['num_records'] == 24 and manifest['extra']['plan']['model'] == 'initial'
  rows = [r for r in metrics_lib.read_metrics(run) if 'loss' in r]
  assert [r['data_records_seen'] for r in rows] == [8, 16]       # one record per group, from them
  # They are the base model's samples: data.synthesize's (a separate Trainer, replicated parameters)
  # of the initial model with the evaluation sampler on the same plan.
  synthesize.synthesize(c, str(tmp_path / 'cli'), num=24, batch=c.batch_size * c.num_rollouts, seed=c.seed,
                        progress=False)
  np.testing.assert_allclose(_samples(str(tmp_path / 'cli')), _samples(str(run / 'base_samples')),
                             rtol=1e-6, atol=1e-6)
  # The toy base is its 4-mode mixture, not noise.
  assert np.abs(_samples(str(run / 'base_samples'))).mean() > 0.8
  # Resuming reads them again (nothing is re-sampled) and continues their stream.
  stamp = os.path.getmtime(run / 'base_samples' / synthesis.PROGRESS)
  c.num_iterations = 3
  resumed = trainer_lib.Trainer(c, run)
  assert resumed.loader is not None
  resumed.train(progress=False)
  assert os.path.getmtime(run / 'base_samples' / synthesis.PROGRESS) == stamp
  last = [r for r in metrics_lib.read_metrics(run) if 'loss' in r][-1]
  assert last['step'] == 3 and last['data_records_seen'] == 24


def test_base_samples_gone_after_training_started_is_one_clear_error(tmp_path):
  c = _base_config(num=16)
  run = tmp_path / 'run'
  trainer_lib.Trainer(c, run).train(progress=False)
  os.remove(run / 'base_samples' / records_lib.MANIFEST)
  with pytest.raises(cli.UsageError, match='no longer the base'):     # one line from the CLI
    trainer_lib.Trainer(c, run).train(progress=False)


def test_base_samples_only_where_a_data_term_needs_them(tmp_path):
  c = small_config('flow_grpo')
  c.data.base_samples = 8
  assert trainer_lib.Trainer(c, tmp_path / 'a').base_samples_dir is None       # no data term
  c = _base_config()
  records_lib.write_shards([dict(prompt='', sample=np.zeros(2, np.float32))] * 8, str(tmp_path / 'records'))
  c.data.path = str(tmp_path / 'records')
  assert trainer_lib.Trainer(c, tmp_path / 'b').base_samples_dir is None       # records given
  c = _base_config()
  c.data.base_samples_dir = 'gs://bucket/samples'
  with pytest.raises(config_lib.ConfigError, match='config.data.base_samples_dir'):
    trainer_lib.Trainer(c, tmp_path / 'c')
  c = _base_config(num=-1)
  with pytest.raises(config_lib.ConfigError, match='config.data.base_samples'):
    config_lib.validate(c, 1)


def test_progress_file_counts_every_shard(tmp_path):
  trainer = trainer_lib.Trainer(_base_config(), tmp_path / 'run')
  trainer.restore_or_init()
  todo = synthesis.prompts_round_robin(['a', 'b', 'c'], 10)
  assert todo[:4] == ['a', 'b', 'c', 'a']
  _write(trainer, tmp_path / 'out', todo, _sample_fn(trainer))
  with open(tmp_path / 'out' / synthesis.PROGRESS) as f:
    progress = json.load(f)
  assert [v['records'] for _, v in sorted(progress['shards'].items())] == [8, 2]
  assert progress['plan']['num_samples'] == 10 and progress['plan']['seed'] == 3
