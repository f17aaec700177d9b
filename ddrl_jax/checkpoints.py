"""Which checkpoint of a workdir may be resumed: integrity records and config compatibility.

A checkpoint is one orbax step directory. Once orbax has committed it, `write_integrity` records the
size and sha256 of every file in it (`ddrl_integrity.json`, written last and atomically), so a file that
is later missing, truncated or altered is found by `verify` before anything is restored; orbax's own
read errors catch damage in a checkpoint killed between the commit and that record. The config saved
with the state is compared key by key with the run's config: only `SAFE_TO_CHANGE` keys may differ
(logged), anything else (another model shape, algorithm, sampler, data) is an error naming the keys.
"""
import hashlib
import json
import os

INTEGRITY = 'ddrl_integrity.json'

# Keys a resumed run may change: budgets, logging, the learning-rate schedule, reward-service plumbing,
# data-loader parallelism, the mesh and its sharding rules (checkpoints restore onto any topology), the
# micro-batch (the same update in chunks: memory, not math) and the pretraining section (not read by the RL
# run). Where a model family's initial weights came from (read only
# when starting from step 0) is safe too: the family names those keys (`resume_safe_keys`) and the caller
# passes them as `extra_safe`.
SAFE_TO_CHANGE = (
    'num_iterations', 'log_every', 'checkpoint_every', 'max_checkpoints', 'eval_every',
    'eval_samples', 'eval_videos', 'eval_video_fps', 'max_nonfinite_steps', 'checkpoint_checksums',
    'pretrain.',
    'optim.learning_rate', 'optim.warmup_steps', 'optim.warmup_init_factor',
    'reward.workers', 'reward.chunk_size', 'reward.chunk_timeout_s', 'reward.timeout_s',
    'reward.max_failed_batches', 'reward.backend', 'reward.redis_url', 'reward.token_env',
    'reward.retries', 'reward.task_ttl_s', 'data.worker_count', 'data.skip_bad', 'mesh.', 'sharding.',
    'require_inputs', 'reward.no_server_grace_s', 'skip_memory_check', 'micro_batch')


# Keys added after checkpoints were first written, with the value that reproduces how those runs
# trained: a saved config without the key reads as this value, so such checkpoints still resume.
ADDED_KEY_DEFAULTS = {
    'rl.adv_normalization': 'cosmos_rl', 'rl.adv_global_std': True, 'rl.failed_advantage': 'zero',
    'rl.drop_zero_advantages': False, 'rl.kl_form': 'exact', 'rl.nft_beta': 1.0, 'rl.nft_old_decay': 1,
    'lora.rank': 0, 'model_family': '', 'sampler.eval_num_steps': 0, 'sampler.eval_deterministic': False,
    'eval_videos': 4, 'eval_video_fps': 8,   # logging only (SAFE_TO_CHANGE): today's defaults
    'require_inputs': False, 'skip_memory_check': False,
    'data.base_samples': 0, 'data.base_samples_dir': '', 'micro_batch': 0,
}

# The data term's keys: moot for an algorithm without one (a FlowGRPO run resumes whatever they say).
DATA_TERM_KEYS = ('rl.data_beta', 'rl.data_loss_steps', 'rl.data_noise', 'rl.cond_dropout',
                  'rl.data_weighting')


