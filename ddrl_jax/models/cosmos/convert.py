"""PyTorch state dicts -> `CosmosDiT` NNX state.

Two source formats:
- diffusers `CosmosTransformer3DModel` (`convert_diffusers_state_dict`);
- the original Cosmos-Predict2.5 `net.`-prefixed checkpoint (`convert_cosmos_state_dict`).

Both map every tensor to a path of the NNX state (names follow the original checkpoint), transpose
Linear weights [out, in] -> kernels (in, out), stack per-block tensors on the leading 'layers' axis,
check everything against `nnx.eval_shape` of the model and raise ONE ValueError that lists all
missing, unexpected and mis-shaped keys.

Usage:
  state = convert_diffusers_state_dict({k: v.numpy() for k, v in sd.items()}, config)
  model = nnx.merge(nnx.graphdef(abstract_model), state)
"""
import re

import numpy as np
from flax import nnx

from ddrl_jax.models import checked_state
from ddrl_jax.models.cosmos.dit import CosmosDiT

# (source-name regex, NNX path template, kind). kind: 'linear' (transpose), 'vector' (copy).
# A `{i}` group in the regex is the block index; those tensors are stacked along the layer axis.
_DIFFUSERS_ATTN = {'to_q': 'q_proj', 'to_k': 'k_proj', 'to_v': 'v_proj', 'to_out.0': 'output_proj'}
_DIFFUSERS_NORM = {'norm1': 'self_attn', 'norm2': 'cross_attn', 'norm3': 'mlp'}


def _diffusers_rules():
  """(regex, path, kind) triples for diffusers key names."""
  blk = r'transformer_blocks\.(\d+)\.'
  rules = [
      (r'patch_embed\.proj\.weight', 'x_embedder/kernel', 'linear'),
      (r'time_embed\.t_embedder\.linear_1\.weight', 't_embedder/linear_1/kernel', 'linear'),
      (r'time_embed\.t_embedder\.linear_2\.weight', 't_embedder/linear_2/kernel', 'linear'),
      (r'time_embed\.norm\.weight', 't_embedding_norm/scale', 'vector'),
      (r'crossattn_proj\.0\.weight', 'crossattn_proj/kernel', 'linear'),
      (r'crossattn_proj\.0\.bias', 'crossattn_proj/bias', 'vector'),
      (r'norm_out\.linear_1\.weight', 'final_layer/adaln_modulation/linear_1/kernel', 'linear'),
      (r'norm_out\.linear_2\.weight', 'final_layer/adaln_modulation/linear_2/kernel', 'linear'),
      (r'proj_out\.weight', 'final_layer/linear/kernel', 'linear'),
      (r'learnable_pos_embed\.pos_emb_([thw])', 'extra_pos_embedder/pos_emb_{0}', 'vector'),
      (blk + r'ff\.net\.0\.proj\.weight', 'blocks/mlp/layer1/kernel', 'linear'),
      (blk + r'ff\.net\.2\.weight', 'blocks/mlp/layer2/kernel', 'linear'),
  ]
  for attn, ours in (('attn1', 'self_attn'), ('attn2', 'cross_attn')):
    for theirs, proj in _DIFFUSERS_ATTN.items():
      rules.append((blk + rf'{attn}\.{re.escape(theirs)}\.weight', f'blocks/{ours}/{proj}/kernel', 'linear'))
    for theirs, norm in (('norm_q', 'q_norm'), ('norm_k', 'k_norm')):
      rules.append((blk + rf'{attn}\.{theirs}\.weight', f'blocks/{ours}/{norm}/scale', 'vector'))
  for norm, sub in _DIFFUSERS_NORM.items():
    for j in (1, 2):
      rules.append((blk + rf'{norm}\.linear_{j}\.weight',
                    f'blocks/adaln_modulation_{sub}/linear_{j}/kernel', 'linear'))
  return rules


