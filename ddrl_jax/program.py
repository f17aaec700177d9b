"""The training program of a config on a mesh, assembled in one place: the trainer, `python -m
ddrl_jax.aot` and benchmarks/gpu_step.py all build their sharding plan, optimizer, abstract train state,
state shardings and jitted step functions here, so what is compiled ahead of time is what trains.

    program = assemble(config, task, mesh, model_key)
    program.abstract_state, program.state_shardings      # nothing allocated
    fns = program.step_fns()                              # update.StepFns: rollout, sample, data_grads, update
    state = program.init_state(trained, frozen)           # the initial state on its shardings

Under LoRA the frozen base is kept in the compute dtype (the task's `cast_params`: the copy every step
would otherwise cast it to, in half the bytes).
"""
import dataclasses
from typing import Any, Callable, Optional

import jax

from ddrl_jax import config as config_lib
from ddrl_jax import optim
from ddrl_jax import parallel
from ddrl_jax import update as update_lib
from ddrl_jax.models import lora as lora_lib


@dataclasses.dataclass(frozen=True)
class Program:
  """What one config trains on one mesh (see the module docstring)."""
  config: Any
  task: Any
  plan: Any                      # parallel.ShardingPlan
  optimizer: Any                 # optax.GradientTransformation
  sampler: Any
  apply_fn: Callable
  cast_params: Optional[Callable]
  abstract_state: Any            # update.TrainState of ShapeDtypeStructs
  state_shardings: Any           # update.TrainState of shardings

  @property
  def lora(self):
    return lora_lib.from_config(self.config)

  def keep_frozen(self, frozen):
    """The frozen base as the state keeps it: in the compute dtype (unchanged without a cast)."""
    return frozen if frozen is None or self.cast_params is None else self.cast_params(frozen)

  def step_fns(self):
    """The jitted rollout, sample, data-gradient and update functions on the plan's shardings."""
    return update_lib.build_step_fns(self.config, self.plan, self.state_shardings, self.apply_fn, self.sampler,
                                     self.task.sample_shape, self.optimizer, self.cast_params)

  def init_state(self, trained, frozen):
    """The step-0 train state of (trained params, frozen base or None), placed on its shardings."""
    sh = self.state_shardings
    init = jax.jit(lambda p, f: update_lib.init_train_state(p, self.config, self.optimizer,
                                                           self.keep_frozen(f)),
                   in_shardings=(sh.params, sh.frozen), out_shardings=sh)
    return init(trained, frozen)


def assemble(config, task, mesh, model_key, plan=None):
  """The `Program` of `config` for `task` on `mesh`; the model's abstract parameters come from
  `model_key` (their values do not matter here). `plan`: the run's ShardingPlan when the caller already
  holds one. Raises ConfigError for LoRA on a model without adapters."""
  plan = plan or parallel.ShardingPlan.for_model(config, mesh, task.family)
  optimizer = optim.make_optimizer(config.optim)
  spec = lora_lib.from_config(config)
  apply_fn, abstract_params = task.abstract_params(model_key)
  trained, frozen = lora_lib.split(abstract_params, spec)
  if spec.enabled and not jax.tree.leaves(trained):
    raise config_lib.ConfigError(
        f'config.lora.rank={spec.rank}: task {config.task!r} has no LoRA adapters (its model '
        'is not built from ddrl_jax.models.layers.Dense); use rank 0', 'lora.rank')
  cast = task.cast_params
  if frozen is not None and cast is not None:
    frozen = jax.eval_shape(cast, frozen)
  abstract_state = jax.eval_shape(
      lambda p, f: update_lib.init_train_state(p, config, optimizer, f), trained, frozen)
  return Program(config=config, task=task, plan=plan, optimizer=optimizer,
                 sampler=update_lib.make_sampler(config), apply_fn=apply_fn, cast_params=cast,
                 abstract_state=abstract_state, state_shardings=plan.state(abstract_state, optimizer))
