"""The pure DDRL/GRPO update: train state, rollout and data batches, advantages, the two-half update
(data gradient while rewards are pending, then the policy gradient and AdamW), and the jitted functions of
one iteration with their shardings. The loop around them (rollouts -> rewards -> update, checkpoints,
metrics) is `trainer.Trainer`; `ddrl_jax.aot` compiles the same functions for a TPU slice.
"""
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddrl_jax import config as config_lib
from ddrl_jax import optim
from ddrl_jax import parallel
from ddrl_jax import rl as rl_lib
from ddrl_jax import sampling
from ddrl_jax.models import lora as lora_lib
from ddrl_jax.parallel import micro_batch


class TrainState(NamedTuple):
  """The trained state. With LoRA (config.lora.rank > 0) `params` and every copy of it (optimizer
  moments, EMA, DiffusionNFT's old policy) are the adapters alone and `frozen` is the base model; the
  reference of a KL term is the base itself (adapters at zero), so no copy of it is kept."""
  step: Any            # () int32: optimizer steps taken
  params: Any          # fp32 master parameters (the trained ones: all, or the LoRA adapters)
  opt_state: Any
  ema_params: Any      # power EMA of params (None if disabled)
  ref_params: Any      # frozen reference (flow_grpo / diffusion_nft with kl_beta > 0, full fine-tuning)
  old_params: Any = None  # diffusion_nft's old policy (samples the rollouts; EMA of params); else None
  frozen: Any = None   # the base model under LoRA (never trained, not checkpointed); else None


class RolloutBatch(NamedTuple):
  """Rollouts as the trainer shards them: one rollout per slot, B*N slots over (data, fsdp).

  cosmos-rl runs one rollout per data-parallel instance (16 groups x 8 = 128 instances), so the slot
  axis, not the group axis, is what must divide the mesh. Slot b*N + n is rollout n of group b.
  """
  traj: sampling.Trajectory   # (B*N, 1, ...)
  rewards: Any                # (B*N, R) float32, one column per reward; NaN/Inf = failed sample
  cond: Any                   # pytree of (B*N, ...): each group's condition repeated N times


def flat_rollout_batch(traj, rewards, cond):
  """A `RolloutBatch` from group-layout rollouts: traj (B, N, ...), rewards (B, N[, R]), cond (B, ...)."""
  b, n = rewards.shape[:2]
  flat = lambda a: a.reshape((b * n, 1) + a.shape[2:])
  return RolloutBatch(traj=jax.tree.map(flat, traj), rewards=jnp.reshape(rewards, (b * n, -1)),
                      cond=rl_lib.repeat_groups(cond, n))


