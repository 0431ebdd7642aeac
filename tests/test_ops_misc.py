"""FFTs, complex constants and miscellaneous ops through backend="tpu" vs eager, on random
inputs kept away from zero. FFT tolerances are relative to the largest output magnitude (the
sums grow with the signal size)."""
import re

import pytest
import torch
from torch.utils._pytree import tree_leaves

import tpu_dynamo
from conftest import compile_tpu

fft = torch.fft


def rand(*shape, complex=False):
    t = (torch.rand(shape) + 0.5) * torch.where(torch.rand(shape) < 0.5, -1.0, 1.0)
    return torch.complex(t, rand(*shape)) if complex else t


def check(fn, *args, tol=1e-5):
    with torch.no_grad():
        got, want = compile_tpu(fn)(*args), fn(*args)
    got, want = tree_leaves(got), tree_leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        finite = w[w.isfinite()].abs() if w.is_floating_point() or w.is_complex() else w.new_ones(1)
        scale = max(1.0, finite.max().item()) if finite.numel() else 1.0
        torch.testing.assert_close(g, w, rtol=0, atol=tol * scale, equal_nan=True)


FFT_CASES = [
    ("fft_dim1_ortho", lambda x: fft.fft(x, dim=1, norm="ortho"), False),
    ("fft_n_pad", lambda x: fft.fft(x, n=9), True),
    ("ifft_forward", lambda x: fft.ifft(x, norm="forward"), True),
    ("ifft_backward", lambda x: fft.ifft(x), True),
    ("fft2_s", lambda x: fft.fft2(x, s=(4, 9)), True),
    ("ifftn", lambda x: fft.ifftn(x, dim=(0, 2)), True),
    ("rfft", lambda x: fft.rfft(x), False),
    ("rfft2_ortho", lambda x: fft.rfft2(x, norm="ortho"), False),
    ("rfftn_all", lambda x: fft.rfftn(x), False),
    ("irfft_odd", lambda x: fft.irfft(x, n=11), True),
    ("irfft_ortho", lambda x: fft.irfft(x, norm="ortho"), True),
    ("irfftn_s", lambda x: fft.irfftn(x, s=(5, 8)), True),
    ("irfft2_forward", lambda x: fft.irfft2(x, norm="forward"), True),
    ("hfft", lambda x: fft.hfft(x), True),
    ("ihfft", lambda x: fft.ihfft(x), False),
    ("ihfft2", lambda x: fft.ihfft2(x), False),
    ("fftshift", lambda x: fft.fftshift(fft.fft(x)), False),
    ("stft", lambda x: torch.stft(x.flatten(), 8, hop_length=3, window=torch.hann_window(8), return_complex=True), False),
]


@pytest.mark.parametrize("fn,complex", [c[1:] for c in FFT_CASES], ids=[c[0] for c in FFT_CASES])
def test_fft(fn, complex):
    torch.manual_seed(0)
    check(fn, rand(5, 6, 7, complex=complex))


def seq():
    return torch.sort(rand(7)).values


def rows():
    return torch.sort(rand(3, 7), dim=-1).values


def values():
    return torch.cat([rand(2, 5), seq()[:5].reshape(1, 5)])  # some values equal a boundary


def row_sorter():
    perm = torch.stack([torch.randperm(7) for _ in range(3)])
    return torch.gather(rows(), 1, torch.argsort(perm, 1)), perm, values()


def sorter():
    perm = torch.randperm(7)
    return seq()[torch.argsort(perm)], perm, values()


bag = torch.nn.functional.embedding_bag
BAG_IDX = torch.tensor([1, 2, 2, 4, 5, 0, 3])
MASK = torch.tensor([True, False, True, True, False])
EDGES = [torch.tensor([-1.0, 0.0, 1.5]), torch.tensor([-2.0, -0.5, 0.0, 0.3, 2.0])]
INF = float("inf")

