"""CLI: sample a (base) model over a prompt set into record shards, as regularization data for DDRL.

  python -m ddrl_jax.data.synthesize --config=configs/toy2d.py --out=/tmp/synthetic \\
      [--workdir=DIR] [--prompts=FILE] [--per_prompt=K | --num=N] [--batch=M] [--seed=S] [--ema]
      [--sampler=eval|ode|sde] [--text=none]

The paper's image experiment regularizes with samples of the base model instead of its (unavailable)
training data: the forward-KL data term then keeps the policy near the base model's distribution. DDRL
presets do this on their own (config.data.base_samples: the trainer writes them into its workdir on the
first run); this CLI writes the same records anywhere, e.g. once for several runs.

The model is the latest checkpoint of --workdir (its EMA with --ema), or, without --workdir, the task's
initial model (its base / pretrained weights). --sampler: 'eval' (default) the config's evaluation
sampler (sampler.eval_num_steps, without noise when sampler.eval_deterministic), 'ode' the training
schedule without noise, 'sde' the training sampler itself. Records: ddrl_jax.data.records format, one per
sample, built by the task's `record_of` (prompt, sample, and for video tasks text_embedding and
first_frame); read them back with config.data.path. A killed run, rerun with the same flags, continues at
its first unfinished shard (ddrl_jax.data.synthesis). Non-finite samples are skipped and counted.
"""
import logging
import os
import sys
import tempfile

from absl import flags
from ml_collections import config_flags

from ddrl_jax import cli
from ddrl_jax import console
from ddrl_jax import preflight
from ddrl_jax import storage
from ddrl_jax import trainer as trainer_lib
from ddrl_jax import update as update_lib
from ddrl_jax.data import synthesis
from ddrl_jax.models import lora as lora_lib

logger = logging.getLogger('ddrl_jax.data.synthesize')   # not __name__: '__main__' under python -m

SAMPLERS = ('eval', 'ode', 'sde')


def read_prompts(path):
  """One prompt per non-empty line."""
  with open(path, encoding='utf-8') as f:
    prompts = [line.strip() for line in f if line.strip()]
  if not prompts:
    raise ValueError(f'--prompts={path}: no prompts in the file')
  return prompts


def make_synthesis_sampler(config, name):
  """The sampler of `name` (SAMPLERS) for `config`."""
  if name == 'eval':
    return update_lib.make_eval_sampler(config)
  if name == 'ode':
    return update_lib.make_sampler(config).deterministic()
  if name == 'sde':
    return update_lib.make_sampler(config)
  raise ValueError(f'sampler {name!r}: one of {SAMPLERS}')


def synthesize(config, out, *, workdir=None, prompts=None, per_prompt=1, num=None, batch=64, seed=0,
               ema=False, text=True, sampler='eval', records_per_shard=1000, progress=True):
  """Writes per_prompt samples of every prompt (or `num` samples over the prompts in turn) to `out`;
  returns a summary dict (ddrl_jax.data.synthesis.write_samples)."""
  if workdir and not storage.exists(os.path.join(str(workdir), 'checkpoints')):
    raise cli.UsageError(f'--workdir={workdir}: no training run there (no checkpoints/)',
                         'give a trainer --workdir, or none to sample the base model')
  preflight.check_model_then_skip(config, cli.config_spec(sys.argv) or 'the config')
  with tempfile.TemporaryDirectory() as scratch:
    trainer = trainer_lib.Trainer(config, workdir or scratch)
    step = trainer.restore_or_init(read_only=True)
  task = trainer.task
  task.require('records')
  chosen = make_synthesis_sampler(config, sampler)
  sample_fn = trainer_lib.make_sample_fn(chosen, trainer.apply_fn, task.sample_shape, trainer.mesh,
                                         plan=trainer.plan)
  params = trainer.state.ema_params if ema else trainer.state.params
  if params is None:
    raise ValueError('--ema: the checkpoint holds no EMA parameters (config.optim.ema_power_s=None)')
  params = lora_lib.combine(params, trainer.state.frozen)     # the adapted model under LoRA
  prompts = list(prompts or task.prompt_set())
  todo = (synthesis.prompts_round_robin(prompts, num) if num else
          [p for p in prompts for _ in range(per_prompt)])
  described = dict(task=config.task, sampler=sampler, steps=int(chosen.num_steps),
                   stochastic=sampler == 'sde', model=dict(workdir=str(workdir or ''), step=step, ema=ema))
  summary = synthesis.write_samples(task, sample_fn, params, trainer.mesh, out, todo, seed=seed,
                                    batch=batch, text=text, records_per_shard=records_per_shard,
                                    described=described, extra=dict(source='synthesize', per_prompt=per_prompt),
                                    progress=progress)
  return dict(summary, step=step)


def _define_flags():
  """Defined only when run as a script, so importing this module adds no global absl flags."""
  global _CONFIG, _OUT, _WORKDIR, _PROMPTS, _PER_PROMPT, _NUM, _BATCH, _SEED, _EMA, _TEXT, _SAMPLER
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'Training config (task, model, sampler).')
  _OUT = flags.DEFINE_string('out', None, 'Output directory for the record shards.')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'Trainer workdir to sample from (default: base).')
  _PROMPTS = flags.DEFINE_string('prompts', None, 'Prompt file, one per line (default: the task\'s).')
  _PER_PROMPT = flags.DEFINE_integer('per_prompt', 1, 'Samples per prompt.')
  _BATCH = flags.DEFINE_integer('batch', 64, 'Samples per sampling call.')
  _SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
  _EMA = flags.DEFINE_bool('ema', False, 'Sample with the EMA parameters of --workdir.')
  _NUM = flags.DEFINE_integer('num', 0, 'Samples in all, over the prompts in turn (instead of --per_prompt).')
  _TEXT = flags.DEFINE_enum('text', 'task', ['task', 'none'], 'Store text embeddings (video tasks).')
  _SAMPLER = flags.DEFINE_enum('sampler', 'eval', list(SAMPLERS),
                               "'eval': the config's evaluation sampler; 'ode': the training schedule "
                               "without noise; 'sde': the training sampler.")


def main(argv):
  console.setup()
  del argv
  prompts = read_prompts(_PROMPTS.value) if _PROMPTS.value else None
  summary = synthesize(_CONFIG.value, _OUT.value, workdir=_WORKDIR.value, prompts=prompts,
                       per_prompt=_PER_PROMPT.value, num=_NUM.value or None, batch=_BATCH.value,
                       seed=_SEED.value, ema=_EMA.value, text=_TEXT.value == 'task', sampler=_SAMPLER.value)
  print(f"wrote {summary['num_records']} records to {_OUT.value} "
        f"({len(summary['shards'])} shards, model step {summary['step']}, "
        f"{summary['skipped_nonfinite']} non-finite skipped)")


if __name__ == '__main__':
  _define_flags()
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  cli.run(main, required=('config', 'out'))
