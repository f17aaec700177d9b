"""Rewards by name.

A reward is a callable ``reward(samples, prompts) -> (M,) float`` built by a factory from keyword
arguments:
  samples: host numpy, (M, H, W, C) uint8 images, (M, F, H, W, C) uint8 videos, or raw float samples
    for tasks without pixels (e.g. (M, 2) points of the toy task);
  prompts: list of M condition strings (the rollout group's prompt, repeated per rollout);
  returns: one score per sample; NaN marks a sample the reward could not score.

Built-in names resolve lazily to ``module:factory`` so a process that never scores OCR never imports
tesserocr or rapidocr_onnxruntime. `register` adds a factory at run time; reward workers are separate
processes, so a custom reward must live in a module listed in ``config.reward.imports`` (imported by
every worker).
"""
import importlib

import numpy as np

BUILTIN = {
    'ocr': 'ddrl_jax.rewards.ocr:OCRReward',
    'ocr_rapid': 'ddrl_jax.rewards.ocr:RapidOCRReward',   # the same score read by RapidOCR (PP-OCRv4)
    'videoalign': 'ddrl_jax.rewards.videoalign:VideoAlignReward',   # VQ/MQ/TA of VideoReward (torch)
    # VBench (torch): the mean of its five quality dimensions (DDRL's VBench reward), or one of them.
    'vbench': 'ddrl_jax.rewards.vbench:VBenchReward',
    'vbench_subject_consistency': 'ddrl_jax.rewards.vbench:SubjectConsistency',
    'vbench_background_consistency': 'ddrl_jax.rewards.vbench:BackgroundConsistency',
    'vbench_motion_smoothness': 'ddrl_jax.rewards.vbench:MotionSmoothness',
    'vbench_aesthetic_quality': 'ddrl_jax.rewards.vbench:AestheticQuality',
    'vbench_imaging_quality': 'ddrl_jax.rewards.vbench:ImagingQuality',
    'cosmos_reason1': 'ddrl_jax.rewards.cosmos_reason1:CosmosReason1Reward',  # Reason1 P("No") (torch)
    # CLIP-class image rewards (torch), at the scales of the references the paper and the field use.
    'pickscore': 'ddrl_jax.rewards.clip_rewards:PickScore',              # PickScore_v1 / 26
    'clipscore': 'ddrl_jax.rewards.clip_rewards:CLIPScore',              # CLIP L/14 cosine (DDRL Table 4)
    'clipscore_flowgrpo': 'ddrl_jax.rewards.clip_rewards:CLIPScoreFlowGRPO',  # the same logits / 30
    'laion_aesthetic': 'ddrl_jax.rewards.clip_rewards:LAIONAesthetic',   # LAION aesthetic v2 MLP on CLIP L/14
    'hpsv21': 'ddrl_jax.rewards.hps:HPSv21',      # HPSv2.1 (open_clip ViT-H-14 fine-tune): image . text cosine
    'imagereward': 'ddrl_jax.rewards.imagereward:ImageReward',   # BLIP ViT-L + BERT cross-attention, z-scored
    # The CLIP-class rewards in JAX (Flax NNX, on JAX devices; parity with the torch ones above).
    'pickscore_jax': 'ddrl_jax.rewards.clip_jax:PickScoreJax',
    'clipscore_jax': 'ddrl_jax.rewards.clip_jax:CLIPScoreJax',
    'clipscore_flowgrpo_jax': 'ddrl_jax.rewards.clip_jax:CLIPScoreFlowGRPOJax',
    'laion_aesthetic_jax': 'ddrl_jax.rewards.clip_jax:LAIONAestheticJax',
    'hpsv21_jax': 'ddrl_jax.rewards.hps_jax:HPSv21Jax',   # hpsv21's checkpoint on clip_jax's NNX CLIP
    # UnifiedReward-7b-v1.5 behind an OpenAI-compatible server (sglang / vLLM): Final Score / 5.
    'unified_reward': 'ddrl_jax.rewards.unified_reward:UnifiedReward',
    # GenEval's rules on a detector's output (partial credit for training; correct / strict for evaluation).
    'geneval': 'ddrl_jax.rewards.geneval:GenEvalReward',
    'geneval_correct': 'ddrl_jax.rewards.geneval:GenEvalCorrect',
    'geneval_strict': 'ddrl_jax.rewards.geneval:GenEvalStrictCorrect',
    'linear': 'ddrl_jax.rewards.basic:LinearReward',
    'temporal_smoothness': 'ddrl_jax.rewards.basic:TemporalSmoothness',
    'mean_intensity': 'ddrl_jax.rewards.basic:MeanIntensity',
    # Fault injection for the service's own tests and for checking a deployment (see debug.py).
    'debug_sleep': 'ddrl_jax.rewards.debug:Sleep',
    'debug_crash': 'ddrl_jax.rewards.debug:Crash',
    'debug_garbage': 'ddrl_jax.rewards.debug:Garbage',
    'debug_gate': 'ddrl_jax.rewards.debug:Gate',
}

