"""Per-step metrics: averaged with clu.metrics, written as JSONL and (if tensorboardX is installed)
TensorBoard events under the workdir. A resumed run first drops what the steps it re-runs had written,
so metrics.jsonl holds each step once and TensorBoard purges the re-run steps' events. Evaluation videos
go to TensorBoard's image dashboard as animated GIFs (`write_videos`)."""
import json
import logging
import os

from clu import metrics as clu_metrics
import numpy as np

from ddrl_jax import storage

logger = logging.getLogger(__name__)


WALL_CLOCK_METRICS = ('achieved_flops_per_s', 'mfu')   # computed from time_* (besides time_* themselves)


def is_wall_clock(key):
  """Whether a metric depends on wall time (time_*, achieved_flops_per_s, mfu): it differs between two
  otherwise identical runs, and a resumed run's first iteration (which compiles) has no throughput."""
  return key.startswith('time_') or key in WALL_CLOCK_METRICS


def average_metrics(per_step):
  """Averages a list of {name: scalar} dicts with clu.metrics.Average (keys may differ between dicts)."""
  acc = {}
  for m in per_step:
    for k, v in m.items():
      avg = clu_metrics.Average.from_model_output(np.asarray(v, np.float32))
      acc[k] = avg if k not in acc else acc[k].merge(avg)
  return {k: float(v.compute()) for k, v in acc.items()}


def _kept_lines(text, last_kept_step):
  """(lines of steps <= last_kept_step, number dropped), dropping torn or unreadable lines too."""
  kept, dropped = [], 0
  for line in text.splitlines(keepends=True):
    try:
      rec = json.loads(line)
      keep = line.endswith('\n') and rec['step'] <= last_kept_step
    except (ValueError, KeyError, TypeError):
      keep = False
    if keep:
      kept.append(line)
    else:
      dropped += 1
  return kept, dropped


def truncate_metrics(path, last_kept_step):
  """Rewrites a metrics.jsonl without the rows of steps > last_kept_step (and any torn line a kill
  left), atomically. Returns the number of rows dropped."""
  text = storage.read_text(path)
  if text is None:
    return 0
  kept, dropped = _kept_lines(text, last_kept_step)
  if dropped:
    storage.write_text(path, ''.join(kept))
  return dropped


class MetricWriter:
  """Appends {'step': ..., **scalars} lines to <workdir>/metrics.jsonl and TensorBoard scalars.

  resume_step: the step the run restarts from; rows and TensorBoard events written after it by an
  earlier (interrupted) run are dropped first. None: append to whatever the file holds.
  A bucket workdir (gs://...) has no append: the file is rewritten whole at each write (it is small).
  """

  def __init__(self, workdir, resume_step=None):
    workdir = str(workdir)
    self.remote = storage.is_remote(workdir)
    if not self.remote:
      os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, 'metrics.jsonl')
    purge_step = None
    if resume_step is not None:
      # Step 0 holds only the initial evaluation, which a run starting at 0 writes again.
      last_kept = resume_step if resume_step > 0 else -1
      dropped = truncate_metrics(self.path, last_kept)
      if dropped:
        logger.info('metrics.jsonl: dropped %d rows after step %d (they are re-run)', dropped,
                    last_kept)
      purge_step = last_kept + 1
    if self.remote:
      self._lines = (storage.read_text(self.path) or '').splitlines(keepends=True)
      self._file = None
    else:
      self._file = open(self.path, 'a')
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'), purge_step=purge_step)
    except ImportError:
      self._tb = None

  def flush(self):
    if self._file is not None:
      self._file.flush()
    if self._tb is not None:
      self._tb.flush()

  def write(self, step, scalars):
    scalars = {k: float(v) for k, v in scalars.items()}
    line = json.dumps({'step': int(step), **scalars}, sort_keys=True) + '\n'
    if self.remote:
      self._lines.append(line)
      storage.write_text(self.path, ''.join(self._lines))
    else:
      self._file.write(line)
      self._file.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(k, v, int(step))

  def write_videos(self, step, videos, fps):
    """{tag: uint8 (F, H, W, 3)} -> one animated GIF image summary per tag at `step`, which TensorBoard's
    Images tab plays (what tensorboardX's add_video writes; add_video itself needs moviepy). No-op
    without tensorboardX."""
    if self._tb is None or not videos:
      return
    from tensorboardX.proto.summary_pb2 import Summary  # pylint: disable=g-import-not-at-top
    from ddrl_jax import video_io  # pylint: disable=g-import-not-at-top
    values = []
    for tag, video in videos.items():
      _, h, w, c = np.shape(video)
      image = Summary.Image(height=h, width=w, colorspace=c,
                            encoded_image_string=video_io.gif_bytes(video, fps))
      values.append(Summary.Value(tag=tag, image=image))
    self._tb._get_file_writer().add_summary(  # pylint: disable=protected-access
        Summary(value=values), int(step))

  def close(self):
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()


class NullWriter:
  """MetricWriter's interface, writing nothing: the writer of every process but process 0."""

  def flush(self):
    pass

  def write(self, step, scalars):
    del step, scalars

  def write_videos(self, step, videos, fps):
    del step, videos, fps

  def close(self):
    pass


def read_metrics(workdir):
  """The JSONL records of a workdir, in order (a resumed run's last record for a step wins)."""
  text = storage.read_text(os.path.join(str(workdir), 'metrics.jsonl'))
  if text is None:
    raise FileNotFoundError(os.path.join(str(workdir), 'metrics.jsonl'))
  by_step = {}
  for line in text.splitlines():
    rec = json.loads(line)
    by_step[(rec['step'], 'eval' if any(k.startswith('eval') for k in rec) else 'train')] = rec
  return [by_step[k] for k in sorted(by_step)]
