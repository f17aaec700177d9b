"""The README's plain-JAX example runs as written."""
import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'README.md')


def test_readme_starts_with_two_commands():
  text = open(README).read()
  first_block = re.search(r'```bash\n(.*?)```', text, re.S).group(1).strip().splitlines()
  assert len(first_block) == 2
  assert 'python -m ddrl_jax.train --config=configs/ocr_tiny.py' in first_block[0]
  assert 'python -m pytest' in first_block[1]
  assert text.index('```bash') < text.index('```python')


def test_readme_example_runs(capsys):
  text = open(README).read()
  marker = text.index('README example')
  code = re.search(r'```python\n(.*?)```', text[marker:], re.S).group(1)
  namespace = {}
  exec(compile(code, 'README.md', 'exec'), namespace)
  loss, metrics, grads = namespace['loss'], namespace['metrics'], namespace['grads']
  assert __import__('numpy').isfinite(float(loss))
  assert float(metrics['ratio_mean']) > 0.99
  assert all(float(abs(g).sum()) > 0 for g in __import__('jax').tree.leaves(grads))
  assert 'data_loss' in metrics and float(metrics['data_loss']) > 0
  assert capsys.readouterr().out.strip()
