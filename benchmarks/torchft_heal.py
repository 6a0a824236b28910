"""A replica group lost and healed under torchft: torch's FSDP2 beside shardwise.

    python benchmarks/torchft_heal.py                       # widths 1024 and 65536, both implementations
    python benchmarks/torchft_heal.py --widths 65536 --ranks 4     # 2 groups of 4 ranks

Runs `tests.compat._torchft_groups.kill_and_heal` (2 replica groups x 2 CPU gloo ranks, a
lighthouse on 127.0.0.1; torchtitan's FTManager wiring, `tests/compat/_torchft_rank.py`) once per
implementation and model width (``Linear(8, W) -> ReLU -> Linear(W, 8)``, AdamW): group 1 loses a
rank by ``os._exit`` at step 3, restarts and heals, is killed whole by ``SIGKILL``, restarts and
heals again. From the ranks' step records it prints, per implementation and width:

    lost        steps the survivor (group 0) ran that did not commit (exact; target 0)
    steady      the survivor's median step time while both groups step
    down        its median step time while it is alone
    heal_peer   its step time on each step a peer healed from it (it serves its state then)
    heal        the healing group's step time on its heal step (receive + load + step), median of the 2 heals
    state       bytes of one rank's served state (model + optimizer shards): the full state / group size
    sent        bytes one rank sends per heal (torchft's HTTP body: the state serialized)

Counts and bytes are exact. Times are wall-clock medians on this machine, which other jobs load
(the load average is printed with them): compare the implementations within one run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.compat._torchft_groups import Cluster, kill_and_heal  # noqa: E402


def measure(impl: str, width: int, workdir: Path, ranks: int = 2) -> dict[str, float]:
    with Cluster(workdir, impl, ranks=ranks) as c:
        ev = kill_and_heal(c, pace=0.05, extra=("--width", str(width), "--measure-bytes"))
    surv = [r for r in c.records(0, 0)]
    healer = c.records(1, 0)
    heal_steps = {ev["back1"], ev["back2"]}
    steady = [r["t"] for r in surv if r["committed"] and r["participants"] == 2 and r["step"] not in heal_steps
              and r["step"] > 1]
    down = [r["t"] for r in surv if r["committed"] and r["participants"] == 1 and r["step"] not in heal_steps]
    heal_peer = [r["t"] for r in surv if r["step"] in heal_steps and r["committed"]]
    heal = [r["t"] for r in healer if r["step"] in heal_steps and not r["participating"]]
    final = c.final(0, 0)
    return {"lost": sum(not r["committed"] for r in surv), "steady": statistics.median(steady),
            "down": statistics.median(down), "heal_peer": statistics.median(heal_peer) if heal_peer else float("nan"),
            "heal": statistics.median(heal) if heal else float("nan"),
            "state": final["state_bytes"], "sent": final["sent_bytes"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[1024, 65536])
    p.add_argument("--impls", nargs="+", default=["torch", "shardwise"])
    p.add_argument("--ranks", type=int, nargs="+", default=[2], help="group sizes (ranks per replica group)")
    a = p.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    print("| impl | width | ranks | lost | steady ms | down ms | peer-heal step ms | heal step ms | state B/rank | sent B/rank |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for width, ranks in [(w, r) for w in a.widths for r in a.ranks]:
            for impl in a.impls:
                m = measure(impl, width, Path(tmp) / f"{impl}_{width}_{ranks}", ranks)
                print(f"| {impl} | {width} | {ranks} | {m['lost']} | {m['steady'] * 1e3:.1f} | {m['down'] * 1e3:.1f} | "
                      f"{m['heal_peer'] * 1e3:.1f} | {m['heal'] * 1e3:.1f} | {m['state']} | {m['sent']} |",
                      flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
