"""Before a run builds anything: are the inputs a full preset needs there (weights, data, reward models)?

A full-size preset (configs/cosmos2b.py and the like) sets `config.require_inputs = True`. Its task lists
what it needs (`Task.required_inputs`: converted weights, record shards, a text encoder, a prompt file),
and each reward with files checks them (`rewards.registry.input_problems`, with the local reward backend;
with the redis backend the reward servers check their own). One missing input stops the run with one
line naming every missing input, the key that sets it and the command that makes it:

  error: configs/cosmos2b.py needs inputs it was not given: config.cosmos.checkpoint (the converted DiT:
  python -m ddrl_jax.models.convert ...), ... (set them with --config.<key>=...; ':smoke' runs the whole
  path on tiny random models, and --config.require_inputs=False runs with random weights on purpose)

`:smoke` presets and the CPU configs set require_inputs = False. Nothing is loaded or built here.
"""
import dataclasses

from ddrl_jax import cli
from ddrl_jax import storage


@dataclasses.dataclass(frozen=True)
class Input:
  """One input of a run: `key` (dotted config key), its `value`, `what` it is, `how` to make it, and
  whether it names a path that must exist (`path`) or only must be set."""
  key: str
  value: str
  what: str
  how: str = ''
  path: bool = True

  def problem(self):
    """'' when the input is there, else one clause naming the key, what it is and how to make it."""
    value = str(self.value or '')
    how = f': {self.how}' if self.how else ''
    if not value:
      return f'config.{self.key} ({self.what}{how})'
    if self.path and not storage.exists(value):
      return f'config.{self.key}={value} does not exist ({self.what}{how})'
    return ''


class MissingInputs(cli.UsageError):
  """A run whose required inputs are missing (a UsageError: the CLIs print one line and exit 2)."""


# What a reader of a trained run (export_lora, synthesize, evaluate) does not need: the training data.
TRAINING_ONLY_KEYS = ('data.path', 'cosmos.eval_prompts')


def problems(config, task, model_only=False, skip=None):
  """One clause per missing input of the run: the task's, then the local rewards' files. model_only:
  the model's own inputs (weights, VAE, text encoders) only, for the CLIs that read a run; skip: a
  predicate on keys that this caller does not need."""
  inputs = [i for i in task.required_inputs() if not (model_only and i.key in TRAINING_ONLY_KEYS)
            and not (skip and skip(i.key))]
  out = [p for p in (i.problem() for i in inputs) if p]
  if config.reward.get('backend', 'local') == 'local' and not model_only:
    from ddrl_jax.rewards import registry  # pylint: disable=g-import-not-at-top
    kwargs = config.reward.get('kwargs') or {}
    for name in config.reward.fns:
      out += registry.input_problems(name, dict(kwargs.get(name) or {}))
  return out


def check(config, task, where='this config', model_only=False, skip=None):
  """Raises MissingInputs (one line) when config.require_inputs and an input is missing (of the model
  alone with `model_only`; none whose key `skip` accepts)."""
  if not config.get('require_inputs', False):
    return
  found = problems(config, task, model_only, skip)
  if found:
    raise MissingInputs(
        f'{where} needs inputs it was not given: ' + '; '.join(found),
        "set them with --config.<key>=...; ':smoke' runs the whole path on tiny random models, and "
        '--config.require_inputs=False runs without them on purpose (random weights)')


def check_model_then_skip(config, where='this config'):
  """For the CLIs that read a trained run: refuses (one line) a config whose model inputs are missing,
  then turns config.require_inputs off so the trainer they build does not ask for training data."""
  from ddrl_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from ddrl_jax import tasks  # pylint: disable=g-import-not-at-top
  try:
    task = tasks.get_task(config)
  except Exception:  # pylint: disable=broad-except  (a config the task cannot be built from: its key)
    import jax  # pylint: disable=g-import-not-at-top
    config_lib.validate(config, jax.device_count())
    raise
  check(config, task, where, model_only=True)
  config.require_inputs = False
