"""Text rendering with Stable Diffusion 3.5 (the 'sd3' family): FlowGRPO's OCR prompts, the OCR reward on
decoded images (FlowGRPO `general_ocr_sd3`, DiffusionNFT `sd3_ocr`, the DDRL paper's Table 4).

Samples: (16, R/8, R/8) normalized SD3-VAE latents of R x R images (config.sd3.resolution, 512 in the
recipes). Rewards and evaluation decode them with the SD3 VAE (jitted, in chunks of config.sd3.vae_batch)
into uint8 images scored by the OCR readers against each prompt's quoted text.

Prompts: `data/ocr/flow_grpo_ocr_test.txt` (FlowGRPO's 1017 OCR test prompts; its training split is not
public). The first config.sd3.num_eval_prompts are held out for evaluation, the rest are the training
prompts (disjoint). config.sd3.prompts may name another file (one prompt a line).

Conditions (a dict of (B, ...) arrays): 'text' (B, 77 + max_sequence_length, joint_dim) and 'pooled'
(B, pooled_dim), SD3's CLIP-L/G + T5 conditioning (models/sd3/text.py), 'index' (B,) the prompt's
row in the training + held-out prompt list (-1 for a record's prompt that is not in it); under classifier-free guidance also
'guidance' (B,) and the empty prompt's 'null_text', 'null_pooled' (models/sd3/family.py). Each prompt is
encoded once per run and cached (host float32).

CFG policy (config.sd3): rollouts and the policy-gradient re-evaluation of the rollouts sample with
guidance_rollout (the rollout's own conditions carry it, so the two always agree), evaluation with
guidance_eval; records (the DDRL data term) get guidance_rollout too (with the DDRL preset both are 1).

Data: DDRL's data term reads records (config.data.path), e.g. the base model's own samples written by
`python -m ddrl_jax.data.synthesize` (the paper's Table 4 regularizes SD3.5-M with them), or real images
encoded by `python -m ddrl_jax.data.prepare`; records may carry the text and pooled embeddings.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

from ddrl_jax.models.sd3 import family as sd3_family
from ddrl_jax.models.sd3 import vae as sd3_vae
from ddrl_jax.parallel import hosts
from ddrl_jax.rl import algorithms as rl_algorithms
from ddrl_jax.tasks import base
from ddrl_jax.tasks import ocr as ocr_task
from ddrl_jax.tasks import video as video_task

DEFAULT_PROMPTS = os.path.join(ocr_task.REPO_ROOT, 'data', 'ocr', 'flow_grpo_ocr_test.txt')
VAE_PRESETS = {'sd35': sd3_vae.sd35, 'tiny': sd3_vae.tiny}


def read_prompts(path):
  """Non-empty lines of a prompt file (relative paths from the repository root)."""
  path = ocr_task.resolve(path) if path else DEFAULT_PROMPTS
  with open(path, encoding='utf-8') as f:
    prompts = [line.strip() for line in f if line.strip()]
  if not prompts:
    raise ValueError(f'config.sd3.prompts={path!r}: no prompts')
  return prompts


def vae_config(c):
  if c.vae not in VAE_PRESETS:
    raise ValueError(f'config.sd3.vae={c.vae!r}: unknown preset; known: {sorted(VAE_PRESETS)}')
  kw = dict(c.vae_overrides) if c.get('vae_overrides') else {}
  return VAE_PRESETS[c.vae](**kw)


def text_encoders(c):
  """The SD3 text encoders of config.sd3.text_encoders: a diffusers pipeline folder, or 'tiny_random'
  (tiny random CLIP-L/G + T5 built in-process, for the CPU smoke run)."""
  from ddrl_jax.models.sd3 import text as text_lib  # pylint: disable=g-import-not-at-top
  if c.text_encoders == 'tiny_random':
    return text_lib.tiny_random(seed=c.text_seed)
  if not c.text_encoders:
    raise ValueError('config.sd3.text_encoders is empty: give a diffusers SD3.5 pipeline folder (with '
                     "text_encoder/, text_encoder_2/, text_encoder_3/ and tokenizers) or 'tiny_random'")
  return text_lib.SD3TextEncoders.from_pretrained(ocr_task.resolve(c.text_encoders))


class SD3OCR(base.FamilyTask):
  """SD3.5 on FlowGRPO's OCR prompts (see the module docstring)."""

  DEFAULT_FAMILY = 'sd3'
  capabilities = frozenset({'records', 'media', 'aot'})

  def __init__(self, config):
    super().__init__(config)
    c = self.c = config.sd3
    self.dit = self.family.dit
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
    prompts = read_prompts(c.prompts)
    if len(prompts) <= c.num_eval_prompts:
      raise ValueError(f'config.sd3.num_eval_prompts={c.num_eval_prompts}: the prompt file has only '
                       f'{len(prompts)} prompts (the rest train)')
    self.eval_prompts = prompts[:c.num_eval_prompts]
    self.train_prompts = prompts[c.num_eval_prompts:]
    self.all_prompts = self.train_prompts + self.eval_prompts
    self._row = {p: i for i, p in reversed(list(enumerate(self.all_prompts)))}
    self.text_length = sd3_family.text_tokens(c)
    self._encoders = None
    self._cache = {}             # prompt -> (text (L, D), pooled (P,)) float32
    self._vae = None
    self._readers = None

  # ----------------------------------------------------------------------------------- text
  def encode_prompts(self, prompts):
    """list[str] -> {'text_embedding': (B, L, D), 'pooled_embedding': (B, P)} float32, each prompt
    encoded once per run."""
    todo = [p for p in dict.fromkeys(prompts) if p not in self._cache]
    if todo:
      if self._encoders is None:
        self._encoders = text_encoders(self.c)
      text, pooled = self._encoders.encode(todo, max_sequence_length=self.c.max_sequence_length)
      for i, p in enumerate(todo):
        self._cache[p] = (np.asarray(text[i], np.float32), np.asarray(pooled[i], np.float32))
    return dict(text_embedding=np.stack([self._cache[p][0] for p in prompts]),
                pooled_embedding=np.stack([self._cache[p][1] for p in prompts]))

  def _cond(self, prompts, guidance, text=None, pooled=None):
    if text is None or pooled is None:
      enc = self.encode_prompts(prompts)
      text, pooled = enc['text_embedding'], enc['pooled_embedding']
    b = len(prompts)
    cond = dict(text=jnp.asarray(text, jnp.float32), pooled=jnp.asarray(pooled, jnp.float32),
                index=jnp.asarray([self._row.get(p, -1) for p in prompts], jnp.int32))
    if self.family.cfg_on:
      null = self.encode_prompts([''])
      cond.update(guidance=jnp.full((b,), guidance, jnp.float32),
                  null_text=jnp.asarray(np.repeat(null['text_embedding'], b, 0)),
                  null_pooled=jnp.asarray(np.repeat(null['pooled_embedding'], b, 0)))
    return cond

  def _prompts_of(self, key, batch, pool):
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    return [pool[i] for i in rng.integers(0, len(pool), batch)]

  def conditions(self, key, batch):
    """B random training prompts, at the rollout guidance."""
    return self._cond(self._prompts_of(key, batch, self.train_prompts), self.c.guidance_rollout)

  def eval_conditions(self, key, batch):
    """The first B held-out prompts (cycled), at the evaluation guidance: the same set every time."""
    del key
    prompts = [self.eval_prompts[i % len(self.eval_prompts)] for i in range(batch)]
    return self._cond(prompts, self.c.guidance_eval)

  def abstract_conditions(self, batch):
    f32 = jnp.float32
    p = self.dit.pooled_projection_dim
    text = jax.ShapeDtypeStruct((batch, self.text_length, self.dit.joint_attention_dim), f32)
    out = dict(text=text, pooled=jax.ShapeDtypeStruct((batch, p), f32),
               index=jax.ShapeDtypeStruct((batch,), jnp.int32))
    if self.family.cfg_on:
      out.update(guidance=jax.ShapeDtypeStruct((batch,), f32), null_text=text,
                 null_pooled=jax.ShapeDtypeStruct((batch, p), f32))
    return out

  def prompts(self, cond):
    """The prompt of each condition (training and held-out prompts; records' own prompts need not be in
    the list, and the trainer takes those from the records)."""
    out = []
    for i in np.asarray(cond['index']):
      if not 0 <= i < len(self.all_prompts):
        raise ValueError(f'condition index {i}: not a prompt of config.sd3.prompts')
      out.append(self.all_prompts[int(i)])
    return out

  def data(self, key, cond):
    """Zeros for the algorithms without a data term (the trainer's data batch is then unused); DDRL's
    data come from records (config.data.path)."""
    del key
    algo = rl_algorithms.get_algorithm(self.config.algorithm)
    if algo.uses_data and self.config.rl.data_beta > 0:
      raise ValueError('the sd3_ocr task has no built-in data: set config.data.path to records, e.g. the '
                       'base model\'s samples from python -m ddrl_jax.data.synthesize')
    return jnp.zeros((cond['pooled'].shape[0],) + self.sample_shape, jnp.float32)

  def from_records(self, batch, key):
    """Records (prompt, sample (16, h, w) latent [, text_embedding, pooled_embedding]) -> (cond, x0)."""
    del key
    x0 = np.asarray(batch['sample'], np.float32)
    if x0.shape[1:] != self.sample_shape:
      raise ValueError(f'config.data.path: records hold samples of shape {x0.shape[1:]}, the task '
                       f'needs {self.sample_shape} (config.sd3.resolution)')
    prompts = list(batch['prompt'])
    cond = self._cond(prompts, self.c.guidance_rollout, batch.get('text_embedding'),
                      batch.get('pooled_embedding'))
    if cond['text'].shape[1:] != (self.text_length, self.dit.joint_attention_dim):
      raise ValueError(f'config.data.path: text embeddings of shape {cond["text"].shape[1:]}, the task '
                       f'needs {(self.text_length, self.dit.joint_attention_dim)}')
    return cond, jnp.asarray(x0)

  # ------------------------------------------------------------------------------- VAE
  def _vae_fns(self):
    if self._vae is None:
      import flax.nnx as nnx  # pylint: disable=g-import-not-at-top
      vae = sd3_vae.SD3VAE(self.vae_cfg, rngs=nnx.Rngs(self.c.vae_seed))
      if self.c.vae_checkpoint:
        video_task.restore_converted(vae, ocr_task.resolve(self.c.vae_checkpoint), 'config.sd3.vae_checkpoint')
      graphdef, state = nnx.split(vae)

      @jax.jit
      def encode(s, images):
        m = nnx.merge(graphdef, s)
        return m.normalize_latents(m.encode(images))

      def decode_u8(s, z):
        m = nnx.merge(graphdef, s)
        z = z.astype(jnp.float32)
        images = m.decode(m.denormalize_latents(jnp.nan_to_num(z)))
        finite = jnp.isfinite(z).reshape(z.shape[0], -1).all(-1) & \
            jnp.isfinite(images).reshape(images.shape[0], -1).all(-1)
        u8 = jnp.round((jnp.nan_to_num(images).clip(-1, 1) + 1.0) * 127.5).astype(jnp.uint8)
        return jnp.transpose(u8, (0, 2, 3, 1)), finite

      decode_u8 = hosts.local_data_parallel(decode_u8)
      self._vae = (state, encode, decode_u8, decode_u8.place(state))
    return self._vae

  def decode(self, latents):
    """(M, 16, h, w) latents -> (uint8 images (M, H, W, 3), finite (M,)), in chunks of config.sd3.vae_batch
    per local device (the last chunk zero-padded: one compiled shape)."""
    _, _, decode_u8, local_state = self._vae_fns()
    return hosts.in_chunks(decode_u8, local_state, np.asarray(latents, np.float32), self.c.vae_batch)

  @property
  def media_shape(self):
    """(1, R, R, 3): the uint8 image the VAE encodes into one latent."""
    return (1, self.c.resolution, self.c.resolution, 3)

  def encode_samples(self, media_u8):
    """(B, 1, R, R, 3) uint8 images -> (B, 16, R/8, R/8) normalized latents (posterior mean)."""
    media_u8 = np.asarray(media_u8)
    if media_u8.dtype != np.uint8 or media_u8.shape[1:] != self.media_shape:
      raise ValueError(f'encode_samples: expected (B, *{self.media_shape}) uint8, got {media_u8.shape} '
                       f'{media_u8.dtype}')
    state, encode, _, _ = self._vae_fns()
    step = self.c.vae_batch
    out = []
    for s in range(0, media_u8.shape[0], step):
      chunk = media_u8[s:s + step, 0]
      images = np.zeros((step, 3, self.c.resolution, self.c.resolution), np.float32)
      images[:len(chunk)] = ocr_task.to_pixels(chunk)
      out.append(np.asarray(encode(state, jnp.asarray(images)), np.float32)[:len(chunk)])
    return np.concatenate(out) if out else np.zeros((0,) + self.sample_shape, np.float32)

  # -------------------------------------------------------------------- rewards and evaluation
  def reward_inputs(self, samples, cond):
    del cond
    return self.decode(samples)

  def evaluate(self, samples, key, cond=None):
    """OCR accuracy (Tesseract and RapidOCR) of the decoded samples of the held-out prompts."""
    del key
    images, finite = self.decode(samples)
    if cond is None:
      return dict(finite_fraction=float(finite.mean()))
    self._readers = self._readers or ocr_task.readers_of(self.config)
    return ocr_task.ocr_metrics_of(images, finite, self.prompts(cond), self._readers)

  # ---------------------------------------------------------------------------- records
  def prompt_set(self):
    return list(self.train_prompts)

  def conditions_from_prompts(self, prompts, key):
    del key
    return self._cond(list(prompts), self.c.guidance_rollout)

  def record_of(self, sample, prompt, text=True):
    """A record of one generated (16, h, w) latent with its prompt (and its text embeddings)."""
    rec = dict(prompt=prompt, sample=np.asarray(sample, np.float32))
    if text:
      enc = self.encode_prompts([prompt])
      rec.update(text_embedding=enc['text_embedding'][0], pooled_embedding=enc['pooled_embedding'][0])
    return rec


TASK = SD3OCR