# (id, function, inputs): one compiled function per case, inputs made after seeding.
CASES = [
    ("fftn_4_dims", lambda x: fft.fftn(x, dim=(0, 1, 2, 4)), lambda: [rand(2, 3, 4, 5, 3)]),
    ("rfftn_5_dims", lambda x: fft.rfftn(x), lambda: [rand(2, 3, 4, 5, 3)]),
    ("irfftn_4_dims", lambda x: fft.irfftn(x, dim=(1, 2, 3, 4)), lambda: [rand(2, 3, 4, 5, 3, complex=True)]),
    ("pad_complex", lambda z: torch.nn.functional.pad(z, (1, 2)) * 2, lambda: [rand(3, 4, complex=True)]),
    ("conj", lambda z: z.conj() * z + 1.5, lambda: [rand(3, 4, complex=True)]),
    ("abs_complex", lambda x: fft.rfft(x).abs(), lambda: [rand(4, 16)]),
    ("angle_complex", lambda x: fft.rfft(x).angle(), lambda: [rand(4, 16)]),
    ("spectrogram", lambda x: torch.stft(x, 8, window=torch.hann_window(8), return_complex=True).abs() ** 2,
     lambda: [rand(64)]),
    ("polar", torch.polar, lambda: [rand(3, 4).abs(), rand(3, 4)]),
    ("complex_broadcast", torch.complex, lambda: [rand(3, 4), rand(4)]),
    ("diagonal_scatter", lambda x, s: torch.diagonal_scatter(x, s), lambda: [rand(4, 5), rand(4)]),
    ("diagonal_scatter_above", lambda x, s: torch.diagonal_scatter(x, s, 2), lambda: [rand(4, 5), rand(3)]),
    ("diagonal_scatter_below_dims", lambda x, s: torch.diagonal_scatter(x, s, -1, 2, 0),
     lambda: [rand(5, 3, 4), rand(3, 3)]),
    ("diagonal_scatter_int", lambda x, s: torch.diagonal_scatter(x, s, 1),
     lambda: [torch.randint(-9, 9, (3, 3)), torch.randint(-9, 9, (2,))]),
    ("searchsorted", torch.searchsorted, lambda: [seq(), values()]),
    ("searchsorted_right_int32", lambda s, x: torch.searchsorted(s, x, right=True, out_int32=True),
     lambda: [seq(), values()]),
    ("searchsorted_rows_side", lambda s, x: torch.searchsorted(s, x, side="right"), lambda: [rows(), values()]),
    ("searchsorted_sorter", lambda s, p, x: torch.searchsorted(s, x, sorter=p), sorter),
    ("searchsorted_rows_sorter", lambda s, p, x: torch.searchsorted(s, x, sorter=p), row_sorter),
    ("searchsorted_scalar", lambda s: torch.searchsorted(s, 0.25), lambda: [seq()]),
    ("bucketize_right", lambda s, x: torch.bucketize(x, s, right=True), lambda: [seq(), values()]),
    ("isin", lambda s, x: torch.isin(x, s), lambda: [seq(), values()]),
    ("take", torch.take, lambda: [rand(3, 4), torch.tensor([[0, -1], [5, 11]])]),
    ("take_0d_index", lambda x: torch.take(x, torch.tensor(3)), lambda: [rand(3, 4)]),
    ("put_accumulate", lambda x, i: x.put(i, torch.full((2, 2), 2.5), accumulate=True),
     lambda: [rand(3, 4), torch.tensor([[1, 1], [-2, 4]])]),
    ("put", lambda x, i: x.put(i, torch.full((2, 2), 2.5)), lambda: [rand(3, 4), torch.tensor([[0, -1], [5, 11]])]),
    ("masked_scatter", lambda x, s: x.masked_scatter(x > 0, s), lambda: [rand(3, 4), rand(4, 4)]),
    ("masked_scatter_bcast", lambda x, s: x.masked_scatter(torch.tensor([True, False, True, True]), s),
     lambda: [rand(3, 4), rand(13)]),
    ("index_select_0d", lambda x: torch.index_select(x.sum(), 0, torch.tensor([0])), lambda: [rand(3, 4)]),
    ("mode", lambda x: torch.mode(x, 1), lambda: [rand(4, 6)]),
    ("mode_ties_keepdim", lambda x: torch.mode(x, 0, keepdim=True), lambda: [torch.randint(0, 3, (6, 5)).float()]),
    ("logcumsumexp", lambda x: torch.logcumsumexp(x, 1), lambda: [rand(4, 6) * 40]),
    ("logcumsumexp_inf", lambda x: torch.logcumsumexp(x, 0),
     lambda: [torch.tensor([[-INF, 1.0], [-INF, INF], [2.0, 3.0]])]),
    ("bilinear", torch.nn.functional.bilinear, lambda: [rand(2, 3, 3), rand(2, 3, 4), rand(5, 3, 4), rand(5)]),
    ("index_put_mask_row", lambda x, v: x.index_put((MASK,), v), lambda: [rand(5, 4), rand(4)]),
    ("index_put_mask_rows_acc", lambda x, v: x.index_put((MASK,), v, accumulate=True), lambda: [rand(5, 4), rand(3, 4)]),
    ("index_put_mask_2d", lambda x: x.index_put((x > 0,), torch.tensor(2.5)), lambda: [rand(5, 4)]),
    ("as_strided_scatter", lambda x, s: torch.as_strided_scatter(x, s, (2, 2), (1, 3), 1),
     lambda: [rand(5, 4), rand(2, 2)]),
    ("histogram", lambda x: torch.histogram(x, 7), lambda: [rand(40)]),
    ("histogram_range_density", lambda x: torch.histogram(x, 5, range=(-1.0, 1.0), weight=x.abs(), density=True),
     lambda: [rand(40)]),
    ("histogram_edges", torch.histogram, lambda: [rand(40), torch.tensor([-1.2, -0.3, 0.0, 0.4, 1.5])]),
    ("histogram_constant", lambda x: torch.histogram(x, 3), lambda: [torch.full((4,), 2.0)]),
    ("histogramdd", lambda x: torch.histogramdd(x, [3, 4]), lambda: [rand(30, 2)]),
    ("histogramdd_range_density",
     lambda x: torch.histogramdd(x, [2, 2, 3], range=[-1.0, 1.0, 0.0, 1.5, -1.5, 0.0], density=True),
     lambda: [rand(30, 3)]),
    ("histogramdd_edges", lambda x: torch.histogramdd(x, EDGES, weight=x[:, 0].abs(), density=True),
     lambda: [rand(30, 2)]),
    ("embedding_bag_aux_mean", lambda w: torch.ops.aten._embedding_bag_forward_only(
        w, BAG_IDX, torch.tensor([0, 3, 3, 5]), False, 1, False, None, False, 2), lambda: [rand(6, 3)]),
    ("embedding_bag_aux_max", lambda w: torch.ops.aten._embedding_bag_forward_only(
        w, BAG_IDX, torch.tensor([0, 3, 3, 5]), False, 2, False, None, False, 2), lambda: [rand(6, 3)]),
    ("embedding_bag_weights", lambda w, p: bag(BAG_IDX, w, torch.tensor([0, 4]), mode="sum", per_sample_weights=p),
     lambda: [rand(6, 3), rand(7)]),
    ("embedding_bag_weights_padding",
     lambda w, p: bag(BAG_IDX, w, torch.tensor([0, 4]), mode="sum", per_sample_weights=p, padding_idx=2),
     lambda: [rand(6, 3), rand(7)]),
]


