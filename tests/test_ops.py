"""Op-level table: small torch functions through backend="tpu" vs eager, f32 and bf16.

Inputs are random and kept away from zero (and positive where an op needs it). A case whose
ATen op has no lowering rule yet is skipped with the op named; a wrong result is a failure.
"""
import pytest
import torch

from tpu_dynamo import _native

from conftest import compile_tpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
A, B = (3, 5), (5, 4)


def rand(shape, dtype, positive=False):
    t = torch.rand(shape) + 0.5 if positive else (torch.rand(shape) + 0.5) * torch.where(torch.rand(shape) < 0.5, -1.0, 1.0)
    return t.to(dtype)


# (name, function, input shapes, positive inputs, ATen ops it needs after decomposition)
CASES = [
    ("add", lambda x, y: x + y, [A, A], False, ["aten.add.Tensor"]),
    ("mul_scalar", lambda x: x * 1.5, [A], False, ["aten.mul.Tensor"]),
    ("div", lambda x, y: x / y, [A, A], True, ["aten.div.Tensor"]),
    ("sub_bcast", lambda x, y: x - y, [A, (5,)], False, ["aten.sub.Tensor"]),
    ("neg_abs", lambda x: -x.abs(), [A], False, ["aten.abs.default", "aten.neg.default"]),
    ("exp_log", lambda x: torch.exp(x) + torch.log(x), [A], True, ["aten.exp.default", "aten.log.default"]),
    ("sin_cos", lambda x: torch.sin(x) * torch.cos(x), [A], False, ["aten.sin.default", "aten.cos.default"]),
    ("rsqrt", torch.rsqrt, [A], True, ["aten.rsqrt.default"]),
    ("tanh_sigmoid", lambda x: torch.tanh(x) + torch.sigmoid(x), [A], False, ["aten.tanh.default", "aten.sigmoid.default"]),
    ("relu", torch.relu, [A], False, ["aten.relu.default"]),
    ("gelu", torch.nn.functional.gelu, [A], False, ["aten.gelu.default"]),
    ("silu", torch.nn.functional.silu, [A], False, ["aten.mul.Tensor", "aten.sigmoid.default"]),
    ("pow", lambda x: x.pow(2.0) + x.pow(3), [A], False, ["aten.pow.Tensor_Scalar"]),
    ("reciprocal", torch.reciprocal, [A], True, ["aten.reciprocal.default"]),
    ("minimum_where", lambda x, y: torch.where(x > 0, torch.minimum(x, y), y), [A, A], False,
     ["aten.minimum.default", "aten.gt.Scalar", "aten.where.self"]),
    ("mean_dim", lambda x: x.mean(dim=-1, keepdim=True), [A], False, ["aten.mean.dim"]),
    ("sum_dim", lambda x: x.sum(dim=0), [A], False, ["aten.sum.dim_IntList"]),
    ("softmax", lambda x: torch.softmax(x, dim=-1), [A], False, ["aten._softmax.default"]),
    ("log_softmax", lambda x: torch.log_softmax(x, dim=-1), [A], False, ["aten._log_softmax.default"]),
    ("cumsum", lambda x: torch.cumsum(x, dim=1), [A], False, ["aten.cumsum.default"]),
    ("view_permute", lambda x: x.reshape(5, 3).permute(1, 0) * 2, [A], False, ["aten.view.default", "aten.permute.default"]),
    ("unsqueeze_expand", lambda x: x.unsqueeze(0).expand(2, 3, 5) + 1, [A], False,
     ["aten.unsqueeze.default", "aten.expand.default"]),
    ("cat", lambda x, y: torch.cat([x, y], dim=0), [A, A], False, ["aten.cat.default"]),
    ("slice_select", lambda x: x[1:, ::2] + x[0, 1], [A], False, ["aten.slice.Tensor", "aten.select.int"]),
    ("split", lambda x: torch.split(x, [2, 3], dim=1)[1] * 1, [A], False, ["aten.split_with_sizes.default"]),
    ("to_dtype", lambda x: (x.to(torch.float64) * 2).to(x.dtype), [A], False, ["aten._to_copy.default"]),
    ("arange_full", lambda x: x + torch.arange(5, dtype=x.dtype) + torch.full((5,), 2.0, dtype=x.dtype), [A], False,
     ["aten.arange.start_step", "aten.full.default"]),
    ("layer_norm", lambda x: torch.nn.functional.layer_norm(x, (5,)), [A], False, ["aten.native_layer_norm.default"]),
    ("mm", lambda x, y: x @ y, [A, B], False, ["aten.mm.default"]),
    ("bmm", lambda x, y: torch.bmm(x, y), [(2, *A), (2, *B)], False, ["aten.bmm.default"]),
    ("addmm", lambda b, x, y: torch.addmm(b, x, y), [(4,), A, B], False, ["aten.addmm.default"]),
    ("embedding", lambda w, i: torch.nn.functional.embedding(i, w), [(10, 4), None], False, ["aten.embedding.default"]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,fn,shapes,positive,ops", CASES, ids=[c[0] for c in CASES])
def test_op_matches_eager(name, fn, shapes, positive, ops, dtype):
    missing = sorted(set(ops) - set(_native.supported_ops()))
    if missing:
        pytest.skip(f"compiler lacks {missing}")
    torch.manual_seed(0)
    args = [torch.randint(0, 10, (3, 2)) if s is None else rand(s, dtype, positive) for s in shapes]
    with torch.no_grad():
        got, want = compile_tpu(fn)(*args), fn(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert (got.double() - want.double()).abs().max().item() <= TOL[dtype] * max(1.0, want.double().abs().max().item())
