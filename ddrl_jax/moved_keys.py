"""Config keys and task names that moved, with their new places: a user's command line naming an old key
gets one line saying where it went, and a checkpoint written under the old layout resumes under the new
one (`migrate`, applied to a saved config before it is compared with the current one).

Moves (issue 48, the family owns its pipeline): the tasks 'sd3_ocr' and 'wan_t2v' became one
`prompt_task` with `config.model_family` 'sd3' / 'wan'; their prompt keys moved from the model's section
(config.sd3 / config.wan) to the task's (config.prompt). Renamed values: cosmos-rl's conventions are
'cosmos_rl' (rl.log_ratio, rl.adv_normalization, rl.data_weighting), 'cosmos' still accepted; `canonical`
spells a flat config's values the current way (rl/options.py ALIASES) on both sides of a comparison.
"""

MOVED_TASKS = {'sd3_ocr': 'sd3', 'wan_t2v': 'wan'}        # old task -> prompt_task with this model_family
PROMPT_KEYS = ('prompts', 'num_eval_prompts', 'guidance_rollout', 'guidance_eval', 'prompts_required',
               'prompts_source')
PROMPT_TASK = 'prompt_task'
# Keys the old layout set only in some presets (the image-reward recipes), with the value that means what
# their absence meant.
PROMPT_DEFAULTS = {'prompt.prompts_required': False, 'prompt.prompts_source': ''}


def new_place(key):
  """The current dotted key of an old one ('sd3.prompts' -> 'prompt.prompts'), or None when it did not
  move."""
  section, _, leaf = key.partition('.')
  if section in MOVED_TASKS.values() and leaf in PROMPT_KEYS:
    return f'prompt.{leaf}'
  return None


def task_message(task):
  """The one-line explanation for a config naming a moved task, or None."""
  if task not in MOVED_TASKS:
    return None
  family = MOVED_TASKS[task]
  return (f"config.task={task!r} is now config.task='{PROMPT_TASK}' with config.model_family='{family}'; "
          f"its keys config.{family}.{{{','.join(PROMPT_KEYS[:4])},...}} moved to config.prompt")


def canonical(flat):
  """A flat config with the enumerated rl values in their current spelling ('cosmos' -> 'cosmos_rl')."""
  from ddrl_jax.rl import options  # pylint: disable=g-import-not-at-top
  out = dict(flat)
  for key in options.CHOICES:
    if f'rl.{key}' in out:
      out[f'rl.{key}'] = options.canonical(out[f'rl.{key}'])
  return out


def migrate(flat):
  """A saved flat config ({'a.b': v}) of the old layout -> the current one (a copy; unchanged when it is
  already current)."""
  task = flat.get('task')
  if task not in MOVED_TASKS:
    return flat
  out = {}
  for key, value in flat.items():
    out[new_place(key) or key] = value
  out['task'] = PROMPT_TASK
  if not out.get('model_family'):
    out['model_family'] = MOVED_TASKS[task]
  for key, value in PROMPT_DEFAULTS.items():
    out.setdefault(key, value)
  return out
