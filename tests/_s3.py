"""A local S3-compatible server for the tests: moto in server mode on 127.0.0.1.

`s3_server` starts ``python -m moto.server`` on a free loopback port once per test process (its
own process, so its request handling does not share this process's interpreter lock with the
code under test; shared by every S3 test module, stopped at exit), creates a bucket, and points
every S3 client at it through the environment (``AWS_ENDPOINT_URL``, fake credentials): this
process's and every process it starts (rank processes, a second job), which inherit the
environment. On exit from the block it restores the environment. Nothing beyond loopback is
reached.

`S3Calls` counts (and can kill at) the S3 requests of this process: every s3fs request goes
through ``S3FileSystem._call_s3``.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import pytest

WRITES = ("put_object", "copy_object", "upload_part_copy", "delete_object", "delete_objects",
          "create_multipart_upload", "upload_part", "complete_multipart_upload")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _forget_clients() -> None:
    """Drop s3fs's cached file-system instances (they hold the endpoint they were made with)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


_servers: dict[str, str] = {}  # one moto server per test process, shared by every S3 test module


def _endpoint() -> str:
    """The endpoint of this process's moto server, started on first use and stopped at exit."""
    if "endpoint" in _servers:
        return _servers["endpoint"]
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(os.devnull, "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=log)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()

    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop()
                raise RuntimeError(f"the moto server did not start on {endpoint} (exit {proc.poll()})")
            time.sleep(0.1)
    atexit.register(stop)
    _servers["endpoint"] = endpoint
    return endpoint


@contextlib.contextmanager
def s3_server(bucket: str = "ckpt") -> Iterator[dict[str, str]]:
    """Point every S3 client at this process's moto server (started once, shared by the S3 test
    modules) with ``bucket`` created; yields the environment that reaches it, restored after."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    endpoint = _endpoint()
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        _forget_clients()
        import s3fs

        fs = s3fs.S3FileSystem()
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _forget_clients()


def fresh_prefix(bucket: str = "ckpt") -> str:
    """A new folder URL in ``bucket`` (tests share one server)."""
    return f"s3://{bucket}/t-{uuid.uuid4().hex[:8]}"


class Killed(Exception):
    """The writer died at an S3 request: this one and every later request of the process fail."""


class S3Calls:
    """Counts this process's S3 requests by operation while installed (``with S3Calls() as c``);
    ``kill_at=k`` makes the k-th *write* request (`WRITES`) and every request after it raise
    `Killed` before reaching the server, as if the process had died there."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.writes: list[str] = []
        self.kill_at, self.dead = kill_at, False
        self._undo: Callable[[], None] | None = None

    def __enter__(self) -> S3Calls:
        import s3fs

        real = s3fs.S3FileSystem._call_s3
        calls = self

        async def call(fs, method, *args, **kwargs):
            if calls.dead:
                raise Killed(method)
            if method in WRITES:
                calls.writes.append(f"{method} {kwargs.get('Key', kwargs.get('Bucket', ''))}")
                if calls.kill_at is not None and len(calls.writes) == calls.kill_at:
                    calls.dead = True
                    raise Killed(method)
            calls.counts[method] += 1
            return await real(fs, method, *args, **kwargs)

        from fsspec.asyn import sync_wrapper

        real_sync = s3fs.S3FileSystem.call_s3  # what an open file's uploads call: the same requests
        s3fs.S3FileSystem._call_s3 = call
        s3fs.S3FileSystem.call_s3 = sync_wrapper(call)
        self._undo = lambda: (setattr(s3fs.S3FileSystem, "_call_s3", real),
                              setattr(s3fs.S3FileSystem, "call_s3", real_sync))
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._undo is not None
        self._undo()

    @property
    def total(self) -> int:
        return sum(self.counts.values())
