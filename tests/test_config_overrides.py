"""ddrl_jax.config_overrides: the '@'-joined key=value overrides the benchmarks name cells and recipes by."""
import ml_collections
import pytest

from ddrl_jax import config_overrides


def _config():
  return ml_collections.ConfigDict({'rl': {'data_beta': 0.01, 'train_steps': (0, 2), 'data_weighting': 'x'},
                                    'seed': 0})


def test_values_are_literals_where_they_parse_and_strings_otherwise():
  assert config_overrides.parse('rl.data_beta=0.03@rl.data_weighting=path_kl@rl.train_steps=[1, 3]') == {
      'rl.data_beta': 0.03, 'rl.data_weighting': 'path_kl', 'rl.train_steps': [1, 3]}
  assert config_overrides.parse('') == {}
  assert config_overrides.parse_value('(0, 2)') == (0, 2) and config_overrides.parse_value('a/b') == 'a/b'
  for bad in ('rl.data_beta', '=1', '1x=2', 'rl data=1'):
    with pytest.raises(ValueError, match=r"cell 'x': .* is not <config.key>=<value>"):
      config_overrides.parse(bad, "cell 'x'")


def test_apply_sets_dotted_keys_and_names_what_is_unknown():
  config = config_overrides.apply(_config(), config_overrides.parse('rl.train_steps=[1, 3]@seed=4'), 'c')
  assert config.rl.train_steps == (1, 3) and config.seed == 4          # a list is stored as a tuple
  with pytest.raises(ValueError, match="recipe 'r': config has no key 'rl.data_bta'"):
    config_overrides.apply(_config(), {'rl.data_bta': 1}, "recipe 'r'")
  with pytest.raises(ValueError, match="config has no section 'optim' \\(in 'optim.lr'\\)"):
    config_overrides.apply(_config(), {'optim.lr': 1}, 'c')
