"""One writer per output directory and checkpoint root.

    with locks.scope():                          # runner.execute opens one per stage run
        locks.hold(output_dir, purpose="sft output")   # raises LockHeld naming the holder, at once
        ...                                      # CheckpointStore holds its root the same way
    # released here (and by the OS / the lease's expiry if the process dies)

- A local directory is locked with `filelock` (an OS lock on DIR/.qvl-lock, released when the process dies);
  DIR/.qvl-lock.json names the holder (pid, host, purpose, start) while it is held. Both files are left out of
  commit markers.
- An s3:// prefix is locked by a lease object PREFIX.qvl-lock.json created with a conditional write
  (If-None-Match: *), renewed every lease/5 (lease: QVL_S3_LEASE_S, 60 s) with If-Match on its ETag. A second
  run stops as soon as it sees a renewal (the holder is alive); it takes the lease over, atomically, when its
  holder was a process of this host, boot and pid namespace that no longer exists (a killed run, rerun), or
  after seeing it unrenewed for two renewal periods on its own clock (a holder elsewhere that died: a KFP retry
  in a new pod waits ~24 s). A holder whose lease was taken stops at its next commit (`check_not_lost`). This
  needs an S3 that honours conditional writes (AWS S3, MinIO, SeaweedFS do).
- Only rank 0 of a torchrun job takes locks (all ranks write one output together). Outside a `scope()`,
  `hold` is a no-op: the library can be used without the CLI's locking.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from components._shared.platform import storage
from components._shared.platform.env_numbers import env_number

LOCK_FILE, HOLDER_FILE = storage.LOCK_FILES
S3_SUFFIX = ".qvl-lock.json"
LEASE_ENV, LEASE_DEFAULT_S = "QVL_S3_LEASE_S", 60.0
_HELD_CODES = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


class LockHeld(RuntimeError):
    """Another run writes this output directory or checkpoint root."""


class OutputUnusable(RuntimeError):
    """The output location cannot be written (read-only, not a directory, ...)."""


def holder(purpose: str) -> dict[str, Any]:
    """Who holds a lock: this process, its host (the pod name on Kubernetes) and what for."""
    return {
        "pid": os.getpid(),
        **_machine(),
        "purpose": purpose,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "kfp_run": os.environ.get("KFP_RUN_ID", ""),
    }


def describe(who: dict[str, Any]) -> str:
    return f"pid {who.get('pid')} on {who.get('host')} ({who.get('purpose')}, since {who.get('started')})"


class LocalLock:
    """An OS lock on a local directory, with a holder file beside it."""

    def __init__(self, directory: str | Path, *, holder: dict[str, Any]) -> None:
        from filelock import FileLock, Timeout

        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".qvl-write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise OutputUnusable(
                f"{self.directory} is not writable ({err.strerror or err}); choose a writable "
                + ("train.checkpoint_uri" if holder.get("purpose") == "checkpoints" else "--output-dir")
                + ", or fix its permissions."
            ) from err
        self.lock = FileLock(str(self.directory / LOCK_FILE), timeout=0)
        try:
            self.lock.acquire()
        except Timeout:
            raise LockHeld(
                f"{self.directory} is in use by {describe(_read_json(self.directory / HOLDER_FILE))}: one run "
                "writes an output or checkpoint folder at a time. Wait for it to finish, stop it, or choose another "
                "--output-dir."
            ) from None
        storage.write_bytes(self.directory / HOLDER_FILE, json.dumps(holder, indent=1).encode())

    def release(self) -> None:
        with contextlib.suppress(OSError):
            (self.directory / HOLDER_FILE).unlink()
        self.lock.release()


class S3Lease:
    """A lease object PREFIX.qvl-lock.json, created conditionally and renewed in a background thread."""

    def __init__(
        self, prefix: str, *, holder: dict[str, Any], lease_s: float | None = None, renew: bool = True
    ) -> None:
        if lease_s is None:
            lease_s = env_number(LEASE_ENV, LEASE_DEFAULT_S, minimum=1.0, unit="seconds")
        self.bucket, key = storage.split_s3(prefix.rstrip("/"))
        self.key, self.uri, self.lease_s = key + S3_SUFFIX, prefix.rstrip("/") + S3_SUFFIX, lease_s
        self.holder = holder
        self.lost = False
        self.etag = self._create()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if renew:
            self._thread = threading.Thread(target=self._renew_loop, name="qvl-s3-lease", daemon=True)
            self._thread.start()

    def _body(self) -> bytes:
        body = {**self.holder, "lease_s": self.lease_s, "expires": time.time() + self.lease_s}
        return json.dumps(body, indent=1).encode()

    def _put(self, **condition: str) -> str | None:
        """Write the lease under `condition`; its ETag, or None when the condition failed (someone else holds it)."""
        from botocore.exceptions import ClientError

        from components._shared.platform import s3_client

        with s3_client.errors(self.uri):
            try:
                reply = s3_client.client().put_object(Bucket=self.bucket, Key=self.key, Body=self._body(), **condition)
            except ClientError as err:
                if str(err.response.get("Error", {}).get("Code")) in _HELD_CODES:
                    return None
                raise
        return str(reply["ETag"])

    def read(self) -> tuple[str, str] | None:
        """(body, ETag) of the lease object now, or None when there is none."""
        from components._shared.platform import s3_client

        try:
            with s3_client.errors(self.uri):
                reply = s3_client.client().get_object(Bucket=self.bucket, Key=self.key)
                return reply["Body"].read().decode(), str(reply["ETag"])
        except FileNotFoundError:
            return None

    def _create(self) -> str:
        """Create the lease, or take over one whose holder is gone: a dead process of this host and pid namespace
        (a run killed and rerun here), or a lease seen unchanged for two of its renewal periods on this machine's
        own clock (the holder stopped renewing). Seeing it renewed means the holder is alive: stop at once."""
        seen, since = None, 0.0
        while True:
            etag = self._put(IfNoneMatch="*")
            if etag is not None:
                return etag
            current = self.read()
            if current is None:
                continue  # released between our two requests
            who, tag = json.loads(current[0]), current[1]
            period = max(0.05, float(who.get("lease_s", LEASE_DEFAULT_S)) / 5)  # the holder renews this often
            if _dead_here(who) or (tag == seen and time.monotonic() - since >= 2 * period):
                etag = self._put(IfMatch=tag)  # atomic: only one of several waiting runs takes it over
                if etag is not None:
                    return etag
                seen = None
                continue
            if seen is not None and tag != seen:
                raise LockHeld(
                    f"{self.uri.removesuffix(S3_SUFFIX)} is in use by {describe(who)}, which renews its lease "
                    f"({self.uri}). Wait for that run, stop it, or choose another location."
                )
            if seen is None:
                seen, since = tag, time.monotonic()
            time.sleep(period / 2)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 5):
            try:
                etag = self._put(IfMatch=self.etag)
            except Exception as err:  # a flaky S3: try again next period (the lease outlives two misses)
                print(f"WARNING: could not renew the lease {self.uri}: {err}", flush=True)
                continue
            if etag is None:
                self.lost = True
                print(f"ERROR: lost the lease {self.uri}: another run took it; this run stops at its next commit.")
                return
            self.etag = etag

    def release(self) -> None:
        from components._shared.platform import s3_client

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        current = self.read()
        if current is not None and current[1] == self.etag:
            with s3_client.errors(self.uri):
                s3_client.client().delete_object(Bucket=self.bucket, Key=self.key)


_scopes: list[list[tuple[str, LocalLock | S3Lease]]] = []  # open scopes of this process, innermost last


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Locks taken by `hold` inside are released when it closes."""
    held: list[tuple[str, LocalLock | S3Lease]] = []
    _scopes.append(held)
    try:
        yield
    finally:
        _scopes.remove(held)
        for name, lock in reversed(held):
            try:
                lock.release()
            except Exception as err:  # the OS lock dies with the process, a lease expires: never mask the result
                print(f"WARNING: could not release the lock of {name}: {err}", flush=True)


