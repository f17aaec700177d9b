"""Context-parallel self-attention over the mesh's 'context' axis (Ulysses all-to-all and ring).

Shapes: B batch, S tokens (global), N heads, Hd head dim; cp = mesh.shape[seq_axis], tp =
mesh.shape[head_axis]. Inputs and outputs are global (B, S, N, Hd) arrays laid out as
P(batch_axes, seq_axis, head_axis, None): batch over (data, fsdp), sequence over context, heads over
tensor. Each device runs a local kernel from `ddrl_jax.models.attention` on its piece.

  ulysses: all-to-all heads <-> sequence, so each device attends over the whole sequence with
    N / (cp * tp) heads, then all-to-all back (one all-to-all each for q, k, v and the output); needs
    N % (cp * tp) == 0.
  ring: each device keeps its S / cp queries and passes its K/V block around the ring of cp devices,
    merging blockwise partial attentions with a float32 log-sum-exp; the backward passes dK/dV around
    the ring the same way (flash-style). Only q, k, v, out and lse are saved for the backward, never the
    blocks or probabilities of each step.

Joint attention (SD3's MM-DiT, `joint_ulysses_attention`): image tokens sharded over context as above,
text tokens replicated over context (their count need not divide cp); Ulysses only (see its docstring).

Batch fallback: when B does not divide the size of the batch axes (e.g. B = 1 for a network called per
sample under `jax.vmap`), the batch dimension is replicated over them instead (spec None): every
batch-axis replica then computes the same attention, which is correct but not data-parallel.
"""
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ddrl_jax.models import attention

IMPLS = ('none', 'ulysses', 'ring')
BATCH_AXES = ('data', 'fsdp')


def _axis_size(mesh, axes):
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  return math.prod(mesh.shape[a] for a in axes)


def _shard_map(f, mesh, in_specs, out_specs):
  # check_vma=False: the splash kernel's pallas_call declares its outputs without a varying-axes type,
  # which shard_map's vma check rejects.
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _specs(q, k, v, mesh, batch_axes, seq_axis, head_axis, head_split):
  """(spec of q/k/v/out, spec of a (B, N, S) lse) after checking the shapes fit the mesh.

  head_split: the mesh axes the N heads are split over (context and tensor for Ulysses, tensor for ring).
  """
  b, s, n, _ = q.shape
  if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != q.shape[2:]:
    raise ValueError(f'k {k.shape} and v {v.shape} do not match q {q.shape}')
  cp = _axis_size(mesh, seq_axis)
  if s % cp or k.shape[1] % cp:
    raise ValueError(f'sequence lengths S={s}, L={k.shape[1]} must be divisible by the {seq_axis!r} axis '
                     f'size {cp}')
  sizes = {a: mesh.shape[a] for a in head_split if a is not None}
  if n % math.prod(sizes.values()):
    raise ValueError(f'N={n} heads must be divisible by {math.prod(sizes.values())}, the product of the '
                     f'mesh axis sizes {sizes}')
  batch = tuple(batch_axes) if batch_axes else None
  if batch is not None and b % _axis_size(mesh, batch):
    batch = None
  return P(batch, seq_axis, head_axis, None), P(batch, head_axis, seq_axis)


def ulysses_attention(q, k, v, mesh, cfg, *, batch_axes=BATCH_AXES, seq_axis='context', head_axis='tensor'):
  """DeepSpeed-Ulysses attention: q, k, v (B, S, N, Hd) sequence-sharded -> (B, S, N, Hd), same layout.

  Raises ValueError when N % (cp * tp) != 0 or S % cp != 0. Plain autodiff (all_to_all transposes to
  all_to_all).
  """
  spec, _ = _specs(q, k, v, mesh, batch_axes, seq_axis, head_axis, (seq_axis, head_axis))

  def local(q, k, v):
    # (b, S/cp, N/tp, Hd) -> (b, S, N/(cp*tp), Hd): scatter heads, gather the sequence (in device order).
    to_seq = partial(lax.all_to_all, axis_name=seq_axis, split_axis=2, concat_axis=1, tiled=True)
    out = attention.attend(to_seq(q), to_seq(k), to_seq(v), cfg)
    return lax.all_to_all(out, seq_axis, split_axis=1, concat_axis=2, tiled=True)

  return _shard_map(local, mesh, (spec,) * 3, spec)(q, k, v)


