"""The jitted train step and its sharding, config validation, the optimizer pieces and every algorithm
through the trainer (resume, kills and the CLI: test_fault_tolerance.py; bad input: test_bad_inputs.py)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import toy2d as toy_config
from ddrl_jax import config as config_lib
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import optim
from ddrl_jax import parallel
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.rl import algorithms
from ddrl_jax.tasks import toy2d


def small_config(preset='ddrl', **overrides):
  c = toy_config.get_config(preset)
  c.toy2d.width, c.toy2d.depth = 32, 2
  c.toy2d.pretrain_steps, c.toy2d.pretrain_batch = 200, 256
  c.sampler.num_steps = 6
  if c.rl.train_steps is not None:
    c.rl.train_steps = tuple(range(6))
  c.batch_size, c.num_rollouts = 8, 4
  c.num_iterations, c.eval_every, c.eval_samples = 4, 0, 64
  c.checkpoint_every = 2
  return apply_overrides(c, overrides)


def apply_overrides(config, overrides):
  """Sets {'a.b.c': value} entries of a ConfigDict in place; returns it."""
  for k, v in overrides.items():
    node = config
    *path, last = k.split('.')
    for p in path:
      node = node[p]
    node[last] = v
  return config


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize('key,value,needle', [
    ('num_rollouts', 1, 'config.num_rollouts'),
    ('rl.clip_range', 0.0, 'config.rl.clip_range'),
    ('rl.train_steps', (0, 2, 6), 'config.rl.train_steps'),
    ('rl.train_steps', (-1,), 'config.rl.train_steps'),
    ('rl.train_steps', (5,), 'config.rl.train_steps'),   # cosmos_2ab's deterministic last step
    ('batch_size', 3, 'config.batch_size'),            # 3 x 4 rollouts over 8 data-parallel slots
    ('algorithm', 'ppo', 'config.algorithm'),
    ('rl.kl_beta', 0.1, 'config.rl.kl_beta'),           # DDRL holds no reference model
    ('sampler.kind', 'euler', 'config.sampler.kind'),
    ('mesh.fsdp', 3, 'config.mesh'),
    ('rl.data_loss_steps', 'half', 'config.rl.data_loss_steps'),
])
def test_bad_config_names_the_key(key, value, needle):
  c = small_config(**{key: value})
  with pytest.raises(ValueError, match=needle.replace('.', r'\.')):
    config_lib.validate(c, num_devices=8)


def test_good_configs_validate():
  for preset in ('ddrl', 'ddrl_reduced', 'ddrl_exact', 'flow_grpo', 'dance_grpo', 'ddpo'):
    c = toy_config.get_config(preset)
    assert config_lib.validate(c, num_devices=8) == (8, 1, 1, 1)
    assert config_lib.validate(c, num_devices=1) == (1, 1, 1, 1)


# -------------------------------------------------------------------------------------------- optim
def test_power_ema_matches_cosmos_values():
  gamma = optim.power_ema_gamma(0.1)
  np.testing.assert_allclose(gamma, 6.94, atol=0.01)
  np.testing.assert_allclose(gamma**3 + 7 * gamma**2 + (16 - 100) * gamma + (12 - 100), 0, atol=1e-8)
  assert float(optim.power_ema_beta(0, gamma)) == 0.0
  np.testing.assert_allclose(float(optim.power_ema_beta(10, gamma)), (1 - 1 / 11)**(gamma + 1),
                             rtol=1e-6)
  np.testing.assert_allclose(float(optim.power_ema_beta(10, gamma)), 0.47, atol=0.01)
  np.testing.assert_allclose(float(optim.power_ema_beta(100, gamma)), 0.92, atol=0.01)


def test_zero_nonfinite_counts_and_zeros():
  g = {'a': jnp.array([1.0, jnp.nan, jnp.inf]), 'b': jnp.array([[-jnp.inf, 2.0]])}
  clean, count = optim.zero_nonfinite(g)
  assert int(count) == 3
  np.testing.assert_array_equal(clean['a'], [1.0, 0.0, 0.0])
  np.testing.assert_array_equal(clean['b'], [[0.0, 2.0]])


def test_warmup_schedule():
  c = small_config()
  c.optim.warmup_steps, c.optim.learning_rate = 10, 1e-3
  s = optim.learning_rate_schedule(c.optim)
  np.testing.assert_allclose(float(s(0)), 1e-9, atol=1e-10)  # float32 cancellation in optax
  np.testing.assert_allclose(float(s(5)), 1e-9 + 0.5 * (1e-3 - 1e-9), rtol=1e-5)
  np.testing.assert_allclose(float(s(10)), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(float(s(1000)), 1e-3, rtol=1e-6)


# --------------------------------------------------------------------------------- sharded update
def _batch_for(config, seed=0):
  """A rollout batch, data batch and state built on one device (host values, no mesh)."""
  task = toy2d.Toy2D(config)
  apply_fn, params = task.init_model(jax.random.key(seed))
  sampler = trainer_lib.make_sampler(config)
  key = jax.random.key(seed + 1)
  cond = task.conditions(key, config.batch_size)
  traj = sampler.rollout(apply_fn, params, cond, key, num_rollouts=config.num_rollouts,
                         sample_shape=task.sample_shape)
  rewards = np.asarray(traj.x0) @ task.w    # (B, N): the configured linear reward
  rewards[0, 1] = np.nan   # one failed sample
  data = trainer_lib.DataBatch(x0=task.data(jax.random.key(seed + 2), cond), cond=cond)
  return apply_fn, params, sampler, (traj, jnp.asarray(rewards), cond), data


@pytest.mark.parametrize('preset', ['ddrl', 'flow_grpo'])
def test_sharded_step_equals_single_device(preset):
  config = small_config(preset)
  # The full learning rate at step 0 (no warmup) and Adam's eps near the gradients' size: the first
  # update -lr g / (|g| + eps) then follows each gradient's magnitude, not only its sign.
  config.optim.update(warmup_steps=0, learning_rate=1e-2, eps=1e-2)
  apply_fn, params, sampler, (traj, rewards, cond), data = _batch_for(config)
  rollout = trainer_lib.RolloutBatch(traj=traj, rewards=rewards, cond=cond)   # group layout
  flat = trainer_lib.flat_rollout_batch(traj, rewards, cond)                  # the trainer's layout
  chex.assert_trees_all_equal(trainer_lib.group_rollout_batch(flat, config.num_rollouts),
                              (traj, rewards[..., None], cond))
  optimizer = optim.make_optimizer(config.optim)
  algo = algorithms.get_algorithm(config.algorithm)
  step_fn = trainer_lib.make_train_step(apply_fn, sampler, config, optimizer)
  key = jax.random.key(7)
  steps = algo.select_steps(key, config.batch_size, config.num_rollouts,
                            config_lib.train_steps(config), config.rl.train_fraction)
  adv = trainer_lib.compute_advantages(rollout.rewards[..., None], config)
  data_term = algorithms.DataTerm(x0=data.x0, cond=data.cond, beta=config.rl.data_beta)

  def loss_and_grad(p, rollout, data_term):
    return jax.value_and_grad(
        lambda q: algo.loss(apply_fn, q, p, sampler, rollout.traj, adv, steps, rollout.cond,
                            data_term if algo.uses_data else None, key,
                            algorithms.RLOptions.from_mapping(config.rl)),
        has_aux=True)(p)

  results = {}
  for n in (1, 8):
    mesh = parallel.make_mesh(config.mesh, jax.devices()[:n])
    assert parallel.data_parallel_size(mesh) == n
    rep, batch = parallel.replicated(mesh), parallel.batch_sharding(mesh)
    put = lambda x, s: jax.device_put(x, s)
    (loss, metrics), grads = jax.jit(loss_and_grad, in_shardings=(rep, batch, batch))(
        put(params, rep), put(rollout, batch), put(data_term, batch))
    plan = parallel.ShardingPlan.from_config(config, mesh)
    state = trainer_lib.init_train_state(jax.tree.map(jnp.copy, params), config, optimizer)
    state_sh = plan.state(jax.eval_shape(lambda s: s, state), optimizer)
    new_state, step_metrics = trainer_lib.jit_train_step(step_fn, plan, state_sh)(
        jax.device_put(state, state_sh), put(flat, batch), trainer_lib.place_data(plan, data), key)
    if n == 8:
      assert len(put(flat, batch).traj.x_in.sharding.device_set) == 8
    results[n] = jax.device_get((loss, grads, new_state.params, step_metrics))
  (l1, g1, p1, m1), (l8, g8, p8, m8) = results[1], results[8]
  np.testing.assert_allclose(l1, l8, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(g1, g8, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(p1, p8, rtol=1e-5, atol=1e-7)
  f64 = lambda a: np.asarray(a, np.float64)
  du1, du8 = (jax.tree.map(lambda a, b: f64(a) - f64(b), p, params) for p in (p1, p8))
  scale = max(float(np.abs(d).max()) for d in jax.tree.leaves(du1))
  assert min(float(np.abs(d).max()) for d in jax.tree.leaves(du1)) > 1e-2 * scale > 0, du1   # all move
  chex.assert_trees_all_close(du8, du1, rtol=1e-4, atol=1e-4 * scale)
  for k in ('loss', 'pg_loss', 'grad_norm', 'reward_mean', 'failed_rewards'):
    np.testing.assert_allclose(m1[k], m8[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert m1['failed_rewards'] == 1
  assert np.isfinite(m1['loss'])


def test_ddrl_state_holds_no_reference_or_old_copy():
  c = small_config('ddrl')
  state = trainer_lib.init_train_state({'w': jnp.ones(3)}, c, optim.make_optimizer(c.optim))
  assert state.ref_params is None
  assert state.old_params is None
  c = small_config('flow_grpo')
  state = trainer_lib.init_train_state({'w': jnp.ones(3)}, c, optim.make_optimizer(c.optim))
  assert state.ref_params is not None
  assert state.old_params is None                       # GRPO: the rollout's own log-probs, no old copy
  np.testing.assert_array_equal(state.ref_params['w'], np.ones(3))
  c = small_config('diffusion_nft')                     # the old policy (an EMA of params) is its own copy
  params = {'w': jnp.ones(3)}
  state = trainer_lib.init_train_state(params, c, optim.make_optimizer(c.optim))
  assert state.old_params is not None and state.old_params['w'] is not params['w']
  np.testing.assert_array_equal(state.old_params['w'], np.ones(3))


# ---------------------------------------------------------------------------------- resume / CLI
def _train_metrics(workdir):
  return {r['step']: r for r in metrics_lib.read_metrics(workdir) if 'loss' in r}


@pytest.mark.parametrize('preset', ['flow_grpo', 'dance_grpo', 'ddpo'])
def test_baselines_train_through_the_trainer(preset, tmp_path):
  """Each GRPO-family baseline runs the real loop: rollouts of its own sampler, rewards, its loss."""
  c = small_config(preset, num_iterations=3)
  c.optim.warmup_steps = 0
  trainer = trainer_lib.Trainer(c, tmp_path, devices=jax.devices()[:1])
  trainer.restore_or_init()
  before = jax.tree.map(np.asarray, trainer.state.params)
  trainer.train(progress=False)
  rows = _train_metrics(tmp_path)
  assert sorted(rows) == [1, 2, 3]
  algo = algorithms.get_algorithm(c.algorithm)
  assert config_lib.sampler_kind(c) == algo.default_sampler
  for r in rows.values():
    assert all(np.isfinite(v) for v in r.values()), r
    assert r['nonfinite_grads'] == 0 and r['grad_norm'] > 0 and r['adv_abs_mean'] > 0
    assert 'data_loss' not in r and ('kl' in r) == (preset == 'flow_grpo')
  assert rows[1]['ratio_max_dev'] < 1e-3       # first step after its rollout: the ratio is ~1
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()),
                       trainer.state.params, before)
  assert min(jax.tree.leaves(moved)) > 0
  # Values a wrong loop would change: 3 AdamW steps at the configured rate (each moves an entry by at
  # most ~lr: |m_hat / sqrt(v_hat)| <= 1.003 for b1 0.9, b2 0.99, t <= 3; weight decay 0), rollouts of T
  # steps of the algorithm's sampler, group-centred advantages, and a KL that is 0 before the first step.
  lr = c.optim.learning_rate
  assert c.optim.weight_decay == 0 and int(trainer.state.step) == 3
  assert 0.5 * lr < max(jax.tree.leaves(moved)) <= 3.01 * lr, (moved, lr)
  for r in rows.values():
    assert r['learning_rate'] == pytest.approx(lr) and r['nfe_rollout'] == c.sampler.num_steps, r
    assert r['failed_rewards'] == 0 and abs(r['adv_mean']) < 1e-6, r
  if preset == 'flow_grpo':   # the frozen reference stays at the initial parameters
    jax.tree.map(np.testing.assert_array_equal, trainer.state.ref_params, before)
    assert rows[1]['kl'] == 0 and rows[2]['kl'] > 0 and rows[3]['kl'] > 0, rows
