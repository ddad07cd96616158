"""One self-contained HTML page per local run: `report.html` beside its run_summary.json.

    python -c "from pathlib import Path; from pipelines.qvl.run_report import write_run_report as w; w(Path('runs/x'))"

Header (preset, status, time, lake, MLflow), the DAG as a row of status boxes, the key metrics against their
baselines (`key_metric_rows`, also the source for the README's results table), the champion with its lineage, and
one section per stage with its report.md rendered (figures inline; clean_data adds sample thumbnails per rejection
reason). Nothing is fetched: CSS, figures and thumbnails are inline, every string read from a file is escaped, and
a stage whose files are missing reads "not run" instead of failing the page.
"""

from __future__ import annotations

import base64
import html
import math
import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from components.stages import DAG_ORDER, OPTIONAL
from pipelines.qvl.rejected_samples import rejected_samples, thumbnail
from pipelines.qvl.runs import HEADLINES, SHORT, labelled_headline, read_run

REPORT_FILE = "report.html"
STAGE_ORDER = ("preflight", *DAG_ORDER)
# stage -> [(metric, baseline: a metric key or a constant, label, higher is better; None: no direction)]
BASELINES: dict[str, list[tuple[str, str | float, str, bool | None]]] = {
    "clean_data": [("records_kept", "records_in", "records in", None)],
    "pretrain": [
        ("retrieval_r1", "retrieval_chance", "chance", True),
        ("heldout_caption_loss_final", "heldout_caption_loss_initial", "before training", False),
    ],
    "sft_data": [("kept", "candidates", "candidates", None)],
    "sft": [("vqa_exact_match", "vqa_majority_baseline", "majority answer", True)],
    "reward_model": [("pair_accuracy", 0.5, "chance", True)],
    "rl": [("efficacy_gain", 0.0, "no change", True)],
    "distill": [("student_score_ratio", 1.0, "teacher", True)],
}
# stage -> [(metric, label)] shown beside its first row
NOTES: dict[str, list[tuple[str, str]]] = {
    "clean_data": [("records_rejected", "rejected"), ("kept_fraction", "kept fraction")],
    "extract_features": [("visual_tokens_total", "visual tokens"), ("images_per_second", "images/s")],
    "pretrain": [("retrieval_r1_initial", "R@1 before training")],
    "sft_data": [("lake_records", "lake records"), ("counterfactual_share", "counterfactual share")],
    "sft": [("vqa_exact_match_initial", "before training"), ("train_loss_final", "train loss")],
    "reward_model": [("pair_accuracy_initial", "before training"), ("heldout_pairs", "pairs")],
    "rl": [("efficacy_before", "efficacy before"), ("efficacy_after", "after")],
    "distill": [("student_vqa_exact_match", "student VQA"), ("teacher_vqa_exact_match", "teacher VQA")]
    + [("student_param_ratio", "size ratio"), ("student_speedup", "speedup")],
    "select_checkpoint": [("selected_score", "score"), ("runner_up", "runner-up"), ("registered_model", "model")],
    "promote": [("promoted_files", "files"), ("registered", "registered")],
}
MAIN_LINE = ("clean_data", "extract_features", "pretrain", "sft", "rl", "distill")  # the champion's ancestry
SIDE_INPUTS = {"rl": "reward_model"}
MAX_IMAGE_BYTES, FOLD_LINES = 20 << 20, 25  # figures inlined up to; `##` sections folded beyond (lines)

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1240px;padding:12px 20px;color:#1d232b}
h1{font-size:22px;margin:4px 0}h2{font-size:18px;margin:18px 0 6px;border-bottom:1px solid #d8dde3}
h3{font-size:16px}h4{font-size:14px}h3,h4,h5{margin:10px 0 4px}
table{border-collapse:collapse;margin:6px 0;display:block;overflow-x:auto;max-width:100%;font-size:13px}
.md table{display:inline-block;vertical-align:top;margin-right:14px}
th,td{border:1px solid #d8dde3;padding:2px 8px;text-align:left;vertical-align:top}th{background:#f1f3f6}
td.n{text-align:right;font-variant-numeric:tabular-nums}
code,pre,.path{font:12px ui-monospace,monospace}.path{color:#4a5561;word-break:break-all}
pre{background:#f6f8fa;padding:6px;max-height:14em;overflow:auto}pre.error{background:#fdecec;color:#8b1a1a}
.head{display:grid;grid-template-columns:max-content 1fr;gap:1px 14px;margin:6px 0}.head dt{color:#56606b}
.head dd{margin:0}.muted{color:#6b7682}.good{color:#17803d}.bad{color:#b42318}
.dag,.lineage{display:flex;align-items:stretch;gap:3px;margin:8px 0}.arrow{color:#8a949e;align-self:center}
.box{display:block;flex:1 1 0;min-width:0;border:2px solid;border-radius:6px;padding:3px 6px;font-size:12px;
text-decoration:none;color:inherit}.box b{font-size:12.5px}.lineage .box{max-width:260px}
.succeeded{border-color:#2e9e57;background:#e9f7ee}.cached{border-color:#3a78c2;background:#e8f0fa}
.failed{border-color:#c93a3a;background:#fdecec}.not-run{border-color:#b4bcc4;background:#f3f4f6;color:#6b7682}
.badge{border:1px solid;border-radius:4px;padding:0 6px;font-size:12px;font-weight:normal}
.md img{max-width:min(380px,100%)}.md p:has(>img:only-child){display:inline-block;margin:2px 8px 2px 0}
img.thumb{max-width:96px;max-height:96px;margin:0 4px;border:1px solid #d8dde3;vertical-align:middle;
background:repeating-conic-gradient(#eee 0 25%,#fff 0 50%) 0 0/12px 12px}
.nothumb{display:inline-block;font-size:11px;color:#6b7682;border:1px dashed #b4bcc4;padding:2px 4px;margin:0 4px}
details{margin:4px 0}summary{cursor:pointer;color:#3a4652}
"""
SCRIPT = """
window.addEventListener('error', function (e) {
  var t = e.target, b = document.body || document.documentElement;
  var what = t && t !== window && (t.src || t.href) ? 'failed to load ' + String(t.src || t.href).slice(0, 80)
                                                    : String(e.message || 'error');
  b.dataset.errors = (b.dataset.errors ? b.dataset.errors + ' | ' : '') + what;
}, true);
window.addEventListener('load', function () { document.body.dataset.rendered = 'ok'; });
"""


def write_run_report(run_dir: Path) -> Path:
    """Write run_dir/report.html from run_dir/run_summary.json and the stages' outputs; returns its path."""
    run = read_run(run_dir)
    path = run.path / REPORT_FILE
    path.write_text(render_run_report(run.path, run.summary), encoding="utf-8")
    return path


def render_run_report(run_dir: Path, summary: dict[str, Any]) -> str:
    """The whole page as one HTML string."""
    body = [
        _header(run_dir, summary),
        "<h2>DAG</h2>",
        _dag(summary.get("stages") or {}),
        "<h2>Key metrics vs baseline</h2>",
        _metrics_table(key_metric_rows(summary)),
        _champion(run_dir, summary),
        *(_stage_section(run_dir, summary, stage) for stage in STAGE_ORDER),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>qvl run {_esc(run_dir.name)}</title><style>{CSS}</style></head>\n"
        f"<body><script>{SCRIPT}</script>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def key_metric_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Per DAG stage its headline metric(s) against their baseline, one dict per row.

    Keys: stage, status, metric, value, baseline_name (the metric key, or the label of a constant such as
    chance), baseline_label, baseline, delta (value - baseline), better (None without baseline or direction),
    interval ((low, high) from `<metric>_ci_low/_ci_high`, else None), notes ({label: value}). A stage that did
    not run or failed has one row with value None.
    """
    rows = []
    for stage in DAG_ORDER:
        if stage in OPTIONAL and stage not in (summary.get("stages") or {}):
            continue  # not in this run's DAG
        entry = (summary.get("stages") or {}).get(stage) or {}
        metrics = entry.get("metrics") or {}
        notes = {label: metrics[key] for key, label in NOTES.get(stage, []) if metrics.get(key) not in (None, "")}
        specs = [s for s in BASELINES.get(stage, []) if _number(metrics.get(s[0])) is not None]
        if not specs:  # no baseline known (or the stage has no metrics): the headline alone
            key = next((k for k in HEADLINES.get(stage, ()) if metrics.get(k) is not None), HEADLINES[stage][0])
            specs = [(key, math.nan, "", None)]
        for i, (metric, base, label, higher) in enumerate(specs):
            value, number = metrics.get(metric), _number(metrics.get(metric))
            baseline = _number(metrics.get(base) if isinstance(base, str) else base)
            delta = number - baseline if number is not None and baseline is not None else None
            low, high = (_number(metrics.get(f"{metric}_ci_{end}")) for end in ("low", "high"))
            rows.append(
                {
                    "stage": stage,
                    "status": _status(entry),
                    "metric": metric,
                    "value": value,
                    "baseline_name": (base if isinstance(base, str) else label) if baseline is not None else None,
                    "baseline_label": label if baseline is not None else None,
                    "baseline": baseline,
                    "delta": delta,
                    "better": None if not delta or higher is None else (delta > 0) == higher,
                    "interval": (low, high) if low is not None and high is not None else None,
                    "notes": notes if i == 0 else {},
                }
            )
    return rows


def _metrics_table(rows: list[dict[str, Any]]) -> str:
    out = ["<table><tr><th>stage</th><th>metric</th><th>value</th><th>baseline</th><th>&Delta;</th><th>notes</th>"]
    for r in rows:
        value = _fmt(r["value"]) if r["status"] in ("succeeded", "cached") else _esc(r["status"])
        if r["interval"]:
            value += f' <span class="muted">[95% CI {_fmt(r["interval"][0])}, {_fmt(r["interval"][1])}]</span>'
        base = (
            f'{_fmt(r["baseline"])} <span class="muted" title="{_esc(r["baseline_name"])}">'
            f"({_esc(r['baseline_label'])})</span>"
            if r["baseline_name"]
            else ""
        )
        tone = {True: "good", False: "bad", None: "muted"}[r["better"]]
        delta = f'<span class="{tone}">{r["delta"]:+.4g}</span>' if r["delta"] is not None else ""
        notes = ", ".join(f"{_esc(k)} {_fmt(v)}" for k, v in r["notes"].items())
        out.append(
            f'<tr><td><a href="#stage-{r["stage"]}">{r["stage"]}</a></td><td><code>{_esc(r["metric"])}</code></td>'
            f'<td class="n">{value}</td><td class="n">{base}</td><td class="n">{delta}</td><td>{notes}</td></tr>'
        )
    return "".join(out) + "</table>"


def _header(run_dir: Path, summary: dict[str, Any]) -> str:
    status = str(summary.get("status", "unknown"))
    items = [
        ("preset", _esc(summary.get("preset", "?"))),
        ("status", f'<span class="badge {_css(status)}">{_esc(status)}</span>'),
        ("total time", _duration(summary.get("seconds"))),
        ("lake", f'<span class="path">{_esc(summary.get("lake_uri") or "-")}</span>'),
        ("data", f'<span class="path">{_esc(summary.get("data_uri") or "-")}</span>'),
        ("MLflow", f'<span class="path">{_esc(summary.get("mlflow_tracking_uri") or "-")}</span>'),
        ("parent run", f"<code>{_esc(summary.get('mlflow_run_id') or '-')}</code>"),
        ("run dir", f'<span class="path">{_esc(run_dir)}</span>'),
    ]
    rows = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items)
    return f"<h1>qvl run: {_esc(run_dir.name)}</h1><dl class='head'>{rows}</dl>"


def _dag(stages: dict[str, Any]) -> str:
    boxes = []
    for stage in STAGE_ORDER:
        entry = stages.get(stage) or {}
        status = _status(entry)
        shown = labelled_headline(stage, entry.get("metrics")) if stage in SHORT and status != "failed" else ""
        metric = f"<br>{_esc(shown)}" if shown else ""
        boxes.append(
            f'<a class="box {_css(status)}" href="#stage-{stage}"><b>{stage.replace("_", "_<wbr>")}</b>'
            f"<br>{_esc(status)}<br>{_duration(entry.get('seconds'))}{metric}</a>"
        )
    return '<div class="dag">' + '<span class="arrow">&rarr;</span>'.join(boxes) + "</div>"


def _champion(run_dir: Path, summary: dict[str, Any]) -> str:
    """The selected model: its stage, score, where it is registered, the runner-up, and its lineage."""
    entry = (summary.get("stages") or {}).get("select_checkpoint") or {}
    m, output = entry.get("metrics") or {}, _output_dir(entry)
    if _status(entry) not in ("succeeded", "cached") or not m.get("selected_stage"):
        return f"<h2 id='champion'>Champion</h2><p class='muted'>none: select_checkpoint {_esc(_status(entry))}.</p>"
    registered = (
        f"registered as <code>{_esc(m.get('registered_model'))}</code> version {_esc(m['registered_version'])} "
        f"(alias <code>champion</code>) in <span class='path'>{_esc(summary.get('mlflow_tracking_uri'))}</span>"
        if m.get("registered_version")
        else "not registered"
    )
    runner = f"; runner-up <code>{_esc(m['runner_up'])}</code>" if m.get("runner_up") else ""
    if runner and m.get("challenger_version"):
        runner += f" (alias <code>challenger</code>, version {_esc(m['challenger_version'])})"
    counts = ", ".join(
        f"{_fmt(m[k])} {k.split('_')[1]}" for k in ("candidates_evaluated", "candidates_skipped") if k in m
    )
    card = output / "model_card.md" if output and (output / "model_card.md").is_file() else None
    return (
        f"<h2 id='champion'>Champion</h2><p><b>{_esc(m.get('selected_candidate', m['selected_stage']))}</b> from "
        f"stage <b>{_esc(m['selected_stage'])}</b>, score {_fmt(m.get('selected_score'))}, {registered}{runner}. "
        f"Candidates: {counts or '-'}."
        + (f" Model card: <span class='path'>{_esc(_rel(card, run_dir))}</span>" if card else "")
        + "</p>"
        + _lineage(summary, str(m["selected_stage"]))
    )


def _lineage(summary: dict[str, Any], champion: str) -> str:
    """lake -> clean_data -> ... -> the champion's stage -> select_checkpoint -> registry, with artifact paths."""
    stages = summary.get("stages") or {}
    line = MAIN_LINE[: MAIN_LINE.index(champion) + 1] if champion in MAIN_LINE else MAIN_LINE
    nodes = [("lake", str(summary.get("lake_uri") or "-"), "succeeded")]
    for stage in (*line, "select_checkpoint"):
        entry = stages.get(stage) or {}
        artifacts = entry.get("artifacts") or {}
        path = next((v for k, v in artifacts.items() if k not in ("output", "report")), artifacts.get("output", "-"))
        side = f" (+ {SIDE_INPUTS[stage]})" if stage in SIDE_INPUTS else ""
        nodes.append((stage + side, str(path), _status(entry)))
    paths = [p for _, p, _ in nodes[1:] if os.path.isabs(p)]
    root = os.path.commonpath(paths) if len(paths) > 1 else ""
    m = (stages.get("select_checkpoint") or {}).get("metrics") or {}
    if m.get("registered_version"):
        nodes.append(("registry", f"models:/{m.get('registered_model')}@champion (v{m['registered_version']})", ""))
    boxes = [
        f'<div class="box {_css(s)}"><b>{_esc(n).replace("_", "_<wbr>")}</b><br><span class="path" title="{_esc(p)}">'
        f"{_esc(os.path.relpath(p, root) if root and p.startswith(root + os.sep) else p)}</span></div>"
        for n, p, s in nodes
    ]
    under = f"<p class='muted'>stage artifacts under <span class='path'>{_esc(root)}</span></p>" if root else ""
    return (
        "<h3>Lineage</h3>"
        + under
        + '<div class="lineage">'
        + '<span class="arrow">&rarr;</span>'.join(boxes)
        + "</div>"
    )


def _stage_section(run_dir: Path, summary: dict[str, Any], stage: str) -> str:
    entry = (summary.get("stages") or {}).get(stage) or {}
    status, output = _status(entry), _output_dir(entry)
    head = (
        f'<section id="stage-{stage}"><h2>{stage} <span class="badge {_css(status)}">{_esc(status)}</span> '
        f'<span class="muted">{_duration(entry.get("seconds"))}</span></h2>'
    )
    if status == "not run":
        return head + "<p class='muted'>not run: this stage has no result in the run summary.</p></section>"
    parts = [head, f"<pre class='error'>{_esc(entry['error'])}</pre>" if entry.get("error") else ""]
    report = output / "report.md" if output and (output / "report.md").is_file() else None
    if report:
        parts.append(f"<div class='md'>{render_markdown(report.read_text(errors='replace'), report.parent)}</div>")
    elif status != "failed":
        parts.append("<p class='muted'>no report.md in this stage's output.</p>")
    if stage == "clean_data" and output:
        parts.append(_rejections(output, entry.get("metrics") or {}, str(summary.get("lake_uri") or "")))
    flat = _flatten(entry.get("metrics") or {})
    rows = "".join(f"<tr><td><code>{_esc(k)}</code></td><td class='n'>{_fmt(v)}</td></tr>" for k, v in flat.items())
    if flat:
        parts.append(f"<details{'' if report else ' open'}><summary>all metrics ({len(flat)})</summary>")
        parts.append(f"<table>{rows}</table></details>")
    if output:
        parts.append(f"<p class='muted'>output: <span class='path'>{_esc(_rel(output, run_dir))}</span></p>")
    return "".join(parts) + "</section>"


def render_markdown(text: str, base_dir: Path) -> str:
    """Markdown as HTML: raw HTML escaped, headings two levels down, images inlined as data URIs (files under
    `base_dir` only), other images and external links dropped, long figure-less `##` sections folded."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = md.parse(text)
    starts = [i for i, t in enumerate(tokens) if t.type == "heading_open" and t.tag in ("h1", "h2")]
    bounds = list(zip([0, *starts], [*starts, len(tokens)], strict=True))
    line_of = [t.map[0] if t.map else 0 for t in tokens] + [text.count("\n") + 1]
    folded = {
        a
        for a, b in bounds
        if tokens[a].tag == "h2"
        and line_of[b] - line_of[a] > FOLD_LINES
        and not any(c.type == "image" for t in tokens[a:b] for c in t.children or [])
    }
    for token in tokens:
        _sanitize(token, base_dir)
    out = []
    for a, b in bounds:
        if a in folded:
            body = md.renderer.render(tokens[a + 3 : b], md.options, {})
            out.append(f"<details><summary>{_esc(tokens[a + 1].content)}</summary>{body}</details>")
        else:
            out.append(md.renderer.render(tokens[a:b], md.options, {}))
    return "".join(out)


def _sanitize(token: Any, base_dir: Path) -> None:
    if token.type in ("heading_open", "heading_close"):
        token.tag = f"h{min(6, int(token.tag[1]) + 2)}"
    for child in token.children or []:
        if child.type == "image":
            src = _inline_image(str(child.attrGet("src") or ""), base_dir)
            if src:
                child.attrSet("src", src)
            else:
                child.type, child.tag, child.attrs, child.children = "text", "", {}, None
                child.content = f"[figure not embedded: {child.content}]"
        elif child.type == "link_open" and not str(child.attrGet("href") or "").startswith("#"):
            child.attrs.pop("href", None)


def _inline_image(src: str, base_dir: Path) -> str | None:
    if src.startswith("data:image/"):
        return src
    if ":" in src.split("/")[0] or src.startswith("/"):
        return None  # a scheme (http:, file:, ...) or an absolute path: never fetched
    path = (base_dir / unquote(src)).resolve()
    kind = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".gif": "gif", ".webp": "webp"}.get(path.suffix.lower())
    if not kind or not path.is_relative_to(base_dir.resolve()) or not path.is_file():
        return None
    if path.stat().st_size > MAX_IMAGE_BYTES:
        return None
    return f"data:image/{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"


def _rejections(output: Path, metrics: dict[str, Any], lake_uri: str) -> str:
    """Rejected records per reason (counts) with a few sample images each."""
    samples, note = rejected_samples(output, lake_uri)
    counts = {r: n for r, n in (metrics.get("rejected_by_reason") or {}).items() if n}
    for reason, picked in samples.items():
        counts.setdefault(reason, len(picked))
    out = ["<h3>Rejected records per reason</h3>", f"<p class='muted'>{_esc(note)}</p>" if note else ""]
    out.append("<table class='rejections'><tr><th>reason</th><th>records</th><th>samples</th></tr>")
    for reason, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        cells = []
        for key, detail, data in samples.get(reason, []):
            title, thumb = _esc(f"{key}: {detail}"), thumbnail(data)
            missing = "no image" if not data else "does not decode"
            cells.append(
                f'<img class="thumb" src="{thumb}" alt="{_esc(key)}" title="{title}">'
                if thumb
                else f'<span class="nothumb" title="{title}">{missing}</span>'
            )
        out.append(f"<tr><td>{_esc(reason)}</td><td class='n'>{_fmt(count)}</td><td>{''.join(cells)}</td></tr>")
    return "".join(out) + "</table>"


def _status(entry: dict[str, Any]) -> str:
    return str(entry.get("status") or "not run") if entry else "not run"


def _css(status: str) -> str:
    return status if status in ("succeeded", "cached", "failed") else "not-run"


def _output_dir(entry: dict[str, Any]) -> Path | None:
    output = (entry.get("artifacts") or {}).get("output")
    return Path(output) if output and Path(output).is_dir() else None


def _rel(path: Path, run_dir: Path) -> str:
    return str(path.relative_to(run_dir)) if path.is_relative_to(run_dir) else str(path)


def _flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        flat.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else _esc(value)
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) >= 1000):
        return f"{int(value):,}"
    return f"{value:.4g}"


def _duration(seconds: Any) -> str:
    if _number(seconds) is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 60 else f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)
