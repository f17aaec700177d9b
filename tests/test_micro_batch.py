"""Micro-batched rollouts and updates (config.micro_batch): the slot layout, rollouts in chunks equal to
one batch bit for bit, and every algorithm's chunked update equal to its unchunked update (gradients and
every metric), on one device and under FSDP on 8 fake devices."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_trainer import _batch_for  # tests/test_trainer.py
from test_trainer import small_config

from ddrl_jax import config as config_lib
from ddrl_jax import parallel
from ddrl_jax import update as update_lib
from ddrl_jax.parallel import micro_batch
from ddrl_jax.tasks import toy2d

# (preset, overrides): every algorithm, DDRL's data term in each step mode with fresh noise and condition
# dropout (per-slot draws), FlowGRPO with its zero-advantage filter and a KL (masked means).
CASES = {
    'ddrl_full': ('ddrl', {'rl.data_noise': 'fresh', 'rl.cond_dropout': 0.3}),
    'ddrl_random_step': ('ddrl_reduced_random', {'rl.data_noise': 'fresh', 'rl.cond_dropout': 0.3,
                                                 'rl.data_weighting': 'path_kl'}),
    'ddrl_first': ('ddrl_reduced', {}),
    'flow_grpo': ('flow_grpo', {'rl.kl_beta': 0.04, 'rl.drop_zero_advantages': True}),
    'dance_grpo': ('dance_grpo', {}),
    'ddpo': ('ddpo', {}),
    'diffusion_nft': ('diffusion_nft', {'rl.kl_beta': 0.01}),
}


def test_chunks_keep_each_positions_slots_and_invert():
  slots = jnp.arange(16)
  chunks = micro_batch.to_chunks(slots, 2, 4)     # 4 positions of 4 slots, 2 per position per chunk
  np.testing.assert_array_equal(chunks, [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]])
  np.testing.assert_array_equal(micro_batch.from_chunks(chunks, 4), slots)
  tree = {'a': jnp.arange(48).reshape(16, 3), 'k': jax.random.split(jax.random.key(0), 16)}
  back = micro_batch.from_chunks(micro_batch.to_chunks(tree, 4, 2), 2)
  chex.assert_trees_all_equal(jax.random.key_data(back['k']), jax.random.key_data(tree['k']))
  np.testing.assert_array_equal(back['a'], tree['a'])
  np.testing.assert_array_equal(micro_batch.to_chunks(slots, 1, 4)[0], slots)


@pytest.mark.parametrize('micro,error', [(3, 'must divide the 32 rollout slots'), (-1, 'must be an int')])
def test_micro_batch_is_validated_in_one_line(micro, error):
  c = small_config('ddrl')
  c.micro_batch = micro
  with pytest.raises(config_lib.ConfigError, match=f'config.micro_batch={micro}: {error}'):
    config_lib.validate(c, 1)
  c.micro_batch = 8
  config_lib.validate(c, 1)
  assert config_lib.slot_chunks(c, 1) == 4 and config_lib.slot_chunks(c, 2) == 2


def _rollout_inputs(config):
  task = toy2d.Toy2D(config)
  apply_fn, params = task.init_model(jax.random.key(0))
  cond = update_lib.flat_rollout_batch(
      jnp.zeros((config.batch_size, config.num_rollouts)),
      jnp.zeros((config.batch_size, config.num_rollouts)),
      task.conditions(jax.random.key(1), config.batch_size)).cond
  return task, apply_fn, params, cond


def test_rollouts_in_chunks_are_one_batchs_bit_for_bit():
  config = small_config('ddrl')
  task, apply_fn, params, cond = _rollout_inputs(config)
  sampler = update_lib.make_sampler(config)
  whole = jax.jit(update_lib.make_rollout_fn(sampler, apply_fn, task.sample_shape, config))
  want = whole(params, cond, jax.random.key(5))
  for micro in (4, 8):
    config.micro_batch = micro
    got = jax.jit(update_lib.make_rollout_fn(sampler, apply_fn, task.sample_shape, config))(
        params, cond, jax.random.key(5))
    chex.assert_trees_all_equal(got, want)


def _gradient_recorder():
  """An optimizer whose state is the last gradient it was given (and which moves nothing)."""
  return optax.GradientTransformation(
      lambda p: jax.tree.map(jnp.zeros_like, p),
      lambda g, state, params=None: (jax.tree.map(jnp.zeros_like, g), g))


def _update(config, batch_shards=1, mesh=None):
  """The trainer's two-half update of one batch: (the total gradient it applies, its metrics)."""
  apply_fn, params, sampler, (traj, rewards, cond), data = _batch_for(config)
  rollout = update_lib.flat_rollout_batch(traj, rewards, cond)
  optimizer = _gradient_recorder()
  state = update_lib.init_train_state(params, config, optimizer)
  if state.ref_params is not None:
    state = state._replace(ref_params=jax.tree.map(lambda x: x + 0.05 * jnp.sign(x), params))
  if state.old_params is not None:
    state = state._replace(old_params=jax.tree.map(lambda x: x - 0.03 * jnp.sign(x), params))
  data_grads, update = update_lib.make_update_fns(apply_fn, sampler, config, optimizer,
                                                  batch_shards=batch_shards)
  key = jax.random.key(11)
  if mesh is not None:
    plan = parallel.ShardingPlan.for_model(config, mesh, toy2d.Toy2D(config).family)
    rollout = jax.device_put(rollout, plan.batch())
    data_grads, update = plan.scope(data_grads), plan.scope(update)
  grads, data_metrics = jax.jit(data_grads)(update_lib.model_params(state), rollout, data, key)
  new_state, metrics = jax.jit(update)(state, rollout, grads, key)
  metrics = update_lib.combine_metrics(metrics, data_metrics, config)
  return new_state.opt_state, metrics


