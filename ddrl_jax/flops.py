"""Model FLOPs of one RL iteration, the dense peak FLOP/s of accelerator chips, and MFU.

FLOPs here are model FLOPs: 2 per multiply-accumulate of the network's matmuls and attention (the
task's `forward_flops_per_sample()`), a backward pass counted as 2 forwards, nothing for
rematerialisation (activation-checkpointing recompute is hardware work, not model work), the optimizer,
the VAE decode or the rewards. MFU = achieved model FLOP/s / (peak FLOP/s per chip x chips).

One iteration, per rollout slot (B*N slots), in network forwards of one sample:
  rollout    nfe                 the sampler's denoiser calls (T; cosmos_2ab adds its final clean call)
  policy     3 K                 forward + backward at each of the K trained steps
  reference  K                   FlowGRPO / DiffusionNFT with kl_beta > 0: the frozen reference's
             (+ K)               forward per step; DiffusionNFT adds its old policy's forward per step
  data       3 K ('full'), 3 ('first', 'random_step'), 0 without a data term (DDRL, data_beta > 0)
The data term runs on the B*N slots too: each group's clean sample is repeated over its N rollouts.
Evaluation samples are not part of an iteration.
"""
import re
from typing import NamedTuple

import jax
import numpy as np

from ddrl_jax import config as config_lib
from ddrl_jax import update as update_lib
from ddrl_jax.rl import algorithms

DTYPES = ('bfloat16', 'float16', 'tf32', 'float32')
_DTYPE_ALIASES = {'bf16': 'bfloat16', 'fp16': 'float16', 'half': 'float16', 'fp32': 'float32',
                  'f32': 'float32', 'tensorfloat32': 'tf32'}

# Dense (no structured sparsity) peak FLOP/s of one chip (one JAX device), by chip family and the dtype
# the matmul inputs are rounded to. Sources:
#   TPU v4 275 bf16: cloud.google.com/tpu/docs/v4 ("Peak compute per chip (bf16) 275 TFLOPs").
#   TPU v5e 197 bf16: cloud.google.com/tpu/docs/v5e ("Peak compute per chip (bf16) 197 TFLOPs").
#   TPU v5p 459 bf16: cloud.google.com/tpu/docs/v5p ("Peak compute per chip (bf16) 459 TFLOPs").
#   TPU v6e (Trillium) 918 bf16: cloud.google.com/tpu/docs/v6e ("Peak compute per chip (bf16) 918 TFLOPs").
#   TPUs publish no float32 matmul peak (XLA runs float32 dots as bf16 passes): none here.
#   A100 (SXM4 and PCIe, 40/80 GB): NVIDIA A100 datasheet: FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS
#     (312 / 624 with sparsity).
#   H100 SXM5: NVIDIA H100 datasheet, SXM column: FP32 67, TF32 989*, BF16/FP16 1979* TFLOPS, * = with
#     sparsity, so dense 494.5 and 989.
#   H100 PCIe: the same datasheet, PCIe column: FP32 51, TF32 756*, BF16/FP16 1513* -> dense 378, 756.
#   H200 (SXM): NVIDIA H200 datasheet, SXM column: FP32 67, TF32 989*, BF16/FP16 1979* -> as H100 SXM.
PEAK_FLOPS = {
    'tpu_v4': {'bfloat16': 275e12},
    'tpu_v5e': {'bfloat16': 197e12},
    'tpu_v5p': {'bfloat16': 459e12},
    'tpu_v6e': {'bfloat16': 918e12},
    'a100': {'bfloat16': 312e12, 'float16': 312e12, 'tf32': 156e12, 'float32': 19.5e12},
    'h100_sxm': {'bfloat16': 989e12, 'float16': 989e12, 'tf32': 494.5e12, 'float32': 67e12},
    'h100_pcie': {'bfloat16': 756e12, 'float16': 756e12, 'tf32': 378e12, 'float32': 51e12},
    'h200': {'bfloat16': 989e12, 'float16': 989e12, 'tf32': 494.5e12, 'float32': 67e12},
}

# `jax.Device.device_kind` strings (full match) -> chip family. TPU names as JAX reports them
# (jax/_src/pallas/mosaic/tpu_info.py, chip_version_from_device_kind: v5p is 'TPU v5', v5e 'TPU v5 lite',
# v6e 'TPU v6 lite'; newer libtpu may say 'TPU v5p' / 'TPU v6e'); GPU names are the CUDA device names.
# NVL variants (other clocks and power) are left unknown on purpose.
DEVICE_KINDS = (
    (r'TPU v4', 'tpu_v4'),
    (r'TPU v5 lite|TPU v5e', 'tpu_v5e'),
    (r'TPU v5|TPU v5p', 'tpu_v5p'),
    (r'TPU v6 lite|TPU v6e', 'tpu_v6e'),
    (r'NVIDIA A100([- ].*)?', 'a100'),     # A100-SXM4-80GB, A100-SXM4-40GB, A100 80GB PCIe, ...
    (r'NVIDIA H100 PCIe', 'h100_pcie'),
    (r'NVIDIA H100 80GB HBM3|NVIDIA H100 SXM5?.*', 'h100_sxm'),
    (r'NVIDIA H200', 'h200'),
)


def normalize_dtype(dtype):
  """A dtype (name, numpy/jax dtype, or alias such as 'bf16') -> one of DTYPES; ValueError otherwise."""
  name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
  name = _DTYPE_ALIASES.get(name.lower(), name.lower())
  if name not in DTYPES:
    raise ValueError(f'dtype {dtype!r}: known {DTYPES} (or aliases {sorted(_DTYPE_ALIASES)})')
  return name


