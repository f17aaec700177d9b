"""ddrl_jax.data: record format, shards, the grain loader (order, sharding, resume, bad records),
the tfds builder and dataset preparation with the smoke Cosmos task's VAE and text encoder."""
import json
import os
import subprocess
import sys

from array_record.python.array_record_module import ArrayRecordWriter
import numpy as np
import orbax.checkpoint as ocp
from PIL import Image
import pytest

from configs import cosmos2b
from ddrl_jax import tasks
from ddrl_jax.data import media
from ddrl_jax.data import pipeline
from ddrl_jax.data import prepare
from ddrl_jax.data import records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_record(i, *, pixels=False):
  rs = np.random.RandomState(i)
  if pixels:
    return dict(prompt=f'pixels {i}', sample=rs.randint(0, 256, (2, 4, 4, 3)).astype(np.uint8))
  return dict(prompt=f'prompt {i} \u00e9', sample=rs.randn(16, 2, 4, 4).astype(np.float32),
              text_embedding=rs.randn(5, 8).astype(np.float32),
              first_frame=rs.randn(16, 1, 4, 4).astype(np.float32),
              pooled_embedding=rs.randn(6).astype(np.float32), meta={'file': f'f{i}.png', 'i': i})


def assert_same_record(got, want):
  assert got['prompt'] == want['prompt']
  assert got.get('meta') == want.get('meta')
  for name in records.ARRAY_FIELDS:
    assert (name in got) == (name in want), name
    if name in want:
      assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name


@pytest.fixture(scope='module')
def shard_dir(tmp_path_factory):
  """12 float32 records in 3 shards of at most 5."""
  out = str(tmp_path_factory.mktemp('shards'))
  records.write_shards([make_record(i) for i in range(12)], out, records_per_shard=5)
  return out


def batch_ids(batch):
  return [m['i'] for m in batch['meta']]


# ---------------------------------------------------------------------------------------- records
def test_record_roundtrip_float32_and_uint8():
  for rec in (make_record(3), make_record(4, pixels=True)):
    raw = records.encode_record(rec)
    assert b'numpy' not in raw and b'pickle' not in raw
    assert_same_record(records.decode_record(raw, 'x[0]'), rec)


@pytest.mark.parametrize('bad, match', [
    (dict(sample=np.zeros(2, np.float32)), "missing required field 'prompt'"),
    (dict(prompt=3, sample=np.zeros(2, np.float32)), "'prompt': expected str"),
    (dict(prompt='p'), "missing required field 'sample'"),
    (dict(prompt='p', sample=[1.0, 2.0]), "'sample': expected an array"),
    (dict(prompt='p', sample=np.zeros(2, np.float64)), "dtype float64"),
    (dict(prompt='p', sample=np.array([1.0, np.nan], np.float32)), 'NaN'),
    (dict(prompt='p', sample=np.zeros(2, np.float32), text_embedding=np.zeros(3, np.float32)), r'\(L, D\)'),
    (dict(prompt='p', sample=np.zeros(2, np.float32), meta={'a': object()}), 'JSON-able'),
    (dict(prompt='p', sample=np.zeros(2, np.float32), label=1), 'unknown fields'),
])
def test_encode_rejects_bad_fields(bad, match):
  with pytest.raises(ValueError, match=match):
    records.encode_record(bad)


def test_decode_errors_name_where_field_and_shapes():
  with pytest.raises(records.RecordError, match=r'^f\.array_record\[7\]: corrupt record'):
    records.decode_record(b'\x93garbage', 'f.array_record[7]')
  raw = records.encode_record(make_record(0))
  expected = {'sample': ((16, 2, 4, 5), 'float32')}
  with pytest.raises(records.RecordError, match=r"^f\[1\]: field 'sample' has shape \(16, 2, 4, 4\) "
                     r'float32, expected \(16, 2, 4, 5\) float32'):
    records.decode_record(raw, 'f[1]', expected)
  records.decode_record(raw, 'f[1]', {'sample': ((16, None, 4, 4), 'float32')})   # None: any size
  with pytest.raises(records.RecordError, match="missing field 'first_frame'"):
    records.decode_record(records.encode_record(make_record(0, pixels=True)), 'f[2]',
                          {'first_frame': ((1,), 'uint8')})


