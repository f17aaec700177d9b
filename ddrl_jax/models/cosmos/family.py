"""The Cosmos families: the Cosmos-Predict2.5 video DiT ('cosmos') and its one-frame text-to-image wrapper
with a byte text encoder ('cosmos_t2i'), behind `models.family.ModelFamily`; and the Cosmos converters.

'cosmos' reads config.cosmos (configs/cosmos_common.py): the DiT preset and overrides, dtypes, remat,
attention kernel, the converted checkpoint and the image-to-video conditioning time. Its velocity adapter
is cosmos' frame replacement (`make_video_apply_fn`; the derivation is in tasks/video.py). It owns its
pipeline (`models.pipeline.LatentPipeline`):
  VAE    the Wan2.1 VAE (`models.video_vae.WanVAE`, Cosmos-Predict2.5's tokenizer) of config.cosmos.vae with
         vae_overrides, weights from config.cosmos.vae_checkpoint ('' = random, seed vae_seed), in chunks of
         config.cosmos.vae_batch; samples (16, T, H, W) normalized latents, media (F, H, W, 3) uint8 videos
         with F = 1 + 4 (T - 1) (the tiny preset's factors where it has others).
  text   config.cosmos.text: 'reason1', Cosmos-Predict2.5's own conditioning, the Cosmos-Reason1-7B
         language model in JAX (`models.reason1_text`) from config.cosmos.text_encoder, text_length chat
         tokens, 28 normalised hidden states concatenated (512, 100352) at the paper's size, prompts cut to
         text_length counted in `num_truncated_prompts`; 'bytes', the prompt's UTF-8 bytes through a frozen
         fixed-seed (config.cosmos.text_seed) `models.text.ByteEmbedding` of the DiT's text width (a
         stand-in for `:smoke` runs). Embeddings are not cached (`cache_text` False): a Reason1 one is
         196 MiB in float32 at the paper's size, and one encoder forward costs about 1/300 of one DiT
         forward at 720p (README). `device_text_encoder()` describes the Reason1 encoder for `aot`.
  guidance  Cosmos' own, not the pipeline's empty-prompt CFG (guidance_mode 'none'): the task adds
         'guidance' w (B,) and 'null_text', `negative_text()` (config.cosmos.negative_prompt, default
         diffusers' NEGATIVE_PROMPT), and the adapter computes v_cond + w (v_cond - v_null).

'cosmos_t2i' reads config.ocr (configs/ocr_tiny.py): width, depth, heads, ..., the x-prediction floor
min_t, classifier-free guidance, and the base checkpoint written by `ddrl_jax.pretrain`. The image size is
config.ocr.image_size when given, else the OCR renders' 32 x 96.
"""
import os

import flax.nnx as nnx
import jax
import jax.numpy as jnp

import numpy as np

from ddrl_jax import params_io
from ddrl_jax.models import family as family_lib
from ddrl_jax.models import pipeline as pipeline_lib
from ddrl_jax.models import text as text_lib
from ddrl_jax.models import video_vae
from ddrl_jax.models.cosmos import convert as cosmos_convert
from ddrl_jax.models.cosmos import dit as cosmos_dit
from ddrl_jax.models.cosmos import t2i as cosmos_t2i

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PRESETS = {'cosmos2b': cosmos_dit.cosmos2b, 'cosmos14b': cosmos_dit.cosmos14b, 'tiny': cosmos_dit.tiny}
OCR_IMAGE_SIZE = (32, 96)        # tasks/text_render.py's HEIGHT, WIDTH

# Logical names the Cosmos DiT adds to the shared ones (parallel/rules.py): the raw text-embedding width
# (100352) and the context width after its projection (1024) are FSDP-sharded like the model width; the
# adaLN-LoRA rank (256) is small and replicated; latent frames split over context like the tokens.
LOGICAL_RULES = {
    'crossattn_in': 'fsdp',
    'cross_embed': 'fsdp',
    'adaln': '',
    'act_frames': 'context',
}
SEQUENCE_NAMES = ('act_frames', 'act_seq')

