"""The bad-input table: each row is one bad input and what it must produce: an error of a given class whose
message contains given words, or (reward faults, which must never stop training by themselves) NaN
scores with the failure counted and described. No row may be accepted silently.

Sections: every key `config.validate` checks (a test below fails when validate checks a key that has no
row); the CLI's flags; data records; damaged and mismatched checkpoints; reward workers; the Redis
reward service. benchmarks/RESULTS.md reports the count.
"""
import ast
import copy
import logging
import os
import shutil
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
from test_reward_service import IMAGES  # tests/test_reward_service.py (fixtures used below)
from test_reward_service import client
from test_reward_service import redis_url  # pylint: disable=unused-import
from test_reward_service import servers  # pylint: disable=unused-import
from test_trainer import apply_overrides  # tests/test_trainer.py
from test_trainer import small_config

from ddrl_jax import checkpoints as checkpoints_lib
from ddrl_jax import config as config_lib
from ddrl_jax import rewards
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.data import pipeline
from ddrl_jax.data import records as records_lib
from ddrl_jax.rewards import pool as pool_lib
from ddrl_jax.rewards import wire

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fns = lambda **w: ml_collections.ConfigDict(w)

# ------------------------------------------------------------------------------ config.validate
# (preset, {key: value}, words the ConfigError must contain). small_config: T = 6, B = 8, N = 4.
VALIDATE = [
    ('ddrl', {'algorithm': 'ppo'}, 'config.algorithm=\'ppo\': unknown algorithm'),
    ('ddrl', {'num_rollouts': 1}, 'config.num_rollouts=1: need N >= 2'),
    ('ddrl', {'batch_size': 0}, 'config.batch_size=0: need at least one group'),
    ('ddrl', {'num_iterations': -1}, 'config.num_iterations=-1: must be >= 0'),
    ('ddrl', {'log_every': 0}, 'config.log_every=0: must be >= 1'),
    ('ddrl', {'checkpoint_every': 0}, 'config.checkpoint_every=0: must be >= 1'),
    ('ddrl', {'max_checkpoints': 0}, 'config.max_checkpoints=0: must be >= 1'),
    ('ddrl', {'max_nonfinite_steps': 0}, 'config.max_nonfinite_steps=0: must be >= 1'),
    ('ddrl', {'eval_every': -2}, 'config.eval_every=-2'),
    ('ddrl', {'eval_samples': 0}, 'config.eval_samples=0: must be >= 1'),
    ('ddrl', {'eval_videos': -1}, 'config.eval_videos=-1'),
    ('ddrl', {'eval_video_fps': 0}, 'config.eval_video_fps=0'),
    ('ddrl', {'data.base_samples': -5}, 'config.data.base_samples=-5'),
    ('ddrl', {'sampler.kind': 'euler'}, "config.sampler.kind='euler': unknown sampler"),
    ('ddrl', {'sampler.num_steps': 1}, 'config.sampler.num_steps=1: need T >= 2'),
    ('ddrl', {'sampler.eval_num_steps': 1}, 'config.sampler.eval_num_steps=1: need 0'),
    ('ddrl', {'rl.clip_range': 0.0}, 'config.rl.clip_range=0.0: the PPO clip range must be > 0'),
    ('ddrl', {'rl.train_steps': ()}, 'config.rl.train_steps=(): no trained steps'),
    ('ddrl', {'rl.train_steps': (0, 6)}, 'indices [6] are outside [0, T)'),
    ('ddrl', {'rl.train_steps': (2, 2)}, 'duplicate step indices'),
    ('ddrl', {'rl.train_steps': (5,)}, 'step T-1 = 5 of cosmos_2ab is deterministic'),
    ('dance_grpo', {'rl.train_fraction': 0.0}, 'config.rl.train_fraction=0.0: must be in (0, 1]'),
    ('ddrl', {'rl.adv_transform': 'softmax'}, "config.rl.adv_transform='softmax'"),
    ('ddrl_exact', {'rl.exact_beta': 0.0}, 'config.rl.exact_beta=0.0: must be > 0'),
    ('ddrl', {'rl.log_ratio': 'kl'}, "config.rl.log_ratio='kl'"),
    ('ddrl', {'rl.old_mean': 'ema'}, "config.rl.old_mean='ema'"),
    ('ddrl', {'rl.data_beta': -1.0}, 'config.rl.data_beta=-1.0: must be >= 0'),
    ('ddrl', {'rl.data_loss_steps': 'half'}, "config.rl.data_loss_steps='half'"),
    ('ddrl', {'rl.data_noise': 'zero'}, "config.rl.data_noise='zero'"),
    ('ddrl', {'rl.data_weighting': 'snr'}, "config.rl.data_weighting='snr'"),
    ('ddrl', {'rl.cond_dropout': 1.0}, 'config.rl.cond_dropout=1.0: must be in [0, 1)'),
    ('flow_grpo', {'rl.kl_beta': -0.1}, 'config.rl.kl_beta=-0.1: must be >= 0'),
    ('ddrl', {'rl.kl_beta': 0.1}, 'ddrl holds no reference model'),
    ('ddrl', {'rl.adv_normalization': 'rank'}, "config.rl.adv_normalization='rank'"),
    ('ddrl', {'rl.adv_eps': 0.0}, 'config.rl.adv_eps=0.0: must be > 0'),
    ('ddrl', {'rl.failed_advantage': 'nan'}, "config.rl.failed_advantage='nan'"),
    ('flow_grpo', {'rl.kl_form': 'girsanov'}, "config.rl.kl_form='girsanov'"),
    ('flow_grpo', {'sampler.kind': 'dance_sde'}, 'only the flow_sde sampler defines'),
    ('diffusion_nft', {'rl.nft_beta': 0.0}, 'config.rl.nft_beta=0.0: must be > 0'),
    ('diffusion_nft', {'rl.nft_old_decay': 5}, 'config.rl.nft_old_decay=5: known schedules'),
    ('diffusion_nft', {'rl.adv_clip': 0.0}, 'config.rl.adv_clip=0.0: diffusion_nft maps advantages'),
    ('ddrl', {'optim.learning_rate': 0.0}, 'config.optim.learning_rate=0.0: must be > 0'),
    ('ddrl', {'optim.grad_clip': 0.0}, 'config.optim.grad_clip=0.0: must be > 0'),
    ('ddrl', {'optim.warmup_steps': -1}, 'config.optim.warmup_steps=-1: must be >= 0'),
    ('ddrl', {'optim.ema_power_s': 0.0}, 'config.optim.ema_power_s=0.0: must be > 0 or None'),
    ('ddrl', {'reward.fns': fns()}, 'config.reward.fns is empty'),
    ('ddrl', {'reward.fns': fns(nope=1.0)}, "config.reward.fns: unknown reward 'nope'"),
    ('ddrl', {'reward.fns': fns(linear=0.0)}, 'config.reward.fns.linear=0.0: weights must be > 0'),
    ('ddrl', {'reward.kwargs': fns(nope={})}, 'config.reward.kwargs names unknown rewards'),
    ('ddrl', {'reward.combine': 'max'}, "config.reward.combine='max'"),
    ('ddrl', {'reward.no_server_grace_s': 0.0}, 'config.reward.no_server_grace_s=0.0: must be > 0'),
    ('ddrl', {'reward.bounds': fns(linear=(1.0, 0.0))}, 'config.reward.bounds.linear=(1.0, 0.0)'),
    ('ddrl', {'reward.backend': 'http'}, "config.reward.backend='http'"),
    ('ddrl', {'reward.workers': -1}, 'config.reward.workers=-1: must be >= 0'),
    ('ddrl', {'reward.chunk_size': 0}, 'config.reward.chunk_size=0: must be >= 1'),
    ('ddrl', {'reward.timeout_s': 0.0}, 'config.reward.timeout_s=0.0: timeouts must be > 0'),
    ('ddrl', {'reward.chunk_timeout_s': 0.0}, 'timeouts must be > 0'),
    ('ddrl', {'reward.max_failed_batches': 0}, 'config.reward.max_failed_batches=0: must be >= 1'),
    ('ddrl', {'reward.fns': fns(clipscore_jax=1.0), 'reward.workers': 2},
     "config.reward.workers=2: ['clipscore_jax'] run JAX on the trainer's devices, in its process"),
    ('ddrl_exact', {'reward.fns': fns(linear=1.0, mean_intensity=1.0)},
     "the exact tilt transform needs one reward or combine='weighted_sum'"),
    ('ddrl', {'mesh.fsdp': 3}, 'config.mesh'),
    ('ddrl', {'batch_size': 3}, 'not divisible by the data-parallel mesh size data*fsdp = 8'),
    ('ddrl', {'micro_batch': 3}, 'config.micro_batch=3: must divide the'),
    ('ddrl', {'sharding.context_impl': 'usp'}, "config.sharding.context_impl='usp': known:"),
    ('ddrl', {'sharding.max_replicated_fraction': 1.5}, 'config.sharding.max_replicated_fraction=1.5'),
    ('ddrl', {'sharding.fsdp_axes': 'fsdp,pod'}, "config.sharding.fsdp_axes='fsdp,pod': unknown mesh axes"),
    ('ddrl', {'sharding.rules.embed': 'model'}, "config.sharding.rules.embed='model': unknown mesh axes"),
    # The Cosmos smoke config (tiny DiT: 2 heads, 2 latent frames) on 8 devices.
    ('cosmos:smoke', {'mesh.data': -1, 'mesh.context': 4}, 'config.cosmos.latent_shape=(2, 4, 4): 2 latent '
     'frames do not divide over mesh.context = 4'),
    ('cosmos:smoke', {'mesh.data': -1, 'mesh.context': 4, 'cosmos.latent_shape': (4, 4, 4)},
     'config.mesh.context=4: Ulysses attention splits the 2 heads over context x tensor = 4 devices'),
]


