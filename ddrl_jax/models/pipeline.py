"""The text-to-media pipeline a latent model family owns: its text encoders (prompts -> embeddings, each
prompt encoded once per run), its condition schema (which embedding fields, and how classifier-free
guidance enters) and its VAE (media <-> latents), so that one prompt task (`ddrl_jax.tasks.prompt_task`)
serves every text-to-image and text-to-video family.

`LatentPipeline` is the mixin a family composes (Wan's and Cosmos' do; SD3's and FLUX's compose
`ImageLatents`, a LatentPipeline with the image VAE's parts: DECODE_PERM, build_vae and media_to_pixels of
(1, R, R, 3) images through `autoencoder_kl.AutoencoderKL`, and `PooledText`, the TEXT_FIELDS and
encode_text of a T5 sequence with a CLIP pooled vector); the family supplies:

  TEXT_FIELDS        {condition name: record name}, e.g. {'text': 'text_embedding', 'pooled': ...}
  DECODE_PERM        the axes that turn the VAE's decoded (M, 3, ...) pixels into (M, ..., 3) media
  sample_shape       one latent (C, ...), media_shape one uint8 medium (F, H, W, 3)
  vae_batch          samples per local device per VAE call (the last chunk is zero-padded)
  make_text_encoder() -> an encoder object; encode_text(encoder, prompts) -> {record name: (B, ...)}
  text_shapes()      {condition name: per-sample shape}
  build_vae()        the VAE module (encode / decode / normalize_latents / denormalize_latents), random
                     weights; `vae_checkpoint` (a converted checkpoint folder, '' = random) and
                     `vae_checkpoint_key` (the config key, for messages) load its weights
  media_to_pixels(u8) (B, *media_shape) uint8 -> the VAE's (B, 3, ...) float32 input in [-1, 1]
  cache_text         whether `encode_prompts` keeps each prompt's embedding for the run (True); a family
                     whose embeddings are too large to keep sets False (Cosmos' Reason1: 196 MiB a prompt)
                     and every call encodes its prompts
  guidance_mode      'cfg': guidance runs the 2B forward with the empty prompt's 'null_<field>' twins;
                     'embed': the scale is a model input (FLUX.1-dev's guidance embedding, guidance
                     distillation): every condition carries 'guidance' (B,), no null branch, one forward;
                     'none': the pipeline adds no guidance fields (the family takes no guidance, or its
                     own: Cosmos' negative-prompt guidance, which its task adds)
  cfg_on             whether any phase samples with guidance != 1 (then conditions carry 'guidance')
  shape_key          the config key that sets the sample shape (for messages)
  required_inputs()  the weights a full run needs (a default from section, weights_source,
                     convert_models() and text_encoder_key is below); convert_models() defaults to the
                     section's `model` and the class's `convert_vae` (the converter CLI's model names)

Conditions built here: the text fields (B, ...) float32 and, when `cfg_on`, 'guidance' (B,) with the
empty prompt's 'null_<name>' for each text field; under 'embed', 'guidance' (B,) alone, always. Tasks add their own fields (the prompt task: 'index').

Shared pieces every family's pipeline uses: `resolve` (paths relative to the repository root),
`restore_converted` (converted weights into a module), `vae_functions` (the jitted encode and the
data-parallel uint8 decode).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddrl_jax.models import autoencoder_kl
from ddrl_jax.parallel import hosts

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GUIDANCE_MODES = ('cfg', 'embed', 'none')


def resolve(path):
  """A config path, relative paths taken from the repository root (where the README's commands run)."""
  return path if not path or os.path.isabs(path) else os.path.join(REPO_ROOT, path)


def restore_converted(module, ckpt_dir, key):
  """Loads converted parameters (`python -m ddrl_jax.models.convert`) into `module`'s Params (not LoRA
  adapters), in place; ValueError naming `key` when they do not fit."""
  from ddrl_jax.models import convert  # pylint: disable=g-import-not-at-top
  state = nnx.state(module, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
  host = convert.load_converted_like(ckpt_dir, nnx.to_pure_dict(state), key)
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, host))
  nnx.update(module, state)


def vae_functions(vae, perm):
  """(state, encode, decode_u8, decode_u8's state placed on this host's devices) of a VAE module with
  encode/decode/normalize_latents/denormalize_latents: encode(state, pixels in [-1, 1]) -> normalized
  latents (jitted); decode_u8(state, latents) -> (uint8 pixels transposed by `perm`, finite (M,)),
  data parallel over this host's devices. Non-finite latents decode as zeros and are marked."""
  graphdef, state = nnx.split(vae)

  @jax.jit
  def encode(s, pixels):
    m = nnx.merge(graphdef, s)
    return m.normalize_latents(m.encode(pixels))

  def decode_u8(s, z):
    m = nnx.merge(graphdef, s)
    z = z.astype(jnp.float32)
    pixels = m.decode(m.denormalize_latents(jnp.nan_to_num(z)))
    finite = jnp.isfinite(z).reshape(z.shape[0], -1).all(-1) & \
        jnp.isfinite(pixels).reshape(pixels.shape[0], -1).all(-1)
    u8 = jnp.round((jnp.nan_to_num(pixels).clip(-1, 1) + 1.0) * 127.5).astype(jnp.uint8)
    return jnp.transpose(u8, perm), finite

  decode_u8 = hosts.local_data_parallel(decode_u8)
  return state, encode, decode_u8, decode_u8.place(state)


