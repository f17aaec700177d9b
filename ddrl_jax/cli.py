"""What every ddrl_jax CLI shares: a mistake in the flags or the config is one line, not a traceback.

`run(main, required=(...))` replaces `app.run(main)`. A mistake prints

    error: <what is wrong> (<how to fix it>); see `python -m ddrl_jax.train --help`

on stderr and exits 2. The mistakes: a missing required flag, an unknown flag or config key, a value of the
wrong type, a config file that does not exist (found while the flags are parsed, before any JAX work), an
unknown preset (`--config=FILE:preset`), an argument that is not a flag, and any `ConfigError`,
`UsageError`, task `Unsupported` or `CheckpointError` (a workdir holding another config's run, damaged
checkpoints) raised by `main` (e.g. a value `config.validate` rejects). `--traceback` (or
DDRL_TRACEBACK=1) shows the full trace instead. `--help` prints the flags and exits 0.
"""
import difflib
import importlib.util
import os
import sys

from absl import app
from absl import flags

USAGE_EXIT = 2     # as argparse and the shells: the command line was wrong
HELP_ARGS = ('--help', '-h', '-?', '--helpshort', '--helpfull')
TRACEBACK_ENV = 'DDRL_TRACEBACK'


class UsageError(Exception):
  """A mistake of the user's: `what` is wrong, `fix` says how to put it right."""

  def __init__(self, what, fix=''):
    super().__init__(what)
    self.what, self.fix = what, fix


def prog_name():
  """How the running CLI was started, e.g. 'python -m ddrl_jax.train'."""
  spec = getattr(sys.modules.get('__main__'), '__spec__', None)
  return f'python -m {spec.name}' if spec is not None else os.path.basename(sys.argv[0])


def error_line(what, fix=''):
  """The one-line answer to a mistake (no trailing newline)."""
  fix = f' ({fix})' if fix else ''
  return f'error: {what}{fix}; see `{prog_name()} --help`'


def wants_traceback(argv=None):
  argv = sys.argv if argv is None else argv
  return '--traceback' in argv or os.environ.get(TRACEBACK_ENV, '') not in ('', '0')


def fail(what, fix=''):
  """Prints the one-line error and exits with USAGE_EXIT."""
  sys.stderr.write(error_line(what, fix) + '\n')
  sys.exit(USAGE_EXIT)


