"""SD3.5's MMDiT as a model family ('sd3'), and the SD3 converters (transformer and VAE).

Reads config.sd3 (configs/sd35m.py): the MMDiT preset ('sd35_medium', 'sd35_large', 'tiny') and overrides,
dtypes, remat, the attention kernel, the converted checkpoint, the text sequence length and the
classifier-free-guidance policy.

Velocity adapter. SD3 is a rectified flow x_sigma = (1 - sigma) x0 + sigma eps whose network predicts
eps - x0 from timestep = 1000 sigma, i.e. exactly the library's convention with t = sigma. Conditions
are a dict: 'text' (B, L, joint_dim) the joint CLIP-L/G + T5 sequence, 'pooled' (B, pooled_dim); with
CFG on (`cfg_on`) also 'guidance' (B,) per sample and the empty prompt's 'null_text', 'null_pooled':
v = v_null + w (v_cond - v_null) from one forward of 2B (w = 1 gives v_cond). The guidance rides in the
conditions, so rollouts, the policy gradient (which re-evaluates the rollout's own conditions) and
evaluation each use the scale their conditions carry (the task sets them from the config's policy).
"""
import flax.nnx as nnx
import jax
import jax.numpy as jnp

from ddrl_jax.models import family as family_lib
from ddrl_jax.models.sd3 import convert as sd3_convert
from ddrl_jax.models.sd3 import mmdit
from ddrl_jax.models.sd3 import vae as sd3_vae
from ddrl_jax.models.sd3 import vae_convert
from ddrl_jax.parallel import rules as rules_lib

PRESETS = {'sd35_medium': mmdit.sd35_medium, 'sd35_large': mmdit.sd35_large, 'tiny': mmdit.tiny}
CLIP_TOKENS = 77            # CLIP-L/G's sequence, before T5's max_sequence_length tokens

# The MMDiT's logical names beyond the shared ones (parallel/rules.py).
LOGICAL_RULES = {k: v for k, v in mmdit.LOGICAL_RULES.items() if k not in rules_lib.DEFAULT_RULES}


def dit_config(c):
  """MMDiTConfig from config.sd3: preset + overrides + dtypes, remat and attention kernel."""
  return family_lib.preset_config(PRESETS, c, 'config.sd3')


def text_tokens(c):
  """The joint text sequence length: 77 CLIP tokens + T5's max_sequence_length."""
  return CLIP_TOKENS + c.max_sequence_length


def make_apply_fn(graphdef, cfg_on):
  """apply_fn(params, x_t (B, C, H, W), t (B,), cond) -> velocity (see the module docstring)."""

  def apply_fn(params, x_t, t, cond):
    params = jax.tree.map(lambda a: a, params)     # NNX Variables at this trace level
    model = nnx.merge(graphdef, params)
    timestep = jnp.reshape(t, (x_t.shape[0],)).astype(jnp.float32) * 1000.0
    if not cfg_on:
      return model(x_t, timestep, cond['text'], cond['pooled']).astype(jnp.float32)
    return family_lib.guided_velocity(model, x_t, timestep, cond, ('text', 'pooled'))

  return apply_fn


def dit_exporter(dit):
  """The Exporter of an MMDiT(dit): adapters under diffusers' SD3Transformer2DModel module names."""
  return family_lib.Exporter(
      subtree='',
      diffusers_names=lambda path: sd3_convert.diffusers_names(path, dit)[0],
      # With diffusers' persistent pos_embed buffer, so the merged file loads with strict load_state_dict.
      to_diffusers=lambda flat: sd3_convert.to_diffusers_state_dict(family_lib.nest_paths(flat), dit,
                                                                    with_pos_embed=True))


class SD3Family(family_lib.SectionFamily):
  """The MMDiT of SD3 / SD3.5 on (16, H/8, W/8) latents, from config.sd3."""

  name = 'sd3'
  section = 'sd3'
  LOGICAL_RULES = LOGICAL_RULES
  resume_safe_keys = ('sd3.checkpoint', 'sd3.vae_checkpoint', 'sd3.text_encoders')

  def __init__(self, config):
    self.c = config.sd3
    self.dit = dit_config(self.c)

  def build(self, key):
    return mmdit.MMDiT(self.dit, rngs=nnx.Rngs(key))

  def apply_fn(self, graphdef):
    return make_apply_fn(graphdef, self.cfg_on)

  def forward_flops(self, sample_shape):
    """One MMDiT forward on one (C, H, W) latent with the joint text sequence; twice under CFG."""
    _, parts = mmdit.forward_flops(self.dit, latent_hw=tuple(sample_shape[1:]),
                                   text_tokens=text_tokens(self.c))
    return float(sum(parts.values())) * (2 if self.cfg_on else 1)

  def attention_shape(self):
    """Context parallelism shards the image tokens (H/p x W/p of the latent)."""
    p = self.dit.patch_size
    side = self.c.resolution // 8 // p
    return family_lib.AttentionShape(heads=self.dit.num_attention_heads, seq_blocks=side * side,
                                     key='sd3.resolution', value=self.c.resolution)

  def exporter(self):
    return dit_exporter(self.dit)


FAMILIES = {'sd3': SD3Family}


def _state_of(abstract_module, pure):
  state = nnx.state(abstract_module, nnx.Param)
  nnx.replace_by_pure_dict(state, pure)
  return state


def _convert_dit(state_dict, config):
  pure = sd3_convert.from_diffusers_state_dict(state_dict, config)
  return _state_of(mmdit.abstract_model(config), pure), 'diffusers'


def _convert_vae(state_dict, config):
  pure = vae_convert.from_diffusers_state_dict(state_dict, config)
  return _state_of(sd3_vae.abstract_model(config), pure), 'diffusers'


def _dit_converter(preset):
  return family_lib.Converter(make_config=lambda param_dtype: preset(param_dtype=param_dtype),
                              abstract=mmdit.abstract_model, convert=_convert_dit, subfolder='transformer')


def _vae_converter(preset):
  return family_lib.Converter(make_config=lambda param_dtype: preset(param_dtype=param_dtype),
                              abstract=sd3_vae.abstract_model, convert=_convert_vae, subfolder='vae')


CONVERTERS = {'sd35_medium': _dit_converter(mmdit.sd35_medium), 'sd35_large': _dit_converter(mmdit.sd35_large),
              'sd3_tiny': _dit_converter(mmdit.tiny), 'sd35_vae': _vae_converter(sd3_vae.sd35),
              'sd3_vae_tiny': _vae_converter(sd3_vae.tiny)}
