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
HOST_SETUP = 'launch/tpu/host_setup.sh'
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
  at = [i for i, w in enumerate(words) if w.endswith('/slurm.sbatch')]
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


def srun_steps(result):
  """The srun commands of a run, from `srun` on: the training step's `srun ...` and the CPU-only steps'
  `env -u SLURM_GPUS_PER_NODE srun ...` (checked to carry --gres=none)."""
  steps = []
  for c in result.commands:
    if c[0] == 'srun':
      steps.append(c)
    elif c[:4] == ['env', '-u', 'SLURM_GPUS_PER_NODE', 'srun']:
      assert '--gres=none' in c, c
      steps.append(c[3:])
  return steps


def train_step(result):
  found = [c for c in srun_steps(result) if 'ddrl_jax.train' in c]
  assert len(found) == 1, result.lines
  return found[0]


def check_train(argv, config, workdir):
  assert opt(argv, '--config') == config
  assert opt(argv, '--workdir') == workdir
  assert opt(argv, '--compilation_cache_dir') == workdir + '/xla_cache'


def check_libtpu(value):
  flags = value.split()
  for f in TPU_FLAGS:
    assert f in flags, (f, flags)


# --------------------------------------------------------------------------------- syntax, help
@pytest.mark.parametrize('script', SCRIPTS + (HOST_SETUP,))
def test_bash_syntax(script):
  proc = subprocess.run(['bash', '-n', script], cwd=REPO, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr


def test_shellcheck():
  if shutil.which('shellcheck') is None:
    if os.environ.get('DDRL_REQUIRE_SHELLCHECK'):
      pytest.fail("shellcheck is not installed (.ci/run installs Debian's shellcheck)")
    pytest.skip('shellcheck is not installed')
  proc = subprocess.run(['shellcheck', '-s', 'bash', *SCRIPTS, HOST_SETUP], cwd=REPO, capture_output=True, text=True,
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
  assert ssh and all(c[5] == name and opt(c, '--zone') == 'us-east5-a' for c in ssh)
  # The install: one ssh (and scp) per host, every host exactly once, so a failing host can be named;
  # the training: one ssh to all hosts at once.
  hosts = topology.topology(accelerator).num_chips // 4                     # v5p: 4 chips per host
  installs = [c for c in ssh if 'host_setup.sh' in opt(c, '--command')]
  assert sorted(int(opt(c, '--worker')) for c in installs) == list(range(hosts))
  scps = r.find('gcloud', 'compute', 'tpus', 'tpu-vm', 'scp')
  assert sorted(int(opt(c, '--worker')) for c in scps) == list(range(hosts))
  setup = remote_words(opt(installs[0], '--command'))
  assert setup[setup.index('bash') + 1] == '~/ddrl_jax/' + HOST_SETUP
  assert opt(setup, '--python') == 'python3.11' and opt(setup, '--extras') == 'tpu,video'
  remote = [opt(c, '--command') for c in ssh if opt(c, '--worker') == 'all']
  train = [remote_words(c) for c in remote if 'ddrl_jax.train' in c]
  assert len(train) == 1 and len(remote) == 1, remote
  assert '~/ddrl_venv/bin/python -m ddrl_jax.train' in ' '.join(train[0])
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
  assert '--exclusive' in sbatch and opt(sbatch, '--mem') == '0'    # all of each node's memory
  assert opt(script_args, '--config') == config
  assert opt(script_args, '--workdir') == '/shared/run'

  assert len(srun_steps(r)) == 1  # --rewards=local: the training step alone
  srun = r.one('srun')
  assert int(opt(srun, '--nodes')) == nodes and int(opt(srun, '--ntasks-per-node')) == gpn
  assert opt(srun, '--mem') == '0' and '--overlap' in srun and int(opt(srun, '--gpus-per-node')) == gpn
  assert opt(srun, '--cpus-per-task') == '<node CPUs/8>'     # outside a job: the job fills it in
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
  assert '--exclusive' in header and header['--mem'] == '0'


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
  sruns = srun_steps(r)
  serve = [c for c in sruns if 'ddrl_jax.rewards.serve' in c]
  train = [c for c in sruns if 'ddrl_jax.train' in c]
  assert len(serve) == 1 and len(train) == 1, r.lines
  assert int(opt(serve[0], '--ntasks-per-node')) == 1 and '--overlap' in serve[0]
  # The reward servers take no GPU (--gres=none, checked by srun_steps) and remove no memory from the
  # training step (--mem=0), so neither step waits for the other on any Slurm version.
  assert opt(serve[0], '--mem') == '0' and '--gpus-per-node' not in ' '.join(serve[0])
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
  commands.append(train_argv(train_step(redis)))
  serve = [c for c in srun_steps(redis) if 'ddrl_jax.rewards.serve' in c][0]
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
@pytest.mark.parametrize('name,extra', [('Dockerfile.tpu', '.[tpu,video]'), ('Dockerfile.gpu', '.[cuda,video]'),
                                        ('Dockerfile.rewards', '.[video_rewards]')])
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


# ------------------------------------------------ SLURM: memory, CPUs, Redis, container mode (pyxis)
def test_slurm_in_job_cpus_and_started_redis(stub_bin):
  """In a job: --cpus-per-task is the node's CPUs / GPUs per node (srun >= 22.05 does not inherit it);
  --start-redis runs redis-server as a GPU-free step on the batch script's node, and the servers and
  the trainer use that node's address."""
  env = dict(SLURM_JOB_ID='7', SLURM_JOB_NUM_NODES='32', SLURM_SUBMIT_DIR=REPO,
             SLURM_JOB_CPUS_PER_NODE='224(x32)', SLURMD_NODENAME='gpu-a001')
  r = run_script(stub_bin, SLURM, '--dry-run', *BASE_ARGS[SLURM], '--rewards=redis', '--start-redis',
                 env=env)
  assert r.rc == 0, r.err
  steps = srun_steps(r)
  redis = [c for c in steps if 'redis-server' in c]
  assert len(redis) == 1 and opt(redis[0], '--nodelist') == 'gpu-a001' and opt(redis[0], '--ntasks') == '1'
  assert opt(redis[0], '--appendonly') == 'yes' and opt(redis[0], '--dir').endswith('/redis'), redis[0]
  url = opt([c for c in steps if 'ddrl_jax.rewards.serve' in c][0], '--redis')
  assert re.fullmatch(r'redis://[^<>]+:6379/0', url), url
  train = train_step(r)
  assert opt(train, '--cpus-per-task') == '28'
  assert opt(train_argv(train), '--config.reward.redis_url') == url
  for c in steps:
    assert opt(c, '--mem') == '0' and '--overlap' in c, c
  # An explicit --cpus-per-task wins, and the submission hands it to the job.
  r = run_script(stub_bin, SLURM, '--dry-run', *BASE_ARGS[SLURM], '--cpus-per-task=12', env=env)
  assert opt(train_step(r), '--cpus-per-task') == '12'
  sub = run_script(stub_bin, SLURM, '--dry-run', *BASE_ARGS[SLURM], '--cpus-per-task=12')
  assert opt(split_sbatch(sub.one('sbatch'))[1], '--cpus-per-task') == '12'


@pytest.fixture
def bare_host(tmp_path, stub_bin):
  """A directory holding nothing but a copy of slurm.sbatch, and a PYTHON that records any call and
  fails: what a login node of a container-only cluster has."""
  (tmp_path / 'slurm.sbatch').write_text(open(os.path.join(REPO, SLURM)).read())
  python = tmp_path / 'python_stub'
  python.write_text(f'#!/bin/sh\necho "python $*" >> "{stub_bin}/calls.log"\nexit 97\n')
  python.chmod(0o755)

  def run(*args, env=None):
    proc = subprocess.run(['bash', str(tmp_path / 'slurm.sbatch'), *args], cwd=tmp_path,
                          env=_env(stub_bin, dict(PYTHON=str(python), **(env or {}))),
                          capture_output=True, text=True, timeout=60, check=False)
    result = Result(args, proc, stub_bin)
    assert not result.calls, result.calls          # no python, srun, sbatch, redis ... ran
    return result
  return run


IMAGE_NAMES = [
    ('nvcr.io#nvidia/jax:25.04', 'nvcr.io#nvidia/jax:25.04'),                 # pyxis already
    ('us-docker.pkg.dev/proj/repo/ddrl-jax:gpu', 'us-docker.pkg.dev#proj/repo/ddrl-jax:gpu'),
    ('gcr.io/proj/ddrl:gpu', 'gcr.io#proj/ddrl:gpu'),
    ('localhost:5000/ddrl:gpu', 'localhost:5000#ddrl:gpu'),
    ('someone/ddrl:gpu', 'someone/ddrl:gpu'),                                  # Docker Hub
    ('/shared/images/ddrl.sqsh', '/shared/images/ddrl.sqsh'),                  # an enroot squashfs
]


@pytest.mark.parametrize('given,pyxis', IMAGE_NAMES)
def test_slurm_container_mode_submits_from_a_bare_host(bare_host, given, pyxis):
  """Container mode needs nothing on the host but bash and Slurm: no repository, no Python. The node
  count comes from --nodes, the image name is put in pyxis' REGISTRY#IMAGE form, every step runs in
  the image with the workdir mounted, and the job's first step checks the mesh inside the image."""
  r = bare_host('--dry-run', '--config=configs/cosmos2b.py', '--workdir=/shared/run', '--nodes=32',
                f'--container-image={given}', '--container-mounts=/data:/data', '--rewards=redis',
                '--redis-url=redis://r:6379/0')
  assert r.rc == 0, r.err
  sbatch, script_args = split_sbatch(r.one('sbatch'))
  assert int(opt(sbatch, '--nodes')) == 32 and opt(sbatch, '--mem') == '0'
  assert opt(sbatch, '--output').startswith('/shared/run/')           # no repository on the host
  assert opt(script_args, '--container-image') == pyxis
  assert r.find('mkdir', '-p', '/shared/run')
  steps = srun_steps(r)
  assert len(steps) == 3, r.lines                   # the mesh check, the reward servers, the training
  for c in steps:
    assert opt(c, '--container-image') == pyxis
    assert opt(c, '--container-mounts') == '/shared/run:/shared/run,/data:/data'
    assert opt(c, '--container-workdir') == '/app'
  check = steps[0]
  at = check.index('launch/render.py')
  assert check[at - 1] == '/opt/venv/bin/python' and opt(check[at:], '--nodes') == '32'
  assert opt(check[at:], '--require') == 'gpu'
  assert train_step(r)[train_step(r).index('-m') - 1] == '/opt/venv/bin/python'


def test_slurm_container_mode_needs_nodes_without_ddrl_jax(bare_host):
  r = bare_host('--dry-run', '--workdir=/shared/run', '--container-image=nvcr.io#nvidia/x:1')
  assert r.rc == 2 and '--nodes=N' in r.err and not r.commands, r.err


@pytest.mark.parametrize('nodes', [32, 16])
def test_slurm_container_mode_checks_the_mesh_in_the_job(bare_host, nodes):
  """The job's mesh check, run here as the image would run it (render.py of this repository): it
  passes for the 32 nodes cosmos2b's mesh needs and stops a 16-node job naming the mismatch."""
  env = dict(SLURM_JOB_ID='9', SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_CPUS_PER_NODE='96(x2)')
  r = bare_host('--dry-run', '--workdir=/shared/run', '--container-image=nvcr.io#nvidia/x:1', env=env)
  assert r.rc == 0 and not r.find('sbatch'), r.err
  check = srun_steps(r)[0]
  argv = check[check.index('launch/render.py'):]
  assert opt(argv, '--nodes') == str(nodes)
  proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS='cpu'),
                        capture_output=True, text=True, timeout=120, check=False)
  if nodes == 32:
    assert proc.returncode == 0 and proc.stdout.strip() == '32', proc.stderr
  else:
    assert proc.returncode == 2 and 'needs 256' in proc.stderr, proc.stderr
  assert opt(train_step(r), '--cpus-per-task') == '12'


