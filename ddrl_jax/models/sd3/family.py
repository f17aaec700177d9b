"""SD3.5 as a model family ('sd3'): the MMDiT, its pipeline (CLIP-L/G + T5 text encoders, the
16-channel VAE, the condition schema), and the SD3 converters (transformer and VAE). The VAE is the shared
`models.autoencoder_kl.AutoencoderKL` at its `sd35` preset.

Reads config.sd3 (configs/sd35m.py): the MMDiT preset ('sd35_medium', 'sd35_large', 'tiny') and overrides,
dtypes, remat, the attention kernel, the converted checkpoint, the text encoders' folder and the T5
sequence length, the VAE preset and its converted checkpoint, and the image resolution. The guidance
scales are the prompt task's (config.prompt.guidance_rollout / guidance_eval).

Samples: (16, R/8, R/8) normalized SD3-VAE latents of R x R images (config.sd3.resolution); media: one
(1, R, R, 3) uint8 image.

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

from ddrl_jax.models import autoencoder_kl
from ddrl_jax.models import autoencoder_kl_convert
from ddrl_jax.models import family as family_lib
from ddrl_jax.models import pipeline as pipeline_lib
from ddrl_jax.models.sd3 import convert as sd3_convert
from ddrl_jax.models.sd3 import mmdit
from ddrl_jax.parallel import rules as rules_lib

PRESETS = {'sd35_medium': mmdit.sd35_medium, 'sd35_large': mmdit.sd35_large, 'tiny': mmdit.tiny}
VAE_PRESETS = {'sd35': autoencoder_kl.sd35, 'tiny': autoencoder_kl.tiny}
CLIP_TOKENS = 77            # CLIP-L/G's sequence, before T5's max_sequence_length tokens

# The MMDiT's logical names beyond the shared ones (parallel/rules.py).
LOGICAL_RULES = {k: v for k, v in mmdit.LOGICAL_RULES.items() if k not in rules_lib.DEFAULT_RULES}


def dit_config(c):
  """MMDiTConfig from config.sd3: preset + overrides + dtypes, remat and attention kernel."""
  return family_lib.preset_config(PRESETS, c, 'config.sd3')


def vae_config(c):
  """The VAE config of config.sd3.vae (a VAE_PRESETS key) with config.sd3.vae_overrides."""
  return family_lib.vae_preset_config(VAE_PRESETS, c, 'config.sd3')


def text_encoders(c):
  """The SD3 text encoders of config.sd3.text_encoders: a diffusers pipeline folder, or 'tiny_random'
  (tiny random CLIP-L/G + T5 built in-process, for the CPU smoke run)."""
  from ddrl_jax.models.sd3 import text as text_lib  # pylint: disable=g-import-not-at-top
  if c.text_encoders == 'tiny_random':
    return text_lib.tiny_random(seed=c.text_seed)
  if not c.text_encoders:
    raise ValueError('config.sd3.text_encoders is empty: give a diffusers SD3.5 pipeline folder (with '
                     "text_encoder/, text_encoder_2/, text_encoder_3/ and tokenizers) or 'tiny_random'")
  return text_lib.SD3TextEncoders.from_pretrained(pipeline_lib.resolve(c.text_encoders))


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


class SD3Family(family_lib.SectionFamily, pipeline_lib.PooledText, pipeline_lib.ImageLatents):
  """The MMDiT of SD3 / SD3.5 on (16, H/8, W/8) latents with its text encoders and VAE, from config.sd3."""

  name = 'sd3'
  section = 'sd3'
  LOGICAL_RULES = LOGICAL_RULES
  resume_safe_keys = ('sd3.checkpoint', 'sd3.vae_checkpoint', 'sd3.text_encoders')
  vae_checkpoint_key = 'config.sd3.vae_checkpoint'
  weights_source = '<diffusers SD3.5 folder>'
  text_encoder_key = 'sd3.text_encoders'
  convert_vae = 'sd35_vae'
  shape_key = 'config.sd3.resolution'

  def __init__(self, config):
    self.config = config
    self.c = c = config.sd3
    self.dit = dit_config(c)
    self.vae_cfg = vae_config(c)
    factor = self.vae_cfg.spatial_factor
    if c.resolution % (factor * self.dit.patch_size):
      raise ValueError(f'config.sd3.resolution={c.resolution}: not a multiple of the VAE factor {factor} '
                       f'x patch {self.dit.patch_size}')
    if self.vae_cfg.latent_channels != self.dit.in_channels:
      raise ValueError(f'config.sd3: VAE latent channels {self.vae_cfg.latent_channels} != MMDiT '
                       f'in_channels {self.dit.in_channels}')
    side = c.resolution // factor
    self.sample_shape = (self.dit.in_channels, side, side)
    self.media_shape = (1, c.resolution, c.resolution, 3)
    self.text_length = text_tokens(c)
    self.vae_checkpoint = c.vae_checkpoint
    self.vae_batch = c.vae_batch

  # ------------------------------------------------------------------------------ pipeline
  def make_text_encoder(self):
    return text_encoders(self.c)

  def text_shapes(self):
    return dict(text=(self.text_length, self.dit.joint_attention_dim), pooled=(self.dit.pooled_projection_dim,))

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


def _dit_converter(preset):
  return family_lib.preset_converter(preset, mmdit.abstract_model, sd3_convert.state_from_diffusers, 'transformer')


CONVERTERS = {'sd35_medium': _dit_converter(mmdit.sd35_medium), 'sd35_large': _dit_converter(mmdit.sd35_large),
              'sd3_tiny': _dit_converter(mmdit.tiny),
              'sd35_vae': autoencoder_kl_convert.converter(autoencoder_kl.sd35),
              'sd3_vae_tiny': autoencoder_kl_convert.converter(autoencoder_kl.tiny)}
