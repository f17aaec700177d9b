"""ddrl_jax.xla_flags: defaults are added to XLA_FLAGS once, never override the user's, and are live here."""
import os

import jax
import pytest

from ddrl_jax import xla_flags


def test_defaults_added_to_an_empty_environment():
  env = {}
  assert xla_flags.apply(env) == '--xla_cpu_experimental_ynn_fusion_type=dot'
  assert env['XLA_FLAGS'] == '--xla_cpu_experimental_ynn_fusion_type=dot'


def test_user_flags_kept_and_defaults_appended_once():
  value = xla_flags.with_defaults('--xla_dump_to=/tmp/d')
  assert value == '--xla_dump_to=/tmp/d --xla_cpu_experimental_ynn_fusion_type=dot'
  assert xla_flags.with_defaults(value) == value


@pytest.mark.parametrize('given', ['--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce',
                                   '-xla_cpu_experimental_ynn_fusion_type=reduce --xla_dump_to=/tmp/d'])
def test_a_flag_the_user_set_is_not_changed(given):
  assert xla_flags.with_defaults(given) == given


def test_the_users_string_is_kept_as_written():
  """Quotes and spacing are not re-tokenized (a quoted path with a space stays one value)."""
  given = '--xla_dump_to="/tmp/a b"  --xla_cpu_use_thunk_runtime=true'
  assert xla_flags.with_defaults(given) == given + ' --xla_cpu_experimental_ynn_fusion_type=dot'
  assert xla_flags.with_defaults("--xla_dump_to='unmatched") == (
      "--xla_dump_to='unmatched --xla_cpu_experimental_ynn_fusion_type=dot")


def test_apply_after_a_backend_started_is_an_error(monkeypatch):
  jax.numpy.zeros(1).block_until_ready()
  monkeypatch.setenv('XLA_FLAGS', '')
  with pytest.raises(RuntimeError, match='before the first JAX computation'):
    xla_flags.apply()


def test_the_suite_runs_with_the_defaults():
  """conftest applies them before the backend starts: the compiled program hands XLA:CPU's YNNPACK only
  the dot, not the reduction that follows it."""
  hlo = jax.jit(lambda a: (a @ a).sum(0)).lower(jax.numpy.ones((64, 64))).compile().as_text()
  fusions = [line for line in hlo.splitlines() if '__ynn_fusion' in line]
  assert fusions and all('reduce' not in line for line in fusions)


def test_no_tpu_host_gets_its_own_platforms_and_a_tpu_host_is_left_alone():
  none = lambda pattern: []
  gpus = lambda pattern: ['/dev/nvidia0'] if pattern.startswith('/dev/nvidia') else []
  tpu = lambda pattern: ['/dev/vfio/0'] if pattern.startswith('/dev/vfio') else []
  found = lambda name: object()
  missing = lambda name: None
  assert xla_flags.host_platforms(none, found) == 'cpu'
  assert xla_flags.host_platforms(gpus, found) == 'cuda,cpu'
  assert xla_flags.host_platforms(gpus, missing) == 'cpu'        # no JAX CUDA plugin: cpu only
  assert xla_flags.host_platforms(tpu, found) is None
  env = {'JAX_PLATFORMS': 'tpu'}
  xla_flags.apply(env)
  assert env['JAX_PLATFORMS'] == 'tpu'                           # the user's choice is kept


def test_a_cpu_run_with_libtpu_installed_prints_no_tpu_errors():
  """With libtpu installed (the aot extra) and no TPU, a CLI's JAX start prints no E0000 lines."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  if xla_flags.host_platforms() is None:
    pytest.skip('this host has a TPU')
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  code = 'import ddrl_jax, jax; print(jax.devices()[0].platform)'      # importing ddrl_jax is enough
  run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120, env=env)
  assert run.returncode == 0 and run.stdout.strip() in ('cpu', 'gpu'), run.stderr[-1000:]
  assert 'E0000' not in run.stderr and 'INVALID_ARGUMENT' not in run.stderr, run.stderr[-1000:]


def test_compile_only_tpu_devices_on_a_cpu_host_print_nothing():
  """aot's compile-only TPU devices load libtpu on a host without chips; named accelerator type and
  worker (parallel/topology.py) keep libtpu's five INVALID_ARGUMENT lines off stderr."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  if importlib.util.find_spec('libtpu') is None:
    pytest.skip("needs libtpu: pip install -e '.[aot]'")
  if xla_flags.host_platforms() is None:
    pytest.skip('this host has a TPU')
  env = {k: v for k, v in os.environ.items() if not k.startswith('TPU_')}
  code = ('from ddrl_jax.parallel import topology; d = topology.topology_devices("v5p-8"); '
          'print(len(d), d[0].platform)')
  run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300, env=env)
  assert run.returncode == 0 and run.stdout.split() == ['4', 'tpu'], run.stderr[-1000:]
  assert run.stderr.strip() == '', run.stderr[-1000:]
