"""Bit-level ops through backend="tpu" vs eager, compared bit for bit: integer shifts (PyTorch's
OpInfo samples per integer dtype, and shift counts out of range) and `Tensor.view(dtype)`."""
import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

from conftest import compile_tpu

INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
SHIFT_OPS = {op.name: op for op in op_db if op.name in ("bitwise_left_shift", "bitwise_right_shift")}
# Same-size integer dtype of each dtype `view` is tested with, to compare floats bit for bit.
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    as_int = BITS[want.element_size()]
    assert torch.equal(got.view(as_int), want.view(as_int))


@pytest.mark.parametrize("dtype", INTS, ids=str)
@pytest.mark.parametrize("name", sorted(SHIFT_OPS))
def test_shift_opinfo_samples_match_eager(name, dtype):
    op = SHIFT_OPS[name]
    samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))[:4]
    assert samples
    for sample in samples:
        torch._dynamo.reset()
        fn = lambda x, *args: op(x, *args, **sample.kwargs)  # noqa: E731
        with torch.no_grad():
            same_bits(compile_tpu(fn)(sample.input, *sample.args), fn(sample.input, *sample.args))


@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_shift_counts_out_of_range_match_eager(dtype):
    """Counts of 0, the width and more, and negative ones: ATen gives 0, or for a signed right
    shift the sign, as StableHLO's shifts do."""
    width = 8 * dtype.itemsize
    counts = [0, 1, 3, width - 1, width, width + 5] + ([] if dtype == torch.uint8 else [-1, -width])
    y = torch.tensor(counts, dtype=dtype).repeat(6, 1)
    torch.manual_seed(0)
    info = torch.iinfo(dtype)
    x = torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), y.shape, dtype=torch.int64).to(dtype)
    fns = [
        lambda x, y: x << y,
        lambda x, y: x >> y,
        lambda x, y: torch.bitwise_left_shift(x, 3) + torch.bitwise_right_shift(x, 2),
        lambda x, y: x >> 1,
    ]
    for fn in fns:
        torch._dynamo.reset()
        with torch.no_grad():
            same_bits(compile_tpu(fn)(x, y), fn(x, y))


VIEWS = [
    ("f32_as_i32", torch.float32, torch.int32, (4, 6)),
    ("i32_as_f32", torch.int32, torch.float32, (4, 6)),
    ("f32_as_bf16", torch.float32, torch.bfloat16, (3, 5)),
    ("bf16_as_f32", torch.bfloat16, torch.float32, (3, 8)),
    ("f32_as_u8", torch.float32, torch.uint8, (2, 3)),
    ("u8_as_f32", torch.uint8, torch.float32, (2, 12)),
    ("f64_as_i64", torch.float64, torch.int64, (5,)),
    ("i64_as_f16", torch.int64, torch.float16, (2, 3)),
    ("f16_as_i64", torch.float16, torch.int64, (3, 4)),
    ("i8_as_u8", torch.int8, torch.uint8, (4, 4)),
]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype.is_floating_point:
        x = torch.randn(shape, dtype=torch.float64) * 100
        return x.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**62)), min(info.max, 2**62), shape, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("src,dst,shape", [v[1:] for v in VIEWS], ids=[v[0] for v in VIEWS])
def test_view_as_another_dtype_matches_eager_bit_for_bit(src, dst, shape):
    torch.manual_seed(0)
    x = sample(src, shape)

    # The flip keeps the view inside the graph (a graph output that is a view of an input or
    # of an intermediate is made again outside it, by AOTAutograd), and reading the result as
    # integers compares NaN payloads too.
    def fn(x):
        return x.view(dst).flip(0).view(BITS[dst.itemsize])

    with torch.no_grad():
        assert torch.equal(compile_tpu(fn)(x), fn(x))


def test_float_bit_tricks_match_eager():
    """The pattern bit views serve in models: a float's bits edited as an integer and read back
    (here: bf16-style truncation of f32 mantissas, and the exponent field)."""
    torch.manual_seed(0)
    x = torch.randn(64, 33) * 1e3

    def truncate(x):
        bits = x.view(torch.int32)
        exponent = (bits >> 23) & 0xFF
        return (bits & -65536).view(torch.float32) * 2, exponent

    with torch.no_grad():
        got, want = compile_tpu(truncate)(x), truncate(x)
    for g, w in zip(got, want):
        same_bits(g, w)