def test_slurm_container_mounts_need_an_image(stub_bin):
  r = run_script(stub_bin, SLURM, '--dry-run', *BASE_ARGS[SLURM], '--container-mounts=/a:/a')
  assert r.rc == 2 and '--container-image' in r.err and not r.commands


# ---------------------------------------------- TPU: capacity, failing hosts, host setup, registry
@pytest.mark.parametrize('capacity,flag,alpha', [('reserved', '--reserved', False), ('spot', '--spot', False),
                                                 ('best-effort', '--best-effort', True)])
def test_gcloud_capacity(dry, capacity, flag, alpha):
  """Reserved, spot and best-effort capacity go to `queued-resources create` (--best-effort is only in
  gcloud alpha); they imply --queued, and --valid-until-duration bounds the wait."""
  r = dry(GCLOUD, 'configs/cosmos2b.py', f'--capacity={capacity}', '--valid-until-duration=6h')
  prefix = ('gcloud', 'alpha') if alpha else ('gcloud',)
  create = r.one(*prefix, 'compute', 'tpus', 'queued-resources', 'create')
  assert flag in create and opt(create, '--valid-until-duration') == '6h'
  assert sum(f in create for f in ('--reserved', '--spot', '--best-effort')) == 1
  assert not r.find('gcloud', 'compute', 'tpus', 'tpu-vm', 'create')
  plain = dry(GCLOUD, 'configs/cosmos2b.py', '--queued').one('gcloud', 'compute', 'tpus', 'queued-resources',
                                                            'create')
  assert not {'--reserved', '--spot', '--best-effort'} & set(plain)


