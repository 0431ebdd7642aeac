"""What a compile leaves behind for people: the INFO log line, `TPU_DYNAMO_DUMP_DIR` files and
the `debug_callback` option."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from .options import Options

log = logging.getLogger("tpu_dynamo")


def wanted(options: Options) -> bool:
    """Whether `report` will use the StableHLO text (a disk cache hit only lowers for it then)."""
    return bool(os.environ.get("TPU_DYNAMO_DUMP_DIR")) or options.debug_callback is not None


def report(options: Options, *, fx_code: str, stablehlo: str | None, graph_hash: str) -> None:
    """Writes the graph's FX code and StableHLO to `$TPU_DYNAMO_DUMP_DIR` (if set) and hands
    them to the `debug_callback` option (if given); `stablehlo` is set whenever `wanted`."""
    name = options.name or "graph"
    dump_dir = os.environ.get("TPU_DYNAMO_DUMP_DIR")
    if dump_dir:
        stem = Path(dump_dir) / f"{name}-{graph_hash[:16]}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{stem}.fx.py").write_text(fx_code)
        Path(f"{stem}.stablehlo.mlir").write_text(stablehlo)
        log.debug("dumped %s.{fx.py,stablehlo.mlir}", stem)
    if options.debug_callback is not None:
        options.debug_callback(
            {"name": name, "fx_code": fx_code, "stablehlo": stablehlo, "graph_hash": graph_hash}
        )