def guidance_of(config):
  """(guidance_rollout, guidance_eval) of the run: the prompt task's section (config.prompt), 1.0 where a
  config has none (no guidance)."""
  section = config.get('prompt') if hasattr(config, 'get') else None
  if section is None:
    return 1.0, 1.0
  return float(section.get('guidance_rollout', 1.0)), float(section.get('guidance_eval', 1.0))


class LatentPipeline:
  """Text encoders, condition schema and VAE of a latent family (see the module docstring). State (the
  encoder, the embedding cache, the VAE functions) is created on first use, so building a family for
  `aot` or a config check loads nothing."""

  TEXT_FIELDS = {'text': 'text_embedding'}
  DECODE_PERM = ()
  guidance_mode = 'cfg'
  cache_text = True
  vae_checkpoint = ''
  vae_checkpoint_key = ''
  vae_batch = 1

  # ------------------------------------------------------------------ supplied by the family
  def make_text_encoder(self):
    raise NotImplementedError

  def encode_text(self, encoder, prompts):
    raise NotImplementedError

  def text_shapes(self):
    raise NotImplementedError

  def build_vae(self):
    raise NotImplementedError

  def media_to_pixels(self, media_u8):
    raise NotImplementedError

  # ------------------------------------------------------------------------------ guidance
  @property
  def cfg_on(self):
    """Whether any phase samples with classifier-free guidance (config.prompt.guidance_rollout or
    guidance_eval != 1), so that apply_fn runs the 2B forward of `family.guided_velocity`."""
    return self.guidance_mode == 'cfg' and any(g != 1.0 for g in guidance_of(self.config))

  # ---------------------------------------------------------------------------------- text
  def _pipeline_state(self):
    if not hasattr(self, '_text_cache'):
      self._text_encoder = None
      self._text_cache = {}          # prompt -> {record name: per-sample float32 array}
      self._vae_fns = None
    return self

  def text_encoder(self):
    """The family's text encoder (`make_text_encoder()`, made on first use and kept)."""
    self._pipeline_state()
    if self._text_encoder is None:
      self._text_encoder = self.make_text_encoder()
    return self._text_encoder

  def encode_prompts(self, prompts):
    """list[str] -> {record name: (B, ...)} float32 embeddings, each prompt encoded once per run (every
    call encodes all of `prompts`, in one `encode_text` call, when the family sets `cache_text` False)."""
    self._pipeline_state()
    if not self.cache_text:
      out = self.encode_text(self.text_encoder(), list(prompts))
      return {field: np.asarray(out[field], np.float32) for field in self.TEXT_FIELDS.values()}
    todo = [p for p in dict.fromkeys(prompts) if p not in self._text_cache]
    if todo:
      out = self.encode_text(self.text_encoder(), todo)
      for i, p in enumerate(todo):
        self._text_cache[p] = {k: np.asarray(v[i], np.float32) for k, v in out.items()}
    return {field: np.stack([self._text_cache[p][field] for p in prompts])
            for field in self.TEXT_FIELDS.values()}

  # ---------------------------------------------------------------------------- conditions
  def text_conditions(self, prompts, guidance, given=None):
    """The family's condition fields for `prompts` at `guidance`: the text fields (B, ...) float32 and,
    under CFG, 'guidance' (B,) and 'null_<name>'. `given` {record name: (B, ...)} embeddings are used as
    they are when every text field is there (records may carry them)."""
    given = given or {}
    if any(given.get(f) is None for f in self.TEXT_FIELDS.values()):
      given = self.encode_prompts(list(prompts))
    b = len(prompts)
    cond = {name: jnp.asarray(given[field], jnp.float32) for name, field in self.TEXT_FIELDS.items()}
    if self.cfg_on:
      null = self.encode_prompts([''])
      cond['guidance'] = jnp.full((b,), guidance, jnp.float32)
      for name, field in self.TEXT_FIELDS.items():
        cond[f'null_{name}'] = jnp.asarray(np.repeat(null[field], b, 0))
    elif self.guidance_mode == 'embed':
      cond['guidance'] = jnp.full((b,), guidance, jnp.float32)
    return cond

  def abstract_text_conditions(self, batch):
    """ShapeDtypeStructs of `text_conditions` for `batch` prompts."""
    f32 = jnp.float32
    text = {name: jax.ShapeDtypeStruct((batch,) + tuple(shape), f32) for name, shape in self.text_shapes().items()}
    out = dict(text)
    if self.cfg_on:
      out['guidance'] = jax.ShapeDtypeStruct((batch,), f32)
      out.update({f'null_{name}': s for name, s in text.items()})
    elif self.guidance_mode == 'embed':
      out['guidance'] = jax.ShapeDtypeStruct((batch,), f32)
    return out

  # ----------------------------------------------------------------------------------- VAE
  def vae(self):
    """(state, encode, decode_u8, local state) of the family's VAE with its converted weights."""
    self._pipeline_state()
    if self._vae_fns is None:
      module = self.build_vae()
      if self.vae_checkpoint:
        restore_converted(module, resolve(self.vae_checkpoint), self.vae_checkpoint_key)
      self._vae_fns = vae_functions(module, self.DECODE_PERM)
    return self._vae_fns

  def decode(self, latents):
    """(M, *sample_shape) latents -> (uint8 media, finite (M,)): images (M, H, W, 3) when DECODE_PERM
    drops no frame axis (an image VAE), videos (M, F, H, W, 3); in chunks of `vae_batch` per local device
    (the last chunk zero-padded: one compiled shape)."""
    _, _, decode_u8, local_state = self.vae()
    return hosts.in_chunks(decode_u8, local_state, np.asarray(latents, np.float32), self.vae_batch)

  def encode_samples(self, media_u8):
    """(B, *media_shape) uint8 media -> (B, *sample_shape) normalized latents (posterior mean), in chunks
    of `vae_batch` (the last one zero-padded: one compiled shape)."""
    media_u8 = np.asarray(media_u8)
    if media_u8.dtype != np.uint8 or media_u8.shape[1:] != tuple(self.media_shape):
      raise ValueError(f'encode_samples: expected (B, *{self.media_shape}) uint8, got {media_u8.shape} '
                       f'{media_u8.dtype}')
    state, encode, _, _ = self.vae()
    step = self.vae_batch
    out = []
    for s in range(0, media_u8.shape[0], step):
      pixels = self.media_to_pixels(media_u8[s:s + step])
      padded = np.zeros((step,) + pixels.shape[1:], np.float32)
      padded[:len(pixels)] = pixels
      out.append(np.asarray(encode(state, jnp.asarray(padded)), np.float32)[:len(pixels)])
    return np.concatenate(out) if out else np.zeros((0,) + tuple(self.sample_shape), np.float32)

  # ------------------------------------------------------------------------- run inputs
  def convert_models(self):
    """The converter model names of this family's DiT (by its section's `model`) and VAE (`convert_vae`)."""
    return self.c.model, self.convert_vae

  def required_inputs(self):
    """The weights a full run of this family needs (`preflight.Input`s): the converted DiT and VAE and
    the text encoders' folder, each with the command that makes it."""
    from ddrl_jax import preflight  # pylint: disable=g-import-not-at-top
    c, sec, src = self.c, self.section, self.weights_source
    model, vae = self.convert_models()
    text_key = self.text_encoder_key.split('.', 1)[1]
    return [preflight.Input(f'{sec}.checkpoint', c.checkpoint, f'the converted {c.model} transformer',
                            f'python -m ddrl_jax.models.convert --model={model} --source={src}/transformer '
                            '--out=<dir>'),
            preflight.Input(f'{sec}.vae_checkpoint', c.vae_checkpoint, 'the converted VAE',
                            f'python -m ddrl_jax.models.convert --model={vae} --source={src}/vae --out=<dir>'),
            preflight.Input(self.text_encoder_key, c.get(text_key, ''), 'the text encoders',
                            f'{src} (its text encoder and tokenizer folders)')]

  @property
  def is_video(self):
    """Whether a medium has more than one frame."""
    return self.media_shape[0] > 1


