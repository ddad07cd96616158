"""The rollout engine: batched sampling from the policy with the KV cache, then one packed teacher-forced pass
per model for the log-probabilities (policy, reference), entropies and values of the sampled tokens.

Completions are kept as the generated token ids (never re-tokenised text), so the update scores exactly the
tokens that were sampled. A rollout's `sample` is the prompt plus its completion with labels on the
completion tokens only, so the packer (components/_shared/model/packing.py) serves sampling-time scoring and the
update alike; the per-token tensors are in the order of those labelled tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from components._shared.data.datasets import prompt_turns
from components._shared.model.encoder import IGNORE_INDEX, ConversationEncoder, Sample
from components._shared.model.generation import own_generation_config
from components._shared.model.head_loss import head_rows_map, output_head
from components._shared.model.packing import (
    forward_hidden,
    generation_vision_inputs,
    pack,
    plan_micro_batches,
    to_device,
)
from components._shared.model.train_config import TrainConfig
from components.rl.shard import ONE_PROCESS, Shard

DEFAULT_CHUNK_ROWS = TrainConfig().loss_chunk_tokens


@dataclass
class Rollout:
    record: dict
    completion_ids: list[int]
    text: str
    finished: bool
    sample: Sample
    rewards: dict[str, float] = field(default_factory=dict)
    reward: float = 0.0
    logprobs: torch.Tensor | None = None  # (T,) under the sampling policy, as the trainer scores it
    sampler_logprobs: torch.Tensor | None = None  # (T,) as generate() sampled them (the parity check's other side)
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None  # (T,) critic, PPO only
    entropy: torch.Tensor | None = None  # (T,)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return len(self.completion_ids)


class Policy(torch.nn.Module):
    """The Qwen-VL being trained plus, for PPO, a value head reading its last hidden state (shared trunk)."""

    def __init__(self, model, *, value_head: bool) -> None:
        super().__init__()
        self.model = model
        self.value_head = None
        if value_head:
            hidden = model.config.text_config.hidden_size
            self.value_head = torch.nn.Linear(hidden, 1)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def gradient_checkpointing_enable(self, **kwargs):
        self.model.gradient_checkpointing_enable(**kwargs)

    def enable_input_require_grads(self):
        self.model.enable_input_require_grads()

    def token_outputs(
        self, batch: dict, temperature: float, suppressed: list[int], **options
    ) -> dict[str, torch.Tensor]:
        """At the labelled positions of a packed batch, in order: log-probabilities of the targets, entropies and
        (with a value head) values. The LM head runs on those rows only, in chunks (the vocabulary is large);
        `options` as for token_outputs (plain_rows, full_distribution, chunk_rows)."""
        return token_outputs(self.model, batch, temperature, suppressed, value_head=self.value_head, **options)


def suppressed_tokens(config) -> list[int]:
    """Vision marker tokens of a model config: never sampled (a completion holding one would claim image rows it does
    not have), and masked the same way when scoring, so sampled and scored distributions stay identical."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(getattr(config, n)) for n in names if getattr(config, n, None) is not None})


