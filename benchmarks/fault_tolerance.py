"""Resume determinism under SIGKILL: does a run killed at a random moment and resumed end with the same
metrics, step for step, as a run never interrupted?

  python benchmarks/fault_tolerance.py                       # toy2d and ocr_tiny, 20 kills each
  python benchmarks/fault_tolerance.py --configs=toy2d --kills=4

For each config (small budgets, through the real CLI `python -m ddrl_jax.train`): one uninterrupted run,
then `--kills` runs, each killed once with SIGKILL and resumed by the same command. Kills cycle through
four phases of an iteration, read from the trainer's event log (DDRL_EVENT_LOG): during the rollout
(after `iteration_start`), while the rewards are pending (after `rewards_submitted`: the workers score
while the trainer computes the data gradient, then waits), during the update (after `rewards_ready`)
and during a checkpoint save (after `checkpoint_start`), at a random iteration and a random delay
within the phase's duration in the uninterrupted run. A run counts as identical when its
metrics.jsonl holds every step exactly once (train and eval rows) with values bit-equal to the
uninterrupted run (the `time_*` keys excepted). Iterations lost per kill = iterations finished before the
kill minus the step the resume restored. Trials append to --out (JSONL) as they finish; rerunning skips
those done, so the benchmark spans sessions.
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from ddrl_jax import metrics as metrics_lib  # pylint: disable=wrong-import-position

# Small budgets: every phase, an evaluation and several checkpoints inside a few iterations.
CONFIGS = {
    'toy2d': ['--config=configs/toy2d.py', '--config.num_iterations=8', '--config.checkpoint_every=2',
              '--config.eval_every=4', '--config.eval_samples=256', '--config.toy2d.pretrain_steps=300',
              '--config.reward.workers=1'],
    'ocr_tiny': ['--config=configs/ocr_tiny.py', '--config.num_iterations=6', '--config.batch_size=4',
                 '--config.num_rollouts=4', '--config.checkpoint_every=2', '--config.eval_every=3',
                 '--config.eval_samples=16'],
}
# phase -> (event that starts it, event that ends it)
PHASES = {
    'rollout': ('iteration_start', 'rollout_done'),
    'reward_wait': ('rewards_submitted', 'rewards_ready'),   # rewards pending (scored meanwhile)
    'update': ('rewards_ready', 'update_done'),
    'checkpoint': ('checkpoint_start', 'checkpoint_done'),
}


def read_events(path):
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except ValueError:
        pass        # a line torn by the kill
  return out


def read_rows(workdir):
  """metrics.jsonl as a list of rows (a torn last line is reported as such)."""
  rows = []
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for line in f:
      rows.append(json.loads(line))
  return rows


def comparable(rows):
  """{(step, 'train'|'eval'): row without its wall-clock metrics} and the list of duplicated keys."""
  out, dups = {}, []
  for r in rows:
    key = (r['step'], 'eval' if any(k.startswith('eval') for k in r) else 'train')
    if key in out:
      dups.append(key)
    out[key] = {k: v for k, v in r.items() if not metrics_lib.is_wall_clock(k)}
  return out, dups


def command(name, workdir):
  return [sys.executable, '-m', 'ddrl_jax.train'] + CONFIGS[name] + [f'--workdir={workdir}']


class EventTail:
  """New lines of a growing event log, read incrementally (a poll costs microseconds)."""

  def __init__(self, path):
    self.path, self.offset, self.events, self._partial = path, 0, [], ''

  def poll(self):
    if os.path.exists(self.path):
      with open(self.path) as f:
        f.seek(self.offset)
        chunk = f.read()
        self.offset = f.tell()
      lines = (self._partial + chunk).split('\n')
      self._partial = lines.pop()
      for line in lines:
        try:
          self.events.append(json.loads(line))
        except ValueError:
          pass
    return self.events


def run(name, workdir, events, log, kill_at=None, timeout=1800):
  """Runs the CLI to completion, or until `kill_at(new event) -> delay or None` asks for a SIGKILL.

  Returns (return code, kill time or None, pids of the child processes at the kill).
  """
  env = dict(os.environ, DDRL_EVENT_LOG=events)
  tail = EventTail(events)
  tail.poll()
  seen = len(tail.events)
  with open(log, 'a') as out:
    proc = subprocess.Popen(command(name, workdir), cwd=ROOT, env=env, stdout=out, stderr=out)
    t0, killed, children = time.time(), None, []
    while proc.poll() is None:
      if kill_at is not None and killed is None:
        new = tail.poll()[seen:]
        seen += len(new)
        delays = [d for d in map(kill_at, new) if d is not None]
        if delays:
          children = child_pids(proc.pid)
          time.sleep(max(0.0, delays[0] - 0.001))
          killed = time.time()
          proc.send_signal(signal.SIGKILL)
      if time.time() - t0 > timeout:
        proc.kill()
        raise RuntimeError(f'{name}: run exceeded {timeout} s; see {log}')
      time.sleep(0.0005)
    return proc.wait(), killed, children


def child_pids(pid):
  """Direct children of `pid`, read from /proc (fast enough to call just before a kill)."""
  task_dir = f'/proc/{pid}/task'
  if os.path.isdir(task_dir):
    pids = []
    for tid in os.listdir(task_dir):
      try:
        with open(os.path.join(task_dir, tid, 'children')) as f:
          pids += [int(p) for p in f.read().split()]
      except OSError:
        pass
    return pids
  out = subprocess.run(['ps', '-o', 'pid=', '--ppid', str(pid)], capture_output=True, text=True).stdout
  return [int(p) for p in out.split()]


def alive(pids, wait=5.0):
  """The pids still running after up to `wait` s (e.g. reward workers that outlived their killed
  trainer); zombies waiting to be reaped count as gone."""
  deadline = time.time() + wait
  while True:
    out = []
    for p in pids:
      try:
        with open(f'/proc/{p}/stat') as f:
          state = f.read().rsplit(')', 1)[1].split()[0]
      except OSError:
        continue
      if state != 'Z':
        out.append(p)
    if not out or time.time() > deadline:
      return out
    time.sleep(0.05)


def phase_durations(events):
  """{(phase, it): seconds} in a run's event log."""
  out, start = {}, {}
  for e in events:
    for phase, (begin, end) in PHASES.items():
      it = e.get('it', -1)
      if e['event'] == begin:
        start[(phase, it)] = e['time']
      elif e['event'] == end and (phase, it) in start:
        out[(phase, it)] = e['time'] - start[(phase, it)]
  return out


