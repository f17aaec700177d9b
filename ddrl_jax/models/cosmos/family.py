"""The Cosmos families: the Cosmos-Predict2.5 video DiT ('cosmos') and its one-frame text-to-image wrapper
with a byte text encoder ('cosmos_t2i'), behind `models.family.ModelFamily`; and the Cosmos converters.

'cosmos' reads config.cosmos (configs/cosmos_common.py): the DiT preset and overrides, dtypes, remat,
attention kernel, the converted checkpoint and the image-to-video conditioning time. Its velocity adapter
is cosmos' frame replacement (`make_video_apply_fn`; the derivation is in tasks/video.py).

'cosmos_t2i' reads config.ocr (configs/ocr_tiny.py): width, depth, heads, ..., the x-prediction floor
min_t, classifier-free guidance, and the base checkpoint written by `ddrl_jax.pretrain`. The image size is
config.ocr.image_size when given, else the OCR renders' 32 x 96.
"""
import os

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from ddrl_jax import params_io
from ddrl_jax.models import family as family_lib
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


def dit_config(c):
  """CosmosDiTConfig from config.cosmos: preset ('cosmos2b', 'cosmos14b', 'tiny') + overrides."""
  return family_lib.preset_config(PRESETS, c, 'config.cosmos')


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


class CosmosVideoFamily(_CosmosBase):
  """The Cosmos-Predict2.5 DiT on (16, T, H, W) latents, from config.cosmos."""

  name = 'cosmos'
  section = 'cosmos'
  # The base weights' source and the evaluation's prompts, guidance and judges: a resumed run may change them.
  resume_safe_keys = ('cosmos.checkpoint', 'cosmos.eval_prompts', 'cosmos.guidance_eval',
                      'cosmos.negative_prompt', 'cosmos.eval_rewards')

  def __init__(self, config):
    self.c = config.cosmos
    self.dit = dit_config(self.c)

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
  return family_lib.Converter(
      make_config=lambda param_dtype: preset(param_dtype=param_dtype),
      abstract=lambda config: cosmos_convert.abstract_params(config)[0],
      convert=_convert_any, subfolder='transformer')


CONVERTERS = {'cosmos2b': _converter(cosmos_dit.cosmos2b), 'cosmos14b': _converter(cosmos_dit.cosmos14b),
              'cosmos_tiny': _converter(cosmos_dit.tiny)}

