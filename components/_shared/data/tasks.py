"""Tasks: every held-out or RL record names one, and its task names the scorer that judges an answer.

A task is a name and a scorer from SCORERS (the one table: a new scorer is one function in data/scorers.py and one
entry here). The synthetic world's eight question types are BUILTIN_TASKS (their metrics keep their names:
`exact_match/<type>`, `vqa_exact_match`, `grounding_accuracy`, `anls`, `cider_d`); any other task is declared in the
data directory's dataset.yaml (`tasks: {name: scorer}`), named per file there, or is a scorer's own name.

`summarize(rows)` turns scored rows into the flat metric dict every stage logs: per task, and per benchmark
(`benchmark/<name>` = the mean record score of that benchmark, with its reports, e.g. `benchmark/pope/f1`).
Pure Python (no torch).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from components._shared.data import metrics as M
from components._shared.data import scorers as S

Rows = Sequence[Mapping[str, Any]]


def _cider_report(rows: Rows) -> dict[str, float]:
    """CIDEr-D over a task's caption rows, one candidate per (benchmark, id): ids repeat across benchmarks."""
    keys = [(r.get("benchmark"), r["id"]) for r in rows]
    if len(set(keys)) != len(rows):
        raise ValueError("caption records have duplicate ids; CIDEr-D needs one candidate per benchmark and id")
    candidates = {key: r["prediction"] for key, r in zip(keys, rows, strict=True)}
    return {"cider_d": M.cider_d(candidates, {key: S.answers_of(r) for key, r in zip(keys, rows, strict=True)})[0]}


def _anls_report(rows: Rows) -> dict[str, float]:
    return {"anls": sum(S.anls(r["prediction"], r) for r in rows) / len(rows)}


@dataclass(frozen=True)
class Scorer:
    """`score(prediction, record)` in [0, 1]; `reward` the RL efficacy where it gives partial credit (grounding:
    the IoU itself); `parses` the format check of RL's format reward; `report` corpus metrics over a task's rows."""

    score: Callable[[str, Mapping[str, Any]], float]
    reward: Callable[[str, Mapping[str, Any]], float] | None = None
    parses: Callable[[str, Mapping[str, Any]], bool] | None = None
    report: Callable[[Rows], dict[str, float]] | None = None
    baseline: bool = True  # a majority-answer baseline is meaningful (not for boxes or captions)
    check: Callable[[Mapping[str, Any]], object] | None = None  # ValueError for a record no prediction can score on


SCORERS: dict[str, Scorer] = {
    "exact_match": Scorer(S.exact_match),
    "vqa_accuracy": Scorer(S.vqa_accuracy),  # VQAv2, TextVQA
    "anls": Scorer(S.anls),  # DocVQA, InfographicVQA
    "relaxed_accuracy": Scorer(S.relaxed_accuracy),  # ChartQA
    "multiple_choice": Scorer(
        S.multiple_choice, parses=lambda p, r: S.parse_choice(p, r["choices"]) is not None, check=S.choice_golds
    ),
    "yes_no": Scorer(S.yes_no_accuracy, report=S.yes_no_report, check=S.yes_no_golds),  # POPE
    "grounding": Scorer(  # RefCOCO / RefCOCO+ / RefCOCOg: accuracy at IoU 0.5
        S.grounding,
        reward=S.grounding_iou,
        parses=lambda p, r: S.parse_predicted_box(p) is not None,
        baseline=False,
        check=S.grounding_gold,
    ),
    "cider_d": Scorer(S.caption_overlap, report=_cider_report, baseline=False),  # COCO / NoCaps captions
}


@dataclass(frozen=True)
class Task:
    name: str
    scorer: str
    reports: tuple[Callable[[Rows], dict[str, float]], ...] = ()

    @property
    def builtin(self) -> bool:
        return BUILTIN_TASKS.get(self.name) is self


