"""Registered rewards used as evaluation judges (`python -m ddrl_jax.evaluate --judges=...`, the paper's
Table 4 beside OCR, the video evaluation's VideoAlign/VBench columns): names checked against the registry
and each judge's files checked before anything is built, each built from config.reward.kwargs.<name>."""
from ddrl_jax import cli
from ddrl_jax import preflight
from ddrl_jax.rewards import registry


def check_names(names, where):
  """Raises one line naming the judges that are not registered rewards (`where`: the flag or key)."""
  unknown = [n for n in names if n not in registry.known_rewards()]
  if unknown:
    raise cli.UsageError(f'unknown judges {unknown} ({where}); known: {registry.known_rewards()}',
                         'name registered rewards')


def input_problems(config, names):
  """One-line problems with the files the judges `names` need under config.reward.kwargs."""
  kwargs = config.reward.get('kwargs') or {}
  return [p for n in names for p in registry.input_problems(n, dict(kwargs.get(n) or {}))]


def build(config, names, where='--judges'):
  """{name: reward} of the judges `names`; an unknown name or a judge's missing files is one line."""
  check_names(names, where)
  problems = input_problems(config, names)
  if problems:
    raise preflight.MissingInputs('the judges need inputs they were not given: ' + '; '.join(problems),
                                  'set them with --config.reward.kwargs.<judge>.<key>=...')
  kwargs = config.reward.get('kwargs') or {}
  return {n: registry.make_reward(n, **dict(kwargs.get(n) or {})) for n in names}
