"""Config validation: runs before anything compiles and names the offending key."""
from ddrl_jax import rewards
from ddrl_jax import sampling
from ddrl_jax.models import lora as lora_lib
from ddrl_jax.parallel import mesh as mesh_lib
from ddrl_jax.parallel import plan as plan_lib
from ddrl_jax.parallel import rules as rules_lib
from ddrl_jax.rl import options as rl_options
from ddrl_jax.rl import registry as algorithms

ADV_TRANSFORMS = rl_options.ADV_TRANSFORMS


class ConfigError(ValueError):
  """A bad config value; the message starts with the key (`key`, when one key is at fault)."""

  def __init__(self, message, key=None):
    super().__init__(message)
    self.key = key


def _check(ok, key, value, why):
  if not ok:
    raise ConfigError(f'config.{key}={value!r}: {why}', key)


def sampler_kind(config):
  """The sampler kind in use: config.sampler.kind or the algorithm's default."""
  return config.sampler.kind or algorithms.get_algorithm(config.algorithm).default_sampler


def train_steps(config):
  """The trained steps (fixed algorithms) or candidate pool (random ones) as a tuple."""
  algo = algorithms.get_algorithm(config.algorithm)
  steps = config.rl.train_steps
  return tuple(steps) if steps is not None else algo.default_train_steps(config.sampler.num_steps)


