"""The paper's video evaluation and the Cosmos presets' first contact: prompt files with categories,
Cosmos' classifier-free guidance, first-frame latents, per-category tables, `python -m ddrl_jax.evaluate`
on a prompt file, the presets of Table 1 and their one-line stop without weights, data or rewards."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import cosmos14b
from configs import cosmos2b
from ddrl_jax import preflight
from ddrl_jax import trainer as trainer_lib
from ddrl_jax.data import prompt_file
from ddrl_jax.models.cosmos import family as cosmos_family
from ddrl_jax.tasks import video
from ddrl_jax.tasks import video_eval

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _png(path, size=40, seed=0):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  Image.fromarray(rng.integers(0, 256, (size, size + 8, 3), dtype=np.uint8)).save(path)
  return path


# ------------------------------------------------------------------------------------------ prompt files
def test_prompt_file_layouts_and_errors(tmp_path):
  os.makedirs(tmp_path / 'frames')
  _png(tmp_path / 'frames' / 'a.png')
  lines = [{'prompt': 'a robot arm picks a cup', 'category': 'robotics', 'first_frame': 'frames/a.png'},
           {'prompt': 'a car turns left', 'category': 'driving'},
           {'prompt': ' a person waves ', 'image': 'frames/a.png'}]
  (tmp_path / 'p.jsonl').write_text('\n'.join(json.dumps(l) for l in lines) + '\n\n')
  entries = prompt_file.read_prompt_file(str(tmp_path / 'p.jsonl'))
  assert [(e.prompt, e.category, e.mode) for e in entries] == [
      ('a robot arm picks a cup', 'robotics', 'i2v'), ('a car turns left', 'driving', 't2v'),
      ('a person waves', 'all', 'i2v')]
  assert entries[0].first_frame == str(tmp_path / 'frames' / 'a.png')
  (tmp_path / 'p.csv').write_text('prompt,category,first_frame\na cup,industry,frames/a.png\nrain,others,\n')
  assert [e.mode for e in prompt_file.read_prompt_file(str(tmp_path / 'p.csv'))] == ['i2v', 't2v']
  (tmp_path / 'p.txt').write_text('one\n\ntwo\n')
  assert [e.prompt for e in prompt_file.read_prompt_file(str(tmp_path / 'p.txt'))] == ['one', 'two']
  for name, text, match in [
      ('bad.jsonl', '{"prompt": "x"}\n{"category": "y"}\n', r'bad.jsonl:2: no "prompt"'),
      ('gone.jsonl', '{"prompt": "x", "first_frame": "nope.png"}\n', r'gone.jsonl:1: first frame .*nope.png'),
      ('broken.jsonl', '{"prompt": \n', r'broken.jsonl:1: not JSON'),
      ('empty.txt', '\n', 'no prompts'),
      ('p.yaml', 'x', 'unknown prompt file type')]:
    (tmp_path / name).write_text(text)
    with pytest.raises(prompt_file.PromptFileError, match=match):
      prompt_file.read_prompt_file(str(tmp_path / name))


def test_summary_means_per_category_and_mode():
  entries = [prompt_file.EvalPrompt('a', 'x', None), prompt_file.EvalPrompt('b', 'x', '/f.png'),
             prompt_file.EvalPrompt('c', 'y', None), prompt_file.EvalPrompt('d', 'y', None)]
  columns = {'r': np.array([1.0, 2.0, np.nan, 4.0]), 's': np.array([0.0, 0.0, 1.0, 1.0])}
  s = video_eval.summarize(columns, entries)
  assert s['r'] == pytest.approx(7 / 3) and s['s'] == 0.5
  assert s['r@x'] == 1.5 and s['r@y'] == 4.0 and s['s@y'] == 1.0
  assert s['r@t2v'] == 2.5 and s['r@i2v'] == 2.0 and s['r@x/t2v'] == 1.0
  assert s['n@all'] == 4 and s['n@i2v'] == 1 and s['n@y/t2v'] == 2
  table = video_eval.table_markdown(s, entries, ['r', 's'])
  assert '| x | 2 | 1.5000 | 0.0000 |' in table and '| all | 4 | 2.3333 | 0.5000 |' in table
  assert video_eval.example_rows(entries, 1) == [0, 2]


# -------------------------------------------------------------------------------- guidance, first frames
@pytest.fixture(scope='module')
def smoke_task():
  task = video.CosmosVideo(cosmos2b.get_config('smoke'))
  apply_fn, params = task.init_model(jax.random.key(0))
  return task, apply_fn, params


def test_guided_velocity_is_cosmos_cfg_and_leaves_the_conditioned_frame(smoke_task):
  """v = v_c + w (v_c - v_neg) from one batched call equals the formula over two unguided calls."""
  task, apply_fn, params = smoke_task
  b = 4
  k = jax.random.split(jax.random.key(3), 4)
  x_t = jax.random.normal(k[0], (b,) + task.sample_shape)
  t = jnp.array([0.9, 0.5, 0.3, 0.7])
  text = jax.random.normal(k[1], (b, task.c.text_length, task.text_dim))
  null = jax.random.normal(k[2], (b, task.c.text_length, task.text_dim))
  first = jax.random.normal(k[3], (b,) + task.sample_shape[:1] + (1,) + task.sample_shape[2:])
  cond = dict(text=text, first_frame=first, num_cond=jnp.array([0, 1, 0, 1], jnp.int32))
  w = jnp.array([7.0, 7.0, 3.0, 0.0])
  guided = apply_fn(params, x_t, t, dict(cond, guidance=w, null_text=null))
  v_c = apply_fn(params, x_t, t, cond)
  v_n = apply_fn(params, x_t, t, dict(cond, text=null))
  expect = v_c + w[:, None, None, None, None] * (v_c - v_n)
  np.testing.assert_allclose(guided, expect, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(guided[3], v_c[3], rtol=1e-6, atol=1e-6)            # w = 0: no guidance
  frame0 = (x_t[1, :, :1] - first[1]) / t[1]                                      # I2V: replaced frame
  np.testing.assert_allclose(guided[1, :, :1], frame0, rtol=1e-5, atol=1e-5)
  assert not np.allclose(guided[0], v_c[0], atol=1e-4)


def test_first_frame_latent_is_frame_zero_of_the_video_latent(smoke_task, tmp_path):
  """The causal Wan VAE: an image encoded alone gives latent frame 0 of any video starting with it."""
  task = smoke_task[0]
  f, h, w, _ = task.media_shape
  rng = np.random.default_rng(1)
  clip = rng.integers(0, 256, (1, f, h, w, 3), dtype=np.uint8)
  np.save(tmp_path / 'frame.npy', clip[0, 0])
  alone = task.encode_first_frames([str(tmp_path / 'frame.npy')])
  whole = task.encode_samples(clip)
  assert alone.shape == (1,) + task.sample_shape[:1] + (1,) + task.sample_shape[2:]
  np.testing.assert_allclose(alone, whole[:, :, :1], rtol=1e-4, atol=1e-4)


def test_eval_conditions_from_a_prompt_file_with_guidance(tmp_path):
  _png(tmp_path / 'a.png')
  (tmp_path / 'p.jsonl').write_text(json.dumps({'prompt': 'a cup', 'category': 'industry',
                                                'first_frame': 'a.png'}) + '\n'
                                    + json.dumps({'prompt': 'a road', 'category': 'driving'}) + '\n')
  config = cosmos2b.get_config('smoke')
  config.cosmos.eval_prompts = str(tmp_path / 'p.jsonl')
  task = video.CosmosVideo(config)
  cond = task.eval_conditions(jax.random.key(0), 3)
  assert np.asarray(cond['num_cond']).tolist() == [1, 0, 1]
  assert np.asarray(cond['index']).tolist() == [-1, -2, -1]
  assert task.prompts(cond) == ['a cup', 'a road', 'a cup']
  assert np.abs(np.asarray(cond['first_frame'][1])).max() == 0 < np.abs(np.asarray(cond['first_frame'][0])).max()
  assert np.asarray(cond['guidance']).tolist() == [7.0] * 3
  np.testing.assert_allclose(cond['null_text'][0], task.encode_prompts([cosmos_family.NEGATIVE_PROMPT])[0])
  config.cosmos.guidance_eval = 0.0
  assert 'guidance' not in video.CosmosVideo(config).eval_conditions(jax.random.key(0), 2)


def test_a_records_run_without_a_prompt_file_cannot_evaluate():
  config = cosmos2b.get_config('smoke')
  config.cosmos.data = 'records'
  with pytest.raises(ValueError, match='config.cosmos.eval_prompts'):
    video.CosmosVideo(config).eval_conditions(jax.random.key(0), 2)


# -------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize('module', [cosmos2b, cosmos14b])
def test_table1_presets(module):
  model = module.__name__.split('.')[-1]
  for arg, algorithm, reward in [('', 'ddrl', 'videoalign'), ('vbench', 'ddrl', 'vbench'),
                                 ('ddrl_videoalign', 'ddrl', 'videoalign'),
                                 ('dance_grpo', 'dance_grpo', 'videoalign'),
                                 ('flow_grpo_vbench', 'flow_grpo', 'vbench')]:
    c = module.get_config(arg)
    assert (c.algorithm, list(c.reward.fns)) == (algorithm, [reward]), arg
    assert c.require_inputs and c.cosmos.data == 'records' and c.cosmos.text == 'reason1'
    assert set(c.reward.kwargs) == {'videoalign', 'vbench'} and c.cosmos.eval_rewards == ('videoalign', 'vbench')
    assert (c.sampler.kind, c.sampler.eval_num_steps, c.cosmos.i2v_prob) == ('cosmos_2ab', 35, 0.5)
    assert c.cosmos.guidance_eval == {'cosmos2b': 7.0, 'cosmos14b': 3.0}[model]
    assert (c.optim.b1, c.optim.b2) == (0.9, 0.99) and (c.batch_size, c.num_rollouts) == (16, 8)
    assert c.optim.learning_rate == {'cosmos2b': 1e-5, 'cosmos14b': 3e-6}[model]
  ddrl, dance, flow = (module.get_config(a) for a in ('', 'dance_grpo', 'flow_grpo'))
  assert (ddrl.sampler.num_steps, len(ddrl.rl.train_steps), ddrl.rl.data_beta) == (20, 10, 0.01)
  assert (dance.sampler.num_steps, int(len(dance.rl.train_steps) * dance.rl.train_fraction)) == (20, 12)
  assert dance.rl.kl_beta == 0 and flow.rl.kl_beta == 0.01 and flow.sampler.num_steps == 10
  for smoke in ('smoke', 'ddrl_smoke', 'dance_grpo_smoke', 'flow_grpo_smoke'):
    c = module.get_config(smoke)
    assert not c.require_inputs and c.cosmos.data == 'synthetic' and c.cosmos.text == 'bytes'
    assert list(c.reward.fns) == ['temporal_smoothness']
  with pytest.raises(ValueError, match='unknown config arg'):
    module.get_config('grpo')


def test_full_preset_stops_in_one_line_naming_every_missing_input(tmp_path):
  config = cosmos2b.get_config()
  with pytest.raises(preflight.MissingInputs) as e:
    trainer_lib.Trainer(config, str(tmp_path / 'run'))
  text = str(e.value)
  for key in ('config.cosmos.checkpoint', 'config.cosmos.vae_checkpoint', 'config.cosmos.text_encoder',
              'config.data.path', 'config.cosmos.eval_prompts', 'reward.kwargs.videoalign.checkpoint',
              'python -m ddrl_jax.models.convert --model=cosmos2b', 'python -m ddrl_jax.data.prepare'):
    assert key in text, key
  assert '\n' not in text and not os.path.exists(tmp_path / 'run')
  # Given paths that do not exist are named as such; present ones are not named.
  for key in ('checkpoint', 'vae_checkpoint', 'text_encoder'):
    os.makedirs(tmp_path / key)
    config.cosmos[key] = str(tmp_path / key)
  config.cosmos.eval_prompts = str(tmp_path / 'nope.jsonl')
  config.data.path = str(tmp_path / 'records')
  config.reward.kwargs.videoalign.checkpoint = str(tmp_path / 'va')
  found = preflight.problems(config, video.CosmosVideo(config))
  assert len(found) == 3 and all('does not exist' in p or 'videoalign' in p for p in found), found
  assert not any('cosmos.checkpoint' in p for p in found)


def test_vbench_preset_checks_its_weights_files(tmp_path):
  config = cosmos2b.get_config('vbench')
  config.reward.kwargs.vbench.weights_dir = str(tmp_path)
  found = preflight.problems(config, video.CosmosVideo(config))
  assert sum('vbench' in p for p in found) == 5, found     # one line per dimension's missing file


def test_train_cli_prints_one_error_line_and_exits_2(tmp_path):
  run = subprocess.run([sys.executable, '-m', 'ddrl_jax.train', '--config=configs/cosmos2b.py',
                        f'--workdir={tmp_path / "run"}'], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert run.returncode == 2, run.stderr[-2000:]
  errors = [l for l in run.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and 'config.cosmos.checkpoint' in errors[0] and ':smoke' in errors[0], run.stderr
  assert 'Traceback' not in run.stderr and not os.path.exists(tmp_path / 'run')


# ------------------------------------------------------------------------------------------ the CLI
@pytest.mark.slow
def test_evaluate_cli_on_a_prompt_file_with_a_baseline(tmp_path):
  """Base against base on the same seeds: identical tables (the seeds really are shared), per category
  and mode, the JSON rows, MP4s, side-by-side videos and the grid."""
  os.makedirs(tmp_path / 'frames')
  _png(tmp_path / 'frames' / 'a.png')
  lines = [{'prompt': 'a red square moving to the right', 'category': 'robotics',
            'first_frame': 'frames/a.png'},
           {'prompt': 'a blue square moving down', 'category': 'driving'},
           {'prompt': 'a cyan square drifting', 'category': 'driving', 'first_frame': 'frames/a.png'}]
  (tmp_path / 'p.jsonl').write_text('\n'.join(json.dumps(l) for l in lines))
  out = tmp_path / 'eval'
  run = subprocess.run(
      [sys.executable, '-m', 'ddrl_jax.evaluate', '--config=configs/cosmos2b.py:smoke', '--checkpoint=base',
       '--baseline=base', f'--prompt_file={tmp_path / "p.jsonl"}', f'--out={out}',
       '--videos_per_category=1', '--config.cosmos.guidance_eval=7.0', '--config.sampler.eval_num_steps=5'],
      cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert run.returncode == 0, run.stderr[-3000:]
  rows = [json.loads(l) for l in open(out / 'evaluation.jsonl')]
  assert [r['model'] for r in rows] == ['baseline', 'checkpoint']
  base, again = rows
  assert (base['num_prompts'], base['steps'], base['guidance']) == (3, 5, 7.0)
  for key in ('temporal_smoothness', 'temporal_smoothness@driving', 'temporal_smoothness@i2v',
              'temporal_smoothness@robotics/i2v', 'temporal_smoothness@t2v'):
    assert np.isfinite(base[key]) and base[key] == again[key], key
  assert base['n@driving'] == 2 and base['n@i2v'] == 2
  table = (out / 'table.md').read_text()
  assert '| robotics | 1 |' in table and '| all | 3 |' in table
  assert os.path.exists(out / 'grid.png')
  from ddrl_jax import video_io  # pylint: disable=g-import-not-at-top
  try:
    video_io.write_mp4(str(tmp_path / 'probe.mp4'), np.zeros((2, 8, 8, 3), np.uint8))
  except ImportError:
    return
  assert sorted(os.listdir(out / 'videos')) == ['0000_robotics_i2v.mp4', '0001_driving_t2v.mp4']
  both = video_io.read_mp4(str(out / 'side_by_side' / '0001_driving_t2v.mp4'))
  half = both.shape[2] // 2
  assert half == 32                                          # two 32-pixel-wide videos side by side
  left, right = both[:, :, :half].astype(float), both[:, :, half:].astype(float)
  assert np.abs(left - right).mean() < 2.0                   # base | base: one video (up to MP4 coding)


def test_evaluate_cli_names_a_missing_prompt_file(tmp_path):
  run = subprocess.run([sys.executable, '-m', 'ddrl_jax.evaluate', '--config=configs/cosmos2b.py:smoke',
                        '--checkpoint=base', f'--prompt_file={tmp_path / "nope.jsonl"}'],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert run.returncode == 2, run.stderr[-2000:]
  errors = [l for l in run.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and 'nope.jsonl does not exist' in errors[0], run.stderr


def test_reward_input_checks_against_real_layouts(tmp_path):
  """The preflight's reward checks accept the tiny checkpoints in the released layouts and name what is
  missing from a folder that lacks them; nothing is loaded."""
  pytest.importorskip('torch')
  from ddrl_jax.rewards import cosmos_reason1  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import registry  # pylint: disable=g-import-not-at-top
  from ddrl_jax.rewards import videoalign  # pylint: disable=g-import-not-at-top
  va = videoalign.save_tiny(str(tmp_path / 'va'))
  assert registry.input_problems('videoalign', va) == []
  os.makedirs(tmp_path / 'empty')
  found = registry.input_problems('videoalign', {'checkpoint': str(tmp_path / 'empty')})
  assert len(found) == 1 and 'checkpoint-<step>' in found[0], found
  judge = cosmos_reason1.save_tiny(str(tmp_path / 'r1'))
  assert registry.input_problems('cosmos_reason1', judge) == []
  os.remove(os.path.join(judge['checkpoint'], 'config.json'))
  found = registry.input_problems('cosmos_reason1', judge)
  assert len(found) == 1 and 'config.json' in found[0], found
  assert registry.input_problems('temporal_smoothness', {}) == []
  found = registry.input_problems('vbench_imaging_quality', {'weights_dir': str(tmp_path)})
  assert len(found) == 1 and 'imaging_quality' in found[0], found
