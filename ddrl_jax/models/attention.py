"""Local attention kernels: one device's view of full (non-causal, unmasked) multi-head attention.

Shapes: B batch, S query tokens, L key/value tokens, N heads, Hd head dim. Every kernel maps
q (B, S, N, Hd), k and v (B, L, N, Hd) to (B, S, N, Hd) in q's dtype, with softmax scale 1/sqrt(Hd) and
the softmax accumulated in float32.

Kernels ('xla', 'cudnn', 'splash'):
  xla: `jax.nn.dot_product_attention(implementation='xla')`, materializes the (S, L) logits; any platform.
  cudnn: cuDNN flash attention through `jax.nn.dot_product_attention(implementation='cudnn')`; GPU only
    (JAX raises 'cuDNN is not detected' elsewhere). Not exercised by the tests, which run on CPU.
  splash: the Pallas TPU splash-attention kernel (blockwise, never holds an (S, L) buffer); TPU, or any
    platform with `interpret=True` (Pallas interpret mode, slow, for tests).
Sequences shorter than `min_flash_len` always take 'xla' (maxdiffusion's flash_min_seq_length): e.g. the
512-token text cross-attention is cheap and too short to tile well.

Every call runs under a named scope `attention_kernel.<label>` (label: the kernel, or 'xla_short' for the
short-sequence fallback), so a lowered program says which kernels it really contains (`program_kernels`):
`ddrl_jax.aot` records them per compiled function and refuses a program whose long-sequence attention is
not the kernel its family names for the target.

Context parallelism (Ulysses / ring) over these kernels lives in `ddrl_jax.parallel.context`.
"""
import contextlib
import dataclasses
import math
import re
import threading

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

KERNELS = ('xla', 'cudnn', 'splash')
_AUTO = ('', 'auto')
_LANES = 128   # splash's block sizes must be multiples of the TPU lane width


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Which local attention kernel to use and how to tile it (frozen, so hashable and jit-static).

  kernel: one of KERNELS, or '' / 'auto' for the platform default (`default_kernel`).
  block_q: splash query block (tokens); clipped to the padded query length for short sequences.
  block_kv: splash key/value block held in VMEM (tokens); clipped like block_q.
  block_kv_compute: splash inner key/value step within block_kv (tokens); must divide block_kv.
  min_flash_len: when min(S, L) is below this the 'xla' kernel is used whatever `kernel` says.
  interpret: run the splash kernel in Pallas interpret mode (works on CPU; for tests only).
  """
  kernel: str = 'xla'
  block_q: int = 512
  block_kv: int = 512
  block_kv_compute: int = 512
  min_flash_len: int = 4096
  interpret: bool = False

  def __post_init__(self):
    if self.kernel not in _AUTO:
      resolve(self.kernel, 'cpu')


def default_kernel(platform):
  """The kernel for a JAX platform name: 'splash' on TPU, 'cudnn' on GPU, 'xla' otherwise."""
  if platform == 'tpu':
    return 'splash'
  if platform in ('gpu', 'cuda'):
    return 'cudnn'
  return 'xla'


def resolve(config_kernel, platform):
  """The kernel name to run: `config_kernel`, or the platform default when it is '' or 'auto'."""
  if config_kernel in _AUTO:
    return default_kernel(platform)
  if config_kernel not in KERNELS:
    raise ValueError(f'unknown attention kernel {config_kernel!r}; expected one of {KERNELS} '
                     f"(or '' / 'auto' for the platform default)")
  return config_kernel


_target = threading.local()


@contextlib.contextmanager
def target_platform(platform):
  """Resolves '' / 'auto' kernels for `platform` instead of this process's backend while tracing (an
  ahead-of-time compile for a TPU slice on a CPU host picks the kernel a run on the slice would)."""
  old = getattr(_target, 'platform', None)
  _target.platform = platform
  try:
    yield
  finally:
    _target.platform = old


def current_platform():
  """The platform '' / 'auto' kernels resolve for: `target_platform`'s, else jax.default_backend()."""
  return getattr(_target, 'platform', None) or jax.default_backend()