def plan_trials(durations, kills, seed):
  """`kills` (phase, iteration, delay) triples cycling through the phases, random within each."""
  rng = random.Random(seed)
  by_phase = {p: sorted(it for (q, it) in durations if q == p) for p in PHASES}
  trials = []
  for i in range(kills):
    phase = list(PHASES)[i % len(PHASES)]
    it = rng.choice(by_phase[phase])
    trials.append((phase, it, rng.uniform(0.0, durations[(phase, it)])))
  return trials


def trial(name, index, phase, it, delay, reference, base):
  workdir = os.path.join(base, f'{name}_kill{index:02d}')
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  events, log = os.path.join(workdir, 'events.jsonl'), os.path.join(workdir, 'log.txt')
  begin = PHASES[phase][0]

  def kill_at(e):
    return delay if e['event'] == begin and e.get('it', -1) == it else None

  code, killed, children = run(name, workdir, events, log, kill_at)
  evs = read_events(events)
  if killed is None:
    return dict(config=name, trial=index, phase=phase, it=it, delay=delay, error=f'not killed (rc {code})')
  before = [e for e in evs if e['time'] <= killed]
  landed = before[-1]['event'] if before else None
  ends = [e['time'] for e in evs if e['event'] == PHASES[phase][1] and e.get('it', -1) == it]
  in_phase = landed == begin and not ends
  time.sleep(1.0)
  left = alive(children)
  done_at_kill = sum(1 for e in before if e['event'] == 'update_done')
  start = len(evs)
  code, _, _ = run(name, workdir, events, log)
  resumed = [e for e in read_events(events)[start:] if e['event'] == 'restored']
  restored = resumed[0]['step'] if resumed else None
  result = dict(config=name, trial=index, phase=phase, it=it, delay=round(delay, 4), landed_after=landed,
                in_phase=in_phase,
                resume_rc=code, restored_step=restored, iterations_done_at_kill=done_at_kill,
                lost=None if restored is None else done_at_kill - restored, orphan_workers=len(left))
  if code != 0:
    result['error'] = f'resume exited {code}; see {log}'
    return result
  got, dups = comparable(read_rows(workdir))
  want, _ = comparable(reference)
  diffs = [f'{k}: missing' for k in want if k not in got] + [f'{k}: extra' for k in got if k not in want]
  for k in want:
    if k in got and got[k] != want[k]:
      bad = sorted(m for m in set(want[k]) | set(got[k]) if want[k].get(m) != got[k].get(m))
      diffs.append(f'{k}: {bad[:4]}')
  result.update(identical=not diffs and not dups, duplicated_steps=len(dups), differences=diffs[:5])
  return result


