"""The console: informational lines at INFO (shown by the CLIs) and WARNING only for what is wrong, no
orbax chatter on a checkpoint load, a progress-bar pace without the first iteration's compile, and the
end-of-run summary table."""
import logging
import re
import shutil
import time

from absl import flags
from absl import logging as absl_logging
import jax
import pytest
from test_trainer import small_config  # tests/test_trainer.py

from ddrl_jax import console
from ddrl_jax import resume
from ddrl_jax import trainer as trainer_lib

ORBAX_CHATTER = 'could not be restored'


# ------------------------------------------------------------------------------------------- levels
@pytest.fixture
def restore_levels():
  """Puts back the levels console.setup() changes."""
  loggers = [logging.getLogger(name) for name in ('', 'absl', console.LOGGER)]
  levels, verbosity = [log.level for log in loggers], flags.FLAGS['verbosity'].value
  yield
  flags.FLAGS['verbosity'].value = verbosity
  for log, level in zip(loggers, levels):
    log.setLevel(level)


def test_setup_shows_ddrl_jax_info_and_hides_other_libraries_info(restore_levels):  # pylint: disable=unused-argument,redefined-outer-name
  console.setup()
  assert logging.getLogger('ddrl_jax.trainer').isEnabledFor(logging.INFO)
  assert not logging.getLogger('ddrl_jax.trainer').isEnabledFor(logging.DEBUG)
  for other in ('absl', 'some_library'):     # orbax logs through absl
    assert not logging.getLogger(other).isEnabledFor(logging.INFO), other
    assert logging.getLogger(other).isEnabledFor(logging.WARNING), other
  assert absl_logging.get_verbosity() == absl_logging.WARNING


def _quick_iterations(trainer, first_s, then_s):
  """Replaces the trainer's iterations and evaluation by stand-ins taking `first_s` seconds (the first
  iteration: the compile) and `then_s` (the others): the console, not the training, is under test."""
  calls = []

  def train_iteration(it):
    time.sleep(first_s if not calls else then_s)
    calls.append(it)
    trainer.state = trainer.state._replace(step=trainer.state.step + 1)     # what it checkpoints
    return dict(loss=1.0, params_finite=1.0, nonfinite_grads=0.0, reward_mean=0.5)

  trainer.train_iteration = train_iteration
  trainer.evaluate = lambda it: {'eval/reward': 0.25}


def test_a_resumed_run_logs_news_at_info_and_its_pace_leaves_out_the_first_iteration(trained, tmp_path,
                                                                                      caplog, capsys):
  """Resuming the `trained` workdir for 6 more iterations: resuming, a safe config change, the sharding
  and throughput lines and the start-up costs are INFO; nothing is wrong, so nothing is a WARNING;
  orbax's 'could not be restored' is not said; the progress bar's s/it is that of the iterations after
  the first."""
  workdir = tmp_path / 'run'
  shutil.copytree(trained, workdir)
  caplog.set_level(logging.INFO, logger=console.LOGGER)
  trainer = trainer_lib.Trainer(small_config('ddrl', num_iterations=10), workdir, devices=jax.devices()[:1])
  _quick_iterations(trainer, first_s=1.0, then_s=0.01)
  metrics = trainer.train(progress=True)
  ours = [r for r in caplog.records if r.name.startswith('ddrl_jax')]
  for words in ('resuming', 'num_iterations changed: 4 -> 10', 'sharding: 1 cpu device(s) (cpu); mesh',
                'throughput:',
                'first iteration'):
    found = [r for r in ours if words in r.getMessage()]
    assert found and all(r.levelno == logging.INFO for r in found), (words, caplog.text)
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
  assert ORBAX_CHATTER not in caplog.text
  # The start-up line names the first iteration alone (a resumed run has no step-0 evaluation).
  line = next(r.getMessage() for r in ours if 'first iteration' in r.getMessage())
  assert line == console.startup_line(trainer.pace.first_s)
  assert trainer.pace.first_s >= 1.0 and trainer.pace.after_first == 5
  assert trainer.pace.seconds_per_iteration < 0.5
  bar = capsys.readouterr().err.replace('\r', '\n').splitlines()
  last = [b for b in bar if '10/10' in b][-1]
  assert float(re.search(r'\[[0-9:]+, ([0-9.e-]+) s/it, ', last).group(1)) < 0.5, last
  summary = trainer.run_summary()
  assert summary['evaluation'] == {'step': 10, 'eval/reward': 0.25}
  assert summary['checkpoint'] == str(workdir / 'checkpoints' / '10')
  table = console.summary_table(metrics, trainer.workdir, **summary)
  assert f'summary of {workdir}:' in table and 'eval/reward  0.25' in table


