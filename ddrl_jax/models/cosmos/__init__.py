"""Cosmos-Predict2.5: the video DiT, its one-frame text-to-image wrapper, the converters and the families."""
