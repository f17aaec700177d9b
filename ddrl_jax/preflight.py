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


def problems(config, task):
  """One clause per missing input of the run: the task's, then the local rewards' files."""
  out = [p for p in (i.problem() for i in task.required_inputs()) if p]
  if config.reward.get('backend', 'local') == 'local':
    from ddrl_jax.rewards import registry  # pylint: disable=g-import-not-at-top
    kwargs = config.reward.get('kwargs') or {}
    for name in config.reward.fns:
      out += registry.input_problems(name, dict(kwargs.get(name) or {}))
  return out


def check(config, task, where='this config'):
  """Raises MissingInputs (one line) when config.require_inputs and an input is missing."""
  if not config.get('require_inputs', False):
    return
  found = problems(config, task)
  if found:
    raise MissingInputs(
        f'{where} needs inputs it was not given: ' + '; '.join(found),
        "set them with --config.<key>=...; ':smoke' runs the whole path on tiny random models, and "
        '--config.require_inputs=False runs without them on purpose (random weights)')
