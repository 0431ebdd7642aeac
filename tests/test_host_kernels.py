"""Our host kernels (runtime/src/host_kernels.rs) through backend="tpu" on the CPU plugin, with
the weight stored `[N, K]` (`nn.Linear`) or `[K, N]` (GPT-2's `Conv1D`, `x @ W`): a bf16 vector
times a weight (a linear layer at one token, a decode step's), f32 products of short
contractions split over XLA's threads (on AMX tiles where the CPU has them; with their bias, and
a tanh GELU after it, a gated MLP's SiLU and product, or a residual added last, applied by the kernel), f32 attention without a mask or with the causal
one, f32 3×3 convolutions, bf16 convolutions as their windows times the weight on the tiles, and
f32 LayerNorm and RMSNorm."""
import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import tpu_dynamo
from tpu_dynamo import _native

from conftest import compile_tpu

# (K, N, bias): a decode step's projections at SmolLM-135M's width, an LM head's shape in small,
# and sizes off the kernels' blocks (K not a multiple of 32, N of the 64-output chunks).
LINEARS = [(576, 1536, False), (1536, 576, False), (576, 4099, False), (100, 7, False), (576, 192, True), (33, 130, True)]
# (K, N): GPT-2 small's attention and MLP projections, and sizes off the blocks.
CONV1DS = [(768, 2304), (3072, 768), (100, 7), (33, 130)]


def host_kernels() -> list[str]:
    return tpu_dynamo.device_info()["host_kernels"]


F32_KERNELS = ["tpu_dynamo.f32_matmul_nt", "tpu_dynamo.f32_matmul_nn"]
BF16_TILE_KERNELS = ["tpu_dynamo.bf16_matmul_nt", "tpu_dynamo.bf16_matmul_nn"]
BF16_TILE_BIAS_KERNELS = ["tpu_dynamo.bf16_matmul_nt_bias", "tpu_dynamo.bf16_matmul_nn_bias"]
BF16_TILE_GELU_KERNELS = ["tpu_dynamo.bf16_matmul_nt_bias_gelu_tanh", "tpu_dynamo.bf16_matmul_nn_bias_gelu_tanh"]
BF16_TILE_SILU_KERNELS = ["tpu_dynamo.bf16_matmul_nt_silu_times", "tpu_dynamo.bf16_matmul_nn_silu_times"]
BIAS_KERNELS = ["tpu_dynamo.f32_matmul_nt_bias", "tpu_dynamo.f32_matmul_nn_bias"]
GELU_KERNELS = ["tpu_dynamo.f32_matmul_nt_bias_gelu_tanh", "tpu_dynamo.f32_matmul_nn_bias_gelu_tanh"]
SILU_KERNELS = ["tpu_dynamo.f32_matmul_nt_silu_times", "tpu_dynamo.f32_matmul_nn_silu_times"]
PLUS_KERNELS = ["tpu_dynamo.f32_matmul_nt_plus", "tpu_dynamo.f32_matmul_nn_plus"]
BIAS_PLUS_KERNELS = ["tpu_dynamo.f32_matmul_nt_bias_plus", "tpu_dynamo.f32_matmul_nn_bias_plus"]
ATTENTION_KERNELS = ["tpu_dynamo.f32_attention", "tpu_dynamo.f32_causal_attention"]
CONV_KERNEL = "tpu_dynamo.f32_conv3x3"
BF16_CONV_KERNELS = ["tpu_dynamo.bf16_conv_windows", "tpu_dynamo.bf16_conv_windows_bias"]
BF16_CONV3X3_KERNEL = "tpu_dynamo.bf16_conv3x3"
BF16_ATTENTION_KERNELS = ["tpu_dynamo.bf16_attention", "tpu_dynamo.bf16_causal_attention"]
LAYER_NORM_KERNEL = "tpu_dynamo.f32_layer_norm"
BF16_LAYER_NORM_KERNEL = "tpu_dynamo.bf16_layer_norm"
RMS_NORM_KERNEL = "tpu_dynamo.f32_rms_norm"
BF16_RMS_NORM_KERNEL = "tpu_dynamo.bf16_rms_norm"
ROTARY_KERNEL = "tpu_dynamo.f32_rotary"
CPU_FLAGS = set(Path("/proc/cpuinfo").read_text().split())
AVX512 = "avx512f" in CPU_FLAGS
# f32 products, attention, norms and 3×3 convolutions run on AVX2's vectors with FMA too (AMD Zen 2 and 3).
F32_PRODUCTS = AVX512 or {"avx2", "fma"} <= CPU_FLAGS
# bf16 rows' loads and stores take AVX-512's word and 256-bit forms (every AVX-512 CPU but Xeon Phi).
AVX512_BW = {"avx512bw", "avx512vl"} <= CPU_FLAGS
AMX = {"amx_bf16", "amx_tile"} <= CPU_FLAGS
# Where AMX is not, bf16 products (and attention) run in the tiles' layouts on AVX-512 BF16's vector dot products.
BF16_PRODUCTS = AMX or {"avx512_bf16", "avx512bw", "avx512vl"} <= CPU_FLAGS


def test_the_embedded_plugin_runs_our_kernels():
    """On x86-64 with AVX2 and FMA (this CI's machines) the embedded plugin registers the bf16
    ones and f32 products (with their epilogues), attention, norms, rotary embeddings and 3×3
    convolutions, with AVX-512 bf16 norms too, and with AMX or AVX-512 BF16 bf16 products and
    attention."""
    products = F32_KERNELS + BIAS_KERNELS + GELU_KERNELS + SILU_KERNELS + PLUS_KERNELS + BIAS_PLUS_KERNELS + ATTENTION_KERNELS
    products += [LAYER_NORM_KERNEL, RMS_NORM_KERNEL, ROTARY_KERNEL, CONV_KERNEL]
    avx512_kernels = [BF16_LAYER_NORM_KERNEL, BF16_RMS_NORM_KERNEL] if AVX512_BW else []
    f32_kernels = (products if F32_PRODUCTS else []) + (avx512_kernels if AVX512 else [])
    assert host_kernels() == ["tpu_dynamo.bf16_matvec", "tpu_dynamo.bf16_vecmat"] + f32_kernels + (
        BF16_TILE_KERNELS + BF16_TILE_BIAS_KERNELS + BF16_TILE_GELU_KERNELS + BF16_TILE_SILU_KERNELS + BF16_CONV_KERNELS + [BF16_CONV3X3_KERNEL] + BF16_ATTENTION_KERNELS
        if BF16_PRODUCTS
        else []
    )


