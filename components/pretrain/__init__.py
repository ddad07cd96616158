"""pretrain: align the vision side with the LM on image-caption pairs. Stage 1 trains the merger (optionally the
LM) on cached ViT features; stage 2 trains jointly from pixels with per-module learning rates."""
