"""Training data: record shards (records), the grain pipeline (pipeline), dataset preparation (prepare).

  python -m ddrl_jax.data.prepare --source=DIR --out=DIR --config=configs/cosmos2b.py:smoke
  loader = pipeline.RecordLoader(DIR, batch_size=8, expected=records.expected_from_manifest(DIR))

tfds users: ddrl_jax.data.tfds_builder.RecordsBuilder (no TensorFlow needed).
"""