def _cosmos_rules():
  """(regex, path, kind) triples for the original `net.` checkpoint names (arch notes section 4)."""
  blk = r'net\.blocks\.(\d+)\.'
  rules = [
      (r'net\.x_embedder\.proj\.1\.weight', 'x_embedder/kernel', 'linear'),
      (r'net\.t_embedder\.1\.linear_1\.weight', 't_embedder/linear_1/kernel', 'linear'),
      (r'net\.t_embedder\.1\.linear_2\.weight', 't_embedder/linear_2/kernel', 'linear'),
      (r'net\.t_embedding_norm\.weight', 't_embedding_norm/scale', 'vector'),
      (r'net\.crossattn_proj\.0\.weight', 'crossattn_proj/kernel', 'linear'),
      (r'net\.crossattn_proj\.0\.bias', 'crossattn_proj/bias', 'vector'),
      (r'net\.final_layer\.adaln_modulation\.1\.weight', 'final_layer/adaln_modulation/linear_1/kernel',
       'linear'),
      (r'net\.final_layer\.adaln_modulation\.2\.weight', 'final_layer/adaln_modulation/linear_2/kernel',
       'linear'),
      (r'net\.final_layer\.linear\.weight', 'final_layer/linear/kernel', 'linear'),
      (r'net\.extra_pos_embedder\.pos_emb_([thw])', 'extra_pos_embedder/pos_emb_{0}', 'vector'),
      (blk + r'mlp\.layer([12])\.weight', 'blocks/mlp/layer{0}/kernel', 'linear'),
      (blk + r'(self_attn|cross_attn)\.(q_proj|k_proj|v_proj|output_proj)\.weight', 'blocks/{0}/{1}/kernel',
       'linear'),
      (blk + r'(self_attn|cross_attn)\.(q_norm|k_norm)\.weight', 'blocks/{0}/{1}/scale', 'vector'),
      (blk + r'adaln_modulation_(self_attn|cross_attn|mlp)\.([12])\.weight',
       'blocks/adaln_modulation_{0}/linear_{1}/kernel', 'linear'),
  ]
  return rules


_COSMOS_DROP = re.compile(r'(net\.accum_.*|net\.pos_embedder\..*|.*\._extra_state)$')


def _match(key, rules):
  """Source key -> (path tuple, block index or None, kind), or None when no rule matches."""
  for pattern, template, kind in rules:
    m = re.fullmatch(pattern, key)
    if m is None:
      continue
    groups = m.groups()
    if template.startswith('blocks/'):
      return tuple(template.format(*groups[1:]).split('/')), int(groups[0]), kind
    return tuple(template.format(*groups).split('/')), None, kind
  return None


def abstract_params(config):
  """{path tuple: ShapeDtypeStruct-like} of the model's nnx.Param leaves, without allocating."""
  abstract = nnx.eval_shape(lambda: CosmosDiT(config, rngs=nnx.Rngs(0)))
  return abstract, checked_state.param_specs(abstract)


def _to_kernel(value, kind):
  value = np.asarray(value)
  return value.T if kind == 'linear' else value


def _convert(state_dict, config, rules, drop=None):
  """Shared driver: maps, stacks, validates; returns an nnx.State of Params (host numpy values)."""
  abstract, expected = abstract_params(config)
  num_blocks = config.num_blocks
  flat, stacks, sources = {}, {}, {}
  unexpected, misshaped = [], []
  for key, value in state_dict.items():
    if drop is not None and drop.fullmatch(key):
      continue
    hit = _match(key, rules)
    if hit is None or hit[0] not in expected or (hit[1] is not None and hit[1] >= num_blocks):
      unexpected.append(key)
      continue
    path, idx, kind = hit
    arr = _to_kernel(value, kind)
    want = expected[path].shape[1:] if idx is not None else expected[path].shape
    if tuple(arr.shape) != tuple(want):
      misshaped.append(f'{key}: got {tuple(np.shape(value))}, want {tuple(want)} after '
                       f'{"transpose" if kind == "linear" else "copy"} (-> {"/".join(path)})')
      continue
    if idx is None:
      flat[path] = arr
    else:
      stacks.setdefault(path, {})[idx] = arr
    sources.setdefault(path, []).append(key)
  missing = []
  for path, spec in expected.items():
    if path[0] == 'blocks':
      have = stacks.get(path, {})
      lacking = [i for i in range(num_blocks) if i not in have]
      if lacking:
        missing.append(f'{"/".join(path)} for blocks {lacking}')
      else:
        flat[path] = np.stack([have[i] for i in range(num_blocks)])
    elif path not in flat:
      missing.append('/'.join(path))
  return checked_state.fill_params(abstract, expected, flat, name='CosmosDiT(config)', missing=missing,
                                   unexpected=unexpected, misshaped=misshaped)


