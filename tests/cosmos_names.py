"""Test helpers for the diffusers Cosmos-2.5 transformer: random weights and original `net.` names."""
import math

import torch


def randomize_cosmos_torch(model):
  """Gives a diffusers CosmosTransformer3DModel O(1) random weights (matrices ~1/sqrt(fan-in), norm
  scales near 1, small biases) and the original Cosmos qk-norm eps 1e-6 (diffusers defaults to 1e-5)."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 2:
        p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
      elif name.endswith('bias'):
        p.copy_(0.1 * torch.randn_like(p))
      else:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
  for m in model.modules():
    if m.__class__.__name__ == 'RMSNorm' and hasattr(m, 'eps'):
      m.eps = 1e-6
  return model


def to_cosmos_name(key):
  """diffusers name -> original `net.` name (inverse of diffusers' rename table, arch notes section 4)."""
  simple = {'patch_embed.proj.weight': 'x_embedder.proj.1.weight',
            'time_embed.t_embedder.linear_1.weight': 't_embedder.1.linear_1.weight',
            'time_embed.t_embedder.linear_2.weight': 't_embedder.1.linear_2.weight',
            'time_embed.norm.weight': 't_embedding_norm.weight',
            'norm_out.linear_1.weight': 'final_layer.adaln_modulation.1.weight',
            'norm_out.linear_2.weight': 'final_layer.adaln_modulation.2.weight',
            'proj_out.weight': 'final_layer.linear.weight'}
  if key in simple:
    return 'net.' + simple[key]
  for a, b in [('transformer_blocks', 'blocks'), ('attn1', 'self_attn'), ('attn2', 'cross_attn'),
               ('to_q', 'q_proj'), ('to_k', 'k_proj'), ('to_v', 'v_proj'), ('to_out.0', 'output_proj'),
               ('norm_q', 'q_norm'), ('norm_k', 'k_norm'), ('ff.net.0.proj', 'mlp.layer1'),
               ('ff.net.2', 'mlp.layer2'), ('norm1.linear_', 'adaln_modulation_self_attn.'),
               ('norm2.linear_', 'adaln_modulation_cross_attn.'), ('norm3.linear_', 'adaln_modulation_mlp.')]:
    key = key.replace(a, b)
  return 'net.' + key
