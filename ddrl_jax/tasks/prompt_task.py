"""What the prompt-conditioned latent tasks share (`sd3_ocr`, `wan_t2v`): a prompt file split into held-out
and training prompts, text embeddings cached per prompt, the conditions with their classifier-free-guidance
fields, records, and a VAE that decodes latents to uint8 pixels in chunks (`parallel.hosts.in_chunks`).

A subclass sets `SECTION` (its config section, e.g. 'sd3'), `TEXT_FIELDS` (condition name -> the name
`encode_prompts` and records use, e.g. {'text': 'text_embedding'}), `SHAPE_KEY` (the config key that sets
the sample shape, for messages), `sample_shape`, and implements `_make_encoder()`, `_encode(encoder,
prompts)` -> {record name: (B, ...) array}, `text_shapes()` -> {condition name: per-sample shape},
`_build_vae()` (the VAE module, its decoded layout given by `DECODE_PERM`) and `_media_to_pixels`.

Conditions: the text fields, 'index' (B,) the prompt's row in training + held-out prompts (-1 for a
record's prompt that is not in it); under classifier-free guidance (the family's cfg_on) also 'guidance'
(B,) and 'null_<name>' for each text field, the empty prompt's embedding. Rollouts and the policy-gradient
re-evaluation use config.<section>.guidance_rollout (the rollout's own conditions carry it), evaluation
guidance_eval, records guidance_rollout.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

from ddrl_jax.parallel import hosts
from ddrl_jax.rl import algorithms as rl_algorithms
from ddrl_jax.tasks import base
from ddrl_jax.tasks import ocr as ocr_task

DEFAULT_PROMPTS = os.path.join(ocr_task.REPO_ROOT, 'data', 'ocr', 'flow_grpo_ocr_test.txt')


def resolve(path):
  """A config path, relative paths taken from the repository root (where the README's commands run)."""
  return path if not path or os.path.isabs(path) else os.path.join(ocr_task.REPO_ROOT, path)


def read_prompts(path, key='config.sd3.prompts'):
  """Non-empty lines of a prompt file (relative paths from the repository root); '' = FlowGRPO's OCR
  test prompts. `key` names the config key in errors."""
  path = resolve(path) if path else DEFAULT_PROMPTS
  with open(path, encoding='utf-8') as f:
    prompts = [line.strip() for line in f if line.strip()]
  if not prompts:
    raise ValueError(f'{key}={path!r}: no prompts')
  return prompts


def vae_functions(vae, perm):
  """(state, encode, decode_u8, decode_u8's state placed on this host's devices) of a VAE module with
  encode/decode/normalize_latents/denormalize_latents: encode(state, pixels in [-1, 1]) -> normalized
  latents (jitted); decode_u8(state, latents) -> (uint8 pixels transposed by `perm`, finite (M,)),
  data parallel over this host's devices. Non-finite latents decode as zeros and are marked."""
  import flax.nnx as nnx  # pylint: disable=g-import-not-at-top
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


class PromptTask(base.FamilyTask):
  """A text-conditioned latent task on a prompt file (see the module docstring)."""

  SECTION = ''
  TEXT_FIELDS = {'text': 'text_embedding'}
  SHAPE_KEY = ''
  DECODE_PERM = ()
  capabilities = frozenset({'records', 'media', 'aot'})

  def _init_prompts(self):
    """Reads config.<section>.prompts and splits it: the first num_eval_prompts are held out."""
    c = self.c
    prompts = read_prompts(c.prompts, f'config.{self.SECTION}.prompts')
    if len(prompts) <= c.num_eval_prompts:
      raise ValueError(f'config.{self.SECTION}.num_eval_prompts={c.num_eval_prompts}: the prompt file has '
                       f'only {len(prompts)} prompts (the rest train)')
    self.eval_prompts = prompts[:c.num_eval_prompts]
    self.train_prompts = prompts[c.num_eval_prompts:]
    self.all_prompts = self.train_prompts + self.eval_prompts
    self._row = {p: i for i, p in reversed(list(enumerate(self.all_prompts)))}
    self._encoder = None
    self._cache = {}             # prompt -> {record name: per-sample array} float32
    self._vae = None
    self._readers = None

  # Set by subclasses for `required_inputs`: the text-encoder key of the section, and the converter model
  # names of the DiT (by config.<section>.model) and the VAE.
  TEXT_ENCODER_KEY = 'text_encoder'
  CONVERT_MODELS = {}
  CONVERT_VAE = ''
  WEIGHTS_SOURCE = '<diffusers pipeline folder>'

  def required_inputs(self):
    """What a full run of this task needs (`ddrl_jax.preflight`, when config.require_inputs): the
    converted DiT and VAE, the text encoders' folder, and DDRL's records (the base's own samples)."""
    from ddrl_jax import preflight  # pylint: disable=g-import-not-at-top
    c, sec, src = self.c, self.SECTION, self.WEIGHTS_SOURCE
    model = self.CONVERT_MODELS.get(c.model, c.model)
    out = [preflight.Input(f'{sec}.checkpoint', c.checkpoint, f'the converted {c.model} transformer',
                           f'python -m ddrl_jax.models.convert --model={model} --source={src}/transformer '
                           '--out=<dir>'),
           preflight.Input(f'{sec}.vae_checkpoint', c.vae_checkpoint, 'the converted VAE',
                           f'python -m ddrl_jax.models.convert --model={self.CONVERT_VAE} --source={src}/vae '
                           '--out=<dir>'),
           preflight.Input(f'{sec}.{self.TEXT_ENCODER_KEY}', c.get(self.TEXT_ENCODER_KEY, ''),
                           'the text encoders', f'{src} (its text encoder and tokenizer folders)')]
    if c.get('prompts_required', False):     # a recipe whose prompt set does not ship with the project
      out.append(preflight.Input(f'{sec}.prompts', c.prompts, 'the training prompts',
                                 c.get('prompts_source', 'a file of prompts, one a line')))
    algo = rl_algorithms.get_algorithm(self.config.algorithm)
    if algo.uses_data and self.config.rl.data_beta > 0 and not self.config.data.get('base_samples', 0):
      out.append(preflight.Input('data.path', self.config.data.path, "the data term's records (the base's "
                                 'own samples)', '--config.data.base_samples=<N> (sampled on the first run) or '
                                 'python -m ddrl_jax.data.synthesize --config=<this config> --out=<dir>'))
    return out

  # --------------------------------------------------------------------------------- hooks
  def _make_encoder(self):
    raise NotImplementedError

  def _encode(self, encoder, prompts):
    raise NotImplementedError

  def text_shapes(self):
    raise NotImplementedError

  def _build_vae(self):
    raise NotImplementedError

  def _media_to_pixels(self, media_u8):
    raise NotImplementedError

  # ----------------------------------------------------------------------------------- text
  def encode_prompts(self, prompts):
    """list[str] -> {record name: (B, ...)} float32 embeddings, each prompt encoded once per run."""
    todo = [p for p in dict.fromkeys(prompts) if p not in self._cache]
    if todo:
      if self._encoder is None:
        self._encoder = self._make_encoder()
      out = self._encode(self._encoder, todo)
      for i, p in enumerate(todo):
        self._cache[p] = {k: np.asarray(v[i], np.float32) for k, v in out.items()}
    return {field: np.stack([self._cache[p][field] for p in prompts]) for field in self.TEXT_FIELDS.values()}

  def _cond(self, prompts, guidance, given=None):
    """Conditions of `prompts` at `guidance`; `given` {record name: (B, ...)} embeddings used as they are
    when every text field is there."""
    given = given or {}
    if any(given.get(f) is None for f in self.TEXT_FIELDS.values()):
      given = self.encode_prompts(prompts)
    b = len(prompts)
    cond = {name: jnp.asarray(given[field], jnp.float32) for name, field in self.TEXT_FIELDS.items()}
    cond['index'] = jnp.asarray([self._row.get(p, -1) for p in prompts], jnp.int32)
    if self.family.cfg_on:
      null = self.encode_prompts([''])
      cond['guidance'] = jnp.full((b,), guidance, jnp.float32)
      for name, field in self.TEXT_FIELDS.items():
        cond[f'null_{name}'] = jnp.asarray(np.repeat(null[field], b, 0))
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
    text = {name: jax.ShapeDtypeStruct((batch,) + tuple(shape), f32) for name, shape in self.text_shapes().items()}
    out = dict(text, index=jax.ShapeDtypeStruct((batch,), jnp.int32))
    if self.family.cfg_on:
      out['guidance'] = jax.ShapeDtypeStruct((batch,), f32)
      out.update({f'null_{name}': s for name, s in text.items()})
    return out

  def prompts(self, cond):
    """The prompt of each condition (training and held-out prompts; records' own prompts need not be in
    the list, and the trainer takes those from the records)."""
    out = []
    for i in np.asarray(cond['index']):
      if not 0 <= i < len(self.all_prompts):
        raise ValueError(f'condition index {i}: not a prompt of config.{self.SECTION}.prompts')
      out.append(self.all_prompts[int(i)])
    return out

  def data(self, key, cond):
    """Zeros for the algorithms without a data term (the trainer's data batch is then unused); DDRL's
    data come from records (config.data.path)."""
    del key
    algo = rl_algorithms.get_algorithm(self.config.algorithm)
    if algo.uses_data and self.config.rl.data_beta > 0:
      raise ValueError(f'the {self.config.task} task has no built-in data: set config.data.base_samples '
                       "(the trainer samples the base model first) or config.data.path to records")
    return jnp.zeros((cond['index'].shape[0],) + tuple(self.sample_shape), jnp.float32)

  def from_records(self, batch, key):
    """Records (prompt, sample [, the text fields' embeddings]) -> (cond, x0)."""
    del key
    x0 = np.asarray(batch['sample'], np.float32)
    if x0.shape[1:] != tuple(self.sample_shape):
      raise ValueError(f'config.data.path: records hold samples of shape {x0.shape[1:]}, the task '
                       f'needs {tuple(self.sample_shape)} ({self.SHAPE_KEY})')
    prompts = list(batch['prompt'])
    cond = self._cond(prompts, self.c.guidance_rollout, {f: batch.get(f) for f in self.TEXT_FIELDS.values()})
    want = tuple(self.text_shapes()['text'])
    if cond['text'].shape[1:] != want:
      raise ValueError(f'config.data.path: text embeddings of shape {cond["text"].shape[1:]}, the task '
                       f'needs {want}')
    return cond, jnp.asarray(x0)

  # ------------------------------------------------------------------------------- VAE
  def _vae_fns(self):
    if self._vae is None:
      vae = self._build_vae()
      if self.c.vae_checkpoint:
        from ddrl_jax.tasks import video as video_task  # pylint: disable=g-import-not-at-top
        video_task.restore_converted(vae, resolve(self.c.vae_checkpoint),
                                     f'config.{self.SECTION}.vae_checkpoint')
      self._vae = vae_functions(vae, self.DECODE_PERM)
    return self._vae

  def decode(self, latents):
    """(M, *sample_shape) latents -> (uint8 pixels, finite (M,)), in chunks of config.<section>.vae_batch
    per local device (the last chunk zero-padded: one compiled shape)."""
    _, _, decode_u8, local_state = self._vae_fns()
    return hosts.in_chunks(decode_u8, local_state, np.asarray(latents, np.float32), self.c.vae_batch)

  def encode_samples(self, media_u8):
    """(B, *media_shape) uint8 media -> (B, *sample_shape) normalized latents (posterior mean), in chunks
    of config.<section>.vae_batch (the last one zero-padded: one compiled shape)."""
    media_u8 = np.asarray(media_u8)
    if media_u8.dtype != np.uint8 or media_u8.shape[1:] != tuple(self.media_shape):
      raise ValueError(f'encode_samples: expected (B, *{self.media_shape}) uint8, got {media_u8.shape} '
                       f'{media_u8.dtype}')
    state, encode, _, _ = self._vae_fns()
    step = self.c.vae_batch
    out = []
    for s in range(0, media_u8.shape[0], step):
      pixels = self._media_to_pixels(media_u8[s:s + step])
      padded = np.zeros((step,) + pixels.shape[1:], np.float32)
      padded[:len(pixels)] = pixels
      out.append(np.asarray(encode(state, jnp.asarray(padded)), np.float32)[:len(pixels)])
    return np.concatenate(out) if out else np.zeros((0,) + tuple(self.sample_shape), np.float32)

  # -------------------------------------------------------------------- rewards and evaluation
  def reward_inputs(self, samples, cond):
    del cond
    return self.decode(samples)

  def _make_readers(self):
    return ocr_task.readers_of(self.config)

  def ocr_metrics(self, pixels, finite, cond):
    """OCR accuracy (Tesseract and RapidOCR, config.reward.kwargs' options) of decoded samples."""
    self._readers = self._readers or self._make_readers()
    return ocr_task.ocr_metrics_of(pixels, finite, self.prompts(cond), self._readers)

  # ---------------------------------------------------------------------------- records
  def prompt_set(self):
    return list(self.train_prompts)

  def conditions_from_prompts(self, prompts, key):
    del key
    return self._cond(list(prompts), self.c.guidance_rollout)

  def record_of(self, sample, prompt, text=True):
    """A record of one generated latent with its prompt (and its text embeddings)."""
    rec = dict(prompt=prompt, sample=np.asarray(sample, np.float32))
    if text:
      enc = self.encode_prompts([prompt])
      rec.update({field: value[0] for field, value in enc.items()})
    return rec
