"""Test helper: diffusers Cosmos-2.5 transformer names -> original Cosmos `net.` checkpoint names."""


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
