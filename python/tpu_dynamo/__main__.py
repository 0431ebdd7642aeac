"""`python -m tpu_dynamo [self-check | cache info|list|clear | doctor]`.

Without a command it runs the self-check: the plugin, the device and one compiled graph."""
from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time

import torch

import tpu_dynamo
from tpu_dynamo import _native


def self_check(_args: argparse.Namespace) -> int:
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
          f" (compile or disk cache), second {second * 1e3:.2f} ms")
    print(f"stats:    {tpu_dynamo.stats()}")
    ok = diff <= 1e-5
    print("self-check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


def _plugin_line() -> str:
    """The identity disk entries are bound to, or why there is none."""
    try:
        p = _native.plugin_identity()
    except (tpu_dynamo.PluginNotFoundError, OSError) as e:
        return f"unavailable ({e})"
    return (f"{p['platform']} {p['platform_version']}, PJRT {p['pjrt_api_version']},"
            f" XLA {p['xla_version'] or '?'}, library {p['library_hash'][:16]}")


def _print_cache_info() -> None:
    info = tpu_dynamo.cache_info()
    print(f"cache dir:     {info['dir'] or '(none)'}")
    print(f"cache mode:    {info['mode']}")
    print(f"cache entries: {info['entries']} ({info['bytes']} bytes of at most {info['max_bytes']})")
    print(f"cache graphs:  {info['graphs']} converted graphs ({info['graph_bytes']} bytes of at most {info['max_bytes']})")
    if info["warning"]:
        print(f"cache warning: {info['warning']}")


def cache(args: argparse.Namespace) -> int:
    if args.action == "info":
        _print_cache_info()
        print(f"plugin:        {_plugin_line()}")
    elif args.action == "list":
        for key, path, size, last_used in tpu_dynamo.cache_list():
            used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last_used))
            print(f"{key[:16]}  {size:>12}  {used}  {path}")
    else:
        try:
            removed = tpu_dynamo.cache_clear()
        except OSError as e:
            print(f"cannot clear the cache: {e}", file=sys.stderr)
            return 1
        print(f"removed {removed} entries from {tpu_dynamo.cache_info()['dir']}")
    return 0


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def doctor(_args: argparse.Namespace) -> int:
    """Everything a bug report needs; exits 1 if no plugin can be loaded."""
    print(
        f"tpu_dynamo:    {tpu_dynamo.__version__} (MLIR {_native.MLIR_VERSION},"
        f" compiler {_native.COMPILER_SOURCE_HASH[:16]})"
    )
    for dist in ("torch", "transformers", "diffusers"):
        print(f"{dist + ':':<15}{_version(dist)}")
    try:
        info = tpu_dynamo.device_info()
    except tpu_dynamo.PluginNotFoundError as e:
        print(f"plugin:        NOT FOUND ({e})")
        _print_cache_info()
        return 1
    print(f"plugin:        {info['plugin']}")
    print(f"plugin id:     {_plugin_line()}")
    print(f"platform:      {info['platform']} ({info['platform_version']})")
    print(f"devices:       {', '.join(info['devices'])}")
    print(f"host kernels:  {', '.join(info['host_kernels']) or 'none (TPU_DYNAMO_HOST_KERNELS=0, or not this plugin or CPU)'}")
    _print_cache_info()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_dynamo", description=__doc__)
    parser.set_defaults(run=self_check)
    commands = parser.add_subparsers(title="commands")
    commands.add_parser("self-check", help="compile and run one graph (the default)").set_defaults(run=self_check)
    cache_parser = commands.add_parser("cache", help="inspect or clear the persistent executable cache")
    cache_parser.add_argument("action", choices=["info", "list", "clear"])
    cache_parser.set_defaults(run=cache)
    commands.add_parser("doctor", help="versions, plugin, devices and cache state").set_defaults(run=doctor)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
