"""tpu_dynamo: a torch.compile backend that lowers FX graphs to StableHLO and runs them on PJRT."""
from ._native import __version__

__all__ = ["__version__"]
