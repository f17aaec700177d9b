"""The trainer's two side streams: rewards scored while the data gradient computes (shown by event order),
failed rewards counted, and record data (synthesized by the base model) consumed once, resumably."""
import os

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from test_trainer import small_config  # tests/test_trainer.py

from ddrl_jax import config as config_lib
from ddrl_jax import metrics as metrics_lib
from ddrl_jax import optim
from ddrl_jax import rewards
from ddrl_jax import rl as rl_lib
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.data import records as records_lib
from ddrl_jax.data import synthesize


def test_rewards_are_pending_while_the_data_gradient_computes(tmp_path):
  gate = tmp_path / 'gate'
  c = small_config('ddrl', num_iterations=2)
  c.reward.fns = ml_collections.ConfigDict({'linear': 1.0, 'debug_gate': 0.5})
  c.reward.kwargs.debug_gate = ml_collections.ConfigDict({'path': str(gate), 'max_wait': 120.0})
  c.reward.workers = 1          # a separate worker process holds the gated reward
  trainer = trainer_lib.Trainer(c, tmp_path / 'run')
  seen = []

  def hook(name, info):
    seen.append((name, dict(info)))
    if name == 'data_grad_done':
      gate.touch()              # only now may the reward finish
    if name == 'update_done':
      gate.unlink()

  trainer.event_hooks.append(hook)
  trainer.train(progress=False)
  names = [n for n, _ in seen]
  iteration = ['iteration_start', 'rollout_done', 'rewards_submitted', 'data_grad_done',
               'rewards_ready', 'update_done']
  assert names == ['restored'] + iteration * 2 + ['checkpoint_start', 'checkpoint_done']
  assert [info['it'] for n, info in seen if n == 'update_done'] == [0, 1]
  assert all(info['rewards_pending'] for n, info in seen if n == 'data_grad_done')
  rows = [r for r in metrics_lib.read_metrics(tmp_path / 'run') if 'loss' in r]
  assert [r['time_reward_overlap'] for r in rows] == [1.0, 1.0]
  assert all(np.isfinite(r['reward/debug_gate']) and r['failed_rewards'] == 0 for r in rows)
  assert all(r['data_loss'] > 0 for r in rows)


def _public_loss(config, apply_fn, sampler, traj, advantages, steps, cond, data, ref_params, key):
  """The loss as a user of ddrl_jax.rl would write it: rl.ddrl_loss / rl.flow_grpo_loss directly."""
  r = config.rl
  if config.algorithm == 'ddrl':
    term = rl_lib.DataTerm(x0=data.x0, cond=data.cond, beta=r.data_beta, steps=r.data_loss_steps,
                           noise=r.data_noise, cond_dropout=r.cond_dropout, weighting=r.data_weighting)
    return lambda p: rl_lib.ddrl_loss(apply_fn, p, sampler, traj, advantages, steps, cond, term, key,
                                      clip_range=r.clip_range, log_ratio_form=r.log_ratio or 'cosmos',
                                      loss_scale=r.loss_scale)
  return lambda p: rl_lib.flow_grpo_loss(apply_fn, p, ref_params, sampler, traj, advantages, steps, cond,
                                         key, kl_beta=r.kl_beta, clip_range=r.clip_range,
                                         log_ratio_form=r.log_ratio or 'gaussian',
                                         loss_scale=r.loss_scale, kl_form=r.kl_form,
                                         drop_zero_advantages=r.drop_zero_advantages)


@pytest.mark.parametrize('preset', ['ddrl', 'flow_grpo'])
def test_trainer_update_equals_value_and_grad_of_the_public_loss(preset):
  """The trainer's split update (data gradient first, policy gradient after the rewards) against
  jax.value_and_grad of the public loss on the same inputs, then the same optimizer step."""
  from test_trainer import _batch_for  # pylint: disable=g-import-not-at-top
  c = small_config(preset)
  c.optim.warmup_steps = 0                     # a full-size first step, so parameters move visibly
  apply_fn, params, sampler, (traj, rewards, cond), data = _batch_for(c)
  rewards = jnp.nan_to_num(rewards)            # failed samples are tested elsewhere
  b, n = rewards.shape
  rollout = trainer_lib.flat_rollout_batch(traj, rewards, cond)
  key = jax.random.key(3)
  # The documented key contract: (k_steps, k_loss) = split(key); ddrl/flow_grpo train a fixed list.
  _, k_loss = jax.random.split(key)
  steps = jnp.broadcast_to(jnp.asarray(config_lib.train_steps(c), jnp.int32),
                           (b, n, len(config_lib.train_steps(c))))
  advantages = rl_lib.group_advantages(rewards.reshape(-1), group_size=n, clip=c.rl.adv_clip,
                                       eps=c.rl.adv_eps, normalization=c.rl.adv_normalization,
                                       global_std=c.rl.adv_global_std).reshape(b, n)
  ref_params = jax.tree.map(lambda x: x + 0.05 * jnp.sign(x), params)   # a reference != params: KL > 0
  loss_fn = _public_loss(c, apply_fn, sampler, traj, advantages, steps, cond, data, ref_params, k_loss)
  (want_loss, want_metrics), want_grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(want_grads))

  def trainer_step(optimizer):
    state = trainer_lib.init_train_state(params, c, optimizer)
    if state.ref_params is not None:
      state = state._replace(ref_params=ref_params)
    data_grads, update = trainer_lib.make_update_fns(apply_fn, sampler, c, optimizer)
    grads, data_metrics = jax.jit(data_grads)(params, rollout, data, key)
    new_state, metrics = jax.jit(update)(state, rollout, grads, key)
    return new_state, trainer_lib.combine_metrics(metrics, data_metrics, c)

  # SGD with rate 1: the parameter change is minus the trainer's total gradient, entry by entry.
  sgd_state, metrics = trainer_step(optax.sgd(1.0))
  got_grads = jax.tree.map(lambda old, new: old - new, params, sgd_state.params)
  chex.assert_trees_all_close(got_grads, want_grads, rtol=2e-5, atol=1e-7)
  # Two compiled programs (the trainer's jit and this eager value_and_grad) round differently.
  np.testing.assert_allclose(metrics['loss'], want_loss, rtol=1e-5, atol=1e-9)
  np.testing.assert_allclose(metrics['grad_norm'], optax.tree.norm(want_grads), rtol=1e-5)
  for k in ('pg_loss', 'data_loss', 'kl'):
    if k in want_metrics:
      np.testing.assert_allclose(metrics[k], want_metrics[k], rtol=1e-5, atol=1e-8, err_msg=k)
  assert ('kl' in metrics) == (preset == 'flow_grpo') and ('data_loss' in metrics) == (preset == 'ddrl')
  # The configured optimizer: the same AdamW step built here from optax.
  o = c.optim
  adamw = optax.chain(optax.clip_by_global_norm(o.grad_clip),
                      optax.adamw(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps,
                                  weight_decay=o.weight_decay))
  updates, _ = adamw.update(want_grads, adamw.init(params), params)
  adam_state, _ = trainer_step(optim.make_optimizer(c.optim))
  chex.assert_trees_all_close(adam_state.params, optax.apply_updates(params, updates), rtol=1e-6,
                              atol=1e-8)


