"""Structured pruning of a Qwen2(.5)-VL teacher into a smaller student of the same family (Minitron-style init).

    importance = measure_importance(teacher, batches)      # hooks on one calibration pass, no gradients
    plan = plan_pruning(teacher, importance, sizes)         # which layers, heads, neurons, channels stay
    student = prune(teacher, plan)                          # a new model of the student config with sliced weights

Ranking (Muralidharan et al. 2024, "Compact Language Models via Pruning and Knowledge Distillation"):
- layers / ViT blocks: block importance 1 - cos(residual in, residual out), the least important are dropped;
- residual channels: mean |output| of every norm that reads the residual stream (LM or ViT), summed;
- attention heads: mean L2 norm of each head's output (the input of o_proj / proj); with GQA whole key/value
  groups are ranked by their query heads, then the best query heads of each kept group stay;
- MLP neurons (LM, ViT, the merger's hidden layer): mean |input of the down projection|.
Head dimensions never change (so RoPE sections stay valid); width pruning removes whole heads. Norm weights are
rescaled by rms(kept channels) / rms(all channels) measured on the calibration pass, so a pruned norm still
produces the teacher's scale on the channels it keeps.

Hand-written: transformers and peft have no structured pruning for these models, and torch.nn.utils.prune
only masks weights (the model stays its original size).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from components._shared.model.attention import enable_vision_varlen
from components._shared.model.attention import register as packed_attention
from components._shared.model.families import family_for
from components._shared.model.packing import forward_logits, to_device
from components._shared.model.vlm import qwen_model, student_config

_LM_LAYER = re.compile(r"(model\.language_model\.layers\.)(\d+)(\..*)")
_VIS_BLOCK = re.compile(r"(model\.visual\.blocks\.)(\d+)(\..*)")


@dataclass
class Importance:
    """Scores gathered on the calibration pass (sums over tokens, divided by token counts)."""

    lm_layers: list[float]
    lm_channels: torch.Tensor
    lm_heads: list[torch.Tensor]  # per layer, (heads,)
    lm_neurons: list[torch.Tensor]  # per layer, (intermediate,)
    vis_blocks: list[float]
    vis_channels: torch.Tensor
    vis_heads: list[torch.Tensor]
    vis_neurons: list[torch.Tensor]
    merger_neurons: torch.Tensor
    norm_mean_square: dict[str, torch.Tensor]  # norm module name -> per-channel mean square of its input


@dataclass
class PrunePlan:
    """What the student keeps, in teacher indices (sorted)."""

    lm_layers: list[int]
    lm_channels: torch.Tensor
    lm_q_heads: dict[int, torch.Tensor]
    lm_kv_heads: dict[int, torch.Tensor]
    lm_neurons: dict[int, torch.Tensor]
    vis_blocks: list[int]
    vis_channels: torch.Tensor
    vis_heads: dict[int, torch.Tensor]
    vis_neurons: dict[int, torch.Tensor]
    merger_neurons: torch.Tensor
    norm_scale: dict[str, float] = field(default_factory=dict)  # teacher norm module name -> weight multiplier
    config: object = None  # the student's model config

    def summary(self) -> dict[str, object]:
        return {
            "lm_layers_kept": self.lm_layers,
            "vision_blocks_kept": self.vis_blocks,
            "lm_channels_kept": int(self.lm_channels.numel()),
            "vision_channels_kept": int(self.vis_channels.numel()),
        }


def _vision_width(config) -> int:
    return family_for(config).vision_width(config.vision_config)


def _first_tensor(value):
    return value[0] if isinstance(value, tuple) else value


@torch.no_grad()
def measure_importance(teacher, batches) -> Importance:
    """Run the packed `batches` through the teacher with hooks that score layers, channels, heads and neurons."""
    qwen = qwen_model(teacher)
    config = qwen.config
    text, lm_layers, blocks = config.text_config, qwen.language_model.layers, qwen.visual.blocks
    lm_head_dim = text.hidden_size // text.num_attention_heads
    vis_heads = config.vision_config.num_heads
    vis_head_dim = _vision_width(config) // vis_heads
    sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
    counts: dict[str, int] = defaultdict(int)

    def add(key: str, value: torch.Tensor, tokens: int) -> None:
        sums[key] = sums[key] + value.detach().float().cpu()
        counts[key] += tokens

    def rows(x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (tokens, d)
        return x.reshape(-1, x.shape[-1]).float()

    hooks = []

    def norm_hook(name: str, channel_key: str):
        def hook(module, args, output):
            x_in, x_out = rows(args[0]), rows(_first_tensor(output))
            add(channel_key, x_out.abs().sum(0), x_out.shape[0])
            add(f"ms:{name}", x_in.pow(2).sum(0), x_in.shape[0])

        return hook

    def head_hook(key: str, head_dim: int):
        def hook(module, args):
            x = rows(args[0])
            add(key, x.view(x.shape[0], -1, head_dim).norm(dim=-1).sum(0), x.shape[0])

        return hook

    def neuron_hook(key: str):
        def hook(module, args):
            x = rows(args[0])
            add(key, x.abs().sum(0), x.shape[0])

        return hook

    def block_hook(key: str):
        def hook(module, args, kwargs, output):
            x_in = rows(args[0] if args else kwargs["hidden_states"])
            x_out = rows(_first_tensor(output))
            cos = torch.nn.functional.cosine_similarity(x_in, x_out, dim=-1)
            add(key, (1.0 - cos).sum(), x_in.shape[0])

        return hook

    for name, module in teacher.named_modules():
        if (
            name.endswith(("input_layernorm", "post_attention_layernorm"))
            and ".language_model.layers." in name
            or name.endswith("language_model.norm")
        ):
            hooks.append(module.register_forward_hook(norm_hook(name, "lm_channels")))
        elif name.endswith((".norm1", ".norm2")) and ".visual.blocks." in name or name.endswith("merger.ln_q"):
            hooks.append(module.register_forward_hook(norm_hook(name, "vis_channels")))
    for i, layer in enumerate(lm_layers):
        hooks.append(layer.register_forward_hook(block_hook(f"lm_layer:{i}"), with_kwargs=True))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(head_hook(f"lm_heads:{i}", lm_head_dim)))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(neuron_hook(f"lm_neurons:{i}")))
    for i, block in enumerate(blocks):
        hooks.append(block.register_forward_hook(block_hook(f"vis_block:{i}"), with_kwargs=True))
        hooks.append(block.attn.proj.register_forward_pre_hook(head_hook(f"vis_heads:{i}", vis_head_dim)))
        down = block.mlp.fc2 if hasattr(block.mlp, "fc2") else block.mlp.down_proj
        hooks.append(down.register_forward_pre_hook(neuron_hook(f"vis_neurons:{i}")))
    hooks.append(qwen.visual.merger.mlp[2].register_forward_pre_hook(neuron_hook("merger_neurons")))
    device = next(teacher.parameters()).device
    try:
        teacher.eval()
        for batch in batches:
            forward_logits(teacher, to_device(batch, device))
    finally:
        for h in hooks:
            h.remove()
    if not counts:
        raise ValueError("the calibration pass saw no tokens; give distill.student.calibration_samples > 0 records.")

    def mean(key: str) -> torch.Tensor:
        return sums[key] / max(counts[key], 1)

    return Importance(
        lm_layers=[float(mean(f"lm_layer:{i}")) for i in range(len(lm_layers))],
        lm_channels=mean("lm_channels"),
        lm_heads=[mean(f"lm_heads:{i}") for i in range(len(lm_layers))],
        lm_neurons=[mean(f"lm_neurons:{i}") for i in range(len(lm_layers))],
        vis_blocks=[float(mean(f"vis_block:{i}")) for i in range(len(blocks))],
        vis_channels=mean("vis_channels"),
        vis_heads=[mean(f"vis_heads:{i}") for i in range(len(blocks))],
        vis_neurons=[mean(f"vis_neurons:{i}") for i in range(len(blocks))],
        merger_neurons=mean("merger_neurons"),
        norm_mean_square={k[3:]: mean(k) for k in sums if k.startswith("ms:")},
    )


def _top(scores: torch.Tensor | list[float], k: int) -> torch.Tensor:
    """Indices of the k largest scores, in ascending index order (ties go to the lower index)."""
    scores = torch.as_tensor(scores, dtype=torch.float64)
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return torch.tensor(sorted(order[:k]), dtype=torch.int64)


def plan_pruning(
    teacher,
    importance: Importance,
    *,
    layers: int = 0,
    hidden: int = 0,
    intermediate: int = 0,
    kv_heads: int = 0,
    vision_depth: int = 0,
    vision_hidden: int = 0,
    vision_intermediate: int = 0,
) -> PrunePlan:
    """Choose what stays; a size of 0 keeps the teacher's. Raises naming the setting when a size cannot be cut."""
    config = qwen_model(teacher).config
    text, vision = config.text_config, config.vision_config
    t_layers, t_hidden, t_heads = text.num_hidden_layers, text.hidden_size, text.num_attention_heads
    t_kv, head_dim = text.num_key_value_heads, text.hidden_size // text.num_attention_heads
    t_depth, t_vwidth, t_vheads = vision.depth, _vision_width(config), vision.num_heads
    v_head_dim = t_vwidth // t_vheads
    family = family_for(config)
    t_vinter = family.vision_intermediate(vision)
    layers, hidden, intermediate = layers or t_layers, hidden or t_hidden, intermediate or text.intermediate_size
    vision_depth, vision_hidden = vision_depth or t_depth, vision_hidden or t_vwidth
    vision_intermediate = vision_intermediate or (
        t_vinter * vision_hidden // t_vwidth if family.vision_mlp_is_ratio else t_vinter
    )
    checks = [
        ("layers", layers, t_layers),
        ("hidden", hidden, t_hidden),
        ("intermediate", intermediate, text.intermediate_size),
        ("vision_depth", vision_depth, t_depth),
        ("vision_hidden", vision_hidden, t_vwidth),
        ("vision_intermediate", vision_intermediate, t_vinter),
    ]
    for name, value, limit in checks:
        if value > limit:
            raise ValueError(f"distill.student.{name}={value} exceeds the teacher's {limit}; pruning only removes.")
    if hidden % head_dim:
        raise ValueError(
            f"distill.student.hidden={hidden} is not a multiple of the teacher's head_dim {head_dim}; "
            "pruning removes whole heads."
        )
    if vision_hidden % v_head_dim:
        raise ValueError(
            f"distill.student.vision_hidden={vision_hidden} is not a multiple of the teacher's ViT "
            f"head_dim {v_head_dim}; pruning removes whole heads."
        )
    heads = hidden // head_dim
    kv_heads = kv_heads or max(1, t_kv * heads // t_heads)
    group, t_group = heads // max(kv_heads, 1), t_heads // t_kv
    if heads % kv_heads or kv_heads > t_kv or group > t_group:
        raise ValueError(
            f"distill.student.kv_heads={kv_heads} does not fit {heads} query heads in the teacher's "
            f"{t_kv} groups of {t_group}; choose kv_heads dividing {heads} with {heads}/kv_heads <= "
            f"{t_group}."
        )
    vheads = vision_hidden // v_head_dim

    lm_layers = _top(importance.lm_layers, layers).tolist()
    vis_blocks = _top(importance.vis_blocks, vision_depth).tolist()
    lm_q, lm_kv, lm_neurons = {}, {}, {}
    for i in lm_layers:
        scores = importance.lm_heads[i].view(t_kv, t_group)
        groups = _top(scores.sum(1), kv_heads)
        lm_kv[i] = groups
        lm_q[i] = torch.cat([g * t_group + _top(scores[g], group) for g in groups.tolist()])
        lm_neurons[i] = _top(importance.lm_neurons[i], intermediate)
    vis_heads = {i: _top(importance.vis_heads[i], vheads) for i in vis_blocks}
    vis_neurons = {i: _top(importance.vis_neurons[i], vision_intermediate) for i in vis_blocks}
    lm_channels = _top(importance.lm_channels, hidden)
    vis_channels = _top(importance.vis_channels, vision_hidden)
    merge_unit = vision.spatial_merge_size**2
    merger_neurons = _top(importance.merger_neurons, vision_hidden * merge_unit)

    norm_scale = {}
    for name, ms in importance.norm_mean_square.items():
        kept = lm_channels if ".language_model." in name else vis_channels
        norm_scale[name] = float(torch.sqrt(ms[kept].mean() / ms.mean().clamp_min(1e-12)))
    full = getattr(vision, "fullatt_block_indexes", None)
    student = student_config(
        config,
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        kv_heads=kv_heads,
        vision_depth=vision_depth,
        vision_hidden=vision_hidden,
        vision_heads=vheads,
        vision_intermediate=vision_intermediate,
        vision_full_attention=None
        if full is None
        else ([j for j, i in enumerate(vis_blocks) if i in full] or [vision_depth - 1]),
    )
    student.text_config.rope_parameters = dict(text.rope_parameters)  # head_dim unchanged: same M-RoPE sections
    return PrunePlan(
        lm_layers,
        lm_channels,
        lm_q,
        lm_kv,
        lm_neurons,
        vis_blocks,
        vis_channels,
        vis_heads,
        vis_neurons,
        merger_neurons,
        norm_scale,
        student,
    )


def _rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    return (heads[:, None] * head_dim + torch.arange(head_dim)[None]).flatten()


def _slices(name: str, plan: PrunePlan, teacher_config) -> tuple[str, list[tuple[int, torch.Tensor]], str]:
    """(teacher parameter name, [(dim, kept indices)], teacher norm module or '') for a student parameter."""
    text, vision = teacher_config.text_config, teacher_config.vision_config
    lm_ch, vis_ch = plan.lm_channels, plan.vis_channels
    if m := _LM_LAYER.match(name):
        layer = plan.lm_layers[int(m.group(2))]
        teacher_name, rest = f"{m.group(1)}{layer}{m.group(3)}", m.group(3)
        head_dim = text.hidden_size // text.num_attention_heads
        q, kv, neurons = (
            _rows(plan.lm_q_heads[layer], head_dim),
            _rows(plan.lm_kv_heads[layer], head_dim),
            plan.lm_neurons[layer],
        )
        if "layernorm" in rest:
            return teacher_name, [(0, lm_ch)], teacher_name.rsplit(".", 1)[0]
        table = {
            ".self_attn.q_proj.weight": [(0, q), (1, lm_ch)],
            ".self_attn.q_proj.bias": [(0, q)],
            ".self_attn.k_proj.weight": [(0, kv), (1, lm_ch)],
            ".self_attn.k_proj.bias": [(0, kv)],
            ".self_attn.v_proj.weight": [(0, kv), (1, lm_ch)],
            ".self_attn.v_proj.bias": [(0, kv)],
            ".self_attn.o_proj.weight": [(0, lm_ch), (1, q)],
            ".mlp.gate_proj.weight": [(0, neurons), (1, lm_ch)],
            ".mlp.up_proj.weight": [(0, neurons), (1, lm_ch)],
            ".mlp.down_proj.weight": [(0, lm_ch), (1, neurons)],
        }
        return teacher_name, table[rest], ""
    if m := _VIS_BLOCK.match(name):
        block = plan.vis_blocks[int(m.group(2))]
        teacher_name, rest = f"{m.group(1)}{block}{m.group(3)}", m.group(3)
        width = _vision_width(teacher_config)
        head_dim = width // vision.num_heads
        heads, neurons = _rows(plan.vis_heads[block], head_dim), plan.vis_neurons[block]
        qkv = torch.cat([part * width + heads for part in range(3)])
        if rest.startswith((".norm1.", ".norm2.")):
            return teacher_name, [(0, vis_ch)], teacher_name.rsplit(".", 1)[0] if rest.endswith("weight") else ""
        table = {
            ".attn.qkv.weight": [(0, qkv), (1, vis_ch)],
            ".attn.qkv.bias": [(0, qkv)],
            ".attn.proj.weight": [(0, vis_ch), (1, heads)],
            ".attn.proj.bias": [(0, vis_ch)],
        }
        for up in ("gate_proj", "up_proj", "fc1"):
            table[f".mlp.{up}.weight"], table[f".mlp.{up}.bias"] = [(0, neurons), (1, vis_ch)], [(0, neurons)]
        for down in ("down_proj", "fc2"):
            table[f".mlp.{down}.weight"], table[f".mlp.{down}.bias"] = [(0, vis_ch), (1, neurons)], [(0, vis_ch)]
        return teacher_name, table[rest], ""
    merge_unit = vision.spatial_merge_size**2
    merger_in = torch.cat([s * _vision_width(teacher_config) + vis_ch for s in range(merge_unit)])
    table = {
        "model.visual.patch_embed.proj.weight": [(0, vis_ch)],
        "model.visual.merger.ln_q.weight": [(0, vis_ch)],
        "model.visual.merger.ln_q.bias": [(0, vis_ch)],
        "model.visual.merger.mlp.0.weight": [(0, plan.merger_neurons), (1, merger_in)],
        "model.visual.merger.mlp.0.bias": [(0, plan.merger_neurons)],
        "model.visual.merger.mlp.2.weight": [(0, lm_ch), (1, plan.merger_neurons)],
        "model.visual.merger.mlp.2.bias": [(0, lm_ch)],
        "model.language_model.embed_tokens.weight": [(1, lm_ch)],
        "model.language_model.norm.weight": [(0, lm_ch)],
        "lm_head.weight": [(1, lm_ch)],
    }
    if name not in table:
        raise ValueError(
            f"pruning does not know the student parameter {name!r}; this model layout is not a "
            "Qwen2-VL / Qwen2.5-VL one the pruner supports (use student.init: random or model)."
        )
    norm = {
        "model.visual.merger.ln_q.weight": "model.visual.merger.ln_q",
        "model.language_model.norm.weight": "model.language_model.norm",
    }.get(name, "")
    return name, table[name], norm


@torch.no_grad()
def prune(teacher, plan: PrunePlan):
    """The student model (plan.config) with every weight sliced from the teacher as the plan says."""
    from transformers import AutoModelForImageTextToText

    student = AutoModelForImageTextToText.from_config(  # fp32, on the CPU; copy_ casts and moves
        plan.config, attn_implementation=packed_attention()
    )
    enable_vision_varlen(student)
    teacher_config = qwen_model(teacher).config
    weights = teacher.state_dict()
    for name, param in student.state_dict().items():
        teacher_name, slices, norm = _slices(name, plan, teacher_config)
        value = weights[teacher_name]
        for dim, index in slices:
            value = value.index_select(dim, index.to(value.device))
        if norm:
            value = value * plan.norm_scale.get(norm, 1.0)
        value = value.to(device=param.device, dtype=param.dtype)
        if value.shape != param.shape:
            raise ValueError(
                f"pruned {teacher_name} to {tuple(value.shape)} but the student's {name} is "
                f"{tuple(param.shape)}; the plan and the student config disagree."
            )
        param.copy_(value)
    student.generation_config = teacher.generation_config
    return student
