"""Low-rank adapters (LoRA) on any model built from `layers.Dense`, and the trainable/frozen split.

config.lora (configs/common.py):
  rank     0 = full fine-tuning (the default); r > 0 adds adapters to the targeted dense layers
  alpha    the forward scale is alpha / rank (peft's lora_alpha); 0 means alpha = rank
  targets  regexes, each matched in full against a layer's dotted module path (e.g.
           'blocks.self_attn.q_proj'); a layer is adapted when any matches. The model families' docs give
           the diffusers/peft module names they correspond to
  init     'kaiming': A ~ U(-1/sqrt(din), 1/sqrt(din)), peft's default (kaiming_uniform with a = sqrt 5);
           'gaussian': A ~ N(0, 1/r^2), peft's init_lora_weights='gaussian' (flow_grpo's SD3/Wan recipes).
           B = 0 either way, so a fresh adapter leaves the model's output unchanged.

`attach` adds the adapters after the model is built: a stacked block's (L, din, dout) kernel gets (L, din,
r) and (L, r, dout) adapters, scanned with it; each adapter carries its kernel's logical axes on the
shared dimension (A: the kernel's input axis, B: its output axis) and none on r.

`split(params)` -> (trainable, frozen): the LoRAParam leaves, and the rest (the base); `combine` merges
them back into the state the model's apply_fn takes. With rank 0 trainable is all of params and frozen
None, exactly as before adapters existed.
"""
import dataclasses
import math
import re
from typing import Any, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddrl_jax import cli
from ddrl_jax.models import layers

INITS = ('kaiming', 'gaussian')


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  rank: int = 0
  alpha: float = 0.0
  targets: Tuple[str, ...] = ()
  init: str = 'kaiming'

  @property
  def enabled(self):
    return self.rank > 0

  @property
  def scale(self):
    return (self.alpha or self.rank) / self.rank

  def matches(self, path):
    return any(re.fullmatch(t, path) for t in self.targets)


class Adapted(NamedTuple):
  """Model parameters under LoRA as the step functions take them: the trained adapters and the base."""
  trainable: Any
  frozen: Any



class TargetsError(cli.UsageError, ValueError):
  """config.lora.targets that match no layer (a user's mistake: the CLIs print it in one line)."""


def from_config(config):
  """LoRAConfig of config.lora (a ConfigDict, or absent: full fine-tuning)."""
  c = config.get('lora') if hasattr(config, 'get') else None
  if c is None:
    return LoRAConfig()
  return LoRAConfig(rank=int(c.rank), alpha=float(c.alpha), targets=tuple(c.targets), init=str(c.init))


def validate(spec):
  """Raises ValueError naming the config.lora key at fault."""
  if spec.rank < 0:
    raise ValueError(f'config.lora.rank={spec.rank}: must be >= 0 (0 = full fine-tuning)')
  if not spec.enabled:
    return
  if spec.alpha < 0:
    raise ValueError(f'config.lora.alpha={spec.alpha}: must be >= 0 (0 means alpha = rank)')
  if spec.init not in INITS:
    raise ValueError(f'config.lora.init={spec.init!r}: one of {INITS}')
  if not spec.targets:
    raise ValueError('config.lora.targets is empty: name the dense layers to adapt (regexes over module '
                     'paths such as "blocks.self_attn.q_proj")')
  for t in spec.targets:
    try:
      re.compile(t)
    except re.error as e:
      raise ValueError(f'config.lora.targets: {t!r} is not a regex ({e})') from e


def dense_layers(model):
  """[(dotted module path, Dense)] of every dense layer of an NNX model, in graph order."""
  return [('.'.join(str(k) for k in path), node) for path, node in nnx.iter_graph(model)
          if isinstance(node, layers.Dense)]


def _names(variable):
  """The logical axis names a Variable carries (as the sharding rules read them), or None."""
  names = nnx.spmd.get_var_pspec(variable)
  return tuple(names) if names is not None and len(names) else None


