"""Multi-process start-up: `jax.distributed.initialize` before any device query, and the compile cache.

Every host of a pod or cluster runs the same command; `initialize(options)` is the first thing the
train, pretrain and aot CLIs do. Which processes form the job comes from, in this order:

1. explicit options (the `--coordinator_address`, `--num_processes`, `--process_id`,
   `--local_device_ids` flags; JAX also reads JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
   JAX_PROCESS_ID and JAX_LOCAL_DEVICE_IDS);
2. the cluster the process runs in, which `jax.distributed.initialize()` then detects itself:
   Cloud TPU pod slices (GCE queued resources / `tpu-vm ssh --worker=all`, GKE JobSets), SLURM steps
   started by `srun` with more than one task, Open MPI (`mpirun`), Kubernetes indexed jobs;
3. nothing found: one process, and `initialize` does nothing.

CPU processes keep JAX's own settings: JAX_NUM_CPU_DEVICES (devices per process) and
JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo (cross-process collectives), e.g. two processes on one machine:

  JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=4 JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo \\
    python -m ddrl_jax.train --config=configs/toy2d.py --workdir=/tmp/w \\
      --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=0   # and =1 in a second shell
"""
import contextlib
import dataclasses
import importlib.util
import logging
import os
import sys
import traceback
from typing import Optional, Sequence

import jax

logger = logging.getLogger(__name__)

# Environment variables by which a launcher marks a multi-process job (read without any network query).
CLUSTER_MARKERS = (
    ('explicit', ('JAX_COORDINATOR_ADDRESS',)),
    ('cloud_tpu', ('MEGASCALE_COORDINATOR_ADDRESS', 'TPU_WORKER_HOSTNAMES', 'TPU_PROCESS_ADDRESSES')),
    ('slurm', ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')),
    ('open_mpi', ('OMPI_MCA_orte_hnp_uri',)),
    ('kubernetes', ('KUBERNETES_SERVICE_HOST', 'JOB_COMPLETION_INDEX')),
)


@dataclasses.dataclass
class Options:
  """How this process joins the job; None fields are left to JAX's auto-detection."""
  coordinator_address: Optional[str] = None    # 'host:port' of process 0's coordination service
  num_processes: Optional[int] = None
  process_id: Optional[int] = None
  local_device_ids: Optional[Sequence[int]] = None   # e.g. [3]: one GPU per process
  initialization_timeout: int = 300             # seconds to wait for every process to join
  heartbeat_timeout: int = 100                  # seconds of silence after which a process counts as dead
  shutdown_timeout: int = 300                   # seconds an exiting process waits for the others
  compilation_cache_dir: str = ''               # persistent XLA cache (a shared GCS / NFS path on pods)

  @property
  def explicit(self):
    return self.coordinator_address is not None or (self.num_processes or 1) > 1


def detect_cluster(environ=None):
  """The kind of multi-process launcher this process runs under, from its environment, or None.

  'explicit' (JAX_* variables), 'cloud_tpu' (a multi-host slice's worker list, or any TPU VM when
  reading the real environment), 'slurm' (an srun step of more than one task), 'open_mpi',
  'kubernetes' (an indexed job, with the kubernetes package installed)."""
  env = os.environ if environ is None else environ
  for name, keys in CLUSTER_MARKERS:
    if name == 'cloud_tpu':
      hosts = env.get('TPU_WORKER_HOSTNAMES', '') or env.get('TPU_PROCESS_ADDRESSES', '')
      if env.get('MEGASCALE_COORDINATOR_ADDRESS') or len([h for h in hosts.split(',') if h]) > 1:
        return name
    elif name == 'slurm':
      if all(k in env for k in keys) and int(env.get('SLURM_NTASKS', '1') or 1) > 1:
        return name
    elif name == 'kubernetes':
      # JAX's Kubernetes bootstrap needs the kubernetes package (pip install 'jax[k8s]').
      if all(k in env for k in keys) and importlib.util.find_spec('kubernetes') is not None:
        return name
    elif all(k in env for k in keys):
      return name
  if environ is None and _on_cloud_tpu_vm():
    # Any TPU VM: JAX asks the metadata server how many workers the slice has (one on a single-host
    # slice, which still gets JAX's preemption notices for maintenance events).
    return 'cloud_tpu'
  return None


def _on_cloud_tpu_vm():
  try:
    from jax._src import cloud_tpu_init  # pylint: disable=g-import-not-at-top
    return bool(cloud_tpu_init.running_in_cloud_tpu_vm)
  except ImportError:
    return False


def is_initialized():
  return jax.distributed.is_initialized()


def initialize(options=None, environ=None):
  """Joins the job (once; a no-op for one process) and sets the compilation cache. Returns a dict of
  what happened: {'initialized': bool, 'cluster': name or None, 'process_index', 'process_count'}.

  Must run before anything asks JAX for devices: the first device query fixes the process's view."""
  options = options or Options()
  if options.compilation_cache_dir:
    set_compilation_cache(options.compilation_cache_dir)
  if options.num_processes == 1 and options.coordinator_address is None:
    cluster = None                                          # explicitly one process
  else:
    cluster = 'flags' if options.explicit else detect_cluster(environ)
  started = False
  if cluster is not None and not is_initialized():
    jax.distributed.initialize(
        coordinator_address=options.coordinator_address, num_processes=options.num_processes,
        process_id=options.process_id,
        local_device_ids=list(options.local_device_ids) if options.local_device_ids else None,
        initialization_timeout=int(options.initialization_timeout),
        heartbeat_timeout_seconds=int(options.heartbeat_timeout),
        shutdown_timeout_seconds=int(options.shutdown_timeout))
    started = True
  info = dict(initialized=started or is_initialized(), cluster=cluster,
              process_index=jax.process_index(), process_count=jax.process_count())
  if info['process_count'] > 1:    # one process: the trainer's sharding line already names the devices
    log_topology(cluster)
  return info


def set_compilation_cache(path):
  """Persists compiled executables under `path` (every host reads the entries any host wrote)."""
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 1.0)


