"""Stable Diffusion 3.5: the MMDiT (`mmdit`), its VAE (`vae`), the CLIP-L/G + T5 conditioning (`text`),
the diffusers converters and the model family."""
