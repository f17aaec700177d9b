"""Per-step metrics: averaged with clu.metrics, written as JSONL and (if tensorboardX is installed)
TensorBoard events under the workdir."""
import json
import os

import numpy as np
from clu import metrics as clu_metrics


def average_metrics(per_step):
  """Averages a list of {name: scalar} dicts with clu.metrics.Average (keys may differ between dicts)."""
  acc = {}
  for m in per_step:
    for k, v in m.items():
      avg = clu_metrics.Average.from_model_output(np.asarray(v, np.float32))
      acc[k] = avg if k not in acc else acc[k].merge(avg)
  return {k: float(v.compute()) for k, v in acc.items()}


class MetricWriter:
  """Appends {'step': ..., **scalars} lines to <workdir>/metrics.jsonl and TensorBoard scalars."""

  def __init__(self, workdir):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self._file = open(self.path, 'a')
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))
    except ImportError:
      self._tb = None

  def write(self, step, scalars):
    scalars = {k: float(v) for k, v in scalars.items()}
    self._file.write(json.dumps({'step': int(step), **scalars}, sort_keys=True) + '\n')
    self._file.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(k, v, int(step))

  def close(self):
    self._file.close()
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir):
  """The JSONL records of a workdir, in order (a resumed run's last record for a step wins)."""
  path = os.path.join(workdir, 'metrics.jsonl')
  by_step = {}
  with open(path) as f:
    for line in f:
      rec = json.loads(line)
      by_step[(rec['step'], 'eval' if any(k.startswith('eval') for k in rec) else 'train')] = rec
  return [by_step[k] for k in sorted(by_step)]
