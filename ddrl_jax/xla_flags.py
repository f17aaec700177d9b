"""XLA flags that ddrl_jax's entry points add to XLA_FLAGS before the first JAX backend starts.

  --xla_cpu_experimental_ynn_fusion_type=dot
    XLA:CPU (jaxlib 0.10.2) hands dots, elementwise ops and reductions to YNNPACK fusions by default. Its
    reductions over a non-minor axis are slow: the adaLN shift/scale/gate gradients of the Cosmos DiT
    (sums of (B, T', H'W', D) over H'W') took 5-7 ms each on (64, 1, 64, 128), and the gradient phases
    of a DDRL iteration took 13.6 s against 8.8 s with YNNPACK used for dots alone (benchmarks/RESULTS.md,
    issue 13). A flag of XLA's CPU backend; the GPU and TPU backends do not read it.

The CLIs (`ddrl_jax.train`, `pretrain`, `aot`), the benchmarks and the tests call `apply()`. A library
user who imports the losses into another program keeps their own XLA_FLAGS; they can call `apply()`
before their first JAX computation for the same effect. A flag the user already set is never changed.
"""
import os
import re

DEFAULTS = {'xla_cpu_experimental_ynn_fusion_type': 'dot'}


def with_defaults(xla_flags, defaults=None):
  """`xla_flags` (an XLA_FLAGS string, kept as written) with ' --name=value' appended for every flag of
  `defaults` ({name: value}) it does not mention."""
  defaults = DEFAULTS if defaults is None else defaults
  value = xla_flags or ''
  for name, default in defaults.items():
    if not re.search(rf'(^|\s)--?{re.escape(name)}(=|\s|$)', value):
      value = f'{value} --{name}={default}'.strip()
  return value


def backends_started():
  """Whether a JAX backend has been created in this process (XLA_FLAGS is read only before that)."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  return bool(getattr(xla_bridge, '_backends', None))


def apply(environ=None):
  """Adds the defaults to environ['XLA_FLAGS'] (os.environ by default). Returns the new value.

  Raises RuntimeError if a JAX backend already started in this process, since XLA would ignore them."""
  environ = os.environ if environ is None else environ
  value = with_defaults(environ.get('XLA_FLAGS', ''))
  if value != environ.get('XLA_FLAGS', '') and environ is os.environ and backends_started():
    raise RuntimeError('ddrl_jax.xla_flags.apply() must run before the first JAX computation: a backend '
                       f'has already started, so XLA would ignore XLA_FLAGS={value!r}')
  environ['XLA_FLAGS'] = value
  return value
