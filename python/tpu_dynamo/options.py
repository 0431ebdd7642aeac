"""`torch.compile(backend="tpu", options={...})`: TorchTPU's option keys, validated up front."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DebugCallback = Callable[[dict[str, Any]], None]
"""Receives one dict per compiled graph: `name`, `fx_code`, `stablehlo`, `graph_hash`."""

# TorchTPU's keys that we accept but only at their default (not implemented yet).
_UNIMPLEMENTED_DEFAULTS: dict[str, Any] = {
    "serializable": False,
    "async_compile": False,
}


# TorchTPU's bucketing keys and their valid ranges. Accepted; graphs still compile per exact
# shape, because padding a dynamic dim is only correct when no op mixes positions along it
# (softmax, reductions, cumsum over it would read the padding), which nothing proves yet.
_BUCKET_RANGES: dict[str, tuple[int, int]] = {"num_dynamic_buckets": (1, 8), "bucket_size": (1, 1 << 20)}


@dataclass(frozen=True)
class Options:
    debug_callback: DebugCallback | None = None
    name: str | None = None
    buckets_requested: bool = False
    """`num_dynamic_buckets`/`bucket_size` was given: symbolic graphs log that shapes stay exact."""


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
    own = ("debug_callback", "name", *_BUCKET_RANGES)
    for key in opts:
        if key not in _UNIMPLEMENTED_DEFAULTS and key not in own:
            known = ", ".join(sorted([*_UNIMPLEMENTED_DEFAULTS, *own]))
            raise TypeError(f"tpu_dynamo: unknown option {key!r}; known options: {known}")
    for key, (low, high) in _BUCKET_RANGES.items():
        value = opts.get(key)
        if value is not None and (type(value) is not int or not low <= value <= high):
            raise ValueError(f"tpu_dynamo: {key} must be an int in {low}..{high}, got {value!r}")
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
    buckets = any(opts.get(key) is not None for key in _BUCKET_RANGES)
    return Options(debug_callback=callback, name=graph_name, buckets_requested=buckets)