# The synthetic world's question types (components/synth_world), scored as before tasks existed.
BUILTIN_TASKS: dict[str, Task] = {
    "caption": Task("caption", "exact_match", (_cider_report,)),
    "color": Task("color", "exact_match"),
    "count": Task("count", "exact_match"),
    "shape": Task("shape", "exact_match"),
    "position": Task("position", "exact_match"),
    "relation": Task("relation", "exact_match"),
    "grounding": Task("grounding", "grounding"),
    "ocr": Task("ocr", "exact_match", (_anls_report,)),
}
SYNTHETIC_TASKS = tuple(BUILTIN_TASKS)


def resolve(name: str, declared: Mapping[str, str] | None = None, *, where: str = "record") -> Task:
    """The task called `name`: a builtin, one `declared` (name -> scorer), or a scorer's own name."""
    prefix = f"{where}: " if where else ""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{prefix}the task must be a non-empty name, got {name!r}.")
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    scorer = (declared or {}).get(name, name if name in SCORERS else None)
    if scorer is None:
        raise ValueError(
            f"{prefix}unknown task {name!r}. Declare it in the data directory's dataset.yaml "
            f"(tasks: {{{name}: SCORER}}) with a scorer from {sorted(SCORERS)}, or use a builtin task "
            f"({', '.join(SYNTHETIC_TASKS)})."
        )
    if scorer not in SCORERS:
        raise ValueError(f"{prefix}task {name!r} names unknown scorer {scorer!r}; choose from {sorted(SCORERS)}.")
    report = SCORERS[scorer].report
    return Task(name, scorer, (report,) if report else ())


def task_of(record: Mapping[str, Any]) -> Task:
    """The task of a record (or scored row): its "type", with the "scorer" the reader resolved for it."""
    name, scorer = str(record.get("type") or ""), record.get("scorer")
    if scorer is not None and name not in BUILTIN_TASKS:
        return resolve(name, {name: scorer}, where=f"record {record.get('id')!r}")
    return resolve(name, where=f"record {record.get('id')!r}")


def score(prediction: str, record: Mapping[str, Any]) -> float:
    """The record's task score of `prediction` in [0, 1]."""
    return SCORERS[task_of(record).scorer].score(prediction, record)


def reward(prediction: str, record: Mapping[str, Any]) -> float:
    """The RL efficacy of `prediction` under the record's task (partial credit where its scorer gives one)."""
    scorer = SCORERS[task_of(record).scorer]
    return (scorer.reward or scorer.score)(prediction, record)


def parses(prediction: str, record: Mapping[str, Any]) -> bool:
    """Whether `prediction` has the form the record's task reads (a box, an option letter); True without a check."""
    check = SCORERS[task_of(record).scorer].parses
    return True if check is None else bool(check(prediction, record))


