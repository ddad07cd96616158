"""sft: instruction tuning of the VLM (LoRA / QLoRA / full) on image conversations, with a curriculum,
held-out VQA evaluation against the majority baseline, and post-SFT temperature calibration."""
