"""`torch.compile(backend="tpu", options={...})`: TorchTPU's option keys, validated up front."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DebugCallback = Callable[[dict[str, Any]], None]
"""Receives one dict per compiled graph: `name`, `fx_code`, `stablehlo`, `graph_hash`."""

# TorchTPU's keys that we accept but only at their default (not implemented yet).
_UNIMPLEMENTED_DEFAULTS: dict[str, Any] = {
    "num_dynamic_buckets": None,
    "bucket_size": None,
    "serializable": False,
    "async_compile": False,
}


@dataclass(frozen=True)
class Options:
    debug_callback: DebugCallback | None = None
    name: str | None = None


def parse(options: Mapping[str, Any] | None, mode: str | None, name: str | None) -> Options:
    """Validates the backend's keyword arguments.

    `mode` reaches a custom backend as a keyword only when it is not "default" (torch.compile
    forwards it to every backend since 2.x); its values are Inductor presets, meaningless here.
    """
    if mode is not None and mode != "default":
        raise ValueError(
            f"tpu_dynamo: mode={mode!r} is an Inductor preset and is not supported by backend 'tpu';"
            " drop mode= (and pass backend options through options={...})"
        )
    opts = dict(options or {})
    for key in opts:
        if key not in _UNIMPLEMENTED_DEFAULTS and key not in ("debug_callback", "name"):
            known = ", ".join(sorted([*_UNIMPLEMENTED_DEFAULTS, "debug_callback", "name"]))
            raise TypeError(f"tpu_dynamo: unknown option {key!r}; known options: {known}")
    for key, default in _UNIMPLEMENTED_DEFAULTS.items():
        if key in opts and opts[key] != default:
            raise NotImplementedError(
                f"tpu_dynamo: option {key}={opts[key]!r} is not implemented yet (only {default!r})"
            )
    callback = opts.get("debug_callback")
    if callback is not None and not callable(callback):
        raise TypeError(f"tpu_dynamo: debug_callback must be callable, got {type(callback).__name__}")
    graph_name = opts.get("name", name)
    if graph_name is not None and not isinstance(graph_name, str):
        raise TypeError(f"tpu_dynamo: name must be a str, got {type(graph_name).__name__}")
    return Options(debug_callback=callback, name=graph_name)