def _label_for(q, k, cfg):
  """The kernel `attend` runs for these shapes as a scope label: cfg's (resolved), or 'xla_short' when
  the sequences are shorter than min_flash_len."""
  kernel = resolve(cfg.kernel, current_platform())
  if min(q.shape[1], k.shape[1]) < cfg.min_flash_len:
    return 'xla' + _SHORT
  return kernel


_SCOPE = 'attention_kernel.'
_SHORT = '_short'
_SCOPE_RE = re.compile(re.escape(_SCOPE) + r'(xla_short|xla|cudnn|splash)\b')
# What each kernel lowers to on its own platform (interpret-mode splash lowers to plain HLO instead).
_KERNEL_OPS = {'splash': ('tpu', 'tpu_custom_call'), 'cudnn': ('gpu', '__cudnn$fmha')}


def program_kernels(module_text):
  """Sorted attention-kernel labels in a lowered program: `lowered.as_text(debug_info=True)` (the scope
  names live in its locations). Labels: 'xla', 'cudnn', 'splash', and 'xla_short' for attention that fell
  back to 'xla' below min_flash_len."""
  return sorted(set(_SCOPE_RE.findall(module_text)))


def check_program(module_text, expected, platform):
  """Problems (strings; empty when none) of a program lowered for `platform` whose long-sequence
  attention should run `expected` (a KERNELS name, or None for a network without attention): a
  long-sequence label other than `expected`, or, on the kernel's own platform, a kernel label without the
  operation that kernel lowers to (splash without a Pallas `tpu_custom_call`, cuDNN without a
  `__cudnn$fmha` call)."""
  problems = []
  labels = program_kernels(module_text)
  wrong = [k for k in labels if not k.endswith(_SHORT) and k != expected]
  if wrong:
    problems.append(f'long-sequence attention runs {wrong} where the family names {expected!r} for '
                    f'{platform}')
  for kernel, (kernel_platform, op) in _KERNEL_OPS.items():
    on_its_platform = platform == kernel_platform or (kernel_platform == 'gpu' and platform == 'cuda')
    if kernel in labels and on_its_platform and op not in module_text:
      problems.append(f'{kernel!r} is scoped but the program has no {op} call')
  return problems


def attend(q, k, v, cfg):
  """Full attention softmax(q k^T / sqrt(Hd)) v: q (B, S, N, Hd), k, v (B, L, N, Hd) -> (B, S, N, Hd)."""
  label = _label_for(q, k, cfg)
  kernel = label.removesuffix(_SHORT)
  with jax.named_scope(_SCOPE + label):
    if kernel == 'splash':
      return _splash(q, k, v, cfg, save_residuals=False)
    # 'xla' and 'cudnn' (implementation=None would let JAX choose, which hides what actually runs).
    return jax.nn.dot_product_attention(q, k, v, implementation=kernel)


def attend_with_lse(q, k, v, cfg):
  """`attend` plus the per-query log-sum-exp of the scaled logits, for merging partial attentions.

  Returns (out (B, S, N, Hd) in q.dtype, lse (B, N, S) float32) with
  lse[b, n, s] = log sum_l exp(q[b, s, n] . k[b, l, n] / sqrt(Hd)) (natural log).
  Only the 'xla' path is differentiable (out and lse): splash refuses AD with save_residuals and the
  cuDNN path is not relied on for it; callers that need gradients (ring attention) define their own VJP.
  """
  label = _label_for(q, k, cfg)
  kernel = label.removesuffix(_SHORT)
  with jax.named_scope(_SCOPE + label):
    if kernel == 'splash':
      return _splash(q, k, v, cfg, save_residuals=True)
    if kernel == 'cudnn':
      # JAX returns cuDNN's natural-log softmax statistic as (B, S, N) in out's dtype (bf16 in, bf16 lse).
      out, lse = jax.nn.dot_product_attention(q, k, v, implementation='cudnn', return_residual=True)
      return out, jnp.transpose(lse, (0, 2, 1)).astype(jnp.float32)
    return _xla_with_lse(q, k, v)


