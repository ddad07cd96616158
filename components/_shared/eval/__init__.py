"""What runs a model on data: the held-out evaluation suite (batched generation, answer confidences, held-out
loss, calibration). Imports `data`, `model` and `platform`."""
