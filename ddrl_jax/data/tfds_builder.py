"""A tensorflow-datasets builder over ddrl_jax record shards, usable without TensorFlow.

  builder = RecordsBuilder(records_dir='/data/train', data_dir='/data/tfds')
  builder.download_and_prepare()          # converts once; later calls reuse the prepared files
  source = builder.as_data_source()['train']
  example = source[0]   # {'prompt': b'...', 'sample': np.ndarray, 'source': b'data-00000-of-00001...[3]', ...}

What works without TensorFlow (tensorflow-datasets 4.9.10, checked with TF not installed):
  * `download_and_prepare()` with file_format 'array_record' (this builder's default): tfds serializes
    tf.train.Example protos with its own numpy/protobuf code and writes ArrayRecord shards;
  * `as_data_source()` (and `tfds.data_source(...)` on the prepared directory): random-access numpy
    examples, which a grain pipeline can consume directly.
What needs TensorFlow: `as_dataset()` / `tfds.load()` (they build a tf.data pipeline), and the
'tfrecord' file format. Those are not used here.

The builder does not read ddrl_jax's msgpack records in place: tfds can only read its own example format,
so `download_and_prepare` makes a tfds copy (data_dir/ddrl_records/<config>/1.0.0/) of every record.

Features (shapes and dtypes from the records' manifest.json, so every record must match them):
  prompt: Text (read back as bytes), sample: Tensor, text_embedding / first_frame: Tensor when the
  records have them, meta: Text (JSON), source: Text "<shard file name>[<index in shard>]".
Tensors use the BYTES encoding (raw array bytes) instead of per-value proto lists.
The record directory reaches the builder through `records_dir=` (or a RecordsConfig); the config name
is derived from the directory (name plus a hash of its absolute path) unless one is given.
"""
import dataclasses
import hashlib
import json
import os
import re

import numpy as np
import tensorflow_datasets as tfds

from ddrl_jax.data import records as records_lib


@dataclasses.dataclass(eq=False)
class RecordsConfig(tfds.core.BuilderConfig):
  records_dir: str = ''


def config_for(records_dir):
  """RecordsConfig named '<dir name>_<8 hex of sha1(abspath)>'."""
  path = os.path.abspath(records_dir)
  slug = re.sub(r'[^a-zA-Z0-9_]', '_', os.path.basename(path.rstrip('/'))) or 'records'
  digest = hashlib.sha1(path.encode()).hexdigest()[:8]
  return RecordsConfig(name=f'{slug}_{digest}', records_dir=path,
                       description=f'ddrl_jax records of {path}')


class RecordsBuilder(tfds.core.GeneratorBasedBuilder):
  """tfds builder named 'ddrl_records': one 'train' split holding every record of records_dir."""

  name = 'ddrl_records'
  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'ddrl_jax record format version 1.'}
  # Nothing is downloaded. Without this, tfds 4.9.10 looks for a checksums file next to the builder's
  # code (DatasetBuilder.code_path), which imports the `importlib_resources` backport that tfds only
  # requires on Python < 3.9, and fails on 3.10+ where it is not installed.
  url_infos = None

  def __init__(self, *, records_dir=None, config=None, file_format='array_record', **kwargs):
    if config is None:
      if records_dir is None:
        raise ValueError('RecordsBuilder: pass records_dir= (a directory written by '
                         'ddrl_jax.data.records.write_shards) or config=RecordsConfig(...)')
      config = config_for(records_dir)
    self._manifest = records_lib.read_manifest(config.records_dir)
    super().__init__(config=config, file_format=file_format, **kwargs)

  def _info(self):
    features = {'prompt': tfds.features.Text(), 'meta': tfds.features.Text(),
                'source': tfds.features.Text()}
    for name, field in self._manifest['fields'].items():
      features[name] = tfds.features.Tensor(shape=tuple(field['shape']), dtype=np.dtype(field['dtype']),
                                            encoding=tfds.features.Encoding.BYTES)
    return tfds.core.DatasetInfo(
        builder=self, description='ddrl_jax training records (prompt, clean sample, conditions).',
        features=tfds.features.FeaturesDict(features))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples()}

  def _generate_examples(self):
    """Yields (key, example) for every record, shard by shard, checked against the manifest."""
    # pylint: disable-next=g-import-not-at-top
    from array_record.python.array_record_module import ArrayRecordReader
    expected = records_lib.expected_from_manifest(self.builder_config.records_dir)
    for shard in self._manifest['shards']:
      path = os.path.join(self.builder_config.records_dir, shard)
      reader = ArrayRecordReader(path)
      try:
        for i in range(reader.num_records()):
          record = records_lib.decode_record(reader.read([i])[0], f'{path}[{i}]', expected)
          example = {name: record[name] for name in expected}
          example.update(prompt=record['prompt'], meta=json.dumps(record.get('meta') or {}),
                         source=f'{shard}[{i}]')
          yield f'{shard}[{i}]', example
      finally:
        reader.close()
