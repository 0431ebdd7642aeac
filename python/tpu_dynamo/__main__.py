"""`python -m tpu_dynamo`: a self-check of the plugin, the device and one compiled graph."""
from __future__ import annotations

import sys
import time

import torch

import tpu_dynamo


def main() -> int:
    info = tpu_dynamo.device_info()
    print(f"tpu_dynamo {tpu_dynamo.__version__}, torch {torch.__version__}")
    print(f"plugin:   {info['plugin']}")
    print(f"platform: {info['platform']} ({info['platform_version']})")
    print(f"devices:  {', '.join(info['devices'])}")

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ y + 1.0)

    x, y = torch.randn(4, 8), torch.randn(8, 3)
    compiled = torch.compile(f, backend="tpu", fullgraph=True)
    with torch.no_grad():
        start = time.perf_counter()
        got = compiled(x, y)
        first = time.perf_counter() - start
        start = time.perf_counter()
        compiled(x, y)
        second = time.perf_counter() - start
    diff = (got - f(x, y)).abs().max().item()
    print(f"tanh(x @ y + 1): max abs diff vs eager {diff:.2e}; first call {first * 1e3:.0f} ms"
          f" (compile), second {second * 1e3:.2f} ms")
    print(f"stats:    {tpu_dynamo.stats()}")
    ok = diff <= 1e-5
    print("self-check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
