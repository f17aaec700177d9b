"""The task interface: what the trainer, `aot`, `evaluate`, `data.prepare`, `data.synthesize` and `pretrain`
call, as a typing.Protocol, and `FamilyTask`, the base class that builds the model from the task's
model family (`ddrl_jax.models.family`) so a task itself is data, conditions, rewards and evaluation.

Optional abilities are declared in `capabilities`, not probed: 'records' (synthesize writes records of
generated samples: prompt_set, conditions_from_prompts, record_of), 'media' (prepare encodes captioned
images or videos: media_shape, encode_samples, encode_prompts), 'pretrain' (pretrain_batch), 'aot'
(abstract_conditions), 'checkpoint_evaluation' (evaluate_checkpoints: the task's own evaluation of saved
checkpoints for `python -m ddrl_jax.evaluate`; without it that command runs the trainer's evaluation).
Calling a method of an undeclared ability raises `Unsupported` naming the task.
"""
import dataclasses
from typing import Any, Callable, Optional, Protocol

import flax.nnx as nnx

from ddrl_jax.models import family as family_lib
from ddrl_jax.models import lora as lora_lib


class Unsupported(ValueError):
  """The task cannot do what was asked (e.g. encode media); the message names it and what can."""


@dataclasses.dataclass(frozen=True)
class CheckpointRequest:
  """What `python -m ddrl_jax.evaluate` asks of a task's own checkpoint evaluation (its flags).

  checkpoints: 'base', trainer workdirs or params-only exports, each evaluated in turn;
  load: (checkpoint, ema) -> (task, apply_fn, params), the command's loader (a workdir's latest
    checkpoint with its frozen base combined, or an export);
  out: where rows go (a JSONL file for images, a folder for video; '' lets the task choose);
  judges: registered reward names to score the samples with (() lets the task choose);
  prompts, per_prompt: held-out prompts and samples per prompt (image tasks);
  prompt_file, max_prompts, baseline, videos_per_category, seed, batch: the prompt-file evaluation
    (video tasks: its file, a cut of it, a second model on the same seeds, MP4s per category, the noise
    seed, prompts per sampling call with 0 the data-parallel size).
  """
  checkpoints: tuple
  load: Callable
  out: str = ''
  ema: bool = False
  judges: tuple = ()
  prompts: int = 64
  per_prompt: int = 4
  prompt_file: str = ''
  max_prompts: int = 0
  baseline: str = ''
  videos_per_category: int = 2
  seed: int = 0
  batch: int = 0


class Task(Protocol):
  """What the library calls on a task. Shapes: B conditions, M samples, `sample_shape` one sample."""

  config: Any
  family: family_lib.ModelFamily
  lora: lora_lib.LoRAConfig
  sample_shape: tuple
  capabilities: frozenset
  eval_needs_all_samples: bool      # evaluate() needs every sample at once (gathered across processes)
  cast_params: Optional[Callable]   # params -> compute-dtype copy; set by abstract_params

  # ---- the model (FamilyTask implements these from the family)
  def abstract_params(self, key) -> tuple:
    """(apply_fn, abstract params with adapters); nothing allocated."""

  def init_model(self, key) -> tuple:
    """(apply_fn, initial params with adapters) on the default device."""

  def init_params_sharded(self, key, shardings) -> Any:
    """The initial params placed on `shardings` shard by shard."""

  def init_untrained(self, key) -> tuple:
    """(apply_fn, random params without adapters): what pretraining starts from."""

  def forward_flops_per_sample(self) -> float:
    """Model FLOPs of one apply_fn call on one sample."""

  # ---- conditions and data
  def conditions(self, key, batch: int) -> Any:
    """(B, ...) training conditions."""

  def eval_conditions(self, key, batch: int) -> Any:
    """(B, ...) evaluation conditions (held-out ones where the task has them)."""

  def abstract_conditions(self, batch: int) -> Any:
    """ShapeDtypeStructs of `conditions(key, batch)` ('aot')."""

  def data(self, key, cond) -> Any:
    """(B, *sample_shape) clean samples paired with the conditions."""

  def from_records(self, batch: dict, key) -> tuple:
    """A record batch (ddrl_jax.data.pipeline) -> (conditions, x0)."""

  # ---- rewards and evaluation
  def prompts(self, cond) -> list:
    """The prompt string of each condition."""

  def reward_inputs(self, samples, cond) -> tuple:
    """(M, *sample_shape) samples -> (what the reward service scores, valid (M,) bool)."""

  def evaluate(self, samples, key, cond=None) -> dict:
    """{metric: float} of (M, *sample_shape) samples of `cond`. A task whose class sets
    `eval_scores_with_rewards = True` also gets `score`, fn(reward inputs, prompts) -> {reward name: (M,)
    scores}: the run's own rewards through the trainer's reward service."""

  def required_inputs(self) -> list:
    """The run's inputs (`preflight.Input`: config key, what it is, how to make it) that a full run
    must be given; `preflight.check` refuses to start, in one line, while any is missing."""

  def evaluate_checkpoints(self, request: CheckpointRequest) -> list:
    """JSON rows of the task's own evaluation of request.checkpoints ('checkpoint_evaluation')."""

  def batch_metrics(self, cond) -> dict:
    """{metric: float} describing one iteration's conditions (B, ...), logged with the step's metrics
    (e.g. how many groups were text-to-video and image-to-video)."""