def _config(preset, overrides):
  if preset != 'cosmos:smoke':
    return small_config(preset, **overrides)
  from configs import cosmos2b  # pylint: disable=g-import-not-at-top
  return apply_overrides(cosmos2b.get_config('smoke'), overrides)


@pytest.mark.parametrize('preset,overrides,words', VALIDATE,
                         ids=[f'{p}:{",".join(o)}={list(o.values())[0]!r}' for p, o, _ in VALIDATE])
def test_validate_rejects(preset, overrides, words):
  c = _config(preset, overrides)
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.validate(c, num_devices=8)
  assert words in str(err.value)


def test_every_key_validate_checks_has_a_row():
  tree = ast.parse(open(os.path.join(ROOT, 'ddrl_jax', 'config.py')).read())
  checked, loops = set(), {}
  for node in ast.walk(tree):
    if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):   # for key in ('a', 'b'): ...
      loops[node.target.id] = {e.value for e in node.iter.elts}
  from ddrl_jax.rl import options, registry  # pylint: disable=g-import-not-at-top
  # f'rl.{key}': the rl keys RLOptions.problems and the algorithms' `problems` check.
  rl_keys = set(options.CHECKED_KEYS).union(*(a.CHECKED_KEYS for a in registry.ALGORITHMS.values()))
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and getattr(node.func, 'id', None) == '_check':
      key = node.args[1]
      if isinstance(key, ast.JoinedStr):
        assert ast.unparse(key) == "f'rl.{key}'", ast.unparse(key)
        checked |= {f'rl.{k}' for k in rl_keys}
      else:
        checked |= {key.value} if isinstance(key, ast.Constant) else loops[key.id]
  rows = {k for _, o, _ in VALIDATE for k in o}
  assert len(checked) > 30
  assert checked <= rows, f'validated keys without a bad-input row: {sorted(checked - rows)}'


