"""Export a LoRA run's adapters for diffusers/peft, or the merged full weights.

  python -m ddrl_jax.export_lora --config=configs/ocr_tiny.py --config.lora.rank=8 --config.lora.alpha=16 \
      --workdir=/tmp/ddrl_ocr_lora --out=/tmp/ddrl_ocr_lora/export [--ema] [--merged]

Reads the workdir's latest checkpoint (the same config as the run, as for resuming) and writes into --out:
  pytorch_lora_weights.safetensors: the adapters under diffusers' `CosmosTransformer3DModel` module names
    (`transformer.transformer_blocks.0.attn1.to_q.lora_A.weight`, ...), loadable with
    `CosmosTransformer3DModel.load_lora_adapter(path, prefix='transformer')` or a pipeline's
    `load_lora_weights`; alpha is folded into lora_B and the peft config is in the file's metadata, so
    either loader reloads it at full strength (ddrl_jax/models/lora_export.py);
  with --merged, diffusion_pytorch_model.safetensors: the whole DiT with the adapters folded into the
    kernels (W + alpha/r A B), loadable with `load_state_dict` into the same diffusers class.
  export.json: what was written, the step, the rank, alpha and the adapted modules.
"""
import json
import os
import sys

from absl import flags
import jax
from ml_collections import config_flags

from ddrl_jax import cli
from ddrl_jax import console
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.models import lora as lora_lib
from ddrl_jax.models import lora_export


def export(config, workdir, out, *, ema=False, merged=False, devices=None):
  """Writes the export files of `workdir`'s latest checkpoint into `out`; returns the export.json dict.
  devices: those the checkpoint is restored onto (default: all; the run's batch must divide over them)."""
  from ddrl_jax import preflight  # pylint: disable=g-import-not-at-top
  from ddrl_jax import storage  # pylint: disable=g-import-not-at-top
  if not storage.exists(os.path.join(str(workdir), 'checkpoints')):
    raise cli.UsageError(f'--workdir={workdir}: no training run there (no checkpoints/)',
                         'give the --workdir of a LoRA run')
  spec = lora_lib.from_config(config)
  if not spec.enabled:
    saved = _saved_lora(workdir)
    if saved and saved.get('rank'):
      targets = ','.join(saved.get('targets') or ())
      raise cli.UsageError(
          f'{workdir} trained LoRA adapters (rank {saved["rank"]}, alpha {saved.get("alpha")}), but the '
          'config given has config.lora.rank=0',
          f'pass the flags the run used: --config.lora.rank={saved["rank"]} '
          f'--config.lora.alpha={saved.get("alpha")}' + (f" --config.lora.targets='{targets}'" if targets else ''))
    raise cli.UsageError('config.lora.rank is 0 and so was the run\'s: it trained every parameter, there are '
                         'no adapters to export', 'give the workdir of a LoRA run (config.lora.rank > 0)')
  # The adapters come from the checkpoint, the frozen base from the config's weights (checked against
  # the fingerprint the run saved): those must be given, the training data need not.
  preflight.check_model_then_skip(config, cli.config_spec(sys.argv) or 'the config')
  trainer = trainer_lib.Trainer(config, workdir, devices=devices)
  step = trainer.restore_or_init(read_only=True)
  if step == 0:
    raise cli.UsageError(f'{workdir} has no checkpoint', 'train first, or give the run\'s --workdir')
  trained = trainer.state.ema_params if ema else trainer.state.params
  if trained is None:
    raise cli.UsageError('--ema: the run keeps no EMA', 'drop --ema (config.optim.ema_power_s was None)')
  trained = jax.device_get(trained)
  exporter = trainer.task.family.exporter()
  if exporter is None:
    raise cli.UsageError(f'model family {trainer.task.family.name!r} has no diffusers counterpart to '
                         'export to', 'export works for the families with diffusers names')
  os.makedirs(out, exist_ok=True)
  adapters = os.path.join(out, lora_export.WEIGHTS_NAME)
  modules = lora_export.save_adapters(adapters, trained, spec, exporter)
  info = dict(workdir=str(workdir), step=step, ema=ema, rank=spec.rank, alpha=spec.alpha or spec.rank,
              modules=modules, adapters=adapters)
  if merged:
    full = jax.device_get(lora_lib.combine(trained, trainer.state.frozen))
    info['merged'] = os.path.join(out, lora_export.MERGED_NAME)
    lora_export.save_merged(info['merged'], full, spec, exporter)
  with open(os.path.join(out, 'export.json'), 'w') as f:
    json.dump(info, f, indent=1)
  return info


def _saved_lora(workdir):
  """The lora section of the config saved with the run's newest checkpoint, or None (nothing is created)."""
  from ddrl_jax import resume  # pylint: disable=g-import-not-at-top
  from ddrl_jax import storage  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  if not storage.exists(os.path.join(str(workdir), 'checkpoints')):
    return None
  stub = ml_collections.ConfigDict(dict(max_checkpoints=1))
  saved = resume.RunCheckpoints(workdir, stub).saved_config()
  return (saved or {}).get('lora')


def _define_flags():
  global _CONFIG, _WORKDIR, _OUT, _EMA, _MERGED
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'The config the run trained with.')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'The LoRA run\'s workdir.')
  _OUT = flags.DEFINE_string('out', None, 'Output directory (default: <workdir>/export).')
  _EMA = flags.DEFINE_bool('ema', False, 'Export the EMA of the adapters.')
  _MERGED = flags.DEFINE_bool('merged', False, 'Also write the merged full weights.')


def main(argv):
  del argv
  console.setup()
  info = export(_CONFIG.value, _WORKDIR.value, _OUT.value or os.path.join(_WORKDIR.value, 'export'),
                ema=_EMA.value, merged=_MERGED.value)
  print(json.dumps(info))


if __name__ == '__main__':
  _define_flags()
  cli.run(main, required=('config', 'workdir'))
