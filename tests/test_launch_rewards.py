"""launch/: GPU reward pools for a trainer that runs elsewhere (launch/gpu/reward_pool.sbatch,
launch/tpu/gcloud_reward_pool.sh) and the bearer token on the TPU side (launch/tpu/gcloud_v5p.sh).

Dry runs only, as in test_launch.py: sbatch, srun and gcloud are stubs that record a call, and every test
checks that none happened. What is checked: one reward server per GPU, each pinned to a different GPU
(the SLURM tasks' pinning is run here with a stub server; the VMs' systemd instances are expanded), the
serve command parses with ddrl_jax.rewards.serve's own flags, the Redis URL and the config's imports
reach the servers, the bearer token is required and never printed (it travels in the environment or as
a file), the config's rewards are checked (a torch reward on 'cpu' stops the launch), the container
image, the tear-down, and bash -n / shellcheck of the scripts and of the VMs' startup script.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from test_launch import GCLOUD, REPO, Result, _env, opt, remote_words, train_argv

POOL_SLURM = 'launch/gpu/reward_pool.sbatch'
POOL_GCE = 'launch/tpu/gcloud_reward_pool.sh'
POOLS = (POOL_SLURM, POOL_GCE)
TOKEN = 'tok-5ecret-0123456789'
URL = 'redis://10.0.0.3:6379/0'
# The paper's video rewards, as a trainer that sends them to the pool gives them (device 'cuda').
REWARD_FLAGS = ("--config.reward.fns={'videoalign': 1.0, 'vbench': 1.0}",
                "--config.reward.kwargs={'videoalign': {'checkpoint': '/w/videoalign', 'device': 'cuda'}, "
                "'vbench': {'weights_dir': '/w/vbench', 'device': 'cuda'}}")
_PARSE_SERVE = r'''
import json, sys
from absl import flags
from ddrl_jax.rewards import serve
flags.FLAGS(['serve'] + sys.argv[1:])
f = flags.FLAGS
print(json.dumps(dict(redis=f.redis, workers=f.workers, imports=f.imports, name=f.name, token=f.token)))
'''


@pytest.fixture(scope='module')
def stubs(tmp_path_factory):
  """A PATH dir whose sbatch/srun/gcloud record the call and fail."""
  d = tmp_path_factory.mktemp('pool_stubs')
  for name in ('sbatch', 'srun', 'gcloud', 'docker'):
    (d / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{d / "calls.log"}"\nexit 97\n')
    (d / name).chmod(0o755)
  return d


def pool(stubs, script, *args, token=TOKEN, env=None):
  """`bash SCRIPT ARGS` with DDRL_REWARD_TOKEN (unless token=None); nothing may reach the stubs and the
  token may appear nowhere in the output."""
  extra = dict(env or {})
  if token is not None:
    extra['DDRL_REWARD_TOKEN'] = token
  proc = subprocess.run(['bash', script, *args], cwd=REPO, env=_env(stubs, extra), capture_output=True,
                        text=True, timeout=120, check=False)
  r = Result(args, proc, stubs)
  assert not r.calls, f'{script} {args} called {r.calls}'
  assert TOKEN not in r.out + r.err
  return r


def serve_argv(words):
  """The flags after `-m ddrl_jax.rewards.serve` in a word list."""
  at = words.index('ddrl_jax.rewards.serve')
  assert words[at - 1] == '-m', words
  return words[at + 1:]


def parse_serve(argv):
  proc = subprocess.run([sys.executable, '-c', _PARSE_SERVE, *argv], cwd=REPO, capture_output=True,
                        text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS='cpu'), check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  import json  # pylint: disable=g-import-not-at-top
  return json.loads(proc.stdout.strip().splitlines()[-1])


def one_error(r, *needles):
  """Exit 2, nothing printed or run, and the first stderr line names what is wrong."""
  assert r.rc == 2 and not r.commands, (r.rc, r.out, r.err)
  first = r.err.strip().splitlines()[0]
  assert 'error:' in first and all(n in first for n in needles), r.err


# -------------------------------------------------------------------------------- syntax, help
@pytest.mark.parametrize('script', POOLS)
def test_bash_syntax_and_help(stubs, script):
  proc = subprocess.run(['bash', '-n', script], cwd=REPO, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr
  r = pool(stubs, script, '--help')
  assert r.rc == 0 and 'Usage:' in r.out and '--dry-run' in r.out and not r.commands, r.err
  r = pool(stubs, script, '--dry-run', '--bogus-option=1')
  assert r.rc == 2 and 'unknown option: --bogus-option' in r.err and not r.commands


def test_shellcheck():
  if shutil.which('shellcheck') is None:
    if os.environ.get('DDRL_REQUIRE_SHELLCHECK'):
      pytest.fail("shellcheck is not installed (.ci/run installs Debian's shellcheck)")
    pytest.skip('shellcheck is not installed')
  proc = subprocess.run(['shellcheck', '-s', 'bash', *POOLS], cwd=REPO, capture_output=True, text=True,
                        check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------- SLURM
@pytest.fixture(scope='module')
def slurm_submit(stubs):
  r = pool(stubs, POOL_SLURM, '--dry-run', f'--redis-url={URL}', '--nodes=2', '--reward-workers-per-gpu=2',
           '--', *REWARD_FLAGS)
  assert r.rc == 0, r.err
  return r


def test_slurm_pool_submits_one_server_per_gpu(slurm_submit):
  r = slurm_submit
  sbatch = r.one('sbatch')
  at = [i for i, w in enumerate(sbatch) if w.endswith('/reward_pool.sbatch')]
  assert len(at) == 1, sbatch
  options, script_args = sbatch[:at[0]], sbatch[at[0] + 1:]
  assert opt(options, '--nodes') == '2' and opt(options, '--gpus-per-node') == '8'
  assert opt(options, '--ntasks-per-node') == '8' and opt(options, '--mem') == '0'
  # The job gets the same options (sbatch's environment carries the token) and the train flags.
  assert opt(script_args, '--redis-url') == URL and opt(script_args, '--reward-workers-per-gpu') == '2'
  assert opt(script_args, '--config') == 'configs/cosmos2b.py'
  assert script_args[script_args.index('--') + 1:] == list(REWARD_FLAGS)
  # In the job: one task per GPU, all of the node's GPUs in the step; the server per task.
  srun = r.one('srun')
  assert opt(srun, '--nodes') == '2' and opt(srun, '--ntasks-per-node') == '8'
  assert opt(srun, '--gpus-per-node') == '8' and '--gres=none' not in srun
  assert srun[srun.index('bash') - 1] == 'JAX_PLATFORMS=cpu'
  parsed = parse_serve(serve_argv(srun))
  assert parsed['redis'] == URL and parsed['workers'] == 2 and parsed['token'] is None
  assert parsed['imports'] == []
  # What the trainer elsewhere must be started with.
  assert f'--config.reward.backend=redis --config.reward.redis_url={URL}' in r.err
  assert 'launch/tpu/gcloud_v5p.sh --config=configs/cosmos2b.py' in r.err
  assert 'on the GPU: vbench,videoalign' in r.err


def test_slurm_pool_pins_each_server_to_its_own_gpu(slurm_submit, tmp_path):
  """The task command run as Slurm runs it, once per task (SLURM_LOCALID 0..7), with a stub server that
  reports its CUDA_VISIBLE_DEVICES: every task gets another GPU, the one at its index of the step's
  list (also when Slurm numbers the GPUs otherwise), or the only one when Slurm binds one per task."""
  srun = slurm_submit.one('srun')
  at = srun.index('bash')
  assert srun[at + 1] == '-c'
  script, name = srun[at + 2], srun[at + 3]
  server = tmp_path / 'server'
  server.write_text('#!/bin/sh\necho "$CUDA_VISIBLE_DEVICES $*"\n')
  server.chmod(0o755)

  def task(localid, visible):
    env = dict(os.environ, SLURM_LOCALID=str(localid), CUDA_VISIBLE_DEVICES=visible)
    proc = subprocess.run(['bash', '-c', script, name, str(server), '--redis=' + URL], env=env,
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    gpu, *argv = proc.stdout.split()
    assert argv[0] == '--redis=' + URL and re.fullmatch(rf'--name=.+-gpu{localid}', argv[1]), argv
    return gpu

  assert [task(i, '0,1,2,3,4,5,6,7') for i in range(8)] == [str(i) for i in range(8)]
  assert [task(i, '4,5,6,7,0,1,2,3') for i in range(8)] == ['4', '5', '6', '7', '0', '1', '2', '3']
  assert {task(i, str(i + 8)) for i in range(8)} == {str(i + 8) for i in range(8)}   # bound by Slurm
  proc = subprocess.run(['bash', '-c', script, name, str(server)], capture_output=True, text=True,
                        env=dict(os.environ, SLURM_LOCALID='5', CUDA_VISIBLE_DEVICES='0,1'), timeout=30,
                        check=False)
  assert proc.returncode == 1 and 'no GPU 5' in proc.stderr and not proc.stdout


def test_slurm_pool_in_a_job_with_a_container(stubs):
  """Inside the job (SLURM_JOB_ID): no sbatch, the job's nodes, CPUs per server from the node's, the
  image in pyxis' form with its Python, the servers' --imports."""
  env = dict(SLURM_JOB_ID='41', SLURM_JOB_NUM_NODES='3', SLURM_JOB_CPUS_PER_NODE='96(x3)', SLURM_SUBMIT_DIR=REPO)
  r = pool(stubs, POOL_SLURM, '--dry-run', f'--redis-url={URL}', '--imports=my_rewards',
           '--container-image=us-central1-docker.pkg.dev/proj/repo/ddrl-jax:rewards',
           '--container-mounts=/weights:/weights', env=env)
  assert r.rc == 0 and not r.find('sbatch'), r.err
  srun = r.one('srun')
  assert opt(srun, '--nodes') == '3' and opt(srun, '--cpus-per-task') == '12'
  assert opt(srun, '--container-image') == 'us-central1-docker.pkg.dev#proj/repo/ddrl-jax:rewards'
  assert opt(srun, '--container-mounts') == '/weights:/weights' and opt(srun, '--container-workdir') == '/app'
  argv = serve_argv(srun)
  assert srun[srun.index('-m') - 1] == '/opt/venv/bin/python'
  assert opt(argv, '--imports') == 'my_rewards' and opt(argv, '--redis') == URL


def test_slurm_pool_header():
  with open(os.path.join(REPO, POOL_SLURM)) as f:
    header = dict(re.findall(r'^#SBATCH (--[a-z-]+)(?:=(\S*))?', f.read(), re.M))
  assert header['--nodes'] == '1' and header['--gpus-per-node'] == header['--ntasks-per-node'] == '8'
  assert header['--mem'] == '0'


@pytest.mark.parametrize('script', POOLS)
def test_pool_needs_the_token_and_the_url(stubs, script):
  base = ('--dry-run', '--zone=us-east5-a', '--staging=gs://bucket/stage') if script == POOL_GCE else ('--dry-run',)
  one_error(pool(stubs, script, *base, f'--redis-url={URL}', token=None), 'DDRL_REWARD_TOKEN')
  one_error(pool(stubs, script, *base), '--redis-url is required')
  one_error(pool(stubs, script, *base, '--redis-url=10.0.0.3:6379'), '--redis-url must be')
  one_error(pool(stubs, script, *base, f'--redis-url={URL}', '--reward-workers-per-gpu=0'),
            '--reward-workers-per-gpu')


@pytest.mark.parametrize('script', POOLS)
def test_pool_refuses_a_torch_reward_on_the_cpu(stubs, script):
  """The trainer sends its reward kwargs with every task; a torch reward left on the factories' default
  device 'cpu' would run on the CPU of a GPU VM: the launch stops naming the key and the fix."""
  base = ('--dry-run', '--zone=us-east5-a', '--staging=gs://bucket/stage') if script == POOL_GCE else ('--dry-run',)
  r = pool(stubs, script, *base, f'--redis-url={URL}', '--', "--config.reward.fns={'cosmos_reason1': 1.0}")
  assert r.rc == 2 and not r.commands, r.err
  assert "config.reward.kwargs.cosmos_reason1.device is 'cpu'" in r.err and "'device': 'cuda'" in r.err


# -------------------------------------------------------------------------------- Compute Engine
@pytest.fixture(scope='module')
def gce_create(stubs):
  r = pool(stubs, POOL_GCE, '--dry-run', '--zone=us-east5-a', f'--redis-url={URL}', '--vms=3',
           '--name=pool', '--staging=gs://bucket/stage/', '--', *REWARD_FLAGS)
  assert r.rc == 0, r.err
  return r


def test_gcloud_pool_creates_the_vms(gce_create):
  r = gce_create
  tar = r.one('tar')
  assert tar[-1] == '.' and opt(tar, '-C') == REPO
  assert r.one('gcloud', 'storage', 'cp') == ['gcloud', 'storage', 'cp', tar[2], 'gs://bucket/stage/ddrl_jax_src.tgz']
  create = r.one('gcloud', 'compute', 'instances', 'create')
  assert create[4:7] == ['pool-0', 'pool-1', 'pool-2'] and opt(create, '--zone') == 'us-east5-a'
  assert opt(create, '--machine-type') == 'a3-highgpu-8g' and not [w for w in create if w.startswith('--accelerator')]
  assert opt(create, '--maintenance-policy') == 'TERMINATE'
  assert opt(create, '--image-project') == 'ubuntu-os-accelerator-images'
  assert opt(create, '--boot-disk-type') == 'pd-balanced' and opt(create, '--network-interface') == 'nic-type=GVNIC'
  files = dict(kv.split('=', 1) for kv in opt(create, '--metadata-from-file').split(','))
  assert set(files) == {'startup-script', 'ddrl-reward-token'}        # the token as a file, not a value
  assert r.commands.index(tar) < r.commands.index(create)
  # The TPU job's command, the check and the tear-down.
  assert (f'bash launch/tpu/gcloud_v5p.sh --config=configs/cosmos2b.py --zone=us-east5-a --workdir=gs://BUCKET/DIR'
          f' -- --config.reward.backend=redis --config.reward.redis_url={URL}') in r.err
  hint = [l for l in r.err.splitlines() if 'launch/tpu/gcloud_v5p.sh' in l][0]
  assert shlex.split(hint.split(' -- ', 1)[1])[2:] == list(REWARD_FLAGS)
  assert 'bash launch/tpu/gcloud_reward_pool.sh --zone=us-east5-a --vms=3 --name=pool --delete' in r.err
  assert '3 VMs x 8 GPUs = 24 reward servers' in r.err


@pytest.fixture(scope='module')
def startup(stubs):
  r = pool(stubs, POOL_GCE, '--print-startup-script', f'--redis-url={URL}', '--machine-type=a2-ultragpu-4g',
           '--repo=https://example.com/ddrl_jax.git', '--reward-workers-per-gpu=2', '--imports=my_rewards',
           '--weights=gs://bucket/reward-weights', '--', *REWARD_FLAGS, token=None)
  assert r.rc == 0 and not r.commands, r.err
  return r.out


def test_gcloud_pool_startup_script_serves_one_gpu_each(startup, tmp_path):
  """The VMs' startup script: the install (video_rewards extra, the weights), then a systemd instance per
  GPU whose CUDA_VISIBLE_DEVICES is its instance number: 4 servers on a2-ultragpu-4g, GPUs 0..3."""
  text = startup
  assert 'retry git clone https://example.com/ddrl_jax.git /opt/ddrl_jax' in text
  assert 'host_setup.sh --python=python3.11 --extras=video_rewards --venv=/opt/ddrl_venv' in text
  assert 'retry gcloud storage rsync --recursive gs://bucket/reward-weights /opt/ddrl_weights' in text
  assert 'computeMetadata/v1/instance/attributes/ddrl-reward-token' in text and 'GPUS=4' in text
  unit = re.search(r"<<'UNIT'\n(.*?)\nUNIT\n", text, re.S).group(1)
  service = dict(l.split('=', 1) for l in unit.splitlines() if '=' in l and not l.startswith('#'))
  assert service['Restart'] == 'always' and service['EnvironmentFile'] == '/etc/ddrl-reward.env'
  instances = re.search(r'^systemctl enable((?: ddrl-reward@\d+)+)$', text, re.M).group(1).split()
  assert re.search(r'^systemctl restart' + ' '.join([''] + instances) + '$', text, re.M)
  pins = []
  for inst in instances:
    i = inst.split('@')[1]
    env = dict(kv.split('=', 1) for kv in service['Environment'].replace('%i', i).split())
    pins.append(env['CUDA_VISIBLE_DEVICES'])
  assert pins == ['0', '1', '2', '3']
  argv = service['ExecStart'].replace('%H', 'vm-0').replace('%i', '2').split()
  assert argv[:3] == ['/opt/ddrl_venv/bin/python', '-m', 'ddrl_jax.rewards.serve']
  parsed = parse_serve(serve_argv(argv))
  assert parsed == dict(redis=URL, workers=2, imports=['my_rewards'], name='vm-0-gpu2', token=None)
  script = tmp_path / 'startup.sh'
  script.write_text(text)
  proc = subprocess.run(['bash', '-n', str(script)], capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr
  if shutil.which('shellcheck'):
    proc = subprocess.run(['shellcheck', '-s', 'bash', str(script)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout


def test_gcloud_pool_machine_types(stubs):
  base = ('--dry-run', '--zone=us-east5-a', f'--redis-url={URL}', '--staging=gs://bucket/stage')
  one_error(pool(stubs, POOL_GCE, *base, '--machine-type=n1-standard-16', '--accelerator=nvidia-tesla-t4'),
            '--gpus-per-vm')
  one_error(pool(stubs, POOL_GCE, *base, '--machine-type=c3-standard-8'), '--gpus-per-vm')
  one_error(pool(stubs, POOL_GCE, '--dry-run', '--zone=us-east5-a', f'--redis-url={URL}'), '--staging')
  one_error(pool(stubs, POOL_GCE, *base[:2], '--redis-url=redis://localhost:6379/0', *base[3:]), 'localhost')
  one_error(pool(stubs, POOL_GCE, '--dry-run', f'--redis-url={URL}'), '--zone')
  r = pool(stubs, POOL_GCE, *base, '--machine-type=n1-standard-16', '--accelerator=nvidia-tesla-t4',
           '--gpus-per-vm=2', '--spot', '--reservation=res-1', '--', *REWARD_FLAGS)
  assert r.rc == 0, r.err
  create = r.one('gcloud', 'compute', 'instances', 'create')
  assert opt(create, '--accelerator') == 'type=nvidia-tesla-t4,count=2'
  assert opt(create, '--provisioning-model') == 'SPOT' and opt(create, '--reservation') == 'res-1'


def test_gcloud_pool_delete(stubs):
  """The tear-down needs neither the token nor the URL."""
  r = pool(stubs, POOL_GCE, '--dry-run', '--zone=us-east5-a', '--vms=2', '--name=pool', '--project=proj',
           '--delete', token=None)
  assert r.rc == 0, r.err
  assert r.commands == [['gcloud', 'compute', 'instances', 'delete', 'pool-0', 'pool-1', '--zone', 'us-east5-a',
                         '--project', 'proj', '--quiet']]


# ------------------------------------------------------------------ the TPU side: gcloud_v5p.sh
def test_gcloud_v5p_ships_the_reward_token(stubs):
  """With the Redis backend in the train flags, gcloud_v5p.sh copies $DDRL_REWARD_TOKEN to every host as
  a file and the train command exports it from there; without the token it stops before any command."""
  flags = ('--', '--config.reward.backend=redis', f'--config.reward.redis_url={URL}', *REWARD_FLAGS)
  base = ('--dry-run', '--zone=us-east5-a', '--workdir=gs://bucket/run', '--skip-install')
  r = pool(stubs, GCLOUD, *base, *flags)
  assert r.rc == 0, r.err
  scp = r.one('gcloud', 'compute', 'tpus', 'tpu-vm', 'scp')
  assert scp[6] == 'ddrl-cosmos2b:.ddrl_reward_token' and opt(scp, '--worker') == 'all'
  ssh = r.one('gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh')
  assert r.commands.index(scp) < r.commands.index(ssh)
  command = opt(ssh, '--command')
  assert 'export DDRL_REWARD_TOKEN="$(cat ~/.ddrl_reward_token)" && ' in command
  argv = train_argv(remote_words(command))
  assert opt(argv, '--config.reward.backend') == 'redis' and opt(argv, '--config.reward.redis_url') == URL
  one_error(pool(stubs, GCLOUD, *base, *flags, token=None), 'DDRL_REWARD_TOKEN')
  two_words = pool(stubs, GCLOUD, *base, '--', '--config.reward.backend', 'redis', token=None)
  one_error(two_words, 'DDRL_REWARD_TOKEN')
  plain = pool(stubs, GCLOUD, *base, token=None)
  assert plain.rc == 0 and not plain.find('gcloud', 'compute', 'tpus', 'tpu-vm', 'scp')
  assert 'DDRL_REWARD_TOKEN' not in opt(plain.one('gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh'), '--command')


def test_gcloud_pool_startup_script_runs(stubs, tmp_path):
  """The startup script run here as the VM would run it (its /opt and /etc moved under a temporary
  root; nvidia-smi, gcloud, curl and systemctl stubs; the repository's host_setup.sh replaced by one that
  makes a virtualenv stub): it waits for the GPUs, installs once, writes the token root-only and starts
  one unit per GPU; a reboot (a second run) skips the install and restarts the units."""
  r = pool(stubs, POOL_GCE, '--print-startup-script', f'--redis-url={URL}', '--gpus-per-vm=2',
           '--machine-type=g2-standard-24', '--staging=gs://bucket/stage', '--', *REWARD_FLAGS, token=None)
  assert r.rc == 0, r.err
  root, bin_dir, log = tmp_path / 'root', tmp_path / 'bin', tmp_path / 'calls.log'
  bin_dir.mkdir()
  source = tmp_path / 'source'
  (source / 'launch' / 'tpu').mkdir(parents=True)
  (source / 'launch' / 'tpu' / 'host_setup.sh').write_text(f'''#!/bin/bash
echo "host_setup $*" >> "{log}"
venv=${{@: -1}}; venv=${{venv#--venv=}}; mkdir -p "$venv/bin"
printf '#!/bin/sh\\necho "venv-python $*" >> "{log}"\\n' > "$venv/bin/python"; chmod +x "$venv/bin/python"
''')
  subprocess.run(['tar', '-czf', str(tmp_path / 'src.tgz'), '-C', str(source), '.'], check=True)
  stub_text = {
      'nvidia-smi': 'printf "GPU 0: NVIDIA L4 (UUID: a)\\nGPU 1: NVIDIA L4 (UUID: b)\\n"',
      'gcloud': f'echo "gcloud $*" >> "{log}"; cp "{tmp_path}/src.tgz" "$4"',
      'curl': f'echo "curl $*" >> "{log}"; printf %s {TOKEN}',
      'systemctl': f'echo "systemctl $*" >> "{log}"',
  }
  for name, body in stub_text.items():
    (bin_dir / name).write_text(f'#!/bin/bash\n{body}\n')
    (bin_dir / name).chmod(0o755)
  script = tmp_path / 'startup.sh'
  script.write_text(r.out.replace('/opt/', f'{root}/opt/').replace('/etc/', f'{root}/etc/')
                    .replace('/tmp/ddrl_jax_src.tgz', f'{tmp_path}/fetched.tgz'))
  (root / 'etc' / 'systemd' / 'system').mkdir(parents=True)
  (root / 'opt').mkdir()
  env = dict(os.environ, PATH=f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')
  for boot in (1, 2):
    proc = subprocess.run(['bash', str(script)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    assert sum(c.startswith('gcloud storage cp gs://bucket/stage/ddrl_jax_src.tgz') for c in calls) == 1, calls
    assert sum(c.startswith('host_setup --python=python3.11 --extras=video_rewards') for c in calls) == 1
    assert sum('--no-deps vbench==0.1.5' in c for c in calls) == 1 and sum('import sys, torch' in c for c in calls) == 1
    assert [c for c in calls if c.startswith('systemctl restart')] == ['systemctl restart ddrl-reward@0 ddrl-reward@1'] * boot
  env_file = root / 'etc' / 'ddrl-reward.env'
  assert env_file.read_text() == f'DDRL_REWARD_TOKEN={TOKEN}\n' and (env_file.stat().st_mode & 0o777) == 0o600
  unit = (root / 'etc' / 'systemd' / 'system' / 'ddrl-reward@.service').read_text()
  assert f'ExecStart={root}/opt/ddrl_venv/bin/python -m ddrl_jax.rewards.serve --redis={URL}' in unit
  assert TOKEN not in unit and TOKEN not in script.read_text()
