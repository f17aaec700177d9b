"""Micro-batches of rollout slots: the layout that splits a step's B*N slots into C chunks so that every
chunk keeps each data-parallel position's share of the batch on that position.

The trainer shards the slot axis over the D = data x fsdp positions in contiguous blocks of S / D slots.
Chunk c takes slots [c*m, (c+1)*m) of every block (m = S / (D*C), config.micro_batch):

    (S, ...) -> (D, C, m, ...) -> (C, D, m, ...) -> (C, D*m, ...)

Position d's block stays on d in every chunk, so chunking moves no data between devices; a scan over
the leading C axis then runs each (D*m)-slot chunk with the batch's own shardings. `from_chunks` is the
inverse. With C = 1 both are the identity (no reshape is traced).
"""
import jax


def to_chunks(tree, num_chunks, batch_shards):
  """Leaves (S, ...) -> (C, S / C, ...) chunks of slots in the layout of the module docstring."""
  if num_chunks == 1:
    return jax.tree.map(lambda a: a[None], tree)

  def split(a):
    s = a.shape[0]
    if s % (num_chunks * batch_shards):
      raise ValueError(f'{s} slots do not split into {num_chunks} chunks over {batch_shards} positions')
    m = s // (num_chunks * batch_shards)
    a = a.reshape((batch_shards, num_chunks, m) + a.shape[1:]).swapaxes(0, 1)
    return a.reshape((num_chunks, batch_shards * m) + a.shape[3:])
  return jax.tree.map(split, tree)


def from_chunks(tree, batch_shards):
  """Inverse of `to_chunks`: leaves (C, S / C, ...) -> (S, ...)."""
  def merge(a):
    c, rows = a.shape[:2]
    if c == 1:
      return a[0]
    m = rows // batch_shards
    a = a.reshape((c, batch_shards, m) + a.shape[2:]).swapaxes(0, 1)
    return a.reshape((batch_shards * c * m,) + a.shape[3:])
  return jax.tree.map(merge, tree)