def log_topology(cluster=None):
  """One line per process: index, count, its devices and the global device count."""
  local = jax.local_devices()
  logger.info('process %d of %d (%s): %d local devices %s (%s); %d devices in all',
              jax.process_index(), jax.process_count(), cluster or 'single process', len(local),
              [d.id for d in local], local[0].device_kind if local else '?', jax.device_count())


@contextlib.contextmanager
def fail_fast():
  """On an exception in a multi-process job: print it and end this process at once (exit code 1).

  A normal exit would first wait up to the shutdown timeout for the other processes, which are
  themselves blocked in a collective waiting for this one; exiting at once closes its connections, so
  the others fail within seconds (or the coordinator's heartbeat timeout) instead of hanging."""
  try:
    yield
  except BaseException as e:  # pylint: disable=broad-except
    if jax.process_count() == 1 or isinstance(e, SystemExit) and not e.code:
      raise
    sys.stderr.write(f'process {jax.process_index()} of {jax.process_count()} failed:\n')
    traceback.print_exc()
    sys.stderr.flush()
    sys.stdout.flush()
    logging.shutdown()
    os._exit(1)


def is_main_process():
  """Process 0 writes metrics, TensorBoard, sample grids and shows the progress bar."""
  return jax.process_index() == 0


# ------------------------------------------------------------------------------------------ flags
def define_flags(flag_values=None):
  """Registers the start-up flags with absl (the CLIs call this from their own _define_flags)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FLAGS if flag_values is None else flag_values
  flags.DEFINE_string('coordinator_address', None,
                      "host:port of process 0's coordinator (default: detected from the cluster).",
                      flag_values=fv)
  flags.DEFINE_integer('num_processes', None, 'Processes in the job (default: detected).', flag_values=fv)
  flags.DEFINE_integer('process_id', None, 'This process, 0..num_processes-1 (default: detected).',
                       flag_values=fv)
  flags.DEFINE_list('local_device_ids', None, 'Devices this process uses, e.g. 0 (one GPU per process).',
                    flag_values=fv)
  flags.DEFINE_integer('initialization_timeout', 300, 'Seconds to wait for every process to join.',
                       flag_values=fv)
  flags.DEFINE_integer('heartbeat_timeout', 100, 'Seconds of silence after which a process is dead.',
                       flag_values=fv)
  flags.DEFINE_string('compilation_cache_dir', '', 'Persistent XLA compilation cache (shared path).',
                      flag_values=fv)


def options_from_flags(flag_values=None):
  """The Options of the parsed start-up flags."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS if flag_values is None else flag_values
  ids = f.local_device_ids
  return Options(coordinator_address=f.coordinator_address, num_processes=f.num_processes,
                 process_id=f.process_id, local_device_ids=[int(i) for i in ids] if ids else None,
                 initialization_timeout=f.initialization_timeout,
                 heartbeat_timeout=f.heartbeat_timeout, compilation_cache_dir=f.compilation_cache_dir)