# Rewards that run JAX on the trainer's own devices: built in the trainer's process (config.reward.workers
# = 0, the local backend), given a mesh of this process's devices (`mesh=`, batch over its 'data' axis).
IN_PROCESS = ('pickscore_jax', 'clipscore_jax', 'clipscore_flowgrpo_jax', 'laion_aesthetic_jax', 'hpsv21_jax')

# What each reward with files needs, checked before a run builds anything (ddrl_jax.preflight):
# module:function(kwargs) -> list of one-line problems.
INPUT_CHECKS = {
    'videoalign': 'ddrl_jax.rewards.videoalign:input_problems',
    'vbench': 'ddrl_jax.rewards.vbench:input_problems',
    'cosmos_reason1': 'ddrl_jax.rewards.cosmos_reason1:input_problems',
    'pickscore': 'ddrl_jax.rewards.clip_rewards:pickscore_input_problems',
    'clipscore': 'ddrl_jax.rewards.clip_rewards:clipscore_input_problems',
    'clipscore_flowgrpo': 'ddrl_jax.rewards.clip_rewards:clipscore_flowgrpo_input_problems',
    'laion_aesthetic': 'ddrl_jax.rewards.clip_rewards:aesthetic_input_problems',
    'hpsv21': 'ddrl_jax.rewards.hps:input_problems',
    'imagereward': 'ddrl_jax.rewards.imagereward:input_problems',
    'pickscore_jax': 'ddrl_jax.rewards.clip_jax:pickscore_jax_input_problems',
    'clipscore_jax': 'ddrl_jax.rewards.clip_jax:clipscore_jax_input_problems',
    'clipscore_flowgrpo_jax': 'ddrl_jax.rewards.clip_jax:clipscore_flowgrpo_jax_input_problems',
    'laion_aesthetic_jax': 'ddrl_jax.rewards.clip_jax:aesthetic_jax_input_problems',
    'hpsv21_jax': 'ddrl_jax.rewards.hps_jax:input_problems',
    'unified_reward': 'ddrl_jax.rewards.unified_reward:input_problems',
    'geneval': 'ddrl_jax.rewards.geneval:input_problems',
    'geneval_correct': 'ddrl_jax.rewards.geneval:input_problems',
    'geneval_strict': 'ddrl_jax.rewards.geneval:input_problems',
}

