"""CLI: sample a (base) model over a prompt set into record shards, as regularization data for DDRL.

  python -m ddrl_jax.data.synthesize --config=configs/toy2d.py --out=/tmp/synthetic \\
      [--workdir=DIR] [--prompts=FILE] [--per_prompt=K] [--batch=M] [--seed=S] [--ema] [--text=none]

The paper's image experiment regularizes with samples of the base model instead of its (unavailable)
training data: the forward-KL data term then keeps the policy near the base model's distribution. The
model is the latest checkpoint of --workdir (its EMA with --ema), or, without --workdir, the task's
initial model (its base / pretrained weights). The sampler is the config's, made deterministic (the
ODE) unless --stochastic. Records: ddrl_jax.data.records format, one per sample, built by the task's
`record_of` (prompt, sample, and for video tasks text_embedding and first_frame); read them back with
config.data.path. Non-finite samples are skipped and counted.
"""
import logging
import os
import tempfile

from absl import flags
import jax
from ml_collections import config_flags
import numpy as np
import tqdm

from ddrl_jax import cli
from ddrl_jax import console
from ddrl_jax import parallel
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.data import records as records_lib
from ddrl_jax.models import lora as lora_lib

logger = logging.getLogger('ddrl_jax.data.synthesize')   # not __name__: '__main__' under python -m


def read_prompts(path):
  """One prompt per non-empty line."""
  with open(path, encoding='utf-8') as f:
    prompts = [line.strip() for line in f if line.strip()]
  if not prompts:
    raise ValueError(f'--prompts={path}: no prompts in the file')
  return prompts


def synthesize(config, out, *, workdir=None, prompts=None, per_prompt=1, batch=64, seed=0, ema=False,
               text=True, stochastic=False, records_per_shard=1000, progress=True):
  """Writes per_prompt samples of every prompt to `out`; returns a summary dict."""
  with tempfile.TemporaryDirectory() as scratch:
    trainer = trainer_lib.Trainer(config, workdir or scratch)
    step = trainer.restore_or_init(read_only=True)
  sampler = trainer.sampler if stochastic else trainer.sampler.deterministic()
  sample_fn = trainer_lib.make_sample_fn(sampler, trainer.apply_fn, trainer.task.sample_shape,
                                         trainer.mesh, plan=trainer.plan)
  params = trainer.state.ema_params if ema else trainer.state.params
  if params is None:
    raise ValueError('--ema: the checkpoint holds no EMA parameters (config.optim.ema_power_s=None)')
  params = lora_lib.combine(params, trainer.state.frozen)     # the adapted model under LoRA
  task = trainer.task
  task.require('records')
  prompts = list(prompts or task.prompt_set())
  dp = parallel.data_parallel_size(trainer.mesh)
  batch = max(dp, batch // dp * dp)
  todo = [p for p in prompts for _ in range(per_prompt)]
  key = jax.random.key(seed)
  stats = {'skipped_nonfinite': 0}

  def generate():
    bar = tqdm.tqdm(total=len(todo), disable=not progress, desc='synthesize', dynamic_ncols=True)
    for i, start in enumerate(range(0, len(todo), batch)):
      chunk = todo[start:start + batch]
      padded = chunk + [chunk[-1]] * (-len(chunk) % dp)        # slots must divide the mesh
      k_cond, k_sample = jax.random.split(jax.random.fold_in(key, i))
      cond = task.conditions_from_prompts(padded, k_cond)
      cond = jax.device_put(cond, parallel.batch_sharding(trainer.mesh))
      samples = np.asarray(sample_fn(params, cond, k_sample))
      samples = samples.reshape((len(padded),) + task.sample_shape)[:len(chunk)]
      for prompt, sample in zip(chunk, samples):
        if not np.isfinite(sample).all():
          stats['skipped_nonfinite'] += 1
          logger.warning('skipping a non-finite sample of prompt %r', prompt)
          continue
        yield task.record_of(sample, prompt, text=text)
      bar.update(len(chunk))
    bar.close()

  shards = records_lib.write_shards(
      generate(), out, records_per_shard=records_per_shard,
      extra=dict(source='synthesize', config_task=config.task, checkpoint_step=step,
                 workdir=workdir or '', ema=ema, stochastic=stochastic, per_prompt=per_prompt,
                 seed=seed, **stats))
  return dict(shards=shards, num_records=len(todo) - stats['skipped_nonfinite'], step=step, **stats)


def _define_flags():
  """Defined only when run as a script, so importing this module adds no global absl flags."""
  global _CONFIG, _OUT, _WORKDIR, _PROMPTS, _PER_PROMPT, _BATCH, _SEED, _EMA, _TEXT, _STOCHASTIC
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'Training config (task, model, sampler).')
  _OUT = flags.DEFINE_string('out', None, 'Output directory for the record shards.')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'Trainer workdir to sample from (default: base).')
  _PROMPTS = flags.DEFINE_string('prompts', None, 'Prompt file, one per line (default: the task\'s).')
  _PER_PROMPT = flags.DEFINE_integer('per_prompt', 1, 'Samples per prompt.')
  _BATCH = flags.DEFINE_integer('batch', 64, 'Samples per sampling call.')
  _SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
  _EMA = flags.DEFINE_bool('ema', False, 'Sample with the EMA parameters of --workdir.')
  _TEXT = flags.DEFINE_enum('text', 'task', ['task', 'none'], 'Store text embeddings (video tasks).')
  _STOCHASTIC = flags.DEFINE_bool('stochastic', False, 'Use the SDE sampler instead of the ODE.')


def main(argv):
  console.setup()
  del argv
  prompts = read_prompts(_PROMPTS.value) if _PROMPTS.value else None
  summary = synthesize(_CONFIG.value, _OUT.value, workdir=_WORKDIR.value, prompts=prompts,
                       per_prompt=_PER_PROMPT.value, batch=_BATCH.value, seed=_SEED.value,
                       ema=_EMA.value, text=_TEXT.value == 'task', stochastic=_STOCHASTIC.value)
  print(f"wrote {summary['num_records']} records to {_OUT.value} "
        f"({len(summary['shards'])} shards, model step {summary['step']}, "
        f"{summary['skipped_nonfinite']} non-finite skipped)")


if __name__ == '__main__':
  _define_flags()
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  cli.run(main, required=('config', 'out'))
