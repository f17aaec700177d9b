"""Wan2.1 as a model family ('wan': the text-to-video DiT, `transformer.WanDiT`, with its pipeline: the UMT5
text encoder, the Wan VAE, the condition schema), and the Wan converters for `python -m
ddrl_jax.models.convert` (the DiT from a diffusers `transformer/` folder, the VAE).

The family reads config.wan: the DiT preset ('wan1_3b', 'wan14b', 'tiny') and overrides, dtypes, remat,
the attention kernel, the converted checkpoint, the latent shape (T, H, W), the text encoder's folder and
the text length (UMT5, padded to 512 as the diffusers pipeline pads it), the VAE preset and its converted
checkpoint. Samples: (16, T, H, W) latents; media: (1 + 4 (T - 1), 8 H, 8 W, 3) uint8 videos. Wan is a rectified flow whose network predicts
eps - x0 from timestep = 1000 t: the library's convention. Conditions: {'text': (B, L, 4096)}; with
classifier-free guidance also 'guidance' (B,) and 'null_text' (the empty prompt's embedding):
v = v_null + w (v_cond - v_null) from one forward of 2B.

Original Wan2.1 VAE names (`Wan2.1_VAE.pth`, Cosmos' `tokenizer.pth`) are renamed to diffusers'
`AutoencoderKLWan` names first (`video_vae_convert.wan_original_to_diffusers`). The VAE is the shared
`models.video_vae.WanVAE` (Cosmos-Predict2.5 decodes with it too).
"""
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from ddrl_jax.models import checked_state
from ddrl_jax.models import family as family_lib
from ddrl_jax.models import pipeline as pipeline_lib
from ddrl_jax.models import video_vae
from ddrl_jax.models import video_vae_convert
from ddrl_jax.models.wan import transformer as wan_dit
from ddrl_jax.models.wan import transformer_convert

PRESETS = {'wan1_3b': wan_dit.wan1_3b, 'wan14b': wan_dit.wan14b, 'tiny': wan_dit.tiny}
LOGICAL_RULES = dict(wan_dit.LOGICAL_RULES)
VAE_PRESETS = {'wan21': video_vae.wan21, 'tiny': video_vae.tiny}


def vae_config(c):
  """The VAE config of config.wan.vae (a VAE_PRESETS key) with config.wan.vae_overrides."""
  return family_lib.vae_preset_config(VAE_PRESETS, c, 'config.wan')


def text_encoder(c):
  """The UMT5 encoder of config.wan.text_encoder: a diffusers Wan pipeline folder, or 'tiny_random'."""
  from ddrl_jax.models.wan import text as text_lib  # pylint: disable=g-import-not-at-top
  if c.text_encoder == 'tiny_random':
    return text_lib.tiny_random(seed=c.text_seed)
  if not c.text_encoder:
    raise ValueError("config.wan.text_encoder is empty: give a diffusers Wan2.1 pipeline folder (with "
                     "text_encoder/ and tokenizer/) or 'tiny_random'")
  return text_lib.WanTextEncoder.from_pretrained(pipeline_lib.resolve(c.text_encoder))


def make_apply_fn(graphdef, cfg_on):
  """apply_fn(params, x_t (B, 16, T, H, W), t (B,), cond) -> velocity (see the module docstring)."""

  def apply_fn(params, x_t, t, cond):
    params = jax.tree.map(lambda a: a, params)     # NNX Variables at this trace level
    model = nnx.merge(graphdef, params)
    timestep = jnp.reshape(t, (x_t.shape[0],)).astype(jnp.float32) * 1000.0
    if not cfg_on:
      return model(x_t, timestep, cond['text']).astype(jnp.float32)
    return family_lib.guided_velocity(model, x_t, timestep, cond, ('text',))

  return apply_fn


def dit_exporter(dit):
  """The Exporter of a WanDiT(dit): adapters under diffusers' WanTransformer3DModel module names."""
  return family_lib.Exporter(
      subtree='',
      diffusers_names=lambda path: transformer_convert.diffusers_names(path, dit),
      to_diffusers=lambda flat: transformer_convert.to_diffusers_state_dict(family_lib.nest_paths(flat), dit))


