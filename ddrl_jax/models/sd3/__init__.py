"""Stable Diffusion 3.5: the MMDiT, its VAE, conditioning."""
