"""Text-to-video and image-to-video DDRL with the Cosmos-Predict2.5 DiT as the policy.

The policy is `models.cosmos.dit.CosmosDiT` (the 'cosmos' family) on normalized Wan2.1 latents
(16, T, H, W). The family (models/cosmos/family.py, a `models.pipeline.LatentPipeline`) owns the network,
the Wan2.1 VAE (`family.encode_samples`, `decode`, `vae()`) and the text encoders (`family.encode_prompts`,
`negative_text`, `device_text_encoder`); this task holds the data, the conditions, the rewards and the
evaluation. The trainer's generic sampler calls ``apply_fn(params, x_t, t, cond)`` with the flow state
x_t = (1 - t) x0 + t eps and expects the velocity eps - x0; the family's adapter
(`models.cosmos.family.make_video_apply_fn`) wraps the DiT into that interface with cosmos' frame-replace
image-to-video conditioning (cosmos_predict25_architecture.md section 1.4), derived below.

Conditions (a dict of (B, ...) arrays, sharded on B by the trainer):
  text:        (B, L, C) context embeddings (C = crossattn_in of the DiT, or context_dim without it).
  first_frame: (B, 16, 1, H, W) clean ground-truth latent of latent frame 0 of the paired video.
  num_cond:    (B,) int32, 0 (text-to-video) or 1 (image-to-video), drawn per group with probability
               config.cosmos.i2v_prob (0.5 as cosmos-rl's min/max_num_conditional_frames = 0/1).
  index:       (B,) int32 index of the paired dataset item (the data term looks its latents up).
The data loss's condition dropout (rl.cond_dropout) zeroes only cond['text'] (diffusion_loss.drop_condition),
so image-to-video groups keep their conditioning frame, as in cosmos.

Conditioned frames (frame replacement):
  * the DiT input of frame 0 is the GT latent, the cond-mask channel is 1 there, and its per-frame
    timestep is config.cosmos.cond_timestep (1e-4 = cosmos' sigma_conditional, i.e.
    conditional_frame_timestep 0.1 on the 0-1000 scale);
  * the returned velocity of frame 0 is v = (x_t - gt) / t, computed from the sampler's own state x_t.
    Every consumer here turns a velocity into x0_hat = x_t - t v (the cosmos_2ab kernel via
    `transitions.cosmos_x0`: (1-t) x_sigma - t v with x_t = (1-t) x_sigma), so x0_hat = gt (exactly up
    to float32 rounding). This *is* cosmos' replacement v = noise - gt: write the conditioned frame of the
    state as x_t = (1-t) gt + t n, which defines the effective noise n = (x_t - (1-t) gt)/t; then
    n - gt = (x_t - gt)/t. In the data loss x_t = (1-t) x0 + t eps with x0's frame 0 = gt, so n = eps and
    v equals cosmos' (eps - gt) and the conditioned frame contributes 0 to the velocity MSE (it still
    counts in the mean, as in cosmos). In a rollout cosmos replaces x0_hat by gt directly
    (denoise_replace_gt_frames); the formula above gives the same x0_hat without knowing the noise.

Data (config.cosmos.data):
  'records': the paper's setting. Captioned videos (and images) prepared once with `ddrl_jax.data.prepare`
    into record shards at config.data.path; each record is one condition group (its prompt, its clean
    latent, its first latent frame). T2V or I2V is drawn per group with config.cosmos.i2v_prob (0.5: the
    paper's 1:1 mix); `batch_metrics` reports how many groups of each kind a batch held.
  'synthetic' (`:smoke` only): a fixed set of videos of a coloured square moving over a dark background,
    each rendered with numpy from the item's seed; the motion and colour are those the paired prompt names.
    They are encoded once with the family's Wan VAE and normalized, so the data term really trains on VAE
    latents.

Evaluation conditions: config.cosmos.eval_prompts, a prompt file with categories and optional first
frames (`data.prompt_file`, PAI-Bench's shape): its first eval_samples entries (cycled), I2V where an
entry names an image (encoded with the VAE as the conditioning latent frame), T2V otherwise; their
cond['index'] is -(row + 1), so `prompts` tells them from the training prompts. Without a prompt file a
synthetic run evaluates on its own square prompts. With config.cosmos.guidance_eval w > 0 evaluation
samples with Cosmos' classifier-free guidance against config.cosmos.negative_prompt (diffusers' default
negative prompt; `models.cosmos.family.make_video_apply_fn`); rollouts never use guidance (cosmos-rl's
DDRL rollouts run at guidance 0). The trainer scores the evaluation videos with the run's own rewards
through its reward service (`eval_scores_with_rewards`); `python -m ddrl_jax.evaluate` reports every
reward column and every VBench dimension per category (tasks/video_eval.py).

Text (config.cosmos.text, encoded by the family): 'reason1', Cosmos-Predict2.5's own conditioning, the
Cosmos-Reason1-7B language model run in JAX from config.cosmos.text_encoder (a diffusers Cosmos-Predict2.5
folder with text_encoder/ and tokenizer/, or the text_encoder folder): 512 chat tokens, 28 normalised hidden
states concatenated to (512, 100352); or 'bytes', a frozen byte embedding (a stand-in for `:smoke` runs
without an encoder). Prompts are encoded when a batch needs them (records prepared with `--text=task` carry
them instead); the embeddings are not cached, except the built-in prompts' and the negative prompt's.

Rewards: `reward_inputs` denormalizes and decodes the latents with the VAE (jitted) into uint8 videos
(M, F, H, W, 3) and hands them, with each group's prompt, to the reward service (config.reward: the
presets' VideoAlign or VBench, configs/cosmos_common.py; `:smoke` uses rewards/basic.py's temporal
smoothness, r = -mean |frame_{k+1} - frame_k| / 255, 0 for a static video). Samples whose latent or decode is not finite are marked invalid (reward NaN: the trainer
counts them as failed, advantage 0). There is no trainer hook to write decoded frames to the workdir
yet, so this task writes none.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ddrl_jax.rewards import basic as basic_rewards
from ddrl_jax.tasks import base

# (prompt, RGB in [0, 1], direction (dy, dx) in pixels per frame per unit speed).
PROMPTS = (
    ('a red square moving to the right', (1.0, 0.1, 0.1), (0, 1)),
    ('a green square moving to the left', (0.1, 0.9, 0.1), (0, -1)),
    ('a blue square moving down', (0.2, 0.3, 1.0), (1, 0)),
    ('a yellow square moving up', (1.0, 0.9, 0.1), (-1, 0)),
    ('a magenta square drifting diagonally down and right', (0.9, 0.1, 0.9), (1, 1)),
    ('a cyan square drifting diagonally up and left', (0.1, 0.9, 0.9), (-1, -1)),
    ('a white square standing still', (0.95, 0.95, 0.95), (0, 0)),
    ('an orange square moving right slowly', (1.0, 0.55, 0.1), (0, 0.5)),
)

DATA_KINDS = ('records', 'synthetic')


def render_square_video(item, frames, height, width):
  """(3, frames, height, width) float32 video in [-1, 1]: prompt item % len(PROMPTS)'s square.

  Deterministic in `item`: start position, size and speed come from RandomState(item).
  """
  _, rgb, (dy, dx) = PROMPTS[item % len(PROMPTS)]
  rs = np.random.RandomState(item)
  side = max(2, int(round(min(height, width) * rs.uniform(0.2, 0.35))))
  speed = rs.uniform(0.5, 1.5) * min(height, width) / max(frames, 2) / 2
  y0 = rs.uniform(0, height - side)
  x0 = rs.uniform(0, width - side)
  bg = rs.uniform(0.05, 0.2, size=3)
  video = np.empty((3, frames, height, width), np.float32)
  video[:] = bg[:, None, None, None]
  for f in range(frames):
    y = int(round(np.clip(y0 + dy * speed * f, 0, height - side)))
    x = int(round(np.clip(x0 + dx * speed * f, 0, width - side)))
    video[:, f, y:y + side, x:x + side] = np.asarray(rgb, np.float32)[:, None, None]
  return video * 2.0 - 1.0


class CosmosVideo(base.FamilyTask):
  """T2V / I2V video task for the trainer (see the module docstring). The model is the 'cosmos' family
  (models/cosmos/family.py: the DiT, its frame-replacement velocity adapter, its VAE and text encoders)."""

  DEFAULT_FAMILY = 'cosmos'
  capabilities = frozenset({'records', 'media', 'aot', 'device_text_encoder', 'checkpoint_evaluation'})
  eval_scores_with_rewards = True     # the trainer passes `evaluate` a scorer of the run's rewards

  def __init__(self, config):
    super().__init__(config)
    c = self.c = config.cosmos
    self.sample_shape = tuple(self.family.sample_shape)          # (16, T, H, W)
    frames, height, width, _ = self.family.media_shape
    self.video_shape = (3, frames, height, width)
    self.text_dim = self.family.text_shapes()['text'][1]
    if c.get('data', 'synthetic') not in DATA_KINDS:
      raise ValueError(f'config.cosmos.data={c.data!r}; known: {DATA_KINDS}')
    self._eval_table = None
    self._latents = None
    self._text = None
    self.cond_log = []           # host copies of num_cond per conditions() call (T2V/I2V bookkeeping)
    self.i2v_frame0_err = []     # max |x0[frame 0] - gt| over I2V rollouts, per reward() call

  @property
  def num_truncated_prompts(self):
    """Prompts longer than config.cosmos.text_length chat tokens so far (cut and logged by the family's
    Reason1 encoder)."""
    return self.family.num_truncated_prompts

  # ----------------------------------------------------------------------------------- dataset
  def dataset_latents(self):
    """(num_videos, 16, T, H, W) float32 normalized latents of the synthetic videos (host, cached)."""
    if self._latents is None:
      if self.c.data != 'synthetic':
        raise ValueError(f"config.cosmos.data={self.c.data!r}: a records run's data come from "
                         'config.data.path (the trainer reads them; there is no built-in dataset)')
      state, encode, _, _ = self.family.vae()
      _, f, h, w = self.video_shape
      out = []
      for start in range(0, self.c.num_videos, self.c.vae_batch):
        items = range(start, min(start + self.c.vae_batch, self.c.num_videos))
        videos = np.stack([render_square_video(i, f, h, w) for i in items])
        out.append(np.asarray(encode(state, jnp.asarray(videos)), np.float32))
      self._latents = np.concatenate(out)
      if self._latents.shape[1:] != self.sample_shape:
        raise ValueError(f'VAE latents {self._latents.shape[1:]} != sample shape {self.sample_shape}')
    return self._latents

  def prompt_embeddings(self):
    """(len(PROMPTS), L, C) text embeddings of the built-in prompts (host, cached)."""
    if self._text is None:
      self._text = self.encode_prompts([p for p, _, _ in PROMPTS])
    return self._text

  # ----------------------------------------------------------------------------------- task API
  def conditions(self, key, batch):
    k_item, k_mode = jax.random.split(key)
    latents = self.dataset_latents()
    index = np.asarray(jax.random.randint(k_item, (batch,), 0, self.c.num_videos), np.int32)
    num_cond = np.asarray(jax.random.bernoulli(k_mode, self.c.i2v_prob, (batch,)), np.int32)
    self.cond_log.append(num_cond.copy())
    text = self.prompt_embeddings()[index % len(PROMPTS)]
    first = latents[index][:, :, :1]
    return dict(text=jnp.asarray(text), first_frame=jnp.asarray(first),
                num_cond=jnp.asarray(num_cond), index=jnp.asarray(index))

  def eval_conditions(self, key, batch):
    """(B, ...) evaluation conditions: the prompt file's first B entries, else (synthetic runs) the
    training draw; with guidance_eval > 0 also 'guidance' (B,) and 'null_text' (B, L, C)."""
    if self.c.get('eval_prompts'):
      cond = self.prompt_file_conditions(range(batch))
    elif self.c.data == 'synthetic':
      cond = self.conditions(key, batch)
    else:
      raise ValueError("config.cosmos.eval_prompts: a records run (config.cosmos.data='records') "
                       'evaluates on a prompt file (prompt, category, optional first frame; '
                       'ddrl_jax/data/prompt_file.py)')
    return self.with_guidance(cond, float(self.c.get('guidance_eval', 0.0)))

  def eval_table(self):
    """The entries (`data.prompt_file.EvalPrompt`) of config.cosmos.eval_prompts (cached)."""
    if self._eval_table is None:
      from ddrl_jax.data import prompt_file  # pylint: disable=g-import-not-at-top
      self._eval_table = prompt_file.read_prompt_file(self.c.eval_prompts)
    return self._eval_table

  def prompt_file_conditions(self, rows, table=None):
    """Conditions (B, ...) of prompt-file rows (taken modulo its length): the text embedding, the first
    frame's latent for I2V entries (zeros and num_cond 0 for T2V), index -(row + 1)."""
    table = self.eval_table() if table is None else table
    rows = [r % len(table) for r in rows]
    entries = [table[r] for r in rows]
    _, lh, lw = self.sample_shape[1:]
    first = np.zeros((len(rows), self.sample_shape[0], 1, lh, lw), np.float32)
    i2v = [i for i, e in enumerate(entries) if e.first_frame]
    if i2v:
      first[i2v] = self.encode_first_frames([entries[i].first_frame for i in i2v])
    num_cond = np.asarray([1 if e.first_frame else 0 for e in entries], np.int32)
    text = self.encode_prompts([e.prompt for e in entries])
    return dict(text=jnp.asarray(text), first_frame=jnp.asarray(first), num_cond=jnp.asarray(num_cond),
                index=jnp.asarray([-(r + 1) for r in rows], jnp.int32))

  def with_guidance(self, cond, guidance):
    """`cond` with Cosmos' classifier-free guidance at `guidance` (unchanged at 0): 'guidance' (B,) and
    'null_text' (B, L, C), the embedding of config.cosmos.negative_prompt."""
    if not guidance:
      return cond
    null = self.family.negative_text()
    b = cond['text'].shape[0]
    return dict(cond, guidance=jnp.full((b,), guidance, jnp.float32),
                null_text=jnp.broadcast_to(jnp.asarray(null), (b,) + null.shape))

  def encode_first_frames(self, paths):
    """(B, 16, 1, h, w) float32 normalized latents of the first frames of image (or video) files, each
    centre-cropped and resized to the task's (H, W): the causal Wan VAE encodes frame 0 alone, so this
    is latent frame 0 of any video that starts with it. Errors name the file (data.media.MediaError)."""
    from ddrl_jax.data import media  # pylint: disable=g-import-not-at-top
    state, encode, _, _ = self.family.vae()
    _, _, h, w = self.video_shape
    out = []
    for path in paths:
      frame = media.center_crop_resize(media.load_media(path, max_frames=1)[0], h, w)
      video = np.transpose(frame.astype(np.float32) / 127.5 - 1.0, (2, 0, 1))[None, :, None]
      out.append(np.asarray(encode(state, jnp.asarray(video)), np.float32)[0])
    return np.stack(out)

  def abstract_conditions(self, batch):
    """ShapeDtypeStructs of `conditions(key, batch)` (for ahead-of-time compiles; nothing is encoded)."""
    c, _, h, w = self.sample_shape
    f32, i32 = jnp.float32, jnp.int32
    return dict(self.family.abstract_text_conditions(batch),
                first_frame=jax.ShapeDtypeStruct((batch, c, 1, h, w), f32),
                num_cond=jax.ShapeDtypeStruct((batch,), i32), index=jax.ShapeDtypeStruct((batch,), i32))

  def data(self, key, cond):
    """(B, 16, T, H, W) clean latents of each condition's paired video."""
    del key
    return jnp.asarray(self.dataset_latents()[np.asarray(cond['index'])])

  def decode(self, latents):
    """(M, 16, T, H, W) latents -> (uint8 videos (M, F, H, W, 3), finite (M,) bool): the family's VAE, in
    chunks of config.cosmos.vae_batch per local device, data parallel over this host's devices."""
    return self.family.decode(latents)

  def prompts(self, cond):
    """The prompt text of each condition: index >= 0 into the built-in prompts, index -(row + 1) into
    the evaluation prompt file."""
    return [self.eval_table()[-int(i) - 1].prompt if i < 0 else PROMPTS[int(i) % len(PROMPTS)][0]
            for i in np.asarray(cond['index'])]

  def reward_inputs(self, samples, cond):
    """(M, 16, T, H, W) final latents and their (M, ...) conditions -> what the reward service scores:
    (uint8 videos (M, F, H, W, 3), valid (M,) bool: latent and decode finite)."""
    samples = np.asarray(samples, np.float32)
    num_cond = np.asarray(cond['num_cond'])
    if num_cond.any():
      gt = np.asarray(cond['first_frame'])[num_cond > 0]
      self.i2v_frame0_err.append(float(np.abs(samples[num_cond > 0][:, :, :1] - gt).max()))
    videos, finite = self.decode(samples)
    return videos, finite

  def from_records(self, batch, key):
    """A `data.pipeline.RecordLoader` batch -> (conditions (B, ...), clean latents (B, 16, T, H, W)).

    The text is the records' text_embedding, or the prompts embedded now; the I2V frame is the
    records' first_frame (or the sample's first latent frame); T2V/I2V is drawn per group as in
    `conditions`. cond['index'] is the row in the batch (the built-in prompt table is not used).
    """
    x0 = np.asarray(batch['sample'], np.float32)
    b = x0.shape[0]
    if x0.shape[1:] != self.sample_shape:
      raise ValueError(f'config.data.path: records hold samples of shape {x0.shape[1:]}, the task '
                       f'needs {self.sample_shape} (config.cosmos.latent_shape)')
    text = batch.get('text_embedding')
    text = self.encode_prompts(batch['prompt']) if text is None else np.asarray(text, np.float32)
    if text.shape[1:] != (self.c.text_length, self.text_dim):
      raise ValueError(f'config.data.path: text embeddings of shape {text.shape[1:]}, the task '
                       f'needs {(self.c.text_length, self.text_dim)}')
    first = batch.get('first_frame')
    first = x0[:, :, :1] if first is None else np.asarray(first, np.float32)
    num_cond = np.asarray(jax.random.bernoulli(key, self.c.i2v_prob, (b,)), np.int32)
    self.cond_log.append(num_cond.copy())
    cond = dict(text=jnp.asarray(text), first_frame=jnp.asarray(first),
                num_cond=jnp.asarray(num_cond), index=jnp.arange(b, dtype=jnp.int32))
    return cond, jnp.asarray(x0)

  def required_inputs(self):
    """What a full run of this task needs (checked by `ddrl_jax.preflight` when config.require_inputs): the
    family's weights (converted DiT and VAE, the Reason1 text encoder), the records and the evaluation
    prompts."""
    from ddrl_jax import preflight  # pylint: disable=g-import-not-at-top
    c = self.c
    out = list(self.family.required_inputs())
    if c.data == 'records':
      out.append(preflight.Input('data.path', self.config.data.path, 'captioned videos as record shards',
                                 'python -m ddrl_jax.data.prepare --config=<this config> --text=none '
                                 '--source=<videos + .txt captions> --out=<dir>'))
      out.append(preflight.Input('cosmos.eval_prompts', c.get('eval_prompts', ''),
                                 'the evaluation prompt file',
                                 'JSONL of {"prompt", "category", "first_frame"}, PAI-Bench\'s shape'))
    return out

  def batch_metrics(self, cond):
    """Groups of this process's batch by kind: cond_i2v (first frame given) and cond_t2v."""
    num_cond = np.asarray(cond['num_cond'])
    return dict(cond_i2v=float((num_cond > 0).sum()), cond_t2v=float((num_cond == 0).sum()))

  def evaluate_checkpoints(self, request):
    """The paper's PAI-Bench-style evaluation on a prompt file with categories (video_eval.py)."""
    from ddrl_jax.tasks import video_eval  # pylint: disable=g-import-not-at-top  (it imports this module)
    return video_eval.evaluate_checkpoints(self, request)

  def evaluate(self, samples, key, cond=None, score=None):
    """Metrics of (M, 16, T, H, W) evaluation samples of conditions `cond`.

    score: fn(videos, prompts) -> {reward name: (M,) scores} (the trainer's: the run's rewards through its
    reward service). Gives reward/<name> (mean over the finite scores), the same over the T2V and I2V
    samples (reward/<name>/t2v, /i2v), and reward, the config.reward.fns-weighted sum of the means.
    Without `score` (or `cond`), reward is the temporal smoothness of the videos.
    """
    del key
    samples = np.asarray(samples, np.float32)
    videos, finite = self.decode(samples)
    out = dict(finite_fraction=float(finite.mean()), latent_std=float(np.nanstd(samples)))
    if score is None or cond is None:
      r = np.where(finite, basic_rewards.TemporalSmoothness()(videos, None), np.nan)
      ok = np.isfinite(r)
      out['reward'] = float(r[ok].mean()) if ok.any() else float('nan')
      return out
    columns = score(videos, self.prompts(cond))
    i2v = np.asarray(cond['num_cond']) > 0
    weights = dict(self.config.reward.fns)
    total = 0.0
    for name, values in columns.items():
      values = np.where(finite, np.asarray(values, np.float64), np.nan)
      out[f'reward/{name}'] = _finite_mean(values)
      out[f'reward/{name}/t2v'] = _finite_mean(values[~i2v])
      out[f'reward/{name}/i2v'] = _finite_mean(values[i2v])
      total += weights.get(name, 1.0) * out[f'reward/{name}']
    out['reward'] = float(total)
    return out


  # ---- record encoding (ddrl_jax.data.prepare / synthesize)
  @property
  def media_shape(self):
    """(F, H, W, 3): the uint8 video the VAE encodes into one (16, T, H', W') latent."""
    return tuple(self.family.media_shape)

  def encode_samples(self, media_u8):
    """(B, F, H, W, 3) uint8 videos -> (B, *sample_shape) float32 normalized VAE latents (host): the
    family's VAE in chunks of config.cosmos.vae_batch, the last zero-padded (one compiled shape, and a
    video's latent does not depend on how the videos were batched)."""
    return self.family.encode_samples(media_u8)

  def prompt_set(self):
    """The built-in prompts (ddrl_jax.data.synthesize's default prompt set)."""
    return [p for p, _, _ in PROMPTS]

  def conditions_from_prompts(self, prompts, key):
    """Text-to-video conditions (B, ...) of B prompt strings (for synthesize)."""
    del key
    b = len(prompts)
    lt, lh, lw = self.sample_shape[1:]
    return dict(text=jnp.asarray(self.encode_prompts(prompts)),
                first_frame=jnp.zeros((b, self.sample_shape[0], 1, lh, lw), jnp.float32),
                num_cond=jnp.zeros((b,), jnp.int32), index=jnp.arange(b, dtype=jnp.int32))

  def record_of(self, sample, prompt, text=True):
    """A record (ddrl_jax.data.records) of one generated latent (16, T, H, W) and its prompt."""
    sample = np.asarray(sample, np.float32)
    rec = dict(prompt=prompt, sample=sample, first_frame=sample[:, :1])
    if text:
      rec['text_embedding'] = self.encode_prompts([prompt])[0]
    return rec

  def encode_prompts(self, prompts):
    """list[str] -> (B, L, C) float32 text embeddings as the DiT's cond['text'] (host): the family's
    encoder (config.cosmos.text), not cached."""
    return self.family.encode_prompts(list(prompts))['text_embedding']

  def device_text_encoder(self):
    """The text encoder this task runs on the training devices (models.reason1_text.DeviceEncoder, for
    `ddrl_jax.aot`), or None without config.cosmos.text='reason1': the family's."""
    return self.family.device_text_encoder()


def _finite_mean(values):
  ok = np.isfinite(values)
  return float(values[ok].mean()) if ok.any() else float('nan')


TASK = CosmosVideo