@pytest.mark.parametrize("fn,make", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_op(fn, make):
    torch.manual_seed(0)
    check(fn, *make())


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("offsets,include_last", [([0, 3, 3, 5], False), ([0, 3, 3, 7], True), (None, False)],
                         ids=["offsets", "include_last", "2d"])
def test_embedding_bag(mode, padding_idx, offsets, include_last):
    torch.manual_seed(0)
    idx = BAG_IDX if offsets else BAG_IDX[:6].reshape(2, 3)
    off = torch.tensor(offsets) if offsets else None
    check(lambda w: bag(idx, w, off, mode=mode, padding_idx=padding_idx, include_last_offset=include_last), rand(6, 3))


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_grid_sample_3d(mode, padding, align, dtype):
    """bf16 computes in bf16 as ATen's kernel does, so it matches as closely as f32."""
    torch.manual_seed(0)
    x, g = rand(2, 3, 4, 5, 6).to(dtype), (torch.rand(2, 3, 4, 2, 3) * 2.6 - 1.3).to(dtype)  # some outside
    check(lambda x, g: torch.nn.functional.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align), x, g)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("resize", [dict(size=(3, 7)), dict(size=(17, 33)), dict(scale_factor=(1.7, 0.45))],
                         ids=["down", "up", "scales"])
def test_upsample_antialias(mode, align, resize):
    torch.manual_seed(0)
    check(lambda x: torch.nn.functional.interpolate(x, mode=mode, align_corners=align, antialias=True, **resize),
          rand(2, 3, 10, 20))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
def test_embedding_max_norm(norm_type):
    torch.manual_seed(0)
    w, idx = rand(6, 4) * 2, torch.tensor([[0, 2], [2, 5]])
    w_tpu, w_eager = w.clone(), w.clone()
    emb = lambda w: torch.nn.functional.embedding(idx, w, max_norm=1.5, norm_type=norm_type)
    with torch.no_grad():
        got, want = compile_tpu(emb)(w_tpu), emb(w_eager)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_tpu, w_eager, rtol=1e-5, atol=1e-5)  # the renorm is in place


