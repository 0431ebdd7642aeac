"""Shared reporting for the examples: eager-vs-compiled difference and compile/hit counts."""
import torch

import tpu_dynamo


def max_abs_diff(eager: torch.Tensor, compiled: torch.Tensor) -> float:
    return (eager.float() - compiled.float()).abs().max().item()


def report(name: str, eager: torch.Tensor, compiled: torch.Tensor, **extra) -> dict:
    stats = tpu_dynamo.stats()
    row = {
        "example": name,
        "max_abs_diff": max_abs_diff(eager, compiled),
        "output_scale": eager.float().abs().max().item(),
        "compiles": stats["compiles"],
        "disk_hits": stats["disk_hits"],
        "executions": stats["executions"],
        **extra,
    }
    print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return row
