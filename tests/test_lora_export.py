"""LoRA export: the adapters written as a diffusers LoRA file load into diffusers'
`CosmosTransformer3DModel` with peft (`load_lora_adapter`) and reproduce ddrl_jax's LoRA forward in fp32;
the merged full weights load with `load_state_dict` and do the same; the NNX -> diffusers key map is the
exact inverse of the converter."""
import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_cosmos_dit import B, CROSS_IN, H, L, W, _config, _torch_forward  # tests/test_cosmos_dit.py
from test_cosmos_dit import torch_model, diffusers_sd  # noqa: F401  pylint: disable=unused-import

from ddrl_jax.models.cosmos import convert as cosmos_convert
from ddrl_jax.models.cosmos import family as cosmos_family
from ddrl_jax.models import lora
from ddrl_jax.models import lora_export

torch = pytest.importorskip('torch')
pytest.importorskip('peft')
safetensors = pytest.importorskip('safetensors')

SPEC = lora.LoRAConfig(rank=4, alpha=12.0, targets=(
    r'blocks\.(self_attn|cross_attn)\.(q_proj|k_proj|v_proj|output_proj)', r'blocks\.mlp\.layer1'))


@pytest.fixture(scope='module')
def adapted(diffusers_sd):
  """Our model from the diffusers weights, with random (nonzero) r4 adapters: (model, trainable)."""
  config = _config()
  model = cosmos_convert.merge_params(config, cosmos_convert.convert_diffusers_state_dict(diffusers_sd, config))
  return attach_random_adapters(model, SPEC)


def attach_random_adapters(model, spec):
  """Attaches `spec`'s adapters to `model` with random nonzero A and B (0.2 N(0, 1)) so that they change
  its output; returns (model, the trainable adapter state)."""
  lora.attach(model, spec, jax.random.key(0))
  trainable, _ = lora.split(nnx.state(model), spec)
  leaves, treedef = jax.tree.flatten(trainable)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  trainable = jax.tree.unflatten(treedef, [0.2 * jax.random.normal(k, l.shape) for k, l in zip(keys, leaves)])
  nnx.update(model, trainable)
  return model, trainable


def _inputs(seed=3):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((B, 16, 2, H, W)).astype(np.float32)
  t = rng.uniform(0.05, 1.0, (B, 2)).astype(np.float32)
  ctx = rng.standard_normal((B, L, CROSS_IN)).astype(np.float32)
  cond = np.zeros((B, 1, 2, H, W), np.float32)
  pad = np.zeros((1, 1, 2 * H, 2 * W), np.float32)
  return x, t, ctx, cond, pad


def test_key_map_is_the_converters_inverse(diffusers_sd):
  config = _config()
  state = cosmos_convert.convert_diffusers_state_dict(diffusers_sd, config)
  flat = {'/'.join(str(k) for k in p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
  back = cosmos_convert.to_diffusers_state_dict(flat, config.num_blocks)
  assert sorted(back) == sorted(diffusers_sd)
  for k, v in diffusers_sd.items():
    np.testing.assert_array_equal(back[k], v)


def test_exported_adapters_load_into_diffusers_with_peft(adapted, torch_model, tmp_path, monkeypatch):
  model, trainable = adapted
  x, t, ctx, cond, pad = _inputs()
  ours = np.asarray(model(*map(jnp.asarray, (x, t, ctx, cond, pad))))
  base = _torch_forward(torch_model, x, t, ctx, cond, pad, monkeypatch)
  assert np.abs(ours - base).max() > 1e-2                          # the adapters change the output
  path = tmp_path / lora_export.WEIGHTS_NAME
  n = lora_export.save_adapters(str(path), trainable, SPEC, cosmos_family.dit_exporter(_config().num_blocks))
  assert n == 2 * (8 + 1)                                          # 2 blocks x (8 attention + layer1)
  with safetensors.safe_open(str(path), 'np') as f:
    meta = json.loads(f.metadata()['lora_adapter_metadata'])
    assert {'transformer.r': 4, 'transformer.lora_alpha': 4}.items() <= meta.items()
    assert 'transformer.transformer_blocks.1.attn2.to_out.0.lora_B.weight' in f.keys()
  theirs_model = copy.deepcopy(torch_model)     # peft wraps the modules it adapts: keep the fixture plain
  theirs_model.load_lora_adapter(str(path), prefix='transformer', adapter_name='ddrl')
  theirs = _torch_forward(theirs_model, x, t, ctx, cond, pad, monkeypatch)
  np.testing.assert_allclose(theirs, ours, atol=1e-5 * max(1.0, float(np.abs(ours).max())), rtol=0)
  # And the base is back once the adapter is removed.
  theirs_model.delete_adapters('ddrl')
  np.testing.assert_allclose(_torch_forward(theirs_model, x, t, ctx, cond, pad, monkeypatch), base, atol=1e-6)


def test_merged_weights_load_into_diffusers(adapted, torch_model, tmp_path, monkeypatch):
  model, _ = adapted
  x, t, ctx, cond, pad = _inputs(4)
  ours = np.asarray(model(*map(jnp.asarray, (x, t, ctx, cond, pad))))
  path = tmp_path / lora_export.MERGED_NAME
  lora_export.save_merged(str(path), nnx.state(model), SPEC, cosmos_family.dit_exporter(_config().num_blocks))
  from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top
  merged = copy.deepcopy(torch_model)
  merged.load_state_dict(load_file(str(path)), strict=True)
  theirs = _torch_forward(merged, x, t, ctx, cond, pad, monkeypatch)
  np.testing.assert_allclose(theirs, ours, atol=1e-5 * max(1.0, float(np.abs(ours).max())), rtol=0)
