"""FLUX.1 as a model family ('flux'): the double/single-stream transformer, its pipeline (CLIP-L pooled +
T5-XXL text, the shared 16-channel AutoencoderKL at its FLUX preset, the guidance embedding as a model
input) and its converters (transformer and VAE) and LoRA exporter.

Reads config.flux (configs/flux1_dev.py): the transformer preset ('flux1_dev', 'flux1_schnell', 'tiny') and
overrides, dtypes, remat, the attention kernel, the converted checkpoint, the text encoders' folder and the
T5 sequence length, the VAE preset and its converted checkpoint, and the image resolution. The guidance
scales are the prompt task's (config.prompt.guidance_rollout / guidance_eval).

Samples: (16, R/8, R/8) normalized FLUX-VAE latents of R x R images (config.flux.resolution; the 2 x 2
packing is inside the transformer); media: one (1, R, R, 3) uint8 image.

Velocity adapter. FLUX is a rectified flow x_sigma = (1 - sigma) x0 + sigma eps whose network predicts
eps - x0 from sigma (the transformer multiplies it and the guidance by 1000): the library's convention
with t = sigma. Conditions: 'text' (B, L, 4096) the T5 states, 'pooled' (B, 768) CLIP-L's pooled output
and, for [dev] (guidance_mode 'embed': FLUX.1-dev is guidance-distilled), 'guidance' (B,), the scale fed to
the guidance embedder: one forward, no null branch, rollouts and evaluation each at the scale their
conditions carry. [schnell] has no guidance embedder ('none').

The sampler's time shift: diffusers' FluxPipeline shifts sigmas with mu linear in the image's token count
(256 tokens -> 0.5, 4096 -> 1.15) as exp(mu) / (exp(mu) + 1/sigma - 1), which is the library's static
`sampler.shift` s sigma / (1 + (s - 1) sigma) with s = exp(mu): `resolution_shift` gives it.
"""
import math

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from ddrl_jax.models import autoencoder_kl
from ddrl_jax.models import autoencoder_kl_convert
from ddrl_jax.models import family as family_lib
from ddrl_jax.models import pipeline as pipeline_lib
from ddrl_jax.models.flux import convert as flux_convert
from ddrl_jax.models.flux import transformer
from ddrl_jax.parallel import rules as rules_lib

PRESETS = {'flux1_dev': transformer.flux1_dev, 'flux1_schnell': transformer.flux1_schnell,
           'tiny': transformer.tiny}
VAE_PRESETS = {'flux1': autoencoder_kl.flux1, 'tiny': autoencoder_kl.tiny}
LOGICAL_RULES = {k: v for k, v in transformer.LOGICAL_RULES.items() if k not in rules_lib.DEFAULT_RULES}
# diffusers' FluxPipeline `calculate_shift` defaults (base_image_seq_len, max_image_seq_len, base_shift,
# max_shift), as in FLUX.1's scheduler config.
SHIFT_POINTS = (256, 4096, 0.5, 1.15)


