"""The one-line contract as a table: every CLI x every family's presets x the common mistakes exits 2 with
exactly one `error:` line (the last line on stderr, no traceback) naming the mistake, and leaves no file
behind (a workdir holding another run is left as it was).

Mistakes: a full preset without its weights, a model_family with no section in the config, an unknown
reward, a data path with no records, LoRA targets matching nothing, a workdir holding another config's
run, and each CLI's own (a task that cannot do what the CLI does, a source without media). Cells where a
mistake is not one for that CLI are left out and named in NOT_MISTAKES.

Each cell is `python -m <cli> ...` in its own process (2 at a time; each is mostly Python start-up and
imports). The fast tier runs FAST_CELLS; CI's slow step runs them all.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# family -> (full preset or None, smoke preset, a family whose section that config lacks)
FAMILIES = {
    'toy': (None, 'configs/toy2d.py', 'wan'),
    'ocr': (None, 'configs/ocr_tiny.py', 'sd3'),
    'sd3': ('configs/sd35m.py:ddrl', 'configs/sd35m.py:ddrl_smoke', 'wan'),
    'wan': ('configs/wan1_3b.py:flow_grpo', 'configs/wan1_3b.py:flow_grpo_smoke', 'sd3'),
    'cosmos': ('configs/cosmos2b.py', 'configs/cosmos2b.py:smoke', 'sd3'),
}
# Which CLIs read a config (W: the cell's empty folder; RUN: a toy2d run made once per session).
CONFIG_CLIS = {
    'train': ('ddrl_jax.train', ['--workdir=W/run']),
    'evaluate': ('ddrl_jax.evaluate', ['--checkpoint=base', '--out=W/eval.jsonl']),
    'aot': ('ddrl_jax.aot', ['--topology=cpu-1']),
    'pretrain': ('ddrl_jax.pretrain', ['--workdir=W/run']),
    'export_lora': ('ddrl_jax.export_lora', ['--workdir=RUN', '--out=W/export']),
    'synthesize': ('ddrl_jax.data.synthesize', ['--out=W/out']),
    'prepare': ('ddrl_jax.data.prepare', ['--source=W/src', '--out=W/out']),
}
NOT_MISTAKES = {
    ('aot', 'missing_inputs'): 'aot compiles shapes: it needs no weights',
    ('aot', 'missing_data'): 'aot compiles shapes: it reads no records',
    ('evaluate', 'missing_data'): 'evaluation reads no training records',
    ('prepare', 'unknown_reward'): 'prepare encodes media: it runs no reward',
    ('prepare', 'missing_data'): 'prepare writes records: its source is --source (row prepare/no_media)',
    ('prepare', 'bad_lora'): 'prepare runs no denoiser',
    ('synthesize', 'missing_data'): 'synthesize writes records, it reads none',
}
FAMILY_SECTION_WORDS = "config.model_family='{other}': this config has no config.{other} section"


def _mistake_args(mistake, fam):
  other = FAMILIES[fam][2]
  return {
      'wrong_family': ([f'--config.model_family={other}'], FAMILY_SECTION_WORDS.format(other=other)),
      'unknown_reward': (["--config.reward.fns={'nope': 1.0}"], "unknown reward 'nope'"),
      'missing_data': (['--config.data.path=W/no_such_records'], 'config.data.path='),
      'bad_lora': (['--config.lora.rank=4', "--config.lora.targets=('nomatch',)"],
                   'has no LoRA adapters' if fam == 'toy' else 'match no dense layer'),
  }[mistake]


def _cells():
  """(id, module, args, words) of every cell."""
  cells = []
  for cli, (module, base_args) in CONFIG_CLIS.items():
    for fam, (full, smoke, _) in FAMILIES.items():
      spec = smoke
      if cli == 'pretrain' and fam != 'ocr':      # only the OCR toy task pretrains its own base
        cells.append((f'{cli}/{fam}/no_pretraining', module, [f'--config={smoke}'] + base_args,
                      "cannot do 'pretrain'"))
        continue
      if cli == 'prepare' and fam in ('toy', 'ocr'):   # tasks that encode no media
        cells.append((f'{cli}/{fam}/no_media_encoder', module, [f'--config={smoke}'] + base_args,
                      "cannot do 'media'"))
        continue
      if cli == 'aot' and fam in ('toy', 'ocr'):       # CPU-sized tasks: nothing to compile for a slice
        cells.append((f'{cli}/{fam}/no_aot', module, [f'--config={smoke}'] + base_args, "cannot do 'aot'"))
        continue
      if cli == 'export_lora' and fam == 'toy':        # a model without adapters: nothing to export
        cells.append((f'{cli}/{fam}/no_adapters', module, [f'--config={smoke}'] + base_args,
                      'there are no adapters to export'))
        continue
      extra = ['--config.lora.rank=4'] if cli == 'export_lora' else []
      if (cli, fam) == ('evaluate', 'cosmos'):         # the video evaluation reads a prompt file first
        extra = ['--prompt_file=W/prompts.jsonl']
      if full and (cli, 'missing_inputs') not in NOT_MISTAKES and cli != 'export_lora':
        words = ('the evaluation needs inputs it was not given' if (cli, fam) == ('evaluate', 'cosmos')
                 else 'needs inputs it was not given')
        cells.append((f'{cli}/{fam}/missing_inputs', module, [f'--config={full}'] + base_args, words))
      for mistake in ('wrong_family', 'unknown_reward', 'missing_data', 'bad_lora'):
        if (cli, mistake) in NOT_MISTAKES or (cli == 'pretrain' and mistake in ('missing_data', 'bad_lora')):
          continue
        args, words = _mistake_args(mistake, fam)
        if (cli, fam, mistake) == ('evaluate', 'cosmos', 'unknown_reward'):   # its rewards are its judges
          args, words = ['--judges=nope'], "unknown judges ['nope']"
        cells.append((f'{cli}/{fam}/{mistake}', module, [f'--config={spec}'] + base_args + extra + args,
                      words))
  cells += [
      # a workdir holding another config's run (RUN: toy2d DDRL)
      ('train/ocr/foreign_workdir', 'ddrl_jax.train', ['--config=configs/ocr_tiny.py', '--workdir=RUN'],
       "was written with another config: task: 'toy2d' in the checkpoint, 'ocr' now"),
      ('evaluate/ocr/foreign_workdir', 'ddrl_jax.evaluate', ['--config=configs/ocr_tiny.py',
                                                             '--checkpoint=RUN', '--out=W/e.jsonl'],
       "holds a run of another config, whose state does not fit this one: task: 'toy2d'"),
      ('evaluate/sd3/foreign_workdir', 'ddrl_jax.evaluate', ['--config=configs/sd35m.py:ddrl_smoke',
                                                             '--checkpoint=RUN', '--out=W/e.jsonl'],
       "holds a run of another config, whose state does not fit this one: task: 'toy2d'"),
      ('synthesize/ocr/foreign_workdir', 'ddrl_jax.data.synthesize', ['--config=configs/ocr_tiny.py',
                                                                      '--workdir=RUN', '--out=W/out'],
       "holds a run of another config"),
      ('train/toy/other_algorithm_in_workdir', 'ddrl_jax.train',
       ['--config=configs/toy2d.py:flow_grpo', '--workdir=RUN'], "algorithm: 'ddrl' in the checkpoint"),
      ('export_lora/sd3/no_run', 'ddrl_jax.export_lora', ['--config=configs/sd35m.py:ddrl_smoke',
                                                          '--workdir=W/none'], 'no training run there'),
      ('evaluate/sd3/no_run', 'ddrl_jax.evaluate', ['--config=configs/sd35m.py:ddrl_smoke',
                                                    '--checkpoint=W/none'], 'not a trainer workdir'),
      ('synthesize/sd3/no_run', 'ddrl_jax.data.synthesize', ['--config=configs/sd35m.py:ddrl_smoke',
                                                             '--workdir=W/none', '--out=W/out'],
       'no training run there'),
      ('prepare/wan/no_media', 'ddrl_jax.data.prepare', ['--config=configs/wan1_3b.py:flow_grpo_smoke',
                                                         '--source=W/src', '--out=W/out'], 'no media files'),
      ('aot/sd3/unknown_topology', 'ddrl_jax.aot', ['--config=configs/sd35m.py:ddrl_smoke',
                                                    '--topology=v5p-7'], "unknown topology 'v5p-7'"),
      # convert: the source is the mistake (no config)
      ('convert/sd3/no_source', 'ddrl_jax.models.convert', ['--model=sd35_medium', '--source=W/none',
                                                            '--out=W/out'], 'no such file or folder'),
      ('convert/sd3/folder_without_weights', 'ddrl_jax.models.convert',
       ['--model=sd35_medium', '--source=W/empty', '--out=W/out'], 'no *.safetensors in the folder'),
      ('export_lora/sd3/foreign_workdir', 'ddrl_jax.export_lora',
       ['--config=configs/sd35m.py:ddrl_smoke', '--config.lora.rank=4', '--workdir=RUN', '--out=W/export'],
       "holds a run of another config, whose state does not fit this one: task: 'toy2d'"),
      ('convert/wan/other_models_weights', 'ddrl_jax.models.convert',
       ['--model=wan1_3b', '--source=W/src/other.safetensors', '--out=W/out'], '825 missing'),
      ('convert/cosmos/other_models_weights', 'ddrl_jax.models.convert',
       ['--model=cosmos2b', '--source=W/src/other.safetensors', '--out=W/out'],
       'state dict does not match CosmosDiT'),
  ]
  return cells


CELLS = _cells()
FAST_CELLS = ('evaluate/sd3/missing_inputs', 'export_lora/wan/missing_data', 'prepare/cosmos/missing_inputs',
              'synthesize/ocr/foreign_workdir', 'aot/toy/bad_lora', 'pretrain/sd3/no_pretraining')


def _files(folder):
  out = set()
  for dirpath, _, files in os.walk(folder):
    out.update(os.path.relpath(os.path.join(dirpath, f), folder) for f in files)
  return out


@pytest.fixture(scope='module')
def toy_run(tmp_path_factory):
  """A finished 1-iteration toy2d DDRL run: the 'workdir holding another config's run'."""
  run = tmp_path_factory.mktemp('toy_run')
  subprocess.run([sys.executable, '-m', 'ddrl_jax.train', '--config=configs/toy2d.py', f'--workdir={run}',
                  '--config.num_iterations=1', '--config.eval_every=-1'], cwd=ROOT, check=True,
                 capture_output=True, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  return run


@pytest.fixture(scope='module')
def answers(request, tmp_path_factory, toy_run):  # pylint: disable=redefined-outer-name
  """{cell id: (returncode, stderr, files left in W, RUN's files before, after)} of the selected cells."""
  selected = {item.callspec.id for item in request.session.items
              if getattr(item, 'callspec', None) and item.originalname == 'test_cli_mistake_is_one_line'}
  rows = [c for c in CELLS if c[0] in selected]
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  env.pop('DDRL_TRACEBACK', None)
  out, running = {}, []

  def start(cell):
    name, module, args, _ = cell
    work = tmp_path_factory.mktemp('cell')
    (work / 'src').mkdir()
    (work / 'empty').mkdir()
    (work / 'src' / 'notes.txt').write_text('not media')
    (work / 'prompts.jsonl').write_text('{"prompt": "a robot arm stacks cups", "category": "robotics"}\n')
    from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    save_file({'foo.weight': np.zeros((2, 2), np.float32)}, str(work / 'src' / 'other.safetensors'))
    before = _files(work), _files(toy_run)
    args = [a.replace('=W/', f'={work}/').replace('=RUN', f'={toy_run}') for a in args]
    proc = subprocess.Popen([sys.executable, '-m', module] + args, cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return name, work, before, proc

  def finish(name, work, before, proc):
    _, err = proc.communicate(timeout=600)
    out[name] = (proc.returncode, err, _files(work) - before[0], before[1], _files(toy_run))

  for cell in rows:
    running.append(start(cell))
    if len(running) >= 2:
      finish(*running.pop(0))
  while running:
    finish(*running.pop(0))
  return out


def _tier(name):
  return () if name in FAST_CELLS else (pytest.mark.slow,)


@pytest.mark.parametrize('name,module,words', [pytest.param(n, m, w, id=n, marks=_tier(n))
                                               for n, m, _, w in CELLS])
def test_cli_mistake_is_one_line(name, module, words, answers):  # pylint: disable=redefined-outer-name
  returncode, stderr, left, run_before, run_after = answers[name]
  lines = stderr.strip().splitlines()
  errors = [line for line in lines if line.startswith('error:')]
  assert returncode == 2, stderr[-3000:]
  assert len(errors) == 1 and lines[-1] == errors[0], stderr[-3000:]
  assert errors[0].endswith(f'see `python -m {module} --help`'), errors[0]
  assert 'Traceback' not in stderr
  assert words in errors[0], (words, errors[0])
  assert not left, f'files left behind: {sorted(left)}'
  assert run_after == run_before, 'the other run\'s workdir was changed'


def test_every_cli_and_family_has_cells():
  names = [c[0] for c in CELLS]
  for cli in list(CONFIG_CLIS) + ['convert']:
    assert any(n.startswith(cli + '/') for n in names), cli
  for cli in CONFIG_CLIS:
    for fam in FAMILIES:
      assert any(n.startswith(f'{cli}/{fam}/') for n in names), (cli, fam)
  assert len(names) == len(set(names)) and len(names) > 100