WINDOW_CASES = [
    ("hann", {}),
    ("hann", {"periodic": False}),
    ("hamming", {}),
    ("hamming", {"periodic": True, "alpha": 0.6}),
    ("hamming", {"periodic": False, "alpha": 0.5, "beta": 0.3}),
    ("blackman", {}),
    ("blackman", {"periodic": False}),
    ("bartlett", {}),
    ("bartlett", {"periodic": False}),
    ("kaiser", {}),
    ("kaiser", {"periodic": False, "beta": 5.0}),
]


# Tolerances: f32 and f64 a few ulps of the window's values (at most 1); bf16 0.05, since eager
# rounds every step to bf16 (its arange, the scaled argument of the cosine) and we round once.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-12), (torch.bfloat16, 5e-2)],
                         ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("length", [0, 1, 6, 17])
@pytest.mark.parametrize("name,kwargs", WINDOW_CASES, ids=[f"{n}-{'-'.join(map(str, k.values()))}" for n, k in WINDOW_CASES])
def test_window_functions_match_eager(name, kwargs, length, dtype, tol):
    """A window made inside the compiled function, as `torch.stft(x, n, window=...)` in a
    forward makes it: every factory, overload, and the special lengths 0 and 1."""
    torch.manual_seed(0)
    make = getattr(torch, f"{name}_window")
    check(lambda x: x * make(length, dtype=dtype, **kwargs), rand(length).to(dtype), tol=tol)


def test_squeeze_empty_dims_keeps_shape():
    check(lambda x: x.squeeze(()) * 2, rand(1, 3, 1))


def _float_mask(batch, q_len, kv_len, dtype):
    mask = torch.randn(batch, 1, q_len, kv_len, dtype=dtype)
    mask[0, 0, 3] = float("-inf")  # query 3 of batch 0 sees no key: its output is 0
    mask[1, 0, :, 2] = float("-inf")  # key 2 of batch 1 is hidden from every query
    return mask


