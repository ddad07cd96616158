"""Generation with the stage's own sampling settings only.

`model.generate(**kwargs)` fills every setting left unset from the checkpoint's `generation_config.json`; Qwen's
Instruct checkpoints ship `repetition_penalty`, `top_k`, `top_p` and `temperature` there. RL scores a rollout with
a plain softmax at its temperature, so a rollout sampled from a penalised distribution would break the equality of
sampled and scored log-probabilities the policy gradient relies on, and a "greedy" evaluation would be greedy on
penalised logits. `own_generation_config` swaps in a fresh GenerationConfig (transformers' neutral defaults plus
the given settings) for the duration of the call, and restores the checkpoint's afterwards (it is saved with the
model for serving).

    with own_generation_config(model, eos_token_id=end, pad_token_id=pad):
        model.generate(..., do_sample=True, temperature=T, top_k=0, top_p=1.0)
"""

from __future__ import annotations

import contextlib


def generating_model(model):
    """The module whose `generation_config` generate() reads, under peft / DeepSpeed / reward-head wrappers."""
    for module in model.modules():
        if hasattr(module, "generation_config") and hasattr(module, "generate"):
            if type(module).__name__.startswith("Peft"):
                continue  # peft forwards generate() to the transformers model inside
            return module
    raise ValueError(f"{type(model).__name__} has no generate(); generation needs a transformers generative model.")


@contextlib.contextmanager
def own_generation_config(model, **settings):
    """Within the block, generate() on `model` sees only `settings` over transformers' defaults."""
    from transformers import GenerationConfig

    target = generating_model(model)
    saved = target.generation_config
    target.generation_config = GenerationConfig(**settings)
    try:
        yield target.generation_config
    finally:
        target.generation_config = saved
