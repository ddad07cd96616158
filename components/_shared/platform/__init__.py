"""Plumbing every stage may use: config base and presets, storage (local/S3), tracking (MLflow),
container image tags, image decoding, report figures. Imports nothing else of `_shared`."""
