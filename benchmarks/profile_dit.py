"""Where the Cosmos DiT's forward+backward spends its time on XLA:CPU: per-op times from a jax.profiler trace.

  JAX_PLATFORMS=cpu python benchmarks/profile_dit.py                      # D 128, 4 blocks, batch 64
  JAX_PLATFORMS=cpu python benchmarks/profile_dit.py --blocks=1 --remat=full --top=40

XLA:CPU emits a trace event per executed thunk when `--xla_cpu_enable_xprof_traceme=true` is in XLA_FLAGS
(added here). The events of `--reps` executions are summed per op name (over both of XLA's threads, so the
total is CPU time, not wall time), then grouped by the kind of op (the fusion's name without its number) and
by the source of the op (the jaxpr primitive in the fusion's op_name metadata, forward or backward). This is
how issue 13's causes were found (benchmarks/RESULTS.md, "Speed"): YNNPACK reductions of the adaLN
gradients, the transposed operands of multi-axis kernel contractions, and the stacked residuals of the
blocks' scan.
"""
import argparse
import collections
import glob
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from ddrl_jax import xla_flags  # pylint: disable=wrong-import-position


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--width', type=int, default=128)
  p.add_argument('--blocks', type=int, default=4)
  p.add_argument('--heads', type=int, default=4)
  p.add_argument('--batch', type=int, default=64)
  p.add_argument('--latent', default='1,16,16', help='latent frames,H,W (16 channels, patch 1x2x2)')
  p.add_argument('--remat', default='none')
  p.add_argument('--reps', type=int, default=3)
  p.add_argument('--top', type=int, default=25)
  return p.parse_args(argv)


def dit_grad_fn(args):
  """(jitted grad of a mean-square loss of the DiT, params, x (B, 16, T, H, W))."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from ddrl_jax.models.cosmos import dit as cosmos_dit  # pylint: disable=import-outside-toplevel
  cfg = cosmos_dit.CosmosDiTConfig(model_channels=args.width, num_blocks=args.blocks, num_heads=args.heads,
                                   adaln_lora_dim=32, crossattn_in=None, context_dim=args.width,
                                   remat_policy=args.remat)
  graphdef, params = nnx.split(cosmos_dit.CosmosDiT(cfg, rngs=nnx.Rngs(0)))
  t, h, w = (int(v) for v in args.latent.split(','))
  x = jax.random.normal(jax.random.key(1), (args.batch, 16, t, h, w))
  times = jnp.full((args.batch, t), 0.5)
  context = jax.random.normal(jax.random.key(2), (args.batch, 8, args.width))
  loss = lambda p, x: jnp.mean(nnx.merge(graphdef, p)(x, times, context) ** 2)
  return jax.jit(jax.grad(loss)), params, x


def op_times(fn, args_, reps, logdir):
  """Profile of fn(*args_) (compiled first) over `reps` executions.

  Returns ({op name: total ns}, {thread name: (busy ns, thunks executed)}, wall seconds per execution).
  """
  import time  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from jax._src.lib import _profile_data  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(fn(*args_))
  with jax.profiler.trace(logdir):
    start = time.perf_counter()
    for _ in range(reps):
      jax.block_until_ready(fn(*args_))
    wall = (time.perf_counter() - start) / reps
  path = glob.glob(os.path.join(logdir, '**', '*.xplane.pb'), recursive=True)[0]
  totals, threads = collections.Counter(), collections.defaultdict(lambda: [0, 0])
  for plane in _profile_data.ProfileData.from_file(path).planes:
    for line in plane.lines:
      if line.name == 'python':
        continue
      for event in line.events:
        if 'Execute' not in event.name:
          totals[event.name] += event.duration_ns
          threads[line.name][0] += event.duration_ns
          threads[line.name][1] += 1
  return totals, dict(threads), wall


def op_sources(hlo_text):
  """{instruction name: op_name metadata} of an optimized HLO module's text."""
  found = re.finditer(r'^\s+(?:ROOT )?%([\w.\-]+) = .*?op_name="([^"]+)"', hlo_text, re.M)
  return {m.group(1): m.group(2) for m in found}


def group(totals, sources):
  """(by kind of op, by (phase, primitive, kind)): Counters of ns."""
  by_kind, by_source = collections.Counter(), collections.Counter()
  for name, ns in totals.items():
    kind = re.sub(r'[._0-9]+$', '', name)
    source = sources.get(name, '?')
    phase = 'backward' if 'transpose(jvp' in source else 'forward'
    by_kind[kind] += ns
    by_source[(phase, source.split('/')[-1], kind)] += ns
  return by_kind, by_source


def main(argv=None):
  xla_flags.apply()
  os.environ['XLA_FLAGS'] += ' --xla_cpu_enable_xprof_traceme=true'
  args = parse_args(argv)
  fn, params, x = dit_grad_fn(args)
  with tempfile.TemporaryDirectory() as logdir:
    totals, threads, wall = op_times(fn, (params, x), args.reps, logdir)
  sources = op_sources(fn.lower(params, x).compile().as_text())
  by_kind, by_source = group(totals, sources)
  ms = lambda ns: ns / 1e6 / args.reps
  print(f'DiT D{args.width} x {args.blocks} blocks, batch {args.batch}, latent {args.latent}, remat '
        f'{args.remat}; XLA_FLAGS={os.environ["XLA_FLAGS"]!r}')
  print(f'CPU time per forward+backward (both threads): {ms(sum(totals.values())):.1f} ms; wall '
        f'{wall * 1e3:.1f} ms under the profiler')
  print('busy time per XLA thread (a thread busy for much less than the wall waits on the other):')
  for name, (ns, count) in sorted(threads.items(), key=lambda kv: -kv[1][0]):
    if ns > 0.01 * wall * 1e9 * args.reps:
      print(f'  {ms(ns):8.1f} ms in {count // args.reps} thunks  {name}')
  print('\nby kind of op:')
  for kind, ns in by_kind.most_common(args.top):
    print(f'  {ms(ns):8.2f} ms  {kind}')
  print('\nby source (phase, primitive, kind):')
  for key, ns in by_source.most_common(args.top):
    print(f'  {ms(ns):8.2f} ms  {key}')


if __name__ == '__main__':
  main()
