"""Wan2.1: the video VAE (`vae`), the text-to-video DiT (`transformer`), UMT5 conditioning (`text`), their
converters and the model family."""