def test_orbax_unregistered_item_warning_is_hidden_only_in_the_checkpoint_load(trained, tmp_path,
                                                                                caplog):
  workdir = tmp_path / 'run'
  shutil.copytree(trained, workdir)
  caplog.set_level(logging.WARNING)
  trainer = trainer_lib.Trainer(small_config('ddrl', num_iterations=4), workdir, devices=jax.devices()[:1])
  assert trainer.restore_or_init(read_only=True) == 4     # evaluate.py's load
  assert ORBAX_CHATTER not in caplog.text
  # Outside the load orbax still says it: the filter is narrow, and this test would see the message.
  resume.RunCheckpoints(workdir, trainer.config).manager.item_metadata(4)
  assert f'Item "config" was found in the checkpoint, but {ORBAX_CHATTER}' in caplog.text


def test_hidden_drops_only_matching_records_inside_the_block(caplog):
  log = logging.getLogger('ddrl_jax.test_console')
  caplog.set_level(logging.WARNING)
  with console.hidden('ddrl_jax.test_console', 'noise %s'):
    log.warning('noise %s', 1)
    log.warning('signal %s', 2)
  log.warning('noise %s', 3)
  assert [r.getMessage() for r in caplog.records] == ['signal 2', 'noise 3']


# --------------------------------------------------------------------------------------------- pace
def test_pace_leaves_the_first_iteration_out_of_the_rate_and_eta():
  pace = console.Pace(remaining=10)
  assert pace.seconds_per_iteration is None and pace.eta_s is None and pace.text() == ''
  pace.done(0.0, 300.0)                 # compile: 5 minutes
  assert pace.first_s == 300.0 and pace.seconds_per_iteration is None and pace.text() == ''
  pace.done(300.0, 302.0)
  pace.done(302.0, 305.0)               # a gap between iterations (an evaluation) counts
  assert pace.after_first == 2 and pace.remaining == 7
  assert pace.seconds_per_iteration == pytest.approx(2.5)
  assert pace.eta_s == pytest.approx(17.5)
  assert pace.text() == '2.5 s/it, 17.5 s left'


def test_duration_and_startup_line():
  assert console.duration(41.23) == '41.2 s'
  assert console.duration(75) == '1 min 15 s'
  assert console.duration(5100) == '1 h 25 min'
  assert console.startup_line(41.23, 12.3) == ('first iteration 41.2 s (compile included); step-0 '
                                               'evaluation 12.3 s')
  assert console.startup_line(41.23) == 'first iteration 41.2 s (compile included)'


# ------------------------------------------------------------------------------------------ summary
def test_summary_table_shows_what_a_user_reads():
  metrics = dict(reward_mean=0.31416, loss=2.0, achieved_flops_per_s=2.5e10, mfu=0.123,
                 flops_per_iteration=1e10, **{f'k{i}': i for i in range(30)})
  evaluation = {'step': 200, 'eval/ocr': 0.8123, 'eval/ocr_rapid': 0.7, 'eval/reward': 0.1,
                'eval_ema/ocr': 0.83}
  table = console.summary_table(metrics, '/w', evaluation=evaluation, seconds_per_iteration=1.234,
                                first_iteration_s=41.2, checkpoint='/w/checkpoints/200',
                                samples='/w/samples/eval_000200.png')
  lines = table.splitlines()
  assert lines[0] == 'summary of /w:'
  assert [line.split()[0] for line in lines[1:]] == ['reward', 'eval/ocr', 's/iteration', 'GFLOP/s',
                                                     'checkpoints', 'metrics', 'samples']
  assert lines[1].split()[1] == '0.3142'
  assert lines[2].split()[1] == '0.8123' and 'step 200' in lines[2] and 'EMA parameters: 0.83' in lines[2]
  assert lines[3].split()[1] == '1.23' and '41.2 s, compile included' in lines[3]
  assert lines[4].split()[1] == '25' and 'MFU 12.30%' in lines[4]
  assert lines[5].split()[1] == '/w/checkpoints/200'
  assert '/w/metrics.jsonl' in lines[6] and '/w/tensorboard' in lines[6]
  assert lines[7].split()[1] == '/w/samples/eval_000200.png'
  assert 'k17' not in table and 'loss' not in table       # the full row stays in metrics.jsonl
  assert len({line.index(line.split()[1]) for line in lines[1:5]}) == 1      # one column of values


def test_summary_table_without_evaluation_throughput_or_samples():
  table = console.summary_table(dict(reward_mean=0.5), '/w')
  names = [line.split()[0] for line in table.splitlines()[1:]]
  assert names == ['reward', 's/iteration', 'GFLOP/s', 'checkpoints', 'metrics']
  assert 'the task counts no FLOPs' in table and 'one iteration only' in table
  table = console.summary_table(dict(reward_mean=0.5, flops_per_iteration=1.0), '/w',
                                evaluation={'step': 4, 'eval/sw_to_data': 0.2, 'eval/reward': 0.3},
                                first_iteration_s=3.0)
  assert 'eval/reward' in table and 'sw_to_data' not in table      # eval/reward before other metrics
  assert 'not measured on a first iteration' in table and 'one iteration only (3 s, compile' in table
  assert console.held_out_key({'step': 1, 'eval/b': 1.0, 'eval/a': 2.0}) == 'eval/a'
  assert console.held_out_key({'step': 1}) is None
