"""Converted graphs found again by the Dynamo graph they came from, so that a new process
neither runs AOTAutograd nor converts: of a warm first call (our executables on disk) these took
~20-35 % (gpt2-b1 0.45 of 2.0 s, sd3 0.9 of 2.5, the UNet 1.6 of 4.8), Dynamo's tracing the rest.

Only graphs the backend calls without AOTAutograd's wrapper are stored (`direct.wrapper_free`:
a converted graph is all a call needs, or for a graph with symbolic sizes its `symbolic.Traced`)
with no debug output wanted. The key is a digest of everything AOTAutograd's output and our
conversion depend on, and a graph whose dependencies it cannot name is not stored:

- the Dynamo graph's code, and what each call in it names (the ATen/prims op, or the torch or
  builtin function, as AOTAutograd's own cache accepts them: `check_node_safe`). Graphs with
  submodules, attributes (constants, subgraphs) or ops of other namespaces (custom ops, whose
  Python may change between processes) are left out;
- per input: type, where it comes from (parameter, buffer, constant, user), dtype, device,
  layout, sizes, strides, storage offset (symbolic where traced so), grad and inference flags,
  and which earlier input shares its storage; a size argument's symbol;
- what the trace knows of its size symbols (`shape_facts`). A symbolic graph is stored only where
  AOTAutograd added nothing to that (no guard of its own): a process that finds the graph skips
  AOTAutograd, so Dynamo's guards for the frame are built without it;
- the state AOTAutograd traces under: grad and inference mode, autocast per device type,
  deterministic algorithms, the default dtype, the SDPA backend switches, functorch's config;
- this build (the compiler's source hash, the version, every source file of this package),
  PyTorch's version and Python's.

Entries live in the disk cache's `graphs/` subdirectory (`_native.graph_get`): the same trust
rules, mode, damage checks and size bound as executables. They are pickles, read only from a
directory those rules let this user trust, as Dynamo's precompile artifacts are.
"""
from __future__ import annotations

import functools
import hashlib
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

from . import _native, debug
from .convert import Converted, InputKind
from .options import Options
from .symbolic import Traced

try:
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_node_safe
except ImportError:  # another PyTorch: without its rules, nothing is stored
    check_node_safe = None

_NAMESPACES = ("aten", "prims")


def key(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    kinds: Sequence[InputKind],
    options: Options,
    facts: tuple[str, ...],
) -> bytes | None:
    """The graph's key, or None where it must be traced (see the module docs); `facts`: the
    trace's `shape_facts`."""
    if check_node_safe is None or debug.wanted(options):
        return None
    digest = hashlib.blake2b(_salt(), digest_size=32)

    def field(value: Any) -> None:
        data = value.encode() if isinstance(value, str) else repr(value).encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)

    field(gm.code)
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            return None
        if node.op in ("call_function", "call_method"):
            target = _target_name(node)
            if target is None:
                return None
            field((node.name, target))
    storages: dict[int, int] = {}
    placeholders = gm.graph.find_nodes(op="placeholder")
    for i, (x, kind, node) in enumerate(zip(example_inputs, kinds, placeholders, strict=True)):
        if isinstance(x, torch.SymInt):
            field(("SymInt", str(x.node.expr)))
            continue
        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            return None
        shared = storages.setdefault(x.untyped_storage().data_ptr(), i) if x.numel() else i
        # Traced with symbolic sizes, the graph's sizes are its placeholders' (`s0`, `2*s0`).
        traced = node.meta.get("example_value", x)
        field((type(x).__name__, kind.value, x.dtype, x.device, x.layout, str(traced.shape), str(traced.stride()),
               str(traced.storage_offset()), x.requires_grad, x.is_inference(), shared))
    field(facts)
    field(_tracing_state())
    field((options.name, options.buckets, options.precompute_weights))
    return digest.digest()


def shape_facts() -> tuple[str, ...]:
    """What the trace being compiled knows of its size symbols (their ranges, replacements,
    guards, divisibility and deferred assertions): AOTAutograd traces a symbolic graph under
    them, and Dynamo builds the frame's guards from them after the backend returns."""
    context = torch._guards.TracingContext.try_get()
    env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
    if env is None:
        return ()
    return (
        str(sorted((str(k), str(v)) for k, v in env.var_to_range.items())),
        str(sorted((str(k), str(v)) for k, v in env.replacements.items())),
        str([str(g.expr) for g in env.guards]),
        str(sorted(map(str, env.divisible))),
        str(sorted((str(k), [str(a.expr) for a in v]) for k, v in env.deferred_runtime_asserts.items())),
    )


def load(graph_key: bytes) -> Converted | Traced | None:
    payload = _native.graph_get(graph_key)
    if payload is None:
        return None
    try:
        graph = pickle.loads(payload)
    except Exception as e:  # written by this build (the key says so), so only damage gets here
        debug.log.warning("disk cache: converted graph unreadable (%s); converting again", e)
        return None
    return graph if isinstance(graph, (Converted, Traced)) else None


def store(graph_key: bytes, graph: Converted | Traced) -> None:
    """Keeps `graph` for the next process, where it pickles: the cache only saves work, so a
    graph holding something that does not (an object of the user's) is converted again there."""
    try:
        payload = pickle.dumps(graph, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        debug.log.info("disk cache: converted graph not kept (%s: %s)", type(e).__name__, e)
        return
    _native.graph_put(graph_key, payload)


def _target_name(node: torch.fx.Node) -> str | None:
    """What a call names, where AOTAutograd's output for it is fixed by the key's versions."""
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = str(target)  # e.g. aten.add.Tensor, or aten.add for a packet
        return name if name.split(".")[0] in _NAMESPACES else None
    try:
        check_node_safe(node)
    except BypassAOTAutogradCache:
        return None
    if isinstance(target, str):  # a method of a tensor
        return target
    return f"{getattr(target, '__module__', None)}.{getattr(target, '__qualname__', target)}"


def _tracing_state() -> tuple[Any, ...]:
    autocast = tuple(
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in torch._C._autocast_supported_devices()
    )
    sdpa = tuple(
        getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
        for name in ("flash", "mem_efficient", "math", "cudnn")
    )
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        autocast,
        torch.are_deterministic_algorithms_enabled(),
        torch.get_default_dtype(),
        sdpa,
        sorted(torch._functorch.config.get_config_copy().items()),
    )


@functools.cache
def _salt() -> bytes:
    """This build, PyTorch's and Python's versions: a key from another one never matches."""
    digest = hashlib.blake2b(digest_size=32)
    for part in (_native.__version__, _native.COMPILER_SOURCE_HASH, torch.__version__, torch.version.git_version,
                 sys.version):
        digest.update(part.encode() + b"\0")
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.digest()
