"""components._shared.platform.storage against local directories and a real S3 server (SeaweedFS)."""

import json
import os
from pathlib import Path

import pytest

from components._shared.data import lake as lake_listing
from components._shared.platform import s3_client, storage
from components._shared.platform.storage import COMMIT_MARKER, IntegrityError

MiB = 1024**2


def _make_tree(root: Path) -> dict[str, bytes]:
    files = {"a.txt": b"alpha", "sub/b.bin": os.urandom(3000), "sub/deeper/c.json": b'{"x": 1}', "empty.txt": b""}
    for relative, data in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(data)
    return files


@pytest.fixture(params=["local", "s3"])
def base(request, tmp_path) -> str:
    """A destination root: a local directory or a fresh S3 bucket (the server starts only when needed)."""
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_env").uri


# --- URIs ------------------------------------------------------------------------------------------


def test_split_and_join():
    assert storage.split_s3("s3://my-bucket/a/b.txt") == ("my-bucket", "a/b.txt")
    assert storage.split_s3("s3://my-bucket") == ("my-bucket", "")
    assert storage.join("s3://my-bucket/pre/", "x/", "/y.txt") == "s3://my-bucket/pre/x/y.txt"
    assert storage.join("s3://my-bucket", "k") == "s3://my-bucket/k"
    assert storage.join("/tmp/a", "b", "c.txt") == "/tmp/a/b/c.txt"
    assert storage.is_s3("s3://b/k") and not storage.is_s3("/s3://b") and not storage.is_s3(Path("/x"))


@pytest.mark.parametrize(
    "uri, words",
    [
        ("s3://", "invalid bucket name"),
        ("s3://ab/key", "invalid bucket name"),
        ("s3://Upper/key", "invalid bucket name"),
        ("s3://bucket_x/key", "invalid bucket name"),
        ("s3://my-bucket/a//b", "empty path segment"),
        ("/local/path", "not an S3 URI"),
    ],
)
def test_split_rejects_malformed(uri, words):
    with pytest.raises(ValueError, match=words):
        storage.split_s3(uri)


@pytest.mark.parametrize("uri", ["s3:/bucket/key", "S3://bucket/key", "s3:bucket"])
def test_malformed_s3_uri_is_not_treated_as_a_local_path(uri):
    with pytest.raises(ValueError, match="malformed S3 URI"):
        storage.read_bytes(uri)


# --- round trips -----------------------------------------------------------------------------------


def test_bytes_round_trip_and_exists(base, tmp_path):
    uri = storage.join(base, "dir", "data.bin")
    payload = os.urandom(10_000)
    assert not storage.exists(uri)
    storage.write_bytes(uri, payload)
    assert storage.read_bytes(uri) == payload
    assert storage.exists(uri) and storage.exists(storage.join(base, "dir"))
    assert not storage.exists(storage.join(base, "di"))  # a name prefix is not a directory
    with storage.open_read(uri) as stream:
        assert stream.read(100) == payload[:100] and stream.read() == payload[100:]
    storage.write_bytes(uri, b"second")  # overwrite
    assert storage.read_bytes(uri) == b"second"
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        storage.read_bytes(storage.join(base, "missing.bin"))


def test_local_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    target = tmp_path / "out" / "f.bin"
    storage.write_bytes(target, b"x" * 1000)
    assert [p.name for p in target.parent.iterdir()] == ["f.bin"]


def test_file_round_trip_and_list_files(base, tmp_path):
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(5000))
    for name in ("b/2.txt", "a.txt", "b/1.parquet", "b/c/3.parquet"):
        storage.upload_file(source, storage.join(base, "tree", name))
    storage.write_bytes(storage.join(base, "tree-sibling", "x.txt"), b"not inside tree")
    listed = storage.list_files(storage.join(base, "tree"))
    assert listed == [storage.join(base, "tree", n) for n in ("a.txt", "b/1.parquet", "b/2.txt", "b/c/3.parquet")]
    assert storage.list_files(storage.join(base, "tree"), suffix=".parquet") == [
        storage.join(base, "tree", "b/1.parquet"),
        storage.join(base, "tree", "b/c/3.parquet"),
    ]
    assert storage.list_files(storage.join(base, "nothing-here")) == []
    back = storage.download_file(storage.join(base, "tree", "b/2.txt"), tmp_path / "dl" / "x.bin")
    assert back.read_bytes() == source.read_bytes()


def test_lake_listing_goes_into_subfolders_takes_compressed_tars_and_returns_other_files(base):
    lake = storage.join(base, "lake")
    names = ("00000.tar", "part2/00000.tar", "part2/x/00001.tgz", "00002.tar.gz", "00003.parquet")  # 00003: images
    others = ("00000.parquet", "00000_stats.json", "part2/00000.parquet", "part2/readme.md")  # img2dataset metadata
    for name in names + others:
        storage.write_bytes(storage.join(lake, name), b"x")
    shards = lake_listing.list_lake_shards(lake)
    assert shards == [storage.join(lake, n) for n in sorted(names)]  # sorted, every folder, .tar.gz and .tgz too
    assert lake_listing.list_lake_files(lake) == (shards, [storage.join(lake, n) for n in others])
    for name in ("00000_stats.json", "part2/readme.md"):
        storage.write_bytes(storage.join(base, "no-shards", name), b"x")
    with pytest.raises(
        ValueError, match=r"No \*\.tar, .* or \*\.parquet shards .*it holds 2 other file\(s\), e\.g\. .*00000_stats"
    ):
        lake_listing.list_lake_shards(storage.join(base, "no-shards"))


