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


# TorchTPU's bucketing keys, their valid ranges and defaults: a symbolic size n up to
# bucket_size * num_dynamic_buckets is padded to the next multiple of bucket_size, where the
# compiler proves padding safe for the graph (see `Buckets`).
_BUCKET_RANGES: dict[str, tuple[int, int]] = {"num_dynamic_buckets": (1, 8), "bucket_size": (1, 1 << 20)}
_BUCKET_DEFAULTS = {"num_dynamic_buckets": 8, "bucket_size": 128}


@dataclass(frozen=True)
class Buckets:
    size: int
    count: int

    def pad(self, n: int) -> int:
        """The bucket of size `n`: the next multiple of `size`, or `n` itself past the last one."""
        return n if n > self.size * self.count else -(-n // self.size) * self.size


@dataclass(frozen=True)
class PowersOfTwo:
    """What a symbolic graph pads to, where safe, when the user chose no buckets and its sizes
    keep changing or grow with each call (a decode step; see `symbolic`): at most twice the work
    of the true size, whatever the dimension (a sequence, a batch), and one executable per
    doubling."""

    @staticmethod
    def pad(n: int) -> int:
        return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class Options:
    debug_callback: DebugCallback | None = None
    name: str | None = None
    buckets: Buckets | None = None
    """Set when `num_dynamic_buckets` or `bucket_size` was given (the other at its default)."""
    precompute_weights: bool = True
    """Whether values computed from weights alone are computed once per weight version and kept
    (hoist.py), at the memory they take: at most the weights they come from."""


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
    own = ("debug_callback", "name", "precompute_weights", *_BUCKET_RANGES)
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
    precompute = opts.get("precompute_weights", True)
    if type(precompute) is not bool:
        raise TypeError(f"tpu_dynamo: precompute_weights must be a bool, got {type(precompute).__name__}")
    graph_name = opts.get("name", name)
    if graph_name is not None and not isinstance(graph_name, str):
        raise TypeError(f"tpu_dynamo: name must be a str, got {type(graph_name).__name__}")
    buckets = None
    if any(opts.get(key) is not None for key in _BUCKET_RANGES):
        given = {k: opts.get(k) or default for k, default in _BUCKET_DEFAULTS.items()}
        buckets = Buckets(size=given["bucket_size"], count=given["num_dynamic_buckets"])
    return Options(debug_callback=callback, name=graph_name, buckets=buckets, precompute_weights=precompute)