def check_product(fn, x, w, b, target, compiled):
    """Within one bf16 step of the exact (f64) product plus what f32 sums may lose (2^-16 of the
    sum of the terms' magnitudes), rounded as eager rounds but for rare ties summed in another
    order; the product is our custom call `target`, not XLA's dot."""
    with torch.no_grad():
        got, want = compile_tpu(fn)(x, w, b), fn(x, w, b)
    exact = fn(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    magnitudes = fn(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    assert ((got.double() - exact).abs() <= step + 2.0**-16 * magnitudes).all()
    nearest = exact.to(torch.bfloat16)
    assert ((got != nearest) & (want == nearest)).sum() <= max(2, exact.numel() // 500)
    ((graph_json, _),) = compiled
    assert target in _native.compile(graph_json, need_stablehlo=True).stablehlo


@pytest.mark.parametrize("k, n, bias", LINEARS)
def test_a_one_token_bf16_linear_matches_the_exact_product(k, n, bias, compiled):
    torch.manual_seed(k + n)
    x, w = torch.randn(1, 1, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    check_product(torch.nn.functional.linear, x, w, b, "tpu_dynamo.bf16_matvec", compiled)


@pytest.mark.parametrize("rows", [2, 3, 4])
def test_a_few_rows_go_to_the_kernel_and_eight_do_not(rows, compiled):
    """A few prompts decoded together read each weight row once for all of them through our
    kernel (in fours, twos and ones); eight rows stay XLA's GEMM, as fast there."""
    torch.manual_seed(rows)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    x = torch.randn(rows, 1, 576, dtype=torch.bfloat16)
    check_product(torch.nn.functional.linear, x, w, None, "tpu_dynamo.bf16_matvec", compiled)
    x8 = torch.randn(8, 1, 576, dtype=torch.bfloat16)
    torch._dynamo.reset()  # a new shape would otherwise be traced with symbolic sizes
    with torch.no_grad():
        compile_tpu(torch.nn.functional.linear)(x8, w, None)
    assert "tpu_dynamo.bf16_matvec" not in _native.compile(compiled[-1][0], need_stablehlo=True).stablehlo


@pytest.mark.parametrize("k, n", CONV1DS)
def test_a_one_token_bf16_conv1d_matches_the_exact_product(k, n, compiled):
    """GPT-2's `Conv1D`: `addmm(bias, x, W)` with W stored `[K, N]`."""
    torch.manual_seed(k * n)
    x, w, b = torch.randn(1, 1, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    conv1d = lambda x, w, b: torch.addmm(b, x.view(-1, k), w).view(1, 1, n) if b is not None else (x @ w)
    check_product(conv1d, x, w, b, "tpu_dynamo.bf16_vecmat", compiled)


def test_nan_and_infinity_reach_the_outputs_they_touch():
    """A NaN or an infinite weight makes its output row NaN or infinite, as in eager."""
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    w[3, 5], w[70, 0] = float("nan"), float("inf")
    x[0, 0, 0] = 1.0
    fn = lambda x, w: torch.nn.functional.linear(x, w)
    with torch.no_grad():
        got, want = compile_tpu(fn)(x, w), fn(x, w)
    assert got[0, 0, 3].isnan() and want[0, 0, 3].isnan()
    assert got[0, 0, 70] == want[0, 0, 70] == float("inf")
    assert torch.isfinite(got[0, 0, [0, 1, 2, 4, 69, 71]]).all()


needs_f32_kernels = pytest.mark.skipif(not F32_PRODUCTS, reason="f32 products, attention, norms and convolutions are registered on CPUs with AVX2 and FMA or AVX-512")
# Three bf16 MLP tests too: without AVX-512 XLA's own bf16 products, GELU and SiLU run them,
# and miss those tests' bounds against eager's (an AMD Zen 3).
needs_avx512 = pytest.mark.skipif(
    not AVX512,
    reason="kept weights' long contractions run on our kernel on CPUs with AVX-512 only (and without it"
    " XLA's own bf16 products miss the bf16 MLP tests' bounds)",
)


def check_f32_product(fn, args, target, compiled):
    """Within f32 summation's rounding (K · 2^-24 of the sum of the terms' magnitudes) of the
    exact (f64) product, and computed by our custom call `target`."""
    with torch.no_grad():
        got = compile_tpu(fn)(*args)
    exact = fn(*(a.double() for a in args))
    magnitudes = fn(*(a.double().abs() for a in args))
    k = args[0].shape[-1]
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= k * 2.0**-24 * magnitudes + 1e-30).all()
    ((graph_json, _),) = compiled
    assert target in _native.compile(graph_json, need_stablehlo=True).stablehlo


# (N, C, O, H, W): the tiny UNet's convolutions (its input's 4 channels, 32 at 32×32, 64 at 16×16),
# images narrower than a vector and off its 16 positions, output channels off the kernel's 12.
CONVS = [(1, 4, 32, 32, 32), (1, 32, 32, 32, 32), (1, 64, 64, 16, 16), (2, 8, 13, 8, 8), (1, 3, 5, 5, 7), (2, 20, 30, 9, 40)]


@needs_f32_kernels
@pytest.mark.parametrize("n, c, o, h, w", CONVS)
@pytest.mark.parametrize("bias", [False, True])
def test_an_f32_3x3_convolution_runs_our_kernel(n, c, o, h, w, bias, compiled):
    """Within f32 summation's rounding (C·9 · 2^-24 of the sum of the terms' magnitudes) of the
    exact (f64) convolution, padding 1 as zeros."""
    torch.manual_seed(n * c + o * h + w)
    args = (torch.randn(n, c, h, w), torch.randn(o, c, 3, 3), torch.randn(o) if bias else None)
    conv = lambda x, wt, b: torch.nn.functional.conv2d(x, wt, b, padding=1)
    with torch.no_grad():
        got = compile_tpu(conv)(*args)
    double = lambda f: tuple(None if a is None else f(a.double()) for a in args)
    exact, magnitudes = conv(*double(lambda a: a)), conv(*double(torch.abs))
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= c * 9 * 2.0**-24 * magnitudes + 1e-30).all()
    assert kernel_calls(compiled, [CONV_KERNEL]) == 1


@needs_f32_kernels
@pytest.mark.parametrize(
    "form",
    [dict(stride=2, padding=1), dict(padding=0), dict(padding=1, dilation=2), dict(padding=1, groups=2), dict(padding=2, kernel=5)],
)
def test_other_f32_convolutions_stay_xla_s(form, compiled):
    """Strided, unpadded, dilated and grouped 3×3 convolutions, and 5×5 ones, are not the kernel's."""
    form = dict(form)
    k, groups = form.pop("kernel", 3), form.get("groups", 1)
    torch.manual_seed(k)
    x, wt = torch.randn(1, 8, 16, 16), torch.randn(8, 8 // groups, k, k)
    conv = lambda x, wt: torch.nn.functional.conv2d(x, wt, **form)
    with torch.no_grad():
        got, want = compile_tpu(conv)(x, wt), conv(x, wt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert kernel_calls(compiled, [CONV_KERNEL]) == 0


@needs_f32_kernels
def test_a_convolution_s_nan_and_infinity_reach_the_outputs_they_touch(compiled):
    """A NaN input makes every output whose window holds it NaN, an infinite one ±inf (NaN where
    infinities of both signs meet), as eager's; the others stay finite and agree."""
    torch.manual_seed(3)
    x, wt = torch.randn(1, 4, 20, 20), torch.randn(6, 4, 3, 3)
    x[0, 1, 0, 5], x[0, 2, 10, 19], x[0, 3, 12, 3] = float("nan"), float("inf"), -float("inf")
    conv = lambda x, wt: torch.nn.functional.conv2d(x, wt, padding=1)
    with torch.no_grad():
        got, want = compile_tpu(conv)(x, wt), conv(x, wt)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert got.isnan().any() and got.isinf().any()
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    assert kernel_calls(compiled, [CONV_KERNEL]) == 1


# (rows, K, N): a tiny Llama's projections at batch 1 and 8, GPT-2's MLP, an LM head, the fewest
# rows taken, and sizes off the kernel's tiles (12 rows, 32 columns, 16-wide K blocks).
F32_SHAPES = [(128, 64, 64), (1024, 64, 172), (1024, 64, 256), (128, 64, 1000), (64, 256, 512), (77, 70, 77), (100, 33, 200)]


@needs_f32_kernels
@pytest.mark.parametrize("rows, k, n", F32_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_an_f32_linear_of_a_short_contraction_runs_our_kernel(rows, k, n, bias, compiled):
    torch.manual_seed(rows * k + n)
    x, w = torch.randn(1, rows, k), torch.randn(n, k)
    args = (x, w, torch.randn(n)) if bias else (x, w)
    check_f32_product(torch.nn.functional.linear, args, BIAS_KERNELS[0] if bias else F32_KERNELS[0], compiled)


@needs_f32_kernels
@pytest.mark.parametrize("rows, k, n", F32_SHAPES)
def test_an_f32_conv1d_of_a_short_contraction_runs_our_kernel(rows, k, n, compiled):
    """GPT-2's `Conv1D`: `addmm(bias, x, W)` with W stored `[K, N]`, the bias added by the kernel."""
    torch.manual_seed(rows + k * n)
    args = (torch.randn(rows, k), torch.randn(k, n), torch.randn(n))
    check_f32_product(lambda x, w, b: torch.addmm(b, x, w), args, BIAS_KERNELS[1], compiled)


@needs_f32_kernels
@pytest.mark.parametrize("rows, k, n", [(1, 576, 576), (32, 256, 1024), (128, 576, 576), (64, 16, 16), (8192, 128, 128)])
def test_other_f32_products_stay_xla_dots(rows, k, n, compiled):
    """One row or a few (bound by reading the weight, where XLA's kernels are faster), long
    contractions (our panel no longer in L1), and products too small or too large to gain."""
    x, w = torch.randn(rows, k), torch.randn(n, k)
    with torch.no_grad():
        got = compile_tpu(torch.nn.functional.linear)(x, w)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-4 * k**0.5)
    ((graph_json, _),) = compiled
    stablehlo = _native.compile(graph_json, need_stablehlo=True).stablehlo
    assert not any(target in stablehlo for target in F32_KERNELS)


class KeptConv1D(torch.nn.Module):
    """GPT-2's `Conv1D`: `addmm(bias, x, W)` with a resident W stored `[K, N]`."""

    def __init__(self, k: int, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(k, n) / k**0.5)
        self.bias = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


# (rows, K, N, module): GPT-2 small's attention and MLP projections, SmolLM-135M's, a wide
# weight the threads take a share of columns of each, and sizes off the tiles' blocks (rows not
# a multiple of 32, K of 32, N of 32).
LONG_CONTRACTIONS = [
    (128, 768, 2304, "conv1d"), (128, 3072, 768, "conv1d"), (128, 576, 1536, "linear"), (128, 1536, 576, "linear_bias"),
    (64, 768, 2000, "linear_bias"), (100, 300, 97, "linear_bias"), (70, 1000, 64, "conv1d"),
]


# (rows, K, N, module): a decode step's rows (one prompt's to eight's; split by columns between
# the threads from 1 MiB) and a short prompt's times resident weights, products of 2^18 flops or
# more (one row times 128 K values).
FEW_ROWS = [
    (1, 576, 1536, "linear"), (1, 1536, 576, "linear_bias"), (4, 576, 576, "conv1d"), (1, 576, 4000, "linear"),
    (3, 256, 512, "linear_bias"), (8, 576, 1536, "linear_bias"), (16, 576, 1536, "linear"), (40, 1536, 576, "conv1d"),
]


def kept_product(rows: int, k: int) -> bool:
    """Whether our kernel takes an f32 product of `rows` rows times a resident weight past K = 256
    (or, below 64 rows, of 2^18 flops or more): on AMX tiles from the weight's pieces at any K,
    from 64 rows; on AVX-512 from its f32 panels up to K = 2048, any rows."""
    amx = bool(tpu_dynamo.device_info()["amx"])
    return (amx and rows >= 64) or (not amx and k <= 2048)


@needs_avx512
@pytest.mark.parametrize("rows, k, n, module", LONG_CONTRACTIONS + FEW_ROWS)
def test_a_kept_weight_s_long_contraction_runs_on_the_tiles(rows, k, n, module, compiled):
    """Past K = 256 our kernel takes a product only from a resident weight it keeps packed: on
    AMX tiles from its pieces (1.6× XLA's speed on GPT-2 small's shapes), or on AVX-512 from its
    panels up to K = 2048 (0.86-0.98 of XLA's time on SmolLM-135M's), there a decode step's or
    a short prompt's few rows too (faster than XLA's matrix-vector product or one-thread GEMM, a
    decode step's wide weight's columns split between both threads); elsewhere XLA keeps it. Either way the result is within f32 summation's
    rounding of the exact product, on each call."""
    torch.manual_seed(rows + k + n)
    layer = KeptConv1D(k, n) if module == "conv1d" else torch.nn.Linear(k, n, bias=module == "linear_bias")
    x = torch.randn(rows, k)
    f = compile_tpu(layer)
    weight = layer.weight.double() if module == "conv1d" else layer.weight.double().T
    bias = 0.0 if layer.bias is None else layer.bias.double()
    exact, magnitudes = x.double() @ weight + bias, x.double().abs() @ weight.abs() + abs(bias)
    with torch.no_grad():
        for _ in range(2):
            got = f(x)
            assert ((got.double() - exact).abs() <= k * 2.0**-24 * magnitudes).all()
    assert kernel_calls(compiled, F32_KERNELS if layer.bias is None else BIAS_KERNELS) == int(kept_product(rows, k))


@needs_avx512
def test_a_decode_at_a_real_width_matches_eager_with_its_rows_on_our_kernel():
    """A Llama with 1 MiB projections (hidden 256, MLP 1024) decoding greedily: its steps' single
    rows run on our kernel (split by columns, the gated SiLU and residual adds applied by it),
    the same tokens as eager and every step's logits within 1e-4."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 512, (1, 9), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        modules = []
        model.forward = compile_tpu(model.forward, options={"debug_callback": lambda d: modules.append(d["stablehlo"])})
        got = model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    if not tpu_dynamo.device_info()["amx"]:
        steps = [m for m in modules if "tensor<1x1x256xf32>" in m]
        assert steps and all(any(f'"{t}"' in m for t in F32_KERNELS + BIAS_KERNELS) for m in steps)


@needs_f32_kernels
@pytest.mark.parametrize("rows, k, n, module", LONG_CONTRACTIONS + [(64, 64, 256, "linear"), (1024, 64, 172, "conv1d")])
def test_a_kept_bf16_weight_s_product_runs_on_the_tiles(rows, k, n, module, compiled):
    """bf16 rows times a resident bf16 weight run on AMX tiles as they are, the sums in f32
    rounded once to bf16 as eager's: within one bf16 step of the exact product plus f32
    summation's rounding, and equal to eager's but for rare ties summed in another order."""
    torch.manual_seed(rows * k + n)
    layer = (KeptConv1D(k, n) if module == "conv1d" else torch.nn.Linear(k, n, bias=module == "linear_bias")).to(torch.bfloat16)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    weight = layer.weight.double() if module == "conv1d" else layer.weight.double().T
    exact = x.double() @ weight + (0.0 if layer.bias is None else layer.bias.double())
    magnitudes = x.double().abs() @ weight.abs() + (0.0 if layer.bias is None else layer.bias.double().abs())
    with torch.no_grad():
        got, want = compile_tpu(layer)(x), layer(x)
    step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    assert got.dtype == torch.bfloat16 and ((got.double() - exact).abs() <= step + k * 2.0**-24 * magnitudes).all()
    assert (got != want).sum() <= max(2, got.numel() // 500)
    kernels = BF16_TILE_BIAS_KERNELS if layer.bias is not None else BF16_TILE_KERNELS
    assert kernel_calls(compiled, kernels) == int(tpu_dynamo.device_info()["bf16_products"])


@needs_f32_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_addmm_of_a_full_input_adds_it_after_the_product(dtype, compiled):
    """`addmm(c, a, w)` with `c` shaped as the result (not a bias `[N]`) is not given to the
    kernels that add a bias (it was, and their handler refused it at run time): the product
    runs as any, `c` is added after it."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 256, dtype=dtype))
    c, a = torch.randn(128, 256, dtype=dtype), torch.randn(128, 64, dtype=dtype)
    f = lambda c, a: torch.addmm(c, a, w)
    with torch.no_grad():
        got, want = compile_tpu(f)(c, a), f(c, a)
    tolerance = 2e-5 if dtype == torch.float32 else 2**-6
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * 10)
    assert kernel_calls(compiled, BIAS_KERNELS + BF16_TILE_BIAS_KERNELS) == 0


@needs_f32_kernels
def test_autocast_s_bf16_copy_of_a_weight_stays_xla_s(compiled):
    """Under autocast the bf16 copy of an f32 weight is computed from weights alone (hoist.py)
    and read as it is: on the tiles it would be packed on every call (SmolLM-135M's forward 72 →
    263 ms), so only a parameter's own matrix goes there."""
    torch.manual_seed(6)
    layer, x = torch.nn.Linear(768, 1536), torch.randn(128, 768)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compile_tpu(layer)(x), layer(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert (got != want).sum() <= max(2, got.numel() // 500)
    assert kernel_calls(compiled, BF16_TILE_KERNELS + F32_KERNELS) == 0


@needs_f32_kernels
def test_bf16_nan_and_infinity_on_the_tiles_go_as_eager_s():
    """bf16 values are their own pieces: an infinity or NaN enters the tiles' products as it
    is, and an infinity times a zero weight makes NaN, as in eager."""
    torch.manual_seed(4)
    layer = torch.nn.Linear(768, 256, bias=False).to(torch.bfloat16)
    x = torch.randn(128, 768, dtype=torch.bfloat16)
    x[5, 7], x[9, 3], x[11] = float("inf"), float("nan"), 0.0
    x[11, 0] = float("-inf")
    with torch.no_grad():
        layer.weight[3, 0] = 0.0
        got, want = compile_tpu(layer)(x), layer(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert got[11, 3].isnan() and got[5].isinf().all() and got[9].isnan().all()
    assert (got != want)[torch.isfinite(want)].sum() <= max(2, got.numel() // 500)


# (input shape, output channels, the layer's form, bands of output rows): a strided downsampler
# (SD1.5's UNet's first at batch 2, 11 MiB of windows in two bands), a dilated 3×3, a 5×5, a
# Conv1d and a Conv3d, each of at least 256 outputs and with windows larger than its input and
# weight (smaller ones are XLA's product of the weight and the windows).
BF16_CONVS = [
    ((2, 320, 64, 64), 320, dict(kernel_size=3, stride=2, padding=1), 2),
    ((1, 24, 40, 40), 256, dict(kernel_size=3, padding=2, dilation=2), 1),
    ((1, 8, 48, 48), 272, dict(kernel_size=5, padding=2), 1),
    ((2, 32, 256), 256, dict(kernel_size=3, padding=1), 1),
    ((1, 8, 8, 16, 16), 256, dict(kernel_size=3, padding=1), 1),
]
# (input shape, output channels): 3×3 convolutions of stride 1 and padding 1 for the bf16
# kernel: SD1.5's UNet's first width at batch 2, a VAE decoder's last, odd channel counts (a
# zero channel pads the pairs), planes narrower than a vector, output channels off its twelve,
# and windows small enough for XLA's product on a plane of 256 positions (the kernel's first).
BF16_3X3_CONVS = [
    ((2, 320, 32, 32), 320), ((1, 128, 64, 64), 128), ((1, 7, 9, 13), 13), ((2, 4, 5, 7), 30), ((1, 33, 16, 40), 64),
    ((1, 256, 16, 16), 256),
]


def bf16_conv_layer(shape, out, form, bias=True):
    layer = {3: torch.nn.Conv1d, 4: torch.nn.Conv2d, 5: torch.nn.Conv3d}[len(shape)](shape[1], out, bias=bias, **form)
    return layer.to(torch.bfloat16)


@needs_f32_kernels
@pytest.mark.parametrize("shape, out, form, bands", BF16_CONVS, ids=["strided", "dilated", "5x5", "1d", "3d"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_bf16_convolution_runs_as_its_windows_on_the_tiles(shape, out, form, bands, bias, compiled):
    """A bf16 convolution of a resident weight runs as its windows (each kernel offset's
    channels together) times the weight as it lies on the tiles, the f32 sums (with the bias)
    rounded once to bf16 as eager's: within one bf16 step of the exact convolution plus f32
    summation's rounding, and equal to eager's but for rare ties summed in another order.
    XLA:CPU convolves bf16 in f32 at its f32 product's rate (SD1.5's `[2, 320, 32, 32]`: 21 ms
    against eager's 9)."""
    check_bf16_convolution(shape, out, form, bias, compiled, BF16_CONV_KERNELS[1:] if bias else BF16_CONV_KERNELS[:1], bands)


@needs_f32_kernels
def test_a_bf16_convolution_of_wide_windows_runs_in_bands_of_rows(compiled):
    """Windows past 8 MiB are written and multiplied a band of output rows at a time: `[1, 32,
    256, 256]`'s strided 3×3 (9 MiB) in two bands, 113 rows and 15, the same values."""
    check_bf16_convolution((1, 32, 256, 256), 256, dict(kernel_size=3, stride=2, padding=1), True, compiled, BF16_CONV_KERNELS, 2)


@needs_f32_kernels
@pytest.mark.parametrize("shape, out", BF16_3X3_CONVS)
@pytest.mark.parametrize("bias", [False, True])
def test_a_bf16_3x3_convolution_runs_our_kernel(shape, out, bias, compiled):
    """A bf16 3×3 convolution of stride 1 and padding 1 runs as our kernel on AVX-512 BF16, the
    channels in pairs, its f32 sums (with the bias) rounded once to bf16 as eager's: as
    `test_a_bf16_convolution_runs_as_its_windows_on_the_tiles` checks."""
    check_bf16_convolution(shape, out, dict(kernel_size=3, padding=1), bias, compiled, [BF16_CONV3X3_KERNEL], 1)


def check_bf16_convolution(shape, out, form, bias, compiled, kernels, calls):
    """`bf16_conv_layer`'s values on a random input as `test_a_bf16_convolution_runs_as_its_windows_on_the_tiles`
    describes, in `calls` calls of `kernels` where bf16 products run on the tiles."""
    torch.manual_seed(sum(shape) + out)
    layer, x = bf16_conv_layer(shape, out, form, bias), torch.randn(shape, dtype=torch.bfloat16)
    with torch.no_grad():
        got, want = compile_tpu(layer)(x), layer(x)
    conv = getattr(torch.nn.functional, f"conv{len(shape) - 2}d")
    unbiased = {key: v for key, v in form.items() if key != "kernel_size"}
    exact = conv(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double(), **unbiased)
    magnitudes = conv(x.double().abs(), layer.weight.double().abs(), None if layer.bias is None else layer.bias.double().abs(), **unbiased)
    step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    k = layer.weight[0].numel()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.double() - exact).abs() <= step + k * 2.0**-24 * magnitudes).all()
    assert (got != want).sum() <= max(2, got.numel() // 500)
    assert kernel_calls(compiled, kernels) == calls * int(tpu_dynamo.device_info()["bf16_products"])


@needs_f32_kernels
@pytest.mark.parametrize("form", ["grouped", "transposed", "weight_given_strided", "f32", "narrow_strided", "few_positions"])
def test_other_bf16_convolutions_stay_xla_s(form, compiled):
    """Grouped and transposed convolutions, a strided one of a weight given as an input (not kept
    on the tiles) or of fewer than 256 outputs (where writing the windows costs what the tiles
    save), f32 ones, and a 3×3 one whose windows are XLA's product on planes of fewer than 256
    positions are neither bf16 kernel's; eager's values either way."""
    torch.manual_seed(1)
    shape, out = ((2, 256, 8, 8), 256) if form == "few_positions" else ((1, 32, 24, 24), 128 if form == "narrow_strided" else 256)
    dtype = torch.float32 if form == "f32" else torch.bfloat16
    x = torch.randn(shape, dtype=dtype)
    if form == "grouped":
        fn = torch.nn.Conv2d(32, out, 3, padding=1, groups=2).to(dtype)
    elif form == "transposed":
        fn = torch.nn.ConvTranspose2d(32, out, 3, padding=1).to(dtype)
    elif form == "weight_given_strided":
        w = torch.randn(out, 32, 3, 3, dtype=dtype)
        fn = lambda x: torch.nn.functional.conv2d(x, w, stride=2, padding=1)
    else:
        fn = torch.nn.Conv2d(shape[1], out, 3, stride=2 if form == "narrow_strided" else 1, padding=1).to(dtype)
    with torch.no_grad():
        got, want = compile_tpu(fn)(x), fn(x)
    torch.testing.assert_close(got, want, rtol=0.02 if dtype == torch.bfloat16 else 1e-4, atol=0.05 if dtype == torch.bfloat16 else 1e-4)
    assert kernel_calls(compiled, BF16_CONV_KERNELS + [BF16_CONV3X3_KERNEL]) == 0


@needs_f32_kernels
@pytest.mark.parametrize("stride", [1, 2], ids=["3x3_kernel", "windows"])
def test_a_bf16_convolution_s_nan_and_infinity_go_as_eager_s(stride):
    """bf16 inputs enter both kernels' products as they are: a NaN makes the outputs whose window
    holds it NaN, an infinity ±inf (NaN where it meets a zero weight or the other sign), as
    eager's."""
    torch.manual_seed(6)
    layer = torch.nn.Conv2d(16, 256, 3, stride=stride, padding=1).to(torch.bfloat16)
    x = torch.randn(1, 16, 20 * stride, 20 * stride, dtype=torch.bfloat16)
    x[0, 1, 0, 5], x[0, 2, 10, 19], x[0, 3, 12, 3] = float("nan"), float("inf"), -float("inf")
    with torch.no_grad():
        layer.weight[7, 2] = 0.0
        got, want = compile_tpu(layer)(x), layer(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[want.isinf()], want[want.isinf()])
    assert got.isnan().any() and got.isinf().any()
    assert (got != want)[torch.isfinite(want)].sum() <= max(2, got.numel() // 500)


@needs_f32_kernels
def test_an_infinite_input_row_of_a_long_contraction_gives_eager_s_infinities():
    """A row that is not all finite has no bf16 pieces: the vector kernel computes it."""
    torch.manual_seed(3)
    layer = torch.nn.Linear(768, 96)
    x = torch.randn(128, 768)
    x[5, 7] = float("inf")
    with torch.no_grad():
        got, want = compile_tpu(layer)(x), layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, equal_nan=True)
    assert torch.isinf(got[5]).sum() >= 95


@needs_f32_kernels
def test_f32_nan_and_infinity_reach_the_outputs_they_touch():
    """A NaN or an infinite weight makes its output column NaN or infinite in every row, as in
    eager; an infinity times zero is NaN there too."""
    x, w = torch.randn(64, 64), torch.randn(96, 64)
    w[3, 5], w[70, 0], w[90, 9] = float("nan"), float("inf"), float("inf")
    x[:, 0], x[1, 9] = 1.0, 0.0
    fn = lambda x, w: torch.nn.functional.linear(x, w)
    with torch.no_grad():
        got, want = compile_tpu(fn)(x, w), fn(x, w)
    assert got[:, 3].isnan().all() and want[:, 3].isnan().all()
    assert (got[:, 70] == float("inf")).all() and (want[:, 70] == float("inf")).all()
    assert got[1, 90].isnan() and want[1, 90].isnan()
    assert torch.isfinite(got[:, [0, 1, 2, 4, 69, 71]]).all()


@needs_f32_kernels
def test_an_infinite_input_or_kept_weight_gives_eager_s_infinities():
    """Where AMX runs the products (from bf16 pieces of each value, which an infinity does not
    have), rows of `x` or a weight that are not all finite take the f32 kernel: an infinite
    input gives its row's infinities and a kept weight's infinity its column's, as in eager."""
    torch.manual_seed(5)
    linear = torch.nn.Linear(64, 96, bias=False)
    x = torch.randn(128, 64)
    x[5, 7] = float("inf")
    compiled = compile_tpu(linear)
    with torch.no_grad():
        for _ in range(2):
            got, want = compiled(x), linear(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
            assert torch.isinf(got[5]).sum() >= 95 and torch.isinf(got[:, 11]).sum() >= 127 * linear.weight[11, 3].isinf()
            linear.weight[11, 3] = float("-inf")


def gelu_mlp(form: str, k: int, n: int) -> torch.nn.Module:
    """A product then its tanh GELU as GPT-2 writes it (`Conv1D`, then `gelu_new`'s ops), as
    transformers' `gelu_pytorch_tanh` and diffusers' `GELU(approximate="tanh")` do (`nn.Linear`,
    then `F.gelu(approximate="tanh")`)."""
    from diffusers.models.activations import GELU
    from transformers.activations import ACT2FN
    from transformers.pytorch_utils import Conv1D

    if form == "diffusers":
        return GELU(k, n, approximate="tanh")
    product = Conv1D(n, k) if form == "gelu_new" else torch.nn.Linear(k, n)
    torch.nn.init.normal_(product.bias)
    return torch.nn.Sequential(product, ACT2FN[form])


def kernel_calls(compiled, targets: list[str]) -> int:
    """Calls of the kernels `targets` in the graphs compiled so far (each compiled again for its
    text, which `compiled` records too: hence the copy)."""
    texts = [_native.compile(graph_json, need_stablehlo=True).stablehlo for graph_json, _ in list(compiled)]
    return sum(text.count(f'"{target}"') for text in texts for target in targets)


def run_and_texts(fn, *args) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """`fn` compiled anew and eager on `args`, and the StableHLO of every graph it compiled
    (taken from the compile calls: a test's `compiled` fixture sees one Dynamo graph only)."""
    calls = []
    compile_now = _native.compile
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_native, "compile", lambda graph_json, **kw: calls.append(graph_json) or compile_now(graph_json, **kw))
        with torch.no_grad():
            torch._dynamo.reset()
            got, want = compile_tpu(fn)(*args), fn(*args)
    return got, want, [compile_now(g, need_stablehlo=True).stablehlo for g in calls]


def check_finished_product(module, x, targets, compiled, calls=1):
    """`module` on `x` as close to the f64 result as eager is (within twice its error, plus
    1e-6), its product and what follows it `calls` calls of our kernel `targets`."""
    with torch.no_grad():
        got, want = compile_tpu(module)(x), module(x)
        exact = module.double()(x.double())
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + 1e-6
    assert kernel_calls(compiled, targets) == calls


@needs_f32_kernels
@pytest.mark.parametrize("shape, n", [((1, 128, 64), 256), ((8, 128, 64), 256), ((77, 70), 200), ((2, 40, 33), 130)])
@pytest.mark.parametrize("form", ["gelu_new", "gelu_pytorch_tanh", "diffusers"])
def test_a_tanh_gelu_after_a_product_runs_in_our_kernel(shape, n, form, compiled):
    """The product, its bias and the GELU are one call of our kernel."""
    torch.manual_seed(sum(shape) + n)
    check_finished_product(gelu_mlp(form, shape[-1], n), 2.0 * torch.randn(shape), GELU_KERNELS, compiled)


@needs_f32_kernels
def test_a_product_read_besides_its_gelu_keeps_xla_s_gelu():
    """Where something else reads the product too, the GELU stays XLA's (the kernel would not
    keep the product before it); the bias is still the kernel's."""
    mlp = gelu_mlp("gelu_new", 64, 256)

    def fn(x):
        h = mlp[0](x)
        return mlp[1](h) + h

    got, want, texts = run_and_texts(fn, torch.randn(128, 64))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert any(BIAS_KERNELS[1] in t for t in texts) and not any(target in t for t in texts for target in GELU_KERNELS)


@needs_f32_kernels
def test_a_gelu_product_s_nan_and_infinity_go_as_eager_s(compiled):
    """A row of `x` with a NaN, or with an infinity, and an infinite bias: the outputs they
    touch are NaN or ±∞ as in eager (GELU(−∞) = −∞ · 0 is NaN, GELU(∞) = ∞)."""
    mlp = gelu_mlp("gelu_new", 64, 256)
    x = torch.randn(128, 64)
    x[1, 3], x[4, 0] = float("nan"), float("inf")
    with torch.no_grad():
        mlp[0].bias[[7, 9]] = torch.tensor([float("inf"), float("-inf")])
        got, want = compile_tpu(mlp)(x), mlp(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert got[:, 9].isnan().all() and (got[[0, 2], 7] == float("inf")).all() and got[1].isnan().all()
    assert kernel_calls(compiled, GELU_KERNELS) == 1


@needs_avx512
@pytest.mark.parametrize("shape, n", [((2, 128, 256), 1024), ((300, 200), 500), ((2, 40, 96), 130)])
@pytest.mark.parametrize("form", ["gelu_pytorch_tanh", "diffusers"])
def test_a_bf16_tanh_gelu_after_a_kept_product_runs_on_the_tiles(shape, n, form, compiled):
    """A bf16 `gelu(addmm(..), approximate="tanh")` (diffusers' `FeedForward`) is one call of
    the tiles' kernel: the bias added to the f32 sums, rounded, the GELU of that computed in f32
    and rounded again, as eager's two ops: within one bf16 step of eager's (a product's rounding
    tie summed in another order moves its GELU by a step), and equal to it but for a few."""
    torch.manual_seed(sum(shape) + n)
    mlp = gelu_mlp(form, shape[-1], n).to(torch.bfloat16)
    x = (2.0 * torch.randn(shape)).to(torch.bfloat16)
    with torch.no_grad():
        got, want = compile_tpu(mlp)(x), mlp(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    step = 2.0 ** (torch.floor(torch.log2(want.double().abs().clamp_min(1e-30))) - 7)
    assert ((got.double() - want.double()).abs() <= step + 1e-6).all()
    assert (got != want).sum() <= max(4, got.numel() // 200)
    assert kernel_calls(compiled, BF16_TILE_GELU_KERNELS) == int(tpu_dynamo.device_info()["bf16_products"])


@needs_f32_kernels
def test_a_bf16_gelu_written_out_stays_xla_s_and_special_values_go_as_eager_s(compiled):
    """`gelu_new`'s ops in bf16 each round to bf16, which one kernel would not: they stay XLA's
    after the bias kernel. `aten.gelu`'s kernel gives NaN, ±∞ and -0 where eager does (a NaN
    row, an infinite bias: GELU(−∞) = −∞ · 0 is NaN)."""
    written_out = gelu_mlp("gelu_new", 256, 512).to(torch.bfloat16)
    got, want, texts = run_and_texts(written_out, torch.randn(128, 256, dtype=torch.bfloat16))
    # A product a step off eager's (a tie summed in another order) moves the rounded ops after it.
    torch.testing.assert_close(got, want, rtol=2**-6, atol=1e-2)
    assert not any(target in t for t in texts for target in BF16_TILE_GELU_KERNELS)
    assert any(target in t for t in texts for target in BF16_TILE_BIAS_KERNELS) == tpu_dynamo.device_info()["bf16_products"]
    mlp = gelu_mlp("diffusers", 256, 512).to(torch.bfloat16)
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    with torch.no_grad():
        mlp.proj.bias[[7, 9, 11]] = torch.tensor([float("inf"), float("-inf"), -1e4], dtype=torch.bfloat16)
        got, want = compile_tpu(mlp)(x), mlp(x)
    step = 2.0 ** (torch.floor(torch.log2(want.double().abs().clamp_min(1e-30))) - 7)
    close = (got.double() - want.double()).abs() <= step + 1e-6
    assert (close | (got == want) | (got.isnan() & want.isnan())).all()
    assert got[1].isnan().all() and got[:, 9].isnan().all() and (got[[0, 2], 7] == float("inf")).all()
    assert (got[[0, 2], 11] == 0).all() and torch.signbit(got[[0, 2], 11]).all()
    assert kernel_calls(compiled, BF16_TILE_GELU_KERNELS) == int(tpu_dynamo.device_info()["bf16_products"])


def gated_mlp(form: str, k: int, n: int) -> torch.nn.Module:
    """A gated MLP: transformers' `LlamaMLP` (`down(silu(gate(x)) * up(x))`, SiLU reaching the
    backend as `x * sigmoid(x)`), or the up product first and `F.silu` (`aten.silu`)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    if form == "llama":
        return LlamaMLP(LlamaConfig(hidden_size=k, intermediate_size=n, num_attention_heads=1, num_key_value_heads=1, head_dim=2))

    class UpFirst(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.up = torch.nn.Linear(k, n, bias=False), torch.nn.Linear(k, n, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.up(x) * torch.nn.functional.silu(self.gate(x))

    return UpFirst()


@needs_f32_kernels
@pytest.mark.parametrize("shape, n", [((1, 128, 64), 128), ((8, 128, 64), 172), ((77, 70), 200), ((2, 40, 33), 130)])
@pytest.mark.parametrize("form", ["llama", "up_first"])
def test_a_gated_mlp_s_silu_and_product_run_in_our_kernel(shape, n, form, compiled):
    """The gate's product, its SiLU and the product with the up projection are one call of our
    kernel."""
    torch.manual_seed(sum(shape) + n)
    check_finished_product(gated_mlp(form, shape[-1], n), 2.0 * torch.randn(shape), SILU_KERNELS, compiled)


class Residual(torch.nn.Module):
    """A projection added to the residual stream, as transformers write it: Llama's `residual +
    o_proj(h)` (`nn.Linear` without a bias), GPT-2's `attn_output + residual` (`Conv1D`, an
    `addmm` viewed back), or an `nn.Linear` with its bias; the residual is `x` itself or, with
    `apart`, a value computed beside the product."""

    def __init__(self, form: str, k: int, apart: bool = False) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.form, self.apart = form, apart
        self.proj = Conv1D(k, k) if form == "gpt2" else torch.nn.Linear(k, k, bias=form == "linear_bias")
        if form != "llama":
            torch.nn.init.normal_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x * 0.5 if self.apart else x
        return self.proj(x) + residual if self.form == "gpt2" else residual + self.proj(x)


@needs_f32_kernels
@pytest.mark.parametrize("shape", [(1, 128, 64), (8, 128, 64), (77, 70), (3, 50, 96)])
@pytest.mark.parametrize("form, targets", [("llama", PLUS_KERNELS), ("gpt2", BIAS_PLUS_KERNELS), ("linear_bias", BIAS_PLUS_KERNELS)])
@pytest.mark.parametrize("apart", [False, True], ids=["input", "apart"])
def test_a_residual_added_to_a_product_is_added_by_our_kernel(shape, form, targets, apart, compiled):
    """The product, its bias and the residual are one call of our kernel, the sum rounded once
    after the product as eager's two ops round it: equal to eager's where the product is."""
    torch.manual_seed(sum(shape))
    module = Residual(form, shape[-1], apart)
    check_finished_product(module, 2.0 * torch.randn(shape), targets, compiled)
    x = torch.randn(shape)
    with torch.no_grad():
        product = compile_tpu(module.proj)(x)
        torch.testing.assert_close(compile_tpu(module)(x), product + (x * 0.5 if apart else x), rtol=0, atol=0)


@needs_f32_kernels
def test_a_residual_sum_the_kernel_cannot_make_stays_xla_s():
    """Not the kernel's: a product read besides the sum, a residual broadcast to the product's
    shape, a scaled sum (`alpha`), and a bf16 sum (eager rounds the product to bf16 before it)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(128, 64)
    def read_besides(x):
        h = linear(x)
        return x + h, h.sum()

    forms = {
        "read_besides": read_besides,
        "broadcast": lambda x: linear(x) + x[0],
        "alpha": lambda x: torch.add(x, linear(x), alpha=2.0),
    }
    for name, fn in forms.items():
        got, want, texts = run_and_texts(fn, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
        assert not any(t in text for text in texts for t in PLUS_KERNELS + BIAS_PLUS_KERNELS), name
    block = Residual("linear_bias", 256).to(torch.bfloat16)
    got, want, texts = run_and_texts(block, torch.randn(128, 256, dtype=torch.bfloat16))
    torch.testing.assert_close(got, want, rtol=2**-6, atol=1e-2)
    assert not any(t in text for text in texts for t in PLUS_KERNELS + BIAS_PLUS_KERNELS)


@needs_f32_kernels
def test_a_residual_s_nan_and_infinity_go_as_eager_s(compiled):
    """A NaN or an infinity in the residual, the input or the bias reaches the outputs it
    touches as in eager (∞ + -∞ is NaN)."""
    module = Residual("gpt2", 64, apart=True)
    x = torch.randn(128, 64)
    x[1, 3], x[4, 0] = float("nan"), float("inf")
    with torch.no_grad():
        module.proj.bias[[7, 9]] = torch.tensor([float("inf"), float("-inf")])
        got, want = compile_tpu(module)(x), module(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert got[1].isnan().all() and got[:, 9].isnan().any()
    assert kernel_calls(compiled, BIAS_PLUS_KERNELS) == 1


def bf16_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many of `want`'s bf16 steps `got` is from it (0 where both are the same NaN or ±∞)."""
    step = 2.0 ** (torch.floor(torch.log2(want.double().abs().clamp_min(2.0**-133))) - 7)
    return ((got.double() - want.double()) / step).abs().nan_to_num(0.0).where(got != want, 0.0)


@needs_avx512
@pytest.mark.parametrize("shape, n", [((1, 128, 256), 512), ((300, 200), 500), ((2, 40, 96), 130)])
@pytest.mark.parametrize("form", ["llama", "up_first"])
def test_a_bf16_gated_mlp_s_silu_and_product_run_on_the_tiles(shape, n, form, compiled):
    """In bf16 the gate's product, its SiLU (`aten.silu`, or as its decomposition computes it in
    f32 between two converts) and the product with the up projection are one call of the
    tiles' kernel, each rounded where eager rounds it: the gated values within two bf16 steps of
    eager's (a product's rounding tie summed in another order moves what follows it) and equal
    to them but for a few; with Llama's down projection after them, as close as eager's own
    bf16 is to f64."""
    torch.manual_seed(sum(shape) + n)
    mlp = gated_mlp(form, shape[-1], n).to(torch.bfloat16)
    x = (2.0 * torch.randn(shape)).to(torch.bfloat16)
    with torch.no_grad():
        got, want = compile_tpu(mlp)(x), mlp(x)
        exact = mlp.double()(x.double())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    if form == "up_first":
        assert (bf16_steps(got, want) <= 2).all() and (got != want).sum() <= max(4, got.numel() // 100)
    else:
        assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max()
    assert kernel_calls(compiled, BF16_TILE_SILU_KERNELS) == int(tpu_dynamo.device_info()["bf16_products"])


@needs_avx512
def test_a_bf16_gated_mlp_s_nan_and_infinities_go_as_eager_s(compiled):
    """A NaN row of `x` stays NaN, a gate of -∞ gives NaN (−∞ · 0), one of ∞ times the up
    value ∞: as eager's, the rest within two bf16 steps."""
    mlp = gated_mlp("up_first", 256, 512).to(torch.bfloat16)
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    with torch.no_grad():
        mlp.gate.weight[[7, 9], 0] = torch.tensor([float("inf"), float("-inf")], dtype=torch.bfloat16)
        x[:, 0] = x[:, 0].abs() + 0.5
        got, want = compile_tpu(mlp)(x), mlp(x)
    assert (bf16_steps(got, want) <= 2).all()
    assert (got.isnan() == want.isnan()).all() and got[1].isnan().all() and got[:, 9].isnan().all()
    assert (got[:, 7].isinf() == want[:, 7].isinf()).all() and got[:, 7].isinf().sum() >= 100
    assert kernel_calls(compiled, BF16_TILE_SILU_KERNELS) == int(tpu_dynamo.device_info()["bf16_products"])


@needs_avx512
@pytest.mark.parametrize("form", ["gelu_new", "llama"])
def test_a_long_contraction_s_gelu_or_gated_silu_runs_on_the_tiles(form, compiled):
    """At GPT-2 small's and SmolLM-135M's widths (on AMX the weight's pieces past L2's share,
    the threads taking a share of its columns each) the kernel finishes the rows too, where it
    takes the long contraction."""
    torch.manual_seed(9)
    k, n = (768, 3072) if form == "gelu_new" else (576, 1536)
    module = gelu_mlp(form, k, n) if form == "gelu_new" else gated_mlp(form, k, n)
    targets = GELU_KERNELS if form == "gelu_new" else SILU_KERNELS
    check_finished_product(module, torch.randn(1, 64, k), targets, compiled, calls=int(kept_product(64, k)))


@needs_f32_kernels
def test_a_gate_read_besides_its_silu_and_infinities_go_as_eager_s():
    """A gate's product read by something else too keeps XLA's SiLU; NaN and infinite rows of
    `x` give eager's NaN and infinities (SiLU(−∞) = −∞ · 0 is NaN)."""
    mlp = gated_mlp("up_first", 64, 128)
    x = torch.randn(128, 64)

    def read_twice(x):
        g = mlp.gate(x)
        return torch.nn.functional.silu(g) * mlp.up(x) + g

    x_bad = x.clone()
    x_bad[1, 3], x_bad[4, 0], x_bad[6, 2] = float("nan"), float("inf"), float("-inf")
    for fn, arg, fused in ((read_twice, x, False), (mlp, x_bad, True)):
        got, want, texts = run_and_texts(fn, arg)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert any(target in t for t in texts for target in SILU_KERNELS) == fused
    assert got[[1, 4, 6]].isnan().any(dim=1).all() and torch.isfinite(got[[0, 2, 3, 5]]).all()


@needs_f32_kernels
def test_the_vector_kernel_runs_the_products_where_amx_is_turned_off():
    """`TPU_DYNAMO_AMX=0` keeps the AVX-512 kernel (the same results to f32 rounding); on a CPU
    with AMX (Sapphire Rapids, this CI's) the tiles run a kept weight's products otherwise,
    pytest's fault handler's signal stack notwithstanding (Linux grants the tiles' state only
    where signal stacks can hold it)."""
    script = (
        "import torch, tpu_dynamo\n"
        "torch.manual_seed(0)\n"
        "x, linear = torch.randn(128, 64), torch.nn.Linear(64, 1000, bias=False)\n"
        "f = torch.compile(linear, backend='tpu', fullgraph=True)\n"
        "with torch.no_grad():\n"
        "    assert (f(x) - x.double() @ linear.weight.double().T).abs().max() < 1e-5\n"
        "print(tpu_dynamo.device_info()['amx'])\n"
    )
    for setting, expected in (("0", "False"), ("1", None)):
        env = {**os.environ, "TPU_DYNAMO_AMX": setting}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
        assert out.split()[-1] == (expected or str(AMX))
    assert tpu_dynamo.device_info()["amx"] == AMX


def kept_bytes() -> int:
    return tpu_dynamo.stats()["packed_weight_bytes"]


class TwoLinears(torch.nn.Module):
    """A `Linear` weight `[N, K]` and a `Conv1D`-style one `[K, N]`, both products our kernel's."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 160)
        self.down = torch.nn.Parameter(torch.randn(160, 96) / 160**0.5)

    def forward(self, x):
        return torch.relu(self.up(x)) @ self.down


@needs_f32_kernels
def test_weights_are_packed_once_and_again_after_an_in_place_change():
    """A resident weight's panels are kept from one call to the next, and packed anew once the
    weight changes in place (`mul_`, `copy_` under no_grad: the version moves), where a stale
    panel would give the old product."""
    torch.manual_seed(7)
    model, x = TwoLinears(), torch.randn(2, 64, 64)
    compiled_model = torch.compile(model, backend="tpu", fullgraph=True)
    # What earlier tests' graphs keep goes with them, here rather than during this test.
    torch._dynamo.reset()
    tpu_dynamo.reset_stats()
    gc.collect()
    before = kept_bytes()
    if tpu_dynamo.device_info()["amx"]:
        # Six 1 KiB tiles (two halves of 16 columns, three pieces) per 32 columns and 32 of K:
        # [160, 64] as 5 x 2 of them, [160, 96] as 3 x 5.
        packed_bytes = 6 * 1024 * (5 * 2 + 3 * 5)
    else:
        # [160, 64] as 5 panels of [64, 32] f32s, [160, 96] as 3 of [160, 32].
        packed_bytes = 4 * (5 * 64 * 32 + 3 * 160 * 32)
    with torch.no_grad():
        for step in range(4):
            got = compiled_model(x)
            torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
            if step == 0:
                assert kept_bytes() - before == packed_bytes
            if step == 1:
                model.up.weight.mul_(-2.0)
            if step == 2:
                model.down.copy_(torch.randn(160, 96))
    assert kept_bytes() - before == packed_bytes, "the old versions' panels are freed"
    del compiled_model, got
    torch._dynamo.reset()
    tpu_dynamo.reset_stats()
    gc.collect()
    assert kept_bytes() == before, "a weight's panels go with the last graph that holds it"


@needs_f32_kernels
def test_a_weight_read_as_a_user_input_is_never_taken_from_stale_panels():
    """After an in-place change, a graph that takes the same memory as a plain input (read as it
    is) must see the new value even though another graph still holds its declaration of the old
    one until that graph's next call."""
    torch.manual_seed(8)
    model = torch.nn.Linear(64, 128, bias=False)
    x = torch.randn(128, 64)
    with torch.no_grad():
        torch.compile(model, backend="tpu", fullgraph=True)(x)
        model.weight.mul_(3.0)
        w = model.weight.detach()  # the same memory, as a plain tensor
        got = compile_tpu(lambda x, w: torch.nn.functional.linear(x, w))(x, w)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


# (batch, heads, kv heads, queries, keys, head size, causal): the tiny Llama's and GPT-2's
# attention at batch 1 and 8, Flux's and SD3's (no mask), a long causal prompt with grouped
# heads, a real model's head size, causal with fewer keys than queries and more, one query,
# sizes off the kernel's blocks (12 queries, 32 keys, 16-wide heads), and heads of 4 and 12
# values (their values' product in groups of four keys, the last group partial).
ATTENTION_SHAPES = [
    (1, 4, 2, 128, 128, 16, True), (8, 4, 4, 128, 128, 16, True), (1, 2, 2, 1536, 1536, 16, False),
    (2, 4, 4, 288, 288, 8, False), (1, 4, 2, 600, 600, 16, True), (1, 9, 3, 256, 256, 64, True),
    (1, 2, 1, 50, 20, 40, True), (1, 2, 2, 20, 50, 72, True), (1, 4, 2, 1, 70, 16, False),
    (2, 3, 3, 13, 45, 8, False), (2, 3, 3, 13, 45, 33, True), (1, 8, 4, 70, 70, 4, True),
    (1, 2, 2, 37, 1025, 12, False),
]
ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def exact_attention(q, k, v, causal):
    """Output and logsumexp in f64 (query `i` sees keys `0..=i` when causal)."""
    q, k, v = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], 1), v.double().repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


@needs_f32_kernels
@pytest.mark.parametrize("batch, heads, kv_heads, len_q, len_kv, dim, causal", ATTENTION_SHAPES)
def test_f32_attention_runs_our_kernel(batch, heads, kv_heads, len_q, len_kv, dim, causal, compiled):
    """Output and logsumexp within 2e-6 of the f64 values (eager's flash kernel: within 1e-5 of
    ours), from the custom call alone: no product is left to XLA."""
    torch.manual_seed(len_q * dim + heads)
    q = torch.randn(batch, heads, len_q, dim)
    k, v = torch.randn(batch, kv_heads, len_kv, dim), torch.randn(batch, kv_heads, len_kv, dim)
    fn = lambda q, k, v: ATTENTION(q, k, v, is_causal=causal)[:2]
    with torch.no_grad():
        (out, lse), (eager_out, eager_lse) = compile_tpu(fn)(q, k, v), fn(q, k, v)
    exact_out, exact_lse = exact_attention(q, k, v, causal)
    torch.testing.assert_close(out.double(), exact_out, rtol=0, atol=2e-6)
    torch.testing.assert_close(lse.double(), exact_lse, rtol=0, atol=2e-6 * exact_lse.abs().max().item())
    torch.testing.assert_close(out, eager_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, eager_lse, rtol=0, atol=1e-5)
    ((graph_json, _),) = compiled
    stablehlo = _native.compile(graph_json, need_stablehlo=True).stablehlo
    assert ATTENTION_KERNELS[causal] in stablehlo and "dot_general" not in stablehlo


@needs_f32_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_attention_runs_our_kernel(dtype, compiled):
    """Half inputs are widened to f32 for the f32 kernel, as XLA's way computed them, and the
    results rounded back (bf16 on AMX: its tile kernel, below): eager's values within the half
    type's tolerance (its CPU flash kernel also accumulates in f32)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 100, 32, dtype=dtype), torch.randn(2, 2, 100, 32, dtype=dtype), torch.randn(2, 2, 100, 32, dtype=dtype)
    fn = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with torch.no_grad():
        got, want = compile_tpu(fn)(q, k, v), fn(q, k, v)
    assert got.dtype == dtype
    exact, _ = exact_attention(q, k, v, True)
    step = 2e-2 if dtype == torch.bfloat16 else 2e-3
    assert (got.double() - exact).abs().max() <= step and (got.double() - want.double()).abs().max() <= step
    on_tiles = dtype == torch.bfloat16 and tpu_dynamo.device_info()["bf16_products"]
    assert kernel_calls(compiled, [(BF16_ATTENTION_KERNELS if on_tiles else ATTENTION_KERNELS)[1]]) == 1


# SD3.5 Medium's joint attention at 256x256 (589 tokens; 24 heads there) and its image-only one,
# SmolLM's grouped causal heads, query and key counts off the tiles' 32, head sizes off them.
BF16_ATTENTION_SHAPES = [
    (2, 4, 4, 589, 589, 64, False), (2, 4, 4, 256, 256, 64, False), (1, 9, 3, 300, 300, 64, True),
    (1, 2, 1, 50, 20, 40, True), (1, 2, 2, 20, 50, 72, True), (1, 4, 2, 1, 70, 16, False), (2, 3, 3, 45, 45, 8, False),
]


def check_bf16_attention(got, eager, exact, v):
    """Within what eager's bf16 way of computing may lose against f64: each exponential rounded
    to bf16 for the product by `v` (2^-9 of the largest value) and the output rounded once (a
    bf16 step), twice over; and as close to eager's, which rounds the same way."""
    (out, lse), (eager_out, eager_lse), (exact_out, exact_lse) = got, eager, exact
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    bound = 2.0**-8 * (v.double().abs().max() + exact_out.abs())
    assert ((out.double() - exact_out).abs() <= bound).all()
    assert ((out.double() - eager_out.double()).abs() <= bound).all()
    torch.testing.assert_close(lse.double(), exact_lse, rtol=0, atol=1e-5 * exact_lse.abs().max().item())
    torch.testing.assert_close(lse, eager_lse, rtol=0, atol=1e-4)


@needs_f32_kernels
@pytest.mark.parametrize("batch, heads, kv_heads, len_q, len_kv, dim, causal", BF16_ATTENTION_SHAPES)
def test_bf16_attention_runs_on_the_tiles(batch, heads, kv_heads, len_q, len_kv, dim, causal, compiled):
    """On AMX, bf16 attention runs on its tiles as eager's flash kernel computes bf16: scores
    summed in f32, scaled in f32, exponentials rounded to bf16 for the product by `v`, the
    output rounded once (SD3.5 Medium's joint attention 2.5x faster than in f32, about eager's
    speed). Elsewhere the f32 kernel takes it widened."""
    torch.manual_seed(len_q * dim + heads)
    q = torch.randn(batch, heads, len_q, dim, dtype=torch.bfloat16)
    k, v = torch.randn(batch, kv_heads, len_kv, dim, dtype=torch.bfloat16), torch.randn(batch, kv_heads, len_kv, dim, dtype=torch.bfloat16)
    fn = lambda q, k, v: ATTENTION(q, k, v, is_causal=causal)[:2]
    with torch.no_grad():
        got, eager = compile_tpu(fn)(q, k, v), fn(q, k, v)
    check_bf16_attention(got, eager, exact_attention(q, k, v, causal), v)
    on_tiles = tpu_dynamo.device_info()["bf16_products"]
    assert kernel_calls(compiled, [(BF16_ATTENTION_KERNELS if on_tiles else ATTENTION_KERNELS)[causal]]) == 1


@needs_f32_kernels
@pytest.mark.parametrize("mask_shape, causal", [((2, 1, 40, 40), False), ((2, 4, 40, 40), True), ((2, 1, 1, 40), False)], ids=["batch", "per_head", "static_cache"])
def test_masked_bf16_attention_runs_on_the_tiles(mask_shape, causal, compiled):
    """A bf16 mask reaches the tiles' kernel as an f32 bias added to the scaled scores, as
    eager adds it; a query whose keys are all hidden gets 0, output and logsumexp."""
    torch.manual_seed(2)
    len_q = mask_shape[-2]
    q = torch.randn(2, 4, len_q, 32, dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 40, 32, dtype=torch.bfloat16), torch.randn(2, 2, 40, 32, dtype=torch.bfloat16)
    mask = torch.zeros(mask_shape, dtype=torch.bfloat16).masked_fill(torch.rand(mask_shape) < 0.3, float("-inf"))
    if len_q > 1:
        mask[0, ..., 3, :] = float("-inf")
    fn = lambda q, k, v, m: ATTENTION(q, k, v, is_causal=causal, attn_mask=m)[:2]
    full = mask.expand(2, 4, len_q, 40)
    with torch.no_grad():
        got, eager = compile_tpu(fn)(q, k, v, mask), fn(q, k, v, full)
    # f64 with the mask's -inf as hidden keys (the kernel's own rule for a query's visible keys)
    qd, kd, vd = q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    scores = qd @ kd.transpose(-1, -2) / 32**0.5 + full.double()
    if causal:
        scores = scores.masked_fill(torch.ones(len_q, 40, dtype=torch.bool).triu(1), float("-inf"))
    hidden = scores.isneginf().all(-1, keepdim=True)
    probs = scores.softmax(-1).masked_fill(hidden, 0)
    exact = (probs @ vd, scores.logsumexp(-1).masked_fill(hidden[..., 0], 0))
    check_bf16_attention(got, eager, exact, v)
    if len_q > 1:
        assert got[0][0, :, 3].eq(0).all() and got[1][0, :, 3].eq(0).all()
    assert kernel_calls(compiled, [(BF16_ATTENTION_KERNELS if tpu_dynamo.device_info()["bf16_products"] else ATTENTION_KERNELS)[causal]]) == 1


@needs_f32_kernels
def test_bf16_attention_nan_reaches_the_queries_that_see_it():
    """On the tiles too, a NaN key makes the rows that see it NaN and leaves the others as
    eager's."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32, dtype=torch.bfloat16) for _ in range(3))
    k[0, 1, 25, 3] = float("nan")
    fn = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.no_grad():
        got, want = compile_tpu(fn)(q, k, v), fn(q, k, v)
    assert got[0, 1, 25:].isnan().all() and want[0, 1, 25:].isnan().all()
    assert not got[0, 1, :25].isnan().any() and not got[0, 0].isnan().any()
    torch.testing.assert_close(got[0, 1, :25], want[0, 1, :25], rtol=0, atol=2**-6)


# Masks as SDPA callers pass them: a padded batch's `[B, 1, L, S]` (one query of the first entry
# hidden from every key), per head `[B, H, L, S]`, one `[L, S]` for all, a static cache's
# `[B, 1, 1, S]` over a single query; with the causal flag too.
MASKS = [((2, 1, 40, 40), False), ((2, 4, 40, 40), True), ((40, 40), True), ((2, 1, 1, 40), False)]


@needs_f32_kernels
@pytest.mark.parametrize("mask_shape, causal", MASKS, ids=["batch", "per_head", "shared", "static_cache"])
def test_masked_f32_attention_runs_our_kernel(mask_shape, causal, compiled):
    """A float mask reaches the kernel as a bias on the scores: output and logsumexp within 1e-5
    of eager, and a query whose keys are all hidden gets 0 in both, as eager's CPU kernel gives."""
    torch.manual_seed(1)
    len_q = mask_shape[-2]
    q, k, v = torch.randn(2, 4, len_q, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    mask = torch.zeros(mask_shape).masked_fill(torch.rand(mask_shape) < 0.3, float("-inf"))
    if len(mask_shape) == 4 and len_q > 1:
        mask[0, ..., 3, :] = float("-inf")
    fn = lambda q, k, v, m: ATTENTION(q, k, v, is_causal=causal, attn_mask=m)[:2]
    with torch.no_grad():
        (out, lse), (want_out, want_lse) = compile_tpu(fn)(q, k, v, mask), fn(q, k, v, mask.expand(2, 4, len_q, 40))
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5)
    if len(mask_shape) == 4 and len_q > 1:
        assert out[0, :, 3].eq(0).all() and lse[0, :, 3].eq(0).all()
    ((graph_json, _),) = compiled
    stablehlo = _native.compile(graph_json, need_stablehlo=True).stablehlo
    assert ATTENTION_KERNELS[causal] in stablehlo and "dot_general" not in stablehlo


@needs_f32_kernels
def test_keys_padded_to_a_bucket_are_never_read_by_the_kernel():
    """A decode step's keys padded to a bucket (8 here) reach the kernel with their true count,
    past which it reads no key, value or mask: padding turned to -inf keys and inf values (log
    and reciprocal of zeros) changes nothing; a padding mask's batch row 1 hides every true key
    (0 out, as eager)."""

    def f(q, k, v, new, m, hide):
        k, v = torch.cat([k, new], 2).log(), 1 / torch.cat([v, new], 2)
        bias = 1 / m[:, None, None, torch.arange(k.shape[2])] - 1 + hide
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    modules = []
    run = compile_tpu(f, options={"bucket_size": 8, "debug_callback": lambda d: modules.append(d["stablehlo"])})
    hide = torch.tensor([0.0, float("-inf")]).view(2, 1, 1, 1)
    for s in (3, 5, 7):
        q, new = torch.randn(2, 2, 1, 4), torch.rand(2, 2, 1, 4) + 0.5
        k, v = torch.rand(2, 2, s, 4) + 0.5, torch.rand(2, 2, s, 4) + 0.5
        m = torch.rand(2, s + 1) + 0.5
        for t, d in ((k, 2), (v, 2), (m, 1)):
            torch._dynamo.mark_dynamic(t, d)
        with torch.no_grad():
            got, want = run(q, k, v, new, m, hide), f(q, k, v, new, m, hide)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got[1].eq(0).all()
    (stablehlo,) = [m for m in modules if "tensor<2x2x8x4xf32>" in m]  # the bucket's graph
    call = next(line for line in stablehlo.splitlines() if ATTENTION_KERNELS[0] in line)
    assert "tensor<i64>" in call and "dot_general" not in stablehlo


@needs_f32_kernels
@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_padded_decode_step_grows_its_cache_in_the_attention_kernel(kv_heads, dtype):
    """A decode step fed back its own keys and values pads them to a bucket, packed (the true
    tensor the start of the buffer): its attention kernel reads the cache there and the step's
    new row, and writes the grown cache packed, the step's results (one pass over the cache,
    where XLA unpacked it to the bucket, appended and packed it again). Each step's cache as
    eager's exactly, its output within 1e-5 in f32 (bf16: 2e-2, its rounding)."""
    if dtype == torch.bfloat16 and not BF16_PRODUCTS:
        pytest.skip("bf16 attention is ours where AMX or AVX-512 BF16 is")

    def step(q, k, v, new_k, new_v):
        k, v = torch.cat([k, new_k], 2), torch.cat([v, new_v], 2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True), k, v

    modules = []
    run = compile_tpu(step, options={"debug_callback": lambda d: modules.append(d["stablehlo"])})
    torch.manual_seed(kv_heads)
    k = want_k = torch.randn(2, kv_heads, 5, 16, dtype=dtype)
    v = want_v = torch.randn(2, kv_heads, 5, 16, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        for _ in range(12):
            q, new_k, new_v = torch.randn(2, 4, 1, 16, dtype=dtype), torch.randn(2, kv_heads, 1, 16, dtype=dtype), torch.randn(2, kv_heads, 1, 16, dtype=dtype)
            out, k, v = run(q, k, v, new_k, new_v)
            want, want_k, want_v = step(q, want_k, want_v, new_k, new_v)
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
            torch.testing.assert_close(out, want, rtol=tolerance, atol=tolerance)
    assert tpu_dynamo.stats()["packed_in_place"] > 0
    kernel = (ATTENTION_KERNELS if dtype == torch.float32 else BF16_ATTENTION_KERNELS)[0]
    calls = [line for m in modules for line in m.splitlines() if kernel in line]
    # Out, lse and both grown caches; the caches (bucket of 8 or 16) read as operands.
    grown = [call for call in calls if call.split(") -> (")[1].count("tensor<") == 4]
    assert grown and all(call.split(" : (")[1].split(") -> (")[0].count(f"tensor<2x{kv_heads}x") == 4 for call in grown), calls


class Projected(torch.nn.Module):
    """An attention block as transformers writes one: a fused projection split in three
    (GPT-2's `c_attn`, `"fused"`; by slicing, `"sliced"`) or a projection each, grouped key
    heads, the query and key changed by an elementwise op before they are viewed as heads
    (`"separate"`), `view(B, L, H, E).transpose(1, 2)` each, the output transposed back into the
    output projection; it returns the keys and values (a cache's update) too, and with
    `raw_out` the attention's output as it is."""

    def __init__(self, form: str, causal: bool, raw_out: bool = False, heads: int = 4, kv_heads: int = 4, dim: int = 16):
        super().__init__()
        self.form, self.causal, self.raw_out, self.heads, self.kv_heads, self.dim = form, causal, raw_out, heads, kv_heads, dim
        width = heads * dim
        if form == "separate":
            self.q, self.k, self.v = (torch.nn.Linear(width, n * dim) for n in (heads, kv_heads, kv_heads))
        else:
            self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x):
        (batch, length, width), dim = x.shape, self.dim
        if self.form == "fused":
            q, k, v = self.qkv(x).split(width, dim=2)
        elif self.form == "sliced":
            qkv = self.qkv(x)
            q, k, v = qkv[..., :width], qkv[..., width : 2 * width], qkv[..., 2 * width :]
        else:
            q, k, v = self.q(x) * 1.5, self.k(x) - 0.25, self.v(x)
        heads = lambda t: t.view(batch, length, -1, dim).transpose(1, 2)
        q, k, v = heads(q), heads(k), heads(v)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
        projected = self.out(out.transpose(1, 2).reshape(batch, length, width))
        return (projected, k, v, out) if self.raw_out else (projected, k, v)


@needs_f32_kernels
@pytest.mark.parametrize(
    "form, batch, length, causal, kv_heads, raw_out",
    [
        ("fused", 1, 128, True, 4, False), ("fused", 8, 128, True, 4, False), ("sliced", 2, 45, False, 4, False),
        ("separate", 2, 70, True, 2, False), ("separate", 1, 1, True, 2, False), ("fused", 2, 37, True, 4, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_attention_reads_projections_in_place(form, batch, length, causal, kv_heads, raw_out, dtype, compiled):
    """The kernel (f32, or bf16 on the tiles' layouts) reads queries, keys and values where the
    projections leave them (a fused projection's result, with each one's columns) and writes
    the output as `[B, L, H, E]` for the transpose after it, as eager's flash kernel does;
    where something else reads the output too, it writes it `[B, H, L, E]`; the keys and values
    the block returns (a cache's update) it copies out. Everything the block returns within
    1e-5 of eager in f32,
    within bf16's rounding of the products around the attention in bf16."""
    if dtype == torch.bfloat16 and not BF16_PRODUCTS:
        pytest.skip("bf16 attention is ours where AMX or AVX-512 BF16 is")
    torch.manual_seed(batch * length + kv_heads)
    block = Projected(form, causal, raw_out, kv_heads=kv_heads).eval().to(dtype)
    x = torch.randn(batch, length, 64, dtype=dtype)
    with torch.no_grad():
        got, want = compile_tpu(block)(x), block(x)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance)
    ((graph_json, _),) = compiled
    stablehlo = _native.compile(graph_json, need_stablehlo=True).stablehlo
    kernel = (ATTENTION_KERNELS if dtype == torch.float32 else BF16_ATTENTION_KERNELS)[causal]
    call = next(line for line in stablehlo.splitlines() if kernel in line)
    operands, results = call.split(" : (")[1].split(") -> (")
    t = "f32" if dtype == torch.float32 else "bf16"
    fused = f"tensor<{batch}x{length}x192x{t}>"
    separate = [f"tensor<{batch}x{length}x{n}x16x{t}>" for n in (4, kv_heads, kv_heads)]
    assert operands.split(", ")[:3] == (separate if form == "separate" else [fused] * 3), call
    out = f"tensor<{batch}x{length}x4x16x{t}>" if not raw_out else f"tensor<{batch}x4x{length}x16x{t}>"
    assert results.startswith(out) and stablehlo.count(kernel) == 1, call
    # The keys and values the block returns, copied out by the kernel that reads them in place.
    assert results.count(f"tensor<{batch}x{kv_heads}x{length}x16x{t}>") == 2 + raw_out, call


@needs_f32_kernels
def test_very_long_attention_stays_xlas(compiled):
    """Heads of keys larger than the kernel's scratch takes (2^21 elements: here 40000 keys of
    64) keep XLA's way (attention.rs)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 2, 64), torch.randn(1, 1, 40000, 64), torch.randn(1, 1, 40000, 64)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        torch.testing.assert_close(compile_tpu(sdpa)(q, k, v), sdpa(q, k, v), rtol=0, atol=1e-5)
    ((graph_json, _),) = compiled
    stablehlo = _native.compile(graph_json, need_stablehlo=True).stablehlo
    assert "dot_general" in stablehlo and not any(target in stablehlo for target in ATTENTION_KERNELS)


@needs_f32_kernels
def test_f32_attention_nan_reaches_the_queries_that_see_it():
    """A NaN key makes the rows that see it NaN and leaves the others as eager leaves them: with
    the causal mask, the queries before it."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    k[0, 1, 25, 3] = float("nan")
    fn = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.no_grad():
        got, want = compile_tpu(fn)(q, k, v), fn(q, k, v)
    assert got[0, 1, 25:].isnan().all() and want[0, 1, 25:].isnan().all()
    torch.testing.assert_close(got[0, 1, :25], want[0, 1, :25], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[0, 0], want[0, 0], rtol=0, atol=1e-5)


@needs_f32_kernels
@pytest.mark.parametrize("shape, normalized", [((1, 128, 64), 1), ((8, 128, 64), 1), ((2, 264, 32), 1), ((3, 5, 7), 2), ((4, 1), 1)])
@pytest.mark.parametrize("affine", [True, False])
def test_f32_layer_norm_runs_our_kernel(shape, normalized, affine, compiled):
    """Output, mean and rstd as close to the f64 values as eager's are (within twice its error;
    the rows have a large common offset, as a residual stream has, which f32's rounding of
    `x - mean` dominates), normalized over the last dims, with and without weight and bias."""
    torch.manual_seed(sum(shape))
    x = 50.0 + torch.randn(shape)
    dims = list(shape[-normalized:])
    weight, bias = (torch.randn(dims), torch.randn(dims)) if affine else (None, None)
    fn = lambda x, *params: torch.ops.aten.native_layer_norm(x, dims, *params, 1e-5)
    with torch.no_grad():
        got, want = compile_tpu(fn)(x, weight, bias), fn(x, weight, bias)
        exact = fn(x.double(), *(None if p is None else p.double() for p in (weight, bias)))
    for g, w, e in zip(got, want, exact):
        assert g.shape == w.shape and g.dtype == torch.float32
        assert (g.double() - e).abs().max() <= 2 * (w.double() - e).abs().max() + 1e-6
    ((graph_json, _),) = compiled
    assert LAYER_NORM_KERNEL in _native.compile(graph_json, need_stablehlo=True).stablehlo


@needs_f32_kernels
@pytest.mark.parametrize("shape", [(2, 589, 1536), (3, 7, 33), (4, 1)], ids=["sd35", "odd", "one"])
def test_bf16_layer_norm_runs_our_kernel(shape, compiled):
    """bf16 rows computed in f32 and rounded once, as eager's (XLA's way took 3.4x eager's time
    at SD3.5 Medium's width): within half a bf16 step (and f32's rounding) of the f64 value of
    the same bf16 inputs, equal to eager's but for rare ties; mean and rstd in f32 as eager's."""
    torch.manual_seed(sum(shape))
    x = (5.0 + 3 * torch.randn(shape)).bfloat16()
    weight, bias = torch.randn(shape[-1]).bfloat16(), torch.randn(shape[-1]).bfloat16()
    fn = lambda x, w, b: torch.ops.aten.native_layer_norm(x, [shape[-1]], w, b, 1e-6)
    with torch.no_grad():
        (got, mean, rstd), (want, want_mean, want_rstd) = compile_tpu(fn)(x, weight, bias), fn(x, weight, bias)
        exact, _, _ = fn(x.double(), weight.double(), bias.double())
    assert got.dtype == torch.bfloat16 and mean.dtype == want_mean.dtype
    assert ((got.double() - exact).abs() <= exact.abs() / 256 + 1e-3).all()
    assert (got != want).float().mean() <= 1e-3
    torch.testing.assert_close(mean.float(), want_mean.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd.float(), want_rstd.float(), rtol=1e-4, atol=1e-5)
    ((graph_json, _),) = compiled
    assert (BF16_LAYER_NORM_KERNEL in _native.compile(graph_json, need_stablehlo=True).stablehlo) == AVX512_BW


def modulated_calls(text: str, target: str) -> int:
    """Calls of the LayerNorm kernel `target` in `text` with a factor and shift (six operands)."""
    import re

    return len(re.findall(r'custom_call"\((?:%[\w#]+, ){5}%[\w#]+\)[^\n]*"' + re.escape(target) + '"', text))


@needs_f32_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 128, 256), (1, 300, 264), (2, 8, 32)], ids=["sd35-like", "one-batch", "small"])
def test_a_modulated_layer_norm_is_one_kernel_call(shape, dtype):
    """diffusers' `AdaLayerNormZero` (`norm(x) * (1 + scale[:, None]) + shift[:, None]`) over
    2^16 values or more is one call of our LayerNorm kernel with the factor and shift: f32 to
    f32's rounding of eager's, bf16 equal to eager's but for rare ties (each step rounded as
    eager's ops round); a small one stays the norm and XLA's loop (XLA's loops for the factor
    and shift would cost a small call more than the modulation's)."""
    from diffusers.models.normalization import AdaLayerNormZero

    torch.manual_seed(sum(shape))
    norm = AdaLayerNormZero(shape[-1]).to(dtype)
    x, emb = (2.0 + torch.randn(shape)).to(dtype), torch.randn(shape[0], shape[-1]).to(dtype)
    fn = lambda x, emb: norm(x, emb=emb)[0]
    got, want, texts = run_and_texts(fn, x, emb)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        # A norm a step off eager's at a tie moves the sum after it by that step, which the
        # shift's cancellation may make several of the sum's.
        assert (got.double() - want.double()).abs().max() <= 2**-7 * want.double().abs().max()
        assert (got != want).float().mean() <= 2e-3
    target = LAYER_NORM_KERNEL if dtype == torch.float32 else BF16_LAYER_NORM_KERNEL
    large = x.numel() >= 2**16 and (dtype == torch.float32 or AVX512_BW)
    assert sum(modulated_calls(t, target) for t in texts) == int(large)


@needs_f32_kernels
def test_a_row_with_nan_or_infinity_normalizes_to_nan_as_in_eager():
    x = torch.randn(6, 40)
    x[1, 3], x[4, 0] = float("nan"), float("inf")
    norm = torch.nn.LayerNorm(40)
    with torch.no_grad():
        got, want = compile_tpu(norm)(x), norm(x)
    assert got[[1, 4]].isnan().all() and want[[1, 4]].isnan().all()
    torch.testing.assert_close(got[[0, 2, 3, 5]], want[[0, 2, 3, 5]], rtol=1e-5, atol=1e-5)


def rms_norm(form: str, width: int) -> torch.nn.Module:
    """An RMSNorm as transformers' Llama writes it (the weight first), as diffusers' does (the
    weight last; without one), and torch's own (`F.rms_norm`, which reaches the backend as the
    same ops)."""
    from diffusers.models.normalization import RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = {
        "llama": lambda: LlamaRMSNorm(width, eps=1e-6),
        "diffusers": lambda: RMSNorm(width, eps=1e-6),
        "unweighted": lambda: RMSNorm(width, eps=1e-6, elementwise_affine=False),
        "torch": lambda: torch.nn.RMSNorm(width, eps=1e-5),
    }[form]()
    for p in norm.parameters():
        torch.nn.init.normal_(p, 1.0, 0.5)
    return norm


@needs_f32_kernels
@pytest.mark.parametrize("shape", [(1, 128, 64), (8, 128, 64), (2, 5, 33), (3, 576), (4, 1)])
@pytest.mark.parametrize("form", ["llama", "diffusers", "unweighted", "torch"])
def test_an_rms_norm_a_product_reads_runs_our_kernel(shape, form, compiled):
    """Each form of RMSNorm before a linear layer (a decoder layer's projections) is our kernel,
    as close to the f64 result as eager is (within twice its error, plus 1e-6)."""
    torch.manual_seed(sum(shape))
    norm, linear = rms_norm(form, shape[-1]), torch.nn.Linear(shape[-1], 48)
    fn = lambda x: linear(norm(x))
    x = 3.0 * torch.randn(shape)
    with torch.no_grad():
        got, want = compile_tpu(fn)(x), fn(x)
        norm.double(), linear.double()
        exact = fn(x.double())
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + 1e-6
    assert kernel_calls(compiled, [RMS_NORM_KERNEL]) == 1


@needs_f32_kernels
@pytest.mark.parametrize("shape", [(1, 1024, 576), (2, 5, 33), (4, 1)])
@pytest.mark.parametrize("form", ["llama", "diffusers", "unweighted", "torch"])
def test_a_bf16_rms_norm_a_product_reads_runs_our_kernel(shape, form, compiled):
    """In bf16, transformers' and diffusers' RMSNorm (rows converted to f32, the scaled rows
    rounded back to bf16 before the weight, and after it) is our kernel where AVX-512 BW is,
    rounded where eager rounds: the product after it equal to eager's but for rare rounding
    ties (which a product's cancellation may make many of its steps). `torch.nn.RMSNorm`
    (rounded once, after the weight) stays XLA's."""
    torch.manual_seed(sum(shape))
    norm, linear = rms_norm(form, shape[-1]).to(torch.bfloat16), torch.nn.Linear(shape[-1], 48).to(torch.bfloat16)
    fn = lambda x: linear(norm(x))
    x = (3.0 * torch.randn(shape)).to(torch.bfloat16)
    with torch.no_grad():
        got, want = compile_tpu(fn)(x), fn(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got.double() - want.double()).abs().max() <= 2**-7 * want.double().abs().max()
    assert (got != want).sum() <= max(2, got.numel() // 200)
    assert kernel_calls(compiled, [BF16_RMS_NORM_KERNEL]) == int(AVX512_BW and form != "torch")


@needs_f32_kernels
def test_an_rms_norm_read_by_elementwise_work_stays_xla_s():
    """Diffusers' query norm before the rotary embedding: XLA fuses it into that work, which our
    kernel would cut in two. So would a norm over another dim, or one returned as it is."""
    norm = rms_norm("diffusers", 16)
    rotated = lambda x, cos: norm(x) * cos
    over_rows = lambda x, cos: x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6) @ cos.T
    x, cos = torch.randn(2, 64, 4, 16), torch.randn(2, 64, 4, 16)
    for fn, args in ((rotated, (x, cos)), (over_rows, (x[0, :, 0], cos[0, :, 0])), (norm, (x,))):
        got, want, texts = run_and_texts(fn, *args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert all(RMS_NORM_KERNEL not in t for t in texts)


@needs_f32_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads_first", [False, True], ids=["rows", "transposed"])
def test_a_large_rms_norm_read_by_elementwise_work_runs_our_kernel(dtype, heads_first):
    """SD3.5's query norm (`[2, 24, 256, 64]`, diffusers' form) read by elementwise work: from
    2^16 values on it is our kernel (XLA's fusions of it were slower), as eager's to f32's or
    bf16's rounding. Of a product's rows with heads moved before tokens (`transpose(1, 2)`, as
    diffusers' attention does), the kernel normalizes the rows as they are and the result is
    transposed after."""
    if dtype == torch.bfloat16 and not AVX512_BW:
        pytest.skip("the bf16 kernel needs AVX-512; XLA's own bf16 norm misses this test's bound (an AMD Zen 3)")
    torch.manual_seed(3)
    norm = rms_norm("diffusers", 64).to(dtype)
    rotated = lambda x, cos: norm(x.transpose(1, 2) if heads_first else x) * cos
    x = torch.randn(2, 256, 24, 64, dtype=dtype) if heads_first else torch.randn(2, 24, 256, 64, dtype=dtype)
    cos = torch.randn(2, 24, 256, 64, dtype=dtype)
    got, want, texts = run_and_texts(rotated, x, cos)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    kernel = RMS_NORM_KERNEL if dtype == torch.float32 else BF16_RMS_NORM_KERNEL
    assert any(kernel in t for t in texts) == (dtype == torch.float32 or AVX512_BW)


@needs_f32_kernels
def test_an_rms_norm_row_with_nan_or_infinity_is_nan_as_in_eager(compiled):
    """A row with a NaN or an infinity is NaN after the product, the others as eager's (the
    kernel's own values there, NaN for ∞ · 0 and 0 for the rest of the row, are checked by its
    Rust test)."""
    norm, linear = rms_norm("llama", 40), torch.nn.Linear(40, 40)
    fn = lambda x: linear(norm(x))
    x = torch.randn(6, 40)
    x[1, 3], x[4, 0] = float("nan"), float("inf")
    with torch.no_grad():
        got, want = compile_tpu(fn)(x), fn(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert kernel_calls(compiled, [RMS_NORM_KERNEL]) == 1


class Rotated(torch.nn.Module):
    """Queries and keys rotated by transformers' own `apply_rotary_pos_emb`: read from
    projections' rows (`view(B, L, H, D).transpose(1, 2)`, as its attention layers do) or given
    heads first."""

    def __init__(self, heads: int, kv_heads: int, dim: int, from_rows: bool):
        super().__init__()
        self.heads, self.kv_heads, self.dim, self.from_rows = heads, kv_heads, dim, from_rows

    def forward(self, q, k, cos, sin):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        if self.from_rows:
            (b, length, _) = q.shape
            q = q.view(b, length, self.heads, self.dim).transpose(1, 2)
            k = k.view(b, length, self.kv_heads, self.dim).transpose(1, 2)
        return apply_rotary_pos_emb(q, k, cos, sin)


def rotated_inputs(batch, length, heads, kv_heads, dim, from_rows, per_batch):
    """Queries and keys of `Rotated` (times 4: values past the tables' range of ±1), and the
    tables of transformers' `LlamaRotaryEmbedding` for positions shared by the batch or each its
    own (a left-padded batch's), computed by eager: the graph's own tables are XLA's `cos` and
    `sin`, a few ulps off torch's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    shape = (lambda h: (batch, length, h * dim)) if from_rows else (lambda h: (batch, h, length, dim))
    q, k = 4 * torch.randn(shape(heads)), 4 * torch.randn(shape(kv_heads))
    positions = torch.arange(length).expand(batch, length)
    if per_batch:
        positions = positions + torch.arange(batch)[:, None] * 7
    config = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim)
    with torch.no_grad():
        cos, sin = LlamaRotaryEmbedding(config)(q, positions if per_batch else positions[:1])
    return q, k, cos, sin


@needs_f32_kernels
@pytest.mark.parametrize(
    "batch, length, heads, kv_heads, dim",
    [(8, 128, 4, 2, 16), (1, 128, 9, 3, 64), (2, 64, 2, 1, 80), (2, 300, 4, 4, 6)],
    ids=["tiny-llama-b8", "smollm", "half-off-vectors", "no-vector"],
)
@pytest.mark.parametrize("from_rows", [True, False], ids=["rows", "heads-first"])
@pytest.mark.parametrize("per_batch", [False, True], ids=["shared", "per-batch"])
def test_rotary_embeddings_run_our_kernel_as_eager_s_to_the_bit(batch, length, heads, kv_heads, dim, from_rows, per_batch, compiled):
    """transformers' rotary embedding of queries and keys is one call of our kernel each, read
    from the projections' rows where the graph transposes them, and equal to eager's: the kernel
    multiplies and adds as eager does, without fused multiply-adds."""
    torch.manual_seed(dim + length)
    module = Rotated(heads, kv_heads, dim, from_rows)
    args = rotated_inputs(batch, length, heads, kv_heads, dim, from_rows, per_batch)
    with torch.no_grad():
        got, want = compile_tpu(module)(*args), module(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == torch.float32
        assert torch.equal(g, w)
    assert kernel_calls(compiled, [ROTARY_KERNEL]) == 2


@needs_f32_kernels
def test_a_rotation_s_nan_and_infinity_go_as_eager_s(compiled):
    """A NaN or an infinity in a query reaches the values eager's reach (its row's pair partner
    through `rotate_half`, NaN where an infinity meets a zero of the tables)."""
    module = Rotated(4, 2, 16, True)
    q, k, cos, sin = rotated_inputs(8, 128, 4, 2, 16, True, False)
    q[0, 0, 3], q[1, 5, 20], q[2, 7, 9] = float("nan"), float("inf"), -float("inf")
    with torch.no_grad():
        got, want = compile_tpu(module)(q, k, cos, sin), module(q, k, cos, sin)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    assert kernel_calls(compiled, [ROTARY_KERNEL]) == 2


@needs_f32_kernels
def test_a_decode_step_s_or_a_bf16_rotation_stays_xla_s():
    """A decode step's rotation (a row a head) stays in XLA's fusion with its neighbours, and a
    bf16 one is XLA's (as eager's to bf16's rounding)."""
    for dtype, length in ((torch.float32, 1), (torch.bfloat16, 128)):
        torch.manual_seed(length)
        module = Rotated(4, 2, 16, True)
        q, k, cos, sin = (t.to(dtype) for t in rotated_inputs(1, length, 4, 2, 16, True, False))
        got, want, texts = run_and_texts(module, q, k, cos, sin)
        tolerance = 1e-6 if dtype == torch.float32 else 2**-6
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance)
        assert all(ROTARY_KERNEL not in t for t in texts)