class FamilyTask:
  """Base class of the tasks: the model comes from `family` (chosen by config.model_family, default
  `DEFAULT_FAMILY`), with config.lora's adapters; undeclared abilities raise `Unsupported`."""

  DEFAULT_FAMILY = ''
  capabilities = frozenset()
  eval_needs_all_samples = False

  def __init__(self, config):
    self.config = config
    self.lora = lora_lib.from_config(config)
    self.family = family_lib.from_config(config, default=self.DEFAULT_FAMILY)
    self.cast_params = None

  @property
  def compute_dtype(self):
    return self.family.compute_dtype

  def _unsupported(self, ability, method):
    raise Unsupported(f'task {self.config.task!r} ({type(self).__name__}) cannot {ability} (it has no '
                      f'{method}); tasks that can: see ddrl_jax/tasks/')

  # ------------------------------------------------------------------------------------- model
  def abstract_params(self, key):
    """(apply_fn, abstract params); also sets `cast_params`, the family's compute-dtype cast."""
    apply_fn, params, module = family_lib.abstract_params(self.family, self.lora, key)
    self.cast_params = self.family.compute_cast(module)
    return apply_fn, params

  def init_model(self, key):
    return family_lib.init_params(self.family, self.lora, key)

  def init_params_sharded(self, key, shardings):
    return family_lib.init_params_sharded(self.family, self.lora, key, shardings)

  def init_untrained(self, key):
    graphdef, params = nnx.split(self.family.build(key))
    return self.family.apply_fn(graphdef), params

  def forward_flops_per_sample(self):
    return float(self.family.forward_flops(tuple(self.sample_shape)))

  # -------------------------------------------------------------------------------- defaults
  def required_inputs(self):
    return []

  def eval_conditions(self, key, batch):
    return self.conditions(key, batch)

  def abstract_conditions(self, batch):
    del batch
    self._unsupported('be compiled ahead of time', 'abstract_conditions')

  def from_records(self, batch, key):
    del batch, key
    self._unsupported('read records (config.data.path)', 'from_records')

  def pretrain_batch(self, step, batch):
    del step, batch
    self._unsupported('pretrain', 'pretrain_batch')

  def prompt_set(self):
    self._unsupported('synthesize records', 'prompt_set')

  def conditions_from_prompts(self, prompts, key):
    del prompts, key
    self._unsupported('synthesize records', 'conditions_from_prompts')

  def record_of(self, sample, prompt, text=True):
    del sample, prompt, text
    self._unsupported('synthesize records', 'record_of')

  @property
  def media_shape(self):
    return self._unsupported('encode media', 'media_shape')

  def encode_samples(self, media_u8):
    del media_u8
    self._unsupported('encode media', 'encode_samples')

  def encode_prompts(self, prompts):
    del prompts
    self._unsupported('encode media', 'encode_prompts')

  def batch_metrics(self, cond):
    del cond
    return {}

  def evaluate_checkpoints(self, request):
    del request
    self._unsupported('evaluate checkpoints on its own', 'evaluate_checkpoints')

  def require(self, ability):
    """Raises Unsupported unless `ability` is in `capabilities` (call before starting long work)."""
    require(self, ability)


def require(task, ability):
  """Raises Unsupported unless `ability` is in `task.capabilities` (any object declaring them, e.g.
  data.prepare.PixelTask)."""
  if ability not in task.capabilities:
    config = getattr(task, 'config', None)
    name = f'task {config.task!r} ({type(task).__name__})' if config is not None else type(task).__name__
    raise Unsupported(f'{name} cannot do {ability!r}; it declares '
                      f'{sorted(task.capabilities) or "nothing optional"}')
