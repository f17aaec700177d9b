"""Text-to-image and text-to-video on a prompt file, for any latent family with a pipeline
(`ddrl_jax.models.pipeline.LatentPipeline`: SD3.5's 'sd3', Wan2.1's 'wan'): `config.task = 'prompt_task'`
and `config.model_family` picks the family. The family owns the text encoders, the condition schema and
the VAE; this task holds the prompts, the conditions' guidance policy, the records, the rewards' inputs and
the evaluation.

Config (`config.prompt`):
  prompts           a prompt file, one a line ('' = FlowGRPO's 1017 OCR test prompts,
                    `data/ocr/flow_grpo_ocr_test.txt`; FlowGRPO's OCR training split is not public)
  num_eval_prompts  the first N prompts are held out for evaluation, the rest train (disjoint)
  guidance_rollout  the classifier-free guidance of rollouts and of the policy-gradient re-evaluation (the
                    rollout's own conditions carry it, so the two always agree) and of records
  guidance_eval     the guidance of evaluation
  prompts_required  a recipe whose prompt set does not ship: the prompt file is a required input
  prompts_source    where that prompt set comes from (for the missing-input message)

Conditions (a dict of (B, ...) arrays): the family's text fields and CFG fields (`text_conditions`: e.g.
SD3's 'text' and 'pooled', Wan's 'text', with 'guidance' and 'null_<field>' under CFG) and 'index' (B,),
the prompt's row in training + held-out prompts (-1 for a record's prompt that is not in it).

Rewards score the decoded media: uint8 images (M, H, W, 3) of an image family, videos (M, F, H, W, 3)
of a video family. Evaluation on the held-out prompts: OCR accuracy by Tesseract (the training reader) and
RapidOCR (the held-out judge), reading videos as the training reader does (its frame_stride and
video_mean, unless config.reward.kwargs.ocr_rapid sets them); the run's own rewards (reward/<name>) when
they are not OCR alone; and temporal_smoothness (rewards/basic.py) for videos.

Data: DDRL's data term reads records (config.data.path or config.data.base_samples): the base's own
samples (`python -m ddrl_jax.data.synthesize`, the paper's image setting) or real media encoded by
`python -m ddrl_jax.data.prepare`; records may carry the text embeddings.

Configs written before this task existed (`config.task = 'sd3_ocr'` / `'wan_t2v'` with the prompt keys in
config.sd3 / config.wan) are named in one line with the keys' new places (`ddrl_jax.moved_keys`).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

from ddrl_jax.models import pipeline as pipeline_lib
from ddrl_jax.rewards import basic as basic_rewards
from ddrl_jax.rewards import ocr as ocr_reward
from ddrl_jax.rl import algorithms as rl_algorithms
from ddrl_jax.tasks import base
from ddrl_jax.tasks import ocr as ocr_task

DEFAULT_PROMPTS = os.path.join(pipeline_lib.REPO_ROOT, 'data', 'ocr', 'flow_grpo_ocr_test.txt')
resolve = pipeline_lib.resolve
SECTION = 'prompt'


def read_prompts(path, key='config.prompt.prompts'):
  """Non-empty lines of a prompt file (relative paths from the repository root); '' = FlowGRPO's OCR
  test prompts. `key` names the config key in errors."""
  path = resolve(path) if path else DEFAULT_PROMPTS
  with open(path, encoding='utf-8') as f:
    prompts = [line.strip() for line in f if line.strip()]
  if not prompts:
    raise ValueError(f'{key}={path!r}: no prompts')
  return prompts


def readers_of(config):
  """(Tesseract, RapidOCR) with config.reward.kwargs' options; RapidOCR reads videos as the training
  reader does (its frame_stride and video_mean), unless config.reward.kwargs.ocr_rapid sets them."""
  kwargs = config.reward.kwargs
  ocr_kw = dict(kwargs.get('ocr', {}))
  video = {k: ocr_kw[k] for k in ('frame_stride', 'video_mean') if k in ocr_kw}
  return (ocr_reward.OCRReward(**ocr_kw),
          ocr_reward.RapidOCRReward(**dict(video, **dict(kwargs.get('ocr_rapid', {})))))


class PromptTask(base.FamilyTask):
  """A text-conditioned latent task on a prompt file (see the module docstring)."""

  DEFAULT_FAMILY = ''              # config.model_family names it
  capabilities = frozenset({'records', 'media', 'aot'})

  def __init__(self, config):
    super().__init__(config)
    if not hasattr(self.family, 'text_conditions'):
      raise ValueError(f'config.model_family={self.family.name!r}: the prompt task needs a family with a '
                       'text-to-media pipeline (ddrl_jax/models/pipeline.py), e.g. sd3 or wan')
    if config.get(SECTION) is None:
      raise ValueError('the prompt task reads config.prompt (prompts, num_eval_prompts, guidance_rollout, '
                       'guidance_eval): this config has no such section')
    self.c = c = config.prompt
    self.sample_shape = tuple(self.family.sample_shape)
    prompts = read_prompts(c.prompts)
    if len(prompts) <= c.num_eval_prompts:
      raise ValueError(f'config.prompt.num_eval_prompts={c.num_eval_prompts}: the prompt file has only '
                       f'{len(prompts)} prompts (the rest train)')
    self.eval_prompts = prompts[:c.num_eval_prompts]
    self.train_prompts = prompts[c.num_eval_prompts:]
    self.all_prompts = self.train_prompts + self.eval_prompts
    self._row = {p: i for i, p in reversed(list(enumerate(self.all_prompts)))}
    self._readers = None
    self._smoothness = basic_rewards.TemporalSmoothness() if self.family.is_video else None

  @property
  def media_shape(self):
    """One uint8 medium: (1, H, W, 3) for an image, (F, H, W, 3) for a video."""
    return tuple(self.family.media_shape)

  def required_inputs(self):
    """What a full run needs (`ddrl_jax.preflight`, when config.require_inputs): the family's weights,
    a recipe's own prompt file, and DDRL's records (the base's own samples)."""
    from ddrl_jax import preflight  # pylint: disable=g-import-not-at-top
    out = list(self.family.required_inputs())
    if self.c.get('prompts_required', False):     # a recipe whose prompt set does not ship with the project
      out.append(preflight.Input('prompt.prompts', self.c.prompts, 'the training prompts',
                                 self.c.get('prompts_source', 'a file of prompts, one a line')))
    algo = rl_algorithms.get_algorithm(self.config.algorithm)
    if algo.uses_data and self.config.rl.data_beta > 0 and not self.config.data.get('base_samples', 0):
      out.append(preflight.Input('data.path', self.config.data.path, "the data term's records (the base's "
                                 'own samples)', '--config.data.base_samples=<N> (sampled on the first run) or '
                                 'python -m ddrl_jax.data.synthesize --config=<this config> --out=<dir>'))
    return out

  # ----------------------------------------------------------------------------- conditions
  def encode_prompts(self, prompts):
    """list[str] -> {record name: (B, ...)} float32 embeddings (the family's encoders, cached)."""
    return self.family.encode_prompts(prompts)

  def _cond(self, prompts, guidance, given=None):
    cond = self.family.text_conditions(prompts, guidance, given)
    cond['index'] = jnp.asarray([self._row.get(p, -1) for p in prompts], jnp.int32)
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
    return dict(self.family.abstract_text_conditions(batch), index=jax.ShapeDtypeStruct((batch,), jnp.int32))

  def prompts(self, cond):
    """The prompt of each condition (training and held-out prompts; records' own prompts need not be in
    the list, and the trainer takes those from the records)."""
    out = []
    for i in np.asarray(cond['index']):
      if not 0 <= i < len(self.all_prompts):
        raise ValueError(f'condition index {i}: not a prompt of config.prompt.prompts')
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
                       f'needs {tuple(self.sample_shape)} ({self.family.shape_key})')
    prompts = list(batch['prompt'])
    fields = self.family.TEXT_FIELDS
    cond = self._cond(prompts, self.c.guidance_rollout, {f: batch.get(f) for f in fields.values()})
    want = tuple(self.family.text_shapes()['text'])
    if cond['text'].shape[1:] != want:
      raise ValueError(f'config.data.path: text embeddings of shape {cond["text"].shape[1:]}, the task '
                       f'needs {want}')
    return cond, jnp.asarray(x0)

  # ------------------------------------------------------------------------------- media
  def decode(self, latents):
    """(M, *sample_shape) latents -> (uint8 images (M, H, W, 3) or videos (M, F, H, W, 3), finite (M,))
    (the family's VAE, in chunks)."""
    return self.family.decode(latents)

  def encode_samples(self, media_u8):
    """(B, *media_shape) uint8 media -> (B, *sample_shape) normalized latents (the family's VAE)."""
    return self.family.encode_samples(media_u8)

  # -------------------------------------------------------------------- rewards and evaluation
  def reward_inputs(self, samples, cond):
    del cond
    return self.decode(samples)

  @property
  def eval_scores_with_rewards(self):
    """A run training on rewards other than OCR (the PickScore / GenEval presets) is also evaluated by
    them: the trainer passes `evaluate` a scorer of the run's rewards."""
    return set(self.config.reward.fns) != {'ocr'}

  def ocr_metrics(self, media, finite, cond):
    """OCR accuracy (Tesseract and RapidOCR, config.reward.kwargs' options) of decoded samples."""
    self._readers = self._readers or readers_of(self.config)
    return ocr_task.ocr_metrics_of(media, finite, self.prompts(cond), self._readers)

  def evaluate(self, samples, key, cond=None, score=None):
    """OCR accuracy of the decoded held-out samples; with `score` (fn(media, prompts) -> {reward: (M,)}),
    reward/<name>, each of the run's rewards' mean over the finite samples it could score; for videos the
    mean temporal smoothness of the finite ones."""
    del key
    media, finite = self.decode(samples)
    out = dict(finite_fraction=float(finite.mean()))
    if cond is not None:
      out = self.ocr_metrics(media, finite, cond)
      if score is not None:
        for name, values in score(media, self.prompts(cond)).items():
          values = np.where(finite, np.asarray(values, np.float64), np.nan)
          ok = np.isfinite(values)
          out[f'reward/{name}'] = float(values[ok].mean()) if ok.any() else float('nan')
    if self._smoothness is not None:
      smooth = np.asarray(self._smoothness(media, None), np.float64)[finite]
      out['temporal_smoothness'] = float(smooth.mean()) if smooth.size else float('nan')
    return out

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


TASK = PromptTask
