"""The model-family seam: the core names no model family, tasks are reached through their interface, and
every registered family satisfies the ModelFamily protocol on a real config."""
import os
import re

import jax
import pytest

from configs import cosmos2b
from configs import flux1_dev
from configs import ocr_tiny
from configs import sd35m
from configs import toy2d
from configs import wan1_3b
from ddrl_jax import checkpoints
from ddrl_jax import config as config_lib
from ddrl_jax import parallel
from ddrl_jax import tasks
from ddrl_jax.models import family as family_lib
from ddrl_jax.models import lora as lora_lib
from ddrl_jax.tasks import base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ['ddrl_jax/config.py', 'ddrl_jax/aot.py', 'ddrl_jax/checkpoints.py', 'ddrl_jax/resume.py',
        'ddrl_jax/update.py', 'ddrl_jax/trainer.py', 'ddrl_jax/program.py', 'ddrl_jax/flops.py',
        'ddrl_jax/pretrain.py', 'ddrl_jax/export_lora.py', 'ddrl_jax/evaluate.py',
        'ddrl_jax/rewards/judges.py', 'ddrl_jax/models/convert.py', 'ddrl_jax/models/pipeline.py'] + sorted(
            f'ddrl_jax/{d}/{n}' for d in ('parallel', 'data') for n in os.listdir(os.path.join(ROOT, 'ddrl_jax', d))
            if n.endswith('.py'))
# Core files that still name a family, with what has to move first (a test keeps this list honest: a
# file that no longer names one must leave it).
NOT_YET_SEAMED = {}
# Callers of the task interface: no attribute probing left.
TASK_CALLERS = CORE + ['ddrl_jax/pretrain.py', 'ddrl_jax/export_lora.py',
                       'ddrl_jax/data/prepare.py', 'ddrl_jax/data/synthesize.py']

# What naming a model family looks like: its modules, classes, config sections and the task modules that
# hold them. ('cosmos' alone stays legal: 'cosmos_2ab' and the old spelling of rl.log_ratio /
# rl.adv_normalization / rl.data_weighting = 'cosmos_rl', cosmos-rl's *algorithm* conventions, are not
# the Cosmos network.)
FAMILY_PATTERNS = [
    r'models\.(cosmos|wan|sd3|mlp)\b', r'models import (cosmos|wan|sd3|mlp)\b', r'\bcosmos_dit\b',
    r'\bcosmos_t2i\b', r'\bwan_vae\b', r'\bCosmos(DiT|T2I|Video)\b', r'\bWan(DiT|VAE)\b', r'\bMMDiT\b',
    r'\bVelocityMLP\b', r'tasks(\.| import )(video|ocr|toy2d|sd3_ocr|wan_t2v|prompt_task)\b',
    r"config\.(cosmos|ocr|toy2d)\b", r"\.get\('(cosmos|ocr|toy2d)'", r"'(cosmos|ocr)\.\w+'",
    r"\b(act_frames|crossattn_in|adaln)\b",
]
# Every family's name. Both lists are matched against code only: comments and docstrings may describe
# the models the core serves (ddrl_jax/models/family.py, the registry, is the one place that lists them).
FAMILY_NAMES = [r'(?i)\bsd3\w*', r'(?i)\bsd35\w*', r'(?i)\bwan(\b|\d|_)', r'(?i)\bmmdit\b',
                r'(?i)\bflux\w*', r"'cosmos_t2i'"]   # ('mlp' is also a logical axis name)


def _code_lines(path):
  """(line number, text) of a source file, comments and docstring-free lines included as they are."""
  with open(os.path.join(ROOT, path)) as f:
    return list(enumerate(f.read().splitlines(), 1))


def _code_only(path):
  """(line number, text) of a source file's code: comments and docstrings blanked out (string literals
  that are not docstrings, such as error messages, stay)."""
  import ast  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  import tokenize  # pylint: disable=g-import-not-at-top
  with open(os.path.join(ROOT, path)) as f:
    source = f.read()
  lines = source.splitlines()
  docstrings = set()
  for node in ast.walk(ast.parse(source)):
    body = getattr(node, 'body', None)
    if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
        isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
      docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      row, col = tok.start
      lines[row - 1] = lines[row - 1][:col]
  return [(n, line) for n, line in enumerate(lines, 1) if n not in docstrings]


def _family_hits(path):
  """Code lines of `path` that name a family (its modules, classes, config sections, or its name)."""
  return [f'{path}:{n}: {line.strip()}' for n, line in _code_only(path)
          for pattern in FAMILY_PATTERNS + FAMILY_NAMES if re.search(pattern, line)]


@pytest.mark.parametrize('path', [p for p in CORE if p not in NOT_YET_SEAMED])
def test_core_names_no_model_family(path):
  hits = _family_hits(path)
  assert not hits, 'the core names a model family:\n' + '\n'.join(hits)


@pytest.mark.parametrize('path', sorted(NOT_YET_SEAMED))
def test_the_files_not_yet_seamed_still_need_to_be(path):
  assert path in CORE
  assert _family_hits(path), f'{path} names no family any more: take it out of NOT_YET_SEAMED'


def test_the_family_name_grep_sees_code_not_comments():
  lines = ["config.sd3.resolution", "from ddrl_jax.models.wan import vae", "if name == 'mmdit':",
           "family = 'flux1_dev'", "x = cfg.wan14b"]
  for line in lines:
    assert any(re.search(p, line) for p in FAMILY_NAMES), line
  for line in ("cosmos_rl = 1", "swan = 2", "wander()", "'cosmos_2ab'"):
    assert not any(re.search(p, line) for p in FAMILY_NAMES), line


