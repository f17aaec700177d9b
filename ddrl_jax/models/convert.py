"""Command line: PyTorch / diffusers checkpoints -> orbax checkpoints of a model family's params.

  python -m ddrl_jax.models.convert --source=PATH --model=MODEL --out=DIR [--dtype=float32|bfloat16]

MODEL is one of the families' converters (`--help` lists them all): cosmos2b, cosmos14b, sd35_medium,
sd35_large, sd35_vae, wan1_3b, wan14b, wan21_vae, and tiny variants for tests.

Sources:
- a torch `.pt` / `.pth` file, read with `torch.load(..., weights_only=True)` ONLY: a file that holds
  anything but tensors and plain containers is refused (nothing arbitrary is unpickled);
- one `.safetensors` file;
- a diffusers folder (`config.json` + `*.safetensors`, optionally sharded through
  `diffusion_pytorch_model.safetensors.index.json`), or a pipeline folder holding `transformer/` / `vae/`.

The model names and their converters come from the families (`models.family.converters()`); each
family's converter detects its naming from the keys (e.g. the original Cosmos-Predict2.5 `net.` prefix
against diffusers names, models/cosmos/convert.py; the original Wan2.1 VAE names against diffusers'
`AutoencoderKLWan`, models/video_vae_convert.py `wan_original_to_diffusers`).

Output, in DIR:
- `params/`: an orbax `StandardCheckpointer` checkpoint of the pure nested dict of the model's nnx.Param
  values (host numpy, cast to --dtype);
- `conversion.json`: model, source, naming, dtype, number of source tensors, parameter count.
`load_converted(DIR, model)` restores it as an `nnx.State` of Params, ready for `merge_params`.
"""
import argparse
import glob
import json
import math
import os
import sys

import numpy as np

from ddrl_jax import cli

DTYPES = ('float32', 'bfloat16')


# ------------------------------------------------------------------------------------------ configs
def _converter(model):
  """The family converter of a CLI model name (models.family.converters())."""
  from ddrl_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top
  table = family_lib.converters()
  if model not in table:
    raise ValueError(f'unknown --model {model!r}; choose one of {tuple(table)}')
  return table[model]


def model_config(model, dtype='float32'):
  """The model config for a CLI model name; params are held in `dtype`."""
  import jax.numpy as jnp
  return _converter(model).make_config(jnp.dtype(dtype))


# ------------------------------------------------------------------------------------------ reading
def _import_torch():
  """torch (an extra: the trainer never needs it), or an ImportError naming the extra to install."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("ddrl_jax.models.convert reads .pt and .safetensors weights with torch: "
                      "pip install -e '.[convert]'") from e
  return torch


def _tensor_to_numpy(t):
  torch = _import_torch()
  t = t.detach()
  if t.is_floating_point():
    return t.to(torch.float32).numpy()
  return t.numpy()


def _unwrap(obj, path):
  """A torch.load result -> flat {name: value}; unwraps one {'state_dict'|'model'|'net': {...}} level."""
  if not isinstance(obj, dict):
    raise ValueError(f'{path}: expected a dict of tensors, got {type(obj).__name__}')
  if len(obj) == 1:
    (k, v), = obj.items()
    if k in ('state_dict', 'model', 'module') and isinstance(v, dict):
      return v
  return obj


def _unpickle_detail(e):
  """The line of torch's refusal that names the offending global (without its unsafe-loading advice)."""
  hits = [l.strip() for l in str(e).splitlines() if 'Unsupported' in l or 'GLOBAL' in l]
  return f' Detail: {hits[0].split(" was not an allowed")[0]}' if hits else f' Detail: {type(e).__name__}'


def load_torch_file(path):
  """{name: float32 numpy} of a torch .pt/.pth, loaded with weights_only=True (no arbitrary unpickling)."""
  import pickle
  torch = _import_torch()
  try:
    try:
      obj = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
    except RuntimeError as e:  # legacy (non-zip) files cannot be memory-mapped
      if 'mmap' not in str(e):
        raise
      obj = torch.load(path, map_location='cpu', weights_only=True)
  except (pickle.UnpicklingError, AttributeError, TypeError) as e:
    raise ValueError(
        f'{path}: refused: the file contains non-tensor Python objects, which torch.load(weights_only=True) '
        f'will not unpickle (only tensors and plain containers are accepted). Re-save a plain state dict '
        f'of tensors (or a .safetensors file).{_unpickle_detail(e)}') from None
  sd = _unwrap(obj, path)
  out, bad = {}, []
  for k in list(sd.keys()):
    v = sd.pop(k)
    if isinstance(v, torch.Tensor):
      out[k] = _tensor_to_numpy(v)
    elif isinstance(v, (int, float, bool)):
      out[k] = np.asarray(v)
    elif v is None or k.endswith('._extra_state'):
      continue  # bookkeeping (e.g. TransformerEngine extra state); holds no weights
    else:
      bad.append(f'{k} ({type(v).__name__})')
  if bad:
    raise ValueError(f'{path}: refused: non-tensor entries {bad}')
  return out