def _xla_with_lse(q, k, v):
  """Einsum attention with a float32 log-sum-exp: -> (B, S, N, Hd) in q.dtype, (B, N, S) float32.

  Written out rather than `dot_product_attention(return_residual=True)`, whose lse is rounded to the
  input dtype.
  """
  scale = 1.0 / math.sqrt(q.shape[-1])
  logits = jnp.einsum('bsnh,blnh->bnsl', q, k, preferred_element_type=jnp.float32) * scale
  lse = jax.nn.logsumexp(logits, axis=-1)
  p = jnp.exp(logits - lse[..., None])
  out = jnp.einsum('bnsl,blnh->bsnh', p, v.astype(jnp.float32))
  return out.astype(q.dtype), lse


def _round_up(x, m):
  return -(-x // m) * m


def _splash_blocks(s, l, cfg):
  """(block_q, block_kv, block_kv_compute, padded S, padded L) for lengths s and l.

  Blocks are cfg's, clipped to the lengths rounded up to 128 so short sequences are not padded to a
  full 512 block; the lengths are then padded to a multiple of their block.
  """
  bq = min(cfg.block_q, _round_up(s, _LANES))
  bkv = min(cfg.block_kv, _round_up(l, _LANES))
  bkv_compute = math.gcd(bkv, cfg.block_kv_compute)
  return bq, bkv, bkv_compute, _round_up(s, bq), _round_up(l, bkv)


def _splash(q, k, v, cfg, *, save_residuals):
  """Splash attention on (B, S, N, Hd) / (B, L, N, Hd) tensors; with save_residuals also lse (B, N, S)."""
  b, s, n, hd = q.shape
  l = k.shape[1]
  bq, bkv, bkv_compute, s_pad, l_pad = _splash_blocks(s, l, cfg)
  block_sizes = splash.BlockSizes(
      block_q=bq, block_kv=bkv, block_kv_compute=bkv_compute,
      block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv_compute,
      block_q_dq=bq, block_kv_dq=bkv)
  mask = splash.MultiHeadMask([splash.FullMask((s_pad, l_pad))] * n)
  kernel = splash.make_splash_mha(mask, block_sizes=block_sizes, head_shards=1, q_seq_shards=1,
                                  save_residuals=save_residuals, interpret=cfg.interpret)

  # The kernel does not scale the logits itself. Its layout is (N, S, Hd) per example.
  q = q * jnp.asarray(1.0 / math.sqrt(hd), q.dtype)
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
  q = jnp.pad(q, ((0, 0), (0, 0), (0, s_pad - s), (0, 0)))
  k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, l_pad - l), (0, 0))) for x in (k, v))
  segment_ids = None
  if l_pad != l:
    # Padded keys get segment 1 and every query segment 0, so no query sees them. Padded queries stay
    # in segment 0 (they attend to the real keys and are sliced off, their cotangent is zero): giving
    # them their own id could leave whole rows masked, which the kernel documents as invalid.
    segment_ids = splash.SegmentIds(q=jnp.zeros((s_pad,), jnp.int32),
                                    kv=(jnp.arange(l_pad) >= l).astype(jnp.int32))
  res = jax.vmap(kernel, in_axes=(0, 0, 0, None))(q, k, v, segment_ids)
  out, lse = (res[0], res[1][0]) if save_residuals else (res, None)
  out = jnp.swapaxes(out[:, :, :s], 1, 2)
  if save_residuals:
    # The kernel's residual is log(l) + m, i.e. the natural-log logsumexp of the (already scaled) logits.
    return out, lse[:, :, :s].astype(jnp.float32)
  return out
