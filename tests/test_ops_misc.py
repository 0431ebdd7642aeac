"""FFTs, complex constants and miscellaneous ops through backend="tpu" vs eager, on random
inputs kept away from zero. FFT tolerances are relative to the largest output magnitude (the
sums grow with the signal size)."""
import pytest
import torch
from torch.utils._pytree import tree_leaves

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


def test_fft_over_more_than_three_dims():
    torch.manual_seed(0)
    x = rand(2, 3, 4, 5, 3)
    check(lambda x: fft.fftn(x, dim=(0, 1, 2, 4)), x)
    check(lambda x: fft.rfftn(x), x)
    check(lambda x: fft.irfftn(x, dim=(1, 2, 3, 4)), rand(2, 3, 4, 5, 3, complex=True))


def test_complex_constants_and_conj():
    torch.manual_seed(0)
    z = rand(3, 4, complex=True)
    check(lambda z: torch.nn.functional.pad(z, (1, 2)) * 2, z)
    check(lambda z: z.conj() * z + 1.5, z)


def test_searchsorted_and_bucketize():
    torch.manual_seed(0)
    seq, rows = torch.sort(rand(7)).values, torch.sort(rand(3, 7), dim=-1).values
    x = torch.cat([rand(3, 5), seq[:5].reshape(1, 5)])[:3]  # some values equal a boundary
    check(lambda s, x: torch.searchsorted(s, x), seq, x)
    check(lambda s, x: torch.searchsorted(s, x, right=True, out_int32=True), seq, x)
    check(lambda s, x: torch.searchsorted(s, x, side="right"), rows, x)
    row_perm = torch.stack([torch.randperm(7) for _ in range(3)])
    check(lambda s, p, x: torch.searchsorted(s, x, sorter=p), torch.gather(rows, 1, torch.argsort(row_perm, 1)), row_perm, x)
    perm = torch.randperm(7)
    check(lambda s, p, x: torch.searchsorted(s, x, sorter=p), seq[torch.argsort(perm)], perm, x)
    check(lambda s: torch.searchsorted(s, 0.25), seq)
    check(lambda s, x: torch.bucketize(x, s, right=True), seq, x)
    check(lambda s, x: torch.isin(x, s), seq, x)


def test_take_put_masked_scatter():
    torch.manual_seed(0)
    x, idx = rand(3, 4), torch.tensor([[0, -1], [5, 11]])
    check(lambda x, i: torch.take(x, i), x, idx)
    check(lambda x: torch.take(x, torch.tensor(3)), x)
    check(lambda x, i: x.put(i, torch.full((2, 2), 2.5), accumulate=True), x, torch.tensor([[1, 1], [-2, 4]]))
    check(lambda x, i: x.put(i, torch.full((2, 2), 2.5)), x, idx)
    check(lambda x, s: x.masked_scatter(x > 0, s), x, rand(4, 4))
    check(lambda x, s: x.masked_scatter(torch.tensor([True, False, True, True]), s), x, rand(13))
    check(lambda x: torch.index_select(x.sum(), 0, torch.tensor([0])), x)


def test_mode_and_logcumsumexp():
    torch.manual_seed(0)
    x = rand(4, 6)
    check(lambda x: torch.mode(x, 1), x)
    check(lambda x: torch.mode(x, 0, keepdim=True), torch.randint(0, 3, (6, 5)).float())
    check(lambda x: torch.logcumsumexp(x, 1), x * 40)
    check(lambda x: torch.logcumsumexp(x, 0), torch.tensor([[-float("inf"), 1.0], [-float("inf"), float("inf")], [2.0, 3.0]]))


def test_bilinear_index_put_mask_as_strided_scatter():
    torch.manual_seed(0)
    w, bias = rand(5, 3, 4), rand(5)
    check(lambda a, c: torch.nn.functional.bilinear(a, c, w, bias), rand(2, 3, 3), rand(2, 3, 4))
    x, mask = rand(5, 4), torch.tensor([True, False, True, True, False])
    check(lambda x, v: x.index_put((mask,), v), x, rand(4))
    check(lambda x, v: x.index_put((mask,), v, accumulate=True), x, rand(3, 4))
    check(lambda x: x.index_put((x > 0,), torch.tensor(2.5)), x)
    check(lambda x, s: torch.as_strided_scatter(x, s, (2, 2), (1, 3), 1), x, rand(2, 2))


def test_histogram():
    torch.manual_seed(0)
    x = rand(40)
    check(lambda x: torch.histogram(x, 7), x)
    check(lambda x: torch.histogram(x, 5, range=(-1.0, 1.0), weight=x.abs(), density=True), x)
    check(lambda x, e: torch.histogram(x, e), x, torch.tensor([-1.2, -0.3, 0.0, 0.4, 1.5]))
    check(lambda x: torch.histogram(x, 3), torch.full((4,), 2.0))
    check(lambda x: torch.histogramdd(x, [3, 4]), rand(30, 2))
    check(lambda x: torch.histogramdd(x, [2, 2, 3], range=[-1.0, 1.0, 0.0, 1.5, -1.5, 0.0], density=True), rand(30, 3))
    edges = [torch.tensor([-1.0, 0.0, 1.5]), torch.tensor([-2.0, -0.5, 0.0, 0.3, 2.0])]
    check(lambda x: torch.histogramdd(x, edges, weight=x[:, 0].abs(), density=True), rand(30, 2))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_bag(mode, padding_idx):
    torch.manual_seed(0)
    w, idx = rand(6, 3), torch.tensor([1, 2, 2, 4, 5, 0, 3])
    bag = torch.nn.functional.embedding_bag
    check(lambda w: bag(idx, w, torch.tensor([0, 3, 3, 5]), mode=mode, padding_idx=padding_idx), w)
    check(lambda w: bag(idx, w, torch.tensor([0, 3, 3, 7]), mode=mode, padding_idx=padding_idx,
                        include_last_offset=True), w)
    check(lambda w: bag(idx[:6].reshape(2, 3), w, mode=mode, padding_idx=padding_idx), w)
    if mode == "sum":
        check(lambda w, p: bag(idx, w, torch.tensor([0, 4]), mode="sum", per_sample_weights=p, padding_idx=padding_idx), w, rand(7))


def test_embedding_bag_aux_outputs():
    torch.manual_seed(0)
    w, idx, off = rand(6, 3), torch.tensor([1, 2, 2, 4, 5, 0, 3]), torch.tensor([0, 3, 3, 5])
    f = torch.ops.aten._embedding_bag_forward_only
    for mode in (1, 2):
        check(lambda w: f(w, idx, off, False, mode, False, None, False, 2), w)


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


def test_squeeze_empty_dims_keeps_shape():
    check(lambda x: x.squeeze(()) * 2, rand(1, 3, 1))


def test_complex_magnitude_angle_polar():
    torch.manual_seed(0)
    x = rand(4, 16)
    check(lambda x: torch.fft.rfft(x).abs(), x)
    check(lambda x: torch.fft.rfft(x).angle(), x)
    check(lambda x: torch.stft(x.flatten(), 8, window=torch.hann_window(8), return_complex=True).abs() ** 2, x)
    check(lambda r, t: torch.polar(r, t), rand(3, 4).abs(), rand(3, 4))