def load_safetensors_file(path, into=None):
  _import_torch()    # framework='pt': bf16 tensors, which numpy cannot hold, go through torch
  from safetensors import safe_open
  out = {} if into is None else into
  with safe_open(path, framework='pt', device='cpu') as f:
    for k in f.keys():
      out[k] = _tensor_to_numpy(f.get_tensor(k))
  return out


def _diffusers_dir(path, subfolder):
  """The folder holding the weights: `path`, or its `subfolder` (a pipeline's `transformer/`, `vae/`)."""
  if glob.glob(os.path.join(path, '*.safetensors')):
    return path
  sub = os.path.join(path, subfolder)
  if os.path.isdir(sub) and glob.glob(os.path.join(sub, '*.safetensors')):
    return sub
  raise ValueError(f'{path}: no *.safetensors in the folder (nor in {os.path.basename(sub)}/)')


def load_diffusers_dir(path, subfolder='transformer'):
  d = _diffusers_dir(path, subfolder)
  index = os.path.join(d, 'diffusion_pytorch_model.safetensors.index.json')
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)['weight_map'].values()))
    files = [os.path.join(d, n) for n in files]
  else:
    single = os.path.join(d, 'diffusion_pytorch_model.safetensors')
    files = [single] if os.path.exists(single) else sorted(glob.glob(os.path.join(d, '*.safetensors')))
  out = {}
  for f in files:
    load_safetensors_file(f, into=out)
  return out


def load_source(path, subfolder='transformer'):
  """{name: numpy (floats as float32)} from a .pt/.pth, a .safetensors or a diffusers folder."""
  if not os.path.exists(path):
    raise ValueError(f'{path}: no such file or folder')
  if os.path.isdir(path):
    return load_diffusers_dir(path, subfolder)
  if path.endswith('.safetensors'):
    return load_safetensors_file(path)
  if path.endswith(('.pt', '.pth', '.bin', '.ckpt')):
    return load_torch_file(path)
  raise ValueError(f'{path}: unknown source type (want .pt/.pth, .safetensors or a diffusers folder)')


# ------------------------------------------------------------------------------------------ convert
def convert_state_dict(state_dict, model, dtype='float32'):
  """{name: numpy} -> (nnx.State of Params, naming) for a CLI model name."""
  return _converter(model).convert(state_dict, model_config(model, dtype))


def _abstract_pure(model, dtype):
  import jax
  from flax import nnx
  state = nnx.state(_converter(model).abstract(model_config(model, dtype)), nnx.Param)
  pure = nnx.to_pure_dict(state)
  pure = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pure)
  return state, pure


def convert(source, model, out, dtype='float32'):
  """Reads `source`, converts it for `model`, writes DIR/params (orbax) + DIR/conversion.json."""
  import jax
  import orbax.checkpoint as ocp
  from flax import nnx
  if dtype not in DTYPES:
    raise ValueError(f'--dtype must be one of {DTYPES}, got {dtype!r}')
  subfolder = _converter(model).subfolder
  source = os.path.abspath(source)
  try:
    sd = load_source(source, subfolder)
    num_tensors = len(sd)
    state, naming = convert_state_dict(sd, model, dtype)
  except ValueError as e:
    msg = str(e)[len(source) + 2:] if str(e).startswith(source + ': ') else str(e)
    raise ValueError(f'{source} (--model={model}): {msg}') from None
  del sd
  np_dtype = np.dtype(jax.numpy.dtype(dtype))
  pure = jax.tree.map(lambda x: np.asarray(x).astype(np_dtype, copy=False), nnx.to_pure_dict(state))
  num_params = int(sum(math.prod(x.shape) for x in jax.tree.leaves(pure)))
  out = os.path.abspath(out)
  os.makedirs(out, exist_ok=True)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(out, 'params'), pure, force=True)
  ckptr.wait_until_finished()
  info = dict(model=model, source=source, naming=naming, dtype=dtype, num_tensors=num_tensors,
              num_params=num_params)
  with open(os.path.join(out, 'conversion.json'), 'w') as f:
    json.dump(info, f, indent=2)
  return info


