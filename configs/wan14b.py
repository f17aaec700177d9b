"""Wan2.1-T2V-14B text rendering in video (task prompt_task, model family wan): FlowGRPO's
`general_ocr_wan2_1` recipe with the 14B model (the config's commented-out `Wan2.1-T2V-14B-Diffusers`).

    python -m ddrl_jax.train --config=configs/wan14b.py:flow_grpo --workdir=...

Presets ddrl, flow_grpo (the default), dance_grpo, each with a _smoke variant: configs/wan_common.py
(values, sources and meshes: v5p-64 = data 4 x fsdp 8; 4 nodes x 8 H100).
"""
from configs import wan_common

PRESETS = wan_common.PRESETS


def get_config(arg='flow_grpo'):
  return wan_common.get_config('wan14b', arg)
