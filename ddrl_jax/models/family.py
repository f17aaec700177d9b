"""The model-family seam: what a network family gives the library, the registry, and the generic parts.

A family is one kind of network (the Cosmos DiT, its one-frame text-to-image wrapper, a small MLP; next
SD3.5's MMDiT and Wan2.1's DiT) bound to one configuration. The trainer, `aot`, the config checks and the
sharding plan reach a model only through this protocol, so none of them names a family:

    family = model_family.from_config(config)          # the registry, by config.model_family
    module = family.build(key)                          # the network (random weights, no adapters)
    apply_fn = family.apply_fn(graphdef)                # v = apply_fn(params, x_t, t, cond)

Tasks (`ddrl_jax.tasks`) own data, conditions, rewards and evaluation and hold their family; the generic
functions below (`init_params`, `abstract_params`, `init_params_sharded`) build any family's parameters,
with config.lora's adapters attached after the build and the family's base weights loaded under them.

Registry: `FAMILIES` maps a name to the module that defines it (imported on first use, so `import
ddrl_jax` pulls no model code); that module's `FAMILIES[name](config)` builds the family from the run's
config. A family defined elsewhere (a plugin, a test) registers itself: `register(name, cls)`.
`config.model_family = ''` takes the task's default family.
"""
import dataclasses
import importlib
from typing import Any, Callable, Mapping, Optional, Protocol

import jax
from flax import nnx

from ddrl_jax.models import lora as lora_lib
from ddrl_jax.parallel import plan as plan_lib

# name -> module defining FAMILY(config) (and CONVERTERS, when the family reads foreign checkpoints).
FAMILIES = {
    'cosmos': 'ddrl_jax.models.cosmos.family',          # Cosmos-Predict2.5 DiT (video, frame replacement)
    'cosmos_t2i': 'ddrl_jax.models.cosmos.family',      # the DiT on one frame with a byte text encoder
    'mlp': 'ddrl_jax.models.mlp',                        # the 2-D velocity MLP of the toy task
    'flux': 'ddrl_jax.models.flux.family',               # FLUX.1 double/single-stream DiT (FluxTransformer2DModel)
    'sd3': 'ddrl_jax.models.sd3.family',                 # SD3 / SD3.5 MMDiT (diffusers SD3Transformer2DModel)
    'wan': 'ddrl_jax.models.wan.family',                 # Wan2.1 text-to-video DiT (WanTransformer3DModel)
}
# Modules whose CONVERTERS `converters()` collects.
CONVERTER_MODULES = ('ddrl_jax.models.cosmos.family', 'ddrl_jax.models.wan.family',
                     'ddrl_jax.models.sd3.family', 'ddrl_jax.models.flux.family')

