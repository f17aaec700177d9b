"""Wan2.1: the VAE and the text-to-video DiT."""
