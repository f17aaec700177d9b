"""CLI: python -m ddrl_jax.train --config=configs/toy2d.py[:preset] --workdir=DIR [--config.key=value ...]

On a pod or cluster every process runs the same command; ddrl_jax.distributed joins them (detected
from Cloud TPU, SLURM, Kubernetes or Open MPI, or the --coordinator_address / --num_processes /
--process_id flags) before any device is touched. --compilation_cache_dir keeps compiled programs.

Rerunning with the same workdir resumes from its newest usable checkpoint. SIGTERM or SIGINT (Ctrl-C)
finishes the running iteration, saves a checkpoint and exits 0 with a line saying how to resume; a
second signal exits at once.
"""
from absl import app
from absl import flags
from ml_collections import config_flags

from ddrl_jax import cli
from ddrl_jax import config as config_lib
from ddrl_jax import console
from ddrl_jax import distributed
from ddrl_jax import trainer as trainer_lib
from ddrl_jax import xla_flags


def _define_flags():
  """Defined only when run as a script, so importing this module adds no global absl flags."""
  global _CONFIG, _WORKDIR
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file (get_config(arg)).',
                                            lock_config=True)
  _WORKDIR = flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and samples go here.')
  distributed.define_flags()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]} (flags are --name=value)')
  console.setup()          # ddrl_jax's INFO lines; orbax's (every save) hidden
  distributed.initialize(distributed.options_from_flags())      # before anything asks for devices
  with distributed.fail_fast():     # a failing host ends the job instead of leaving the others waiting
    trainer = trainer_lib.Trainer(_CONFIG.value, _WORKDIR.value)
    try:
      metrics = trainer.train()
    except (cli.UsageError, app.UsageError, config_lib.ConfigError):
      trainer.remove_new_workdir()   # a mistake found while building: no empty checkpoints/ left behind
      raise
  if trainer.stopped_by is None and metrics:
    print(console.summary_table(metrics, trainer.workdir, **trainer.run_summary()))


if __name__ == '__main__':
  xla_flags.apply()       # before any JAX backend starts
  _define_flags()
  cli.run(main, required=('config', 'workdir'))
