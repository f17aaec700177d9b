"""Wan LoRA export: adapters trained on WanDiT, written as a diffusers LoRA file, load into diffusers'
`WanTransformer3DModel` with peft (`load_lora_adapter`) and reproduce ddrl_jax's LoRA forward in fp32 (every
parameter random, tests/test_wan_dit.py's model); the merged full weights load with `load_state_dict`
strictly and do the same; the adapter names are the converter's names."""
import copy
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_wan_dit import CFG, _inputs  # tests/test_wan_dit.py
from test_wan_dit import diffusers_sd, torch_model  # noqa: F401  pylint: disable=unused-import
from test_lora_export import attach_random_adapters  # tests/test_lora_export.py

from configs import wan_common
from ddrl_jax.models import lora
from ddrl_jax.models import lora_export
from ddrl_jax.models.wan import family as wan_family
from ddrl_jax.models.wan import transformer_convert as wc

torch = pytest.importorskip('torch')
pytest.importorskip('peft')
safetensors = pytest.importorskip('safetensors')

# The configs' targets (self- and cross-attention q/k/v/out), at a rank and alpha where alpha/r != 1.
SPEC = lora.LoRAConfig(rank=4, alpha=12.0, targets=wan_common.LORA_TARGETS)
SHAPE = (16, 2, 6, 10)


@pytest.fixture(scope='module')
def adapted(diffusers_sd):
  """WanDiT from the diffusers weights with random (nonzero) r4 adapters: (model, trainable)."""
  return attach_random_adapters(wc.merge_params(CFG, wc.from_diffusers_state_dict(diffusers_sd, CFG)), SPEC)


def _forward(model, x, t, ctx):
  return np.asarray(nnx.jit(lambda m, *a: m(*a))(model, *map(jnp.asarray, (x, t, ctx))))


def _torch_forward(model, x, t, ctx):
  with torch.no_grad():
    return model(torch.tensor(x), torch.tensor(t), torch.tensor(ctx), return_dict=False)[0].numpy()


def test_adapter_names_are_the_converters_names():
  names = wc.diffusers_names('blocks/attn2/to_out/kernel', CFG)
  assert names == [f'blocks.{i}.attn2.to_out.0.weight' for i in range(CFG.num_layers)]
  assert wc.diffusers_names('condition_embedder/text_embedder/linear_1/kernel', CFG) == [
      'condition_embedder.text_embedder.linear_1.weight']
  with pytest.raises(ValueError, match='patch_embedding.*conv'):
    wc.diffusers_names('patch_embedding/kernel', CFG)


def test_exported_adapters_load_into_diffusers_with_peft(adapted, torch_model, tmp_path):
  model, trainable = adapted
  x, t, ctx = _inputs(5, SHAPE)
  ours = _forward(model, x, t, ctx)
  base = _torch_forward(torch_model, x, t, ctx)
  assert np.abs(ours - base).max() > 1e-2                          # the adapters change the output
  path = tmp_path / lora_export.WEIGHTS_NAME
  n = lora_export.save_adapters(str(path), trainable, SPEC, wan_family.dit_exporter(CFG))
  assert n == CFG.num_layers * 8                                   # attn1 and attn2: q, k, v, out
  with safetensors.safe_open(str(path), 'np') as f:
    meta = json.loads(f.metadata()['lora_adapter_metadata'])
    assert {'transformer.r': 4, 'transformer.lora_alpha': 4}.items() <= meta.items()
    keys = set(f.keys())
  assert f'transformer.blocks.{CFG.num_layers - 1}.attn2.to_out.0.lora_B.weight' in keys
  assert all(re.fullmatch(r'transformer\.blocks\.\d+\.attn[12]\.(to_[qkv]|to_out\.0)\.lora_[AB]\.weight', k)
             for k in keys)
  theirs_model = copy.deepcopy(torch_model)     # peft wraps the modules it adapts: keep the fixture plain
  theirs_model.load_lora_adapter(str(path), prefix='transformer', adapter_name='ddrl')
  theirs = _torch_forward(theirs_model, x, t, ctx)
  np.testing.assert_allclose(theirs, ours, atol=1e-5 * max(1.0, float(np.abs(ours).max())), rtol=0)
  theirs_model.delete_adapters('ddrl')
  np.testing.assert_allclose(_torch_forward(theirs_model, x, t, ctx), base, atol=1e-6)


def test_merged_weights_load_into_diffusers(adapted, torch_model, tmp_path):
  model, _ = adapted
  x, t, ctx = _inputs(6, SHAPE)
  ours = _forward(model, x, t, ctx)
  path = tmp_path / lora_export.MERGED_NAME
  lora_export.save_merged(str(path), nnx.state(model, nnx.Param), SPEC,
                          wan_family.dit_exporter(CFG))
  from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top
  merged = copy.deepcopy(torch_model)
  merged.load_state_dict(load_file(str(path)), strict=True)
  theirs = _torch_forward(merged, x, t, ctx)
  np.testing.assert_allclose(theirs, ours, atol=1e-5 * max(1.0, float(np.abs(ours).max())), rtol=0)
