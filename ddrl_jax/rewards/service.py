"""The reward service the trainer talks to: submit decoded samples now, collect the scores later.

    service = make_reward_service(config.reward)
    pending = service.submit(samples_u8, prompts)      # returns at once
    ...                                                # the trainer computes the data loss meanwhile
    result = pending.result()                          # RewardResult; NaN = failed sample

Backends (config.reward.backend):
  'local': the embedded default. `pool.WorkerPool` processes on this host (workers > 0), or an
    `InlinePool` thread (workers = 0) for cheap rewards such as the toy task's.
  'redis': `redis_backend.RedisRewardClient`, a queue served by any number of
    ``python -m ddrl_jax.rewards.serve --redis=URL`` processes on any hosts.
"""
import dataclasses
import os
from typing import Dict, Tuple

import numpy as np

from ddrl_jax.rewards import pool as pool_lib
from ddrl_jax.rewards import registry

COMBINE_MODES = ('advantage_mean', 'weighted_sum')


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """Which rewards, their weights and constructor arguments, and how they combine.

  weights: name -> weight, in a fixed order (the columns of the (M, R) reward matrix).
  kwargs: name -> keyword arguments of the reward's factory.
  combine: 'advantage_mean' (cosmos-rl: a group advantage per reward, then their weighted mean) or
    'weighted_sum' (one advantage of sum_i w_i r_i).
  imports: modules that register custom rewards (imported in the trainer and in every worker).
  bounds: name -> (low, high) of a valid score, over registry.SCORE_BOUNDS (config.reward.bounds).
  """
  weights: Dict[str, float]
  kwargs: Dict[str, dict]
  combine: str = 'advantage_mean'
  imports: Tuple[str, ...] = ()
  bounds: Dict[str, tuple] = dataclasses.field(default_factory=dict)

  @property
  def names(self):
    return list(self.weights)

  @classmethod
  def from_config(cls, reward_config):
    """From a ``config.reward`` ConfigDict; raises ValueError naming the bad key."""
    fns = dict(reward_config.fns)
    if not fns:
      raise ValueError('config.reward.fns is empty: name at least one reward, e.g. {"ocr": 1.0}')
    registry.import_modules(reward_config.imports)
    known = registry.known_rewards()
    for name, w in fns.items():
      if name not in known:
        raise ValueError(f'config.reward.fns: unknown reward {name!r}; known: {known}')
      if not float(w) > 0:
        raise ValueError(f'config.reward.fns.{name}={w!r}: weights must be > 0')
    kwargs = {k: dict(v) for k, v in dict(reward_config.kwargs).items()}
    # Kwargs of known rewards that do not train are allowed: evaluation scores with them (e.g. the Cosmos
    # presets configure VideoAlign and VBench whichever one trains); an unknown name is a typo.
    stray = sorted(set(kwargs) - set(known))
    if stray:
      raise ValueError(f'config.reward.kwargs names unknown rewards: {stray}; known: {known}')
    if reward_config.combine not in COMBINE_MODES:
      raise ValueError(f'config.reward.combine={reward_config.combine!r}; known: {COMBINE_MODES}')
    bounds = {k: tuple(v) for k, v in dict(reward_config.get('bounds') or {}).items()}
    for name, bound in bounds.items():
      if name not in fns or len(bound) != 2 or not float(bound[0]) < float(bound[1]):
        raise ValueError(f'config.reward.bounds.{name}={bound!r}: give (low, high) with low < high for a '
                         f'reward in config.reward.fns')
    return cls(weights={k: float(v) for k, v in fns.items()},
               kwargs={n: kwargs.get(n, {}) for n in fns}, combine=reward_config.combine,
               imports=tuple(reward_config.imports),
               bounds={k: (float(v[0]), float(v[1])) for k, v in bounds.items()})


class LocalRewardService:
  """Rewards scored on this host by a worker pool (or inline), asynchronously."""

  def __init__(self, spec, *, workers=2, chunk_size=16, chunk_timeout_s=120.0,
               result_timeout_s=600.0, mesh=None):
    self.spec = spec
    self.chunk_size = chunk_size
    self.result_timeout_s = result_timeout_s
    if workers > 0:
      self.pool = pool_lib.WorkerPool(spec.kwargs, workers, chunk_timeout_s=chunk_timeout_s,
                                      imports=spec.imports)
    else:
      extra = {n: {'mesh': mesh} for n in spec.names if n in registry.IN_PROCESS and mesh is not None}
      self.pool = pool_lib.InlinePool(spec.kwargs, imports=spec.imports, extra_kwargs=extra)

  def submit(self, samples, prompts):
    return _Pending(self.pool.submit(samples, prompts, self.spec.names, self.chunk_size,
                                     self.spec.bounds), self.result_timeout_s)

  def close(self):
    self.pool.close()


class _Pending:
  """What `submit` returns: `done()` and `result()` (bounded by the service's result timeout)."""

  def __init__(self, job, timeout):
    self.job, self.timeout = job, timeout

  def done(self):
    return self.job.done()

  def result(self):
    return self.job.result(self.timeout)


def in_process_problem(reward_config):
  """'' or one line: JAX rewards (registry.IN_PROCESS) run in the trainer's process on its devices, so
  they need the local backend with reward.workers = 0."""
  names = [n for n in reward_config.fns if n in registry.IN_PROCESS]
  if names and (reward_config.get('backend', 'local') != 'local' or reward_config.get('workers', 0) > 0):
    return (f'{names} run JAX on the trainer\'s devices, in its process: set config.reward.backend=local '
            f'and config.reward.workers=0 (or use the PyTorch rewards of the same name without _jax '
            'in reward workers)')
  return ''


def make_reward_service(reward_config, mesh=None):
  """A `LocalRewardService` or `RedisRewardClient` from ``config.reward``. mesh: the devices in-process
  JAX rewards (registry.IN_PROCESS) run on (this process's devices)."""
  spec = RewardSpec.from_config(reward_config)
  c = reward_config
  problem = in_process_problem(c)
  if problem:
    raise ValueError(problem)
  if c.backend == 'local':
    return LocalRewardService(spec, workers=c.workers, chunk_size=c.chunk_size,
                              chunk_timeout_s=c.chunk_timeout_s, result_timeout_s=c.timeout_s, mesh=mesh)
  if c.backend == 'redis':
    from ddrl_jax.rewards import redis_backend  # pylint: disable=g-import-not-at-top
    token = os.environ.get(c.token_env, '')
    if not token:
      raise ValueError(f'config.reward.backend=redis needs a bearer token in the environment '
                       f'variable {c.token_env} (config.reward.token_env), the same the server has')
    return redis_backend.RedisRewardClient(
        c.redis_url, token, spec, chunk_size=c.chunk_size, timeout_s=c.timeout_s,
        retries=c.retries, task_ttl_s=c.task_ttl_s, no_server_grace_s=c.get('no_server_grace_s', 60.0))
  raise ValueError(f"config.reward.backend={c.backend!r}; known: 'local', 'redis'")


class ScoredElsewhere:
  """The pending result of a process whose rows another process (its row set's lead) scores: done at
  once, NaN scores and no failures; the trainer's exchange replaces the NaNs with the lead's scores."""

  def __init__(self, names, num):
    self.names, self.num = list(names), int(num)

  def done(self):
    return True

  def result(self):
    return pool_lib.RewardResult(scores={n: np.full((self.num,), np.nan, np.float32) for n in self.names},
                                 failures={k: 0 for k in pool_lib.FAILURE_KINDS}, errors=[])