def joint_ulysses_attention(q_img, k_img, v_img, q_txt, k_txt, v_txt, mesh, cfg, *, batch_axes=BATCH_AXES,
                            seq_axis='context', head_axis='tensor'):
  """Ulysses joint attention (SD3's MM-DiT): full attention over the concatenated [image, text] tokens.

  q/k/v_img (B, S, N, Hd) laid out as P(batch_axes, seq_axis, head_axis, None) (image tokens sharded over
  context); q/k/v_txt (B, L, N, Hd) laid out as P(batch_axes, None, head_axis, None): the L text tokens
  are replicated over context (L = 333 for SD3.5, in general not divisible by cp). Returns (out_img
  (B, S, N, Hd), out_txt (B, L, N, Hd)) in the same layouts as their inputs.

  Per device: the image q/k/v go through one all-to-all each (sequence-sharded, N/tp heads ->
  all S tokens, N/(cp*tp) heads); the device takes its own slice of N/(cp*tp) heads of the replicated text
  q/k/v locally (no communication; the slice the image all-to-all gave it); runs the local kernel over
  [image, text] for those heads; the image output goes back by one all-to-all and the text output is
  all-gathered over heads (so it stays replicated over context, like the text residual).

  Gradients are plain autodiff: all_to_all transposes to all_to_all, the all-gather to a reduce-scatter,
  and the cotangent of the replicated text inputs (non-zero only in each device's head slice) is summed
  over context by shard_map's transpose.

  Raises ValueError naming mesh.context when N % (cp * tp) != 0, and when S % cp != 0.
  """
  b, s, n, hd = q_img.shape
  l = q_txt.shape[1]
  for name, x, want in (('k_img', k_img, q_img.shape), ('v_img', v_img, q_img.shape),
                        ('q_txt', q_txt, (b, l, n, hd)), ('k_txt', k_txt, (b, l, n, hd)),
                        ('v_txt', v_txt, (b, l, n, hd))):
    if x.shape != want:
      raise ValueError(f'joint attention: {name} has shape {x.shape}, expected {want}')
  cp, tp = _axis_size(mesh, seq_axis), _axis_size(mesh, head_axis)
  if n % (cp * tp):
    raise ValueError(f'Ulysses joint attention splits the N={n} heads over mesh.context x mesh.tensor = '
                     f'{cp} x {tp} = {cp * tp} devices; they do not divide (choose mesh.context so that '
                     f'context x tensor divides {n})')
  if s % cp:
    raise ValueError(f'joint attention: S={s} image tokens must be divisible by mesh.context = {cp} '
                     f'(the image tokens are sharded over {seq_axis!r})')
  batch = tuple(batch_axes) if batch_axes else None
  if batch is not None and b % _axis_size(mesh, batch):
    batch = None
  img_spec, txt_spec = P(batch, seq_axis, head_axis, None), P(batch, None, head_axis, None)
  n_local = n // (cp * tp)

  def local(q_img, k_img, v_img, q_txt, k_txt, v_txt):
    # Image (b, S/cp, N/tp, Hd) -> (b, S, N/(cp*tp), Hd): device i of the context axis receives head
    # chunk i of the N/tp local heads, so it takes the same chunk of the replicated text heads.
    to_seq = partial(lax.all_to_all, axis_name=seq_axis, split_axis=2, concat_axis=1, tiled=True)
    start = lax.axis_index(seq_axis) * n_local
    heads = partial(lax.dynamic_slice_in_dim, start_index=start, slice_size=n_local, axis=2)
    q = jnp.concatenate([to_seq(q_img), heads(q_txt)], axis=1)
    k = jnp.concatenate([to_seq(k_img), heads(k_txt)], axis=1)
    v = jnp.concatenate([to_seq(v_img), heads(v_txt)], axis=1)
    out = attention.attend(q, k, v, cfg)                         # (b, S + L, N/(cp*tp), Hd)
    out_img = lax.all_to_all(out[:, :s], seq_axis, split_axis=1, concat_axis=2, tiled=True)
    out_txt = lax.all_gather(out[:, s:], seq_axis, axis=2, tiled=True)   # (b, L, N/tp, Hd)
    return out_img, out_txt

  return _shard_map(local, mesh, (img_spec,) * 3 + (txt_spec,) * 3, (img_spec, txt_spec))(
      q_img, k_img, v_img, q_txt, k_txt, v_txt)


def _ring_perm(cp):
  return [(i, (i + 1) % cp) for i in range(cp)]


def _merge(out, lse, block_out, block_lse):
  """Online softmax merge of two partial attentions: (b, s, n, Hd) f32, (b, n, s) f32 each."""
  new_lse = jnp.logaddexp(lse, block_lse)
  w = jnp.exp(lse - new_lse).transpose(0, 2, 1)[..., None]
  w_block = jnp.exp(block_lse - new_lse).transpose(0, 2, 1)[..., None]
  return out * w + block_out.astype(jnp.float32) * w_block, new_lse


def _ring_fwd_local(q, k, v, *, cfg, axis, cp):
  """One device's ring forward: q (b, s, n, Hd) and its K/V block -> (out in q.dtype, lse (b, n, s) f32).

  Step t attends to the block of device (i - t) mod cp; the ppermute of the next block does not depend
  on this step's attention, so XLA may overlap them. cp - 1 hops in the loop, the last block after it.
  """
  perm = _ring_perm(cp)
  out, lse = attention.attend_with_lse(q, k, v, cfg)
  out = out.astype(jnp.float32)

  def step(_, carry):
    out, lse, k, v = carry
    k, v = lax.ppermute((k, v), axis, perm)
    return (*_merge(out, lse, *attention.attend_with_lse(q, k, v, cfg)), k, v)

  out, lse, _, _ = lax.fori_loop(0, cp - 1, step, (out, lse, k, v))
  return out.astype(q.dtype), lse