def validate(config, num_devices):
  """Raises ConfigError (a ValueError) naming the first bad key; returns the resolved mesh shape."""
  _check(config.algorithm in algorithms.ALGORITHMS, 'algorithm', config.algorithm,
         f'unknown algorithm; known: {sorted(algorithms.ALGORITHMS)}')
  algo = algorithms.get_algorithm(config.algorithm)
  _check(config.num_rollouts >= 2, 'num_rollouts', config.num_rollouts,
         'need N >= 2 rollouts per group for a group-relative advantage')
  _check(config.batch_size >= 1, 'batch_size', config.batch_size, 'need at least one group')
  _check(config.num_iterations >= 0, 'num_iterations', config.num_iterations, 'must be >= 0')
  for key in ('log_every', 'checkpoint_every', 'max_checkpoints', 'max_nonfinite_steps'):
    _check(config[key] >= 1, key, config[key], 'must be >= 1')
  _check(config.eval_every >= -1, 'eval_every', config.eval_every,
         'must be >= 0 (0: at the start and the end only) or -1 (no evaluation at step 0)')
  _check(config.eval_samples >= 1, 'eval_samples', config.eval_samples, 'must be >= 1')
  _check(config.eval_videos >= 0, 'eval_videos', config.eval_videos, 'must be >= 0 (0: no MP4s)')
  _check(config.eval_video_fps > 0, 'eval_video_fps', config.eval_video_fps, 'must be > 0')
  if 'reward' in config and 'fns' in config.reward:
    from ddrl_jax.rewards import service as reward_service  # pylint: disable=g-import-not-at-top
    problem = reward_service.in_process_problem(config.reward)
    _check(not problem, 'reward.workers', config.reward.get('workers'), problem)
  if 'data' in config:
    base_samples = config.data.get('base_samples', 0)
    _check(isinstance(base_samples, int) and base_samples >= 0, 'data.base_samples', base_samples,
           "must be an integer >= 0 (0: the task's own data or data.path)")
  kind = sampler_kind(config)
  _check(kind in sampling.KINDS, 'sampler.kind', kind, f'unknown sampler; known: {sampling.KINDS}')
  num_steps = config.sampler.num_steps
  _check(num_steps >= 2, 'sampler.num_steps', num_steps, 'need T >= 2 steps')
  eval_steps = config.sampler.get('eval_num_steps', 0)
  _check(eval_steps == 0 or eval_steps >= 2, 'sampler.eval_num_steps', eval_steps,
         'need 0 (the training sampler) or >= 2 evaluation steps')
  rl = config.rl
  try:
    options = rl_options.RLOptions.from_mapping(rl)
  except (TypeError, ValueError) as e:
    raise ConfigError(f'config.rl: {e}') from None
  for key, value, why in options.problems():
    _check(False, f'rl.{key}', value, why)
  steps = train_steps(config)
  _check(len(steps) > 0, 'rl.train_steps', steps, 'no trained steps')
  bad = [s for s in steps if not 0 <= s < num_steps]
  _check(not bad, 'rl.train_steps', steps,
         f'indices {bad} are outside [0, T) with T = sampler.num_steps = {num_steps}')
  _check(len(set(steps)) == len(steps), 'rl.train_steps', steps, 'duplicate step indices')
  if kind in ('cosmos_2ab', 'ddim') and algo.trains_transitions:
    _check(num_steps - 1 not in steps, 'rl.train_steps', steps,
           f'step T-1 = {num_steps - 1} of {kind} is deterministic (no Gaussian transition to train)')
  for key, value, why in algo.problems(options, kind):
    _check(False, f'rl.{key}', value, why)
  o = config.optim
  _check(o.learning_rate > 0, 'optim.learning_rate', o.learning_rate, 'must be > 0')
  _check(o.grad_clip > 0, 'optim.grad_clip', o.grad_clip, 'must be > 0')
  _check(o.warmup_steps >= 0, 'optim.warmup_steps', o.warmup_steps, 'must be >= 0')
  _check(o.ema_power_s is None or o.ema_power_s > 0, 'optim.ema_power_s', o.ema_power_s,
         'must be > 0 or None')
  try:
    rewards.RewardSpec.from_config(config.reward)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  r = config.reward
  _check(r.backend in ('local', 'redis'), 'reward.backend', r.backend, "known: 'local', 'redis'")
  _check(r.workers >= 0, 'reward.workers', r.workers, 'must be >= 0 (0: score in a thread)')
  _check(r.chunk_size >= 1, 'reward.chunk_size', r.chunk_size, 'must be >= 1')
  _check(r.timeout_s > 0 and r.chunk_timeout_s > 0, 'reward.timeout_s', r.timeout_s,
         'timeouts must be > 0')
  _check(r.max_failed_batches >= 1, 'reward.max_failed_batches', r.max_failed_batches, 'must be >= 1')
  _check(r.get('no_server_grace_s', 60.0) > 0, 'reward.no_server_grace_s', r.get('no_server_grace_s'),
         'must be > 0 (seconds without a live reward server before a batch fails)')
  if rl.adv_transform == 'exact':
    _check(len(r.fns) == 1 or r.combine == 'weighted_sum', 'reward.combine', r.combine,
           "the exact tilt transform needs one reward or combine='weighted_sum'")
  if 'lora' in config:
    try:
      lora_lib.validate(lora_lib.from_config(config))
    except ValueError as e:
      raise ConfigError(str(e), str(e).split('=')[0].split(' ')[0].replace('config.', '')) from None
  try:
    shape = mesh_lib.mesh_shape(config.mesh, num_devices)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  dp = shape[mesh_lib.AXES.index('data')] * shape[mesh_lib.AXES.index('fsdp')]
  slots = config.batch_size * config.num_rollouts
  _check(slots % dp == 0, 'batch_size', config.batch_size,
         f'batch_size * num_rollouts = {slots} rollouts are not divisible by the data-parallel mesh '
         f'size data*fsdp = {dp} (one rollout slot per data-parallel position)')
  micro = config.get('micro_batch', 0)
  _check(isinstance(micro, int) and micro >= 0, 'micro_batch', micro,
         'must be an int >= 0 (rollout slots per device per chunk; 0: the whole batch in one chunk)')
  if micro and slots % dp == 0:
    _check((slots // dp) % micro == 0, 'micro_batch', micro,
           f'must divide the {slots // dp} rollout slots per data-parallel position (batch_size '
           f'{config.batch_size} x num_rollouts {config.num_rollouts} / data*fsdp {dp}); 0: one chunk')
  _validate_sharding(config, dict(zip(mesh_lib.AXES, shape)))
  return shape


def slot_chunks(config, batch_shards):
  """How many chunks the B*N rollout slots run in over `batch_shards` data-parallel positions
  (config.micro_batch slots per position per chunk; 1 when it is 0 or covers the batch)."""
  micro = config.get('micro_batch', 0)
  per_shard = config.batch_size * config.num_rollouts // batch_shards
  return per_shard // micro if micro else 1


def _attention_shape(config):
  """The model family's `AttentionShape` (heads, sequence blocks), or None (no attention, no task)."""
  if not config.get('task'):
    return None
  from ddrl_jax import tasks  # pylint: disable=g-import-not-at-top
  try:
    return tasks.get_family(config).attention_shape()
  except ValueError as e:
    raise ConfigError(str(e), 'model_family' if 'model_family' in str(e) else 'task') from None


def _validate_sharding(config, sizes):
  """config.sharding against the mesh sizes {axis: size} and the model's heads and latent frames."""
  s = config.get('sharding')
  if s is None:
    return
  _check(s.context_impl in plan_lib.CONTEXT_IMPLS, 'sharding.context_impl', s.context_impl,
         f'known: {plan_lib.CONTEXT_IMPLS}')
  _check(0 <= s.max_replicated_fraction <= 1, 'sharding.max_replicated_fraction',
         s.max_replicated_fraction, 'must be in [0, 1]')
  fsdp = rules_lib.resolve_rules({'x': 'fsdp'}, s.fsdp_axes)['x']
  bad = [a for a in fsdp if a not in mesh_lib.AXES]
  _check(not bad, 'sharding.fsdp_axes', s.fsdp_axes, f'unknown mesh axes {bad}; known: {mesh_lib.AXES}')
  try:
    rules_lib.resolve_rules(s.rules, s.fsdp_axes, mesh_lib.AXES)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  cp, tp = sizes['context'], sizes['tensor']
  shape = _attention_shape(config)
  if cp == 1 or shape is None:
    return
  heads, frames = shape.heads, shape.seq_blocks
  key = shape.key
  _check(frames % cp == 0, key, shape.value if key != 'mesh.context' else cp,
         f'{frames} latent frames do not divide over mesh.context = {cp} (the sequence is sharded by '
         f'latent frames)')
  if s.context_impl == 'ulysses':
    _check(heads % (cp * tp) == 0, 'mesh.context', cp,
           f'Ulysses attention splits the {heads} heads over context x tensor = {cp * tp} devices; '
           f'they do not divide (use sharding.context_impl=ring or another mesh.context)')
