#!/usr/bin/env bash
# The Python tests against another PyTorch release: `scripts/test-torch.sh 2.11.0 [pytest args]`.
# Builds the wheel as `make setup` does, then an environment of its own (.venv-torch-VERSION:
# that torch from PyPI with its CUDA libraries, ~3 GB, the requirements resolved against it, the
# embedded plugin and the wheel) and runs the suite there. Idempotent like setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/test-torch.sh TORCH_VERSION [pytest args]}
shift
bash scripts/setup.sh
venv=.venv-torch-$version
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
stamp=$(cat requirements.txt requirements-nodeps.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$venv/.requirements.sha256" 2>/dev/null)" != "$stamp" ]; then
  echo "test-torch: installing torch $version and the requirements into $venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r <(grep -v "^torch==" requirements.txt) "torch==$version"
  "$venv/bin/python" -m pip install -q --no-deps -r requirements-nodeps.txt
  echo "$stamp" > "$venv/.requirements.sha256"
fi
wheel=$(ls -t target/wheels/tpu_dynamo-*.whl | head -1)
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$wheel"
"$venv/bin/python" -c "import torch; print('test-torch: torch', torch.__version__)"
exec "$venv/bin/python" -m pytest -q tests "$@"
