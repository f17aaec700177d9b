"""CLI: python -m ddrl_jax.train --config=configs/toy2d.py[:preset] --workdir=DIR [--config.key=value ...]

Rerunning with the same workdir resumes from its latest checkpoint.
"""
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from ddrl_jax import trainer as trainer_lib

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file (get_config(arg)).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and samples go here.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  metrics = trainer_lib.Trainer(_CONFIG.value, _WORKDIR.value).train()
  if metrics:
    print('final: ' + ' '.join(f'{k}={v:.4g}' for k, v in sorted(metrics.items())))


if __name__ == '__main__':
  app.run(main)