def test_family_pattern_finds_a_family_name(tmp_path):
  """The grep is live: it flags the lines the core held before the seam."""
  before = ["  if config.get('cosmos') is not None:", 'from ddrl_jax.models import cosmos_dit',
            "    'ocr.base_checkpoint', 'ocr.require_base', 'cosmos.checkpoint',",
            "    'act_frames': 'context',", 'from ddrl_jax.tasks import video',
            'from ddrl_jax.tasks import sd3_ocr', 'from ddrl_jax.tasks import wan_t2v',
            'from ddrl_jax.tasks import prompt_task', 'import ddrl_jax.tasks.sd3_ocr']
  for line in before:
    assert any(re.search(p, line) for p in FAMILY_PATTERNS), line


@pytest.mark.parametrize('path', TASK_CALLERS)
def test_no_task_attribute_probing(path):
  probe = re.compile(r'(hasattr|getattr)\((self\.|trainer\.)?task\b')
  hits = [f'{path}:{n}: {line.strip()}' for n, line in _code_lines(path) if probe.search(line)]
  assert not hits, '\n'.join(hits)


CONFIGS = {'cosmos': lambda: cosmos2b.get_config('smoke'), 'cosmos_t2i': ocr_tiny.get_config,
           'mlp': toy2d.get_config, 'sd3': lambda: sd35m.get_config('flow_grpo_smoke'), 'wan': lambda: wan1_3b.get_config('flow_grpo_smoke'),
           'flux': lambda: flux1_dev.get_config('flow_grpo_smoke')}
SAMPLE_SHAPES = {'wan': (16, 2, 4, 4)}


@pytest.mark.parametrize('name', sorted(family_lib.FAMILIES))
def test_registered_family_keeps_the_protocol(name):
  """Every registered family builds, adapts its velocity, counts FLOPs, and its rules are merged into its
  configs (so the sharding plan knows every logical name the model uses); its task, where it has one,
  is a FamilyTask holding it."""
  config = CONFIGS[name]()
  family = tasks.get_family(config) if config.task else family_lib.from_config(config)
  assert family.name == name
  for attr in ('build', 'apply_fn', 'load_base', 'forward_flops', 'attention_shape', 'attention_kernel',
               'logical_rules', 'sequence_names', 'compute_cast', 'exporter'):
    assert callable(getattr(family, attr)), attr
  _, abstract, module = family_lib.abstract_params(family, lora_lib.from_config(config), jax.random.key(0))
  assert jax.tree.leaves(abstract)
  assert family.compute_cast(module) is None or callable(family.compute_cast(module))
  if config.task:
    task = tasks.get_task(config)
    assert isinstance(task, base.FamilyTask) and task.family.name == name
    assert task.forward_flops_per_sample() > 0
  else:
    assert family.forward_flops(SAMPLE_SHAPES[name]) > 0
  for key, axes in family.logical_rules().items():
    assert config.sharding.rules[key] == axes
  plan = parallel.ShardingPlan.for_model(config, parallel.make_mesh(config.mesh, jax.devices()[:1]), family)
  plan.params(abstract)         # raises on a logical name without a rule
  assert set(family.sequence_names()) <= set(plan.rules)


def test_model_family_key_selects_and_names_unknown():
  config = ocr_tiny.get_config()
  config.model_family = 'cosmos_t2i'
  assert tasks.get_family(config).name == 'cosmos_t2i'
  config.model_family = 'nope'
  with pytest.raises(config_lib.ConfigError, match="model_family='nope': unknown model family"):
    config_lib.validate(config, 1)


def test_checkpoint_without_model_family_key_is_compatible():
  """A checkpoint written before config.model_family existed resumes (the key reads as '')."""
  current = ocr_tiny.get_config().to_dict()
  saved = dict(current)
  del saved['model_family']
  safe, unsafe = checkpoints.config_differences(saved, current)
  assert (safe, unsafe) == ([], [])


def test_base_location_is_safe_to_change_only_through_the_family():
  config = ocr_tiny.get_config()
  saved = config.to_dict()
  current = config.to_dict()
  current['ocr'] = dict(current['ocr'], base_checkpoint='/elsewhere')
  assert checkpoints.config_differences(saved, current)[1]            # unsafe without the family's keys
  family = tasks.get_family(config)
  safe, unsafe = checkpoints.config_differences(saved, current, family.resume_safe_keys)
  assert not unsafe and [k for k, _, _ in safe] == ['ocr.base_checkpoint']


def test_unsupported_ability_names_the_task():
  task = tasks.get_task(toy2d.get_config())
  with pytest.raises(base.Unsupported, match=r"task 'toy2d' \(Toy2D\) cannot do 'media'"):
    task.require('media')
  with pytest.raises(base.Unsupported, match='cannot encode media'):
    task.encode_samples(None)


def test_converters_come_from_the_families():
  assert set(family_lib.converters()) == {'cosmos2b', 'cosmos14b', 'cosmos_tiny', 'wan21_vae', 'wan_tiny',
                                          'sd35_medium', 'sd35_large', 'sd3_tiny', 'sd35_vae',
                                          'sd3_vae_tiny', 'wan1_3b', 'wan14b', 'wan_dit_tiny', 'flux1_dev',
                                          'flux1_schnell', 'flux_tiny', 'flux1_vae', 'flux_vae_tiny'}
