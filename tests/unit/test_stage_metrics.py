"""A stage's metrics mirrored to its KFP Metrics artifact: a value KFP's metadata cannot hold (NaN, inf) is left out
with a warning naming it, not a task (and a local run) that crashes after the stage's work was done."""

import json

from google.protobuf import json_format, struct_pb2
from kfp import dsl

from components._shared.launch.result import report_metrics


def test_non_finite_metrics_are_left_out_of_the_artifact_and_named(tmp_path, capsys):
    artifact = dsl.Metrics(name="metrics", uri=str(tmp_path / "metrics"))
    artifact.path = str(tmp_path / "metrics" / "data")  # as the KFP executor sets it
    report_metrics(artifact, {"loss": 0.5, "ece_initial": float("nan"), "eval": {"ratio": float("inf"), "n": 3}})
    assert artifact.metadata == {"loss": 0.5, "eval.n": 3.0}
    assert json.loads((tmp_path / "metrics" / "data").read_text()) == {"eval.n": 3.0, "loss": 0.5}
    assert "not finite, left out of the KFP metrics: ece_initial, eval.ratio" in capsys.readouterr().err
    json_format.ParseDict(artifact.metadata, struct_pb2.Struct())  # what KFP serialises it into
