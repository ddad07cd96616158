"""The VLM training core: model sources and loading, packing, attention, the training loop,
checkpoints, the DeepSpeed backend and the reward-model artifact. Imports `platform` only."""