class WanFamily(family_lib.SectionFamily, pipeline_lib.LatentPipeline):
  """Wan2.1's text-to-video DiT on (16, T, H, W) latents with its text encoder and VAE, from config.wan."""

  name = 'wan'
  section = 'wan'
  LOGICAL_RULES = LOGICAL_RULES
  SEQUENCE_NAMES = wan_dit.SEQUENCE_NAMES
  resume_safe_keys = ('wan.checkpoint', 'wan.vae_checkpoint', 'wan.text_encoder')
  TEXT_FIELDS = {'text': 'text_embedding'}
  DECODE_PERM = (0, 2, 3, 4, 1)          # (M, 3, F, H, W) -> (M, F, H, W, 3)
  vae_checkpoint_key = 'config.wan.vae_checkpoint'
  weights_source = '<diffusers Wan2.1-T2V folder>'
  text_encoder_key = 'wan.text_encoder'
  convert_vae = 'wan21_vae'
  shape_key = 'config.wan.latent_shape'

  def __init__(self, config):
    self.config = config
    self.c = c = config.wan
    self.dit = family_lib.preset_config(PRESETS, c, 'config.wan')
    self.vae_cfg = vae_config(c)
    if self.vae_cfg.z_dim != self.dit.in_channels:
      raise ValueError(f'config.wan: VAE z_dim {self.vae_cfg.z_dim} != DiT in_channels {self.dit.in_channels}')
    lt, lh, lw = c.latent_shape
    _, ph, pw = self.dit.patch_size
    if lh % ph or lw % pw:
      raise ValueError(f'config.wan.latent_shape={tuple(c.latent_shape)}: H and W must be multiples of the '
                       f'patch {(ph, pw)}')
    self.sample_shape = (self.dit.in_channels, lt, lh, lw)
    tf, sf = self.vae_cfg.temporal_factor, self.vae_cfg.spatial_factor
    self.media_shape = (1 + tf * (lt - 1), sf * lh, sf * lw, 3)
    self.vae_checkpoint = c.vae_checkpoint
    self.vae_batch = c.vae_batch

  # ------------------------------------------------------------------------------ pipeline
  def make_text_encoder(self):
    return text_encoder(self.c)

  def encode_text(self, encoder, prompts):
    text = np.asarray(encoder.encode(prompts, max_sequence_length=self.c.text_length), np.float32)
    if text.shape[1:] != (self.c.text_length, self.dit.text_dim):
      raise ValueError(f'config.wan.text_encoder gives embeddings of shape {text.shape[1:]}; the DiT needs '
                       f'{(self.c.text_length, self.dit.text_dim)} (config.wan.text_length, text_dim)')
    return dict(text_embedding=text)

  def text_shapes(self):
    return dict(text=(self.c.text_length, self.dit.text_dim))

  def build_vae(self):
    return video_vae.WanVAE(self.vae_cfg, rngs=nnx.Rngs(self.c.vae_seed))

  def media_to_pixels(self, media_u8):
    """(B, F, H, W, 3) uint8 -> (B, 3, F, H, W) float32 in [-1, 1]."""
    return np.transpose(media_u8.astype(np.float32) / 127.5 - 1.0, (0, 4, 1, 2, 3))

  def build(self, key):
    return wan_dit.WanDiT(self.dit, rngs=nnx.Rngs(key))

  def apply_fn(self, graphdef):
    return make_apply_fn(graphdef, self.cfg_on)

  def forward_flops(self, sample_shape):
    """One DiT forward on one (16, T, H, W) latent with config.wan.text_length tokens; twice under CFG."""
    _, parts = wan_dit.forward_flops(self.dit, latent_thw=tuple(sample_shape[1:]),
                                     text_tokens=self.c.text_length)
    return float(sum(parts.values())) * (2 if self.cfg_on else 1)

  def attention_shape(self):
    return family_lib.AttentionShape(heads=self.dit.num_attention_heads, seq_blocks=self.c.latent_shape[0],
                                     key='wan.latent_shape', value=tuple(self.c.latent_shape))

  def exporter(self):
    return dit_exporter(self.dit)


FAMILIES = {'wan': WanFamily}


def _convert_vae(state_dict, config):
  if video_vae_convert.is_wan_original(state_dict):
    return video_vae_convert.convert_diffusers_vae_state_dict(
        video_vae_convert.wan_original_to_diffusers(state_dict, config), config), 'wan_original'
  return video_vae_convert.convert_diffusers_vae_state_dict(state_dict, config), 'diffusers'


_vae_abstract = lambda config: video_vae_convert.abstract_params(config)[0]
_dit_abstract = lambda config: nnx.eval_shape(lambda: wan_dit.WanDiT(config, rngs=nnx.Rngs(0)))


def _convert_dit(state_dict, config):
  pure = transformer_convert.from_diffusers_state_dict(state_dict, config)
  return checked_state.param_state(_dit_abstract(config), pure), 'diffusers'


_vae = lambda preset: family_lib.preset_converter(preset, _vae_abstract, _convert_vae, 'vae')
_dit = lambda preset: family_lib.preset_converter(preset, _dit_abstract, _convert_dit, 'transformer')
CONVERTERS = {'wan21_vae': _vae(video_vae.wan21), 'wan_tiny': _vae(video_vae.tiny),
              'wan1_3b': _dit(wan_dit.wan1_3b), 'wan14b': _dit(wan_dit.wan14b), 'wan_dit_tiny': _dit(wan_dit.tiny)}
