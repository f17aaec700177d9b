"""launch/: the launch scripts' --dry-run commands fit the configs' meshes.

Nothing here reaches gcloud, xpk, sbatch, srun or docker: those names are stubs on PATH that record a
call (and every test checks none happened). What is checked, for each script x {cosmos2b, cosmos14b}:
the hardware the printed commands ask for (TPU: chips of the slice by ddrl_jax.parallel.topology; GPU:
sbatch --nodes x GPUs per node) equals the config's mesh size (parallel.mesh_shape), the slice name is
one the AOT tool knows, the train command is `python -m ddrl_jax.train --config=<that config>` and parses
with ddrl_jax.train's own flags, the LIBTPU_INIT_ARGS / XLA_FLAGS presets are there and known to
libtpu / jaxlib, and bad input exits non-zero with a message. Also bash -n / shellcheck, the
Dockerfiles, and launch/README.md's table.
"""
import functools
import importlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from ddrl_jax import parallel
from ddrl_jax.parallel import topology

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, 'launch')
GCLOUD = 'launch/tpu/gcloud_v5p.sh'
XPK = 'launch/tpu/xpk_v5p.sh'
SLURM = 'launch/gpu/slurm.sbatch'
SCRIPTS = (GCLOUD, XPK, SLURM)
CONFIGS = ('configs/cosmos2b.py', 'configs/cosmos14b.py')
STUBS = ('gcloud', 'xpk', 'sbatch', 'srun', 'docker', 'redis-server')
# Required options of each script (the test values), before the variant's own.
BASE_ARGS = {
    GCLOUD: ('--zone=us-east5-a', '--workdir=gs://bucket/run'),
    XPK: ('--cluster=c1', '--docker-image=gcr.io/proj/ddrl:tpu', '--workdir=gs://bucket/run'),
    SLURM: ('--workdir=/shared/run',),
}
TPU_FLAGS = ('--xla_tpu_enable_async_collective_fusion=true',
             '--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true',
             '--xla_tpu_enable_async_collective_fusion_multiple_steps=true',
             '--xla_tpu_overlap_compute_collective_tc=true', '--xla_enable_async_all_gather=true',
             '--xla_tpu_enable_async_all_to_all=true',
             '--xla_tpu_enable_data_parallel_all_reduce_opt=true',
             '--xla_tpu_enable_latency_hiding_scheduler=true')
GPU_FLAGS = ('--xla_gpu_enable_latency_hiding_scheduler=true', '--xla_gpu_enable_triton_gemm=false',
             '--xla_gpu_enable_command_buffer=')


# ------------------------------------------------------------------------------------- helpers
@functools.lru_cache(maxsize=None)
def mesh_size(config_path):
  """Devices of the config's mesh: the product of parallel.mesh_shape (the full configs have no -1)."""
  module = importlib.import_module('configs.' + os.path.splitext(os.path.basename(config_path))[0])
  mesh = module.get_config().mesh
  sizes = [int(mesh[a]) for a in parallel.AXES]
  assert -1 not in sizes, mesh
  return math.prod(parallel.mesh_shape(mesh, math.prod(sizes)))


def mesh_desc(config_path):
  module = importlib.import_module('configs.' + os.path.splitext(os.path.basename(config_path))[0])
  shape = parallel.mesh_shape(module.get_config().mesh, mesh_size(config_path))
  return ' x '.join(f'{a}{s}' for a, s in zip(parallel.AXES, shape))


def v5p_slice(chips):
  """The AOT table's v5p slice with this many chips (counted by topology, not re-derived here)."""
  names = [n for n, t in topology.TOPOLOGIES.items() if n.startswith('v5p-') and t.num_chips == chips]
  assert len(names) == 1, (chips, names)
  return names[0]


@pytest.fixture(scope='module')
def stub_bin(tmp_path_factory):
  """A PATH dir whose gcloud/xpk/sbatch/srun/docker/redis-server record the call and fail."""
  d = tmp_path_factory.mktemp('stub_bin')
  calls = d / 'calls.log'
  for name in STUBS:
    p = d / name
    p.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\nexit 97\n')
    p.chmod(0o755)
  return d


