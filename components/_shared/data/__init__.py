"""Everything model-free about data: record formats and containers, data directories (dataset.yaml), the standard
benchmarks' layouts, tasks and their scorers, metric primitives, OCR, and the lake (listing and shard reading).
Imports `platform` only."""
