"""Dynamo's caching precompile with backend="tpu": a second process loads the first one's frames
and our artifacts, so its first call neither traces nor compiles (python/tpu_dynamo/precompile.py)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import TORCH_VERSION

# Older caching precompile traces these frames again or fails whatever the backend (torch 2.11:
# generate()'s CLASS_MATCH guard cannot be serialized; 2.13: loading generate()'s frames raises
# in Dynamo's guard building, with Inductor too); torch 2.15's stores and loads them.
_STORED_BY_TORCH_2_15 = pytest.mark.skipif(TORCH_VERSION < (2, 15), reason="needs torch 2.15's caching precompile")

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    torch._dynamo.config.caching_precompile = True
    import tpu_dynamo
    from torch._dynamo.utils import counters

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x):
            self.steps.add_(1)  # an input mutation inside the graph
            return torch.tanh(self.lin(x) * self.scale), x.sum(-1)

    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        got = torch.compile(m, backend="tpu", fullgraph=True)(x)
        steps = m.steps.item()
        m.steps.zero_()
        want = Block.forward(m, x)
    if sys.argv[1] == "save":
        torch.compiler.save_cache_artifacts()
    stats = tpu_dynamo.stats()
    print(json.dumps({
        "diff": max((g - w).abs().max().item() for g, w in zip(got, want)),
        "steps": steps,
        "graphs_traced": counters["stats"]["unique_graphs"],
        "compiles": stats["compiles"],
        "warm_ups": stats["warm_ups"],
        "dynamo_cache": dict(counters["dynamo_cache"]),
    }))
    """
)


