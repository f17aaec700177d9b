"""AOT fit proofs of a family's recipes on v5p slices (SD3.5-Medium by default, Wan2.1 with --config): per-chip
HBM of each function at each preset's batch, one subprocess per (preset, topology, function), resumable.

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/aot_sd3.py [--presets=ddrl,flow_grpo,diffusion_nft]
      [--topologies=v5p-8,v5p-16] [--out=benchmarks/aot_sd3.jsonl]
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/aot_sd3.py --config=configs/wan1_3b.py --presets=flow_grpo \
      --out=benchmarks/aot_wan.jsonl

Each row is `python -m ddrl_jax.aot`'s JSON line plus `preset`; a compile that kills the process (libtpu
has segfaulted on programs far over a chip's HBM instead of answering RESOURCE_EXHAUSTED) is recorded as
{"fits": null, "outcome": "libtpu_crash", "error": "compiler process died with signal N"} (rows before
issue 49 recorded it as "fits": false). Rows already in --out are skipped, so
an interrupted sweep resumes. A topology is tried for a preset only while the smaller ones did not fit.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aot_fit  # pylint: disable=g-import-not-at-top,wrong-import-position
FUNCTIONS = ('rollout', 'data_grads', 'update')


def done_rows(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def compile_one(config, preset, topology, fn, timeout_s):
  """The aot row of one function at the preset's whole batch (or a row saying why there is none: a
  timeout, an error, or 'libtpu_crash' with fits None, never a fit or a plain miss), as aot_fit compiles."""
  return aot_fit.compile_one(f'{config}:{preset}', topology, fn, 0, 0.0, timeout_s)


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--config', default='configs/sd35m.py')
  p.add_argument('--presets', default='ddrl,flow_grpo,diffusion_nft')
  p.add_argument('--topologies', default='v5p-8,v5p-16,v5p-32')
  p.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'aot_sd3.jsonl'))
  p.add_argument('--timeout_s', type=int, default=1500)
  args = p.parse_args()
  rows = done_rows(args.out)
  have = {(r.get('config', 'configs/sd35m.py'), r['preset'], r['topology'], r['fn']) for r in rows}
  for preset in args.presets.split(','):
    for topology in args.topologies.split(','):
      for fn in FUNCTIONS:
        if (args.config, preset, topology, fn) in have:
          continue
        row = dict(compile_one(args.config, preset, topology, fn, args.timeout_s), preset=preset,
                   config=args.config)
        rows.append(row)
        with open(args.out, 'a') as f:
          f.write(json.dumps(row) + '\n')
        print(json.dumps({k: row.get(k) for k in ('preset', 'topology', 'fn', 'peak_bytes', 'fits',
                                                   'spare_fraction', 'outcome', 'error')}), flush=True)
      fitted = [r for r in rows if r['preset'] == preset and r['topology'] == topology
                and r.get('config', 'configs/sd35m.py') == args.config]
      if len(fitted) == len(FUNCTIONS) and all(r.get('fits') and r.get('spare_fraction', 0) >= 0.1
                                               for r in fitted):
        break           # the smallest slice with 10% to spare: larger ones are not needed


if __name__ == '__main__':
  main()