def summarize(results):
  lines = ['| config | kills | identical | mean iterations lost | aimed at (rollout/reward/update/ckpt) '
           '| landed inside the phase | orphan workers | errors |', '|---|---|---|---|---|---|---|---|']
  for name in sorted({r['config'] for r in results}):
    rs = [r for r in results if r['config'] == name]
    ok = sum(bool(r.get('identical')) for r in rs)
    lost = [r['lost'] for r in rs if r.get('lost') is not None]
    phases = '/'.join(str(sum(r['phase'] == p for r in rs)) for p in PHASES)
    errors = sum('error' in r for r in rs)
    mean_lost = f'{sum(lost) / len(lost):.2f}' if lost else '-'
    inside = '/'.join(str(sum(r['phase'] == p and bool(r.get('in_phase')) for r in rs)) for p in PHASES)
    lines.append(f'| {name} | {len(rs)} | {ok}/{len(rs)} | {mean_lost} | {phases} | {inside} | '
                 f'{sum(r.get("orphan_workers", 0) for r in rs)} | {errors} |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--configs', default='toy2d,ocr_tiny')
  parser.add_argument('--kills', type=int, default=20)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--workdir', default='/tmp/ddrl_fault_tolerance')
  parser.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'fault_tolerance.jsonl'))
  args = parser.parse_args()
  results = [json.loads(l) for l in open(args.out)] if os.path.exists(args.out) else []
  for name in args.configs.split(','):
    ref_dir = os.path.join(args.workdir, f'{name}_reference')
    ref_events = os.path.join(ref_dir, 'events.jsonl')
    if not os.path.exists(os.path.join(ref_dir, 'done')):
      shutil.rmtree(ref_dir, ignore_errors=True)
      os.makedirs(ref_dir)
      t0 = time.time()
      code, _, _ = run(name, ref_dir, ref_events, os.path.join(ref_dir, 'log.txt'))
      if code != 0:
        sys.exit(f'{name}: the uninterrupted run failed (rc {code}); see {ref_dir}/log.txt')
      open(os.path.join(ref_dir, 'done'), 'w').write(f'{time.time() - t0:.1f}')
    reference = read_rows(ref_dir)
    trials = plan_trials(phase_durations(read_events(ref_events)), args.kills, args.seed)
    done = {r['trial'] for r in results if r['config'] == name}
    for i, (phase, it, delay) in enumerate(trials):
      if i in done:
        continue
      t0 = time.time()
      r = trial(name, i, phase, it, delay, reference, args.workdir)
      r['seconds'] = round(time.time() - t0, 1)
      print(json.dumps(r), flush=True)
      results.append(r)
      with open(args.out, 'a') as f:
        f.write(json.dumps(r) + '\n')
  print(summarize(results))


if __name__ == '__main__':
  main()
