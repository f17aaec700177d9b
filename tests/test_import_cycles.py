"""No import cycle in ddrl_jax/: the module-level imports of every module (with the packages each import
loads on the way) form a graph without cycles. Imports inside functions (deferred on purpose, e.g. the
CLIs' heavy dependencies) are not edges."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules():
  """{dotted module name: path} of ddrl_jax (packages by their own name)."""
  out = {}
  for folder, _, files in os.walk(os.path.join(ROOT, 'ddrl_jax')):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, '.')
        out[dotted[:-len('.__init__')] if dotted.endswith('.__init__') else dotted] = path
  return out


def _module_level_statements(tree):
  """The statements that run on import: the module body, with `if` / `try` blocks opened."""
  todo, out = list(tree.body), []
  while todo:
    node = todo.pop()
    out.append(node)
    if isinstance(node, (ast.If, ast.Try)):
      todo += node.body + node.orelse + getattr(node, 'finalbody', []) + [
          s for h in getattr(node, 'handlers', []) for s in h.body]
  return out


def import_graph():
  """{module: set of ddrl_jax modules its import runs first}."""
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    package = name if path.endswith('__init__.py') else name.rsplit('.', 1)[0]
    targets = set()
    for node in _module_level_statements(ast.parse(open(path).read())):
      if isinstance(node, ast.Import):
        targets |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ''
        if node.level:
          parts = package.split('.')
          base = '.'.join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
        targets |= {f'{base}.{a.name}' if f'{base}.{a.name}' in modules else base for a in node.names}
    deps = set()
    for target in targets:
      parts = target.split('.')
      for k in range(2, len(parts) + 1):          # importing a.b.c loads a.b first
        prefix = '.'.join(parts[:k])
        if prefix in modules and prefix != name and not name.startswith(prefix + '.'):
          deps.add(prefix)
    graph[name] = deps
  return graph


def cycles(graph):
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in graph:
    if v not in index:
      visit(v)
  return found


def test_no_import_cycle_in_ddrl_jax():
  graph = import_graph()
  assert len(graph) > 100 and graph['ddrl_jax.trainer'] >= {'ddrl_jax.program', 'ddrl_jax.update'}
  assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
  assert cycles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == [['a', 'b', 'c']]
  assert cycles({'a': {'b'}, 'b': set()}) == []
