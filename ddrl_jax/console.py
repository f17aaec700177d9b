"""What the CLIs show on the console: log levels, the progress bar's pace and the end-of-run summary.

ddrl_jax logs through Python loggers named after its modules (`logging.getLogger(__name__)`): INFO for
what a run is doing (the mesh, the throughput model, resuming, ...), WARNING only for what is wrong
(a damaged checkpoint, a skipped record, a non-finite step, ...). `setup()`, called first by every CLI's
main, shows ddrl_jax's INFO lines and keeps other libraries at WARNING (orbax logs every checkpoint
save at INFO).
"""
import contextlib
import logging
import os

from absl import flags
from absl import logging as absl_logging

LOGGER = 'ddrl_jax'
HELD_OUT = ('ocr', 'reward')      # the evaluation metric the summary shows, the first one present


def setup():
  """ddrl_jax's messages from INFO up, every other library's from WARNING up; an explicit --verbosity
  (-v) instead applies to every logger, ddrl_jax's included."""
  if flags.FLAGS['verbosity'].present:
    return
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger(LOGGER).setLevel(logging.INFO)


class _DropPrefix(logging.Filter):

  def __init__(self, prefix):
    super().__init__()
    self.prefix = prefix

  def filter(self, record):
    return not str(record.msg).startswith(self.prefix)


@contextlib.contextmanager
def hidden(logger_name, prefix):
  """Inside the block, drops the records of logger `logger_name` whose message (the format string,
  before its arguments are filled in) starts with `prefix`."""
  log = logging.getLogger(logger_name)
  drop = _DropPrefix(prefix)
  log.addFilter(drop)
  try:
    yield
  finally:
    log.removeFilter(drop)


# ------------------------------------------------------------------------------------------- pace
def duration(seconds):
  """'41.2 s' under a minute, '2 min 29 s' under an hour, else '1 h 25 min'."""
  if seconds < 60:
    return f'{seconds:.3g} s'
  minutes, s = divmod(int(round(seconds)), 60)
  hours, m = divmod(minutes, 60)
  return f'{hours} h {m} min' if hours else f'{m} min {s} s'


class Pace:
  """Seconds per iteration and time left of a run, from its iterations after the first.

  The first iteration compiles the step functions (and follows the step-0 evaluation), so it is
  timed on its own (`first_s`) and left out of the rate: an estimate from it would be minutes or hours
  too long. The time between two iterations' ends counts everything between them (a periodic
  evaluation or checkpoint included), as those recur.
  """

  def __init__(self, remaining):
    self.remaining = remaining    # iterations still to run
    self.first_s = None           # seconds of the first iteration (compile included)
    self.after_first = 0          # iterations finished after the first
    self._first_end = self._last_end = None

  def done(self, start, end):
    """Records an iteration that ran from time `start` to `end` (seconds, one clock)."""
    self.remaining -= 1
    if self.first_s is None:
      self.first_s, self._first_end = end - start, end
    else:
      self.after_first += 1
      self._last_end = end

  @property
  def seconds_per_iteration(self):
    """Mean seconds per iteration after the first; None before the second has finished."""
    if not self.after_first:
      return None
    return (self._last_end - self._first_end) / self.after_first

  @property
  def eta_s(self):
    """Seconds until the last iteration ends, at seconds_per_iteration; None before it is known."""
    s = self.seconds_per_iteration
    return None if s is None else s * self.remaining

  def text(self):
    """The progress bar's pace, e.g. '0.47 s/it, 12 s left'; '' before the second iteration ends."""
    s = self.seconds_per_iteration
    return '' if s is None else f'{s:.3g} s/it, {duration(self.eta_s)} left'


def startup_line(first_s, eval_s=None):
  """The one line on the run's start-up costs, e.g.
  'first iteration 41.2 s (compile included); step-0 evaluation 12.3 s'."""
  line = f'first iteration {duration(first_s)} (compile included)'
  return line if eval_s is None else f'{line}; step-0 evaluation {duration(eval_s)}'


# ---------------------------------------------------------------------------------------- summary
def held_out_key(evaluation):
  """The evaluation metric the summary shows: eval/<the first of HELD_OUT present>, else the first
  eval/ key; None without one."""
  keys = sorted(k for k in evaluation if k.startswith('eval/'))
  return next((f'eval/{n}' for n in HELD_OUT if f'eval/{n}' in evaluation), keys[0] if keys else None)


def _number(v):
  return f'{v:.4g}'


def summary_table(metrics, workdir, evaluation=None, seconds_per_iteration=None, first_iteration_s=None,
                  checkpoint=None, samples=None, videos=None):
  """The end-of-run table: what a user reads first (the full row of every step is in metrics.jsonl).

  metrics: the last iteration's metrics. evaluation: the last evaluation's row ({'step': s,
  'eval/...': v, 'eval_ema/...': v}) or None. seconds_per_iteration: the mean after the first
  iteration, whose seconds (compile included) are first_iteration_s. checkpoint: the path of the
  last checkpoint. samples: the path of the last sample grid, if any; videos: the pattern of the last
  evaluation MP4s (video tasks), if any.
  """
  rows = [('reward', _number(metrics['reward_mean']), "mean of the last iteration's rollouts")
          if 'reward_mean' in metrics else ('reward', 'n/a', 'no reward_mean metric')]
  key = held_out_key(evaluation or {})
  if key is not None:
    ema = key.replace('eval/', 'eval_ema/', 1)
    note = f"evaluation at step {evaluation['step']}" if 'step' in evaluation else 'evaluation'
    if ema in evaluation:
      note += f'; EMA parameters: {_number(evaluation[ema])}'
    rows.append((key, _number(evaluation[key]), note))
  first = f' ({duration(first_iteration_s)}, compile included)' if first_iteration_s is not None else ''
  rows.append(('s/iteration', 'n/a', f'one iteration only{first}') if seconds_per_iteration is None else
              ('s/iteration', f'{seconds_per_iteration:.3g}', f'after the first{first}'))
  if 'achieved_flops_per_s' in metrics:
    mfu = f"; MFU {100 * metrics['mfu']:.2f}%" if 'mfu' in metrics else ''
    rows.append(('GFLOP/s', _number(metrics['achieved_flops_per_s'] / 1e9),
                 f'last iteration, model FLOPs over compute time{mfu}'))
  else:
    rows.append(('GFLOP/s', 'n/a', 'the task counts no FLOPs' if 'flops_per_iteration' not in metrics
                 else 'not measured on a first iteration (it compiles)'))
  workdir = str(workdir)
  places = [('checkpoints', checkpoint or os.path.join(workdir, 'checkpoints')),
            ('metrics', f"{os.path.join(workdir, 'metrics.jsonl')} (every metric of every step); "
                        f"TensorBoard: {os.path.join(workdir, 'tensorboard')}")]
  if samples:
    places.append(('samples', samples))
  if videos:
    places.append(('videos', f'{videos} (MP4; TensorBoard: Images, eval/videos)'))
  width = max(len(name) for name, *_ in rows + places)
  value_width = max(len(value) for _, value, _ in rows)
  lines = [f'summary of {workdir}:']
  lines += [f'  {name:<{width}}  {value:<{value_width}}  {note}' for name, value, note in rows]
  lines += [f'  {name:<{width}}  {where}' for name, where in places]
  return '\n'.join(lines)
