"""Checkpoints on S3 (a moto server on 127.0.0.1): parallel ranged reads against sequential ones.

    python benchmarks/checkpoint_s3.py            # save on 4 gloo ranks, load on 2 and on 3
    python benchmarks/checkpoint_s3.py --requests # one process: requests and bytes of each step

Starts ``python -m moto.server`` on a free loopback port, saves a state of ``--tensors`` fp32
tensors of ``[--rows, --cols]`` (``Shard(0)`` over ``--save-world`` ranks) to ``s3://bench/...``,
then loads it resharded onto each of ``--load-worlds`` (``Shard(0)`` over 2 ranks meets the saved
boundaries, over 3 it does not), ``--reps`` times each with ``read_concurrency`` 1 (one ranged
GET after another, as loads did before) and ``--concurrency`` (ranged GETs in flight together),
alternating. Every rank counts its own S3 requests (s3fs's ``_call_s3``). Printed per load world
and concurrency: rank 0's wall time from a barrier before to a barrier after the load (median of
the reps), and the requests of the busiest rank; ``verify`` as ``--verify`` (default off: the
data reads alone). Every load is checked against the saved values. Wall times on a loaded
machine are noise; request counts are exact.

``--requests`` instead runs, in this process, a first save of ``latest``, two replaces, a
series with ``keep_last=1`` rotating twice, and a load, and prints for each the S3 requests by
kind and the bytes sent (PUT bodies) and received (GET bodies), plus the bytes the server
copied (COPY requests: the source object's size). It uses only ``save``/``load``, so it runs
against an earlier checkout too (``PYTHONPATH=<old checkout's packages>``).
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _counting() -> collections.Counter:
    """Counts this process's S3 requests by kind, and bytes under "bytes up", "bytes down",
    "bytes copied"."""
    import s3fs

    counts: collections.Counter = collections.Counter()
    real = s3fs.S3FileSystem._call_s3

    async def call(fs, method, *args, **kwargs):
        counts[method] += 1
        if method in ("put_object", "upload_part"):
            counts["bytes up"] += len(kwargs.get("Body") or b"")
        if method == "copy_object":
            src = kwargs["CopySource"]
            counts["bytes copied"] += (await fs._info(f"{src['Bucket']}/{src['Key']}"))["size"]
        out = await real(fs, method, *args, **kwargs)
        if method == "get_object":
            counts["bytes down"] += int(out.get("ContentLength") or 0)
        return out

    from fsspec.asyn import sync_wrapper

    s3fs.S3FileSystem._call_s3 = call
    s3fs.S3FileSystem.call_s3 = sync_wrapper(call)  # what an open file's uploads call
    return counts


def _full(args, i: int) -> torch.Tensor:
    return torch.arange(args.rows * args.cols, dtype=torch.float32).reshape(args.rows, args.cols) + i


def _rank(rank: int, world: int, port: int, args, url: str, phase: str, out) -> None:
    import s3fs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardwise.checkpoint import FsspecStorage, load, save

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    counts = _counting()
    if phase == "save":
        save({f"t{i}": distribute_tensor(_full(args, i), mesh, [Shard(0)]) for i in range(args.tensors)}, url)
    else:
        results = []
        for rep in range(args.reps):
            for conc in ((1, args.concurrency) if rep % 2 == 0 else (args.concurrency, 1)):
                state = {f"t{i}": distribute_tensor(torch.zeros(args.rows, args.cols), mesh, [Shard(0)])
                         for i in range(args.tensors)}
                storage = FsspecStorage(s3fs.S3FileSystem(), read_concurrency=conc)
                counts.clear()
                dist.barrier()
                t0 = time.perf_counter()
                load(state, url, storage=storage, verify=args.verify)
                dist.barrier()
                took = time.perf_counter() - t0
                ok = all(torch.equal(state[f"t{i}"].full_tensor(), _full(args, i)) for i in range(args.tensors))
                results.append({"concurrency": conc, "s": took,
                                "requests": sum(v for k, v in counts.items() if not k.startswith("bytes")),
                                "gets": counts["get_object"], "ok": ok})
        out.put((rank, results))
    dist.destroy_process_group()


def _run(world: int, args, url: str, phase: str) -> dict[int, list]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, url, phase, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=args.timeout) for _ in range(world)) if phase == "load" else {}
    for p in procs:
        p.join(args.timeout)
        if p.exitcode != 0:
            raise RuntimeError(f"a {phase} rank failed (exit {p.exitcode})")
    return got


def requests(url: str) -> None:
    """``--requests``: see the module docstring."""
    from shardwise.checkpoint import load, save

    def state(v: float) -> dict:
        return {"w": torch.full((256, 256), v), "b": torch.arange(5) + int(v), "step": int(v)}

    steps = [("new", lambda: save(state(1.0), f"{url}/latest")),
             ("replace", lambda: save(state(2.0), f"{url}/latest")),
             ("replace again", lambda: save(state(3.0), f"{url}/latest")),
             ("step-1", lambda: save(state(1.0), f"{url}/step-1", keep_last=1)),
             ("rotate", lambda: save(state(2.0), f"{url}/step-2", keep_last=1)),
             ("rotate again", lambda: save(state(3.0), f"{url}/step-3", keep_last=1)),
             ("load", lambda: load(state(0.0), f"{url}/latest"))]
    counts = _counting()
    print("| step | requests | writes (PUT, COPY, DELETE) | COPY | bytes up | bytes down | bytes copied by the server |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for what, fn in steps:
        counts.clear()
        fn()
        n = sum(v for k, v in counts.items() if not k.startswith("bytes"))
        writes = sum(counts[k] for k in ("put_object", "copy_object", "delete_object", "delete_objects"))
        print(f"| {what} | {n} | {writes} | {counts['copy_object']} | {counts['bytes up']:,} | {counts['bytes down']:,} "
              f"| {counts['bytes copied']:,} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save-world", type=int, default=4)
    p.add_argument("--load-worlds", type=int, nargs="*", default=[2, 3])
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--verify", action="store_true")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--requests", action="store_true", help="count the requests and bytes of each step instead")
    args = p.parse_args(argv)
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                    break
            except OSError:
                time.sleep(0.1)
        os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                           "AWS_DEFAULT_REGION": "us-east-1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"})
        import s3fs

        s3fs.S3FileSystem().mkdir("bench")
        if args.requests:
            requests("s3://bench/requests")
            return
        url = "s3://bench/run/step-1"
        _run(args.save_world, args, url, "save")
        mib = args.tensors * args.rows * args.cols * 4 / 2**20
        print(f"{args.tensors} tensors, {mib:.0f} MiB, saved on {args.save_world} ranks; verify={args.verify}")
        print("| load | read_concurrency | time (rank 0, median) | requests (busiest rank) | of which GET |")
        print("| --- | --- | --- | --- | --- |")
        for world in args.load_worlds:
            got = _run(world, args, url, "load")
            assert all(r["ok"] for rs in got.values() for r in rs), "a load read wrong values"
            for conc in (1, args.concurrency):
                times = [r["s"] for r in got[0] if r["concurrency"] == conc]
                req = max(next(r["requests"] for r in rs if r["concurrency"] == conc) for rs in got.values())
                gets = max(next(r["gets"] for r in rs if r["concurrency"] == conc) for rs in got.values())
                print(f"| {args.save_world} -> {world} | {conc} | {statistics.median(times):.2f} s | {req} | {gets} |")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
