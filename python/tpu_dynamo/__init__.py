"""tpu_dynamo: a torch.compile backend that lowers FX graphs to StableHLO and runs them on PJRT.

Use it as `torch.compile(model, backend="tpu")` (or `"tpu_dynamo"`); the names come from the
package's `torch_dynamo_backends` entry points, so no import is needed.
"""
import os as _os
import site as _site
import sys as _sys

# The Rust plugin discovery looks for PJRT plugins (xla-cpu-pjrt, libtpu) in these directories.
_os.environ.setdefault(
    "TPU_DYNAMO_SITE_PACKAGES",
    _os.pathsep.join(dict.fromkeys([*_site.getsitepackages(), *filter(None, _sys.path)])),
)

import atexit as _atexit  # noqa: E402

from ._native import (  # noqa: E402
    LowerError,
    PjrtError,
    PluginNotFoundError,
    __version__,
    cache_clear,
    cache_info,
    cache_list,
    device_info,
    finish_background_work as _finish_background_work,
    reset_stats,
    stats,
)

# A process must not tear the plugin down under a warm-up's execute or a background load.
_atexit.register(_finish_background_work)

__all__ = [
    "LowerError",
    "PjrtError",
    "PluginNotFoundError",
    "__version__",
    "cache_clear",
    "cache_info",
    "cache_list",
    "device_info",
    "reset_stats",
    "stats",
]
