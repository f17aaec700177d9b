"""Stable Diffusion 3.5: the MMDiT (`mmdit`), its VAE (`vae`), their diffusers converters."""
