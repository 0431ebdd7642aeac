"""A small MLP compiled with backend="tpu" and compared with eager."""
import torch

import tpu_dynamo
from _report import report


def main() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.SiLU(), torch.nn.Linear(256, 10)
    ).eval()
    x = torch.randn(32, 64)
    compiled = torch.compile(model, backend="tpu", fullgraph=True)
    tpu_dynamo.reset_stats()
    with torch.no_grad():
        eager = model(x)
        out = compiled(x)
        compiled(torch.randn(32, 64))  # same size: served from the executable cache
    return report("mlp", eager, out)


if __name__ == "__main__":
    main()