def resolution_shift(resolution, vae_factor=8):
  """The static sampler shift exp(mu) that equals FluxPipeline's dynamic shift at R x R images."""
  tokens = (resolution // vae_factor // 2) ** 2
  base_len, max_len, base, top = SHIFT_POINTS
  mu = base + (top - base) * (tokens - base_len) / (max_len - base_len)
  return math.exp(mu)


def dit_config(c):
  return family_lib.preset_config(PRESETS, c, 'config.flux')


def vae_config(c):
  return family_lib.vae_preset_config(VAE_PRESETS, c, 'config.flux')


def text_encoders(c):
  """The FLUX text encoders of config.flux.text_encoders: a diffusers FLUX.1 pipeline folder, or
  'tiny_random' (tiny random CLIP-L + T5 built in-process, for the CPU smoke run)."""
  from ddrl_jax.models.flux import text as text_lib  # pylint: disable=g-import-not-at-top
  if c.text_encoders == 'tiny_random':
    return text_lib.tiny_random(seed=c.text_seed)
  if not c.text_encoders:
    raise ValueError('config.flux.text_encoders is empty: give a diffusers FLUX.1 pipeline folder (with '
                     "text_encoder/, tokenizer/, text_encoder_2/, tokenizer_2/) or 'tiny_random'")
  return text_lib.FluxTextEncoders.from_pretrained(pipeline_lib.resolve(c.text_encoders))


def make_apply_fn(graphdef, guidance_embeds):
  """apply_fn(params, x_t (B, 16, H, W), t (B,), cond) -> velocity (see the module docstring)."""

  def apply_fn(params, x_t, t, cond):
    params = jax.tree.map(lambda a: a, params)     # NNX Variables at this trace level
    model = nnx.merge(graphdef, params)
    sigma = jnp.reshape(t, (x_t.shape[0],)).astype(jnp.float32)
    guidance = jnp.reshape(cond['guidance'], (x_t.shape[0],)).astype(jnp.float32) if guidance_embeds else None
    return model(x_t, sigma, cond['text'], cond['pooled'], guidance).astype(jnp.float32)

  return apply_fn


def dit_exporter(dit):
  """Adapters and merged weights under diffusers' FluxTransformer2DModel module names."""
  return family_lib.Exporter(
      subtree='',
      diffusers_names=lambda path: flux_convert.diffusers_names(path, dit)[0],
      to_diffusers=lambda flat: flux_convert.to_diffusers_state_dict(family_lib.nest_paths(flat), dit))


class FluxFamily(family_lib.SectionFamily, pipeline_lib.PooledText, pipeline_lib.ImageLatents):
  """FLUX.1's transformer on (16, R/8, R/8) latents with its text encoders and VAE, from config.flux."""

  name = 'flux'
  section = 'flux'
  LOGICAL_RULES = LOGICAL_RULES
  resume_safe_keys = ('flux.checkpoint', 'flux.vae_checkpoint', 'flux.text_encoders')
  vae_checkpoint_key = 'config.flux.vae_checkpoint'
  weights_source = '<diffusers FLUX.1 folder>'
  text_encoder_key = 'flux.text_encoders'
  convert_vae = 'flux1_vae'
  shape_key = 'config.flux.resolution'

  def __init__(self, config):
    self.config = config
    self.c = c = config.flux
    self.dit = dit_config(c)
    self.vae_cfg = vae_config(c)
    self.guidance_mode = 'embed' if self.dit.guidance_embeds else 'none'
    factor = self.vae_cfg.spatial_factor
    if c.resolution % (factor * 2):
      raise ValueError(f'config.flux.resolution={c.resolution}: not a multiple of the VAE factor {factor} '
                       'x the 2 x 2 packing')
    if self.vae_cfg.latent_channels != self.dit.latent_channels:
      raise ValueError(f'config.flux: VAE latent channels {self.vae_cfg.latent_channels} != the transformer\'s '
                       f'{self.dit.latent_channels} (in_channels {self.dit.in_channels} / 4)')
    side = c.resolution // factor
    self.sample_shape = (self.dit.latent_channels, side, side)
    self.media_shape = (1, c.resolution, c.resolution, 3)
    self.vae_checkpoint = c.vae_checkpoint
    self.vae_batch = c.vae_batch

  # ------------------------------------------------------------------------------ pipeline
  def make_text_encoder(self):
    return text_encoders(self.c)

  def text_shapes(self):
    return dict(text=(self.c.max_sequence_length, self.dit.joint_attention_dim),
                pooled=(self.dit.pooled_projection_dim,))

  # ------------------------------------------------------------------------------- network
  def build(self, key):
    return transformer.FluxTransformer(self.dit, rngs=nnx.Rngs(key))

  def apply_fn(self, graphdef):
    return make_apply_fn(graphdef, self.dit.guidance_embeds)

  def forward_flops(self, sample_shape):
    """One transformer forward on one (16, H, W) latent with the T5 sequence (no CFG branch)."""
    _, parts = transformer.forward_flops(self.dit, latent_hw=tuple(sample_shape[1:]),
                                         text_tokens=self.c.max_sequence_length)
    return float(sum(parts.values()))

  def attention_shape(self):
    """Context parallelism shards the image tokens ((R/16)^2 after packing); text stays replicated."""
    side = self.c.resolution // self.vae_cfg.spatial_factor // 2
    return family_lib.AttentionShape(heads=self.dit.num_attention_heads, seq_blocks=side * side,
                                     key='flux.resolution', value=self.c.resolution)

  def exporter(self):
    return dit_exporter(self.dit)


FAMILIES = {'flux': FluxFamily}


def _dit_converter(preset):
  return family_lib.preset_converter(preset, transformer.abstract_model, flux_convert.state_from_diffusers,
                                     'transformer')


CONVERTERS = {'flux1_dev': _dit_converter(transformer.flux1_dev),
              'flux1_schnell': _dit_converter(transformer.flux1_schnell),
              'flux_tiny': _dit_converter(transformer.tiny),
              'flux1_vae': autoencoder_kl_convert.converter(autoencoder_kl.flux1),
              'flux_vae_tiny': autoencoder_kl_convert.converter(autoencoder_kl.tiny)}
