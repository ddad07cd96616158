"""The synthetic shapes world: scenes with exact ground truth, a defect-labelled lake, held-out splits."""
