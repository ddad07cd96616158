"""clean_data: read a lake (WebDataset tars or Parquet), drop bad image-caption pairs, account for every record.

stage.py holds the API the pipeline calls (list_shards, clean_shard, merge_shards, run); readers.py streams
records out of shards; filters.py holds the per-record checks and the model-backed scorers.
"""
