"""Data readers, the held-out evaluation suite, metrics and task scorers. Imports `model` and `platform`."""
