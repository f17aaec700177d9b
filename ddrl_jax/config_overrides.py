"""Dotted `key=value` overrides of an ml_collections config, written '@'-joined in one string.

'rl.data_beta=0.03@rl.data_weighting=path_kl' is how the benchmarks name a cell or a recipe variant
(ocr_table's methods, aot_fit's recipes); the training CLI takes the same keys as --config.<key> flags.
"""
import ast
import re

_KEY = re.compile(r'[A-Za-z_][\w.]*')


def parse_value(text):
  """A Python literal where `text` is one ('0.03' -> 0.03, '(0, 2)' -> (0, 2)), else the string itself."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def parse(text, what='override'):
  """'rl.data_beta=0.03@rl.kl_form=exact' -> {'rl.data_beta': 0.03, 'rl.kl_form': 'exact'} (in order).

  An item that is not <config.key>=<value> raises a ValueError naming it and `what`."""
  out = {}
  for item in filter(None, text.split('@')):
    key, eq, value = item.partition('=')
    if not eq or not _KEY.fullmatch(key):
      raise ValueError(f'{what}: {item!r} is not <config.key>=<value>')
    out[key] = parse_value(value)
  return out


def apply(config, overrides, what):
  """Sets each dotted key of `overrides` ({key: value}) on `config` and returns it; a list value becomes
  a tuple. An unknown section or key raises a ValueError naming it and `what`."""
  for key, value in overrides.items():
    *parents, leaf = key.split('.')
    node = config
    for part in parents:
      if part not in node:
        raise ValueError(f'{what}: config has no section {part!r} (in {key!r})')
      node = node[part]
    if leaf not in node:
      raise ValueError(f'{what}: config has no key {key!r}')
    setattr(node, leaf, tuple(value) if isinstance(value, list) else value)
  return config