# ------------------------------------------------------------------------------------- CLI flags
# (CLI module, arguments, words the one-line error must contain). Every row must exit 2 with exactly one
# line on stderr, `error: <what> (<fix>); see `python -m <cli> --help``, and no traceback. Rows marked
# `early` must fail while the flags are parsed, before any JAX work: they run with JAX_PLATFORMS naming
# a platform that does not exist, so touching a JAX backend would fail differently.
TRAIN = ['--config=configs/toy2d.py', '--workdir=W']
CLI = [
    # train: every kind of mistake
    ('missing flags', 'ddrl_jax.train', [], 'missing --config and --workdir (pass --config=<', True),
    ('missing workdir', 'ddrl_jax.train', ['--config=configs/toy2d.py'], 'missing --workdir (pass', True),
    ('no config file', 'ddrl_jax.train', ['--config=configs/no_such.py', '--workdir=W'],
     'no such file configs/no_such.py (config files in configs/: ', True),
    ('near config file', 'ddrl_jax.train', ['--config=configs/toy2.py', '--workdir=W'],
     'did you mean configs/toy2d.py?', True),
    ('unknown preset', 'ddrl_jax.train', ['--config=configs/toy2d.py:ppo', '--workdir=W'],
     "unknown config preset 'ppo'; known: ", True),
    ('wrong type', 'ddrl_jax.train', TRAIN + ['--config.num_rollouts=eight'],
     "--config.num_rollouts=eight: invalid literal for int() with base 10: 'eight' (config.num_rollouts "
     'takes int values)', True),
    ('unknown key', 'ddrl_jax.train', TRAIN + ['--config.num_rolouts=8'],
     'has no key config.num_rolouts (did you mean "num_rollouts"', True),
    ('unknown nested key', 'ddrl_jax.train', TRAIN + ['--config.rl.no_such=1'], 'has no key config.rl.no_such', True),
    ('unknown flag', 'ddrl_jax.train', TRAIN + ['--no_such_flag=1'], 'unknown flag --no_such_flag', True),
    ('stray argument', 'ddrl_jax.train', TRAIN + ['stray'], "unexpected arguments ['stray']", True),
    ('validate rejects', 'ddrl_jax.train', TRAIN + ['--config.num_rollouts=1'],
     'config.num_rollouts=1: need N >= 2 rollouts per group for a group-relative advantage (change it '
     'with --config.num_rollouts=... or in configs/toy2d.py)', False),
    # the other CLIs
    ('pretrain missing workdir', 'ddrl_jax.pretrain', ['--config=configs/ocr_tiny.py'], 'missing --workdir',
     True),
    ('evaluate unknown key', 'ddrl_jax.evaluate', ['--config=configs/ocr_tiny.py', '--config.no_such=1'],
     'has no key config.no_such', True),
    ('evaluate wrong type', 'ddrl_jax.evaluate', ['--config=configs/ocr_tiny.py', '--prompts=many'],
     '--prompts=many: invalid literal for int()', True),
    ('aot missing topology', 'ddrl_jax.aot', ['--config=configs/cosmos2b.py'], 'missing --topology', True),
    ('aot no config file', 'ddrl_jax.aot', ['--config=configs/cosmos3b.py', '--topology=v5p-8'],
     'no such file configs/cosmos3b.py', True),
    ('synthesize unknown preset', 'ddrl_jax.data.synthesize', ['--config=configs/ocr_tiny.py:ppo',
                                                               '--out=W'], "unknown config preset 'ppo'", True),
    ('prepare missing source', 'ddrl_jax.data.prepare', ['--out=W'], 'missing --source', True),
    ('prepare pixels without a size', 'ddrl_jax.data.prepare', ['--out=W', '--source=W'],
     'without --config, the records hold pixels and need a size (pass --height and --width', True),
    ('serve wrong type', 'ddrl_jax.rewards.serve', ['--workers=two'], '--workers takes int values', True),
    ('convert missing flags', 'ddrl_jax.models.convert', [], 'the following arguments are required', True),
    ('convert unknown model', 'ddrl_jax.models.convert', ['--source=W', '--model=sdxl', '--out=W'],
     "invalid choice: 'sdxl'", True),
    ('convert no source', 'ddrl_jax.models.convert', ['--source=W/none.pt', '--model=cosmos_tiny', '--out=W'],
     'no such file', True),
]
CLIS = ('ddrl_jax.train', 'ddrl_jax.pretrain', 'ddrl_jax.evaluate', 'ddrl_jax.aot', 'ddrl_jax.data.prepare',
        'ddrl_jax.data.synthesize', 'ddrl_jax.rewards.serve', 'ddrl_jax.models.convert')


