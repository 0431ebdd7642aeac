#!/usr/bin/env bash
# Issue #6's GPU run in one go, for a session lent the H200 machine (DEVELOPERS.md, `device`).
# That machine reaches nothing outside it, so it brings its own PyTorch with CUDA and the XLA CUDA
# PJRT plugin (jax-cuda13-pjrt's; 2026-11-30: /opt/torch/.venv, torch 2.11), and our wheel comes
# with the working tree: run it from the repository root as
#     run(command="bash bench/device.sh", carry=["target/wheels"], timeout_s=540)
# after `make setup` here. It writes into $OUT (else out/device): the machine, the self-check and
# `doctor`, and `bench.py --device cuda --dtype bf16` (RESULTS-cuda-bf16.md, its JSON and chart);
# copy those into bench/ and read them in RESULTS-cuda-bf16.md's prose.
# MODELS and BENCH_SECONDS (default 420) narrow the run to the time the session has left.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/device}
mkdir -p "$out"
log() { echo "device: $*" | tee -a "$out/log.txt"; }

python=""
for candidate in "${PYTHON:-}" /opt/torch/.venv/bin/python python3; do
  if [ -n "$candidate" ] && "$candidate" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    python=$candidate
    break
  fi
done
[ -n "$python" ] || { log "no Python with a CUDA build of torch (set PYTHON)"; exit 1; }
log "python $python: $("$python" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)')"

plugin=${TPU_DYNAMO_PJRT_PLUGIN:-$("$python" - <<'EOF'
import glob, site, sys
for root in [*site.getsitepackages(), *sys.path]:
    for found in sorted(glob.glob(f"{root}/jax_plugins/xla_cuda*/xla_cuda_plugin.so")):
        print(found)
        raise SystemExit
EOF
)}
[ -n "$plugin" ] || { log "no XLA CUDA PJRT plugin found (install jax-cuda13-pjrt or set TPU_DYNAMO_PJRT_PLUGIN)"; exit 1; }
export TPU_DYNAMO_PJRT_PLUGIN=$plugin
log "plugin $plugin"

wheel=$(ls -t target/wheels/tpu_dynamo-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || { log "no wheel in target/wheels: run make setup here and carry target/wheels"; exit 1; }
# Our wheel in a directory of its own on the machine's Python's path (no index is reachable, and
# nothing else is needed; a venv would not see the packages of a Python that is itself a venv's).
target=/tmp/tpu_dynamo_device
"$python" -m pip install -q --no-deps --no-index --upgrade --target "$target" "$wheel" || { log "wheel install failed"; exit 1; }
export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1
"$python" -m tpu_dynamo > "$out/selfcheck.txt" 2>&1; log "self-check exit $?"
"$python" -m tpu_dynamo doctor > "$out/doctor.txt" 2>&1; log "doctor exit $?"

# The models of the 2026-11-30 run by default: the table is written only when every model is done,
# so a run the timeout cuts short leaves nothing.
models=${MODELS:-gpt2-b8 llama-b8 sd3 flux micro}
# shellcheck disable=SC2086  # the model names are words
timeout "${BENCH_SECONDS:-420}" "$python" bench/bench.py --device cuda --dtype bf16 --no-cold \
  --processes 1 --calls 20 --models $models > "$out/bench.txt" 2>&1
log "bench exit $? ($models)"
cp bench/RESULTS-cuda-bf16.md bench/results-cuda-bf16.json bench/ratios-cuda-bf16.png "$out/" 2>/dev/null
ls -la "$out" | tee -a "$out/log.txt"
