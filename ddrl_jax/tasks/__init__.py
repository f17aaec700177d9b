"""Self-contained experiments that plug into the generic trainer through `config.task`.

A task provides the model, conditions, paired data, reward and evaluation; see `toy2d.Toy2D` for the
interface. The library core (sampling, rl) never imports a task; the trainer finds one by name.
"""
import importlib


def get_task(config):
  """Instantiates `ddrl_jax.tasks.<config.task>.TASK(config)`."""
  try:
    module = importlib.import_module(f'ddrl_jax.tasks.{config.task}')
  except ModuleNotFoundError as e:
    raise ValueError(f'config.task={config.task!r}: no module ddrl_jax.tasks.{config.task}') from e
  return module.TASK(config)
