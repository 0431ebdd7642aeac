#!/usr/bin/env bash
# Issue #6's GPU run in one go, for a session lent the H200 machine (DEVELOPERS.md, `device`).
# That machine reaches nothing outside it, so it brings its own PyTorch with CUDA and the XLA CUDA
# PJRT plugin (jax-cuda13-pjrt's; /opt/torch/.venv, torch 2.11), while our wheel and diffusers
# (not installed there) come with the working tree. After `make setup` here, and once
#     echo /.whl/ >> .git/info/exclude
#     .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux_2_28_x86_64 -d .whl diffusers==0.42.1 importlib_metadata
# run it from the repository root as
#     run(command="bash bench/device.sh", carry=["target/wheels", ".whl"], timeout_s=580)
# (2026-12-04: the self-check, doctor and tests took ~40 s, the first group ~200 s with two of its
# models failing early; the whole run should fit 580 s; a 15-minute budget then has no room for a
# second full run, so narrow a retry with BENCH_GROUPS.)
# It writes into $OUT (else out/device), as device.tgz: the machine, the self-check and `doctor`, the CUDA half of
# tests/test_on_device.py (CUDA tensors in and out, against eager CUDA), a profile of the micro
# graph's call beside Inductor's (bench/profile_call.py), and `bench.py --device
# cuda --dtype bf16` (every backend on CUDA tensors) in groups, each its own table
# (RESULTS-<label>.md, its JSON and chart): copy those into bench/ and read them in their prose.
# BENCH_GROUPS narrows the run to the time the session has left; BENCH_SECONDS bounds each group.
set -uo pipefail
cd "$(dirname "$0")/.."
# What comes back is at most 8 files: everything is written to $work and bundled into one archive
# in $OUT (the log and the test's output beside it).
out=${OUT:-out/device}
work=/tmp/tpu_dynamo_device_out
mkdir -p "$out" "$work"
log() { echo "device: $*" | tee -a "$work/log.txt"; }
# After each step, so that a run the call's time limit stops still brings back what it did.
bundle() { tar -czf "$out/device.tgz" -C "$work" . && cp "$work/log.txt" "$out/"; }

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
"$python" -m pip install -q --no-deps --no-index --upgrade --target "$target" "$wheel" .whl/*.whl 2>>"$work/log.txt" \
  || { log "wheel install failed"; exit 1; }
export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi > "$work/nvidia-smi.txt" 2>&1
"$python" -m tpu_dynamo > "$work/selfcheck.txt" 2>&1; log "self-check exit $?"
"$python" -m tpu_dynamo doctor > "$work/doctor.txt" 2>&1; log "doctor exit $?"
bundle

export PYTHONUNBUFFERED=1
timeout 150 "$python" -m pytest -q -p no:cacheprovider tests/test_on_device.py -k cuda > "$work/test_on_device.txt" 2>&1
log "test_on_device exit $?"
cp "$work/test_on_device.txt" "$out/"
# Where the micro graph's call goes outside our callable on the GPU (0.2 ms on 2026-12-04; 16 µs on CPU).
timeout 120 "$python" bench/profile_call.py --model micro --device cuda --dtype bf16 > "$work/profile_micro.txt" 2>&1
log "profile_call exit $?"
bundle

# label:models; a group's table is written only when all its models are done, so a group the
# timeout cuts short leaves nothing, and the groups before it stand. First what no GPU run has
# measured yet (the transformers rows and the decode; 2026-12-04 they failed on a constant since
# fixed), then the rows measured then, against the same build.
groups=${BENCH_GROUPS:-"cuda-bf16-transformers:gpt2-b1 gpt2-b8 llama-b1 llama-b8
cuda-bf16-decode:llama-decode
cuda-bf16:sd3 flux micro
cuda-bf16-full-size:smollm-135m-b1 sd35-medium-2l"}
while IFS=: read -r label models; do
  [ -n "$label" ] || continue
  # shellcheck disable=SC2086  # the model names are words
  timeout "${BENCH_SECONDS:-300}" "$python" bench/bench.py --device cuda --dtype bf16 --no-cold \
    --processes 1 --calls 20 --label "$label" --models $models > "$work/bench-$label.txt" 2>&1
  log "bench $label exit $? ($models)"
  cp "bench/RESULTS-$label.md" "bench/results-$label.json" "bench/ratios-$label.png" "$work/" 2>/dev/null
  bundle
done <<< "$groups"
ls -la "$work" | tee -a "$work/log.txt"
bundle
tail -n 15 "$work"/test_on_device.txt "$work"/bench-*.txt