def _assert_equal_updates(got, want):
  (g_grads, g_metrics), (w_grads, w_metrics) = got, want
  assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(w_grads))
  # 1e-6 of each leaf's largest entry: an entry that is a near-cancelling sum differs by more than 1e-6
  # of itself when the summation order changes (chunks add their partial sums in another order).
  for g, w in zip(jax.tree.leaves(g_grads), jax.tree.leaves(w_grads)):
    assert float(jnp.abs(g - w).max()) <= 1e-6 * float(jnp.abs(w).max()), (g, w)
  assert set(g_metrics) == set(w_metrics)
  for k in w_metrics:
    # atol: a policy loss is a mean of advantages (summing to 0 per group) times ratios near 1, so its
    # value is float noise around 0 of the size of 1 ulp of the terms it sums.
    np.testing.assert_allclose(g_metrics[k], w_metrics[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize('case', sorted(CASES))
def test_chunked_update_equals_the_whole_batch(case):
  preset, overrides = CASES[case]
  config = small_config(preset, **overrides)
  want = _update(config)
  config.micro_batch = 8          # 32 slots in 4 chunks
  _assert_equal_updates(_update(config), want)


@pytest.mark.parametrize('case', ['ddrl_full', 'flow_grpo', 'diffusion_nft'])
def test_chunked_update_under_fsdp_equals_one_device(case):
  preset, overrides = CASES[case]
  config = small_config(preset, **overrides)
  want = _update(config)
  config.mesh.fsdp, config.mesh.data = 4, 2
  config.micro_batch = 2          # 32 slots over 8 positions: 4 each, 2 chunks
  mesh = parallel.make_mesh(config.mesh, jax.devices()[:8])
  _assert_equal_updates(_update(config, batch_shards=8, mesh=mesh), want)


def test_micro_batch_candidates_are_the_divisors_of_the_slots_per_position():
  from ddrl_jax import aot  # pylint: disable=g-import-not-at-top
  c = small_config('ddrl')           # 8 x 4 = 32 slots
  c.mesh.data = 8
  assert aot.micro_batch_candidates(c, 8) == [4, 2, 1]
  rows = [dict(fits=True, peak_bytes=80, hbm_bytes=100)]
  assert aot.fits_with_margin(rows, 0.1) and not aot.fits_with_margin(rows, 0.25)
  assert not aot.fits_with_margin([dict(fits=False, peak_bytes=1, hbm_bytes=100)], 0.0)
  assert not aot.fits_with_margin([], 0.0)


@pytest.mark.slow
def test_aot_search_finds_the_largest_micro_batch_that_fits():
  """On 8 CPU devices with a made-up memory between the whole batch's peak and a chunked one's: the
  search steps down from the whole batch and stops at the first micro-batch whose step fits."""
  from configs import cosmos2b  # pylint: disable=g-import-not-at-top
  from ddrl_jax import aot  # pylint: disable=g-import-not-at-top
  c = cosmos2b.get_config('smoke')
  c.batch_size, c.num_rollouts, c.mesh.data, c.mesh.fsdp = 4, 4, 2, 1     # 8 slots per position
  devices = jax.devices()[:2]
  peak = lambda micro: max(r['peak_bytes'] for r in aot.compile_report(
      _with(c, micro), None, fns=('rollout',), devices=devices, memory_bytes=1 << 40))
  whole, chunked = peak(0), peak(2)
  assert chunked < whole
  memory = (whole + chunked) // 2
  tried = [m for m, _ in aot.search_micro_batch(c, None, margin=0.0, fns=('rollout',), devices=devices,
                                                memory_bytes=memory)]
  assert tried[0] == 0 and tried[-1] in (4, 2) and peak(tried[-1]) <= memory


def _with(config, micro):
  config = config.copy_and_resolve_references()
  config.micro_batch = micro
  return config
