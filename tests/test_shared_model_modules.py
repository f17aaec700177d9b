"""The seam between model families and what they share: a family folder (ddrl_jax/models/<family>/) imports
no other family's folder, and the shared modules (ddrl_jax/models/*.py: the pipeline pieces autoencoder_kl,
autoencoder_kl_convert and hf_text, layers, attention, ...) import no family. What two families both
need moves up into a shared module rather than being imported across, or copied."""
import ast
import importlib.util
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, 'ddrl_jax', 'models')
SHARED_PIPELINE = ('autoencoder_kl', 'autoencoder_kl_convert', 'hf_text', 'video_vae', 'video_vae_convert')


def _families():
  """The family folders: the packages directly under ddrl_jax/models."""
  return sorted(d for d in os.listdir(MODELS) if os.path.isfile(os.path.join(MODELS, d, '__init__.py')))


def _py_files(folder):
  return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith('.py'))


def _docstrings(tree):
  """ids of the docstring nodes (module, class and function docstrings)."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        out.add(id(first.value))
  return out


def _referenced_modules(path):
  """The absolute module names a file imports anywhere (module level or inside functions), each `from a
  import b` as a.b, plus the 'ddrl_jax.models....' names its non-docstring strings hold (importlib)."""
  tree = ast.parse(open(path).read())
  package = os.path.relpath(os.path.dirname(path), ROOT).replace(os.sep, '.')
  out = set()
  docs = _docstrings(tree)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = importlib.util.resolve_name('.' * node.level + (node.module or ''), package)
      out |= {f'{base}.{a.name}' for a in node.names}
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
      out |= set(re.findall(r'ddrl_jax\.models\.\w+', node.value))
  return out


def _family_of(module):
  """The family folder a module name lies in, or None."""
  parts = module.split('.')
  if parts[:2] == ['ddrl_jax', 'models'] and len(parts) > 2 and parts[2] in _families():
    return parts[2]
  return None


def test_family_folders_are_found():
  assert {'sd3', 'wan', 'cosmos'} <= set(_families())


def test_no_family_imports_another_family():
  crossing = []
  for family in _families():
    for path in _py_files(os.path.join(MODELS, family)):
      for module in _referenced_modules(path):
        other = _family_of(module)
        if other is not None and other != family:
          crossing.append(f'{os.path.relpath(path, ROOT)} -> {module}')
  assert not crossing, 'cross-family imports (move the shared piece to ddrl_jax/models/*.py):\n' + '\n'.join(crossing)


def test_shared_modules_exist_and_import_no_family():
  for name in SHARED_PIPELINE:
    assert os.path.isfile(os.path.join(MODELS, name + '.py')), name
  bad = []
  for path in _py_files(MODELS):
    if os.path.basename(path) == 'family.py':
      continue       # the registry names every family's module by string, to import it on first use
    bad += [f'{os.path.relpath(path, ROOT)} -> {m}' for m in _referenced_modules(path) if _family_of(m)]
  assert not bad, 'shared modules importing a family:\n' + '\n'.join(bad)


def test_shared_modules_load_no_family_and_no_torch():
  """Importing the shared pipeline modules loads no family package, and no torch (it is imported on use)."""
  code = ('import sys\n'
          + ''.join(f'import ddrl_jax.models.{name}\n' for name in SHARED_PIPELINE)
          + 'print(sorted(m for m in sys.modules if m == "torch" or m.split(".")[:2] == ["ddrl_jax", "models"] '
            'and len(m.split(".")) > 2 and m.split(".")[2] in %r))' % (_families(),))
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert out.stdout.strip() == '[]', out.stdout

