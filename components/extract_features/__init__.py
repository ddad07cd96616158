"""extract_features: decode the kept images, smart_resize them and cache the frozen Qwen2.5-VL vision tower's
pre-merger features (safetensors shards + index.json), so pretrain trains the merger without the ViT."""