class PooledText:
  """The text conditions of SD3 and FLUX: 'text' the T5 (joint) sequence and 'pooled' the CLIP pooled vector,
  from the family's encoder's encode(prompts, max_sequence_length=c.max_sequence_length) -> (text, pooled).
  Composed before the LatentPipeline (it overrides TEXT_FIELDS and encode_text)."""

  TEXT_FIELDS = {'text': 'text_embedding', 'pooled': 'pooled_embedding'}

  def encode_text(self, encoder, prompts):
    text, pooled = encoder.encode(prompts, max_sequence_length=self.c.max_sequence_length)
    return dict(text_embedding=text, pooled_embedding=pooled)


class ImageLatents(LatentPipeline):
  """A LatentPipeline of one-image media, (1, R, R, 3) uint8, through the shared AutoencoderKL (SD3's and
  FLUX's): the family sets `vae_cfg` (an `autoencoder_kl.AutoencoderKLConfig`) and `c.vae_seed`."""

  DECODE_PERM = (0, 2, 3, 1)             # (M, 3, H, W) -> (M, H, W, 3)

  def build_vae(self):
    return autoencoder_kl.AutoencoderKL(self.vae_cfg, rngs=nnx.Rngs(self.c.vae_seed))

  def media_to_pixels(self, media_u8):
    """(B, 1, R, R, 3) uint8 -> (B, 3, R, R) float32 in [-1, 1]."""
    return np.transpose(media_u8[:, 0].astype(np.float32) / 127.5 - 1.0, (0, 3, 1, 2))