def _uses_data_term(algorithm):
  from ddrl_jax.rl import registry  # pylint: disable=g-import-not-at-top
  return algorithm not in registry.ALGORITHMS or registry.ALGORITHMS[algorithm].uses_data


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be resumed; the message names its path."""


class DamagedCheckpoint(CheckpointError):
  """Missing, truncated or altered files, or a checkpoint orbax cannot read."""


class IncompatibleCheckpoint(CheckpointError):
  """A checkpoint written with another config (model shape, algorithm, ...)."""


def _sha256(path, chunk=1 << 22):
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(chunk), b''):
      h.update(block)
  return h.hexdigest()


def _files(step_dir):
  """Relative paths of every file under step_dir except the integrity record, sorted."""
  out = []
  for root, _, names in os.walk(step_dir):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), step_dir)
      if rel != INTEGRITY:
        out.append(rel)
  return sorted(out)


def is_local(path):
  return '://' not in str(path)


def write_integrity(step_dir):
  """Records {relative path: [size, sha256]} of a committed step directory (atomically, last)."""
  record = {rel: [os.path.getsize(os.path.join(step_dir, rel)), _sha256(os.path.join(step_dir, rel))]
            for rel in _files(step_dir)}
  tmp = os.path.join(step_dir, INTEGRITY + '.tmp')
  with open(tmp, 'w') as f:
    json.dump(record, f, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(step_dir, INTEGRITY))


def verify(step_dir):
  """Raises DamagedCheckpoint naming the first file that is missing, truncated or altered.

  Returns False (nothing checked) when the directory has no integrity record, True when it matched.
  """
  path = os.path.join(step_dir, INTEGRITY)
  if not os.path.exists(path):
    return False
  try:
    with open(path) as f:
      record = json.load(f)
  except (OSError, ValueError) as e:
    raise DamagedCheckpoint(f'{path}: unreadable integrity record ({e})') from None
  for rel, (size, digest) in sorted(record.items()):
    full = os.path.join(step_dir, rel)
    if not os.path.exists(full):
      raise DamagedCheckpoint(f'{full}: missing')
    actual = os.path.getsize(full)
    if actual != size:
      raise DamagedCheckpoint(f'{full}: {actual} bytes, {size} when written (truncated or replaced)')
    if _sha256(full) != digest:
      raise DamagedCheckpoint(f'{full}: contents changed since it was written (sha256 differs)')
  return True


def flatten(tree, prefix=''):
  """{'a': {'b': 1}} -> {'a.b': 1}; tuples become lists (as JSON stores them)."""
  out = {}
  for k, v in tree.items():
    key = f'{prefix}{k}'
    if isinstance(v, dict) and v:
      out.update(flatten(v, key + '.'))
    else:
      out[key] = json.loads(json.dumps(v, default=str))
  return out


def _safe(key, extra_safe=()):
  return any(key == s or (s.endswith('.') and key.startswith(s)) for s in SAFE_TO_CHANGE + tuple(extra_safe))


def config_differences(saved, current, extra_safe=()):
  """(safe, unsafe): lists of (key, saved value, current value) between two config dicts; `extra_safe`
  adds safe keys (or 'prefix.' groups) to SAFE_TO_CHANGE."""
  from ddrl_jax import moved_keys  # pylint: disable=g-import-not-at-top
  a, b = moved_keys.migrate(flatten(saved)), flatten(current)
  if any(k.startswith('rl.') for k in a):       # a trainer config written before those keys existed
    for key, value in ADDED_KEY_DEFAULTS.items():
      a.setdefault(key, value)
  a, b = moved_keys.canonical(a), moved_keys.canonical(b)      # 'cosmos' == 'cosmos_rl'
  diffs = [(k, a.get(k, '<absent>'), b.get(k, '<absent>')) for k in sorted(set(a) | set(b))
           if a.get(k, '<absent>') != b.get(k, '<absent>')]
  if a.get('lora.rank', 0) == 0 and b.get('lora.rank', 0) == 0:   # no adapters: their settings are moot
    diffs = [d for d in diffs if not d[0].startswith('lora.')]
  if not (_uses_data_term(a.get('algorithm')) or _uses_data_term(b.get('algorithm'))):
    diffs = [d for d in diffs if d[0] not in DATA_TERM_KEYS]      # no data term: its settings are moot
  return ([d for d in diffs if _safe(d[0], extra_safe)], [d for d in diffs if not _safe(d[0], extra_safe)])


def describe_differences(diffs, limit=8):
  """'key: old in the checkpoint, new now; ...' of (key, old, new) triples, the first `limit` of them."""
  first = ('task', 'algorithm', 'model_family')      # what tells another run from a changed one
  diffs = sorted(diffs, key=lambda d: first.index(d[0]) if d[0] in first else len(first))
  shown = '; '.join(f'{k}: {v!r} in the checkpoint, {w!r} now' for k, v, w in diffs[:limit])
  return shown + (f' (and {len(diffs) - limit} more)' if len(diffs) > limit else '')


def check_compatible(saved, current, step_dir, extra_safe=()):
  """Raises IncompatibleCheckpoint listing the unsafe differences; returns the safe ones."""
  safe, unsafe = config_differences(saved, current, extra_safe)
  if unsafe:
    raise IncompatibleCheckpoint(
        f'{step_dir} was written with another config: {describe_differences(unsafe)}. Resume with the same config '
        f'(only {", ".join(SAFE_TO_CHANGE + tuple(extra_safe))} may change), or use a new --workdir.')
  return safe