def test_gcloud_capacity_bad_input(stub_bin):
  for args, message in ((('--capacity=cheap',), '--capacity must be'),
                        (('--capacity=spot', '--skip-create'), 'drop --skip-create')):
    r = run_script(stub_bin, GCLOUD, '--dry-run', *BASE_ARGS[GCLOUD], *args)
    assert r.rc == 2 and message in r.err and not r.commands, (args, r.err)


def test_gcloud_names_the_hosts_whose_install_failed(tmp_path):
  """A real (not dry) run against a gcloud that succeeds everywhere except the install on workers 3
  and 5: the script names exactly those workers, exits non-zero and never starts training."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  calls = tmp_path / 'calls.log'
  (bin_dir / 'gcloud').write_text(f'''#!/bin/bash
echo "gcloud $*" >> "{calls}"
case "$*" in
  *"queued-resources describe"*) echo ACTIVE ;;
  *"--worker=3 --command"*host_setup*|*"--worker=5 --command"*host_setup*) echo "E: host broke" >&2; exit 1 ;;
esac
exit 0
''')
  (bin_dir / 'gcloud').chmod(0o755)
  env = _env(bin_dir, dict(TMPDIR=str(tmp_path)))
  proc = subprocess.run(['bash', GCLOUD, '--config=configs/cosmos2b.py', *BASE_ARGS[GCLOUD], '--queued',
                         '--repo=https://example.com/ddrl_jax.git', '--poll-seconds=0', '--ssh-parallel=16'],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
  log = calls.read_text()
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert 'install failed on 2 of 64 hosts' in proc.stderr and 'workers 3 5' in proc.stderr, proc.stderr[-3000:]
  assert 'E: host broke' in proc.stderr                               # the failing host's log tail
  installs = [l for l in log.splitlines() if 'host_setup.sh' in l]
  assert len(installs) == 64 and '--worker=all' not in log           # no training was started


@pytest.fixture
def fake_host(tmp_path):
  """A PATH for host_setup.sh: sudo runs its command; apt-get fails its first 2 calls (the dpkg lock
  of unattended-upgrades) and logs the rest; add-apt-repository logs; python3.11 is a Python that
  reports the version in $FAKE_PY_VERSION, and its venv's python logs pip installs."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  log = tmp_path / 'calls.log'
  scripts = {
      'sudo': '#!/bin/bash\n"$@"\n',
      'apt-get': f'''#!/bin/bash
n=$(cat "{tmp_path}/apt_count" 2>/dev/null || echo 0); echo $((n + 1)) > "{tmp_path}/apt_count"
if ((n < 2)); then echo "E: Could not get lock /var/lib/dpkg/lock-frontend" >&2; exit 100; fi
echo "apt-get $*" >> "{log}"
''',
      'add-apt-repository': f'#!/bin/bash\necho "add-apt-repository $*" >> "{log}"\n',
      'python3.11': f'''#!/bin/bash
if [[ $1 == -m && $2 == venv ]]; then
  mkdir -p "$3/bin"
  printf '#!/bin/bash\\nif [[ $1 == -c ]]; then {sys.executable} -c "$2"; else echo "venv-python $*" >> "{log}"; fi\\n' > "$3/bin/python"
  chmod +x "$3/bin/python"; exit 0
fi
if [[ $1 == - ]]; then
  exec {sys.executable} -c "import sys; exec(sys.stdin.read().replace('sys.version_info[:3]', 'tuple(map(int, \\"$FAKE_PY_VERSION\\".split(\\".\\")))'))" "${{@:2}}"
fi
exec {sys.executable} "$@"
''',
  }
  for name, text in scripts.items():
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)

  def run(version):
    env = dict(os.environ, PATH=f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', HOME=str(tmp_path),
               FAKE_PY_VERSION=version, DDRL_SETUP_RETRY_SLEEP='0')
    proc = subprocess.run(['bash', HOST_SETUP, '--python=python3.11'], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    return proc, (log.read_text() if log.exists() else '')
  return run


def test_host_setup_waits_for_the_lock_and_retries(fake_host):
  proc, log = fake_host('3.11.14')
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr.count('try 1 of 4 failed') == 1 and 'try 2 of 4 failed' in proc.stderr
  apt = [l for l in log.splitlines() if l.startswith('apt-get')]
  assert apt and all('DPkg::Lock::Timeout=' in l for l in apt)
  assert 'add-apt-repository -y --no-update ppa:deadsnakes/ppa' in log
  assert any('install' in l and 'python3.11 python3.11-venv' in l for l in apt)
  assert "venv-python -m pip install -q -e .[tpu,video]" in log


def test_host_setup_refuses_an_early_python(fake_host):
  proc, log = fake_host('3.11.0')
  assert proc.returncode != 0 and 'too old' in proc.stderr, proc.stderr
  assert 'pip install' not in log


def test_xpk_artifact_registry_push(dry):
  image = 'us-central1-docker.pkg.dev/proj/repo/ddrl-jax:tpu'
  r = dry(XPK, 'configs/cosmos2b.py', '--build', f'--docker-image={image}')
  order = [c[:3] for c in r.commands if c[0] in ('docker', 'gcloud', 'xpk')]
  assert order == [['docker', 'build', '-f'], ['gcloud', 'auth', 'configure-docker'], ['docker', 'push', image],
                   ['xpk', 'workload', 'create']], order
  assert r.one('gcloud', 'auth', 'configure-docker')[3] == 'us-central1-docker.pkg.dev'
  assert 'warning' not in r.err
  old = dry(XPK, 'configs/cosmos2b.py')                 # BASE_ARGS' gcr.io image: warned, still run
  assert 'Container Registry' in old.err and old.find('xpk', 'workload', 'create')


def test_dockerignore_keeps_the_shipped_checkpoints():
  """.dockerignore drops history, caches and run outputs from the build context but keeps what the
  images COPY, including the shipped OCR base checkpoints the OCR configs start from."""
  lines = [l.strip() for l in open(os.path.join(REPO, '.dockerignore')) if l.strip() and not l.startswith('#')]
  assert '.git' in lines and 'checkpoints/*' in lines and '!checkpoints/ocr_tiny_base' in lines
  for name in ('Dockerfile.tpu', 'Dockerfile.gpu'):
    text = open(os.path.join(LAUNCH, 'docker', name)).read()
    assert 'libgl1' in text and 'libglib2.0-0' in text, name         # opencv under RapidOCR
    assert 'COPY checkpoints ./checkpoints' in text, name
  assert 'redis-server' in open(os.path.join(LAUNCH, 'docker', 'Dockerfile.gpu')).read()


PLACEHOLDERS = {'ZONE': 'us-east5-a', 'BUCKET': 'bucket', 'CLUSTER': 'c1', 'REGION': 'us-central1',
                'PROJECT': 'proj', 'REPOSITORY': 'repo'}


def _documented_commands():
  """Every launch command written out in README.md and launch/README.md (code blocks and inline code),
  with the placeholders filled in; the `...` sketches are left out."""
  found = []
  for doc in ('README.md', 'launch/README.md'):
    text = open(os.path.join(REPO, doc)).read()
    for cmd in re.findall(r'^((?:bash|sbatch) launch/\S+.*)$', text, re.M) + \
        re.findall(r'`((?:bash|sbatch) launch/[^`]+)`', text):
      if '...' in cmd or 'docker build' in cmd:
        continue
      for k, v in PLACEHOLDERS.items():
        cmd = re.sub(rf'\b{k}\b', v, cmd)
      found.append((doc, cmd.strip()))
  return sorted(set(found))


# What the dry run of each documented command must print: the train command, or for the GPU reward pools
# (launch/gpu/reward_pool.sbatch, launch/tpu/gcloud_reward_pool.sh) the servers or the VMs.
DOCUMENTED_OUTPUT = {'launch/gpu/reward_pool.sbatch': 'ddrl_jax.rewards.serve',
                     'launch/tpu/gcloud_reward_pool.sh': 'gcloud compute instances'}


def test_documented_commands_dry_run(stub_bin):
  """Each launch command the READMEs write out runs as written (plus --dry-run, and a reward-service
  token in DDRL_REWARD_TOKEN as their text asks): `bash ...` as the submission, `sbatch ...` as the job
  sbatch starts with the script's #SBATCH nodes."""
  commands = _documented_commands()
  assert len(commands) >= 10 and any('--container-image' in c for _, c in commands), commands
  for doc, cmd in commands:
    words = shlex.split(cmd)
    env = dict(DDRL_REWARD_TOKEN='documented-token')
    if words[0] == 'sbatch':
      with open(os.path.join(REPO, words[1])) as f:
        nodes = re.search(r'^#SBATCH --nodes=(\d+)', f.read(), re.M).group(1)
      env.update(SLURM_JOB_ID='1', SLURM_JOB_NUM_NODES=nodes, SLURM_SUBMIT_DIR=REPO)
    r = run_script(stub_bin, words[1], '--dry-run', *words[2:], env=env)
    assert r.rc == 0, (doc, cmd, r.err)
    want = DOCUMENTED_OUTPUT.get(words[1], 'ddrl_jax.train')
    assert any(want in l for l in r.lines), (doc, cmd)