def load_converted(out_dir, model=None, dtype=None):
  """Restores DIR/params as an nnx.State of the model's Params (host numpy values).

  `model`/`dtype` default to those in DIR/conversion.json; a given `model` must agree with it.
  Use with `cosmos_convert.merge_params(config, state)` / `video_vae_convert.merge_params(config, state)`.
  """
  import orbax.checkpoint as ocp
  from flax import nnx
  out_dir = os.path.abspath(out_dir)
  with open(os.path.join(out_dir, 'conversion.json')) as f:
    info = json.load(f)
  if model is not None and model != info['model']:
    raise ValueError(f'{out_dir} holds {info["model"]} params, not {model}')
  model, dtype = info['model'], dtype or info['dtype']
  state, target = _abstract_pure(model, dtype)
  restored = ocp.StandardCheckpointer().restore(os.path.join(out_dir, 'params'), target)
  nnx.replace_by_pure_dict(state, restored)
  return state


def load_converted_like(ckpt_dir, want, key):
  """`convert` output as a host pure dict cast to the dtypes of `want` (the configured model's pure dict
  of arrays or ShapeDtypeStructs). Raises ValueError naming the config `key` when the shapes differ
  (e.g. a cosmos14b checkpoint for a cosmos2b config)."""
  import jax
  from flax import nnx
  loaded = load_converted(ckpt_dir)
  if isinstance(loaded, nnx.State):
    loaded = nnx.to_pure_dict(loaded)
  shapes = lambda tree: jax.tree.map(lambda a: tuple(a.shape), tree)
  if shapes(want) != shapes(loaded):
    raise ValueError(f'{key}={ckpt_dir!r}: converted parameters do not match the configured model '
                     f'(first differences: {_first_differences(shapes(want), shapes(loaded))})')
  return jax.tree.map(lambda a, v: np.asarray(a, v.dtype), loaded, want)


def _first_differences(want, got, limit=5):
  import jax
  flat = lambda t: {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(t)[0]}
  w, g = flat(want), flat(got)
  diffs = [f'{k}: {w.get(k)} vs {g.get(k)}' for k in sorted(set(w) | set(g)) if w.get(k) != g.get(k)]
  return '; '.join(diffs[:limit]) + (f' (+{len(diffs) - limit} more)' if len(diffs) > limit else '')


# ------------------------------------------------------------------------------------------ CLI
class _ArgumentParser(argparse.ArgumentParser):
  """argparse answering a mistake in one line (ddrl_jax.cli's form) instead of usage + error."""

  def error(self, message):
    cli.fail(message, 'the flags are --source, --model, --out and --dtype')


def main(argv=None):
  first, rest = __doc__.split('\n', 1)       # the description once, the rest of the docstring after
  p = _ArgumentParser(prog='python -m ddrl_jax.models.convert', description=first,
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=rest)
  p.add_argument('--traceback', action='store_true', help='show the full traceback of an error')
  p.add_argument('--source', required=True, help='.pt/.pth, .safetensors or diffusers folder')
  from ddrl_jax.models import family as family_lib  # pylint: disable=g-import-not-at-top
  p.add_argument('--model', required=True, choices=tuple(family_lib.converters()),
                 help='the model to convert to (every family converter): ' + ', '.join(family_lib.converters()))
  p.add_argument('--out', required=True, help='output folder (orbax params/ + conversion.json)')
  p.add_argument('--dtype', default='float32', choices=DTYPES)
  args = p.parse_args(argv)
  try:
    info = convert(args.source, args.model, args.out, args.dtype)
  except (ValueError, FileNotFoundError) as e:
    if args.traceback or cli.wants_traceback():
      raise
    cli.fail('; '.join(line.strip() for line in str(e).splitlines() if line.strip()),
             'check --source and --model')
  print(f'converted {info["model"]} ({info["naming"]} naming, {info["num_tensors"]} tensors, '
        f'{info["num_params"]:,} params, {info["dtype"]}) from {info["source"]} -> {os.path.abspath(args.out)}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
