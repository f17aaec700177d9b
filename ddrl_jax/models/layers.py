"""Layers every model family shares: the dense layer (with optional LoRA adapters) and its helper.

`Dense` is the one linear layer of ddrl_jax's models. It is `nnx.Linear` (same parameters `kernel` (din,
dout) and `bias` (dout,), same result) applied to (..., din) as one (prod(...), din) matrix, and it
carries the low-rank adapters that `ddrl_jax.models.lora.attach` gives it: `lora_a` (din, r) and
`lora_b` (r, dout), `nnx.LoRAParam`s, added as y + (alpha / r) (x A) B (peft's form, x A B with A = peft's
lora_A^T). Adapters are created after the model is built (`lora.attach`), so stacked, scanned blocks get
stacked adapters too, and a model without them has exactly the parameters it always had.
"""
import jax.numpy as jnp
from flax import nnx

from ddrl_jax.parallel.plan import tokens_mergeable


class Dense(nnx.Linear):
  """nnx.Linear applied to (..., din) as one (prod(...), din) matrix: (..., din) -> (..., dout), plus
  LoRA adapters when `lora.attach` gave it some.

  Flattening the leading axes first makes the kernel's gradient a single-axis contraction x^T dy;
  contracting several leading axes at once made XLA:CPU transpose both operands (and re-run the fused
  producers) before the matmul: the DiT's forward+backward at width 128 went from 0.81 s to 0.48 s
  (benchmarks/RESULTS.md, issue 13). Under a plan that splits the tokens (context parallelism,
  `parallel.plan.tokens_mergeable`) the layer runs unflattened.
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.lora_a = nnx.data(None)        # (din, r) nnx.LoRAParam, set by lora.attach
    self.lora_b = nnx.data(None)        # (r, dout)
    self.lora_scale = 0.0               # alpha / r

  def _apply(self, x):
    y = super().__call__(x)
    if self.lora_a is None:
      return y
    dtype = y.dtype
    low = jnp.dot(x.astype(dtype), self.lora_a[...].astype(dtype))
    return y + (self.lora_scale * jnp.dot(low, self.lora_b[...].astype(dtype))).astype(dtype)

  def __call__(self, x):
    if x.ndim <= 2 or not tokens_mergeable():   # context-parallel plans keep the token axes
      return self._apply(x)
    lead = x.shape[:-1]
    y = self._apply(x.reshape(-1, x.shape[-1]))
    return y.reshape(lead + y.shape[-1:])


def dense(din, dout, names, rngs, *, dtype, param_dtype, bias=False):
  """A Dense layer whose kernel (din, dout) and bias (dout,) carry logical axis `names`."""
  return Dense(
      din, dout, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names, eager_sharding=False),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), names[1:], eager_sharding=False))
