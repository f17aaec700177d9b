"""The smallest v5p slice for every shipped recipe at the recipe's own batch, with micro-batching
(config.micro_batch), and the 8 x H100-80GB proxy: resumable AOT sweep, one subprocess per compile.

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/aot_fit.py                  # every recipe, v5p slices
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/aot_fit.py --h100           # the 8 x H100 proxy table
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/aot_fit.py --recipes=configs/sd35m.py:ddrl --report
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/aot_fit.py --recipes=configs/cosmos2b.py@mesh.context=4

A recipe is `FILE[:ARG][@key=value...]`: the overrides reach the compile as `--config.key=value` (and
the candidates), e.g. other model axes for a preset laid out for a pod.

For each recipe and slice (smallest first) the sweep looks for the largest micro-batch whose rollout,
data gradient and update all fit with --margin (10%) of the chip's memory to spare: the candidates are the
divisors of the recipe's rollout slots per data-parallel position (`ddrl_jax.aot.micro_batch_candidates`;
the largest is the whole batch, micro_batch 0), searched on the assumption that memory falls as the chunk
shrinks: the whole batch first, then the smallest candidate (if even one slot per chunk does not fit, the
slice is out after two compiles), then a bisection between them. Within a micro-batch, a function that
failed at a larger one compiles first, so a failing candidate usually costs one compile. A slice that fits
at some micro-batch ends the recipe's search: it is the recipe's smallest slice.

Each compile is `python -m ddrl_jax.aot --fns=<fn> --config.micro_batch=<m>` in its own process. A
compile that kills the process (libtpu has died with signal 11 on programs far over a chip's memory
instead of answering RESOURCE_EXHAUSTED) is recorded as outcome 'libtpu_crash', neither a fit nor a
compiler out-of-memory verdict ('oom'), and counts as not fitting; the sweep goes on. Rows already in
--out are reused (re-read before every micro-batch), so the sweep resumes where it stopped and several
sweeps over different recipes may share one --out. The ceiling (--hbm_gib) only judges a compile, so a
row compiled for the same recipe, slice, micro-batch and function under another ceiling is re-judged
(`rejudge`) instead of compiled again.

The H100 proxy (--h100): v5p-16's 8 chips (one 8-GPU node's count) judged against 72 GiB per chip
(`--hbm_gib=72`: an 80 GB H100 less what the CUDA context, cuDNN workspaces and fragmentation take; XLA
gets ~92% of 79.6 GiB). It is a proxy: the program is compiled for TPU (its fusion, tiling and
attention kernel), not for the GPU.
"""
import argparse
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FUNCTIONS = ('rollout', 'data_grads', 'update')
RECIPES = ('configs/sd35m.py:ddrl', 'configs/sd35m.py:flow_grpo', 'configs/sd35m.py:diffusion_nft',
           'configs/wan1_3b.py:ddrl', 'configs/wan1_3b.py:flow_grpo', 'configs/wan1_3b.py:dance_grpo',
           'configs/wan14b.py:ddrl', 'configs/wan14b.py:flow_grpo', 'configs/wan14b.py:dance_grpo',
           'configs/cosmos2b.py', 'configs/cosmos14b.py', 'configs/flux1_dev.py:flow_grpo',
           'configs/flux1_dev.py:dance_grpo', 'configs/flux1_dev.py:ddrl')
SLICES = ('v5p-8', 'v5p-16', 'v5p-32', 'v5p-64', 'v5p-128', 'v5p-256', 'v5p-512', 'v5p-1024', 'v5p-2048')
H100_SLICE, H100_GIB = 'v5p-16', 72.0