def attach(model, spec, key):
  """Adds adapters to every Dense of `model` whose path matches spec.targets (in place). Returns the
  adapted paths. Raises ValueError when a target matches no layer (a typo would otherwise train nothing).
  Works on abstract models (nnx.eval_shape) too."""
  validate(spec)
  if not spec.enabled:
    return []
  found = [(p, d) for p, d in dense_layers(model) if spec.matches(p)]
  unused = [t for t in spec.targets if not any(re.fullmatch(t, p) for p, _ in found)]
  if unused:
    known = sorted({re.sub(r'\.\d+', '', p) for p, _ in dense_layers(model)})
    raise TargetsError(f'config.lora.targets {unused} match no dense layer; the layers are: {known}',
                       'targets are regexes matched in full against those paths')
  for i, (_, dense) in enumerate(found):
    kernel = dense.kernel
    *lead, din, dout = kernel.shape
    r = spec.rank
    k = jax.random.fold_in(key, i)
    if spec.init == 'gaussian':
      a = jax.random.normal(k, (*lead, din, r), jnp.float32) / r
    else:
      bound = 1.0 / math.sqrt(din)
      a = jax.random.uniform(k, (*lead, din, r), jnp.float32, -bound, bound)
    b = jnp.zeros((*lead, r, dout), jnp.float32)
    names = _names(kernel)
    meta_a, meta_b = {}, {}
    if names:
      meta_a = dict(out_sharding=(*names[:-1], None), eager_sharding=False)
      meta_b = dict(out_sharding=(*names[:-2], None, names[-1]), eager_sharding=False)
    dense.lora_a = nnx.LoRAParam(a, **meta_a)
    dense.lora_b = nnx.LoRAParam(b, **meta_b)
    dense.lora_scale = spec.scale
  return [p for p, _ in found]


def adapter_key(model_key):
  """The key adapters are drawn with, derived from the model's (so the base's draws are unchanged)."""
  return jax.random.fold_in(model_key, 0x4C6F5241)


def split(params, spec):
  """(trainable, frozen) of a model state: (LoRA leaves, the base) with adapters, else (params, None)."""
  if not spec.enabled or params is None:
    return params, None
  trainable, frozen = nnx.split_state(params, nnx.LoRAParam, ...)
  return trainable, frozen


def combine(trainable, frozen):
  """The model state of a (trainable, frozen) pair; trainable alone when frozen is None."""
  if frozen is None:
    return trainable
  return nnx.merge_state(frozen, trainable)


def bind(apply_fn, frozen):
  """apply_fn over the trainable part only: (trainable, *args) -> apply_fn(combine(...), *args). The
  frozen base enters under stop_gradient, so derivatives are taken with respect to the adapters alone."""
  if frozen is None:
    return apply_fn
  frozen = jax.lax.stop_gradient(frozen)
  return lambda trainable, *args: apply_fn(combine(trainable, frozen), *args)


def fingerprint(tree):
  """A (2,) uint32 content hash of a pytree of arrays (jit-able, sharded in, replicated out): the sums
  of each leaf's float32 bits weighted by two position patterns, folded over the leaves in order. Any
  changed element changes it with overwhelming probability; equal trees give equal prints."""
  acc = jnp.zeros((2,), jnp.uint32)
  for i, leaf in enumerate(jax.tree.leaves(tree)):
    bits = jax.lax.bitcast_convert_type(leaf.astype(jnp.float32), jnp.uint32).reshape(-1)
    pos = jnp.arange(bits.shape[0], dtype=jnp.uint32)
    h1 = jnp.sum(bits * (pos * np.uint32(2654435761) + np.uint32(i + 1)))
    h2 = jnp.sum((bits ^ (pos * np.uint32(40503))) * np.uint32(2 * i + 3))
    acc = acc * np.uint32(1000003) + jnp.stack([h1, h2])
  return acc