# ------------------------------------------------------------------------------------- config specs
def config_spec(argv):
  """The value of `--config=...` (or `--config VALUE`) in argv, or None."""
  for i, arg in enumerate(argv[1:], 1):
    if arg.startswith('--config='):
      return arg.split('=', 1)[1]
    if arg == '--config' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def load_config(spec):
  """get_config(arg) of a `path[:arg]` config spec, loaded the way config_flags loads it."""
  path, _, arg = spec.partition(':')
  module_spec = importlib.util.spec_from_file_location('_ddrl_cli_config', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def check_config_file(spec):
  """Raises UsageError when the file of a `path[:preset]` spec does not exist."""
  path = spec.partition(':')[0]
  if os.path.isfile(path):
    return
  folder = os.path.dirname(path) or '.'
  there = sorted(f for f in os.listdir(folder) if f.endswith('.py') and not f.startswith('_')) \
      if os.path.isdir(folder) else []
  near = difflib.get_close_matches(os.path.basename(path), there, n=1)
  fix = (f'did you mean {os.path.join(os.path.dirname(path), near[0])}?' if near else
         f'config files in {folder}/: {", ".join(there)}' if there else
         'give the path of a config file, e.g. configs/toy2d.py')
  raise UsageError(f'--config={spec}: no such file {path}', fix)


def _config_node(config, dotted):
  """The value at a dotted key of a ConfigDict; raises KeyError/AttributeError when absent."""
  node = config
  for part in dotted.split('.'):
    node = node[part]
  return node


def _unknown_override(argv, config):
  """(argument, dotted key, error) of the first `--config.a.b=v` naming a key the config lacks."""
  for arg in argv[1:]:
    if arg.startswith('--config.'):
      key = arg[len('--config.'):].split('=', 1)[0]
      try:
        _config_node(config, key)
      except (KeyError, TypeError, AttributeError) as e:
        return arg, key, e
  return None


def _did_you_mean(err):
  text = str(err.args[0] if err.args else err)
  return 'did' + text[text.index('Did you mean') + 3:].rstrip('?') + '?' if 'Did you mean' in text else ''


# --------------------------------------------------------------------------------------- parsing
def _flag_error(e, argv):
  """UsageError for an absl flag-parsing error."""
  msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  if isinstance(e, flags.UnrecognizedFlagError):
    near = f'did you mean --{e.suggestions[0]}?' if getattr(e, 'suggestions', None) else \
        'the flags are listed by --help'
    return UsageError(f'unknown flag --{e.flagname}', near)
  if msg.startswith('flag --config.'):    # a config override that does not parse as the key's type
    key = msg[len('flag --config.'):].split('=', 1)[0]
    spec = config_spec(argv)
    try:
      kind = type(_config_node(load_config(spec), key)).__name__
      fix = f'config.{key} takes {kind} values'
    except Exception:  # pylint: disable=broad-except
      fix = f'give config.{key} a value of its type'
    return UsageError(msg[len('flag '):], fix)
  if msg.startswith('flag --'):
    name = msg[len('flag --'):].split('=', 1)[0]
    kind = flags.FLAGS[name].flag_type() if name in flags.FLAGS else 'value of its type'
    return UsageError(msg[len('flag '):], f'--{name} takes {kind} values')
  return UsageError(msg, 'the flags are listed by --help')


def _print_help(argv):
  full = '--helpfull' in argv
  text = flags.FLAGS.get_help() if full else flags.FLAGS.main_module_help()
  doc = (sys.modules['__main__'].__doc__ or '').strip()
  sys.stdout.write((doc + '\n\n' if doc else '') + f'flags of {prog_name()}:\n{text}\n'
                   + ('' if full else '\n--helpfull lists every flag (absl, JAX, ...).\n'))


def make_flags_parser(required=()):
  """An absl `flags_parser` that answers every mistake in one line (exit 2) and `--help` with exit 0."""

  def parse(argv):
    argv = [a for a in argv if a != '--traceback']
    if any(a in HELP_ARGS for a in argv[1:]):
      _print_help(argv)
      sys.exit(0)
    try:
      spec = config_spec(argv)
      if spec is not None:
        check_config_file(spec)    # before absl and ml_collections: they defer this error to first use
        try:
          load_config(spec)       # an unknown preset or a broken config file, reported plainly
        except Exception as e:  # pylint: disable=broad-except
          raise UsageError(f'--config={spec}: {first_line(e)}',
                           'the preset is named after the colon, e.g. --config=FILE:ddrl'
                           if 'preset' in str(e) else f'fix {spec.partition(":")[0]}') from e
      try:
        rest = flags.FLAGS(argv)
      except flags.Error as e:
        raise _flag_error(e, argv) from e
      except (AttributeError, KeyError) as e:   # ml_collections: an override of a key the config lacks
        unknown = _unknown_override(argv, load_config(spec)) if spec else None
        if unknown is None:
          raise
        arg, key, err = unknown
        from ddrl_jax import moved_keys  # pylint: disable=g-import-not-at-top
        if moved_keys.new_place(key):
          raise UsageError(f'{arg}: config.{key} moved to config.{moved_keys.new_place(key)}',
                           f'write --config.{moved_keys.new_place(key)}=...') from e
        raise UsageError(f'{arg}: {spec} has no key config.{key}',
                         (_did_you_mean(err) + ' ' if _did_you_mean(err) else '')
                         + 'unknown keys are not accepted') from e
      missing = [name for name in required if flags.FLAGS[name].value in (None, '', [])]
      if missing:
        raise UsageError('missing ' + ' and '.join(f'--{n}' for n in missing),
                         'pass ' + ', '.join(f'--{n}=<{flags.FLAGS[n].help.rstrip(".")}>' for n in missing))
      if len(rest) > 1:
        raise UsageError(f'unexpected arguments {rest[1:]}', 'flags are written --name=value')
      return rest
    except UsageError as e:
      if wants_traceback():
        raise
      fail(e.what, e.fix)

  return parse


def first_line(e):
  text = str(e).strip()
  return text.splitlines()[0] if text else type(e).__name__


def run(main, required=()):
  """app.run(main) for ddrl_jax's CLIs. `required`: flag names that must be given.

  Defines --traceback; mistakes (see the module docstring) exit 2 with one line on stderr.
  """
  if 'traceback' not in flags.FLAGS:
    flags.DEFINE_bool('traceback', False, f'Show the full Python traceback of an error (or set '
                      f'{TRACEBACK_ENV}=1).')

  def guarded_main(argv):
    try:
      return main(argv)
    except Exception as e:  # pylint: disable=broad-except  (re-raised unless it is a usage mistake)
      from ddrl_jax.config import ConfigError  # pylint: disable=g-import-not-at-top  (jax; serve needs none)
      from ddrl_jax.tasks.base import Unsupported  # pylint: disable=g-import-not-at-top
      from ddrl_jax.checkpoints import CheckpointError  # pylint: disable=g-import-not-at-top
      if wants_traceback() or not isinstance(e, (UsageError, app.UsageError, ConfigError, Unsupported,
                                                 CheckpointError)):
        raise
      if isinstance(e, UsageError):
        fail(e.what, e.fix)
      if isinstance(e, ConfigError):
        fail(str(e), _config_fix(e, config_spec(sys.argv)))
      fail(str(e))

  app.run(guarded_main, flags_parser=make_flags_parser(required))


def _config_fix(e, spec):
  key = getattr(e, 'key', None)
  where = f' or in {spec.partition(":")[0]}' if spec else ''
  if key:
    return f'change it with --config.{key}=...{where}'
  return f'change the keys it names with --config.<key>=...{where}'


def parse_flags(argv):
  """The flags parser of `run` with no required flags (for `app.run(main, flags_parser=...)`)."""
  return make_flags_parser()(argv)

