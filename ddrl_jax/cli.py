"""absl flag parsing shared by the CLIs: a bad `--config.key=value` override is one readable error.

ml_collections' config flags raise a bare AttributeError for an override of a key the config does
not have; `parse_flags` (pass it as `app.run(main, flags_parser=cli.parse_flags)`) turns that into a
usage error naming the flag, the config file and the closest keys.
"""
import importlib.util
import sys

from absl import flags


def _load_config(spec):
  """get_config(arg) of a `path[:arg]` config spec, loaded the way config_flags loads it."""
  path, _, arg = spec.partition(':')
  module_spec = importlib.util.spec_from_file_location('_ddrl_cli_config', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def _missing_override(argv):
  """The first `--config.a.b=v` argument whose path is not in the config, or None."""
  spec = next((a.split('=', 1)[1] for a in argv[1:] if a.startswith('--config=')), None)
  if spec is None:
    return None
  try:
    config = _load_config(spec)
  except Exception:  # pylint: disable=broad-except  (the original error is the better report)
    return None
  for arg in argv[1:]:
    if not arg.startswith('--config.'):
      continue
    path = arg[len('--config.'):].split('=', 1)[0].split('.')
    node = config
    for part in path:
      try:
        node = node[part]
      except (KeyError, TypeError, AttributeError) as e:
        return arg, '.'.join(path), e
  return None


def parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    missing = _missing_override(argv)
    if missing is None:
      raise
    arg, key, err = missing
    text = str(err.args[0] if err.args else err)
    hint = ' ' + text[text.index('Did you mean'):] if 'Did you mean' in text else ''
    source = next((a.split('=', 1)[1] for a in argv[1:] if a.startswith('--config=')), 'the config')
    sys.stderr.write(f'FATAL Flags parsing error: {arg}: {source} has no key config.{key} (unknown '
                     f'keys are not accepted).{hint}\n')
    sys.exit(1)
