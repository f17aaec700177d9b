"""The rl section typed once (rl/options.py), cosmos-rl's conventions named 'cosmos_rl' with the old
'cosmos' still accepted, and the algorithm registry: every objective goes through `Algorithm`, and a new
algorithm is a class and a registry line."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer import _batch_for  # tests/test_trainer.py
from test_trainer import small_config

from configs import common
from configs import toy2d
from ddrl_jax import checkpoints
from ddrl_jax import config as config_lib
from ddrl_jax import optim
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.rl import algorithms
from ddrl_jax.rl import options
from ddrl_jax.rl import policy
from ddrl_jax.rl import registry


def test_every_rl_key_is_typed_once_with_the_configs_defaults():
  rl = common.base_config().rl
  fields = {f.name: f for f in dataclasses.fields(options.RLOptions)}
  assert set(fields) == set(rl.keys())
  defaults = options.RLOptions()
  for name in fields:
    if name == 'loss_scale':          # the functional loss's neutral 1; configs use cosmos-rl's 10
      assert (defaults.loss_scale, rl.loss_scale) == (1.0, 10.0)
      continue
    assert options.canonical(rl[name]) == getattr(defaults, name), name
  assert set(options.CHOICES) <= set(fields)


@pytest.mark.parametrize('key,old,new', [('log_ratio', 'cosmos', 'cosmos_rl'),
                                         ('adv_normalization', 'cosmos', 'cosmos_rl'),
                                         ('data_weighting', 'cosmos', 'cosmos_rl'),
                                         ('data_loss_steps', 'reduced', 'random_step')])
def test_old_spellings_are_accepted_and_mean_the_same(key, old, new):
  assert getattr(options.RLOptions(**{key: old}), key) == new
  c = toy2d.get_config('ddrl')
  c.rl[key] = old
  config_lib.validate(c, num_devices=1)
  saved = toy2d.get_config('ddrl')
  saved.rl[key] = old
  now = toy2d.get_config('ddrl')
  now.rl[key] = new
  assert checkpoints.config_differences(saved.to_dict(), now.to_dict()) == ([], [])


def test_the_cosmos_rl_log_ratio_is_the_old_cosmos_one():
  k = jax.random.split(jax.random.key(0), 4)
  x, m1, m0 = (jax.random.normal(kk, (2, 3, 5)) for kk in k[:3])
  std = jnp.full((2, 3), 0.3)
  np.testing.assert_array_equal(policy.log_ratio(x, m1, m0, std, form='cosmos'),
                                policy.log_ratio(x, m1, m0, std, form='cosmos_rl'))
  assert float(jnp.abs(policy.log_ratio(x, m1, m0, std, form='gaussian') -
                       policy.log_ratio(x, m1, m0, std, form='cosmos_rl')).max()) > 0


@pytest.mark.parametrize('key,value', [('log_ratio', 'cosmo'), ('adv_normalization', 'z'),
                                       ('data_weighting', 'snr'), ('kl_form', 'reverse'),
                                       ('old_mean', 'current'), ('data_noise', 'x')])
def test_a_bad_choice_names_the_key_and_the_choices(key, value):
  c = toy2d.get_config('ddrl')
  c.rl[key] = value
  with pytest.raises(config_lib.ConfigError, match=rf"config\.rl\.{key}='{value}': known: "):
    config_lib.validate(c, num_devices=1)


def test_an_unknown_rl_key_is_named():
  c = toy2d.get_config('ddrl')
  c.rl.clip_rnage = 0.1
  with pytest.raises(config_lib.ConfigError, match=r"config\.rl: rl options \['clip_rnage'\]: unknown"):
    config_lib.validate(c, num_devices=1)


def test_nft_checks_are_the_algorithms():
  c = toy2d.get_config('ddrl')
  common.apply_algorithm_preset(c, 'diffusion_nft')
  config_lib.validate(c, num_devices=1)
  c.rl.nft_old_decay = 7
  with pytest.raises(config_lib.ConfigError, match=r'config\.rl\.nft_old_decay=7: known schedules'):
    config_lib.validate(c, num_devices=1)


@dataclasses.dataclass(frozen=True)
class HalfStep(algorithms.Algorithm):
  """A new algorithm defined in a test: DanceGRPO's loss at half its gradient, with an 'old policy'
  counter that update_old advances (to show the trainer calls the algorithm's hooks)."""

  def loss_and_grad(self, apply_fn, params, ref_params, sampler, traj, advantages, steps, cond, data, key,
                    options, *, old_params=None, valid=None):
    loss, metrics, grads = super().loss_and_grad(apply_fn, params, ref_params, sampler, traj, advantages,
                                                 steps, cond, data, key, options)
    return loss, metrics, jax.tree.map(lambda g: 0.5 * g, grads)

  def init_old(self, params):
    return {'count': jnp.zeros((), jnp.float32)}

  def update_old(self, old_params, params, step, options):
    return {'count': old_params['count'] + 1}, {'old_count': old_params['count'] + 1}


def test_a_new_algorithm_is_a_class_and_a_registry_line(monkeypatch):
  base = registry.ALGORITHMS['dance_grpo']
  half = HalfStep('half_step', base.default_sampler, uses_reference=False, uses_data=False,
                  step_selection=base.step_selection, default_log_ratio=base.default_log_ratio)
  monkeypatch.setitem(registry.ALGORITHMS, 'half_step', half)
  results = {}
  for name in ('dance_grpo', 'half_step'):
    config = small_config('dance_grpo')
    config.algorithm = name
    config_lib.validate(config, num_devices=1)
    apply_fn, params, sampler, (traj, rewards, cond), data = _batch_for(config)
    optimizer = optim.make_optimizer(config.optim)
    step = trainer_lib.make_train_step(apply_fn, sampler, config, optimizer)
    state = trainer_lib.init_train_state(params, config, optimizer)
    flat = trainer_lib.flat_rollout_batch(traj, rewards, cond)
    new_state, metrics = jax.jit(step)(state, flat, data, jax.random.key(3))
    results[name] = (new_state, metrics)
  (_, m_base), (s_half, m_half) = results['dance_grpo'], results['half_step']
  np.testing.assert_allclose(m_half['grad_norm'], 0.5 * m_base['grad_norm'], rtol=1e-5)
  assert float(m_half['old_count']) == 1.0 and float(s_half.old_params['count']) == 1.0