PER_DATA = ("task/", "benchmark/")  # the prefixes of the metrics of a data set's own tasks and benchmarks


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def summarize(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Flat metrics over scored rows {"id", "type", "prediction", "answer"|"answers", optional "score", "scorer",
    "benchmark"}; keys appear only for what the rows hold.

    Builtin tasks: `exact_match/<type>`, `count/<type>`, `vqa_exact_match` (all non-caption builtin rows),
    `cider_d` (caption rows). Every task: `grounding_accuracy` (rows scored by grounding), `anls` (ocr rows and rows
    scored by ANLS). Other tasks: `task/<name>` (mean score),
    `count/<name>` and their reports as `task/<name>/<metric>`. Rows with a "benchmark": `benchmark/<name>` (mean
    score), `benchmark/<name>/count` and the reports of its tasks as `benchmark/<name>/<metric>`.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("summarize needs at least one record, got none")
    by_task: dict[str, list[int]] = defaultdict(list)  # task -> row indices
    scored: list[float] = []
    tasks: dict[str, Task] = {}
    for i, row in enumerate(rows):
        missing = [k for k in ("id", "type", "prediction") if k not in row]
        if missing or ("answer" not in row and "answers" not in row):
            raise ValueError(f"record {row!r} lacks keys {missing or ['answer']}")
        if row["type"] not in tasks:
            tasks[row["type"]] = task_of(row)
        by_task[row["type"]].append(i)
        scored.append(float(row["score"]) if "score" in row else score(row["prediction"], row))
    out: dict[str, float] = {}
    vqa: list[float] = []
    order = [t for t in SYNTHETIC_TASKS if t in by_task] + sorted(t for t in by_task if t not in BUILTIN_TASKS)
    for name in order:
        task, task_rows = tasks[name], [rows[i] for i in by_task[name]]
        values = [scored[i] for i in by_task[name]]
        if task.builtin:
            out[f"exact_match/{name}"] = _mean(values)
            if name != "caption":
                vqa.extend(values)
            for report in task.reports:
                out.update(report(task_rows))
        else:
            out[f"task/{name}"] = _mean(values)
            for report in task.reports:
                out.update({f"task/{name}/{k}": v for k, v in report(task_rows).items()})
        out[f"count/{name}"] = float(len(task_rows))
    if vqa:
        out["vqa_exact_match"] = _mean(vqa)
    # the suite's grounding accuracy and ANLS over every task scored that way (RefCOCO, DocVQA as much as the
    # synthetic world's boxes and words), so one gate (grounding_accuracy >= 0.68, anls >= 0.45) holds on any data
    boxes = [scored[i] for i, row in enumerate(rows) if tasks[row["type"]].scorer == "grounding"]
    if boxes:
        out["grounding_accuracy"] = _mean(boxes)
    texts = [row for row in rows if row["type"] == "ocr" or tasks[row["type"]].scorer == "anls"]
    if texts:
        out.update(_anls_report(texts))
    out.update(_benchmarks(rows, scored, tasks))
    return out


def _benchmarks(rows: list, scored: list[float], tasks: dict[str, Task]) -> dict[str, float]:
    out: dict[str, float] = {}
    by_benchmark: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        if row.get("benchmark"):
            by_benchmark[row["benchmark"]].append(i)
    for name, members in sorted(by_benchmark.items()):
        out[f"benchmark/{name}"] = _mean([scored[i] for i in members])
        out[f"benchmark/{name}/count"] = float(len(members))
        per_task: dict[str, list] = defaultdict(list)
        for i in members:
            per_task[rows[i]["type"]].append(rows[i])
        for task_name, task_rows in per_task.items():
            for report in tasks[task_name].reports:
                out.update({f"benchmark/{name}/{k}": v for k, v in report(task_rows).items()})
    return out


def majority_baseline(train_answers: Mapping[str, Sequence[str]], eval_rows: Iterable[Mapping[str, Any]]) -> dict:
    """Score "always answer the task's most frequent training answer" on the eval rows.

    `majority/<task>` for the builtin tasks and every task whose scorer reads short answers (not boxes or captions),
    and `vqa_majority_baseline` over the builtin non-caption rows (as `vqa_exact_match`).
    """
    guesses = {name: M.majority_answer(answers) for name, answers in train_answers.items()}
    by_task: dict[str, list[float]] = defaultdict(list)
    for row in eval_rows:
        if "type" not in row or ("answer" not in row and "answers" not in row):
            raise ValueError(f"eval record {row!r} needs 'type' and 'answer'")
        task = task_of(row)
        if not task.builtin and not SCORERS[task.scorer].baseline:
            continue
        by_task[task.name].append(SCORERS[task.scorer].score(guesses.get(task.name, ""), row))
    out = {f"majority/{t}": _mean(v) for t, v in by_task.items()}
    vqa = [s for t, scores in by_task.items() if t in BUILTIN_TASKS and t != "caption" for s in scores]
    if vqa:
        out["vqa_majority_baseline"] = _mean(vqa)
    return out