def test_write_shards_names_manifest_and_read_back(tmp_path, shard_dir):
  names = sorted(os.listdir(shard_dir))
  assert names == [f'data-0000{i}-of-00003.array_record' for i in range(3)] + ['manifest.json']
  manifest = records.read_manifest(shard_dir)
  assert manifest['num_records'] == 12 and manifest['shards'] == names[:3]
  assert manifest['fields']['sample'] == {'shape': [16, 2, 4, 4], 'dtype': 'float32'}
  assert records.expected_from_manifest(shard_dir)['text_embedding'] == ((5, 8), 'float32')
  for got, i in zip(records.read_all(shard_dir), range(12)):
    assert_same_record(got, make_record(i))
  # list_shards: a directory, a glob, files; sorted and unique.
  paths = [os.path.join(shard_dir, n) for n in names[:3]]
  assert records.list_shards(shard_dir) == paths
  assert records.list_shards([os.path.join(shard_dir, '*-of-*'), paths[1]]) == paths
  with pytest.raises(ValueError, match='no ArrayRecord shards'):
    records.list_shards(str(tmp_path / 'nothing*'))
  with pytest.raises(ValueError, match='already holds 3'):
    records.write_shards([make_record(0)], shard_dir)
  # A record whose shape differs from the first stops the write and leaves no partial shard behind.
  bad = [make_record(0), dict(make_record(1), sample=np.zeros((3,), np.float32))]
  with pytest.raises(ValueError, match='record 1'):
    records.write_shards(bad, str(tmp_path / 'bad'))
  assert os.listdir(tmp_path / 'bad') == []


# ----------------------------------------------------------------------------------------- loader
def test_one_epoch_yields_every_record_once(shard_dir):
  loader = pipeline.RecordLoader(shard_dir, 4, seed=5, num_epochs=1,
                                 expected=records.expected_from_manifest(shard_dir))
  batches = list(loader)
  assert len(batches) == 3 and loader.records_seen == 12 and loader.num_skipped == 0
  b = batches[0]
  assert isinstance(b['prompt'], list) and len(b['prompt']) == 4
  assert b['sample'].shape == (4, 16, 2, 4, 4) and b['sample'].dtype == np.float32
  assert b['text_embedding'].shape == (4, 5, 8) and b['first_frame'].shape == (4, 16, 1, 4, 4)
  ids = sum((batch_ids(b) for b in batches), [])
  assert sorted(ids) == list(range(12))
  for k, i in enumerate(batch_ids(b)):
    want = make_record(i)
    assert b['prompt'][k] == want['prompt'] and np.array_equal(b['sample'][k], want['sample'])


def test_shuffle_is_a_function_of_the_seed(shard_dir):
  order = lambda **kw: sum((batch_ids(b) for b in pipeline.RecordLoader(shard_dir, 3, num_epochs=2,
                                                                         **kw)), [])
  a = order(seed=1)
  assert a == order(seed=1)
  assert a != order(seed=2)
  assert a[:12] != a[12:] and sorted(a[12:]) == list(range(12))     # a new permutation per epoch
  assert order(shuffle=False) == list(range(12)) * 2


@pytest.mark.parametrize('num_records', [12, 13])
def test_two_shards_partition_the_records(tmp_path, num_records):
  records.write_shards([make_record(i) for i in range(num_records)], str(tmp_path), records_per_shard=5)
  got = [sum((batch_ids(b) for b in pipeline.RecordLoader(str(tmp_path), 2, seed=3, num_epochs=1,
                                                          shard_index=s, shard_count=2)), [])
         for s in (0, 1)]
  assert len(got[0]) == len(got[1]) == 6
  assert not set(got[0]) & set(got[1])
  assert set(got[0]) | set(got[1]) <= set(range(num_records))
  if num_records == 12:
    assert set(got[0]) | set(got[1]) == set(range(12))
  default = pipeline.RecordLoader(str(tmp_path), 2, seed=3, num_epochs=1)   # jax.process_index/count
  assert len(sum((batch_ids(b) for b in default), [])) == num_records // 2 * 2


