"""Wan2.1: the video VAE (`vae`), the text-to-video DiT (`transformer`), their converters and family."""