def group_rollout_batch(rollout, n):
  """Inverse of `flat_rollout_batch`: (traj (B, N, ...), rewards (B, N, R), cond (B, ...))."""
  group = lambda a: a.reshape((a.shape[0] // n, n) + a.shape[2:])
  cond = jax.tree.map(lambda a: a.reshape((a.shape[0] // n, n) + a.shape[1:])[:, 0], rollout.cond)
  rewards = None if rollout.rewards is None else rollout.rewards.reshape(
      (-1, n) + rollout.rewards.shape[1:])
  return jax.tree.map(group, rollout.traj), rewards, cond


class DataBatch(NamedTuple):
  """Clean data paired with the B group conditions (replicated: B need not divide the mesh)."""
  x0: Any                     # (B, *S)
  cond: Any                   # pytree of (B, ...)


def compute_advantages(rewards, config):
  """(B, N, R) rewards -> (B, N) advantages, in cosmos-rl's order (ddrl_jax/rl/advantages.py): each
  reward normalized by config.rl.adv_normalization, combined by config.reward.combine, then
  config.rl.adv_transform, the clamp at config.rl.adv_clip and config.rl.failed_advantage.

  Every group is taken as its own prompt (the trainer draws one condition per group), so FlowGRPO's
  per-prompt statistics are per-group statistics here."""
  b, n, _ = rewards.shape
  rl = config.rl
  if rl.adv_transform == 'exact':
    per_reward = lambda r: rl_lib.exact_tilt_advantages(r, n, rl.exact_beta, rl.exact_log_partition)
    transform, clip = None, None
  else:
    per_reward = lambda r: rl_lib.normalized_rewards(r, n, rl.adv_normalization, eps=rl.adv_eps,
                                                     global_std=rl.adv_global_std)
    transform, clip = rl.adv_transform or None, rl.adv_clip
  weights = list(config.reward.fns.values())
  adv = rl_lib.multi_reward_advantages(rewards.reshape(b * n, -1), weights, per_reward,
                                       config.reward.combine, transform=transform, clip=clip,
                                       failed=rl.failed_advantage)
  return adv.reshape(b, n)


def make_sampler(config):
  s = config.sampler
  return sampling.make_sampler(config_lib.sampler_kind(config), s.num_steps, sigma_min=s.sigma_min,
                               sigma_max=s.sigma_max, rho=s.rho, s_churn=s.s_churn,
                               s_noise=s.s_noise, shift=s.shift, noise_level=s.noise_level,
                               eta=s.eta)


def make_eval_sampler(config):
  """The evaluation sampler: the training one, with config.sampler.eval_num_steps steps when > 0 and
  without noise when config.sampler.eval_deterministic."""
  s = config.sampler
  steps = s.get('eval_num_steps', 0)
  sampler = make_sampler(config) if not steps else sampling.make_sampler(
      config_lib.sampler_kind(config), steps, sigma_min=s.sigma_min, sigma_max=s.sigma_max, rho=s.rho,
      s_churn=s.s_churn, s_noise=s.s_noise, shift=s.shift, noise_level=s.noise_level, eta=s.eta)
  return sampler.deterministic() if s.get('eval_deterministic', False) else sampler


def init_train_state(params, config, optimizer, frozen=None):
  """The state at step 0 of the trained `params` (with LoRA: the adapters, `frozen` the base)."""
  algo = rl_lib.get_algorithm(config.algorithm)
  copy = lambda p: jax.tree.map(jnp.array, p)
  full = frozen is None
  return TrainState(
      step=jnp.int32(0), params=params, opt_state=optimizer.init(params),
      ema_params=copy(params) if config.optim.ema_power_s else None,
      ref_params=copy(params) if full and algo.uses_reference and config.rl.kl_beta > 0 else None,
      old_params=algo.init_old(params),
      frozen=frozen)


def model_params(state, params=None):
  """What the step functions run the model with: `params` (default the trained ones), paired with the
  frozen base under LoRA (`lora.Adapted`)."""
  params = state.params if params is None else params
  return params if state.frozen is None else lora_lib.Adapted(params, state.frozen)


def rollout_params(state):
  """The parameters that sample the rollouts: diffusion_nft's old policy, else the trained ones."""
  return model_params(state, state.params if state.old_params is None else state.old_params)


def _bound(apply_fn, cast_params, params):
  """(apply_fn over the trained part, that part) of step-function params: under LoRA the frozen base
  (cast to the compute dtype once) is bound into apply_fn and gradients are taken w.r.t. the adapters."""
  if isinstance(params, lora_lib.Adapted):
    return lora_lib.bind(apply_fn, cast_params(params.frozen)), params.trainable
  return apply_fn, cast_params(params)


def _slot_view(a):
  """(B, N, ...) -> (B*N, 1, ...): each rollout slot as a group of one (slot b*N + n is rollout n of b)."""
  return a.reshape((a.shape[0] * a.shape[1], 1) + a.shape[2:])


def make_update_fns(apply_fn, sampler, config, optimizer, cast_params=None, batch_shards=1):
  """The update in two pure halves, so the data term can run while rewards are pending.

    data_grads(params, rollout, data, key) -> (grads, metrics)      needs no rewards
    update(state, rollout, data, grads, key) -> (state, metrics)     adds the policy gradient

  `grads` is the float32 gradient of loss_scale * data_beta * the diffusion loss (None for algorithms
  without a data term). Both halves draw the trained steps and the loss noise from `key` exactly as
  `rl_loss` does, so update(state, .., data_grads(state.params, ..)[0], key) equals one fused step.
  Gradients are accumulated one trained step at a time (`rl.rl_loss_and_grad`), so memory does not grow
  with the number of trained steps. `cast_params` (e.g. the task's bf16 compute copy) is applied to the
  parameters once, before the step scan; gradients are taken with respect to that copy.

  With config.micro_batch > 0 both halves run the B*N slots in C chunks over `batch_shards`
  data-parallel positions (`parallel.micro_batch`): a scan over the chunks accumulates each chunk's
  float32 gradient / C. Advantages are computed over whole groups first; every random draw is per slot
  and every masked mean divides by the whole batch's count (`rl.algorithms` module docstring), so the
  chunked update equals the unchunked one up to float summation order, metrics included (means are
  averaged over the equal-sized chunks, `Algorithm.MAX_METRICS` maxed).
  """
  cast_params = cast_params or (lambda p: p)
  algo = rl_lib.get_algorithm(config.algorithm)
  rl = config.rl
  options = rl_lib.RLOptions.from_mapping(rl)
  pool = config_lib.train_steps(config)
  gamma = optim.power_ema_gamma(config.optim.ema_power_s) if config.optim.ema_power_s else None
  lr_schedule = optim.learning_rate_schedule(config.optim)
  use_data = algo.uses_data and rl.data_beta > 0
  num_chunks = config_lib.slot_chunks(config, batch_shards)
  chunks = lambda tree: micro_batch.to_chunks(tree, num_chunks, batch_shards)

  def per_slot(traj, steps, key):
    """(traj (S, 1, ...), steps (S, 1, K), per-slot keys (S, 1)) of group-layout (B, N, ...) inputs."""
    b, n = steps.shape[:2]
    return jax.tree.map(_slot_view, traj), _slot_view(steps), _slot_view(rl_lib.slot_keys(key, b, n))

  def prepare(rollout, key):
    k_steps, k_loss = jax.random.split(key)
    traj, rewards, cond = group_rollout_batch(rollout, config.num_rollouts)
    b, n = traj.x0.shape[:2]
    steps = algo.select_steps(k_steps, b, n, pool, rl.train_fraction)
    return traj, rewards, cond, steps, k_loss

  def data_term(data):
    return rl_lib.DataTerm(x0=data.x0, cond=data.cond, beta=rl.data_beta, steps=rl.data_loss_steps,
                           noise=rl.data_noise, cond_dropout=rl.cond_dropout,
                           weighting=rl.data_weighting)

  def data_grads(params, rollout, data, key):
    if not use_data:
      return None, {}
    traj, _, _, steps, k_loss = prepare(rollout, key)
    apply, trained = _bound(apply_fn, cast_params, params)
    if num_chunks == 1:
      value, grads = rl_lib.data_loss_and_grad(apply, trained, sampler, traj, steps, data_term(data),
                                               k_loss)
    else:
      n = steps.shape[1]
      slot_data = DataBatch(x0=rl_lib.repeat_groups(data.x0, n), cond=rl_lib.repeat_groups(data.cond, n))

      def body(acc, xs):
        traj_c, steps_c, keys_c, data_c = xs
        value, grads = rl_lib.data_loss_and_grad(apply, trained, sampler, traj_c, steps_c,
                                                 data_term(data_c), keys_c)
        return rl_lib.accumulate(acc, grads, 1.0 / num_chunks), value

      grads, values = jax.lax.scan(body, rl_lib.f32_zeros(trained),
                                   chunks(per_slot(traj, steps, k_loss) + (slot_data,)))
      value = values.mean()
    scale = rl.loss_scale * rl.data_beta
    return jax.tree.map(lambda g: scale * g, grads), {'data_loss': value}

  def update(state, rollout, grads_data, key):
    traj, rewards, cond, steps, k_loss = prepare(rollout, key)
    advantages = compute_advantages(rewards, config)
    apply, trained = _bound(apply_fn, cast_params, model_params(state))
    ref = None if state.ref_params is None else cast_params(state.ref_params)
    if state.frozen is not None and algo.uses_reference and rl.kl_beta > 0:
      ref = jax.tree.map(jnp.zeros_like, trained)    # the base: adapters contribute exactly 0
    old = None if state.old_params is None else cast_params(state.old_params)
    valid = jnp.isfinite(rewards).all(-1)
    if num_chunks == 1:
      _, metrics, grads = algo.loss_and_grad(apply, trained, ref, sampler, traj, advantages, steps,
                                             rollout.cond, None, k_loss, options, old_params=old, valid=valid)
    else:
      mean_total = algo.mean_total(advantages, valid, options, num_chunks)

      def body(acc, xs):
        traj_c, steps_c, keys_c, adv_c, valid_c, cond_c = xs
        _, m, g = algo.loss_and_grad(apply, trained, ref, sampler, traj_c, adv_c, steps_c, cond_c, None,
                                     keys_c, options, old_params=old, valid=valid_c, mean_total=mean_total)
        return rl_lib.accumulate(acc, g, 1.0 / num_chunks), m

      grads, per_chunk = jax.lax.scan(body, rl_lib.f32_zeros(trained), chunks(
          per_slot(traj, steps, k_loss) + (_slot_view(advantages), _slot_view(valid), rollout.cond)))
      metrics = {k: v.max() if k in algo.MAX_METRICS else v.mean() for k, v in per_chunk.items()}
    if grads_data is not None:
      grads = jax.tree.map(jnp.add, grads, grads_data)
    grads, nonfinite = optim.zero_nonfinite(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    ema = state.ema_params
    if ema is not None:
      beta = optim.power_ema_beta(state.step, gamma)
      ema = optim.ema_update(ema, params, beta)
      metrics['ema_beta'] = beta
    old, old_metrics = algo.update_old(state.old_params, params, state.step, options)
    metrics.update(old_metrics)
    failed = ~jnp.isfinite(rewards).all(-1)   # any non-finite reward = failed sample (advantage 0)
    valid = jnp.where(failed[..., None], 0.0, rewards)
    # Means over the valid samples; NaN when none is valid (not 0, which would look like a score).
    num_valid = (~failed).sum()
    mean_valid = lambda total: jnp.where(num_valid > 0, total / jnp.maximum(num_valid, 1), jnp.nan)
    weights = jnp.asarray(list(config.reward.fns.values()), jnp.float32)
    for i, name in enumerate(config.reward.fns):
      metrics[f'reward/{name}'] = mean_valid(valid[..., i].sum())
    params_finite = jnp.all(jnp.stack([jnp.isfinite(p).all() for p in jax.tree.leaves(params)]))
    metrics.update(
        reward_mean=mean_valid((valid @ weights).sum()),
        failed_rewards=failed.sum(), adv_mean=advantages.mean(), adv_abs_mean=jnp.abs(advantages).mean(),
        grad_norm=optax.tree.norm(grads), nonfinite_grads=nonfinite, params_finite=params_finite,
        learning_rate=lr_schedule(state.step), nfe_rollout=traj.nfe.mean())
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, ema_params=ema,
                           ref_params=state.ref_params, old_params=old, frozen=state.frozen)
    return new_state, metrics

  return data_grads, update


def combine_metrics(metrics, data_metrics, config):
  """Adds the data term's metrics to the update's; 'loss' becomes the total loss."""
  metrics = dict(metrics)
  if 'data_loss' in data_metrics:
    metrics['data_loss'] = data_metrics['data_loss']
    metrics['loss'] = metrics['loss'] + config.rl.loss_scale * config.rl.data_beta * \
        data_metrics['data_loss']
  return metrics


def make_train_step(apply_fn, sampler, config, optimizer, cast_params=None, batch_shards=1):
  """The fused pure update (state, rollout, data, key) -> (state, metrics); jit with `jit_train_step`.
  batch_shards: the mesh's data-parallel size (where config.micro_batch chunks the slots)."""
  data_grads, update = make_update_fns(apply_fn, sampler, config, optimizer, cast_params, batch_shards)

  def train_step(state, rollout, data, key):
    grads, data_metrics = data_grads(model_params(state), rollout, data, key)
    state, metrics = update(state, rollout, grads, key)
    return state, combine_metrics(metrics, data_metrics, config)

  return train_step


def jit_train_step(train_step, plan, state_shardings):
  """jit of the fused step with the plan's shardings: state by the logical rules (donated), rollouts split
  on B*N over (data, fsdp), the data batch as placed (`place_data`), metrics replicated."""
  rep = plan.replicated()
  return jax.jit(plan.scope(train_step), in_shardings=(state_shardings, plan.batch(), None, rep),
                 out_shardings=(state_shardings, rep), donate_argnums=(0,))


def make_sample_fn(sampler, apply_fn, sample_shape, mesh, param_shardings=None, plan=None,
                   cast_params=None):
  """jit of (params, cond (M, ...), key) -> (M, 1, *sample_shape) final samples, one per slot.

  Parameters are replicated unless `param_shardings` (with its `plan`) is given."""
  plan = plan or parallel.ShardingPlan.from_config({}, mesh)
  cast_params = cast_params or (lambda p: p)
  params_sh = param_shardings if param_shardings is not None else plan.replicated()
  fn = lambda p, cond, k: sampler.sample(*_bound(apply_fn, cast_params, p), cond, k, num_rollouts=1,
                                         sample_shape=sample_shape)
  return jax.jit(plan.scope(fn), in_shardings=(params_sh, plan.batch(), plan.replicated()),
                 out_shardings=plan.batch())


def make_rollout_fn(sampler, apply_fn, sample_shape, config, cast_params=None, batch_shards=1):
  """(params, slot cond (S, ...), key) -> Trajectory (S, 1, ...): one rollout per slot, in
  config.micro_batch chunks of slots (`parallel.micro_batch`) when set. Slot i draws its noise from
  split(key, (S, 1))[i] however the slots are chunked, so the trajectories are those of one batch. The
  chunks run under `lax.map` (one compiled chunk, a loop on the device: the T-step scan inside keeps
  its memory per chunk; a host loop would add a dispatch and a device-to-host sync per chunk)."""
  cast = cast_params or (lambda p: p)
  num_chunks = config_lib.slot_chunks(config, batch_shards)

  def rollout(params, cond, key):
    apply, trained = _bound(apply_fn, cast, params)
    run = lambda c, k: sampler.rollout(apply, trained, c, k, num_rollouts=1, sample_shape=sample_shape)
    if num_chunks == 1:
      return run(cond, key)
    keys = jax.random.split(key, (jax.tree.leaves(cond)[0].shape[0], 1))
    out = jax.lax.map(lambda xs: run(*xs),
                      micro_batch.to_chunks((cond, keys), num_chunks, batch_shards))
    return micro_batch.from_chunks(out, batch_shards)

  return rollout


class StepFns(NamedTuple):
  """The jitted functions of one iteration (with their shardings; `ddrl_jax.aot` compiles the same)."""
  rollout: Any      # (params, slot cond (B*N, ...), key) -> Trajectory (B*N, 1, ...)
  sample: Any       # (params, cond (M, ...), key) -> (M, 1, *S) final samples
  data_grads: Any   # (params, rollout, data, key) -> (data-term grads | None, metrics)
  update: Any       # (state, rollout, grads, key) -> (state, metrics); state and grads donated


def uses_data_grads(config):
  return rl_lib.get_algorithm(config.algorithm).uses_data and config.rl.data_beta > 0


def build_step_fns(config, plan, state_shardings, apply_fn, sampler, sample_shape, optimizer,
                   cast_params=None):
  """jit the rollout, sampler, data-gradient and update functions with the plan's shardings.

  Parameters and state follow the logical rules, rollouts and slot conditions are split on B*N over
  (data, fsdp), the data batch comes as `place_data` put it, metrics are replicated. The update donates
  the state it replaces (the data gradient cannot alias an output, so it is not donated). Every function
  traces under the plan, so the model's activation constraints and context-parallel attention see the
  mesh."""
  sh, batch, rep = state_shardings, plan.batch(), plan.replicated()
  cast = cast_params or (lambda p: p)
  shards = parallel.data_parallel_size(plan.mesh)
  rollout = make_rollout_fn(sampler, apply_fn, sample_shape, config, cast, shards)
  data_grads, update = make_update_fns(apply_fn, sampler, config, optimizer, cast, batch_shards=shards)
  grads_sh = sh.params if uses_data_grads(config) else None
  model_sh = model_params(sh)          # the shardings of model_params(state)
  return StepFns(
      rollout=jax.jit(plan.scope(rollout), in_shardings=(model_sh, batch, rep), out_shardings=batch),
      sample=make_sample_fn(make_eval_sampler(config), apply_fn, sample_shape, plan.mesh, model_sh, plan,
                            cast),
      data_grads=jax.jit(plan.scope(data_grads), in_shardings=(model_sh, batch, None, rep),
                         out_shardings=(grads_sh, rep)),
      update=jax.jit(plan.scope(update), in_shardings=(sh, batch, grads_sh, rep),
                     out_shardings=(sh, rep), donate_argnums=(0,)))


def place_data(plan, data):
  """A DataBatch on the mesh: each leaf's leading B axis over as many batch axes as divide B."""
  return jax.tree.map(lambda a: parallel.place(a, plan.sharding(('act_batch',), np.shape(a), 'data')),
                      data)
