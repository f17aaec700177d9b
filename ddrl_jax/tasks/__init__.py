"""Self-contained experiments that plug into the generic trainer through `config.task`.

A task provides conditions, paired data, reward and evaluation, and holds its model family
(`ddrl_jax.models.family`); `base.Task` is the interface, `base.FamilyTask` the base class. The library
core (sampling, rl) never imports a task; the trainer finds one by name.
"""
import importlib


def task_class(config):
  """The class `ddrl_jax.tasks.<config.task>.TASK`."""
  from ddrl_jax import moved_keys  # pylint: disable=g-import-not-at-top
  moved = moved_keys.task_message(config.task)
  if moved:
    from ddrl_jax import cli  # pylint: disable=g-import-not-at-top
    raise cli.UsageError(moved, 'configs/sd35m.py and configs/wan_common.py show the new layout')
  try:
    module = importlib.import_module(f'ddrl_jax.tasks.{config.task}')
  except ModuleNotFoundError as e:
    raise ValueError(f'config.task={config.task!r}: no module ddrl_jax.tasks.{config.task}') from e
  return module.TASK


def get_task(config):
  """Instantiates `ddrl_jax.tasks.<config.task>.TASK(config)`."""
  return task_class(config)(config)


def get_family(config):
  """The run's model family (config.model_family, or the task's default), without building the task."""
  from ddrl_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top
  return family_lib.from_config(config, default=task_class(config).DEFAULT_FAMILY)