def chip_family(device_kind):
  """The PEAK_FLOPS key of a `jax.Device.device_kind` string, or None (CPU, unknown chips)."""
  for pattern, family in DEVICE_KINDS:
    if re.fullmatch(pattern, device_kind.strip()):
      return family
  return None


def peak_flops(device_kind, dtype):
  """Dense peak FLOP/s of one chip for matmul inputs of `dtype`, or None when not known (CPU, an
  unknown chip, or a dtype the chip's vendor publishes no peak for, e.g. float32 on TPU)."""
  dtype = normalize_dtype(dtype)
  family = chip_family(device_kind)
  return None if family is None else PEAK_FLOPS[family].get(dtype)


def matmul_dtype(compute_dtype, platform, precision=None):
  """The PEAK_FLOPS column that float32 matmuls actually run at under `precision`.

  Non-float32 compute dtypes are returned as they are. float32 dots at JAX's default precision (None,
  'default', 'fastest') run as one bf16 pass on TPU and as TF32 on Ampere+ GPUs (docs.jax.dev,
  "Matmul precision"); 'bfloat16' / 'BF16_BF16_F32' and 'tensorfloat32' / 'TF32_TF32_F32' name those
  directly; anything else ('float32', 'highest', 'high', ...) is counted against the float32 peak.
  """
  dtype = normalize_dtype(compute_dtype)
  if dtype != 'float32':
    return dtype
  precision = None if precision is None else str(precision).lower()
  gpu = platform in ('gpu', 'cuda')
  if precision in ('bfloat16', 'bf16_bf16_f32') and (gpu or platform == 'tpu'):
    return 'bfloat16'
  if precision in (None, 'default', 'fastest', 'precision.default'):
    return 'bfloat16' if platform == 'tpu' else 'tf32' if gpu else 'float32'
  if gpu and precision in ('tensorfloat32', 'tf32_tf32_f32'):
    return 'tf32'
  return 'float32'


def devices_peak_flops(devices, compute_dtype):
  """Summed dense peak FLOP/s of `devices` (e.g. `mesh.devices.flat`) for the task's compute dtype at
  the current `jax_default_matmul_precision`; None if any chip's peak is unknown."""
  devices = list(devices)
  if not devices:
    raise ValueError('devices_peak_flops: no devices')
  precision = jax.config.jax_default_matmul_precision
  total = 0.0
  for d in devices:
    peak = peak_flops(d.device_kind, matmul_dtype(compute_dtype, d.platform, precision))
    if peak is None:
      return None
    total += peak
  return total


# -------------------------------------------------------------------------------- iteration count
class IterationPasses(NamedTuple):
  """Network forwards of one sample per rollout slot in one iteration, by part (module docstring)."""
  rollout: float
  policy: float
  reference: float
  data: float

  @property
  def total(self):
    return self.rollout + self.policy + self.reference + self.data


class IterationFlops(IterationPasses):
  """Model FLOPs of one iteration by part (all B*N slots); `total` their sum."""


def sampler_nfe(config):
  """Denoiser calls of one rollout of config's sampler: T, plus cosmos_2ab's final clean call (the
  value the rollout's `Trajectory.nfe` holds)."""
  return config.sampler.num_steps + (1 if config_lib.sampler_kind(config) == 'cosmos_2ab' else 0)


def trained_steps_per_rollout(config):
  """K: the trained steps of each rollout, as the algorithm's own `select_steps` draws them."""
  algo = algorithms.get_algorithm(config.algorithm)
  pool = config_lib.train_steps(config)
  shape = jax.eval_shape(
      lambda: algo.select_steps(jax.random.key(0), 1, 1, pool, config.rl.train_fraction)).shape
  return int(shape[-1])


def iteration_passes(config, nfe=None):
  """`IterationPasses` of config's algorithm; nfe (denoiser calls per rollout) defaults to
  `sampler_nfe(config)` (the trainer passes the rollout's measured `nfe_rollout`)."""
  algo = algorithms.get_algorithm(config.algorithm)
  k = trained_steps_per_rollout(config)
  nfe = sampler_nfe(config) if nfe is None else float(nfe)
  reference = algo.reference_passes(k, config.rl.kl_beta > 0)   # KL reference, an old policy
  data = 0
  if update_lib.uses_data_grads(config):
    data = 3 * algorithms.data_term_steps(config.rl.data_loss_steps, k)
  return IterationPasses(rollout=float(nfe), policy=3.0 * k, reference=float(reference),
                         data=float(data))


def iteration_flops(config, forward_flops_per_sample, nfe=None):
  """`IterationFlops` of one iteration: `iteration_passes` x B*N slots x the FLOPs of one forward of
  one sample (the task's `forward_flops_per_sample()`)."""
  if not forward_flops_per_sample > 0:
    raise ValueError(f'forward_flops_per_sample must be > 0, got {forward_flops_per_sample!r}')
  slots = config.batch_size * config.num_rollouts
  passes = iteration_passes(config, nfe)
  return IterationFlops(*(p * slots * float(forward_flops_per_sample) for p in passes))


def throughput_metrics(flops, seconds, peak=None):
  """{'achieved_flops_per_s', and 'mfu' when `peak` (summed peak FLOP/s) is known} of `flops` model
  FLOPs done in `seconds`; {} when seconds is not positive and finite."""
  if not (np.isfinite(seconds) and seconds > 0):
    return {}
  achieved = float(flops) / float(seconds)
  out = {'achieved_flops_per_s': achieved}
  if peak:
    out['mfu'] = achieved / float(peak)
  return out
