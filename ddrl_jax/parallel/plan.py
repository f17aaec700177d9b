"""The sharding plan of a run: the mesh, the resolved logical rules and the context-parallel choice.

The trainer builds one `ShardingPlan` from the config and asks it for every sharding: parameters, the
train state (optimizer state via optax.tree_map_params, EMA and reference like the parameters), rollout
batches and replicated values. Traced functions run under `plan.scope(fn)`, which makes the plan the
active one while JAX traces them; the models' `constrain(x, logical_names)`, `self_attention(...)` and
`joint_attention(...)` read it, and are plain no-ops / the local kernel when no plan is active (toy2d, OCR on one device,
unit tests), so models never see a mesh.
"""
import contextlib
import dataclasses
import functools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ddrl_jax.models import attention as attention_lib
from ddrl_jax.parallel import context as context_lib
from ddrl_jax.parallel import rules as rules_lib

CONTEXT_IMPLS = ('none', 'ulysses', 'ring')


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingPlan:
  """mesh: a Mesh (or AbstractMesh for shape-only checks) with axes parallel.AXES.
  rules: resolved {logical name: mesh axes tuple}.
  context_impl: self-attention over a context-sharded sequence: 'none' (GSPMD), 'ulysses' or 'ring'.
  max_replicated_fraction: the `assert_sufficiently_sharded` tolerance on meshes that shard parameters.
  sequence_names: the activation names of the token sequence (`tokens_mergeable`).
  """
  mesh: Any
  rules: dict
  context_impl: str = 'none'
  max_replicated_fraction: float = 0.02
  sequence_names: tuple = rules_lib.SEQUENCE_NAMES

  @classmethod
  def from_config(cls, config, mesh, model_rules=None, sequence_names=()):
    """The plan of `config.sharding` on `mesh`: the shared default rules, then the model family's
    `model_rules` (its `logical_rules()`), then config.sharding.rules over both; `sequence_names` adds the
    family's sequence activation names to 'act_seq'."""
    s = config.get('sharding') or {}
    rules = dict(rules_lib.DEFAULT_RULES)
    rules.update(dict(model_rules or {}))
    rules.update(dict(s.get('rules') or {}))
    impl = s.get('context_impl', 'none')
    if impl not in CONTEXT_IMPLS:
      raise ValueError(f'config.sharding.context_impl={impl!r}; known: {CONTEXT_IMPLS}')
    return cls(mesh=mesh, rules=rules_lib.resolve_rules(rules, s.get('fsdp_axes', 'fsdp'), mesh.axis_names),
               context_impl=impl, max_replicated_fraction=float(s.get('max_replicated_fraction', 0.02)),
               sequence_names=tuple(dict.fromkeys(rules_lib.SEQUENCE_NAMES + tuple(sequence_names))))

  @classmethod
  def for_model(cls, config, mesh, family):
    """`from_config` with a model family's rules and sequence names (models.family.ModelFamily)."""
    return cls.from_config(config, mesh, family.logical_rules(), family.sequence_names())

  @classmethod
  def for_host(cls, config, devices, family):
    """A plan over one host's `devices` alone, FSDP over all of them (mesh fsdp = len(devices)), with the
    run's rules: for models that each process runs on its own inputs, such as a frozen text encoder
    encoding this host's prompts (no cross-host collectives, so processes need not run it in lockstep)."""
    from ddrl_jax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    shape = dict(data=1, fsdp=len(devices), context=1, tensor=1)
    mesh = mesh_lib.make_mesh(shape, list(devices))
    s = config.get('sharding') or {}
    host = {'sharding': dict(s, fsdp_axes='fsdp', context_impl='none')}
    return cls.for_model(host, mesh, family)

  @property
  def axis_sizes(self):
    return dict(self.mesh.shape)

  def spec(self, logical, shape, what='array'):
    return rules_lib.mesh_spec(logical, shape, self.rules, self.axis_sizes, what)

  def sharding(self, logical, shape, what='array'):
    return NamedSharding(self.mesh, self.spec(logical, shape, what))

  def replicated(self):
    return NamedSharding(self.mesh, P())

  def batch(self):
    """Leading (slot) axis over the activation batch axes (data, fsdp), the rest replicated."""
    return NamedSharding(self.mesh, P(self.rules['act_batch'] or None))

  def params(self, abstract_params):
    """NamedShardings of a parameter tree by its logical names."""
    return rules_lib.param_shardings(abstract_params, self.mesh, self.rules)

  def shards_params(self):
    """Whether the parameter rules use a mesh axis of size > 1 (then the replication check applies)."""
    return any(self.axis_sizes.get(a, 1) > 1 for name, axes in self.rules.items()
               if not rules_lib.is_activation_rule(name) for a in axes)

  def check_params(self, abstract_params, shardings):
    """The parameter sharding report; raises when too much is replicated on a parameter-sharding mesh."""
    if self.shards_params():
      return rules_lib.assert_sufficiently_sharded(abstract_params, shardings,
                                                   self.max_replicated_fraction)
    return rules_lib.sharding_report(abstract_params, shardings)

  def state(self, abstract_state, optimizer,
            param_fields=('params', 'ema_params', 'ref_params', 'old_params'),
            opt_field='opt_state', frozen_fields=('frozen',)):
    """Shardings of a NamedTuple train state: `param_fields` follow the parameter rules, `opt_field` the
    parameters it tracks (optax.tree_map_params; its counters are replicated), `frozen_fields` the
    parameter rules on their own trees, everything else replicated. A field that is None stays None."""
    param_sh = self.params(abstract_state.params)
    rep = self.replicated()
    out = {}
    for field, value in abstract_state._asdict().items():
      if value is None:
        out[field] = None
      elif field in param_fields:
        out[field] = param_sh
      elif field in frozen_fields:     # a parameter tree of its own (LoRA's frozen base)
        out[field] = self.params(value)
      elif field == opt_field:
        out[field] = optax.tree_map_params(
            optimizer, lambda _, s: s, value, param_sh, transform_non_params=lambda _: rep,
            is_leaf=lambda x: isinstance(x, NamedSharding))
      else:
        out[field] = jax.tree.map(lambda _: rep, value)
    return type(abstract_state)(**out)

  @property
  def platform(self):
    """The platform of the mesh's devices ('tpu' for a compile-only TPU topology on a CPU host), or None
    for an AbstractMesh."""
    devices = getattr(self.mesh, 'devices', None)
    return devices.flat[0].platform if isinstance(devices, np.ndarray) and devices.size else None

  def scope(self, fn):
    """`fn` with this plan active while it runs (i.e. while jit traces it), and '' / 'auto' attention
    kernels resolved for the mesh's platform, not this process's backend. The resolution is part of the
    trace itself, so an `eval_shape` or cached trace made before an ahead-of-time `lower` for a TPU
    slice traces the target's kernel too."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
      with active(self), attention_lib.target_platform(self.platform):
        return fn(*args, **kwargs)

    return wrapped


_state = threading.local()


@contextlib.contextmanager
def active(plan):
  """Makes `plan` the one `constrain` and `self_attention` use (None: none)."""
  old = getattr(_state, 'plan', None)
  _state.plan = plan
  try:
    yield plan
  finally:
    _state.plan = old


def current():
  """The active ShardingPlan, or None."""
  return getattr(_state, 'plan', None)


def tokens_mergeable():
  """Whether activations (B, ..., D) may be reshaped to (B*..., D) for free under the active plan.

  True without a plan, or when no mesh axis > 1 splits the token axes (the plan's `sequence_names`): the
  batch alone is split, and a device's rows stay one contiguous block. Under context parallelism each
  device holds a slice of every sample's tokens, which no sharding of the merged axis describes (XLA
  would reshard around each layer), so models keep the token axes there."""
  plan = current()
  if plan is None:
    return True
  return not any(plan.axis_sizes.get(a, 1) > 1 for name in plan.sequence_names
                 for a in plan.rules.get(name) or ())


def constrain(x, logical):
  """with_sharding_constraint by logical names under the active plan; x unchanged without one.

  Inside vmap the names describe the per-example shape; a name whose dimension does not divide its mesh
  axes (e.g. 'act_batch' on a batch of 1) drops them, as everywhere in the rules."""
  plan = current()
  if plan is None:
    return x
  return jax.lax.with_sharding_constraint(x, plan.sharding(logical, x.shape, 'activation'))


def self_attention(q, k, v, cfg):
  """Self-attention q, k, v (B, S, N, Hd) -> (B, S, N, Hd) with the local kernel of `cfg`
  (models.attention.AttentionConfig), context-parallel (Ulysses or ring over the 'context' axis, by
  `config.sharding.context_impl`) when the active plan has a context axis > 1; else the local kernel
  and GSPMD."""
  plan = _context_plan()
  if plan is None:
    return attention_lib.attend(q, k, v, cfg)
  return context_lib.context_attention(q, k, v, plan.mesh, cfg, plan.context_impl,
                                       batch_axes=_used_axes(plan, 'act_batch'), seq_axis='context',
                                       head_axis='tensor')


def _used_axes(plan, name):
  """The mesh axes of size > 1 that the rule `name` uses."""
  return tuple(a for a in plan.rules[name] if plan.axis_sizes.get(a, 1) > 1)


def _context_plan():
  """The active plan when attention is to run context-parallel (a context axis > 1 and context_impl
  other than 'none'), after checking its rules fit; else None (the local kernel and GSPMD)."""
  plan = current()
  if plan is None or plan.context_impl == 'none' or plan.axis_sizes.get('context', 1) == 1:
    return None
  seq, heads = _used_axes(plan, 'act_seq'), _used_axes(plan, 'act_heads')
  if seq != ('context',) or heads not in ((), ('tensor',)):
    raise ValueError(f"context-parallel attention needs config.sharding.rules.act_seq='context' and "
                     f"act_heads 'tensor' or ''; got act_seq={seq}, act_heads={heads}")
  return plan


def _local_joint_attention(q_img, k_img, v_img, q_txt, k_txt, v_txt, cfg):
  """The local kernel over the concatenated [image, text] tokens."""
  s = q_img.shape[1]
  q = jnp.concatenate([q_img, q_txt], axis=1)
  k = jnp.concatenate([k_img, k_txt], axis=1)
  v = jnp.concatenate([v_img, v_txt], axis=1)
  out = attention_lib.attend(q, k, v, cfg)
  return out[:, :s], out[:, s:]


def joint_attention(q_img, k_img, v_img, q_txt, k_txt, v_txt, cfg):
  """Joint (MM-DiT, SD3) attention: full attention over the concatenated [image, text] tokens.

  q/k/v_img (B, S, N, Hd), q/k/v_txt (B, L, N, Hd) -> (out_img (B, S, N, Hd), out_txt (B, L, N, Hd)),
  with the local kernel of `cfg` (models.attention.AttentionConfig).

  Without an active plan, with a context axis of size 1 or with context_impl 'none': the local kernel
  over the concatenated sequence (GSPMD partitions it). With a context axis > 1 and context_impl
  'ulysses': `context.joint_ulysses_attention`, where the image tokens are sharded over 'context'
  (the 'act_seq' rule) and the text tokens are replicated over it (the 'act_text' rule must not use
  'context'; L = 333 for SD3.5 does not divide in general): Ulysses all-to-alls turn the image q/k/v into
  all tokens / a slice of the heads, each device takes the same head slice of the text q/k/v locally,
  attends over [image, text], sends the image output back sequence-sharded and all-gathers the text
  output over heads (the text residual stays replicated over context). Heads must divide context x tensor
  (ValueError naming mesh.context otherwise).

  context_impl 'ring' raises ValueError: a ring over the image K/V blocks would also have to merge the
  replicated text K/V into every image query and give every text query all image K/V (a second,
  lse-merged reduction over context); not implemented, SD3 needs 'ulysses'.
  """
  plan = _context_plan()
  if plan is None:
    return _local_joint_attention(q_img, k_img, v_img, q_txt, k_txt, v_txt, cfg)
  if plan.context_impl != 'ulysses':
    raise ValueError(f"joint (MM-DiT) attention is context-parallel with config.sharding.context_impl='ulysses' "
                     f"only; got {plan.context_impl!r} on mesh.context = {plan.axis_sizes['context']} (ring "
                     f"joint attention is not implemented; use 'ulysses', or 'none' for GSPMD)")
  text = _used_axes(plan, 'act_text')
  if 'context' in text:
    raise ValueError(f"joint attention keeps the text tokens replicated over 'context'; "
                     f"config.sharding.rules.act_text uses it ({text})")
  return context_lib.joint_ulysses_attention(q_img, k_img, v_img, q_txt, k_txt, v_txt, plan.mesh, cfg,
                                             batch_axes=_used_axes(plan, 'act_batch'),
                                             seq_axis='context', head_axis='tensor')


def place(tree, shardings):
  """Puts every leaf on its sharding without ever holding a whole leaf on one device.

  Host (numpy) leaves go through jax.make_array_from_callback (each device receives its own slice);
  jax.Arrays are resharded with device_put. `shardings` has the structure of `tree` (None leaves kept)."""
  def put(x, s):
    if isinstance(x, jax.Array):
      return x if x.sharding.is_equivalent_to(s, x.ndim) else jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

  return jax.tree.map(put, tree, shardings)


def sharded_init(fn, shardings, *args):
  """Runs `fn(*args)` under jit with `out_shardings`, so each device computes only its own shards."""
  return jax.jit(fn, out_shardings=shardings)(*args)

