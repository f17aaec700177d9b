"""CLI: a folder of captioned images / videos -> record shards of VAE latents and text embeddings.

  python -m ddrl_jax.data.prepare --source=DIR --out=DIR --config=configs/cosmos2b.py:smoke
      [--manifest=FILE.jsonl] [--records_per_shard=1000] [--batch=N] [--text=task|none] [--skip_bad]
      [--pad_frames] [--repeat_images] [--overwrite]
  python -m ddrl_jax.data.prepare --source=DIR --out=DIR --height=256 --width=256 [--frames=1]

Captions: a sidecar `<stem>.txt` next to each media file (every media file under --source, recursively),
or --manifest: a JSONL file of {"file": path relative to --source, "caption" (or "prompt"): text}.
A file without a caption, or that cannot be read or fitted, is an error naming it, or with --skip_bad a
counted skip (listed in the summary and in manifest.json's extra.skipped).

Media (ddrl_jax.data.media) are fitted to the task's `media_shape` (first F frames, centre crop to
the aspect ratio, resize) and encoded by the task built from --config (ddrl_jax.tasks.get_task):
  sample         = task.encode_samples(media)        e.g. (16, T, H, W) normalized Wan latents
  text_embedding = task.encode_prompts(captions)     (L, D) when --text=task and the task gives one
  first_frame    = sample[:, :1] for video latents ((C, T, H, W) float), sample[:1] for pixel videos
  meta           = {'file': path relative to --source}
Without --config the records hold the fitted uint8 pixels ((H, W, 3), or (F, H, W, 3) for --frames > 1)
and no text embedding.
"""
import json
import os
import sys

from absl import flags
from ml_collections import config_flags
import numpy as np
import tqdm

from ddrl_jax import cli
from ddrl_jax import console
from ddrl_jax.data import media as media_lib
from ddrl_jax.data import records as records_lib


class PixelTask:
  """Stand-in task without a model: records hold the fitted uint8 pixels and no text embedding."""

  capabilities = frozenset({'media'})

  def __init__(self, height, width, frames=1):
    if min(height, width, frames) < 1:
      raise ValueError(f'pixel records need height, width, frames >= 1, got {height}, {width}, {frames}')
    self.media_shape = (frames, height, width, 3)
    self.sample_shape = self.media_shape if frames > 1 else self.media_shape[1:]

  def encode_samples(self, media_u8):
    return np.asarray(media_u8, np.uint8).reshape((-1,) + self.sample_shape)

  def encode_prompts(self, prompts):
    del prompts


def _read_caption(path):
  with open(path, encoding='utf-8') as f:
    return f.read().strip()


def find_items(source, manifest=None):
  """[(relative media path, caption or None)] in file order; and the ignored (non-media) files.

  With a manifest, its lines in order (captions from "caption" or "prompt"); otherwise every media file
  under `source`, sorted by path, with its sidecar `<stem>.txt` caption (None when missing or empty).
  """
  items, ignored = [], []
  if manifest:
    with open(manifest, encoding='utf-8') as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          entry = json.loads(line)
          rel = entry['file']
        except (ValueError, KeyError, TypeError) as e:
          raise ValueError(f'{manifest}:{n}: expected {{"file": ..., "caption": ...}} ({e})') from e
        caption = entry.get('caption', entry.get('prompt'))
        items.append((rel, (caption.strip() or None) if isinstance(caption, str) else None))
    return items, ignored
  for root, dirs, files in os.walk(source):
    dirs.sort()
    for name in sorted(files):
      rel = os.path.relpath(os.path.join(root, name), source)
      stem, ext = os.path.splitext(name)
      if ext.lower() not in media_lib.MEDIA_EXTENSIONS:
        if ext.lower() != '.txt':
          ignored.append(rel)
        continue
      sidecar = os.path.join(root, stem + '.txt')
      items.append((rel, (_read_caption(sidecar) or None) if os.path.isfile(sidecar) else None))
  return sorted(items), sorted(ignored)


