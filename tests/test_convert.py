"""FX -> IR conversion: input kinds, canonical form, and determinism across processes."""
import json
import subprocess
import sys
import textwrap

from tpu_dynamo import _native
from tpu_dynamo.convert import InputKind

# Captures the IR of every graph `backend="capture"` sees, without lowering it.
CAPTURE = textwrap.dedent("""
    import torch
    from torch._functorch.aot_autograd import aot_module_simplified
    from tpu_dynamo.backend import decompositions, _aot_kinds, _dynamo_kind
    from tpu_dynamo.convert import convert

    captured = []

    def capture(gm, example_inputs):
        phs = gm.graph.find_nodes(op="placeholder")
        kinds = [_dynamo_kind(n, v) for n, v in zip(phs, example_inputs)]

        def fw(aten_gm, _):
            captured.append(convert(aten_gm, _aot_kinds(aten_gm, kinds)))
            return aten_gm

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw, decompositions=decompositions())

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 4)
            self.register_buffer("scale", torch.full((4,), 0.5))
            self.offset = torch.tensor([1.0, 2.0, 3.0, 4.0])

        def forward(self, x):
            h = torch.nn.functional.gelu(self.fc(x)) * self.scale + self.offset
            return torch.softmax(h.to(torch.bfloat16), dim=-1), h.mean(dim=0, keepdim=True) * 0.1
""")


def capture(code: str):
    scope: dict = {}
    exec(CAPTURE + code, scope)
    return scope["captured"]


def test_input_kinds_and_canonical_json():
    (g,) = capture("""
with torch.no_grad():
    torch.compile(M(), backend=capture, fullgraph=True)(torch.randn(2, 8))
""")
    ir = json.loads(g.json)["graph"]
    assert sorted(g.kinds) == sorted([InputKind.PARAMETER, InputKind.PARAMETER, InputKind.BUFFER,
                                      InputKind.CONSTANT, InputKind.USER])
    ops = [n["op"] for n in ir["nodes"]]
    assert "aten.addmm.default" in ops and "aten._to_copy.default" in ops
    to_copy = next(n for n in ir["nodes"] if n["op"] == "aten._to_copy.default")
    assert to_copy["kwargs"] == [["dtype", {"dtype": "bf16"}]]
    # 0.1 as the IEEE-754 bits of the double
    assert any({"float": 4591870180066957722} in n["args"] for n in ir["nodes"])
    assert len(json.loads(g.json)["sources"]) == len(ir["nodes"])
    assert len(_native.canonical_bytes(g.json)) > 0


def test_same_model_same_hash_in_two_processes():
    script = CAPTURE + textwrap.dedent("""
        from tpu_dynamo import _native
        torch.manual_seed(0)
        with torch.no_grad():
            torch.compile(M(), backend=capture, fullgraph=True)(torch.randn(2, 8))
        print(_native.graph_hash(captured[0].json))
    """)
    hashes = [
        subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                       env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout.strip()
        for seed in (1, 2)
    ]
    assert len(hashes[0]) == 64 and hashes[0] == hashes[1]


def _graph_with_constant(value):
    """`x + cat(x, c)[:2]` with `c` read through `get_attr`."""
    import torch

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    c = graph.get_attr("c")
    cat = graph.call_function(torch.ops.aten.cat.default, ([x, c],))
    head = graph.call_function(torch.ops.aten.slice.Tensor, (cat, 0, 0, 2))
    add = graph.call_function(torch.ops.aten.add.Tensor, (x, head))
    graph.output((add,))
    root = torch.nn.Module()
    root.c = value
    gm = torch.fx.GraphModule(root, graph)
    with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        x.meta["val"], c.meta["val"] = torch.empty(2), value
        for n in (cat, head, add):
            n.meta["val"] = n.target(*torch.fx.node.map_arg(n.args, lambda a: a.meta["val"]))
    return gm


def test_an_empty_fake_constant_stands_for_an_empty_tensor():
    """A trace on a GPU holds `torch.tensor([], device="cuda")` (a transformers cache layer's
    first keys) as a FakeTensor constant: it has no elements, so an empty tensor replaces it."""
    import pytest
    import torch

    from tpu_dynamo.convert import convert
    from tpu_dynamo.executable import Executable

    with torch._subclasses.FakeTensorMode():
        empty = torch.empty(0)
        full = torch.ones(3)
    converted = convert(_graph_with_constant(empty), [InputKind.USER])
    assert [type(c) for c in converted.constants] == [torch.Tensor] and converted.constants[0].numel() == 0
    x = torch.randn(2)
    (got,) = Executable(_native.compile(converted.json), converted)([x])
    torch.testing.assert_close(got, x + x)
    with pytest.raises(NotImplementedError, match=r"constant c \(torch.float32 \[3\] on cpu\) has no value"):
        convert(_graph_with_constant(full), [InputKind.USER])


def test_the_device_each_output_was_traced_on_is_kept():
    """A graph traced on a GPU gives back on the host what its trace put there (`.cpu()`)."""
    import torch

    from tpu_dynamo.convert import convert

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    doubled = graph.call_function(torch.ops.aten.add.Tensor, (x, x))
    on_host = graph.call_function(torch.ops.aten._to_copy.default, (doubled,), {"device": torch.device("cpu")})
    graph.output((doubled, on_host))
    with torch._subclasses.FakeTensorMode():
        x.meta["val"] = torch.empty(3, device="cuda")
        doubled.meta["val"] = x.meta["val"] + x.meta["val"]
        on_host.meta["val"] = doubled.meta["val"].cpu()
    converted = convert(torch.fx.GraphModule(torch.nn.Module(), graph), [InputKind.USER])
    assert converted.result_devices == ("cuda:0", "cpu")