# (id, query heads, key/value heads, query length, key length, SDPA keyword arguments)
ATTENTION_CASES = [
    ("float_mask", 4, 4, 8, 8, lambda dt: {"attn_mask": _float_mask(2, 8, 8, dt)}),
    ("bool_mask", 4, 4, 8, 6, lambda dt: {"attn_mask": torch.rand(2, 4, 8, 6) < 0.7}),
    ("causal", 4, 4, 8, 8, lambda dt: {"is_causal": True}),
    ("causal_longer_keys", 4, 4, 5, 9, lambda dt: {"is_causal": True}),
    ("grouped_query_causal", 4, 2, 8, 8, lambda dt: {"is_causal": True, "enable_gqa": True}),
    ("grouped_query_mask_scale", 6, 2, 7, 5,
     lambda dt: {"attn_mask": _float_mask(2, 7, 5, dt), "enable_gqa": True, "scale": 0.3}),
    # From 512 queries a masked or causal attention runs in blocks of 128 rows (the last one
    # shorter here), a causal block over the keys its last query sees.
    ("long_grouped_query_causal", 4, 2, 600, 600, lambda dt: {"is_causal": True, "enable_gqa": True}),
    ("long_causal_more_keys", 2, 2, 520, 700, lambda dt: {"is_causal": True}),
    ("long_causal_fewer_keys", 2, 2, 520, 300, lambda dt: {"is_causal": True}),
    ("long_float_mask", 2, 2, 530, 530, lambda dt: {"attn_mask": _float_mask(2, 530, 530, dt)}),
    ("long_bool_mask", 2, 2, 515, 515, lambda dt: {"attn_mask": torch.rand(2, 1, 515, 515) < 0.7}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,heads,kv_heads,q_len,kv_len,kwargs", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_attention_is_lowered_as_one_op_and_matches_eager(name, heads, kv_heads, q_len, kv_len, kwargs, dtype):
    """CPU SDPA (`_scaled_dot_product_flash_attention_for_cpu`) is lowered as itself, V multiplied
    by unnormalized weights and divided by the row sums: eager's values for every mask kind,
    grouped-query heads and fully masked rows (0, not NaN). Tolerances: 1e-5 f32, 2e-2 bf16 (the
    products accumulate in f32 on both sides)."""
    torch.manual_seed(0)
    q = torch.randn(2, heads, q_len, 16, dtype=dtype)
    k, v = (torch.randn(2, kv_heads, kv_len, 16, dtype=dtype) for _ in range(2))
    kw = kwargs(dtype)
    graphs = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    run = compile_tpu(sdpa, options={"debug_callback": graphs.append})
    with torch.no_grad():
        got, want = run(q, k, v, **kw), sdpa(q, k, v, **kw)
    if name.endswith("float_mask"):
        assert got[0, :, 3].eq(0).all() and want[0, :, 3].eq(0).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    (graph,) = graphs
    assert "_scaled_dot_product_flash_attention_for_cpu.default" in graph["fx_code"]
    assert "bmm" not in graph["fx_code"] and "softmax" not in graph["fx_code"]


@pytest.mark.parametrize("kwargs", [{"is_causal": True}, {"attn_mask": "float"}, {}], ids=["causal", "float_mask", "no_mask"])
def test_attention_scores_see_no_select_so_xla_fuses_them_with_the_product(kwargs):
    """XLA:CPU fuses the scores' product, mask, row max and exponentials into one YNNPACK kernel
    only if no compare or select touches the `[B, H, L, S]` scores (a select there made causal
    GPT-2 attention 2x slower): masks are added as a bias, hidden rows handled on `[L, S]`.
    Inputs in f64, which XLA computes as it would f32 where the CPU has no AVX-512 (f32 and
    half attention without a mask runs our host kernel instead: tests/test_host_kernels.py)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 16, dtype=torch.float64) for _ in range(3))
    if kwargs.get("attn_mask") == "float":
        kwargs = {"attn_mask": _float_mask(2, 128, 128, torch.float64)}
    modules = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    run = compile_tpu(sdpa, options={"debug_callback": lambda d: modules.append(d["stablehlo"])})
    with torch.no_grad():
        torch.testing.assert_close(run(q, k, v, **kwargs), sdpa(q, k, v, **kwargs), rtol=0, atol=1e-10)
    (text,) = modules
    scores = "tensor<2x4x128x128x"
    for line in text.splitlines():
        if '"stablehlo.select"' in line or '"stablehlo.compare"' in line:
            assert scores not in line, line


def test_a_long_causal_attention_multiplies_only_the_keys_each_block_of_queries_sees():
    """600 causal queries run in blocks of 128 rows, each block's scores over the keys its last
    query sees (128, 256, 384, 512, then all 600 for the last 88 rows): about half the products
    of the whole `[600, 600]` scores, and at 2048 tokens 1.0x eager's flash kernel where one
    block was 3.6-3.9x (bench/RESULTS.md, "Twenty-second session"). Inputs in f64, computed as
    f32 would be where the CPU has no AVX-512 (f32 and half inputs run our host kernel there,
    which does the same per 12 queries)."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 600, 16, dtype=torch.float64)
    k, v = torch.randn(1, 2, 600, 16, dtype=torch.float64), torch.randn(1, 2, 600, 16, dtype=torch.float64)
    modules = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    run = compile_tpu(sdpa, options={"debug_callback": lambda d: modules.append(d["stablehlo"])})
    with torch.no_grad():
        got = run(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, sdpa(q, k, v, is_causal=True, enable_gqa=True), rtol=0, atol=1e-10)
    (text,) = modules
    scores = re.findall(r"-> tensor<1x2x(\d+)x(\d+)xf64>", "\n".join(l for l in text.splitlines() if "dot_general" in l))
    # Per block: the scores (queries of both grouped heads x keys), then the values' product.
    assert [(int(r), int(c)) for r, c in scores if c != "16"] == [(256, 128), (256, 256), (256, 384), (256, 512), (176, 600)]


def test_layers_sharing_a_causal_mask_do_not_materialize_it_per_head(compiled):
    """Each layer broadcasts the shared `[L, S]` causal mask inside its own attention kernel.
    XLA merged the layers' identical broadcasts into one and, no longer able to fuse it into
    several kernels, wrote the `[B, H, L, S]` f32 mask out every call (36 MiB at 1024 tokens
    and 9 heads). A 2-layer Llama at batch 2 x 256 tokens (2 MiB of mask): the executable's
    scratch was 4.9 MB with it, 3.0 MB without; bound 4 MiB. Logits within 1e-5 of eager."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, 1000, (2, 256))
    with torch.no_grad():
        got, want = compile_tpu(model)(tokens).logits, model(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # The model's graph, then the prep graph of its rotary table (hoist.py).
    (_, graph), _ = compiled
    mask_bytes = 2 * 4 * 256 * 256 * 4
    assert 0 <= graph.temp_bytes < 2 * mask_bytes, graph.temp_bytes


VECTOR_TIMES_MATRIX = {
    "mm": (lambda x, w, b: x @ w.t(), (1, 576)),
    "linear_one_token": (lambda x, w, b: torch.nn.functional.linear(x, w), (1, 1, 576)),
    "linear_with_bias": (lambda x, w, b: torch.nn.functional.linear(x, w, b), (1, 576)),
    "vector_1d": (lambda x, w, b: x @ w.t(), (576,)),
}


@pytest.mark.parametrize("name", VECTOR_TIMES_MATRIX)
def test_a_bf16_vector_times_a_matrix_converts_no_matrix_to_f32(name, compiled):
    """A linear layer on one token (a decode step at batch 1, an LM head) in bf16: XLA:CPU
    computed a vector-matrix product in f32 after converting the whole matrix to f32 on every
    call (its bf16 GEMM takes no vectors), scratch of 4 bytes per weight; the rule makes it a
    product of two equal rows. Values as eager's within one bf16 step, 2^-7 relative (both
    accumulate in f32; with a bias, one element in 1536 rounds the other way); scratch under the
    bf16 matrix's own size."""
    fn, shape = VECTOR_TIMES_MATRIX[name]
    torch.manual_seed(0)
    w, b = torch.randn(1536, 576, dtype=torch.bfloat16), torch.randn(1536, dtype=torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16)
    with torch.no_grad():
        got, want = compile_tpu(fn)(x, w, b), fn(x, w, b)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    ((_, graph),) = compiled
    assert 0 <= graph.temp_bytes < w.nbytes, graph.temp_bytes


# name: (product, shapes, rows computed per row asked for: one token is two equal rows).
SHORT_BF16_PRODUCTS = {
    "linear": (lambda a, b: torch.nn.functional.linear(a, b), (8, 128, 64), (1000, 64), 1),
    "lora_up": (lambda a, b: a @ b.t(), (1024, 16), (3072, 16), 1),
    "scores": (lambda a, b: a @ b.transpose(-1, -2), (2, 4, 128, 64), (2, 4, 128, 64), 1),
    "one_token": (lambda a, b: a @ b.t(), (1, 256), (1024, 256), 2),
}


@pytest.mark.parametrize("name", SHORT_BF16_PRODUCTS)
def test_a_short_bf16_product_is_written_in_bf16_and_rounded_once(name, compiled):
    """A bf16 product contracting at most 256 elements is asked for in bf16, so XLA:CPU writes
    no f32 product to convert afterwards (no scratch for one), while still accumulating in f32:
    every element within one bf16 step of the exact product plus what f32 sums may lose
    (2^-16 of the sum of the terms' magnitudes; summing in bf16 loses up to 2^-8 of it), and
    each that eager rounds to the nearest bf16 rounded so too, but for the rare sum that lands
    on the other side of a tie in another order."""
    fn, shape_a, shape_b, rows = SHORT_BF16_PRODUCTS[name]
    torch.manual_seed(0)
    a, b = torch.randn(shape_a, dtype=torch.bfloat16), torch.randn(shape_b, dtype=torch.bfloat16)
    with torch.no_grad():
        got, want = compile_tpu(fn)(a, b), fn(a, b)
    exact = fn(a.double(), b.double())
    assert got.dtype == torch.bfloat16
    step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    magnitudes = fn(a.double().abs(), b.double().abs())
    assert ((got.double() - exact).abs() <= step + 2.0**-16 * magnitudes).all()
    nearest = exact.to(torch.bfloat16)
    assert ((got != nearest) & (want == nearest)).sum() <= max(2, exact.numel() // 10000)
    ((_, graph),) = compiled
    assert 0 <= graph.temp_bytes < rows * exact.numel() * 4, graph.temp_bytes


def test_softmax_rows_with_nan_and_infinities_match_eager():
    """The softmax rules take the row max without a NaN pass of their own (NaN still reaches
    every output of its row through the sum) and tell masked rows by their sum: each edge row
    must come out as eager's, NaN for NaN, for softmax, log_softmax, `_safe_softmax` (the SDPA
    math path's, 0 on fully masked rows) and SDPA itself."""
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([
        [1.0, 2, 3, 4], [-inf, -inf, -inf, -inf], [nan, -inf, -inf, -inf], [nan, 1, 2, 3],
        [inf, 1, 2, 3], [-inf, -inf, 0, -inf], [nan, nan, nan, nan], [-80.0, -inf, -79, -inf],
    ])
    # Zero queries and keys make the scores the mask itself, and identity values make the
    # output the attention weights.
    q, k, v = torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 4, 4), torch.eye(4)[None, None]
    attention = lambda m: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m[None, None])
    safe_softmax = lambda x: torch.ops.aten._safe_softmax.default(x, -1)
    for fn in (lambda x: torch.softmax(x, -1), lambda x: torch.log_softmax(x, -1), safe_softmax, attention):
        check(fn, rows)


