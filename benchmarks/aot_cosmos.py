"""AOT memory of one DDRL iteration of Cosmos 2B / 14B on Cloud TPU v5p slices, compiled on this CPU host.

  cd /work/main && JAX_PLATFORMS=cpu python benchmarks/aot_cosmos.py [--out=benchmarks/aot_cosmos.jsonl]
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/aot_cosmos.py --models=cosmos2b --lora_rank=32 --lora_alpha=64
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/aot_cosmos.py --text=reason1 \
      --out=benchmarks/aot_reason1.jsonl

Needs libtpu (`pip install -e '.[aot]'`). For each model: the paper's mesh on its slice (all three
functions, as `python -m ddrl_jax.aot` does), then ever smaller slices at the paper's batch (16 groups x 8
rollouts) with the same fsdp and context sizes and fewer data replicas (each chip then holds more rollout
slots), compiling `update` and `data_grads` (the largest functions) until one does not fit. Appends one
JSON line per compile to --out (resumable: configurations already in the file are skipped). With
--lora_rank, the same with LoRA adapters (config.lora: the default targets, the blocks' attention
projections) and rows named '<model>+lora<rank>'. With --text=reason1, config.cosmos.text='reason1': the
Cosmos-Reason1-7B text encoder stays on the chips (every row's resident and peak bytes count its FSDP-sharded
bf16 parameters, `text_encoder_bytes`), the paper's slice also compiles its forward ('text_encoder'), and
rows are named '<model>+reason1'.
"""
import argparse
import json
import os

from configs import cosmos14b
from configs import cosmos2b
from ddrl_jax import aot

# (model config module, [(topology, mesh)] from the paper's slice down).
PLANS = {
    'cosmos2b': (cosmos2b, [('v5p-512', dict(data=16, fsdp=8, context=2)),
                            ('v5p-256', dict(data=8, fsdp=8, context=2)),
                            ('v5p-128', dict(data=4, fsdp=8, context=2)),
                            ('v5p-64', dict(data=2, fsdp=8, context=2))]),
    'cosmos14b': (cosmos14b, [('v5p-2048', dict(data=4, fsdp=32, context=8)),
                              ('v5p-1024', dict(data=2, fsdp=32, context=8)),
                              ('v5p-512', dict(data=1, fsdp=32, context=8))]),
}


def _done(path):
  if not os.path.exists(path):
    return set()
  rows = [json.loads(l) for l in open(path) if l.strip()]
  return {(r['model'], r['topology'], r['fn']) for r in rows}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--out', default='benchmarks/aot_cosmos.jsonl')
  parser.add_argument('--models', default='cosmos2b,cosmos14b')
  parser.add_argument('--lora_rank', type=int, default=0)
  parser.add_argument('--lora_alpha', type=float, default=0.0)
  parser.add_argument('--text', default='', help="config.cosmos.text, e.g. 'reason1' (default: the config's)")
  args = parser.parse_args()
  done = _done(args.out)
  for base_model in args.models.split(','):
    module, slices = PLANS[base_model]
    model = (base_model + (f'+lora{args.lora_rank}' if args.lora_rank else '')
             + (f'+{args.text}' if args.text else ''))
    for i, (topology, mesh) in enumerate(slices):
      fns = aot.FUNCTIONS if i == 0 else ('update', 'data_grads')
      if i == 0 and args.text == 'reason1':
        fns += (aot.TEXT_ENCODER,)
      todo = [f for f in fns if (model, topology, f) not in done]
      if not todo:
        continue
      config = module.get_config()
      config.mesh.update(mesh)
      config.lora.update(rank=args.lora_rank, alpha=args.lora_alpha)
      if args.text:
        config.cosmos.text = args.text
      fits = True
      for row in aot.compile_report(config, topology, fns=todo):
        row['model'] = model
        print(json.dumps(row), flush=True)
        with open(args.out, 'a') as f:
          f.write(json.dumps(row) + '\n')
        fits = fits and row['fits']
      if not fits:
        break


if __name__ == '__main__':
  main()
