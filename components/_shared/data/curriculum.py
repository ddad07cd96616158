"""A curriculum's phases against the difficulty levels the training data has (sft runs it; preflight asks first)."""

from __future__ import annotations

from collections.abc import Mapping


def curriculum_problem(curriculum: list[dict], difficulties: Mapping[str, int]) -> str | None:
    """Why the curriculum cannot run on data with these difficulties ({name: records}): a phase naming one no record
    has (a misspelt name would otherwise just narrow the phase to the names that do match), or records no phase
    trains on (`Basic`, `expert`, none: never trained, never counted), else None. sft and preflight ask."""
    known = sorted(difficulties)
    for k, phase in enumerate(curriculum):
        missing = [d for d in phase.get("difficulties") or [] if d not in difficulties]
        if missing:
            return (
                f"sft.curriculum[{k}] (phase '{phase.get('name')}').difficulties: {missing} match no training record; "
                f"the data's difficulties are {known} (records without one are 'all'). Use names from that list, "
                "or leave difficulties empty for every record."
            )
    if curriculum and all(phase.get("difficulties") for phase in curriculum):  # else a phase takes every record
        trained = {d for phase in curriculum for d in phase["difficulties"]}
        left = {d: n for d, n in sorted(difficulties.items()) if d not in trained}
        if left:
            return (
                f"{sum(left.values())} training record(s) have a difficulty no sft.curriculum phase trains on "
                f"({left}; records without one are 'all'): add those names to a phase's difficulties, or add a "
                "phase with empty difficulties (every record)."
            )
    return None