VAE_PRESETS = {'wan21': video_vae.wan21, 'tiny': video_vae.tiny}
TEXT_KINDS = ('reason1', 'bytes')
# diffusers' Cosmos2_5_PredictBasePipeline DEFAULT_NEGATIVE_PROMPT (its classifier-free guidance's null).
NEGATIVE_PROMPT = (
    'The video captures a series of frames showing ugly scenes, static with no motion, motion blur, '
    'over-saturation, shaky footage, low resolution, grainy texture, pixelated images, poorly lit areas, '
    'underexposed and overexposed scenes, poor color balance, washed out colors, choppy sequences, '
    'jerky movements, low frame rate, artifacting, color banding, unnatural transitions, outdated special '
    'effects, fake elements, unconvincing visuals, poorly edited content, jump cuts, visual noise, and '
    'flickering. Overall, the video is of poor quality.')


def dit_config(c):
  """CosmosDiTConfig from config.cosmos: preset ('cosmos2b', 'cosmos14b', 'tiny') + overrides."""
  return family_lib.preset_config(PRESETS, c, 'config.cosmos')


def vae_config(c):
  """The Wan VAE config of config.cosmos.vae (a VAE_PRESETS key) with config.cosmos.vae_overrides."""
  return family_lib.vae_preset_config(VAE_PRESETS, c, 'config.cosmos')


def make_video_apply_fn(graphdef, cond_timestep):
  """apply_fn(params, x_t, t, cond) -> velocity for an NNX CosmosDiT graphdef.

  x_t (B, 16, T, H, W) flow state, t (B,), cond {'text' (B, L, C), optional 'first_frame'
  (B, 16, 1, H, W) and 'num_cond' (B,)} (a missing 'first_frame'/'num_cond' means text-to-video). The
  conditioned frame enters as its ground truth at time `cond_timestep`, and its velocity is
  (x_t - gt) / t, so every consumer's x0_hat = x_t - t v equals gt there (tasks/video.py).

  Classifier-free guidance when cond also holds 'guidance' (B,) and 'null_text' (B, L, C) (the negative
  prompt's embedding): v = v_cond + w (v_cond - v_null) with w = cond['guidance'], Cosmos-Predict2.5's
  form (diffusers' Cosmos2_5_PredictBasePipeline: guidance 7 is w = 7, not the v_null + w (..) of SD3), one
  forward of 2B. The conditioned frame's velocity is the same in both halves, so guidance leaves it. Which
  conditions carry the keys is static (the pytree), so rollouts without them pay one forward.
  """

  def velocity(model, x_t, t, context, first, num_cond):
    b = x_t.shape[0]
    if first is None:
      num_cond = jnp.zeros((b,), jnp.int32)
      gt = jnp.zeros_like(x_t)
    else:
      num_cond = jnp.reshape(num_cond, (b,)).astype(jnp.int32)
      gt = jnp.zeros_like(x_t).at[:, :, :first.shape[2]].set(first.astype(jnp.float32))
    x_in, mask = cosmos_dit.frame_replace(x_t, gt, num_cond)       # mask (B, 1, T, H, W)
    frame_on = mask[:, 0, :, 0, 0]                                  # (B, T)
    timesteps = jnp.where(frame_on > 0, jnp.float32(cond_timestep), t[:, None])
    v = model(x_in, timesteps, context, cond_mask=mask).astype(jnp.float32)
    tb = t.reshape((b, 1, 1, 1, 1))
    v_cond = (x_t - gt) / tb
    return jnp.where(mask > 0, v_cond, v)

  def apply_fn(params, x_t, t, cond):
    # Rebuild the Variables at the current trace level: the sampler closes over params under jit and
    # calls this inside vmap, where NNX refuses Variables created at the outer (jit) level.
    params = jax.tree.map(lambda a: a, params)
    model = nnx.merge(graphdef, params)
    b = x_t.shape[0]
    x_t = x_t.astype(jnp.float32)
    t = jnp.reshape(t, (b,)).astype(jnp.float32)
    first, num_cond = cond.get('first_frame'), cond.get('num_cond')
    if 'guidance' not in cond:
      return velocity(model, x_t, t, cond['text'], first, num_cond)
    two = lambda a: None if a is None else jnp.concatenate([a, a])
    both = velocity(model, two(x_t), two(t), jnp.concatenate([cond['text'], cond['null_text']]),
                    two(first), two(num_cond))
    v_cond, v_null = jnp.split(both, 2)
    w = jnp.reshape(cond['guidance'], (b, 1, 1, 1, 1)).astype(jnp.float32)
    return v_cond + w * (v_cond - v_null)

  return apply_fn