# (input shape, groups, with weight and bias)
GROUP_NORM_CASES = [((2, 6), 3, True), ((2, 8, 5), 4, False), ((1, 32, 6, 6), 8, True), ((2, 4, 3, 2, 2), 2, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape,groups,affine", GROUP_NORM_CASES, ids=[str(len(c[0])) + "d" for c in GROUP_NORM_CASES])
def test_group_norm_output_and_statistics_match_eager(shape, groups, affine, dtype):
    """`native_group_norm`: output, mean and rstd as eager's for 2-5-d inputs, inputs off zero
    mean so the centering matters. Tolerances 1e-5 f32, 2e-2 bf16 (statistics in f32 on both
    sides)."""
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    n, c = shape[:2]
    w, b = ((torch.randn(c).to(dtype), torch.randn(c).to(dtype)) if affine else (None, None))
    spatial = x[0, 0].numel()
    fn = lambda x, w, b: torch.native_group_norm(x, w, b, n, c, spatial, groups, 1e-5)
    check(fn, x, w, b, tol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
def test_attention_op_returns_eagers_logsumexp_too(causal, masked):
    """The op's second result (the rows' logsumexp of the scaled scores, what a backward would
    read) matches the CPU flash kernel's, with grouped-query heads; with a float mask (the op's
    only kind: SDPA converts bool masks) rows it hides entirely are 0 in both results, alone
    and combined with the causal mask."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = _float_mask(2, 6, 6, torch.float32) if masked else None
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    fn = lambda q, k, v: op(q, k, v, is_causal=causal, attn_mask=mask)
    if masked:
        with torch.no_grad():
            out, lse = fn(q, k, v)
        assert out[0, :, 3].eq(0).all() and lse[0, :, 3].eq(0).all()
    check(fn, q, k, v)


# (name, input shape, weight shape, stride, padding, dilation, lowered as the windows' product)
CONVOLUTION_CASES = [
    ("2d", (2, 16, 5, 5), (64, 16, 3, 3), 1, 1, 1, True),
    ("2d_strided_dilated_uneven", (1, 8, 9, 7), (48, 8, 3, 2), (2, 1), (1, 0), (2, 1), True),
    ("1d", (2, 8, 10), (32, 8, 5), 1, 2, 1, True),
    ("3d", (1, 4, 3, 4, 4), (64, 4, 3, 3, 3), 1, 1, 1, True),
    ("2d_1x1", (2, 8, 16, 16), (4, 8, 1, 1), 1, 0, 1, True),
    ("2d_1x1_strided", (2, 8, 15, 15), (4, 8, 1, 1), 2, 0, 1, True),
    ("2d_patches_cropped", (2, 3, 34, 33), (8, 3, 4, 4), 4, 0, 1, True),
    ("2d_patches_padded", (1, 3, 14, 14), (8, 3, 4, 2), (4, 2), (1, 0), 1, True),
    ("3d_patches", (1, 2, 4, 6, 6), (8, 2, 2, 3, 3), (2, 3, 3), 0, 1, True),
    ("2d_wide_input", (2, 8, 16, 16), (8, 8, 3, 3), 1, 1, 1, False),
    ("2d_wide_input_strided", (2, 8, 16, 16), (8, 8, 3, 3), 2, 1, 1, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CONVOLUTION_CASES, ids=[c[0] for c in CONVOLUTION_CASES])
def test_a_convolution_whose_windows_are_small_is_one_product(case, dtype):
    """Where the input's windows ([C*K, N*P]) hold no more elements than the input or the
    weight (deep layers of few positions, patch embeddings, 1x1 convolutions), the weight as it
    lies ([O, C*K]) times the windows: XLA:CPU's convolution transposes the whole weight every
    call and ran 2-3x eager at a UNet's 1280 channels on 8x8 (bench/RESULTS.md, "Twenty-third
    session"). Every spatial rank, stride, padding and dilation, windows stacked or tiling the
    input (cropped where they do not cover it); eager's values within 1e-5 (f32) or bf16's own
    tolerance, and the StableHLO holds a convolution only where overlapping windows would
    outgrow both (and our kernel does not take it)."""
    _name, x_shape, w_shape, stride, padding, dilation, as_product = case
    torch.manual_seed(0)
    x, w, bias = rand(*x_shape).to(dtype), rand(*w_shape).to(dtype), rand(w_shape[0]).to(dtype)
    conv = getattr(torch.nn.functional, f"conv{len(x_shape) - 2}d")

    def fn(x, w, bias):
        return conv(x, w, bias, stride=stride, padding=padding, dilation=dilation)

    modules = []
    with torch.no_grad():
        got = compile_tpu(fn, options={"debug_callback": lambda d: modules.append(d["stablehlo"])})(x, w, bias)
        want = fn(x, w, bias)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:
        torch.testing.assert_close(got, want)
    (text,) = modules
    # A 3×3 one of stride 1 and padding 1 goes to our kernel for its dtype where the plugin has it.
    kernel = "tpu_dynamo.f32_conv3x3" if dtype == torch.float32 else "tpu_dynamo.bf16_conv3x3"
    ours = (w_shape[2:], stride, padding, dilation) == ((3, 3), 1, 1, 1) and not as_product
    ours = ours and kernel in tpu_dynamo.device_info()["host_kernels"]
    assert ("stablehlo.convolution" in text) != (as_product or ours)
    assert (f'"{kernel}"' in text) == ours


# (name, input shape, output channels, padding, with bias, computed by Winograd's F(2x2, 3x3))
# Where our 3×3 kernel runs, it takes 128 channels on up to 2048 positions from Winograd.
DIRECT_AT_128 = "tpu_dynamo.f32_conv3x3" in tpu_dynamo.device_info()["host_kernels"]
WINOGRAD_CASES = [
    ("even", (1, 144, 24, 24), 144, 1, True, True),
    ("odd_output_cropped", (2, 144, 19, 15), 160, 1, True, True),
    ("narrowest_few_positions", (1, 128, 24, 24), 128, 1, True, not DIRECT_AT_128),
    ("unpadded", (1, 128, 26, 25), 128, 0, False, True),
    ("padded_unevenly", (1, 144, 23, 21), 128, (1, 2), True, True),
    ("too_few_positions", (1, 128, 22, 22), 128, 1, True, False),
    ("too_few_channels", (1, 128, 24, 24), 96, 1, True, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", WINOGRAD_CASES, ids=[c[0] for c in WINOGRAD_CASES])
def test_a_wide_3x3_convolution_in_f32_is_winograds(case, dtype):
    """A 3x3, stride-1 convolution of at least 128 channels in and out and 512 output positions
    is computed in f32 by Winograd's F(2x2, 3x3): 16 products [O, C] x [C, tiles] (and one for
    the weight's transform) where XLA:CPU's convolution ran 1.2-2x eager at SD1.5's VAE and
    UNet sizes (bench/RESULTS.md, "Twenty-fourth session"). Odd output sizes (computed one
    larger and cropped), no or uneven padding, no bias; eager's values within 1e-5 of the
    largest. In bf16 (the transformed operands would be rounded) and below the thresholds the
    convolution is lowered as before."""
    _name, x_shape, out_channels, padding, with_bias, winograd = case
    torch.manual_seed(0)
    x, w = rand(*x_shape).to(dtype), (rand(out_channels, x_shape[1], 3, 3) / 10).to(dtype)
    bias = rand(out_channels).to(dtype) if with_bias else None
    fn = lambda x, w, bias: torch.nn.functional.conv2d(x, w, bias, padding=padding)
    modules = []
    with torch.no_grad():
        got = compile_tpu(fn, options={"debug_callback": lambda d: modules.append(d["stablehlo"])})(x, w, bias)
        want = fn(x, w, bias)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    else:
        torch.testing.assert_close(got, want)
    (text,) = modules
    # The weight's transform may be our host kernel's product (tpu_dynamo.f32_matmul_*).
    products = text.count("stablehlo.dot_general") + text.count("tpu_dynamo.f32_matmul")
    assert (products == 17 and "stablehlo.convolution" not in text) == (winograd and dtype == torch.float32)