def test_multipart_upload_really_splits_and_round_trips(s3_env, tmp_path):
    data = os.urandom(11 * MiB)  # boto3 parts are at least 5 MiB: 11 MiB -> 3 parts
    (tmp_path / "big.bin").write_bytes(data)
    uri = f"{s3_env.uri}/big/big.bin"
    storage.upload_file(tmp_path / "big.bin", uri, multipart_threshold=1 * MiB)
    etag = s3_env.client().head_object(Bucket=s3_env.bucket, Key="big/big.bin")["ETag"]
    assert etag.strip('"').endswith("-3"), f"expected a 3-part multipart ETag, got {etag}"
    storage.download_file(uri, tmp_path / "back.bin", multipart_threshold=1 * MiB)
    assert (tmp_path / "back.bin").read_bytes() == data
    storage.upload_file(tmp_path / "big.bin", f"{s3_env.uri}/big/single.bin")  # default threshold: one PUT
    assert "-" not in s3_env.client().head_object(Bucket=s3_env.bucket, Key="big/single.bin")["ETag"]


def test_s3_stores_sha256_checksum(s3_env):
    storage.write_bytes(f"{s3_env.uri}/c.txt", b"hello")
    head = s3_env.client().head_object(Bucket=s3_env.bucket, Key="c.txt", ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"] == "LPJNul+wow4m6DsqxbninhsWHlwfp0JecwQzYpOLmCQ="  # base64 sha256("hello")


def test_wrong_credentials_error_names_uri_and_env_vars(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(PermissionError, match=rf"{s3_env.uri}/x.*AWS_SECRET_ACCESS_KEY"):
        storage.read_bytes(f"{s3_env.uri}/x")


def test_missing_credentials_error_says_what_to_set(s3_env, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(PermissionError, match="No S3 credentials.*AWS_ACCESS_KEY_ID.*Kubernetes"):
        storage.write_bytes(f"{s3_env.uri}/x", b"1")


def test_missing_bucket_is_file_not_found(s3_env):
    with pytest.raises(FileNotFoundError, match="qvl-no-such-bucket"):
        storage.read_bytes("s3://qvl-no-such-bucket/k")


def test_a_missing_bucket_listed_is_a_missing_bucket_and_a_web_server_is_not_taken_for_s3(s3_env, monkeypatch):
    """A real S3 answers a listing of a missing bucket NoSuchBucket; an endpoint that answers a bare 404 (another
    web server on that host or port) is named as not an S3 API instead of "the prefix does not exist"."""
    import http.server
    import threading

    with pytest.raises(FileNotFoundError, match="Bucket of s3://qvl-no-such-bucket/lake does not exist"):
        storage.list_files("s3://qvl-no-such-bucket/lake")

    class NotS3(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b"<html>Not Found</html>")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            monkeypatch.setenv(name, f"http://127.0.0.1:{server.server_port}")
        with pytest.raises(ConnectionError, match=r"bare HTTP 404 from http://127\.0\.0\.1:\d+.*not an S3 API"):
            lake_listing.list_lake_shards(f"{s3_env.uri}/lake")
    finally:
        server.shutdown()


def test_an_endpoint_that_does_not_answer_is_said_while_botocore_retries(capsys):
    from botocore.exceptions import EndpointConnectionError

    refused = EndpointConnectionError(endpoint_url="http://127.0.0.1:1/b")
    for attempt in range(1, 11):
        s3_client._say_connection_retries(attempts=attempt, caught_exception=refused)
    s3_client._say_connection_retries(attempts=1, caught_exception=None)  # a retried 503: botocore's own business
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all("did not answer (EndpointConnectionError" in line for line in lines)
    assert "attempt 1)" in lines[0] and "attempt 5)" in lines[1] and "retrying for up to a minute" in lines[0]
    handlers = s3_client.client().meta.events._emitter._handlers.prefix_search("needs-retry.s3.ListObjectsV2")
    assert s3_client._say_connection_retries in handlers  # every request of the client says it


# --- committed publication -------------------------------------------------------------------------


def test_publish_and_fetch_verify_every_file(base, tmp_path):
    files = _make_tree(tmp_path / "out")
    dest = storage.join(base, "run-1")
    marker = storage.publish_dir(tmp_path / "out", dest)
    assert sorted(marker["files"]) == sorted(files)
    assert marker["files"]["a.txt"] == {
        "size": 5,
        "sha256": "8ed3f6ad685b959ead7022518e1af76cd816f8e8ec7ccdda1ed4018e8f2223f8",
    }
    assert storage.is_committed(dest)
    assert json.loads(storage.read_bytes(storage.join(dest, COMMIT_MARKER)))["files"] == marker["files"]
    fetched = storage.fetch_dir(dest, tmp_path / "fetched")
    for relative, data in files.items():
        assert (fetched / relative).read_bytes() == data
    assert storage.is_committed(fetched)


def test_republish_replaces_old_files_and_marker(base, tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "old.txt").write_text("old")
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "new.txt").write_text("new")
    dest = storage.join(base, "model")
    storage.publish_dir(tmp_path / "v1", dest)
    storage.publish_dir(tmp_path / "v2", dest)
    fetched = storage.fetch_dir(dest, tmp_path / "fetched")
    assert sorted(p.name for p in fetched.iterdir()) == [COMMIT_MARKER, "new.txt"]


def test_tampered_object_is_detected(base, tmp_path):
    _make_tree(tmp_path / "out")
    dest = storage.join(base, "run-t")
    storage.publish_dir(tmp_path / "out", dest)
    storage.write_bytes(storage.join(dest, "sub/b.bin"), b"tampered bytes")
    with pytest.raises(IntegrityError, match=r"sub/b\.bin does not match _COMMITTED\.json.*size 14"):
        storage.fetch_dir(dest, tmp_path / "fetched")
    assert not (tmp_path / "fetched" / "sub" / "b.bin").exists()


def test_deleted_object_is_detected(base, tmp_path):
    _make_tree(tmp_path / "out")
    dest = storage.join(base, "run-d")
    storage.publish_dir(tmp_path / "out", dest)
    if storage.is_s3(dest):
        bucket, key = storage.split_s3(storage.join(dest, "a.txt"))
        s3_client.client().delete_object(Bucket=bucket, Key=key)
    else:
        Path(dest, "a.txt").unlink()
    with pytest.raises(IntegrityError, match=r"a\.txt is listed in _COMMITTED\.json but missing"):
        storage.fetch_dir(dest, tmp_path / "fetched")


def test_uncommitted_prefix_is_ignored_and_rejected(base, tmp_path):
    _make_tree(tmp_path / "out")
    root = storage.join(base, "shards")
    storage.publish_dir(tmp_path / "out", storage.join(root, "b-done"))
    storage.publish_dir(tmp_path / "out", storage.join(root, "a-done"))
    storage.write_bytes(storage.join(root, "c-partial", "a.txt"), b"half written")  # no marker
    assert storage.list_committed(root) == [storage.join(root, "a-done"), storage.join(root, "b-done")]
    assert not storage.is_committed(storage.join(root, "c-partial"))
    with pytest.raises(IntegrityError, match=r"c-partial is not committed \(no _COMMITTED\.json\)"):
        storage.fetch_dir(storage.join(root, "c-partial"), tmp_path / "fetched")
    copied = storage.fetch_dir(storage.join(root, "c-partial"), tmp_path / "loose", require_commit=False)
    assert (copied / "a.txt").read_bytes() == b"half written"
    assert storage.list_committed(storage.join(base, "no-such-prefix")) == []


def test_multipart_publish_is_verified(s3_env, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "weights.safetensors").write_bytes(os.urandom(6 * MiB))
    storage.publish_dir(tmp_path / "out", f"{s3_env.uri}/ckpt", multipart_threshold=1 * MiB)
    etag = s3_env.client().head_object(Bucket=s3_env.bucket, Key="ckpt/weights.safetensors")["ETag"]
    assert etag.strip('"').endswith("-2")
    fetched = storage.fetch_dir(f"{s3_env.uri}/ckpt", tmp_path / "back")
    assert (fetched / "weights.safetensors").read_bytes() == (tmp_path / "out" / "weights.safetensors").read_bytes()


def test_unsafe_marker_path_is_rejected(tmp_path):
    dest = tmp_path / "evil"
    dest.mkdir()
    (dest / COMMIT_MARKER).write_text(json.dumps({"files": {"../escape.txt": {"size": 1, "sha256": "0"}}}))
    with pytest.raises(IntegrityError, match="unsafe path '../escape.txt'"):
        storage.fetch_dir(dest, tmp_path / "fetched")
    assert not (tmp_path / "escape.txt").exists()


def test_a_committed_directory_is_readable_as_the_umask_allows(tmp_path):
    """safetensors writes weights owner-only (0600): committing gives them the umask's modes (0644 under 022), so
    another user (a serving pod, the next stage's container) reads the model; a file made private on purpose by a
    group bit stays as it is."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o600
    (tmp_path / "shared.txt").write_text("x")
    (tmp_path / "shared.txt").chmod(0o640)
    old = os.umask(0o022)
    try:
        storage.commit_dir(tmp_path)
    finally:
        os.umask(old)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "shared.txt").stat().st_mode & 0o777 == 0o640
    storage.verify_dir(tmp_path)