def _env(stub_bin, extra=None):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith('SLURM_') and k not in ('XLA_FLAGS', 'LIBTPU_INIT_ARGS', 'DDRL_WORKDIR',
                                                     'DDRL_REWARD_TOKEN', 'TRAIN_PYTHON')}
  env.update(JAX_PLATFORMS='cpu', PYTHON=sys.executable, PATH=f'{stub_bin}{os.pathsep}{env["PATH"]}')
  env.update(extra or {})
  return env


class Result:
  """A finished script run: rc, stdout, stderr, and the '+ ' lines split into argv lists."""

  def __init__(self, args, proc, stub_bin):
    self.args, self.rc = args, proc.returncode
    self.out, self.err = proc.stdout, proc.stderr
    self.lines = [l[2:] for l in self.out.splitlines() if l.startswith('+ ')]
    self.commands = [shlex.split(l) for l in self.lines]
    calls = stub_bin / 'calls.log'
    self.calls = calls.read_text() if calls.exists() else ''

  def find(self, *words):
    """The commands that start with these words."""
    return [c for c in self.commands if tuple(c[:len(words)]) == words]

  def one(self, *words):
    found = self.find(*words)
    assert len(found) == 1, (words, self.lines)
    return found[0]


def run_script(stub_bin, script, *args, env=None):
  proc = subprocess.run(['bash', script, *args], cwd=REPO, env=_env(stub_bin, env), capture_output=True,
                        text=True, timeout=120, check=False)
  result = Result(args, proc, stub_bin)
  assert not result.calls, f'{script} {args} called {result.calls}'
  return result


@pytest.fixture(scope='module')
def dry(stub_bin):
  """Runs (and caches) `bash SCRIPT --dry-run --config=CONFIG <base args> *variant`; must exit 0."""
  cache = {}

  def get(script, config, *variant, env=None):
    key = (script, config, variant, tuple(sorted((env or {}).items())))
    if key not in cache:
      r = run_script(stub_bin, script, '--dry-run', f'--config={config}', *BASE_ARGS[script], *variant,
                     env=env)
      assert r.rc == 0, (script, config, variant, r.err)
      cache[key] = r
    return cache[key]
  return get


def opt(argv, name):
  """The value of --name=V or --name V in argv (exactly one occurrence)."""
  values = [a.split('=', 1)[1] for a in argv if a.startswith(name + '=')]
  values += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
  assert len(values) == 1, (name, argv)
  return values[0]


def split_sbatch(words):
  """An sbatch line -> (sbatch and its options, the script's own arguments)."""
  at = [i for i, w in enumerate(words) if w.endswith('launch/gpu/slurm.sbatch')]
  assert len(at) == 1, words
  return words[:at[0]], words[at[0] + 1:]


def slurm_header():
  """{option: value} of the SLURM script's #SBATCH lines (what a plain `sbatch SCRIPT` asks for)."""
  with open(os.path.join(REPO, SLURM)) as f:
    return dict(re.findall(r'^#SBATCH (--[a-z-]+)(?:=(\S*))?', f.read(), re.M))


def train_argv(words):
  """The flags after `python[3] -m ddrl_jax.train` in a word list (exactly one train command)."""
  idx = [i for i in range(1, len(words) - 1)
         if words[i] == '-m' and words[i + 1] == 'ddrl_jax.train'
         and re.fullmatch(r'(.*/)?python3?', words[i - 1])]
  assert len(idx) == 1, words
  rest = words[idx[0] + 2:]
  return rest[:rest.index('&&')] if '&&' in rest else rest


def remote_words(command):
  """A remote --command string split into words (it is itself a shell line)."""
  return shlex.split(command)


def env_assignment(words, name):
  values = [w.split('=', 1)[1] for w in words if w.startswith(name + '=')]
  assert len(values) == 1, (name, words)
  return values[0]


def check_train(argv, config, workdir):
  assert opt(argv, '--config') == config
  assert opt(argv, '--workdir') == workdir
  assert opt(argv, '--compilation_cache_dir') == workdir + '/xla_cache'


def check_libtpu(value):
  flags = value.split()
  for f in TPU_FLAGS:
    assert f in flags, (f, flags)