def read_rows(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def outcome_of(row):
  """'fits', 'over' (compiled, peak over the ceiling), 'oom' (the compiler's out-of-memory verdict),
  'libtpu_crash' (the compiler process died), 'timeout' or 'error'."""
  if row.get('outcome'):
    return row['outcome']
  if row.get('fits'):
    return 'fits'
  if 'peak_bytes' in row:
    return 'over'
  return 'oom' if 'RESOURCE_EXHAUSTED' in str(row.get('error', '')) else 'error'


def rejudge(row, topology, hbm_gib):
  """`row` (compiled under another --hbm_gib) judged against `hbm_gib` (0: the chip's HBM): fits and
  spare_fraction from its peak_bytes; an outcome without a peak (oom, libtpu_crash, ...) carries over, as
  the program compiled is the same."""
  from ddrl_jax.parallel import topology as topology_lib  # pylint: disable=g-import-not-at-top
  out = dict(row, hbm_gib=hbm_gib, rejudged_from_hbm_gib=row.get('hbm_gib', 0.0), compile_s=0.0)
  if row.get('peak_bytes') and outcome_of(row) in ('fits', 'over'):
    hbm = int(hbm_gib * 2**30) if hbm_gib else topology_lib.hbm_bytes(topology)
    fits = row['peak_bytes'] <= hbm
    out.update(hbm_bytes=hbm, fits=fits, spare_fraction=round(1 - row['peak_bytes'] / hbm, 4),
               outcome='fits' if fits else 'over')
  return out


def mesh_overrides(recipe, topology):
  """--config.mesh.data=-1 when the recipe's mesh is fixed to another slice's size (the Cosmos presets'
  data=16 x fsdp=8 x context=2 for v5p-512): the data axis then fills the slice, the model axes stay."""
  from ddrl_jax.parallel import topology as topology_lib  # pylint: disable=g-import-not-at-top
  mesh = _load(recipe).mesh
  sizes = [mesh.data, mesh.fsdp, mesh.context, mesh.tensor]
  fixed = all(v > 0 for v in sizes) and math.prod(sizes) != topology_lib.num_devices(topology, 1)
  return ['--config.mesh.data=-1'] if fixed else []


def compile_one(recipe, topology, fn, micro, hbm_gib, timeout_s):
  """One function's aot row (with outcome), or a row saying why there is none."""
  spec, overrides = split_recipe(recipe)
  cmd = [sys.executable, '-m', 'ddrl_jax.aot', f'--config={spec}', f'--topology={topology}', f'--fns={fn}',
         f'--config.micro_batch={micro}'] + [f'--config.{k}={v}' for k, v in overrides.items()]
  cmd += mesh_overrides(recipe, topology)
  if hbm_gib:
    cmd.append(f'--hbm_gib={hbm_gib}')
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  try:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
                          check=False)
  except subprocess.TimeoutExpired:
    return dict(fn=fn, topology=topology, fits=None, outcome='timeout', error=f'compile over {timeout_s} s')
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{')]
  if rows:
    return dict(rows[-1], outcome=outcome_of(rows[-1]))
  if proc.returncode < 0:
    return dict(fn=fn, topology=topology, fits=None, outcome='libtpu_crash',
                error=f'compiler process died with signal {-proc.returncode}')
  last = proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else ''
  return dict(fn=fn, topology=topology, fits=None, outcome='error', error=f'exit {proc.returncode}: {last}')


def candidates(recipe, topology):
  """The recipe's micro-batch candidates on `topology`, largest first (the first is the whole batch)."""
  from ddrl_jax import aot  # pylint: disable=g-import-not-at-top
  from ddrl_jax.parallel import topology as topology_lib  # pylint: disable=g-import-not-at-top
  config = _load(recipe)
  if mesh_overrides(recipe, topology):
    config.mesh.data = -1
  return aot.micro_batch_candidates(config, topology_lib.num_devices(topology, 1))


def split_recipe(recipe):
  """'configs/cosmos2b.py@mesh.context=1' -> ('configs/cosmos2b.py', {'mesh.context': '1'})."""
  spec, *items = recipe.split('@')
  overrides = {}
  for item in items:
    key, eq, value = item.partition('=')
    if not eq or not key:
      raise ValueError(f'recipe {recipe!r}: override {item!r} is not <config.key>=<value>')
    overrides[key] = value
  return spec, overrides


def _load(recipe):
  """The recipe's config with its overrides set (an unknown key raises naming it)."""
  from ddrl_jax import cli  # pylint: disable=g-import-not-at-top
  from ddrl_jax import config_overrides  # pylint: disable=g-import-not-at-top
  spec, overrides = split_recipe(recipe)
  config = cli.load_config(os.path.join(ROOT, spec))
  return config_overrides.apply(
      config, {k: config_overrides.parse_value(v) for k, v in overrides.items()}, f'recipe {recipe!r}')


class Sweep:
  """Rows of one --out file, with the compile of a (recipe, slice, micro-batch) done at most once."""

  def __init__(self, args):
    self.args, self.rows = args, read_rows(args.out)

  def key(self, row):
    return (row['recipe'], row['topology'], row.get('hbm_gib', 0.0), row['micro_batch'], row['fn'])

  def fits(self, recipe, topology, micro):
    """Whether every function fits with the margin at `micro` (compiling what is not recorded yet)."""
    hbm_gib = self.args.hbm_gib
    self.rows = read_rows(self.args.out)        # another sweep may share --out: use its rows too
    have = {self.key(r): r for r in self.rows}
    other_ceiling = {(r['recipe'], r['topology'], r['micro_batch'], r['fn']): r for r in self.rows
                     if r.get('hbm_gib', 0.0) != hbm_gib and 'rejudged_from_hbm_gib' not in r}
    failed_before = {r['fn'] for r in self.rows if (r['recipe'], r['topology'], r.get('hbm_gib', 0.0)) == (
        recipe, topology, hbm_gib) and r['outcome'] != 'fits'}
    ok = True
    for fn in sorted(FUNCTIONS, key=lambda fn: fn not in failed_before):
      row = have.get((recipe, topology, hbm_gib, micro, fn))
      if row is None:
        compiled = other_ceiling.get((recipe, topology, micro, fn))
        if compiled is not None:
          row = rejudge(compiled, topology, hbm_gib)
        else:
          row = dict(compile_one(recipe, topology, fn, micro, hbm_gib, self.args.timeout_s), recipe=recipe,
                     micro_batch=micro, hbm_gib=hbm_gib)
        self.rows.append(row)
        with open(self.args.out, 'a') as f:
          f.write(json.dumps(row) + '\n')
        print(json.dumps({k: row.get(k) for k in ('recipe', 'topology', 'micro_batch', 'fn', 'outcome',
                                                   'peak_bytes', 'spare_fraction')}), flush=True)
      ok = ok and row['outcome'] == 'fits' and row.get('spare_fraction', 0) >= self.args.margin
      if not ok:
        return False       # the other functions need not compile for a micro-batch that cannot run
    return ok

  def best_micro_batch(self, recipe, topology):
    """The largest candidate that fits (the whole batch, else the smallest, else a bisection between),
    or None (also when the recipe's mesh cannot be laid on the slice: printed)."""
    from ddrl_jax import config as config_lib  # pylint: disable=g-import-not-at-top
    try:
      cands = candidates(recipe, topology)
    except (ValueError, config_lib.ConfigError) as e:
      print(json.dumps(dict(recipe=recipe, topology=topology, skipped=str(e)[:200])), flush=True)
      return None
    as_config = lambda m: 0 if m == cands[0] else m
    if self.fits(recipe, topology, as_config(cands[0])):
      return 0
    if len(cands) == 1 or not self.fits(recipe, topology, cands[-1]):
      return None
    lo, hi, best = 1, len(cands) - 2, cands[-1]      # cands[lo..hi] untested, descending sizes
    while lo <= hi:
      mid = (lo + hi) // 2
      if self.fits(recipe, topology, as_config(cands[mid])):
        best, hi = cands[mid], mid - 1
      else:
        lo = mid + 1
    return best


def report(rows, margin):
  """Markdown: per recipe and slice, the largest micro-batch that fits and each function's peak."""
  lines = ['| recipe | slice | ceiling | micro_batch | rollout GiB | data_grads GiB | update GiB | verdict |',
           '|---|---|---|---|---|---|---|---|']
  by = {}
  for r in rows:
    by.setdefault((r['recipe'], r['topology'], r.get('hbm_gib', 0.0)), {}).setdefault(
        r['micro_batch'], {})[r['fn']] = r
  for (recipe, topology, hbm_gib), micros in by.items():
    fitting = [m for m, fns in micros.items() if len(fns) == 3 and all(
        f['outcome'] == 'fits' and f.get('spare_fraction', 0) >= margin for f in fns.values())]
    for m in sorted(micros, key=lambda m: (m == 0, m), reverse=True):
      fns = micros[m]
      cell = lambda fn: (f"{fns[fn]['peak_bytes'] / 2**30:.1f}" if fn in fns and 'peak_bytes' in fns[fn]
                         else (fns[fn]['outcome'] if fn in fns else '-'))
      failed = next((f['outcome'] for f in fns.values() if f['outcome'] != 'fits'), None)
      low = any(f.get('spare_fraction', 0) < margin for f in fns.values())
      verdict = ('fits' if m in fitting else failed or ('fits, < margin' if low else 'incomplete'))
      ceiling = f'{hbm_gib:g} GiB' if hbm_gib else 'HBM'
      lines.append(f'| {recipe} | {topology} | {ceiling} | {m or "whole"} | {cell("rollout")} | '
                   f'{cell("data_grads")} | {cell("update")} | {verdict} |')
  return '\n'.join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--recipes', default=','.join(RECIPES))
  p.add_argument('--slices', default=','.join(SLICES))
  p.add_argument('--h100', action='store_true', help=f'the proxy: {H100_SLICE} at {H100_GIB} GiB per chip')
  p.add_argument('--margin', type=float, default=0.1)
  p.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'aot_fit.jsonl'))
  p.add_argument('--timeout_s', type=int, default=1800)
  p.add_argument('--report', action='store_true', help='print the table of --out and stop')
  args = p.parse_args()
  args.hbm_gib = H100_GIB if args.h100 else 0.0
  if args.report:
    print(report(read_rows(args.out), args.margin))
    return
  sweep = Sweep(args)
  slices = [H100_SLICE] if args.h100 else args.slices.split(',')
  for recipe in args.recipes.split(','):
    for topology in slices:
      best = sweep.best_micro_batch(recipe, topology)
      print(json.dumps(dict(recipe=recipe, topology=topology, hbm_gib=args.hbm_gib, micro_batch=best)),
            flush=True)
      if best is not None:
        break


if __name__ == '__main__':
  main()
