"""XLA flags that ddrl_jax's entry points add to XLA_FLAGS before the first JAX backend starts.

  --xla_cpu_experimental_ynn_fusion_type=dot
    XLA:CPU (jaxlib 0.10.2) hands dots, elementwise ops and reductions to YNNPACK fusions by default. Its
    reductions over a non-minor axis are slow: the adaLN shift/scale/gate gradients of the Cosmos DiT
    (sums of (B, T', H'W', D) over H'W') took 5-7 ms each on (64, 1, 64, 128), and the gradient phases
    of a DDRL iteration took 13.6 s against 8.8 s with YNNPACK used for dots alone (benchmarks/RESULTS.md,
    issue 13). A flag of XLA's CPU backend; the GPU and TPU backends do not read it.

JAX_PLATFORMS on a host without a TPU: an installed libtpu (the `aot` extra, for compiling TPU programs
on a CPU host) probes for TPU metadata when JAX starts and prints five `E0000 ... INVALID_ARGUMENT` lines on
a host that has none, so a user's first "error" is a false alarm. When JAX_PLATFORMS is not set and the
host has no TPU device files (/dev/accel*, /dev/vfio/<n>), `apply()` sets it to the platforms the host
has: 'cuda,cpu' with NVIDIA devices and JAX's CUDA plugin installed, else 'cpu'. (Compile-only TPU
topologies, `ddrl_jax.aot`, still work: they do not need the TPU platform to be a backend.)

The CLIs (`ddrl_jax.train`, `pretrain`, `aot`, `evaluate`), the benchmarks and the tests call `apply()`. A library
user who imports the losses into another program keeps their own XLA_FLAGS; they can call `apply()`
before their first JAX computation for the same effect. A flag the user already set is never changed.
"""
import glob
import importlib.util
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


def host_platforms(device_glob=glob.glob, find_spec=importlib.util.find_spec):
  """JAX_PLATFORMS for this host when it has no TPU ('cuda,cpu' or 'cpu'), or None when it has one."""
  if device_glob('/dev/accel*') or device_glob('/dev/vfio/[0-9]*'):
    return None
  cuda = device_glob('/dev/nvidia[0-9]*') and any(
      find_spec(m) is not None for m in ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax_plugins.xla_cuda12'))
  return 'cuda,cpu' if cuda else 'cpu'


def backends_started():
  """Whether a JAX backend has been created in this process (XLA_FLAGS is read only before that)."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  return bool(getattr(xla_bridge, '_backends', None))


def apply(environ=None):
  """Adds the defaults to environ['XLA_FLAGS'] (os.environ by default). Returns the new value.

  Raises RuntimeError if a JAX backend already started in this process, since XLA would ignore them."""
  environ = os.environ if environ is None else environ
  if not environ.get('JAX_PLATFORMS'):
    platforms = host_platforms()
    if platforms:
      environ['JAX_PLATFORMS'] = platforms
  value = with_defaults(environ.get('XLA_FLAGS', ''))
  if value != environ.get('XLA_FLAGS', '') and environ is os.environ and backends_started():
    raise RuntimeError('ddrl_jax.xla_flags.apply() must run before the first JAX computation: a backend '
                       f'has already started, so XLA would ignore XLA_FLAGS={value!r}')
  environ['XLA_FLAGS'] = value
  return value