def test_resume_from_orbax_checkpoint_continues_the_stream(tmp_path, shard_dir):
  make = lambda: pipeline.RecordLoader(shard_dir, 3, seed=7)
  reference = make()
  want = [batch_ids(next(reference)) for _ in range(10)]
  loader = make()
  assert [batch_ids(next(loader)) for _ in range(4)] == want[:4]
  mngr = ocp.CheckpointManager(str(tmp_path / 'ckpt'), options=ocp.CheckpointManagerOptions(create=True))
  mngr.save(4, args=ocp.args.Composite(state=ocp.args.StandardSave({'w': np.arange(3.0)}),
                                       data=pipeline.save_args(loader)))
  next(loader)                  # moving on after save does not change what was saved
  mngr.wait_until_finished()
  mngr.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave({'w': np.arange(3.0)})))
  mngr.wait_until_finished()
  mngr.close()

  mngr = ocp.CheckpointManager(str(tmp_path / 'ckpt'))
  assert 'data' in mngr.item_metadata(4) and 'data' not in mngr.item_metadata(5)
  fresh = make()
  restored = mngr.restore(4, args=ocp.args.Composite(
      state=ocp.args.StandardRestore({'w': np.zeros(3)}), data=pipeline.restore_args(fresh)))
  assert restored['data'] is fresh and np.array_equal(restored['state']['w'], np.arange(3.0))
  assert fresh.records_seen == 12
  assert [batch_ids(next(fresh)) for _ in range(6)] == want[4:]
  # get_state / set_state without orbax.
  other = make()
  other.set_state(fresh.get_state())
  assert batch_ids(next(other)) == batch_ids(next(fresh))


def write_raw(path, raws):
  writer = ArrayRecordWriter(path, records.WRITER_OPTIONS)
  for raw in raws:
    writer.write(raw)
  writer.close()


@pytest.mark.parametrize('kind', ['corrupt', 'misshaped'])
def test_bad_record_raises_naming_file_and_index_or_is_a_counted_skip(tmp_path, kind):
  path = str(tmp_path / f'{kind}.array_record')
  bad = (records.encode_record(make_record(1))[:-20] if kind == 'corrupt' else
         records.encode_record(dict(make_record(1), sample=np.zeros((16, 2, 4, 5), np.float32))))
  write_raw(path, [records.encode_record(make_record(0)), bad, records.encode_record(make_record(2))])
  expected = {'sample': ((16, 2, 4, 4), 'float32')}
  loader = pipeline.RecordLoader(path, 1, shuffle=False, num_epochs=1, expected=expected)
  assert batch_ids(next(loader)) == [0]
  what = 'corrupt record' if kind == 'corrupt' else r"field 'sample' has shape \(16, 2, 4, 5\)"
  with pytest.raises(records.RecordError, match=rf'^{path}\[1\]: {what}'):
    next(loader)
  loader = pipeline.RecordLoader(path, 1, shuffle=False, num_epochs=1, expected=expected, skip_bad=True)
  assert [batch_ids(b) for b in loader] == [[0], [2]]
  assert loader.num_skipped == 1 and loader.records_seen == 3


def test_misshaped_batch_without_expected_names_the_record(tmp_path):
  path = str(tmp_path / 'mixed.array_record')
  write_raw(path, [records.encode_record(make_record(0)),
                   records.encode_record(dict(make_record(1), sample=np.zeros((3,), np.float32)))])
  with pytest.raises(records.RecordError, match=rf"^{path}\[1\]: field 'sample' is"):
    next(pipeline.RecordLoader(path, 2, shuffle=False))


# ------------------------------------------------------------------------------------------- tfds
def test_tfds_builder_reads_back_the_records(tmp_path, shard_dir):
  from ddrl_jax.data import tfds_builder  # pylint: disable=g-import-not-at-top
  builder = tfds_builder.RecordsBuilder(records_dir=shard_dir, data_dir=str(tmp_path / 'tfds'))
  builder.download_and_prepare()
  source = builder.as_data_source()['train']
  assert len(source) == 12
  seen = set()
  for example in source:
    meta = json.loads(example['meta'])
    want = make_record(meta['i'])
    assert example['prompt'].decode() == want['prompt'] and meta == want['meta']
    for name in records.ARRAY_FIELDS:
      assert example[name].dtype == want[name].dtype and np.array_equal(example[name], want[name])
    seen.add(meta['i'])
  assert seen == set(range(12))
  assert 'tensorflow' not in sys.modules