def convert_diffusers_state_dict(state_dict, config):
  """diffusers `CosmosTransformer3DModel.state_dict()` (numpy values) -> nnx.State of the Params.

  The diffusers model must be the 2.5 variant: in_channels = config.in_channels + 1 (cond mask),
  concat_padding_mask, use_crossattn_projection iff config.crossattn_in, extra_pos_embed_type=None.
  """
  return _convert(state_dict, config, _diffusers_rules())


def convert_cosmos_state_dict(state_dict, config):
  """Original Cosmos-Predict2.5 checkpoint (`net.`-prefixed, numpy values) -> nnx.State of the Params.

  Buffers and bookkeeping entries (`net.accum_*`, `net.pos_embedder.*`, `*._extra_state`) are dropped.
  """
  return _convert(state_dict, config, _cosmos_rules(), drop=_COSMOS_DROP)


def merge_params(config, state):
  """Builds a CosmosDiT from a converted state without random initialisation of real weights."""
  abstract = nnx.eval_shape(lambda: CosmosDiT(config, rngs=nnx.Rngs(0)))
  graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
  return nnx.merge(graphdef, state, rest)


# ------------------------------------------------------------------------------ NNX -> diffusers
def _fill(pattern, values):
  """A rule's source regex with its capture groups replaced by `values` in order, unescaped: the key."""
  out, i, k = [], 0, 0
  while i < len(pattern):
    c = pattern[i]
    if c == '\\':
      out.append(pattern[i + 1])
      i += 2
    elif c == '(':
      depth, j = 1, i + 1
      while depth:
        if pattern[j] == '\\':
          j += 2
          continue
        depth += {'(': 1, ')': -1}.get(pattern[j], 0)
        j += 1
      out.append(str(values[k]))
      k += 1
      i = j
    else:
      out.append(c)
      i += 1
  return ''.join(out)


def _inverse_rules(rules):
  """[(regex over our '/'-joined path, source pattern, kind, per-block)] of (regex, template, kind) rules."""
  out = []
  for pattern, template, kind in rules:
    path_re = re.sub(r'\\\{\d\\\}', '([^/]+)', re.escape(template))
    out.append((re.compile(path_re), pattern, kind, template.startswith('blocks/')))
  return out


def diffusers_names(path, num_blocks):
  """diffusers `CosmosTransformer3DModel` keys of one NNX leaf path ('blocks/self_attn/q_proj/kernel'):
  one per block for stacked leaves, else one; and the leaf's kind ('linear': transpose). ValueError
  when no rule maps it."""
  for path_re, pattern, kind, block in _inverse_rules(_diffusers_rules()):
    m = path_re.fullmatch(path)
    if m:
      if block:
        return [_fill(pattern, (i, *m.groups())) for i in range(num_blocks)], kind
      return [_fill(pattern, m.groups())], kind
  raise ValueError(f'{path}: no diffusers name for this parameter')


def to_diffusers_state_dict(flat, num_blocks):
  """{'/'-joined NNX path: array} of a CosmosDiT's Params -> diffusers state dict (numpy, torch layout:
  Linear weights [out, in], per-block tensors unstacked). The inverse of `convert_diffusers_state_dict`."""
  out = {}
  for path, value in flat.items():
    names, kind = diffusers_names(path, num_blocks)
    value = np.asarray(value)
    parts = [value[i] for i in range(num_blocks)] if len(names) > 1 or path.startswith('blocks/') else [value]
    for name, part in zip(names, parts):
      out[name] = np.ascontiguousarray(part.T if kind == 'linear' else part)
  return out
