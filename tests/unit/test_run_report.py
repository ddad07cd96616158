"""report.html of a local run (pipelines/qvl/run_report.py): sections, key metrics vs baseline, thumbnails of rejected
records, escaping, no external URL, and the page rendered in real headless Chromium."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
from html.parser import HTMLParser
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipelines.qvl.rejected_samples import thumbnail
from pipelines.qvl.run_report import STAGE_ORDER, key_metric_rows, render_markdown, write_run_report

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
HOSTILE = "<script>alert('pwned')</script>"


def _image(color: str, size: tuple[int, int] = (40, 30), fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, fmt)
    return buffer.getvalue()


def _stage(run: Path, name: str, status: str, metrics: dict, report: str | None = None, **extra) -> dict:
    output = run / "pipeline_root" / f"{name}-op" / "output"
    output.mkdir(parents=True)
    if report is not None:
        (output / "report.md").write_text(report)
    (output / "_stage_result.json").write_text(json.dumps({"stage": name, "status": status, "metrics": metrics}))
    return {"status": status, "metrics": metrics, "artifacts": {"output": str(output)}, "seconds": 12.5, **extra}


def _rejected(run: Path, clean_dir: Path, *, image_column: bool) -> Path:
    """rejected/part-00000.parquet with 2 reasons (4 too_small, 2 low_clip_score) and a lake tar holding the images
    (or, with image_column, the images in the parquet itself)."""
    rows = [("000000001", "too_small", "red"), ("000000002", "too_small", "green"), ("000000003", "too_small", "blue")]
    rows += [("000000004", "too_small", "white"), ("000000007", "low_clip_score", "purple")]
    rows += [("000000009", "low_clip_score", "orange")]
    lake = run.parent / "lake"
    lake.mkdir()
    with tarfile.open(lake / "00000.tar", "w") as tar:
        for key, _, color in rows:
            for suffix, data in ((".jpg", _image(color, fmt="JPEG")), (".txt", b"a caption")):
                info = tarfile.TarInfo(key + suffix)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    table = {
        "key": [k for k, _, _ in rows],
        "shard": ["00000.tar"] * len(rows),
        "reason": [r for _, r, _ in rows],
        "detail": [f"{r} <b>detail</b>" for _, r, _ in rows],
        "image_hash": ["0" * 40] * len(rows),
    }
    if image_column:
        table["image"] = [_image(c) for _, _, c in rows]
    (clean_dir / "rejected").mkdir()
    pq.write_table(pa.table(table), clean_dir / "rejected" / "part-00000.parquet")
    return lake


def make_run(root: Path, *, image_column: bool = False) -> Path:
    """A small run directory like `qvl run --local` leaves: 3 stages succeeded, 1 cached, rl failed, 2 not run."""
    run = root / "run"
    png = base64.b64encode(_image("teal", (16, 12))).decode()
    stages = {
        "preflight": _stage(run, "preflight", "succeeded", {"configs_validated": 8}),
        "clean_data": _stage(
            run,
            "clean_data",
            "succeeded",
            {"records_in": 10, "records_kept": 4, "records_rejected": 6, "kept_fraction": 0.4}
            | {"rejected_by_reason": {"too_small": 4, "low_clip_score": 2, "nsfw": 0}},
            "# clean_data report\n\n| reason | records |\n|---|---:|\n| too_small | 4 |\n\n![hist](hist.png)\n",
        ),
        "extract_features": _stage(run, "extract_features", "cached", {"images": 4, "visual_tokens_total": 64}),
        "pretrain": _stage(
            run,
            "pretrain",
            "succeeded",
            {"retrieval_r1": 0.5, "retrieval_chance": 0.125, "retrieval_r1_initial": 0.125}
            | {"heldout_caption_loss_initial": 6.0, "heldout_caption_loss_final": 4.5},
            f"# Pretrain\n\nLoss fell. {HOSTILE}\n\n| step | loss |\n|---|---|\n| 0 | 6.0 |\n\n"
            f"![loss](data:image/png;base64,{png})\n\n![tracker](https://example.com/pixel.png)\n\n"
            "[docs](https://example.com/docs) and <img src=http://example.com/x.png>\n",
        ),
        "sft": _stage(
            run, "sft", "succeeded", {"vqa_exact_match": 0.6, "vqa_majority_baseline": 0.25}, "# SFT\n\nok\n"
        ),
        "reward_model": _stage(run, "reward_model", "succeeded", {"pair_accuracy": 0.8, "pair_accuracy_initial": 0.5}),
        "rl": _stage(run, "rl", "failed", {}, error=f"RuntimeError: reward went NaN at step 3 {HOSTILE}"),
    }
    clean_dir = Path(stages["clean_data"]["artifacts"]["output"])
    (clean_dir / "hist.png").write_bytes(_image("navy", (20, 10)))
    stages["clean_data"]["artifacts"]["clean_data"] = str(clean_dir)
    lake = _rejected(run, clean_dir, image_column=image_column)
    summary = {
        "preset": f"tiny{HOSTILE}",
        "status": "failed",
        "seconds": 95.0,
        "lake_uri": "" if image_column else str(lake),
        "data_uri": str(root / "heldout"),
        "mlflow_tracking_uri": f"sqlite:///{run}/mlflow.db",
        "mlflow_run_id": "0123abcd",
        "stages": stages,
    }
    (run / "run_summary.json").write_text(json.dumps(summary))
    return run


def _add_select_checkpoint(run: Path) -> None:
    summary = json.loads((run / "run_summary.json").read_text())
    metrics = {"selected_stage": "sft", "selected_candidate": "sft", "selected_score": 0.61}
    metrics |= {"registered_model": "qvl-tiny", "registered_version": "3", "runner_up": "pretrain"}
    entry = _stage(run, "select_checkpoint", "succeeded", metrics, "# Model card: sft\n\nSelected **sft**.\n")
    output = Path(entry["artifacts"]["output"])
    (output / "model_card.md").write_text("# Model card: sft\n")
    (output / "candidates.json").write_text(json.dumps([{"name": "sft", "stage": "sft", "score": 0.61}]))
    entry["artifacts"]["model"] = str(output / "model")
    for stage in ("pretrain", "sft"):
        summary["stages"][stage]["artifacts"]["model"] = summary["stages"][stage]["artifacts"]["output"] + "/model"
    summary["stages"]["select_checkpoint"] = entry
    (run / "run_summary.json").write_text(json.dumps(summary))


def _section(page: str, stage: str) -> str:
    match = re.search(rf'<section id="stage-{stage}">(.*?)</section>', page, re.S)
    assert match, f"no section for {stage}"
    return match.group(1)


def test_every_stage_has_a_section_with_its_status(tmp_path):
    page = write_run_report(make_run(tmp_path)).read_text()
    for stage in STAGE_ORDER:
        _section(page, stage)
    assert "not run" in _section(page, "distill") and "not run" in _section(page, "select_checkpoint")
    assert 'class="badge cached">cached' in _section(page, "extract_features")
    assert re.search(r'class="box failed" href="#stage-rl"', page)
    assert "<table>" in _section(page, "pretrain") and "<td>6.0</td>" in _section(page, "pretrain")
    assert "none: select_checkpoint not run" in page  # no champion, and no crash


def test_key_metric_rows_hold_the_headline_against_its_baseline(tmp_path):
    summary = json.loads((make_run(tmp_path) / "run_summary.json").read_text())
    rows = {(r["stage"], r["metric"]): r for r in key_metric_rows(summary)}
    sft = rows[("sft", "vqa_exact_match")]
    assert (sft["value"], sft["baseline"], sft["baseline_name"], sft["better"]) == (
        0.6,
        0.25,
        "vqa_majority_baseline",
        True,
    )
    assert sft["delta"] == pytest.approx(0.35)
    loss = rows[("pretrain", "heldout_caption_loss_final")]
    assert (loss["baseline"], loss["delta"], loss["better"]) == (6.0, -1.5, True)  # lower loss is better
    assert rows[("pretrain", "retrieval_r1")]["baseline"] == 0.125
    pairs = rows[("reward_model", "pair_accuracy")]
    assert (pairs["baseline"], pairs["baseline_name"], pairs["notes"]) == (0.5, "chance", {"before training": 0.5})
    kept = rows[("clean_data", "records_kept")]
    assert (kept["value"], kept["baseline"], kept["delta"], kept["notes"]["rejected"]) == (4, 10.0, -6.0, 6)
    assert rows[("extract_features", "images")]["baseline"] is None  # no baseline known: the headline alone
    assert rows[("rl", "efficacy_gain")]["status"] == "failed" and rows[("rl", "efficacy_gain")]["value"] is None
    assert rows[("distill", "student_score_ratio")]["status"] == "not run"
    assert [r["stage"] for r in key_metric_rows(summary)][:3] == ["clean_data", "extract_features", "pretrain"]


def test_rl_interval_and_distill_ratio_rows():
    metrics = {"efficacy_gain": 0.04, "efficacy_gain_ci_low": 0.01, "efficacy_gain_ci_high": 0.07}
    summary = {"stages": {"rl": {"status": "succeeded", "metrics": metrics}}}
    summary["stages"]["distill"] = {"status": "succeeded", "metrics": {"student_score_ratio": 0.9}}
    rows = {r["stage"]: r for r in key_metric_rows(summary)}
    assert rows["rl"]["interval"] == (0.01, 0.07) and rows["rl"]["baseline"] == 0.0 and rows["rl"]["better"]
    assert rows["distill"]["baseline"] == 1.0 and rows["distill"]["better"] is False


def test_a_failed_stage_shows_its_error_escaped(tmp_path):
    section = _section(write_run_report(make_run(tmp_path)).read_text(), "rl")
    assert "RuntimeError: reward went NaN at step 3" in section
    assert "&lt;script&gt;alert(&#x27;pwned&#x27;)&lt;/script&gt;" in section and HOSTILE not in section


@pytest.mark.parametrize("image_column", [False, True], ids=["images-from-the-lake", "images-in-the-parquet"])
def test_clean_data_shows_up_to_three_thumbnails_per_rejection_reason(tmp_path, image_column):
    section = _section(write_run_report(make_run(tmp_path, image_column=image_column)).read_text(), "clean_data")
    rows = dict(re.findall(r"<tr><td>(\w+)</td><td class='n'>\d+</td><td>(.*?)</td></tr>", section))
    assert set(rows) == {"too_small", "low_clip_score"}  # reasons with no records are left out
    assert rows["too_small"].count('<img class="thumb"') == 3 and rows["low_clip_score"].count("<img") == 2
    assert section.count("<img") == 5 + 1  # + the report's own histogram, inlined from hist.png
    assert "too_small &lt;b&gt;detail&lt;/b&gt;" in section
    thumb = re.search(r'<img class="thumb" src="data:image/png;base64,([^"]+)"', section).group(1)
    assert max(Image.open(io.BytesIO(base64.b64decode(thumb))).size) <= 96
    assert thumbnail(b"not an image") is None and thumbnail(b"") is None


def test_the_page_is_self_contained_and_escapes_what_it_reads(tmp_path):
    page = write_run_report(make_run(tmp_path)).read_text()
    dom = _Dom()
    dom.feed(page)
    assert dom.links and all(link.startswith(("data:", "#")) for link in dom.links), {x[:40] for x in dom.links}
    assert not any("http://" in link or "https://" in link for link in dom.links)
    assert page.count("<script>") == 1 and HOSTILE not in page
    assert "[figure not embedded: tracker]" in page
    assert "&lt;img src=http://example.com/x.png&gt;" in page  # raw HTML in a report is text, never markup


def test_render_markdown_never_reads_outside_the_stage_dir(tmp_path):
    (tmp_path / "secret.png").write_bytes(_image("red"))
    (tmp_path / "stage").mkdir()
    out = render_markdown("![a](../secret.png) ![b](/etc/passwd.png) ![c](file:///x.png)", tmp_path / "stage")
    assert "<img" not in out and out.count("figure not embedded") == 2  # markdown-it leaves file: links as text


def test_the_champion_and_its_lineage(tmp_path):
    run = make_run(tmp_path)
    _add_select_checkpoint(run)
    page = write_run_report(run).read_text()
    champion = page.split("<h2 id='champion'>", 1)[1].split("<section", 1)[0]
    assert "<b>sft</b>" in champion and "<code>qvl-tiny</code> version 3" in champion
    lineage = [b.replace("<wbr>", "") for b in re.findall(r'<div class="box [\w-]+"><b>(.*?)</b>', champion)]
    assert lineage == ["lake", "clean_data", "extract_features", "pretrain", "sft", "select_checkpoint", "registry"]
    assert "models:/qvl-tiny@champion (v3)" in champion and "sft-op/output/model" in champion


def test_missing_files_never_crash_the_report(tmp_path):
    run = make_run(tmp_path)
    shutil.rmtree(run / "pipeline_root" / "pretrain-op")
    shutil.rmtree(run / "pipeline_root" / "clean_data-op" / "output" / "rejected")
    page = write_run_report(run).read_text()
    assert "stage-pretrain" in page and "Rejected records per reason" in page
    (run / "run_summary.json").unlink()
    with pytest.raises(ValueError, match="no run_summary.json"):
        write_run_report(run)


class _Dom(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.body: dict[str, str | None] = {}
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.body = dict(attrs) if tag == "body" else self.body
        self.ids |= {v for k, v in attrs if k == "id" and v}
        self.links += [v or "" for k, v in attrs if k in ("src", "href")]


def _chromium(tmp_path: Path, page: Path, *args: str) -> str:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
    command += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    command += [f"--user-data-dir={tmp_path / 'chromium-profile'}", "--host-resolver-rules=MAP * ~NOTFOUND"]
    done = subprocess.run([*command, *args, page.as_uri()], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_report_renders_in_headless_chromium_without_errors(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail(
            "chromium is not installed: run `bash .ci/install.sh --tests` (it installs Debian's chromium package)"
        )
    page = write_run_report(make_run(tmp_path))
    dom = _Dom()
    dom.feed(_chromium(tmp_path, page, "--dump-dom"))
    assert dom.body.get("data-rendered") == "ok", dom.body
    assert not dom.body.get("data-errors"), dom.body["data-errors"]
    assert {f"stage-{s}" for s in STAGE_ORDER} <= dom.ids
    broken = tmp_path / "broken.html"  # the error probe itself works: a failed load is recorded
    broken.write_text(page.read_text().replace("</body>", '<img src="http://example.com/x.png"></body>'))
    probe = _Dom()
    probe.feed(_chromium(tmp_path, broken, "--dump-dom"))
    assert "failed to load http://example.com/x.png" in str(probe.body.get("data-errors"))
    shot = tmp_path / "report.png"
    _chromium(tmp_path, page, f"--screenshot={shot}", "--window-size=1280,3000")
    assert shot.stat().st_size > 10_000 and Image.open(shot).size == (1280, 3000)
    if os.environ.get("QVL_TEST_ARTIFACTS"):
        Path(os.environ["QVL_TEST_ARTIFACTS"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(os.environ["QVL_TEST_ARTIFACTS"]) / "run_report.png")