def _block_grads(q, k, v, lse, dout, delta):
  """Flash backward for one (q block, K/V block) pair, float32 einsums.

  q, dout (b, s, n, Hd), k, v (b, l, n, Hd), lse and delta = rowsum(dout * out) (b, n, s), all f32.
  P is recomputed from q, k and the saved global lse, so it is already normalized over all blocks.
  Returns (dq, dk, dv) contributions of this block.
  """
  scale = 1.0 / math.sqrt(q.shape[-1])
  p = jnp.exp(jnp.einsum('bsnh,blnh->bnsl', q, k) * scale - lse[..., None])
  dv = jnp.einsum('bnsl,bsnh->blnh', p, dout)
  dp = jnp.einsum('bsnh,blnh->bnsl', dout, v)
  ds = p * (dp - delta[..., None])
  dq = jnp.einsum('bnsl,blnh->bsnh', ds, k) * scale
  dk = jnp.einsum('bnsl,bsnh->blnh', ds, q) * scale
  return dq, dk, dv


def _ring_bwd_local(q, k, v, out, dout, lse, *, axis, cp):
  """One device's ring backward: dK/dV accumulators travel with their K/V block and come home after cp
  hops. Returns (dq, dk, dv) in the dtypes of q, k, v.
  """
  perm = _ring_perm(cp)
  f32 = lambda x: x.astype(jnp.float32)
  qf, doutf = f32(q), f32(dout)
  delta = jnp.einsum('bsnh,bsnh->bns', doutf, f32(out))
  block = partial(_block_grads, qf, lse=lse, dout=doutf, delta=delta)

  def step(_, carry):
    dq, k, v, dk, dv = carry
    dq_b, dk_b, dv_b = block(k, v)
    k, v, dk, dv = lax.ppermute((k, v, dk + dk_b, dv + dv_b), axis, perm)
    return dq + dq_b, k, v, dk, dv

  kf, vf = f32(k), f32(v)
  zeros = jnp.zeros_like(kf)
  dq, kf, vf, dk, dv = lax.fori_loop(0, cp - 1, step, (jnp.zeros_like(qf), kf, vf, zeros, zeros))
  dq_b, dk_b, dv_b = block(kf, vf)
  dk, dv = lax.ppermute((dk + dk_b, dv + dv_b), axis, perm)
  return (dq + dq_b).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def ring_attention(q, k, v, mesh, cfg, *, batch_axes=BATCH_AXES, seq_axis='context', head_axis='tensor'):
  """Ring attention: q, k, v (B, S, N, Hd) sequence-sharded -> (B, S, N, Hd), same layout.

  Forward: per step the local `attention.attend_with_lse` kernel (splash/cuDNN for long local blocks,
  'xla' otherwise) on the resident K/V block, merged in float32. Backward (custom VJP): saves q, k, v,
  out and lse, recomputes P per block with float32 einsums (S/cp x S/cp logits per step); on TPU the
  tokamax ring-attention kernel would be the production path for this. Raises ValueError when
  S % cp != 0 or N % tp != 0.
  """
  cp = _axis_size(mesh, seq_axis)
  spec, lse_spec = _specs(q, k, v, mesh, batch_axes, seq_axis, head_axis, (head_axis,))
  fwd = _shard_map(partial(_ring_fwd_local, cfg=cfg, axis=seq_axis, cp=cp), mesh, (spec,) * 3,
                   (spec, lse_spec))
  bwd = _shard_map(partial(_ring_bwd_local, axis=seq_axis, cp=cp), mesh, (spec,) * 5 + (lse_spec,),
                   (spec,) * 3)

  @jax.custom_vjp
  def ring(q, k, v):
    return fwd(q, k, v)[0]

  def ring_fwd(q, k, v):
    out, lse = fwd(q, k, v)
    return out, (q, k, v, out, lse)

  def ring_bwd(res, dout):
    q, k, v, out, lse = res
    return bwd(q, k, v, out, dout, lse)

  ring.defvjp(ring_fwd, ring_bwd)
  return ring(q, k, v)


def context_attention(q, k, v, mesh, cfg, impl, *, batch_axes=BATCH_AXES, seq_axis='context',
                      head_axis='tensor'):
  """Self-attention (B, S, N, Hd) -> (B, S, N, Hd) with context parallelism `impl` (one of IMPLS).

  'none' calls `attention.attend` on the global arrays and leaves the partitioning to GSPMD (mesh unused).
  """
  if impl == 'none':
    return attention.attend(q, k, v, cfg)
  if impl == 'ulysses':
    fn = ulysses_attention
  elif impl == 'ring':
    fn = ring_attention
  else:
    raise ValueError(f'unknown context-parallel attention {impl!r}; expected one of {IMPLS}')
  return fn(q, k, v, mesh, cfg, batch_axes=batch_axes, seq_axis=seq_axis, head_axis=head_axis)
