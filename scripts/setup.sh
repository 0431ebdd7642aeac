#!/usr/bin/env bash
# Idempotent setup for a fresh Debian 12 machine (run as root): Debian packages for the
# MLIR/PJRT build, the project virtualenv (.venv) and the release abi3 wheel of the extension.
# A second run with everything present only re-checks stamps and lets cargo find nothing to do.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

APT_PACKAGES=(
  libmlir-22-dev mlir-22-tools llvm-22-dev libclang-22-dev clang-22
  libpolly-22-dev libzstd-dev protobuf-compiler libprotobuf-dev pkg-config build-essential
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
# Reinstall Python requirements only when a requirements file changes.
req_hash=$(cat requirements.txt requirements-nodeps.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/.requirements.sha256 2>/dev/null)" != "$req_hash" ]; then
  echo "setup: installing Python requirements"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
  .venv/bin/python -m pip install -q --no-deps -r requirements-nodeps.txt
  echo "$req_hash" > .venv/.requirements.sha256
fi

# Build the extension as a release abi3 wheel; install it only when the wheel changed.
if ! log=$(.venv/bin/maturin build --release -i .venv/bin/python -o target/wheels 2>&1); then
  echo "$log"; echo "setup: building the extension failed" >&2; exit 1
fi
wheel=$(ls -t target/wheels/tpu_dynamo-*.whl | head -1)
wheel_hash=$(sha256sum "$wheel" | cut -d' ' -f1)
if [ "$(cat .venv/.wheel.sha256 2>/dev/null)" != "$wheel_hash" ]; then
  .venv/bin/python -m pip install -q --force-reinstall --no-deps "$wheel"
  echo "$wheel_hash" > .venv/.wheel.sha256
fi
echo "setup: ready ($ROOT/.venv)"