ApplyFn = Callable[[Any, jax.Array, jax.Array, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class AttentionShape:
  """What context parallelism must divide: `heads` attention heads (Ulysses splits them over context x
  tensor) and `seq_blocks` sequence blocks (latent frames; the sequence is sharded in whole blocks).
  `key`/`value`: the config key (and its value) that sets `seq_blocks`, for error messages."""
  heads: int
  seq_blocks: int
  key: str = 'mesh.context'
  value: Any = None


@dataclasses.dataclass(frozen=True)
class Converter:
  """A foreign checkpoint format -> this family's parameters (`python -m ddrl_jax.models.convert`).

  make_config(param_dtype) -> the model config of the CLI model name; abstract(config) -> the nnx module
  made by nnx.eval_shape (the converter's output is checked against its Params' shapes);
  convert(state_dict {name: numpy}, config) -> (nnx.State of Params, naming); subfolder: where a
  diffusers pipeline folder keeps the weights ('transformer', 'vae')."""
  make_config: Callable
  abstract: Callable
  convert: Callable
  subfolder: str


def preset_converter(preset, abstract, convert, subfolder):
  """The Converter of a model preset (preset(param_dtype=...) -> config): see `Converter`."""
  return Converter(make_config=lambda param_dtype: preset(param_dtype=param_dtype), abstract=abstract,
                   convert=convert, subfolder=subfolder)


def nest_paths(flat):
  """{'a/b/c': x} -> {'a': {'b': {'c': x}}} (an Exporter's flat paths -> a pure dict)."""
  out = {}
  for path, value in flat.items():
    node = out
    *parents, leaf = path.split('/')
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return out


@dataclasses.dataclass(frozen=True)
class Exporter:
  """How adapters and merged weights leave in diffusers' names (`ddrl_jax.export_lora`).

  subtree: the path prefix of the exported network inside the module ('' = all of it; e.g. 'dit' for a
  wrapper whose front end has no diffusers counterpart); diffusers_names(path) -> the diffusers weight
  names of one (possibly stacked) kernel path below it; to_diffusers(flat {path: array}) -> state dict."""
  subtree: str
  diffusers_names: Callable[[str], list]
  to_diffusers: Callable[[Mapping[str, Any]], dict]


class ModelFamily(Protocol):
  """One network family bound to its configuration (see the module docstring)."""

  name: str
  compute_dtype: str              # 'float32' / 'bfloat16': the dtype the network computes in
  remat_policy: str               # a models.layers.REMAT_POLICIES key ('none' for small models)
  resume_safe_keys: tuple         # config keys that only say where base weights come from

  def build(self, key: jax.Array) -> nnx.Module:
    """The network with fresh weights of `key` and no adapters (under jit with out_shardings this is
    the sharded-from-birth init)."""

  def apply_fn(self, graphdef) -> ApplyFn:
    """apply_fn(params, x_t, t, cond) -> the velocity eps - x0 of the flow x_t = (1 - t) x0 + t eps,
    the convention every sampler and loss uses."""

  def load_base(self, abstract_base: nnx.State) -> Optional[Any]:
    """Host pure dict of the base weights shaped like `abstract_base` (no adapters), or None for the
    random init; raises naming the config key when the weights do not fit the configured model."""

  def forward_flops(self, sample_shape: tuple) -> float:
    """Model FLOPs (2 per multiply-accumulate) of one apply_fn call on one sample of `sample_shape`."""

  def attention_shape(self) -> Optional[AttentionShape]:
    """Heads and sequence blocks of the self-attention (None: the model has none)."""

  def attention_kernel(self, platform: str) -> Optional[str]:
    """The local attention kernel the network uses on `platform` (None: no attention)."""

  def logical_rules(self) -> Mapping[str, str]:
    """The family's own logical axis names -> mesh axes (merged under config.sharding.rules)."""

  def sequence_names(self) -> tuple:
    """Activation names that index the token sequence (context parallelism splits them)."""

  def compute_cast(self, abstract_module) -> Optional[Callable]:
    """params -> params in the compute dtype (None: the network computes in its parameter dtype)."""

  def exporter(self) -> Optional[Exporter]:
    """diffusers names for LoRA export and merged weights (None: no diffusers counterpart)."""


_REGISTERED = {}      # name -> family class, registered at run time (`register`)


def register(name, family_class):
  """Registers `family_class` (called with the run's config, like the classes in FAMILIES' modules) as
  config.model_family `name`: how a family defined outside ddrl_jax/models joins."""
  if name in FAMILIES:
    raise ValueError(f'model family {name!r} is built in ({FAMILIES[name]})')
  _REGISTERED[name] = family_class


def unregister(name):
  _REGISTERED.pop(name, None)


def known_families():
  return sorted(set(FAMILIES) | set(_REGISTERED))


def _module(name, what='config.model_family'):
  if name not in FAMILIES:
    raise ValueError(f'{what}={name!r}: unknown model family; known: {known_families()}')
  return importlib.import_module(FAMILIES[name])


def family_class(name, what='config.model_family'):
  """The class of family `name` (registered, or from its FAMILIES module)."""
  if name in _REGISTERED:
    return _REGISTERED[name]
  return _module(name, what).FAMILIES[name]


def from_config(config, default=''):
  """The family of `config.model_family` ('' = `default`, the task's), bound to the config."""
  name = config.get('model_family', '') or default
  cls = family_class(name)
  section = getattr(cls, 'section', '')
  if section and section not in config:
    from ddrl_jax import cli  # pylint: disable=g-import-not-at-top
    raise cli.UsageError(f'config.model_family={name!r}: this config has no config.{section} section '
                         f'(its task {config.get("task")!r} runs the {default!r} family)',
                         f"drop --config.model_family, or use a config written for {name!r}")
  return cls(config)


def logical_rules(name):
  """The logical rules a family adds (its module's or registered class's LOGICAL_RULES), for configs to
  merge into config.sharding.rules so the command line can override them."""
  if name in _REGISTERED:
    return dict(getattr(_REGISTERED[name], 'LOGICAL_RULES', {}))
  return dict(getattr(_module(name, 'family'), 'LOGICAL_RULES', {}))


def converters():
  """{CLI model name: Converter} of every family (`python -m ddrl_jax.models.convert --model`)."""
  out = {}
  for module in CONVERTER_MODULES:
    out.update(importlib.import_module(module).CONVERTERS)
  return out


DTYPES = {'float32': jax.numpy.float32, 'bfloat16': jax.numpy.bfloat16}


def preset_config(presets, section, key):
  """A model config from a config section: presets[section.model] with section.dit_overrides, the
  section's dtype, param_dtype, remat_policy and (when present) attention kernel settings. `key` names
  the section in errors ('config.cosmos')."""
  from ddrl_jax.models import attention as attention_lib  # pylint: disable=g-import-not-at-top
  if section.model not in presets:
    raise ValueError(f'{key}.model={section.model!r}: unknown preset; known: {sorted(presets)}')
  kw = dict(section.dit_overrides) if section.get('dit_overrides') else {}
  kw.update(dtype=DTYPES[section.dtype], param_dtype=DTYPES[section.param_dtype],
            remat_policy=section.remat_policy)
  if section.get('attention') is not None:
    kw['attention'] = attention_lib.AttentionConfig(**dict(section.attention))
  return presets[section.model](**kw)


def vae_preset_config(presets, section, key):
  """The VAE config of `section.vae` (a key of `presets`) with `section.vae_overrides`; `key` names the
  section in errors ('config.sd3')."""
  if section.vae not in presets:
    raise ValueError(f'{key}.vae={section.vae!r}: unknown preset; known: {sorted(presets)}')
  kw = dict(section.vae_overrides) if section.get('vae_overrides') else {}
  return presets[section.vae](**kw)


class SectionFamily:
  """What the DiT families configured by one config section share: `c` (the section, e.g. config.sd3),
  `dit` (the model config: dtype, remat_policy, attention), `section` (its name, for config keys), and
  the module constants LOGICAL_RULES / SEQUENCE_NAMES given as class attributes. Base weights come from
  `<section>.checkpoint` (the converter CLI's output) when it is set."""

  section = ''
  LOGICAL_RULES = {}
  SEQUENCE_NAMES = ('act_seq',)
  c: Any
  dit: Any

  @property
  def compute_dtype(self):
    return jax.numpy.dtype(self.dit.dtype).name

  @property
  def remat_policy(self):
    return self.dit.remat_policy

  def load_base(self, abstract_base):
    if not self.c.checkpoint:
      return None
    from ddrl_jax.models import convert  # pylint: disable=g-import-not-at-top
    return convert.load_converted_like(self.c.checkpoint, nnx.to_pure_dict(abstract_base),
                                       f'config.{self.section}.checkpoint')

  def attention_kernel(self, platform):
    from ddrl_jax.models import attention as attention_lib  # pylint: disable=g-import-not-at-top
    return attention_lib.resolve(self.dit.attention.kernel, platform)

  def logical_rules(self):
    return dict(self.LOGICAL_RULES)

  def sequence_names(self):
    return tuple(self.SEQUENCE_NAMES)

  def compute_cast(self, abstract_module):
    from ddrl_jax.models import layers  # pylint: disable=g-import-not-at-top
    return layers.compute_cast_fn(abstract_module)


def guided_velocity(call, x_t, timestep, cond, text_keys):
  """Classifier-free guidance from one forward of 2B: v = v_null + w (v_cond - v_null), w = cond['guidance']
  (B,) per sample (w = 1 gives v_cond). `call(x, timestep, *texts)` is the network; `text_keys` are the
  condition keys whose 'null_<key>' twins hold the empty prompt's embeddings."""
  b = x_t.shape[0]
  cat = lambda a, z: jax.numpy.concatenate([a, z])
  both = call(cat(x_t, x_t), cat(timestep, timestep),
              *[cat(cond[k], cond['null_' + k]) for k in text_keys]).astype(jax.numpy.float32)
  v_cond, v_null = jax.numpy.split(both, 2)
  w = jax.numpy.reshape(cond['guidance'], (b,) + (1,) * (x_t.ndim - 1)).astype(jax.numpy.float32)
  return v_null + w * (v_cond - v_null)


# ------------------------------------------------------------------------------ generic parameters
def _with_adapters(module, lora, key):
  """`module` with config.lora's adapters; unchanged when it has no `layers.Dense` at all (the trainer
  then refuses rank > 0 naming the task, rather than a target that matches nothing)."""
  if lora.enabled and not list(lora_lib.dense_layers(module)):
    return module
  lora_lib.attach(module, lora, lora_lib.adapter_key(key))
  return module


def build_adapted(family, lora, key):
  """The family's network of `key` with config.lora's adapters (their own key)."""
  return _with_adapters(family.build(key), lora, key)


def abstract_params(family, lora, key):
  """(apply_fn, abstract nnx.State of the adapted network, the abstract module); nothing allocated."""
  module = nnx.eval_shape(lambda: build_adapted(family, lora, key))
  graphdef, params = nnx.split(module)
  return family.apply_fn(graphdef), params, module


def init_params(family, lora, key, base=None):
  """(apply_fn, params) on the default device: the family's base weights (or `base`, a pure dict) under
  fresh adapters, or the random init when the family has no base."""
  module = family.build(key)
  graphdef, params = nnx.split(module)
  base = family.load_base(params) if base is None else base
  if base is not None:
    nnx.replace_by_pure_dict(params, jax.tree.map(jax.numpy.asarray, base))
    module = nnx.merge(graphdef, params)
  module = _with_adapters(module, lora, key)
  graphdef, params = nnx.split(module)
  return family.apply_fn(graphdef), params


def init_params_sharded(family, lora, key, shardings):
  """The adapted network's params placed on `shardings` shard by shard; no device holds a whole leaf.

  Random weights are drawn under jit with out_shardings (with threefry_partitionable the values equal a
  one-device init); base weights are read into host memory and each device receives its slices, with
  fresh adapters initialized sharded beside them."""
  init = lambda k: nnx.split(build_adapted(family, lora, k))[1]
  _, abstract, _ = abstract_params(family, lora, key)
  adapter_sh, base_sh = lora_lib.split(shardings, lora)
  _, abstract_base = lora_lib.split(abstract, lora)
  if base_sh is None:               # full fine-tuning: every parameter is "base"
    abstract_base, base_sh = abstract, shardings
  host = family.load_base(abstract_base)
  if host is None:
    return plan_lib.sharded_init(init, shardings, key)
  state = jax.tree.map(lambda a: a, abstract_base)
  nnx.replace_by_pure_dict(state, host)
  base = plan_lib.place(state, base_sh)
  if adapter_sh is None or not lora.enabled:
    return base
  adapters = plan_lib.sharded_init(lambda k: lora_lib.split(init(k), lora)[0], adapter_sh, key)
  return lora_lib.combine(adapters, base)