@pytest.mark.slow
def test_crashing_reward_is_counted_then_stops_training(tmp_path):
  c = small_config('ddrl', num_iterations=5)
  c.reward.fns = ml_collections.ConfigDict({'debug_crash': 1.0})
  c.reward.kwargs = ml_collections.ConfigDict()
  c.reward.workers, c.reward.max_failed_batches = 1, 2
  trainer = trainer_lib.Trainer(c, tmp_path)
  with pytest.raises(rewards.RewardServiceError, match='2 reward batches in a row failed'):
    trainer.train(progress=False)
  rows = [r for r in metrics_lib.read_metrics(tmp_path) if 'loss' in r]
  assert len(rows) == 1                                    # the first failed batch was still trained
  assert rows[0]['failed_rewards'] == c.batch_size * c.num_rollouts
  assert rows[0]['reward_failures/crash'] >= 1 and rows[0]['adv_abs_mean'] == 0.0


def _records_config(path, **overrides):
  c = small_config('ddrl', **overrides)
  c.data.path = str(path)
  return c


@pytest.mark.slow
def test_synthesized_records_train_and_resume_continues_the_stream(tmp_path):
  base = small_config('ddrl')
  summary = synthesize.synthesize(base, str(tmp_path / 'syn'), per_prompt=100, batch=64,
                                  progress=False)
  assert summary['num_records'] == 100 and summary['skipped_nonfinite'] == 0
  recs = records_lib.read_all(str(tmp_path / 'syn'))
  task_samples = np.stack([r['sample'] for r in recs])
  assert task_samples.shape == (100, 2) and np.isfinite(task_samples).all()
  # The base model's samples look like its data (the 4-mode mixture), not like noise.
  assert np.abs(task_samples).mean() > 0.8

  straight = _records_config(tmp_path / 'syn', num_iterations=4)
  trainer_lib.Trainer(straight, tmp_path / 'straight').train(progress=False)
  trainer_lib.Trainer(_records_config(tmp_path / 'syn', num_iterations=2),
                      tmp_path / 'resumed').train(progress=False)
  resumed = trainer_lib.Trainer(straight, tmp_path / 'resumed')
  resumed.train(progress=False)
  a = {r['step']: r for r in metrics_lib.read_metrics(tmp_path / 'straight') if 'loss' in r}
  b = {r['step']: r for r in metrics_lib.read_metrics(tmp_path / 'resumed') if 'loss' in r}
  assert sorted(a) == sorted(b) == [1, 2, 3, 4]
  for step in (3, 4):
    assert b[step]['data_records_seen'] == step * straight.batch_size   # every batch used once
    for k, v in a[step].items():
      if not metrics_lib.is_wall_clock(k):
        np.testing.assert_allclose(b[step][k], v, rtol=1e-6, atol=1e-9, err_msg=f'step {step} {k}')
  assert os.path.isdir(tmp_path / 'resumed' / 'checkpoints' / '4' / 'data')


def test_corrupt_record_stops_or_is_skipped_in_training(tmp_path):
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  good = [records_lib.encode_record({'prompt': '', 'sample': np.full(2, i, np.float32)})
          for i in range(40)]
  path = tmp_path / 'bad.array_record'
  writer = array_record_module.ArrayRecordWriter(str(path), 'group_size:1')
  for i, raw in enumerate(good):
    writer.write(b'\x00garbage' if i == 3 else raw)
  writer.close()
  c = _records_config(path, num_iterations=2)
  c.data.shuffle = False
  with pytest.raises(records_lib.RecordError, match=r'bad\.array_record\[3\]'):
    trainer_lib.Trainer(c, tmp_path / 'strict').train(progress=False)
  c.data.skip_bad = True
  trainer_lib.Trainer(c, tmp_path / 'lenient').train(progress=False)
  rows = [r for r in metrics_lib.read_metrics(tmp_path / 'lenient') if 'loss' in r]
  assert rows[-1]['data_records_skipped'] == 1
