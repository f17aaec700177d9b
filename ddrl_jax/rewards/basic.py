"""Rewards without a model: linear (toy task), temporal smoothness (video), mean intensity."""
import numpy as np


class LinearReward:
  """r(x) = w . x on raw (M, D) float samples (the toy task's reward)."""

  def __init__(self, w):
    self.w = np.asarray(w, np.float32)

  def __call__(self, samples, prompts):
    del prompts
    samples = np.asarray(samples, np.float32)
    if samples.ndim != 2 or samples.shape[1] != self.w.shape[0]:
      raise ValueError(f'linear reward: samples {samples.shape} do not match w {self.w.shape}')
    return samples @ self.w


class TemporalSmoothness:
  """r = -mean |frame_{k+1} - frame_k| / 255 on (M, F, H, W, C) uint8 videos: 0 for a static video."""

  def __call__(self, samples, prompts):
    del prompts
    if samples.ndim != 5:
      raise ValueError(f'temporal_smoothness needs (M, F, H, W, C) videos, got {samples.shape}')
    v = samples.astype(np.float32) / 255.0
    return -np.abs(np.diff(v, axis=1)).mean(axis=(1, 2, 3, 4))


class MeanIntensity:
  """r = mean pixel value / 255 of uint8 images or videos (a cheap, monotone reward for checks)."""

  def __call__(self, samples, prompts):
    del prompts
    return samples.reshape(samples.shape[0], -1).astype(np.float32).mean(-1) / 255.0