# --------------------------------------------------------------------------------- syntax, help
@pytest.mark.parametrize('script', SCRIPTS)
def test_bash_syntax(script):
  proc = subprocess.run(['bash', '-n', script], cwd=REPO, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr


def test_shellcheck():
  if shutil.which('shellcheck') is None:
    if os.environ.get('DDRL_REQUIRE_SHELLCHECK'):
      pytest.fail("shellcheck is not installed (.ci/run installs Debian's shellcheck)")
    pytest.skip('shellcheck is not installed')
  proc = subprocess.run(['shellcheck', '-s', 'bash', *SCRIPTS], cwd=REPO, capture_output=True, text=True,
                        check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize('script', SCRIPTS)
def test_help(stub_bin, script):
  r = run_script(stub_bin, script, '--help')
  assert r.rc == 0 and 'Usage:' in r.out and '--dry-run' in r.out, r.err
  assert not r.commands


@pytest.mark.parametrize('script', SCRIPTS)
def test_unknown_option_fails(stub_bin, script):
  r = run_script(stub_bin, script, '--dry-run', *BASE_ARGS[script], '--bogus-option=1')
  assert r.rc != 0 and 'unknown option: --bogus-option' in r.err, (r.rc, r.err)
  assert not r.commands


@pytest.mark.parametrize('script,drop', [(GCLOUD, '--zone'), (XPK, '--cluster'), (XPK, '--docker-image')])
def test_missing_required_option_fails(stub_bin, script, drop):
  args = [a for a in BASE_ARGS[script] if not a.startswith(drop + '=')]
  r = run_script(stub_bin, script, '--dry-run', *args)
  assert r.rc != 0 and drop in r.err and not r.commands, (r.rc, r.err)


# ------------------------------------------------------------------------------------------ TPU
@pytest.mark.parametrize('queued', [True, False], ids=['queued', 'create'])
@pytest.mark.parametrize('config', CONFIGS)
def test_gcloud_dry_run(dry, config, queued):
  r = dry(GCLOUD, config, *(['--queued'] if queued else []))
  if queued:
    create = r.one('gcloud', 'compute', 'tpus', 'queued-resources', 'create')
    name = create[5]
    assert opt(create, '--node-id') == name
    assert opt(create, '--runtime-version') == 'v2-alpha-tpuv5'
    describe = r.one('gcloud', 'compute', 'tpus', 'queued-resources', 'describe')
    assert 'state.state' in opt(describe, '--format')
    assert not r.find('gcloud', 'compute', 'tpus', 'tpu-vm', 'create')
  else:
    create = r.one('gcloud', 'compute', 'tpus', 'tpu-vm', 'create')
    name = create[5]
    assert opt(create, '--version') == 'v2-alpha-tpuv5'
    assert not r.find('gcloud', 'compute', 'tpus', 'queued-resources', 'create')
  assert opt(create, '--zone') == 'us-east5-a'
  accelerator = opt(create, '--accelerator-type')
  assert accelerator in topology.known_topologies()
  assert topology.topology(accelerator).num_chips == mesh_size(config)
  assert set(re.findall(r'v5p-[0-9]+', r.out)) == {accelerator}   # every command names the same slice

  ssh = r.find('gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh')
  assert ssh and all(c[5] == name and '--worker=all' in c and opt(c, '--zone') == 'us-east5-a'
                     for c in ssh)
  remote = [opt(c, '--command') for c in ssh]
  assert any("pip install -e '.[tpu,video]'" in c for c in remote), remote
  train = [remote_words(c) for c in remote if 'ddrl_jax.train' in c]
  assert len(train) == 1, remote
  assert '~/ddrl_venv/bin/python -m ddrl_jax.train' in ' '.join(train[0])
  install = [c for c in remote if 'pip install -e' in c][0]
  assert 'python3.11 -m venv ~/ddrl_venv' in install      # jax 0.10.2 needs Python >= 3.11
  check_train(train_argv(train[0]), config, 'gs://bucket/run')
  check_libtpu(env_assignment(train[0], 'LIBTPU_INIT_ARGS'))


def test_gcloud_git_repo_and_extra_flags(dry):
  r = dry(GCLOUD, 'configs/cosmos2b.py', '--repo=https://example.com/ddrl_jax.git', '--project=p1', '--',
          '--config.num_iterations=2')
  assert not r.find('tar') and not r.find('gcloud', 'compute', 'tpus', 'tpu-vm', 'scp')
  ssh = r.find('gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh')
  assert all(opt(c, '--project') == 'p1' for c in r.find('gcloud'))
  assert any('git clone https://example.com/ddrl_jax.git' in opt(c, '--command') for c in ssh)
  train = [remote_words(opt(c, '--command')) for c in ssh if 'ddrl_jax.train' in opt(c, '--command')]
  assert train_argv(train[0])[-1] == '--config.num_iterations=2'


@pytest.mark.parametrize('config', CONFIGS)
def test_xpk_dry_run(dry, config):
  r = dry(XPK, config, '--build')
  xpk = r.one('xpk', 'workload', 'create')
  accelerator = opt(xpk, '--device-type')
  assert accelerator in topology.known_topologies()
  assert topology.topology(accelerator).num_chips == mesh_size(config)
  assert set(re.findall(r'v5p-[0-9]+', r.out)) == {accelerator}
  assert opt(xpk, '--num-slices') == '1' and opt(xpk, '--cluster') == 'c1'
  assert opt(xpk, '--docker-image') == 'gcr.io/proj/ddrl:tpu'
  assert re.fullmatch(r'[a-z]([-a-z0-9]*[a-z0-9])?', opt(xpk, '--workload'))
  assert len(opt(xpk, '--workload')) <= 40
  words = remote_words(opt(xpk, '--command'))
  assert 'python -m ddrl_jax.train' in ' '.join(words)
  check_train(train_argv(words), config, 'gs://bucket/run')
  check_libtpu(env_assignment(words, 'LIBTPU_INIT_ARGS'))
  build = r.one('docker', 'build')
  assert opt(build, '-f').endswith('launch/docker/Dockerfile.tpu') and opt(build, '-t') == 'gcr.io/proj/ddrl:tpu'
  assert r.one('docker', 'push')[2] == 'gcr.io/proj/ddrl:tpu'


@pytest.mark.parametrize('script,flag', [(GCLOUD, '--accelerator'), (XPK, '--device-type')])
def test_tpu_slice_must_fit_the_mesh(stub_bin, script, flag):
  # cosmos2b needs 256 chips: v5p-512. v5p-1024 has 512; v5p-999 is no slice at all.
  for wrong, message in (('v5p-1024', 'needs 256'), ('v5p-999', 'unknown accelerator')):
    r = run_script(stub_bin, script, '--dry-run', '--config=configs/cosmos2b.py', *BASE_ARGS[script],
                   f'{flag}={wrong}')
    assert r.rc != 0 and message in r.err and not r.commands, (wrong, r.rc, r.err)
  r = run_script(stub_bin, script, '--dry-run', '--config=configs/cosmos2b.py', *BASE_ARGS[script],
                 f'{flag}=v5p-512')
  assert r.rc == 0, r.err


def test_mesh_override_changes_the_slice(dry):
  # --config.mesh.data=4 after `--`: 4 x 8 x 2 = 64 devices -> the 64-chip slice, for render and train.
  r = dry(GCLOUD, 'configs/cosmos2b.py', '--', '--config.mesh.data=4')
  create = r.one('gcloud', 'compute', 'tpus', 'tpu-vm', 'create')
  assert topology.topology(opt(create, '--accelerator-type')).num_chips == 64


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.parametrize('config', CONFIGS)
def test_slurm_submit_dry_run(dry, config):
  r = dry(SLURM, config)
  sbatch, script_args = split_sbatch(r.one('sbatch'))
  nodes, gpn = int(opt(sbatch, '--nodes')), int(opt(sbatch, '--gpus-per-node'))
  assert gpn == 8 and int(opt(sbatch, '--ntasks-per-node')) == gpn     # one process per GPU
  assert nodes * gpn == mesh_size(config)
  assert '--exclusive' in sbatch
  assert opt(script_args, '--config') == config
  assert opt(script_args, '--workdir') == '/shared/run'

  srun = r.one('srun')            # --rewards=local: the training step alone
  assert int(opt(srun, '--nodes')) == nodes and int(opt(srun, '--ntasks-per-node')) == gpn
  assert '--gpus-per-task' not in ' '.join(srun) and '--gpu-bind' not in ' '.join(srun)
  assert 'python -m ddrl_jax.train' in ' '.join(srun)
  check_train(train_argv(srun), config, '/shared/run')
  exports = dict(c[1].split('=', 1) for c in r.find('export'))
  assert exports['XLA_PYTHON_CLIENT_MEM_FRACTION'] == '0.9'
  assert exports['NCCL_DEBUG'] == 'WARN'
  for f in GPU_FLAGS:
    assert f in exports['XLA_FLAGS'].split(), f


def test_slurm_header_is_cosmos2b():
  header = slurm_header()
  assert int(header['--nodes']) * int(header['--gpus-per-node']) == mesh_size('configs/cosmos2b.py')
  assert header['--ntasks-per-node'] == header['--gpus-per-node']
  assert '--exclusive' in header


@pytest.mark.parametrize('config', CONFIGS)
def test_slurm_in_job_checks_the_node_count(stub_bin, config):
  # Inside a 32-node job (the header's): cosmos2b runs its steps, cosmos14b (128 nodes) refuses.
  env = dict(SLURM_JOB_ID='123', SLURM_JOB_NUM_NODES='32', SLURM_SUBMIT_DIR=REPO)
  r = run_script(stub_bin, SLURM, '--dry-run', f'--config={config}', *BASE_ARGS[SLURM], env=env)
  if mesh_size(config) == 32 * 8:
    assert r.rc == 0, r.err
    assert not r.find('sbatch')
    assert int(opt(r.one('srun'), '--nodes')) == 32
  else:
    assert r.rc != 0 and f'needs {mesh_size(config)}' in r.err and not r.commands, r.err


def test_slurm_redis_rewards(dry, stub_bin):
  url = 'redis://redis-host:6379/0'
  r = dry(SLURM, 'configs/cosmos2b.py', '--rewards=redis', f'--redis-url={url}', '--reward-workers=4')
  sruns = r.find('srun')
  serve = [c for c in sruns if 'ddrl_jax.rewards.serve' in c]
  train = [c for c in sruns if 'ddrl_jax.train' in c]
  assert len(serve) == 1 and len(train) == 1, r.lines
  assert int(opt(serve[0], '--ntasks-per-node')) == 1 and '--overlap' in serve[0]
  assert int(opt(serve[0], '--nodes')) == int(opt(train[0], '--nodes'))
  assert opt(serve[0], '--redis') == url and opt(serve[0], '--workers') == '4'
  assert 'CUDA_VISIBLE_DEVICES=' in serve[0] and 'JAX_PLATFORMS=cpu' in serve[0]
  argv = train_argv(train[0])
  assert opt(argv, '--config.reward.backend') == 'redis' and opt(argv, '--config.reward.redis_url') == url
  # The sbatch line hands the reward options on to the job.
  script_args = split_sbatch(r.one('sbatch'))[1]
  assert opt(script_args, '--rewards') == 'redis' and opt(script_args, '--redis-url') == url

  bad = run_script(stub_bin, SLURM, '--dry-run', *BASE_ARGS[SLURM], '--rewards=redis')
  assert bad.rc != 0 and '--redis-url' in bad.err and not bad.commands


# ----------------------------------------------------- the rendered commands against the real CLIs
_PARSE_TRAIN = r'''
import json, sys
from absl import flags
from ddrl_jax import cli, train
train._define_flags()
cli.parse_flags(['ddrl_jax.train'] + sys.argv[1:])
f = flags.FLAGS
print(json.dumps(dict(workdir=f.workdir,
                      cache=f.compilation_cache_dir, backend=f.config.reward.backend,
                      redis_url=f.config.reward.redis_url, mesh=dict(f.config.mesh))))
'''
_PARSE_SERVE = r'''
import json, sys
from absl import flags
from ddrl_jax.rewards import serve
flags.FLAGS(['serve'] + sys.argv[1:])
print(json.dumps(dict(redis=flags.FLAGS.redis, workers=flags.FLAGS.workers)))
'''


def _python(code, argv):
  return subprocess.Popen([sys.executable, '-c', code, *argv], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS='cpu'),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_train_commands_parse_with_the_train_flags(dry):
  """Every rendered train command is accepted by ddrl_jax.train's absl flags and config overrides (an
  unknown flag or --config.* key fails here), and the serve command by ddrl_jax.rewards.serve's."""
  url = 'redis://redis-host:6379/0'
  commands = []
  for config in CONFIGS:
    ssh = dry(GCLOUD, config, '--queued').find('gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh')
    commands += [train_argv(remote_words(opt(c, '--command'))) for c in ssh
                 if 'ddrl_jax.train' in opt(c, '--command')]
    commands.append(train_argv(remote_words(opt(dry(XPK, config, '--build').one('xpk'), '--command'))))
    commands.append(train_argv(dry(SLURM, config).one('srun')))
  redis = dry(SLURM, 'configs/cosmos2b.py', '--rewards=redis', f'--redis-url={url}', '--reward-workers=4')
  commands.append(train_argv([c for c in redis.find('srun') if 'ddrl_jax.train' in c][0]))
  serve = [c for c in redis.find('srun') if 'ddrl_jax.rewards.serve' in c][0]
  serve_argv = serve[serve.index('ddrl_jax.rewards.serve') + 1:]

  procs = [_python(_PARSE_TRAIN, argv) for argv in commands] + [_python(_PARSE_SERVE, serve_argv)]
  outs = []
  for p in procs:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    outs.append(json.loads(out.strip().splitlines()[-1]))
  for argv, parsed in zip(commands, outs[:-1]):
    assert parsed['workdir'] == opt(argv, '--workdir')
    assert parsed['cache'] == opt(argv, '--compilation_cache_dir')
    assert math.prod(parsed['mesh'].values()) == mesh_size(opt(argv, '--config'))
  assert outs[-2]['backend'] == 'redis' and outs[-2]['redis_url'] == url
  assert outs[-1] == dict(redis=url, workers=4)


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason="libtpu is not installed (pip install -e '.[aot]')")
def test_libtpu_knows_the_preset(dry):
  """libtpu parses LIBTPU_INIT_ARGS when it starts (an unknown flag aborts it), here for a compile-only
  v5p topology; a bogus flag next to the preset must fail the same check."""
  words = remote_words(opt(dry(XPK, 'configs/cosmos2b.py', '--build').one('xpk'), '--command'))
  preset = env_assignment(words, 'LIBTPU_INIT_ARGS')
  code = ('import jax, jax.numpy as jnp, numpy as np\n'
          'from ddrl_jax.parallel import topology\n'
          "devs = topology.topology_devices('v5p-8')\n"
          "mesh = jax.sharding.Mesh(np.asarray(devs), ('x',))\n"
          "s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x'))\n"
          'jax.jit(lambda a: a.sum(), in_shardings=s).lower(jax.ShapeDtypeStruct((8, 128), jnp.float32)).compile()\n'
          "print('compiled')\n")
  results = []
  for value in (preset, preset + ' --xla_tpu_no_such_flag_for_the_test=true'):
    env = dict(os.environ, JAX_PLATFORMS='cpu', LIBTPU_INIT_ARGS=value)   # libtpu still starts, compile-only
    results.append(subprocess.run([sys.executable, '-c', code], cwd=REPO, env=env, capture_output=True,
                                  text=True, timeout=300, check=False))
  good, bad = results
  assert good.returncode == 0 and 'compiled' in good.stdout, good.stderr[-3000:]
  assert bad.returncode != 0 and 'xla_tpu_no_such_flag_for_the_test' in bad.stdout + bad.stderr


def test_jaxlib_knows_the_gpu_flags(dry):
  """jaxlib parses XLA_FLAGS when a backend starts (also the CPU one) and aborts on an unknown flag."""
  exports = dict(c[1].split('=', 1) for c in dry(SLURM, 'configs/cosmos2b.py').find('export'))
  code = 'import jax; jax.numpy.zeros(2).block_until_ready(); print("ok")'
  results = [subprocess.run([sys.executable, '-c', code], env=dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=v),
                            capture_output=True, text=True, timeout=120, check=False)
             for v in (exports['XLA_FLAGS'], exports['XLA_FLAGS'] + ' --xla_gpu_no_such_flag_for_the_test=1')]
  assert results[0].returncode == 0 and 'ok' in results[0].stdout, results[0].stderr[-2000:]
  assert results[1].returncode != 0


