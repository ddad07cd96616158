"""promote: the champion as merged safetensors for serving, Model Registry registration, a KServe InferenceService."""
