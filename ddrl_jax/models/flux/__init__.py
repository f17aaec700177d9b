"""FLUX.1: the rectified-flow transformer (`transformer`, diffusers' FluxTransformer2DModel) and its diffusers
converter (`convert`)."""
