"""A curriculum's phases against the difficulty levels the training data has (sft runs it; preflight asks first)."""

from __future__ import annotations


def curriculum_problem(curriculum: list[dict], difficulties: set[str]) -> str | None:
    """Why the curriculum cannot run on data with these difficulties (a phase naming one no record has: a misspelt
    name would otherwise just narrow the phase to the names that do match), else None. sft and preflight ask."""
    known = sorted(difficulties)
    for k, phase in enumerate(curriculum):
        missing = [d for d in phase.get("difficulties") or [] if d not in difficulties]
        if missing:
            return (
                f"sft.curriculum[{k}] (phase '{phase.get('name')}').difficulties: {missing} match no training record; "
                f"the data's difficulties are {known} (records without one are 'all'). Use names from that list, "
                "or leave difficulties empty for every record."
            )
    return None
