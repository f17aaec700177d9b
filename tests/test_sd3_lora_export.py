"""SD3 LoRA export: adapters on the MMDiT's joint attention (configs/sd35m.py's flow_grpo targets, plus the
dual blocks' image-only attn2 so that every stacked attention path is named), written as a diffusers LoRA file, load into diffusers'
`SD3Transformer2DModel` with peft and reproduce ddrl_jax's LoRA forward in fp32 (every parameter random,
tests/test_sd3_mmdit.py's model); the merged weights load with `load_state_dict` and do the same."""
import copy
import json

import jax
import numpy as np
import pytest
from flax import nnx
from test_lora_export import attach_random_adapters  # tests/test_lora_export.py
from test_sd3_mmdit import _config, _inputs  # tests/test_sd3_mmdit.py
from test_sd3_mmdit import diffusers_sd, torch_model  # noqa: F401  pylint: disable=unused-import

from configs import sd35m
from ddrl_jax.models import lora
from ddrl_jax.models import lora_export
from ddrl_jax.models.sd3 import convert
from ddrl_jax.models.sd3 import family as sd3_family

torch = pytest.importorskip('torch')
pytest.importorskip('peft')
safetensors = pytest.importorskip('safetensors')

SPEC = lora.LoRAConfig(rank=4, alpha=12.0,
                       targets=sd35m.LORA_TARGETS + (r'dual_blocks\.attn2\.(to_q|to_k|to_v|to_out)',))


@pytest.fixture(scope='module')
def adapted(diffusers_sd):
  cfg = _config()
  return attach_random_adapters(convert.model_from_pure(convert.from_diffusers_state_dict(diffusers_sd, cfg),
                                                        cfg), SPEC)


def _ours(model, x, t, text, pooled):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))(state, x, t, text, pooled))


def _theirs(model, x, t, text, pooled):
  with torch.no_grad():
    return model(torch.tensor(x), torch.tensor(text), torch.tensor(pooled), torch.tensor(t),
                 return_dict=False)[0].numpy()


def test_exported_adapters_load_into_diffusers_with_peft(adapted, torch_model, tmp_path):
  model, trainable = adapted
  args = _inputs(16, 24, seed=5)
  ours, base = _ours(model, *args), _theirs(torch_model, *args)
  assert np.abs(ours - base).max() > 1e-2                          # the adapters change the output
  path = tmp_path / lora_export.WEIGHTS_NAME
  n = lora_export.save_adapters(str(path), trainable, SPEC, sd3_family.dit_exporter(_config()))
  with safetensors.safe_open(str(path), 'np') as f:
    meta = json.loads(f.metadata()['lora_adapter_metadata'])
    keys = set(f.keys())
  assert meta['transformer.r'] == 4 and len(keys) == 2 * n
  assert any('.attn2.' in k for k in keys) and any('add_q_proj' in k for k in keys)
  theirs_model = copy.deepcopy(torch_model)
  theirs_model.load_lora_adapter(str(path), prefix='transformer', adapter_name='ddrl')
  np.testing.assert_allclose(_theirs(theirs_model, *args), ours,
                             atol=1e-5 * max(1.0, float(np.abs(ours).max())), rtol=0)


def test_merged_weights_load_into_diffusers(adapted, torch_model, tmp_path):
  model, _ = adapted
  args = _inputs(16, 16, seed=6)
  ours = _ours(model, *args)
  path = tmp_path / lora_export.MERGED_NAME
  lora_export.save_merged(str(path), nnx.state(model, nnx.Param), SPEC, sd3_family.dit_exporter(_config()))
  from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top
  merged = copy.deepcopy(torch_model)
  merged.load_state_dict(load_file(str(path)), strict=True)      # every key, the pos_embed buffer too
  np.testing.assert_allclose(_theirs(merged, *args), ours, atol=1e-5 * max(1.0, float(np.abs(ours).max())),
                             rtol=0)
