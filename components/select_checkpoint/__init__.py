"""select_checkpoint: held-out evaluation of every candidate, gated selection, MLflow registry, model card."""
