#!/usr/bin/env bash
# The device check, as one short script for a machine with one or more NVIDIA GPUs (no network
# needed: shardwise is installed from this checkout without its dependencies, which the
# machine's torch image already has):
#
#   bash benchmarks/gpu_check.sh                 # CUDA/NCCL facts, then benchmarks/gpu_step.py
#                                                # (its CPU-offload check first: grads must end on cpu),
#                                                # then its float8 step (--float8, when torchao imports)
#   GPU_CHECK_ARGS="--device cpu --dim 64 --layers 2 --seq-len 32 --steps 2" bash benchmarks/gpu_check.sh
#                                                # the same on CPU (a smoke run of this script)
#
# Writes everything it prints to $OUT/gpu_check.log when OUT is set (the device tool's output
# folder), else to /tmp/gpu_check.log. Each step has its own time limit, so a hang cannot eat
# the machine's whole lease. Exit status: that of the benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-/tmp}/gpu_check.log"
PY="${PYTHON:-python3}"
SITE=/tmp/shardwise-site
export PYTHONUNBUFFERED=1
{
  echo "== machine"
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  echo "== install shardwise from this checkout (no dependencies, no network)"
  rm -rf "$SITE" build  # build/: a stale in-tree build would be installed instead of the sources
  timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" . || exit 3
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "== torch, CUDA, NCCL"
  timeout 60 "$PY" - <<'EOF'
import torch, torch.distributed as dist
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| available", torch.cuda.is_available())
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
    print("NCCL", ".".join(map(str, torch.cuda.nccl.version())), "| nccl backend", dist.is_nccl_available())
import shardwise.composable, shardwise.checkpoint, shardwise.mesh
print("shardwise imports from", shardwise.composable.__file__)
EOF
  echo "== benchmarks/gpu_step.py ${GPU_CHECK_ARGS:-}"
  # shellcheck disable=SC2086
  timeout 420 "$PY" benchmarks/gpu_step.py ${GPU_CHECK_ARGS:-}
  status=$?
  echo "== benchmarks/gpu_step.py --float8 ${GPU_CHECK_ARGS:-} (torchao float8 training, float8 all-gather)"
  if timeout 60 "$PY" -c "import torchao.float8" 2>/dev/null; then
    # shellcheck disable=SC2086
    timeout 300 "$PY" benchmarks/gpu_step.py --float8 --reps 3 ${GPU_CHECK_ARGS:-} || echo "float8 step FAILED ($?)"
  else
    echo "torchao is not installed on this machine: no float8 step"
  fi
  exit $status
} 2>&1 | tee "$LOG"