# ------------------------------------------------------------------------------ docker, README
@pytest.mark.parametrize('name,extra', [('Dockerfile.tpu', '.[tpu,video]'), ('Dockerfile.gpu', '.[cuda,video]')])
def test_dockerfile(name, extra):
  text = re.sub(r'\\\n', ' ', open(os.path.join(LAUNCH, 'docker', name)).read())   # join continued lines
  lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith('#')]
  instructions = [l.split()[0] for l in lines]
  assert instructions.count('FROM') == 1 and 'WORKDIR' in instructions and 'ENTRYPOINT' in instructions
  assert any(l.startswith('RUN pip install -e') and f"'{extra}'" in l for l in lines), lines
  assert '["python"]' in next(l for l in lines if l.startswith('ENTRYPOINT'))
  for l in lines:
    if l.startswith('COPY '):
      for src in l.split()[1:-1]:
        assert os.path.exists(os.path.join(REPO, src)), src
  setup = open(os.path.join(REPO, 'setup.py')).read()
  for e in extra[2:-1].split(','):
    assert f"'{e}':" in setup, e          # the extra exists in setup.py


def _readme_rows():
  rows = []
  for line in open(os.path.join(LAUNCH, 'README.md')):
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if line.startswith('|') and len(cells) == 4 and cells[0] in ('cosmos2b', 'cosmos14b'):
      rows.append(cells)
  return rows