# ------------------------------------------------------------------------------------------ media
def test_fit_media_crops_resizes_and_checks_frames():
  wide = np.zeros((20, 40, 3), np.uint8)
  wide[:, 10:30] = 255                       # the centred square survives the crop to 1:1
  assert np.array_equal(media.center_crop_resize(wide, 8, 8), np.full((8, 8, 3), 255, np.uint8))
  video = np.random.RandomState(0).randint(0, 256, (3, 16, 16, 3)).astype(np.uint8)
  assert np.array_equal(media.fit_media(video, (2, 16, 16, 3), 'v'), video[:2])
  with pytest.raises(media.MediaError, match=r'^v: 3 frames, the task needs 5 \(pass --pad_frames'):
    media.fit_media(video, (5, 16, 16, 3), 'v')
  padded = media.fit_media(video, (5, 8, 8, 3), 'v', pad_frames=True)
  assert padded.shape == (5, 8, 8, 3) and np.array_equal(padded[3], padded[2])
  with pytest.raises(media.MediaError, match='^im: a still image'):
    media.fit_media(video[:1], (5, 16, 16, 3), 'im')
  assert media.fit_media(video[:1], (2, 16, 16, 3), 'im', repeat_images=True).shape == (2, 16, 16, 3)


def test_mp4_is_read_with_imageio_ffmpeg(tmp_path):
  pytest.importorskip('imageio_ffmpeg')
  import imageio.v3 as iio  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / 'clip.mp4')
  iio.imwrite(path, np.full((6, 32, 32, 3), 128, np.uint8), plugin='FFMPEG', fps=8)
  frames = media.load_media(path, max_frames=5)
  assert frames.shape == (5, 32, 32, 3) and frames.dtype == np.uint8
  assert abs(float(frames.mean()) - 128) < 8


def test_mp4_without_imageio_names_the_file_and_the_install(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'imageio_ffmpeg', None)     # import fails as if not installed
  path = str(tmp_path / 'clip.mp4')
  with pytest.raises(media.MediaError, match=rf"^{path}: .*pip install -e '\.\[video\]'"):
    media.load_media(path)


# ---------------------------------------------------------------------------------------- prepare
@pytest.fixture(scope='module')
def smoke_task():
  config = cosmos2b.get_config('smoke')
  config.cosmos.vae_batch = 2                  # compiles in seconds on 2 CPU cores
  return tasks.get_task(config)


def write_media_folder(root):
  """A captioned PNG (cropped), GIF (6 frames), .npy video (7 frames), .npy image, uncaptioned .npy."""
  rs = np.random.RandomState(0)
  os.makedirs(os.path.join(root, 'sub'))
  Image.fromarray(rs.randint(0, 256, (40, 48, 3)).astype(np.uint8)).save(os.path.join(root, 'a.png'))
  gif = [Image.fromarray(rs.randint(0, 256, (32, 32, 3)).astype(np.uint8)) for _ in range(6)]
  gif[0].save(os.path.join(root, 'sub', 'g.gif'), save_all=True, append_images=gif[1:])
  np.save(os.path.join(root, 'v.npy'), rs.randint(0, 256, (7, 36, 36, 3)).astype(np.uint8))
  np.save(os.path.join(root, 'still.npy'), rs.randint(0, 256, (32, 32, 3)).astype(np.uint8))
  np.save(os.path.join(root, 'nocap.npy'), rs.randint(0, 256, (7, 32, 32, 3)).astype(np.uint8))
  captions = {'a': 'a red square', 'sub/g': 'a gif video', 'v': 'an npy video', 'still': 'a still'}
  for stem, text in captions.items():
    with open(os.path.join(root, stem + '.txt'), 'w') as f:
      f.write(text + '\n')
  with open(os.path.join(root, 'notes.json'), 'w') as f:
    f.write('{}')
  return {stem + ext: captions[stem] for stem, ext in
          [('a', '.png'), ('sub/g', '.gif'), ('v', '.npy'), ('still', '.npy')]}