def hold(target: str | Path, *, purpose: str) -> None:
    """Take the one-writer lock of a local directory or s3:// prefix for the rest of the innermost open scope;
    no-op on ranks > 0, outside a scope, or when this process already holds it or a folder above it."""
    if not _scopes or os.environ.get("RANK", "0").strip() not in ("", "0"):
        return
    name = str(target).rstrip("/") if storage.is_s3(target) else str(Path(target).resolve())
    if any(name == held or name.startswith(held + "/") for scope_ in _scopes for held, _ in scope_):
        return
    who = holder(purpose)
    lock = S3Lease(name, holder=who) if storage.is_s3(name) else LocalLock(name, holder=who)
    _scopes[-1].append((name, lock))


def check_not_lost() -> None:
    """Raise LockHeld when a lease this process holds was taken by another run (called before each commit)."""
    for scope_ in _scopes:
        for name, lock in scope_:
            if isinstance(lock, S3Lease) and lock.lost:
                raise LockHeld(f"{name}: another run took this run's lease; stopping before writing over its work.")


def _machine() -> dict[str, Any]:
    """What makes a pid comparable: the same host name, boot and pid namespace (not just a shared host name)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, namespace = "", 0
    return {"host": socket.gethostname(), "boot_id": boot, "pid_ns": namespace}


def _dead_here(who: dict[str, Any]) -> bool:
    """The holder was a process of this machine's pid namespace that no longer exists (killed, not released)."""
    here = _machine()
    if not here["boot_id"] or any(who.get(k) != v for k, v in here.items()):
        return False
    if not isinstance(who.get("pid"), int) or who["pid"] == os.getpid():
        return False
    try:
        os.kill(who["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"pid": "?", "host": "?", "purpose": "unknown: its holder file is missing", "started": "?"}