@pytest.mark.parametrize('config', CONFIGS)
def test_readme_table(config):
  model = os.path.splitext(os.path.basename(config))[0]
  rows = [r for r in _readme_rows() if r[0] == model]
  tpu = [r for r in rows if 'v5p-' in r[1]]
  gpu = [r for r in rows if 'H100' in r[1]]
  assert len(tpu) == 1 and len(gpu) == 1, rows
  n = mesh_size(config)
  assert re.findall(r'v5p-[0-9]+', tpu[0][1]) == [v5p_slice(n)]
  assert f'({n} chips' in tpu[0][1]
  assert f'{n // 8} nodes x 8' in gpu[0][1] and f'({n} GPUs)' in gpu[0][1]
  for r in (tpu[0], gpu[0]):
    assert r[2] == mesh_desc(config), r
    assert f'--config={config}' in r[3], r
  assert GCLOUD in tpu[0][3] and SLURM in gpu[0][3]


def test_readme_table_commands_dry_run(stub_bin):
  """The table's commands work as written (with --dry-run and a zone / bucket filled in): `bash ...` as
  run, `sbatch SCRIPT ...` as the job that sbatch starts with the script's #SBATCH nodes."""
  kinds = []
  for model, _, _, cell in _readme_rows():
    command = shlex.split(cell.strip('`').replace('ZONE', 'us-east5-a').replace('BUCKET', 'bucket'))
    kinds.append(command[0])
    n = mesh_size(f'configs/{model}.py')
    if command[0] == 'sbatch':
      assert command[1] == SLURM, cell
      header = slurm_header()
      nodes = int(header['--nodes'])
      env = dict(SLURM_JOB_ID='123', SLURM_JOB_NUM_NODES=str(nodes), SLURM_SUBMIT_DIR=REPO)
      r = run_script(stub_bin, command[1], '--dry-run', *command[2:], env=env)
      assert r.rc == 0, (cell, r.err)
      assert nodes * int(header['--gpus-per-node']) == n and not r.find('sbatch')
      srun = r.one('srun')
      assert int(opt(srun, '--nodes')) == nodes
      check_train(train_argv(srun), f'configs/{model}.py', opt(command, '--workdir'))
      continue
    assert command[0] == 'bash', cell
    r = run_script(stub_bin, command[1], '--dry-run', *command[2:])
    assert r.rc == 0, (cell, r.err)
    if command[1] == GCLOUD:
      create = r.one('gcloud', 'compute', 'tpus', 'queued-resources', 'create')
      assert topology.topology(opt(create, '--accelerator-type')).num_chips == n
    else:
      assert int(opt(split_sbatch(r.one('sbatch'))[0], '--nodes')) * 8 == n
  assert kinds.count('sbatch') == 1, kinds