def check_against_task(task, source, recs, captions):
  fitted = np.stack([media.fit_media(media.load_media(os.path.join(source, r['meta']['file'])),
                                     task.media_shape, 'f', repeat_images=True) for r in recs])
  latents = task.encode_samples(fitted)
  texts = task.encode_prompts([r['prompt'] for r in recs])
  for r, z, t in zip(recs, latents, texts):
    assert r['prompt'] == captions[r['meta']['file']]
    assert r['sample'].shape == task.sample_shape and r['sample'].dtype == np.float32
    np.testing.assert_allclose(r['sample'], z, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(r['first_frame'], r['sample'][:, :1])
    np.testing.assert_array_equal(r['text_embedding'], t)


def test_prepare_encodes_media_with_the_task(tmp_path, smoke_task):
  source = str(tmp_path / 'src')
  captions = write_media_folder(source)
  with pytest.raises(media.MediaError, match=r'nocap\.npy: no caption'):
    prepare.prepare(source, str(tmp_path / 'strict'), smoke_task, repeat_images=True)
  still_only = tmp_path / 'still.jsonl'
  still_only.write_text(json.dumps({'file': 'still.npy', 'caption': 'a still'}))
  with pytest.raises(media.MediaError, match=r'still\.npy: a still image'):
    prepare.prepare(source, str(tmp_path / 'strict2'), smoke_task, manifest=str(still_only))
  summary = prepare.prepare(source, str(tmp_path / 'out'), smoke_task, repeat_images=True,
                            skip_bad=True, records_per_shard=3, batch=3)
  assert summary['num_records'] == 4 and summary['num_skipped'] == 1 and len(summary['shards']) == 2
  assert 'nocap.npy' in summary['skipped'][0] and summary['ignored'] == ['notes.json']
  recs = records.read_all(str(tmp_path / 'out'))
  assert [r['meta']['file'] for r in recs] == ['a.png', 'still.npy', 'sub/g.gif', 'v.npy']
  check_against_task(smoke_task, source, recs, captions)
  # encode_prompts is prompt_embeddings' frozen byte embedding.
  from ddrl_jax.tasks import video  # pylint: disable=g-import-not-at-top
  np.testing.assert_array_equal(smoke_task.encode_prompts([p for p, _, _ in video.PROMPTS]),
                                smoke_task.prompt_embeddings())
  assert records.read_manifest(str(tmp_path / 'out'))['extra']['skipped'] == summary['skipped']


def test_prepare_pixels_without_a_model(tmp_path):
  source = str(tmp_path / 'src')
  captions = write_media_folder(source)
  summary = prepare.prepare(source, str(tmp_path / 'out'), prepare.PixelTask(16, 16), skip_bad=True)
  recs = records.read_all(str(tmp_path / 'out'))
  assert summary['num_records'] == 4 and all(r['sample'].shape == (16, 16, 3) for r in recs)
  assert all('text_embedding' not in r and 'first_frame' not in r for r in recs)
  assert {r['meta']['file']: r['prompt'] for r in recs} == captions


def test_prepare_cli_with_jsonl_manifest(tmp_path, smoke_task):
  source = str(tmp_path / 'src')
  captions = write_media_folder(source)
  manifest = tmp_path / 'list.jsonl'
  entries = [{'file': 'v.npy', 'caption': 'manifest video'}, {'file': 'sub/g.gif', 'prompt': 'gif'}]
  manifest.write_text('\n'.join(json.dumps(e) for e in entries) + '\n\n')
  out = str(tmp_path / 'out')
  cmd = [sys.executable, '-m', 'ddrl_jax.data.prepare', f'--source={source}', f'--out={out}',
         f'--manifest={manifest}', '--config=configs/cosmos2b.py:smoke', '--config.cosmos.vae_batch=2',
         '--records_per_shard=1']
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary['num_records'] == 2 and summary['sample_shape'] == list(smoke_task.sample_shape)
  recs = records.read_all(out)
  assert [r['meta']['file'] for r in recs] == ['v.npy', 'sub/g.gif']
  captions.update({e['file']: e.get('caption', e.get('prompt')) for e in entries})
  check_against_task(smoke_task, source, recs, captions)
  loader = pipeline.RecordLoader(out, 2, num_epochs=1, expected=records.expected_from_manifest(out))
  batch = next(loader)
  assert batch['sample'].shape == (2,) + smoke_task.sample_shape
  assert batch['text_embedding'].shape == (2, smoke_task.c.text_length, smoke_task.text_dim)