def token_outputs(
    model,
    batch: dict,
    temperature: float,
    suppressed: list[int],
    value_head=None,
    *,
    plain_rows: torch.Tensor | None = None,
    full_distribution: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> dict[str, torch.Tensor]:
    """See Policy.token_outputs. `plain_rows` (a mask over the labelled positions) adds, for those rows only, the
    targets' log-probabilities at temperature 1 (`plain_logprobs`: ptx's NLL) and, with `full_distribution`, the whole
    log-softmax (`plain_full`, rows x vocabulary: ptx's KL). The head runs `chunk_rows` rows at a time."""
    hidden = forward_hidden(model, batch)[0]
    targets = batch["targets"][0]
    where = targets != IGNORE_INDEX
    rows, index = hidden[where], targets[where]

    def per_row(raw: torch.Tensor, chunk: slice) -> tuple[torch.Tensor, ...]:
        raw[:, suppressed] = -1e9  # finite, so that 0 * log 0 stays 0 in the entropy
        logp = torch.log_softmax(raw / temperature, -1)
        target = index[chunk][:, None]
        outs = [logp.gather(1, target).squeeze(1), -(logp.exp() * logp).sum(-1)]
        if plain_rows is not None:
            outs.append(torch.log_softmax(raw, -1).gather(1, target).squeeze(1))
        return tuple(outs)

    head = output_head(model)
    logprobs, entropy, *plain = head_rows_map(rows, head, per_row, chunk_rows=chunk_rows)
    out = {"logprobs": logprobs, "entropy": entropy}
    if plain_rows is not None:
        out["plain_logprobs"] = plain[0][plain_rows]
        if full_distribution:  # ptx rows only (the reference's distributions there are this size anyway)
            raw = head(rows[plain_rows]).float()
            raw[:, suppressed] = -1e9
            out["plain_full"] = torch.log_softmax(raw, -1)
    if value_head is not None:
        out["values"] = value_head(rows.to(value_head.weight.dtype)).squeeze(-1).float()
    return out


def packed_micro_batches(samples: list[Sample], max_tokens: int, device):
    """(indices, samples, packed batch on `device`) per micro-batch of at most `max_tokens` tokens (a longer sample
    gets one of its own)."""
    sizes = [s.num_tokens for s in samples]
    for group in plan_micro_batches(sizes, max(max_tokens, max(sizes))):
        micro = [samples[i] for i in group]
        yield group, micro, to_device(pack(micro), device)


def split_by_sample(values: torch.Tensor, samples: list[Sample]) -> list[torch.Tensor]:
    """Cut a tensor over the labelled positions of a packed batch into one piece per sample."""
    return list(values.split([s.num_targets for s in samples]))


def _check_prompt_images(record: dict, prompt: Sample, merge_unit: int, image_token_id: int) -> None:
    """A rollout prompt must carry its image, with as many image tokens as its pixels give (the trainer later scores
    the rollout on these very pixel rows: the same preprocessing by construction, checked here)."""
    tokens = int((prompt.input_ids == image_token_id).sum())
    expected = int(prompt.image_grid_thw.prod(-1).sum()) // merge_unit if prompt.image_grid_thw.numel() else 0
    if prompt.pixel_values is None or not expected or tokens != expected:
        raise ValueError(
            f"rl record {record.get('id')!r}: its rollout prompt has {tokens} image tokens for {expected} visual "
            "rows; every RL prompt needs its image (the 'image' field of rl.jsonl)."
        )


class SampledLogprobs(LogitsProcessor):
    """Records the log-probability each sampled token had under the distribution generate() sampled it from: the
    logits after generate's own processors (suppressed tokens at -inf), at the sampling temperature (applied by the
    warper that runs after this processor). Each call keeps one (batch, vocabulary) row set until the next call shows
    which token was drawn from it."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.previous: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.steps.append(self.previous.gather(1, tokens[:, None].to(self.previous.device)).squeeze(1).cpu())

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(batch, generated tokens): the sampling log-probability of every generated token."""
        self._take(sequences[:, -1])
        self.previous = None
        return torch.stack(self.steps, dim=1)


class RolloutEngine:
    def __init__(
        self,
        encoder: ConversationEncoder,
        *,
        max_new_tokens: int,
        temperature: float,
        batch_size: int,
        max_tokens: int,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        self.encoder, self.max_new_tokens, self.temperature = encoder, max_new_tokens, temperature
        self.batch_size, self.max_tokens, self.chunk_rows = batch_size, max_tokens, chunk_rows
        self.use_cache = True  # bench/gpu/rl_step.py turns it off for its baseline
        tokenizer = encoder.tokenizer
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.end_id
        self.suppressed = suppressed_tokens(encoder.config)

    def encode_prompts(self, records: list[dict]) -> list[Sample]:
        """Each record's rollout prompt (its image through the processor, the generation prompt), checked to carry
        its image; CPU work without the model, so the data workers can build it ahead of the step."""
        prompts = [
            self.encoder.encode(
                prompt_turns(r["question"]), images=[r["pil"]], add_generation_prompt=True, sample_id=r["id"]
            )
            for r in records
        ]
        for record, prompt in zip(records, prompts, strict=True):
            _check_prompt_images(record, prompt, self.encoder.merge_unit, self.encoder.image_token_id)
        return prompts

    @torch.no_grad()
    def sample(
        self,
        model,
        records: list[dict],
        samples_per_prompt: int,
        prompts: list[Sample] | None = None,
        *,
        seed: Sequence[int] = (0,),
        shard: Shard = ONE_PROCESS,
        synced: bool = False,
    ) -> list[Rollout]:
        """`samples_per_prompt` completions of each record (consecutive), sampled at the configured temperature;
        `prompts` are the records' encoded prompts when built ahead (`encode_prompts`). The jobs are generated in
        chunks of `batch_size`, chunk k from the seed (*seed, k) whatever else ran before, dealt to the ranks of
        `shard` and gathered on all; `synced`: the model is ZeRO-3 sharded (every rank forwards in lockstep)."""
        prompts = self.encode_prompts(records) if prompts is None else prompts
        jobs = [(r, p) for r, p in zip(records, prompts, strict=True) for _ in range(samples_per_prompt)]
        chunks = [
            list(range(start, min(start + self.batch_size, len(jobs))))
            for start in range(0, len(jobs), self.batch_size)
        ]

        def generate(k: int) -> list[tuple[list[int], torch.Tensor]]:
            return self._generate(model, [jobs[i] for i in chunks[k]], (*seed, k), synced)

        rollouts: list[Rollout] = []
        for chunk, outputs in zip(chunks, shard.map(range(len(chunks)), generate, lockstep=synced), strict=True):
            for i, (completion, logprobs) in zip(chunk, outputs, strict=True):
                record, prompt = jobs[i]
                rollouts.append(self._rollout(record, prompt, completion, self.end_id in completion))
                rollouts[-1].sampler_logprobs = logprobs
        return rollouts

    def _generate(self, model, chunk: list, seed: Sequence[int], synced: bool) -> list[tuple[list[int], torch.Tensor]]:
        """(completion token ids, their sampling log-probabilities) of each (record, prompt) of one chunk, sampled
        from the chunk's own generator state (the caller's random state is left as it was)."""
        device = next(model.parameters()).device
        width = max(p.num_tokens for _, p in chunk)
        ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for b, (_, p) in enumerate(chunk):
            ids[b, width - p.num_tokens :] = p.input_ids
            mask[b, width - p.num_tokens :] = 1
        recorder = SampledLogprobs(self.temperature)
        forked = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked), own_generation_config(model):
            torch.manual_seed(int(np.random.SeedSequence(list(seed)).generate_state(1)[0]))
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                mm_token_type_ids=(ids == self.encoder.image_token_id).to(torch.int32).to(device),
                **generation_vision_inputs([p for _, p in chunk], device),
                max_new_tokens=self.max_new_tokens,
                do_sample=True,
                temperature=self.temperature,
                top_k=0,
                top_p=1.0,
                use_cache=self.use_cache,
                eos_token_id=self.end_id,
                pad_token_id=self.pad_id,
                suppress_tokens=self.suppressed,
                logits_processor=LogitsProcessorList([recorder]),
                synced_gpus=synced,
            )
        sampled = recorder.finish(out)
        results = []
        for row, logprobs in zip(out[:, width:].tolist(), sampled, strict=True):
            completion = row[: row.index(self.end_id) + 1] if self.end_id in row else row
            results.append((completion, logprobs[: len(completion)].clone()))
        return results

    def _rollout(self, record: dict, prompt: Sample, completion: list[int], finished: bool) -> Rollout:
        ids = torch.cat([prompt.input_ids, torch.tensor(completion, dtype=torch.int64)])
        labels = torch.cat([torch.full_like(prompt.input_ids, IGNORE_INDEX), torch.tensor(completion)])
        sample = Sample(
            input_ids=ids,
            labels=labels,
            position_ids=self.encoder.rope_positions(ids, prompt.image_grid_thw),
            image_grid_thw=prompt.image_grid_thw,
            pixel_values=prompt.pixel_values,
            pixel_norm=prompt.pixel_norm,
            sample_id=prompt.sample_id,
        )
        text_ids = completion[:-1] if finished else completion
        text = self.encoder.template.shown_answer(self.encoder.tokenizer.decode(text_ids, skip_special_tokens=True))
        text = text.strip()
        return Rollout(record=record, completion_ids=completion, text=text, finished=finished, sample=sample)

    @torch.no_grad()
    def score(self, policy: Policy, reference, rollouts: list[Rollout], shard: Shard = ONE_PROCESS) -> None:
        """Fill logprobs, entropy and values (policy) and ref_logprobs (frozen reference) of every rollout; the
        micro-batches are dealt to the ranks of `shard` in lockstep (either model may be ZeRO-3 sharded)."""
        samples = [r.sample for r in rollouts]
        sizes = [s.num_tokens for s in samples]
        groups = plan_micro_batches(sizes, max(self.max_tokens, max(sizes)))
        device = next(policy.parameters()).device

        def outputs(group: list[int]) -> tuple[dict[str, list[torch.Tensor]], list[torch.Tensor]]:
            micro = [samples[i] for i in group]
            batch = to_device(pack(micro), device)
            mine = policy.token_outputs(batch, self.temperature, self.suppressed, chunk_rows=self.chunk_rows)
            ref = token_outputs(
                reference,
                to_device(batch, next(reference.parameters()).device),
                self.temperature,
                self.suppressed,
                chunk_rows=self.chunk_rows,
            )
            return {k: split_by_sample(v.cpu(), micro) for k, v in mine.items()}, split_by_sample(
                ref["logprobs"].cpu(), micro
            )

        for group, (pieces, ref_pieces) in zip(groups, shard.map(groups, outputs, lockstep=True), strict=True):
            for j, i in enumerate(group):
                r = rollouts[i]
                r.logprobs, r.entropy, r.ref_logprobs = pieces["logprobs"][j], pieces["entropy"][j], ref_pieces[j]
                r.values = pieces["values"][j] if "values" in pieces else None
