"""Wan2.1-T2V-1.3B text rendering in video (task prompt_task, model family wan): FlowGRPO's `general_ocr_wan2_1` model.

    python -m ddrl_jax.train --config=configs/wan1_3b.py:flow_grpo --workdir=...
    python -m ddrl_jax.train --config=configs/wan1_3b.py:flow_grpo_smoke --workdir=/tmp/wan_smoke

Presets ddrl, flow_grpo (the default), dance_grpo, each with a _smoke variant: configs/wan_common.py
(values, sources and meshes: v5p-32 = data 4 x fsdp 4; 2 nodes x 8 H100).
"""
from configs import wan_common

PRESETS = wan_common.PRESETS


def get_config(arg='flow_grpo'):
  return wan_common.get_config('wan1_3b', arg)