def _run_cli(module, args, tmp, early):
  """Starts `python -m module args` (W in the arguments is the folder `tmp`); returns the Popen."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop('DDRL_TRACEBACK', None)
  if early:
    env['JAX_PLATFORMS'] = 'no_such_platform'
  args = [a.replace('=W', f'={tmp}') for a in args]
  return subprocess.Popen([sys.executable, '-m', module] + args, cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope='module')
def cli_answers(request, tmp_path_factory):
  """{row name: (returncode, stdout, stderr, workdir)} of the selected CLI rows and `--help`s, run two at
  a time (each run is mostly Python start-up and imports; the fast tier has the train rows only)."""
  selected = {item.callspec.id for item in request.session.items
              if getattr(item, 'callspec', None) and item.originalname in (
                  'test_cli_mistake_is_one_line', 'test_cli_help_exits_0')}
  rows = [(name, module, args, early) for name, module, args, _, early in CLI if name in selected]
  rows += [(f'{module} --help', module, ['--help'], True) for module in CLIS if module in selected]
  answers, running = {}, []
  for name, module, args, early in rows:
    tmp = tmp_path_factory.mktemp('cli')
    running.append((name, tmp, _run_cli(module, args, tmp, early)))
    while len(running) >= 2 or (running and name == rows[-1][0]):
      done_name, done_tmp, proc = running.pop(0)
      out, err = proc.communicate(timeout=300)
      answers[done_name] = (proc.returncode, out, err, done_tmp)
  return answers


def _is_one_line_error(stderr, module):
  lines = stderr.strip().splitlines()
  return (len(lines) == 1 and lines[0].startswith('error: ')
          and lines[0].endswith(f'; see `python -m {module} --help`'))


def _tier(module):
  return () if module == 'ddrl_jax.train' else (pytest.mark.slow,)


@pytest.mark.parametrize('name,module,args,words,early',
                         [pytest.param(*row, id=row[0], marks=_tier(row[1])) for row in CLI])
def test_cli_mistake_is_one_line(name, module, args, words, early, cli_answers):  # pylint: disable=redefined-outer-name
  del args, early
  returncode, _, stderr, workdir = cli_answers[name]
  assert returncode == 2, stderr[-2000:]
  assert _is_one_line_error(stderr, module), stderr[-2000:]
  assert words in stderr, stderr[-2000:]
  assert not os.path.exists(workdir / 'checkpoints')


@pytest.mark.parametrize('module', [pytest.param(m, id=m, marks=_tier(m)) for m in CLIS])
def test_cli_help_exits_0(module, cli_answers):  # pylint: disable=redefined-outer-name
  returncode, stdout, stderr, _ = cli_answers[f'{module} --help']
  assert returncode == 0, stderr[-2000:]
  assert '--' in stdout and 'error' not in stderr


def test_cli_traceback_flag_shows_the_trace(tmp_path):
  for extra, env in ((['--traceback'], {}), ([], {'DDRL_TRACEBACK': '1'})):
    out = subprocess.run([sys.executable, '-m', 'ddrl_jax.train', '--config=configs/no_such.py',
                          f'--workdir={tmp_path}'] + extra, cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=ROOT, **env))
    assert out.returncode != 0
    assert 'Traceback (most recent call last)' in out.stderr and 'no such file' in out.stderr


# ------------------------------------------------------------------------------------- records
def _shard(path, raws):
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  writer = array_record_module.ArrayRecordWriter(str(path), 'group_size:1')
  for raw in raws:
    writer.write(raw)
  writer.close()
  return str(path)


def _record(sample):
  return records_lib.encode_record({'prompt': 'p', 'sample': np.asarray(sample, np.float32)})


RECORDS = [
    ('corrupt', lambda i: b'\x00garbage' if i == 3 else _record(np.full(2, i)),
     r'bad\.array_record\[3\]: corrupt record'),
    ('misshaped', lambda i: _record(np.full(3 if i == 3 else 2, i)),
     r"bad\.array_record\[3\]: field 'sample' is \(3,\) float32, but .* has \(2,\) float32"),
    ('misshaped_vs_manifest', lambda i: _record(np.full(3 if i == 3 else 2, i)),
     r"bad\.array_record\[3\]: field 'sample' has shape \(3,\) float32, expected \(2,\)"),
]


@pytest.mark.parametrize('kind,make,words', RECORDS, ids=[r[0] for r in RECORDS])
def test_bad_record_stops_the_loader_naming_shard_and_index(kind, make, words, tmp_path):
  path = _shard(tmp_path / 'bad.array_record', [make(i) for i in range(8)])
  expected = {'sample': ((2,), 'float32')} if kind == 'misshaped_vs_manifest' else None
  loader = pipeline.RecordLoader(path, 8, seed=0, shuffle=False, expected=expected)
  with pytest.raises(records_lib.RecordError, match=words):
    next(loader)


# --------------------------------------------------------------------------------- checkpoints
def _state_file(step_dir):
  files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, 'state')) for f in fs]
  return max(files, key=os.path.getsize)


def _truncate(step_dir):
  p = _state_file(step_dir)
  with open(p, 'r+b') as f:
    f.truncate(os.path.getsize(p) // 2)


def _flip(step_dir):
  p = _state_file(step_dir)
  data = bytearray(open(p, 'rb').read())
  data[len(data) // 2] ^= 0xFF
  open(p, 'wb').write(bytes(data))


def _unrecorded_truncate(step_dir):      # killed between orbax's commit and the integrity record
  os.remove(os.path.join(step_dir, checkpoints_lib.INTEGRITY))
  _truncate(step_dir)


# (name, damage(workdir), config overrides, error class or None for a fallback, words)
CHECKPOINTS = [
    ('truncated', lambda w: _truncate(w / 'checkpoints' / '4'), {}, None, 'truncated or replaced'),
    ('file_missing', lambda w: os.remove(_state_file(w / 'checkpoints' / '4')), {}, None, ': missing'),
    ('altered', lambda w: _flip(w / 'checkpoints' / '4'), {}, None, 'contents changed'),
    ('truncated_unrecorded', lambda w: _unrecorded_truncate(w / 'checkpoints' / '4'), {}, None,
     'is damaged'),
    ('config_item_missing', lambda w: shutil.rmtree(w / 'checkpoints' / '4' / 'config'), {}, None,
     'is damaged'),
    ('all_damaged', lambda w: [_truncate(w / 'checkpoints' / s) for s in ('2', '4')], {},
     checkpoints_lib.DamagedCheckpoint, 'Not starting again from step 0'),
    ('other_model_shape', lambda w: None, {'toy2d.width': 48}, checkpoints_lib.IncompatibleCheckpoint,
     'toy2d.width: 32 in the checkpoint, 48 now'),
    ('other_algorithm', lambda w: None, {'_preset': 'flow_grpo'}, checkpoints_lib.IncompatibleCheckpoint,
     "algorithm: 'ddrl' in the checkpoint, 'flow_grpo' now"),
    ('other_data', lambda w: None, {'data.path': '/no/such/records'},
     checkpoints_lib.IncompatibleCheckpoint, 'data.path'),
]


@pytest.mark.parametrize('name,damage,overrides,error,words', CHECKPOINTS,
                         ids=[c[0] for c in CHECKPOINTS])
def test_damaged_or_mismatched_checkpoint(name, damage, overrides, error, words, trained, tmp_path,
                                          caplog):
  workdir = tmp_path / 'run'
  shutil.copytree(trained, workdir)
  damage(workdir)
  overrides = dict(overrides)
  preset = overrides.pop('_preset', 'ddrl')
  c = small_config(preset, num_iterations=4, **overrides)
  if name == 'other_data':       # the loader must exist for the run to get as far as the checkpoint
    c.data.path = ''
    trainer = trainer_lib.Trainer(c, workdir, devices=jax.devices()[:1])
    c.data.path = overrides['data.path']
    trainer.config = c
  else:
    trainer = trainer_lib.Trainer(c, workdir, devices=jax.devices()[:1])
  if error is None:              # damaged latest: warn naming it, fall back to step 2, set it aside
    assert trainer.restore_or_init() == 2
    assert f'checkpoint {workdir}/checkpoints/4 is damaged' in caplog.text
    assert words in caplog.text
    assert os.listdir(workdir / 'checkpoints_damaged')[0].startswith('4_')
    assert not os.path.exists(workdir / 'checkpoints' / '4')
  else:
    with pytest.raises(error) as err:
      trainer.restore_or_init()
    assert words in str(err.value) and str(workdir / 'checkpoints') in str(err.value)
    assert trainer.state is None   # nothing restored, nothing initialized from step 0


def test_safe_config_change_resumes_and_is_logged(trained, tmp_path, caplog):
  caplog.set_level(logging.INFO, logger='ddrl_jax')      # a safe change is news, not a warning
  workdir = tmp_path / 'run'
  shutil.copytree(trained, workdir)
  c = small_config('ddrl', num_iterations=9, **{'optim.learning_rate': 1e-4})
  assert trainer_lib.Trainer(c, workdir, devices=jax.devices()[:1]).restore_or_init() == 4
  assert 'num_iterations changed: 4 -> 9' in caplog.text
  assert 'optim.learning_rate changed: 0.0003 -> 0.0001' in caplog.text


# ------------------------------------------------------------------------------ reward workers
# (name, rewards {name: kwargs}, failure kind, words in the failure message). Reward faults never stop
# the trainer: the samples get NaN (advantage 0), the kind is counted, the message says why.
REWARD_FAULTS = [
    ('crash', {'debug_crash': {}}, 'crash', 'exited with code 13 while scoring'),
    ('hang', {'debug_sleep': {'seconds': 60}}, 'timeout', 'no reply within 2.0 s (killed)'),
    ('garbage', {'debug_garbage': {'kind': 'strings'}}, 'non_numeric', '4 of 4 scores are not numbers'),
    ('nested_garbage', {'debug_garbage': {'kind': 'nested'}}, 'wrong_length',
     'do not have one value per sample'),
    ('wrong_count', {'debug_garbage': {'kind': 'shape'}}, 'wrong_length', 'do not have one value per sample'),
    ('nan', {'debug_garbage': {'kind': 'nan'}}, 'nan', '4 of 4 scores are NaN'),
    ('bool', {'debug_garbage': {'kind': 'bool'}}, 'bool', 'are booleans, not numbers'),
    ('huge', {'debug_garbage': {'kind': 'huge64'}}, 'out_of_range', "outside the reward's bound"),
]


@pytest.mark.parametrize('name,specs,kind,words', REWARD_FAULTS, ids=[r[0] for r in REWARD_FAULTS])
def test_reward_fault_is_nan_and_counted(name, specs, kind, words):
  del name
  with pool_lib.WorkerPool(specs, 1, chunk_timeout_s=2.0) as pool:
    result = pool.submit(IMAGES[:4], ['x'] * 4, chunk_size=4).result(timeout=60)
  (reward,) = specs
  assert np.isnan(result.scores[reward]).all()
  assert result.failures[kind] == 4 and sum(result.failures.values()) == 4     # one per sample
  assert any(words in e for e in result.errors), result.errors


def test_unbuildable_reward_is_an_error():
  with pool_lib.WorkerPool({'debug_sleep': {'no_such_arg': 1}}, 1) as pool:
    with pytest.raises(rewards.RewardServiceError, match='cannot build rewards'):
      pool.submit(IMAGES[:4], ['x'] * 4).result(timeout=60)


def test_reply_with_wrong_number_of_scores_is_refused_by_the_wire_check():
  with pytest.raises(wire.WireError, match=r'scores have shape \(3,\), expected \(4,\)'):
    wire.check_scores(np.zeros(3, np.float32), 4)


# ------------------------------------------------------------------------------- Redis service
def test_wrong_token_is_an_error(redis_url, servers):  # pylint: disable=redefined-outer-name
  servers()
  with pytest.raises(rewards.RewardServiceError, match='bearer token'):
    client(redis_url, {'mean_intensity': 1.0}, token='wrong-token').check()


@pytest.mark.parametrize('payload,words', [
    (b'\xc1\xc1 not msgpack', 'not a msgpack message'),
    (b'\x81\xa4auth\xa3bad', 'malformed request: message lacks'),
])
def test_malformed_redis_payload_is_answered_400(payload, words, redis_url, servers):  # pylint: disable=redefined-outer-name
  servers()
  svc = client(redis_url, {'mean_intensity': 1.0})
  svc.push('bad', payload)
  assert svc.redis.blpop([svc.keys.done('bad')], timeout=30)
  reply = wire.unpack(svc.redis.get(svc.keys.result('bad')))
  assert reply['code'] in (400, 401) and words in reply['error'], reply


def test_checkpoints_from_before_added_keys_still_resume():
  """A saved config without the keys added later (checkpoints.ADDED_KEY_DEFAULTS) matches today's config
  at the values that reproduce those runs, and differs (unsafely) at any other value."""
  current = small_config('ddrl').to_dict()
  saved = copy.deepcopy(current)
  for key in checkpoints_lib.ADDED_KEY_DEFAULTS:
    *sections, name = key.split('.')
    parent = saved
    for section in sections:
      parent = parent[section]
    del parent[name]
  assert checkpoints_lib.config_differences(saved, current) == ([], [])
  current['rl']['kl_form'] = 'flow_grpo'
  assert checkpoints_lib.config_differences(saved, current)[1] == [('rl.kl_form', 'exact', 'flow_grpo')]
  for key, value in checkpoints_lib.ADDED_KEY_DEFAULTS.items():   # the defaults are today's defaults
    assert checkpoints_lib.flatten(small_config('ddrl').to_dict())[key] == value, key
