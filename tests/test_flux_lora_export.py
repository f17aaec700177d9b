"""FLUX LoRA export: adapters on configs/flux1_dev.py's flow_grpo targets (the double blocks' joint attention
and the single blocks' q/k/v), written as a diffusers LoRA file, load into diffusers' FluxTransformer2DModel
with peft and reproduce ddrl_jax's LoRA forward in fp32; the merged weights load with load_state_dict and do
the same (tests/test_flux_transformer.py's random tiny model)."""
import copy
import json

import jax
import numpy as np
import pytest
from flax import nnx
from test_flux_transformer import _config, _inputs, _reference  # tests/test_flux_transformer.py
from test_flux_transformer import diffusers_folder, diffusers_sd, torch_model  # noqa: F401  pylint: disable=unused-import
from test_lora_export import attach_random_adapters  # tests/test_lora_export.py

from configs import flux1_dev
from ddrl_jax.models import lora
from ddrl_jax.models import lora_export
from ddrl_jax.models.flux import convert
from ddrl_jax.models.flux import family as flux_family

torch = pytest.importorskip('torch')
pytest.importorskip('peft')
safetensors = pytest.importorskip('safetensors')

SPEC = lora.LoRAConfig(rank=4, alpha=12.0, targets=flux1_dev.FLOW_GRPO_TARGETS)


@pytest.fixture(scope='module')
def adapted(diffusers_sd):  # pylint: disable=redefined-outer-name
  cfg = _config()
  return attach_random_adapters(convert.model_from_pure(convert.from_diffusers_state_dict(diffusers_sd, cfg),
                                                        cfg), SPEC)


def _ours(model, x, t, text, pooled, guidance):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))(state, x, t, text, pooled, guidance))


def test_exported_adapters_load_into_diffusers_with_peft(adapted, torch_model, tmp_path):  # pylint: disable=redefined-outer-name
  model, trainable = adapted
  args = _inputs(8, 8, seed=5)
  ours = _ours(model, *args)
  base = _reference(torch_model, *args)[1]
  assert np.abs(ours - base).max() > 1e-2                          # the adapters change the output
  path = tmp_path / lora_export.WEIGHTS_NAME
  n = lora_export.save_adapters(str(path), trainable, SPEC, flux_family.dit_exporter(_config()))
  with safetensors.safe_open(str(path), 'np') as f:
    meta = json.loads(f.metadata()['lora_adapter_metadata'])
    keys = set(f.keys())
  assert meta['transformer.r'] == 4 and len(keys) == 2 * n
  assert any('single_transformer_blocks.' in k for k in keys) and any('add_q_proj' in k for k in keys)
  theirs = copy.deepcopy(torch_model)
  theirs.load_lora_adapter(str(path), prefix='transformer', adapter_name='ddrl')
  np.testing.assert_allclose(_reference(theirs, *args)[1], ours,
                             atol=1e-5 * max(1.0, float(np.abs(ours).max())), rtol=0)


def test_merged_weights_load_into_diffusers(adapted, torch_model, tmp_path):  # pylint: disable=redefined-outer-name
  model, _ = adapted
  args = _inputs(8, 12, seed=6)
  ours = _ours(model, *args)
  path = tmp_path / lora_export.MERGED_NAME
  lora_export.save_merged(str(path), nnx.state(model, nnx.Param), SPEC, flux_family.dit_exporter(_config()))
  from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top
  merged = copy.deepcopy(torch_model)
  merged.load_state_dict(load_file(str(path)), strict=True)
  np.testing.assert_allclose(_reference(merged, *args)[1], ours, atol=1e-5 * max(1.0, float(np.abs(ours).max())),
                             rtol=0)
