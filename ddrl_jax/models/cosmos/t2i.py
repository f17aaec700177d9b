"""The Cosmos DiT as a single-frame text-to-image model with its own trainable byte-level text encoder.

    model = CosmosT2I(T2IConfig(dit=cosmos_dit.tiny(in_channels=3, patch=(1, 8, 8), ...),
                                text_length=8), rngs=nnx.Rngs(0))
    v = model(x_t, t, ids)      # x_t (B, C, H, W), t (B,), ids (B, text_length) int32 -> (B, C, H, W)

Images are one-frame videos (T = 1) of the Cosmos DiT (models/cosmos_dit.py), in pixel space or any
latent space with `dit.in_channels` channels. The text is a string's UTF-8 bytes (models/text.py
`encode_bytes`) through a learned `ByteEmbedding` of width `dit.crossattn_in`, then the DiT's own
cross-attention projection: character-level cross-attention, small enough to train on a CPU. Byte id 0
everywhere is the null condition (models/text.py pads with PAD_BYTE, so real prompts never are).
"""
import dataclasses

import flax.nnx as nnx
import jax.numpy as jnp

from ddrl_jax.models.cosmos import dit as cosmos_dit
from ddrl_jax.models import text as text_lib


@dataclasses.dataclass(frozen=True)
class T2IConfig:
  dit: cosmos_dit.CosmosDiTConfig
  text_length: int = 8
  text_init_std: float = 1.0      # O(1) context from the first step (see text.ByteEmbedding)


class CosmosT2I(nnx.Module):
  """Byte embedding -> Cosmos DiT on (B, C, 1, H, W); see the module docstring."""

  def __init__(self, config, *, rngs):
    if config.dit.crossattn_in is None:
      raise ValueError('CosmosT2I needs dit.crossattn_in (the byte-embedding width)')
    self.config = config
    self.text = text_lib.ByteEmbedding(config.dit.crossattn_in, config.text_length, rngs=rngs,
                                       init_std=config.text_init_std)
    self.dit = cosmos_dit.CosmosDiT(config.dit, rngs=rngs)

  def __call__(self, x, t, ids):
    """x (B, C, H, W), t (B,) in [0, 1], ids (B, text_length) int32 -> velocity (B, C, H, W)."""
    b = x.shape[0]
    context = self.text(ids)
    v = self.dit(x[:, :, None], jnp.reshape(t, (b, 1)).astype(jnp.float32), context)
    return v[:, :, 0]