def first_frame_of(sample):
  """The image-to-video conditioning frame of one sample, or None for an image sample."""
  if sample.ndim == 4 and sample.dtype == np.uint8:       # (F, H, W, 3) pixels
    return sample[:1] if sample.shape[0] > 1 else None
  if sample.ndim == 4:                                   # (C, T, H, W) latents
    return sample[:, :1]
  return None


def _records(items, source, task, *, batch, text, pad_frames, repeat_images, skip_bad, skipped):
  """Yields record dicts; appends the messages of skipped items to `skipped`."""
  frames = task.media_shape[0]
  chunk, bar = [], tqdm.tqdm(total=len(items), unit='file', desc='prepare')

  def flush():
    if not chunk:
      return []
    samples = task.encode_samples(np.stack([m for _, _, m in chunk]))
    texts = task.encode_prompts([c for _, c, _ in chunk]) if text == 'task' else None
    out = []
    for i, (rel, caption, _) in enumerate(chunk):
      rec = dict(prompt=caption, sample=samples[i], meta={'file': rel})
      if isinstance(texts, dict):       # several text fields (e.g. SD3: text_embedding, pooled_embedding)
        rec.update({name: value[i] for name, value in texts.items()})
      elif texts is not None:
        rec['text_embedding'] = texts[i]
      first = first_frame_of(samples[i])
      if first is not None:
        rec['first_frame'] = first
      out.append(rec)
    chunk.clear()
    return out

  try:
    for rel, caption in items:
      path = os.path.join(source, rel)
      try:
        if caption is None:
          raise media_lib.MediaError(f'{path}: no caption (expected a non-empty '
                                     f'{os.path.splitext(rel)[0]}.txt or a manifest entry)')
        if not os.path.isfile(path):
          raise media_lib.MediaError(f'{path}: no such file')
        fitted = media_lib.fit_media(media_lib.load_media(path, max_frames=frames), task.media_shape,
                                     path, pad_frames=pad_frames, repeat_images=repeat_images)
      except media_lib.MediaError as e:
        if not skip_bad:
          raise
        skipped.append(str(e))
        tqdm.tqdm.write(f'skipped: {e}')
      else:
        chunk.append((rel, caption, fitted))
      bar.update(1)
      if len(chunk) >= batch:
        yield from flush()
    yield from flush()
  finally:
    bar.close()


def prepare(source, out, task, *, manifest=None, records_per_shard=1000, batch=8, text='task',
            skip_bad=False, pad_frames=False, repeat_images=False, overwrite=False, prefix='data'):
  """Encodes the captioned media under `source` into record shards in `out`; returns a summary dict.

  task: has media_shape (F, H, W, 3), encode_samples (B, F, H, W, 3) uint8 -> (B, *sample_shape) and
    encode_prompts list[str] -> (B, L, D) or None (e.g. tasks.video.CosmosVideo, or PixelTask).
  Returns {'num_records', 'num_skipped', 'skipped' (messages), 'ignored' (non-media files),
    'shards' (paths), 'sample_shape'}.
  """
  from ddrl_jax.tasks import base as tasks_base  # pylint: disable=g-import-not-at-top
  tasks_base.require(task, 'media')   # media_shape, encode_samples, encode_prompts (e.g. task=video)
  if text not in ('task', 'none'):
    raise ValueError(f"text={text!r}: expected 'task' or 'none'")
  if batch < 1:
    raise ValueError(f'batch={batch}: must be >= 1')
  items, ignored = find_items(source, manifest)
  if not items:
    raise cli.UsageError(f'{manifest or source}: no media files ({", ".join(media_lib.MEDIA_EXTENSIONS)})',
                         'check --source (and --manifest)')
  skipped = []
  recs = _records(items, source, task, batch=batch, text=text, pad_frames=pad_frames,
                  repeat_images=repeat_images, skip_bad=skip_bad, skipped=skipped)
  extra = dict(source=os.path.abspath(source), manifest=manifest and os.path.abspath(manifest),
               task=type(task).__name__, media_shape=list(task.media_shape),
               sample_shape=list(task.sample_shape), text=text, skipped=skipped, ignored=ignored)
  shards = records_lib.write_shards(recs, out, prefix=prefix, records_per_shard=records_per_shard,
                                    overwrite=overwrite, extra=extra)
  num = records_lib.read_manifest(out)['num_records']
  return dict(num_records=num, num_skipped=len(skipped), skipped=skipped, ignored=ignored,
              shards=shards, sample_shape=tuple(task.sample_shape))