def _save_then_load(tmp_path, script=SCRIPT, save=("save",), load=("load",)):
    """The reports of `script` run with arguments `save`, then in a new process with `load`, on
    the same Dynamo and tpu_dynamo caches under `tmp_path`."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch"), "TPU_DYNAMO_CACHE_DIR": str(tmp_path / "tpu")}
    return _run(save, env, script), _run(load, env, script)


def _run(args, env, script):
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_loads_precompiled_frames_without_tracing_or_compiling(tmp_path):
    first, second = _save_then_load(tmp_path)
    assert first["dynamo_cache"] == {"dynamo_cache_miss": 1} and first["compiles"] == 1
    assert second["dynamo_cache"] == {"dynamo_cache_hit": 1}
    # Nothing traced; the executable came from our disk cache.
    assert (second["graphs_traced"], second["compiles"]) == (0, 0)
    assert first["graphs_traced"] == 1
    for r in (first, second):
        assert r["diff"] <= 1e-6
        assert r["steps"] == 1  # the in-graph buffer update lands without AOTAutograd's wrapper
        # The executable ran once on zeros while Dynamo built the frame (its zeros for the
        # updated buffer were its own: `steps` saw one update).
        assert r["warm_ups"] == 1


# Counts Dynamo's guard builds and their guards; the frame is saved after its first call, then
# called with another shape, which its guards (loaded ones in the second process) must refuse.
GUARD_BUILDS = textwrap.dedent(
    """
    import json, sys, torch
    torch._dynamo.config.caching_precompile = True
    import tpu_dynamo
    from torch._dynamo import guards
    from torch._dynamo.utils import counters

    built = []
    build_guards = guards.CheckFunctionManager.build_guards

    def counted(self, sorted_guards, *args, **kwargs):
        built.append(len(sorted_guards))
        return build_guards(self, sorted_guards, *args, **kwargs)

    guards.CheckFunctionManager.build_guards = counted
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 8)
    f = torch.compile(m, backend="tpu", fullgraph=True, dynamic=False)
    with torch.no_grad():
        f(torch.randn(4, 16))
        builds = list(built)
        if sys.argv[1] == "save":
            torch.compiler.save_cache_artifacts()
        traced = counters["stats"]["unique_graphs"]
        x = torch.randn(5, 16)
        diff = (f(x) - torch.nn.functional.linear(x, m.weight, m.bias)).abs().max().item()
    print(json.dumps({
        "builds": builds,
        "traced_for_the_first_shape": traced,
        "traced_for_another": counters["stats"]["unique_graphs"] - traced,
        "diff": diff,
    }))
    """
)


@_STORED_BY_TORCH_2_15
def test_a_loaded_frame_builds_its_guards_once_and_they_still_guard(tmp_path):
    """Under caching precompile Dynamo builds a frame's guards twice, first to drop the kinds it
    cannot save; a loaded frame's had those dropped before saving, so it is built once
    (precompile._build_loaded_guards_once) with every saved guard, and still refuses a new shape."""
    first, second = _save_then_load(tmp_path, GUARD_BUILDS)
    assert len(first["builds"]) == 2 and first["traced_for_the_first_shape"] == 1
    assert second["builds"] == first["builds"][-1:] and second["traced_for_the_first_shape"] == 0
    for r in (first, second):
        assert r["traced_for_another"] == 1 and r["diff"] <= 1e-6


# A forward wrapped by a decorator from another module (as transformers' `can_return_tuple` and
# diffusers' decorators wrap every model's forward): `functools.wraps` copies the wrapped
# function's `__module__`, while the wrapper's code reads its own module's globals; and it returns
# an `OrderedDict` (as a model's output is) from a module the script never binds by name.
DECORATED = textwrap.dedent(
    """
    import functools, json, sys, torch
    from collections import OrderedDict
    torch._dynamo.config.caching_precompile = True
    import tpu_dynamo
    from torch._dynamo.utils import counters

    def passthrough(f):
        @functools.wraps(f)
        def wrapped(*args, **kwargs):
            return OrderedDict(y=f(*args, **kwargs))
        return wrapped

    class Linear(torch.nn.Linear):
        forward = passthrough(torch.nn.Linear.forward)

    torch.manual_seed(0)
    m = Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.no_grad():
        got = torch.compile(m, backend="tpu", fullgraph=True)(x)
        want = torch.nn.functional.linear(x, m.weight, m.bias)
    if sys.argv[1] == "save":
        torch.compiler.save_cache_artifacts()
    print(json.dumps({
        "type": type(got).__name__,
        "diff": (got["y"] - want).abs().max().item(),
        "graphs_traced": counters["stats"]["unique_graphs"],
        "compiles": tpu_dynamo.stats()["compiles"],
    }))
    """
)


@_STORED_BY_TORCH_2_15
def test_a_decorated_forward_loads_without_tracing(tmp_path):
    """torch 2.15 would reinstall this frame's graph into the module named by `__module__`, not
    the one whose globals the frame reads (`NameError: __compiled_fn_…`), and would not bind again
    the global through which the frame reaches `collections` (`NameError: ___module_collections_…`);
    precompile._repair_dynamo_packages fixes both, so the second process neither traces nor
    compiles."""
    first, second = _save_then_load(tmp_path, DECORATED)
    assert (first["graphs_traced"], first["compiles"]) == (1, 1)
    assert (second["graphs_traced"], second["compiles"]) == (0, 0)
    for r in (first, second):
        assert r["type"] == "OrderedDict" and r["diff"] <= 1e-6


# The end of a script that compared `got` with `want`: saves Dynamo's cache in the first process
# and reports what each process traced and compiled.
REPORT = textwrap.dedent(
    """
    if sys.argv[1] == "save":
        torch.compiler.save_cache_artifacts()
    print(json.dumps({
        "diff": (got - want).abs().max().item(),
        "graphs_traced": counters["stats"]["unique_graphs"],
        "compiles": tpu_dynamo.stats()["compiles"],
    }))
    """
)


# A module of a class defined inside a function, held in a plain dict attribute and called
# through it, as transformers >= 5.25 holds kernels' hub-kernel wrapper `Func` of
# `apply_rotary_pos_emb` in every attention layer; the class pickles its instances itself, by
# a module-level rebuild function.
LOCAL_CLASS = textwrap.dedent(
    """
    import json, sys, torch
    torch._dynamo.config.caching_precompile = True
    import tpu_dynamo
    from torch._dynamo.utils import counters

    def wrap(fn):
        class Func(torch.nn.Module):
            def forward(self, *args):
                return fn(*args)

            def __reduce__(self):
                return rebuild, (fn.__name__,)
        return Func

    def rebuild(name):
        return KERNELS[name]()

    def rotate(x):
        return torch.cat([-x[..., 1::2], x[..., ::2]], dim=-1)

    KERNELS = {"rotate": wrap(rotate)}

    class Attention(torch.nn.Linear):
        def __init__(self):
            super().__init__(16, 16)
            self._kernel_funcs = {"rotate": KERNELS["rotate"]()}

        def forward(self, x):
            return self._kernel_funcs["rotate"](super().forward(x))

    torch.manual_seed(0)
    m = Attention()
    x = torch.randn(4, 16)
    with torch.no_grad():
        got = torch.compile(m, backend="tpu", fullgraph=True)(x)
        want = rotate(torch.nn.functional.linear(x, m.weight, m.bias))
    """
) + REPORT


@_STORED_BY_TORCH_2_15
def test_a_module_of_a_class_defined_in_a_function_loads_without_tracing(tmp_path):
    """torch 2.15 saves no frame with a type guard on a class defined inside a function ("defined
    in local scope": a package bypass), and would load such a module as a plain `nn.Module`;
    precompile._repair_local_class_guards saves one that pickles itself back into its class by its
    own reduce, so the second process neither traces nor compiles."""
    first, second = _save_then_load(tmp_path, LOCAL_CLASS)
    assert (first["graphs_traced"], first["compiles"]) == (1, 1)
    assert (second["graphs_traced"], second["compiles"]) == (0, 0)
    for r in (first, second):
        assert r["diff"] <= 1e-6


MODEL = textwrap.dedent(
    """
    import json, sys, torch
    torch._dynamo.config.caching_precompile = True
    sys.path.insert(0, sys.argv[3])
    import bench, models, tpu_dynamo
    from torch._dynamo.utils import counters

    case = models.build(sys.argv[2], "cpu", torch.float32)
    with torch.no_grad():
        want = bench._tensor(case.module(*case.inputs))
        got = bench._tensor(bench._compiled(case, "tpu")())
    """
) + REPORT


@_STORED_BY_TORCH_2_15
@pytest.mark.parametrize("name", ["llama-b1", "sd3"])
def test_a_model_forward_loads_without_tracing(tmp_path, name):
    """Transformers' and diffusers' decorated forwards, whole: the second process's first call
    is a guard check and a load (bench/RESULTS.md, run M: 0.08-0.12x the cold first call)."""
    bench_dir = str(Path(__file__).parents[1] / "bench")
    first, second = _save_then_load(tmp_path, MODEL, ("save", name, bench_dir), ("load", name, bench_dir))
    # Llama's graph comes with the prep graph of its rotary table (hoist.py).
    assert (first["graphs_traced"], first["compiles"]) == (1, 2 if name == "llama-b1" else 1)
    assert (second["graphs_traced"], second["compiles"]) == (0, 0)
    for r in (first, second):
        assert r["diff"] <= 1e-4


SYMBOLIC = textwrap.dedent(
    """
    import json, sys, torch
    torch._dynamo.config.caching_precompile = True
    import tpu_dynamo
    from torch._dynamo.utils import counters

    def step(x, cache):
        cache.mul_(0.5)  # an input updated in place and returned
        y = torch.cat([cache, x], dim=0)
        return torch.tanh(y) * 2, y.shape[0] + 1, cache  # a number output from the sizes

    f = torch.compile(step, backend="tpu", fullgraph=True, dynamic=True)
    torch.manual_seed(0)
    diffs, numbers, same = [], [], []
    for rows in map(int, sys.argv[2].split(",")):
        x, cache = torch.randn(rows, 8), torch.randn(rows + 2, 8)
        want_cache = cache.clone()
        want = step(x, want_cache)
        got = f(x, cache)
        diffs.append(max((got[0] - want[0]).abs().max().item(), (cache - want_cache).abs().max().item()))
        numbers.append([got[1], want[1]])
        same.append(got[2] is cache)
    if sys.argv[1] == "save":
        torch.compiler.save_cache_artifacts()
    print(json.dumps({
        "diff": max(diffs), "numbers": numbers, "returns_the_input": all(same),
        "graphs_traced": counters["stats"]["unique_graphs"],
        "compiles": tpu_dynamo.stats()["compiles"],
    }))
    """
)


def test_a_symbolic_graph_loads_without_tracing(tmp_path):
    """A graph traced with symbolic sizes is stored as its `symbolic.Traced`: the second process
    traces nothing, finds the executables of the sizes the first one ran, compiles only a new
    size, and returns the size it computes and the input it updates, as eager does."""
    first, second = _save_then_load(tmp_path, SYMBOLIC, ("save", "3,5"), ("load", "3,5,9"))
    assert (first["graphs_traced"], first["compiles"]) == (1, 2)
    assert (second["graphs_traced"], second["compiles"]) == (0, 1)
    for r in (first, second):
        assert r["diff"] <= 1e-6
        assert all(got == want for got, want in r["numbers"]) and r["returns_the_input"]
    assert [n for n, _ in second["numbers"]] == [9, 13, 21]


GENERATE = textwrap.dedent(
    """
    import json, sys, torch
    torch._dynamo.config.caching_precompile = True
    import tpu_dynamo
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 5))
    def generate():
        return model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = generate()
        model.compile(backend="tpu", fullgraph=True)
        got = generate()
    if sys.argv[1] == "save":
        torch.compiler.save_cache_artifacts()
    print(json.dumps({
        "same": torch.equal(got, want),
        "graphs_traced": counters["stats"]["unique_graphs"],
        "compiles": tpu_dynamo.stats()["compiles"],
    }))
    """
)


@_STORED_BY_TORCH_2_15
def test_a_dynamic_cache_generate_loads_without_tracing(tmp_path):
    """`generate()` with the default dynamic cache: the prompt's and first step's graphs are
    static, the later steps' one symbolic. All three load in a new process, which neither
    traces nor compiles (bench/RESULTS.md, seventeenth session: the bench's first generate 4.1-4.3 s → 0.52-0.73)."""
    first, second = _save_then_load(tmp_path, GENERATE)
    assert first["graphs_traced"] == 3 and first["compiles"] > 3
    assert (second["graphs_traced"], second["compiles"]) == (0, 0)
    assert first["same"] and second["same"]