# The range a valid score of each reward lies in, at the scale of the reference the wrapper reproduces;
# a value outside it is a failure ('out_of_range'), never a score. Rewards not listed: |r| <= DEFAULT_BOUND.
# config.reward.bounds overrides them by name, e.g. {'linear': (-10.0, 10.0)}.
DEFAULT_BOUND = 1e6
SCORE_BOUNDS = {
    'ocr': (0.0, 1.0), 'ocr_rapid': (0.0, 1.0),             # 1 - normalized edit distance
    'videoalign': (-100.0, 100.0),                          # z-scores (their mean, sum or one of them)
    'vbench': (-1.0, 1.0), 'vbench_subject_consistency': (-1.0, 1.0),     # mean cosine similarities
    'vbench_background_consistency': (-1.0, 1.0), 'vbench_motion_smoothness': (0.0, 1.0),
    'vbench_aesthetic_quality': (0.0, 1.0), 'vbench_imaging_quality': (0.0, 1.0),   # /10 and /100
    'cosmos_reason1': (0.0, 1.0),                           # a probability
    'temporal_smoothness': (-1.0, 0.0), 'mean_intensity': (0.0, 1.0),
    'pickscore': (-100 / 26, 100 / 26),                     # exp(logit_scale) <= 100 times a cosine, / 26
    'clipscore': (-1.0, 1.0), 'clipscore_flowgrpo': (-100 / 30, 100 / 30),
    'laion_aesthetic': (-10.0, 20.0),                       # a 1-10 rating scale, with margin (heuristic)
    'hpsv21': (-1.0, 1.0),                                  # a cosine (no logit scale)
    'imagereward': (-10.0, 10.0),                           # z-scored, typically within [-3, 3] (heuristic)
    'pickscore_jax': (-100 / 26, 100 / 26), 'clipscore_jax': (-1.0, 1.0),
    'clipscore_flowgrpo_jax': (-100 / 30, 100 / 30), 'laion_aesthetic_jax': (-10.0, 20.0),
    'hpsv21_jax': (-1.0, 1.0),
    'unified_reward': (0.2, 1.0),                           # Final Score 1-5, / 5
    'geneval': (-14.0, 1.0),                                # mean of count terms, down to 1 - 15 / 1
    'geneval_correct': (0.0, 1.0), 'geneval_strict': (0.0, 1.0),
}

_REGISTERED = {}


def register(name):
  """Decorator: ``@register('my_reward')`` on a factory (class or function) taking keyword arguments."""
  def wrap(factory):
    if name in BUILTIN or name in _REGISTERED:
      raise ValueError(f'reward {name!r} is already registered')
    _REGISTERED[name] = factory
    return factory
  return wrap


def known_rewards():
  return sorted(set(BUILTIN) | set(_REGISTERED))


def get_factory(name):
  if name in _REGISTERED:
    return _REGISTERED[name]
  if name not in BUILTIN:
    raise ValueError(f'unknown reward {name!r}; known: {known_rewards()} (custom rewards: register '
                     f'them in a module listed in config.reward.imports)')
  module, attr = BUILTIN[name].split(':')
  return getattr(importlib.import_module(module), attr)


def make_reward(name, **kwargs):
  """The reward callable `name` built with `kwargs`."""
  return get_factory(name)(**kwargs)


def import_modules(modules):
  """Imports user modules that register rewards (run in the trainer and in every worker)."""
  for m in modules:
    importlib.import_module(m)


def input_problems(name, kwargs):
  """One-line problems with the files reward `name` needs under `kwargs` ([] when it needs none or they
  are there); nothing is loaded."""
  kwargs = dict(kwargs or {})
  if name.startswith('vbench_') and name in BUILTIN:
    kwargs['dimensions'] = (name[len('vbench_'):],)
    name = 'vbench'
  if name not in INPUT_CHECKS:
    return []
  module, attr = INPUT_CHECKS[name].split(':')
  return getattr(importlib.import_module(module), attr)(kwargs)


def score_bound(name, overrides=None):
  """(low, high) of a valid score of reward `name` (SCORE_BOUNDS, `overrides` first)."""
  if overrides and name in overrides:
    low, high = overrides[name]
    return float(low), float(high)
  return SCORE_BOUNDS.get(name, (-DEFAULT_BOUND, DEFAULT_BOUND))


def judge_columns(judges, images, prompts):
  """{'judge/<name>': mean score, 'judge/<name>_failed': NaN count} of registered rewards used as
  evaluation judges (the paper's Table 4 scores OCR samples with ClipScore, PickScore, ImageReward)."""
  out = {}
  for name, judge in (judges or {}).items():
    values = np.asarray(judge(np.asarray(images), list(prompts)), np.float64)
    ok = np.isfinite(values)
    out[f'judge/{name}'] = float(values[ok].mean()) if ok.any() else float('nan')
    out[f'judge/{name}_failed'] = int((~ok).sum())
  return out