# ---------------------------------------------------------------------------------------------- CLI
def _define_flags():
  """Defined only when run as a script, so importing this module adds no global absl flags."""
  f = flags
  return dict(
      config=config_flags.DEFINE_config_file(
          'config', None, 'Task config file (get_config(arg)); without it the records hold pixels.',
          lock_config=True),
      source=f.DEFINE_string('source', None, 'Folder of images / videos (and sidecar captions).'),
      out=f.DEFINE_string('out', None, 'Output folder for the shards and manifest.json.'),
      manifest=f.DEFINE_string('manifest', None, 'JSONL of {"file", "caption"} instead of sidecars.'),
      records_per_shard=f.DEFINE_integer('records_per_shard', 1000, 'Records per ArrayRecord shard.'),
      batch=f.DEFINE_integer('batch', 0, 'Media per encode call (0: 8; the task splits them into its own VAE batches).'),
      text=f.DEFINE_enum('text', 'task', ['task', 'none'],
                         "'task': store the task's text embedding; 'none': prompts only."),
      skip_bad=f.DEFINE_bool('skip_bad', False, 'Skip (and count) unreadable or uncaptioned files.'),
      pad_frames=f.DEFINE_bool('pad_frames', False, 'Repeat the last frame of too short videos.'),
      repeat_images=f.DEFINE_bool('repeat_images', False, 'Use still images as static videos.'),
      overwrite=f.DEFINE_bool('overwrite', False, 'Replace shards already in --out.'),
      height=f.DEFINE_integer('height', 0, 'Pixel records (no --config): height.'),
      width=f.DEFINE_integer('width', 0, 'Pixel records (no --config): width.'),
      frames=f.DEFINE_integer('frames', 1, 'Pixel records (no --config): frames per video.'),
  )


def main(fl):
  """Builds the task from the flags, runs prepare and prints the summary as JSON."""
  console.setup()
  v = {k: h.value for k, h in fl.items()}
  if v['config'] is not None:
    from ddrl_jax import preflight  # pylint: disable=g-import-not-at-top
    from ddrl_jax import tasks  # pylint: disable=g-import-not-at-top
    task = tasks.get_task(v['config'])
    # Encoding needs the VAE and the text encoders, not the denoiser's weights nor any training input.
    preflight.check(v['config'], task, cli.config_spec(sys.argv) or 'the config', model_only=True,
                    skip=lambda key: key.endswith('.checkpoint') and not key.endswith('vae_checkpoint'))
    batch = v['batch'] or 8        # media per encode_samples call (the task chunks its VAE calls itself)
  else:
    if not (v['height'] and v['width']):
      raise cli.UsageError('without --config, the records hold pixels and need a size',
                         'pass --height and --width, or --config')
    task = PixelTask(v['height'], v['width'], v['frames'])
    batch = v['batch'] or 8
  summary = prepare(v['source'], v['out'], task, manifest=v['manifest'],
                    records_per_shard=v['records_per_shard'], batch=batch, text=v['text'],
                    skip_bad=v['skip_bad'], pad_frames=v['pad_frames'],
                    repeat_images=v['repeat_images'], overwrite=v['overwrite'])
  print(json.dumps({k: val for k, val in summary.items() if k != 'shards'} | {'out': v['out']}))


if __name__ == '__main__':
  _FLAGS = _define_flags()
  cli.run(lambda argv: main(_FLAGS), required=('source', 'out'))
