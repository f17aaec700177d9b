"""Parameter counts and analytic forward FLOPs of the Cosmos-Predict2.5 DiTs (cosmos2b, cosmos14b).

  cd /work/main && PYTHONPATH=. python benchmarks/cosmos_size.py

Parameters: counted from `nnx.eval_shape` of `models.cosmos_dit.CosmosDiT` (no memory allocated) and
compared with the published sizes (Cosmos-Predict2.5-2B / -14B; the reference notes' estimates are
2.059e9 / 14.37e9, cosmos_predict25_architecture.md section 1.1).

FLOPs: one forward of one sample at 93 frames x 1280x720 (latent 16x24x90x160, patch 1x2x2 ->
S = 24*45*80 = 86400 tokens) with L = 512 text tokens; FLOPs = 2 x multiply-accumulates:
  per block, per token: self-attn q,k,v,o 4 D^2, cross-attn q,o 2 D^2, MLP 2 * 4 D^2 (MACs);
  per block, per sample: cross-attn k,v over L tokens 2 L C_ctx D, self-attention scores and values
  2 S^2 D (= 4 S^2 D FLOPs), cross-attention 2 S L D;
  plus the patch embed (72 D per token), final layer (D * 64 per token), adaLN-LoRA modulations (per
  latent frame) and crossattn_proj (L * 100352 * 1024).
Prints one JSON line per model and writes nothing else.
"""
import json
import math

import flax.nnx as nnx
import jax

from ddrl_jax.models.cosmos import dit as cosmos_dit
from ddrl_jax.models.cosmos.dit import forward_flops

PUBLISHED = {'cosmos2b': 2.0e9, 'cosmos14b': 14.0e9}
REFERENCE_ESTIMATE = {'cosmos2b': 2.059e9, 'cosmos14b': 14.37e9}
LATENT = (24, 90, 160)     # 93 frames at 720p
TEXT_TOKENS = 512


def param_count(cfg):
  model = nnx.eval_shape(lambda: cosmos_dit.CosmosDiT(cfg, rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
  blocks = sum(math.prod(x.shape) for x in jax.tree.leaves(state['blocks']))
  proj = sum(math.prod(x.shape) for x in jax.tree.leaves(state['crossattn_proj'])) \
      if 'crossattn_proj' in state else 0
  return total, blocks, proj


def main():
  for name, make in (('cosmos2b', cosmos_dit.cosmos2b), ('cosmos14b', cosmos_dit.cosmos14b)):
    cfg = make()
    total, blocks, proj = param_count(cfg)
    tokens, parts = forward_flops(cfg)
    fwd = sum(parts.values())
    print(json.dumps(dict(
        model=name, params=total, params_blocks=blocks, params_per_block=blocks // cfg.num_blocks,
        params_crossattn_proj=proj, published_params=PUBLISHED[name],
        reference_estimate=REFERENCE_ESTIMATE[name],
        ratio_to_reference=round(total / REFERENCE_ESTIMATE[name], 4),
        latent=list(LATENT), tokens=tokens, text_tokens=TEXT_TOKENS,
        fwd_flops=fwd, fwd_pflops=round(fwd / 1e15, 4),
        fwd_pflops_parts={k: round(v / 1e15, 4) for k, v in parts.items()},
        train_step_pflops_per_sample_3x=round(3 * fwd / 1e15, 3))))


if __name__ == '__main__':
  main()
