"""Stable Diffusion 3 / 3.5 in Flax NNX: the MMDiT (`mmdit`) and its diffusers weight converter (`convert`)."""
