"""What the stages share, by kind: platform/ (plumbing), model/ (the VLM training core), eval/ (readers, evaluation,
metrics), launch/ (how a stage runs). Arrows point one way: eval -> model -> platform, launch -> platform; nothing
here imports a stage or pipelines/ (docs/architecture.md)."""
