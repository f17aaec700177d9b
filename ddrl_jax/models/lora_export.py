"""LoRA adapters -> diffusers/peft files, and merged full weights, for any family with an `Exporter`.

`adapter_tensors` gives the diffusers LoRA state dict (`transformer.<module>.lora_A.weight` (r, in) =
A^T, `.lora_B.weight` (out, r) = ((alpha/r) B)^T): B carries the scale, so a loader that ignores the
metadata and one that reads it (lora_alpha = r) both reload the adapter at full strength (diffusers
reloads an adapter without metadata at alpha = r: an r32/alpha64 file would come back at half strength).
The metadata (`lora_adapter_metadata`, keys prefixed 'transformer.') is peft's LoraConfig: r, lora_alpha,
target_modules. `merged_state_dict` folds the adapters into the kernels, W + (alpha/r) A B, and writes the
whole model under diffusers' names. The names come from the model family's `Exporter`
(models/family.py): e.g. the OCR model's DiT (subtree `dit`) exports as the Cosmos DiT does; its
byte-embedding front end has no diffusers counterpart and is left out.
"""
import json

import numpy as np
from flax import nnx

WEIGHTS_NAME = 'pytorch_lora_weights.safetensors'      # diffusers' LORA_WEIGHT_NAME_SAFE
MERGED_NAME = 'diffusion_pytorch_model.safetensors'


def _flat(state, subtree):
  """{'/'-joined path below `subtree` ('' = the whole model): array} of a model state."""
  flat = {'/'.join(str(k) for k in path): np.asarray(v.get_value() if hasattr(v, 'get_value') else v)
          for path, v in nnx.to_flat_state(state)}
  if subtree:
    flat = {p[len(subtree) + 1:]: v for p, v in flat.items() if p.startswith(subtree + '/')}
  return flat


def adapter_tensors(trainable, spec, exporter, prefix='transformer'):
  """(diffusers LoRA tensors {key: np.float32 array}, LoraConfig dict) of a trained adapter state."""
  flat = _flat(trainable, exporter.subtree)
  tensors, modules = {}, set()
  for path in sorted(p for p in flat if p.endswith('/lora_a')):
    layer = path[:-len('/lora_a')]
    names = exporter.diffusers_names(layer + '/kernel')
    a, b = flat[path], flat[layer + '/lora_b'] * spec.scale
    stacked = a.ndim == 3
    for i, name in enumerate(names):
      module = name[:-len('.weight')]
      ai, bi = (a[i], b[i]) if stacked else (a, b)
      tensors[f'{prefix}.{module}.lora_A.weight'] = np.ascontiguousarray(ai.T, np.float32)
      tensors[f'{prefix}.{module}.lora_B.weight'] = np.ascontiguousarray(bi.T, np.float32)
      modules.add(module)
  config = dict(r=spec.rank, lora_alpha=spec.rank, target_modules=sorted(modules), lora_dropout=0.0,
                bias='none', use_rslora=False, use_dora=False, init_lora_weights=True)
  return tensors, config


def save_adapters(path, trainable, spec, exporter, prefix='transformer'):
  """Writes `adapter_tensors` with the peft config as safetensors metadata (as diffusers'
  save_lora_weights does). Returns the number of adapted modules."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  tensors, config = adapter_tensors(trainable, spec, exporter, prefix)
  meta = {f'{prefix}.{k}': v for k, v in config.items()}
  save_file(tensors, path, metadata={'format': 'pt', 'lora_adapter_metadata': json.dumps(meta, sort_keys=True)})
  return len(config['target_modules'])


def merged_state_dict(params, spec, exporter):
  """diffusers state dict of the model with its adapters folded in: kernel + (alpha/r) A B."""
  flat = _flat(params, exporter.subtree)
  merged = {}
  for path, value in flat.items():
    if path.endswith(('/lora_a', '/lora_b')):
      continue
    if path.endswith('/kernel') and path[:-len('kernel')] + 'lora_a' in flat:
      layer = path[:-len('/kernel')]
      a, b = flat[layer + '/lora_a'], flat[layer + '/lora_b']
      value = value + spec.scale * np.einsum('...ir,...ro->...io', a, b)
    merged[path] = value
  return exporter.to_diffusers(merged)


def save_merged(path, params, spec, exporter):
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  save_file({k: np.ascontiguousarray(v, np.float32) for k, v in merged_state_dict(params, spec, exporter).items()},
            path, metadata={'format': 'pt'})

