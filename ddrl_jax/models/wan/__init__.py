"""Wan2.1: the video VAE (and its converters); the text-to-video DiT joins as a model family."""
