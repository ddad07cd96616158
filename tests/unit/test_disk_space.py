"""A write on a full volume is one error naming the place and the space left; a result file is whole or absent.

A real full volume: a 1 MB tmpfs when this machine lets the test mount one (CI's does), else the writer's failure is
injected the way the kernel reports it (ENOSPC) and torch reports it (`unexpected pos`, no errno, no path)."""

import errno
import json
import shutil
import subprocess
from collections import namedtuple

import pytest
import torch

from components._shared.launch.result import RESULT_FILE, _record
from components._shared.platform import disk_space
from components._shared.platform.disk_space import DiskFull, write_text_atomic

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def full_volume(tmp_path):
    """A directory on a volume with no space left (tmpfs of 1 MB, filled)."""
    mount = tmp_path / "vol"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the injected tests below cover it")
    with open(mount / "filler", "wb") as f, pytest.raises(OSError):
        f.write(b"\0" * (2 << 20))
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)  # lazily: a failed writer may hold a file


def test_torch_save_on_a_full_volume_names_the_directory(full_volume):
    target = full_volume / "ckpt"
    target.mkdir()
    with pytest.raises(DiskFull) as caught, disk_space.writing(target, "checkpoint of step 3"):
        torch.save({"w": torch.zeros(1 << 16)}, target / "state.pt")
    message = str(caught.value)
    assert message.startswith(f"checkpoint of step 3: writing {target} failed: the volume holding it is full")
    assert "free of" in message


def test_a_result_on_a_full_volume_keeps_the_previous_one_whole(full_volume):
    (full_volume / "filler").unlink()
    _record("sft", {"status": "succeeded", "metrics": {"loss": 1.0}}, full_volume)
    with open(full_volume / "filler", "wb") as f, pytest.raises(OSError):
        f.write(b"\0" * (2 << 20))
    with pytest.raises(DiskFull, match=rf"writing {RESULT_FILE}: writing {full_volume} failed"):
        _record("sft", {"status": "failed", "error": "x" * 100_000}, full_volume)
    assert json.loads((full_volume / RESULT_FILE).read_text())["status"] == "succeeded"
    assert sorted(p.name for p in full_volume.iterdir()) == sorted(["filler", RESULT_FILE])  # no partial file left


def test_torchs_pathless_message_is_explained_by_the_space_left(tmp_path, monkeypatch):
    """torch.save on a full disk raises RuntimeError('... unexpected pos N vs M') with no errno and no path."""
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(10 << 30, 10 << 30, 1 << 20))
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 791893376 vs 791893264")
    says = r"distill: writing .*ckpt/deep failed: the volume holding it is full \(1.0 MB free"
    with pytest.raises(DiskFull, match=says):
        with disk_space.writing(tmp_path / "ckpt" / "deep", "distill"):
            raise error
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(10 << 30, 1 << 30, 9 << 30))
    with pytest.raises(RuntimeError, match="unexpected pos"), disk_space.writing(tmp_path, "distill"):
        raise error  # plenty of space: not blamed on the disk


def test_an_interrupted_write_leaves_the_old_file_and_no_partial(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    write_text_atomic(path, '{"a": 1}')

    def no_space(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_space.os, "fsync", no_space)
    with pytest.raises(DiskFull, match=rf"writing r.json: writing {tmp_path} failed: the volume holding it is full"):
        write_text_atomic(path, '{"a": 2}')
    assert path.read_text() == '{"a": 1}' and [p.name for p in tmp_path.iterdir()] == ["r.json"]