def t2i_config(c):
  """T2IConfig from config.ocr (the OCR task's model section)."""
  height, width = tuple(c.get('image_size', OCR_IMAGE_SIZE))
  dit = cosmos_dit.CosmosDiTConfig(
      in_channels=3, model_channels=c.width, num_blocks=c.depth, num_heads=c.heads,
      mlp_ratio=c.mlp_ratio, adaln_lora_dim=c.adaln_lora_dim, patch=(1, c.patch, c.patch),
      crossattn_in=c.text_dim, context_dim=c.width, rope_h_ratio=1.0, rope_w_ratio=1.0,
      rope_t_ratio=1.0, remat_policy='none',
      # Learned absolute positions: character k is drawn in cell k, which a query can only find by its
      # absolute column (RoPE makes self-attention relative). Without them the text was ignored for
      # thousands of steps (benchmarks/RESULTS.md).
      extra_pos_embed=True, extra_pos_max_size=(1, height // c.patch, width // c.patch),
      # Sinusoids of 1000 t (DiT's scale): at Cosmos' scale of t in [0, 1] the embedding's fastest
      # frequency is 1 radian per unit t, too coarse for a small model to tell t = 0.05 from 0.1.
      timestep_scale=1000.0)
  return cosmos_t2i.T2IConfig(dit=dit, text_length=c.text_length)


def make_t2i_apply_fn(graphdef, min_t, guidance=1.0):
  """apply_fn(params, x_t (B, 3, H, W), t (B,), ids (B, L)) -> velocity.

  The network predicts the clean image x0_hat (x-prediction) and the velocity is
  v = (x_t - x0_hat) / max(t, min_t). In pixel space an 8 x 8 x 3 patch has 192 values but the model
  is 128 wide: it cannot pass per-pixel noise through, which predicting v = noise - x0 directly
  needs at large t (its samples stayed noisy), while the clean image lies on a low-dimensional
  manifold that it can represent ("let denoising models denoise", Li & He 2025).
  guidance != 1: classifier-free guidance, x0_hat = x0_null + guidance (x0_cond - x0_null), with the
  null condition (all byte ids 0) the model learned through condition dropout; one forward of 2B.
  """
  def apply_fn(params, x_t, t, cond):
    params = jax.tree.map(lambda a: a, params)     # NNX Variables at this trace level (see above)
    model = nnx.merge(graphdef, params)
    if guidance == 1.0:
      x0_hat = model(x_t, t, cond)
    else:
      both = model(jnp.concatenate([x_t, x_t]), jnp.concatenate([jnp.reshape(t, (-1,))] * 2),
                   jnp.concatenate([cond, jnp.zeros_like(cond)]))
      x0_cond, x0_null = jnp.split(both, 2)
      x0_hat = x0_null + guidance * (x0_cond - x0_null)
    tb = jnp.maximum(jnp.reshape(t, (-1,) + (1,) * (x_t.ndim - 1)), min_t)
    return (x_t - x0_hat) / tb
  return apply_fn


def resolve(path):
  """A config path, relative paths taken from the repository root (where the README's commands run)."""
  return path if not path or os.path.isabs(path) else os.path.join(REPO_ROOT, path)


def _flops(dit, latent, text_tokens):
  _, parts = cosmos_dit.forward_flops(dit, latent=tuple(latent), text_tokens=text_tokens)
  return float(sum(parts.values()))


def dit_exporter(num_blocks, subtree=''):
  """The Exporter of a Cosmos DiT of `num_blocks` blocks found at `subtree` of the module."""
  return family_lib.Exporter(
      subtree=subtree,
      diffusers_names=lambda path: cosmos_convert.diffusers_names(path, num_blocks)[0],
      to_diffusers=lambda flat: cosmos_convert.to_diffusers_state_dict(flat, num_blocks))


class _CosmosBase(family_lib.SectionFamily):
  """What both Cosmos families share: the DiT's rules, sequence names, kernel and exporter."""

  dit: cosmos_dit.CosmosDiTConfig
  LOGICAL_RULES = LOGICAL_RULES
  SEQUENCE_NAMES = SEQUENCE_NAMES
  _export_subtree = ''

  def exporter(self):
    return dit_exporter(self.dit.num_blocks, self._export_subtree)


class CosmosVideoFamily(_CosmosBase, pipeline_lib.LatentPipeline):
  """The Cosmos-Predict2.5 DiT on (16, T, H, W) latents with its pipeline (the Wan2.1 VAE, the Reason1 or
  byte text encoder; see the module docstring), from config.cosmos."""

  name = 'cosmos'
  section = 'cosmos'
  # The base weights' source and the evaluation's prompts, guidance and judges: a resumed run may change them.
  resume_safe_keys = ('cosmos.checkpoint', 'cosmos.eval_prompts', 'cosmos.guidance_eval',
                      'cosmos.negative_prompt', 'cosmos.eval_rewards')
  TEXT_FIELDS = {'text': 'text_embedding'}
  DECODE_PERM = (0, 2, 3, 4, 1)          # (M, 3, F, H, W) -> (M, F, H, W, 3)
  guidance_mode = 'none'                 # Cosmos' guidance is its own (negative prompt, w > 0; see above)
  cache_text = False                     # a Reason1 embedding is 196 MiB at the paper's size
  vae_checkpoint_key = 'config.cosmos.vae_checkpoint'
  shape_key = 'config.cosmos.latent_shape'

  def __init__(self, config):
    self.config = config
    self.c = c = config.cosmos
    self.dit = dit_config(c)
    if c.text not in TEXT_KINDS:
      raise ValueError(f'config.cosmos.text={c.text!r}; known: {TEXT_KINDS}')
    self.vae_cfg = vae_config(c)
    if self.vae_cfg.z_dim != self.dit.in_channels:
      raise ValueError(f'config.cosmos: VAE z_dim {self.vae_cfg.z_dim} != DiT in_channels '
                       f'{self.dit.in_channels}')
    lt, lh, lw = c.latent_shape
    self.sample_shape = (self.dit.in_channels, lt, lh, lw)
    tf, sf = self.vae_cfg.temporal_factor, self.vae_cfg.spatial_factor
    self.media_shape = (1 + tf * (lt - 1), sf * lh, sf * lw, 3)
    self.vae_checkpoint = c.vae_checkpoint
    self.vae_batch = c.vae_batch
    self.num_truncated_prompts = 0   # prompts longer than text_length chat tokens (cut, logged)
    self._negative_text = None

  @property
  def text_width(self):
    """The width C of the DiT's text input cond['text'] (B, L, C): crossattn_in, or context_dim without a
    projection."""
    return self.dit.crossattn_in or self.dit.context_dim

  # ------------------------------------------------------------------------------ pipeline
  def text_shapes(self):
    return dict(text=(self.c.text_length, self.text_width))

  def make_text_encoder(self):
    """'reason1': the Cosmos-Reason1 encoder of config.cosmos.text_encoder, checked against the DiT's text
    width; 'bytes': the frozen byte embedding (jitted)."""
    c = self.c
    if c.text == 'bytes':
      emb = text_lib.ByteEmbedding(self.text_width, c.text_length, rngs=nnx.Rngs(c.text_seed))
      return jax.jit(lambda i: emb(i))  # pylint: disable=unnecessary-lambda
    from ddrl_jax import parallel  # pylint: disable=g-import-not-at-top
    from ddrl_jax.models import reason1_text  # pylint: disable=g-import-not-at-top
    if not c.get('text_encoder'):
      raise ValueError("config.cosmos.text='reason1' needs config.cosmos.text_encoder: a diffusers "
                       'Cosmos-Predict2.5 folder (text_encoder/ + tokenizer/, e.g. of '
                       'nvidia/Cosmos-Predict2.5-2B) or its text_encoder folder')
    # Inference only (no fp32 masters), FSDP over this process's devices: each process encodes its own
    # groups' prompts, so the encoder runs without cross-host collectives (ShardingPlan.for_host).
    enc = reason1_text.Reason1TextEncoder.from_pretrained(
        c.text_encoder, max_length=c.text_length, batch_size=c.get('text_batch', 4),
        dtype=self.dit.dtype, param_dtype=self.dit.dtype,
        plan=parallel.ShardingPlan.for_host(self.config, jax.local_devices(), self))
    if enc.dim != self.text_width:
      raise ValueError(f'config.cosmos.text_encoder={c.text_encoder!r} gives {enc.dim}-wide '
                       f'embeddings ({enc.config.num_layers} layers x {enc.config.hidden_size}); the DiT '
                       f'takes {self.text_width} (config.cosmos.model={c.model!r})')
    return enc

  def encode_text(self, encoder, prompts):
    """{'text_embedding': (B, text_length, text_width) float32} of `prompts`."""
    prompts = list(prompts)
    if self.c.text == 'bytes':
      ids, _ = text_lib.encode_bytes(prompts, self.c.text_length)
      return dict(text_embedding=np.asarray(encoder(jnp.asarray(ids)), np.float32))
    encoded = encoder.encode(prompts)
    self.num_truncated_prompts += encoded.num_truncated
    return dict(text_embedding=np.asarray(encoded.embeddings, np.float32))

  def negative_text(self):
    """(text_length, text_width) float32: the embedding of config.cosmos.negative_prompt (diffusers'
    NEGATIVE_PROMPT when the config has none), the null branch of Cosmos' guidance (kept for the run)."""
    if self._negative_text is None:
      prompt = self.c.get('negative_prompt', NEGATIVE_PROMPT)
      self._negative_text = self.encode_prompts([prompt])['text_embedding'][0]
    return self._negative_text

  def device_text_encoder(self):
    """The text encoder run on the training devices (models.reason1_text.DeviceEncoder, for
    `ddrl_jax.aot`), or None without config.cosmos.text='reason1'."""
    from ddrl_jax.models import reason1_text  # pylint: disable=g-import-not-at-top
    return reason1_text.device_encoder(self.c, self.text_width, self.dit.dtype)

  def build_vae(self):
    return video_vae.WanVAE(self.vae_cfg, rngs=nnx.Rngs(self.c.vae_seed))

  def media_to_pixels(self, media_u8):
    """(B, F, H, W, 3) uint8 -> (B, 3, F, H, W) float32 in [-1, 1]."""
    return np.transpose(media_u8.astype(np.float32) / 127.5 - 1.0, (0, 4, 1, 2, 3))

  def required_inputs(self):
    """The weights a full run needs: the converted DiT and Wan2.1 VAE and, with config.cosmos.text
    'reason1', the Cosmos-Reason1 text encoder (`preflight.Input`s with the commands that make them)."""
    from ddrl_jax import preflight  # pylint: disable=g-import-not-at-top
    c, model = self.c, self.c.model
    folder = '<diffusers Cosmos-Predict2.5 folder>'
    out = [preflight.Input('cosmos.checkpoint', c.checkpoint, f'the converted {model} DiT',
                           f'python -m ddrl_jax.models.convert --model={model} --source={folder}/transformer '
                           '--out=<dir>'),
           preflight.Input('cosmos.vae_checkpoint', c.vae_checkpoint, 'the converted Wan2.1 VAE',
                           f'python -m ddrl_jax.models.convert --model=wan21_vae --source={folder}/vae '
                           '--out=<dir>')]
    if c.text == 'reason1':
      out.append(preflight.Input('cosmos.text_encoder', c.get('text_encoder', ''),
                                 'the Cosmos-Reason1 text encoder', f'{folder} (text_encoder/ + tokenizer/)'))
    return out

  # -------------------------------------------------------------------------------- network
  def build(self, key):
    return cosmos_dit.CosmosDiT(self.dit, rngs=nnx.Rngs(key))

  def apply_fn(self, graphdef):
    return make_video_apply_fn(graphdef, self.c.cond_timestep)

  def forward_flops(self, sample_shape):
    """One DiT forward on one (16, T, H, W) latent with config.cosmos.text_length text tokens (frame
    replacement adds none)."""
    return _flops(self.dit, sample_shape[1:], self.c.text_length)

  def attention_shape(self):
    return family_lib.AttentionShape(heads=self.dit.num_heads, seq_blocks=self.c.latent_shape[0],
                                     key='cosmos.latent_shape', value=tuple(self.c.latent_shape))


class CosmosT2IFamily(_CosmosBase):
  """`cosmos.t2i.CosmosT2I` on (3, H, W) images in pixel space, x-prediction, from config.ocr."""

  name = 'cosmos_t2i'
  section = 'ocr'
  resume_safe_keys = ('ocr.base_checkpoint', 'ocr.require_base')
  _export_subtree = 'dit'        # the byte-embedding front end has no diffusers counterpart

  def __init__(self, config):
    self.c = config.ocr
    self.model_cfg = t2i_config(self.c)
    self.dit = self.model_cfg.dit

  def build(self, key):
    return cosmos_t2i.CosmosT2I(self.model_cfg, rngs=nnx.Rngs(key))

  def apply_fn(self, graphdef):
    return make_t2i_apply_fn(graphdef, self.c.min_t, self.c.guidance)

  def load_base(self, abstract_base):
    """config.ocr.base_checkpoint (written by ddrl_jax.pretrain); None (random weights) when it is ''
    or missing and config.ocr.require_base is False."""
    path = resolve(self.c.base_checkpoint)
    if path and os.path.exists(path):
      return nnx.to_pure_dict(params_io.load_params(path, abstract_base, 'config.ocr.base_checkpoint'))
    if path and self.c.require_base:
      raise FileNotFoundError(f'config.ocr.base_checkpoint={self.c.base_checkpoint!r} does not exist; '
                              f'train it with python -m ddrl_jax.pretrain --config=configs/ocr_tiny.py')
    return None

  def forward_flops(self, sample_shape):
    """The DiT on one frame of H x W pixels with text_length byte tokens, twice with classifier-free
    guidance (one forward of 2B); the byte embedding is a lookup."""
    _, h, w = sample_shape
    return _flops(self.dit, (1, h, w), self.c.text_length) * (1 if self.c.guidance == 1.0 else 2)

  def attention_shape(self):
    return family_lib.AttentionShape(heads=self.c.heads, seq_blocks=1)   # images: one frame

  def compute_cast(self, abstract_module):
    del abstract_module
    return None                  # float32 throughout


FAMILIES = {'cosmos': CosmosVideoFamily, 'cosmos_t2i': CosmosT2IFamily}


def _convert_any(state_dict, config):
  """Original `net.`-prefixed Cosmos-Predict2.5 names or diffusers CosmosTransformer3DModel names."""
  if any(k.startswith('net.') for k in state_dict):
    return cosmos_convert.convert_cosmos_state_dict(state_dict, config), 'cosmos_original'
  return cosmos_convert.convert_diffusers_state_dict(state_dict, config), 'diffusers'


def _converter(preset):
  return family_lib.preset_converter(preset, lambda config: cosmos_convert.abstract_params(config)[0],
                                     _convert_any, 'transformer')


CONVERTERS = {'cosmos2b': _converter(cosmos_dit.cosmos2b), 'cosmos14b': _converter(cosmos_dit.cosmos14b),
              'cosmos_tiny': _converter(cosmos_dit.tiny)}

