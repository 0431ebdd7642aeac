//! Convolution (`aten.convolution`, NCHW / OIHW, any number of spatial dims), lowered one of six
//! ways: a wide 3×3 one in f32 by Winograd's minimal filtering (`winograd`); a 3×3 one in bf16
//! (stride 1, padding 1) by our host kernel (`host_bf16_conv3x3`; where its windows are small, only
//! on images of 256 positions or more); where the input's windows are no larger than the padded
//! input or the weight, as one matrix product of the weight and the windows (`windows_product`);
//! another wide one in bf16 as its windows times its weight on our product kernel's tiles
//! (`bf16_windows_on_tiles`); a narrower 3×3 one in f32 (stride 1, padding 1) by our host kernel
//! (`host_conv3x3`); otherwise as StableHLO's convolution.

use super::builder::{i64_array, lowering_target, opmath, padding_attr, Builder, Scalar, Val, R};
use super::{NodeCtx, Registry, Res};
use crate::ir::{DType, TensorType};

pub fn register(r: &mut Registry) {
    r.add(&["aten.convolution.default"], convolution);
}

/// An int-list argument with one entry per spatial dim (a single value applies to all).
fn per_dim(n: &NodeCtx<'_>, pos: usize, name: &str, dims: usize, default: i64) -> R<Vec<i64>> {
    let v = n.ints(pos, name)?;
    Ok(match v.len() {
        0 => vec![default; dims],
        1 => vec![v[0]; dims],
        _ => v,
    })
}

/// `convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
/// groups)` for any number of spatial dims, NCHW / OIHW layout.
fn convolution(n: NodeCtx<'_>) -> Res<'_> {
    let (x, w) = (n.tensor(0, "input")?, n.tensor(1, "weight")?);
    let spatial = x
        .rank()
        .checked_sub(2)
        .ok_or("convolution input needs a batch and a channel dim")?;
    let stride = per_dim(&n, 3, "stride", spatial, 1)?;
    let padding = per_dim(&n, 4, "padding", spatial, 0)?;
    let dilation = per_dim(&n, 5, "dilation", spatial, 1)?;
    let transposed = n.bool_or(6, "transposed", false)?;
    let out_pad = per_dim(&n, 7, "output_padding", spatial, 0)?;
    let groups = n.int_or(8, "groups", 1)?;
    let out = n.out_dtype()?;
    let b = &n.b;
    let (w, lhs_dilation, pads) = if transposed {
        // A transposed convolution is a convolution of the stride-dilated input with the
        // spatially flipped kernel whose in/out channels are swapped within each group.
        let ks = &w.shape()[2..];
        let (cin, cout_g) = (w.shape()[0], w.shape()[1]);
        let mut grouped = vec![groups, cin / groups, cout_g];
        grouped.extend_from_slice(ks);
        let mut perm = vec![0, 2, 1];
        perm.extend(3..3 + spatial);
        let swapped = b.transpose(&b.reshape(&w, &grouped)?, &perm)?;
        let mut oihw = vec![groups * cout_g, cin / groups];
        oihw.extend_from_slice(ks);
        let flipped = b.reverse(
            &b.reshape(&swapped, &oihw)?,
            &(2..2 + spatial).collect::<Vec<_>>(),
        )?;
        let pads = (0..spatial)
            .map(|i| {
                let edge = dilation[i] * (ks[i] - 1) - padding[i];
                (edge, edge + out_pad[i])
            })
            .collect();
        (flipped, stride.clone(), pads)
    } else {
        (
            w,
            vec![1; spatial],
            padding.iter().map(|&p| (p, p)).collect::<Vec<_>>(),
        )
    };
    let window_strides = if transposed { vec![1; spatial] } else { stride };
    let mut shape = vec![x.shape()[0], w.shape()[0]];
    for i in 0..spatial {
        let input = (x.shape()[2 + i] - 1) * lhs_dilation[i] + 1 + pads[i].0 + pads[i].1;
        let window = dilation[i] * (w.shape()[2 + i] - 1) + 1;
        shape.push((input - window).div_euclid(window_strides[i]) + 1);
    }
    if !transposed && groups == 1 {
        let out_spatial = &shape[2..];
        let small = windows_are_small(&x, &w, &shape, &window_strides, &dilation, &pads);
        let y = if winograd_pays(&x, &w, &shape, (&window_strides, &pads, &dilation), out) {
            Some(winograd(b, &x, &w, &pads, out_spatial)?)
        } else if let Some(y) = host_bf16_conv3x3(&n, &x, &w, (&window_strides, &pads, &dilation), out, small)? {
            return Ok(vec![y]);
        } else if small {
            Some(windows_product(
                b,
                &x,
                &w,
                &window_strides,
                &pads,
                &dilation,
                out_spatial,
                opmath(out),
            )?)
        } else if let Some(y) = bf16_windows_on_tiles(&n, &x, &w, (&window_strides, &pads, &dilation), &shape, out)? {
            return Ok(vec![y]);
        } else {
            host_conv3x3(b, &x, &w, &shape, (&window_strides, &pads, &dilation), out)?
        };
        if let Some(y) = y {
            return finish(&n, y, out);
        }
    }
    let dims: Vec<String> = (0..spatial).map(|i| i.to_string()).collect();
    let dims = dims.join(", ");
    let attrs = [
        (
            "dimension_numbers",
            format!("#stablehlo.conv<[b, f, {dims}]x[o, i, {dims}]->[b, f, {dims}]>"),
        ),
        ("window_strides", i64_array(&window_strides)),
        ("padding", padding_attr(&pads)),
        ("lhs_dilation", i64_array(&lhs_dilation)),
        ("rhs_dilation", i64_array(&dilation)),
        ("feature_group_count", format!("{groups} : i64")),
        ("batch_group_count", "1 : i64".to_string()),
    ];
    let y = b.op(
        "stablehlo.convolution",
        &[&x, &w],
        &attrs,
        TensorType::new(opmath(out), shape),
    )?;
    finish(&n, y, out)
}

/// The convolution `y` (in f32 for half inputs) plus the node's bias, as the output dtype.
fn finish<'a>(n: &NodeCtx<'a>, y: Val<'a>, out: DType) -> Res<'a> {
    let b = &n.b;
    let y = match n.opt_tensor(2, "bias")? {
        Some(bias) => add_channel_bias(b, &y, &bias)?,
        None => y,
    };
    Ok(vec![b.convert(&y, out)?])
}

/// The convolution by our host kernel (`tpu_dynamo_runtime::host_kernels`), where the plugin
/// has it: f32, 2-D, 3×3 windows, stride 1, padding 1, undilated (a small UNet's, a ResNet's
/// first stages', a VAE's or UNet's ends', below Winograd's width). XLA:CPU ran those at a
/// quarter to all of eager's rate; the kernel computes them where the input lies, without the
/// windows written out, 1.15-3× faster (bench/RESULTS.md, "Forty-fourth session").
fn host_conv3x3<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    w: &Val<'a>,
    out_shape: &[i64],
    (stride, pads, dilation): (&[i64], &[(i64, i64)], &[i64]),
    out: DType,
) -> R<Option<Val<'a>>> {
    let Some(target) = lowering_target().host_conv3x3 else { return Ok(None) };
    let fits = same_3x3(x, w, (stride, pads, dilation))
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && out == DType::F32;
    if !fits {
        return Ok(None);
    }
    Ok(Some(b.host_call(target, &[x, w], vec![TensorType::new(DType::F32, out_shape.to_vec())])?.remove(0)))
}

/// Whether a 2-D convolution is our 3×3 kernels': 3×3 windows, stride 1, padding 1, undilated
/// (the output as large as the input).
fn same_3x3(x: &Val<'_>, w: &Val<'_>, (stride, pads, dilation): (&[i64], &[(i64, i64)], &[i64])) -> bool {
    x.rank() == 4 && w.shape()[2..] == [3, 3] && stride == [1, 1] && pads == [(1, 1), (1, 1)] && dilation == [1, 1]
}

/// Whether our bf16 kernels add `bias` to their f32 sums themselves: `[outputs]`, bf16 or f32.
fn bf16_kernel_bias(bias: &Val<'_>, outputs: i64) -> bool {
    bias.shape() == [outputs] && matches!(bias.dtype(), DType::Bf16 | DType::F32)
}

/// Positions of an image from which `host_bf16_conv3x3` takes a 3×3 convolution whose windows
/// are small enough for XLA's product of the weight and the windows (ms, ours against that
/// product's): `[2, 640, 16, 16]` 9.8 / 12.9, `[2, 1280, 16, 16]` 40 / 48, `[2, 1280, 8, 8]` 12.0 /
/// 11.4, `[2, 1280, 4, 4]` 3.5 / 3.2.
const BF16_DIRECT_MIN_PLANE: i64 = 256;

/// A bf16 convolution of 3×3 windows, stride 1, padding 1, undilated, by our kernel on AVX-512
/// BF16, where the plugin has it: the input's channels in pairs (`[N, C/2, H, W, 2]`, an odd
/// count padded by a zero one; the kernel pairs the weight's once per weight version), the bias
/// added to the f32 sums before their one rounding. XLA:CPU convolves bf16 in f32 (ms, ours
/// against XLA's, eager's): a VAE decoder's `[1, 128, 256, 256]` 55 / 100-186 (63), `[1, 256,
/// 128, 128]` 55 / 96 (55), SD1.5's `[2, 320, 64, 64]` 44 / 76 (39-43), `[2, 320, 32, 32]` 9.7 /
/// 21 (8.5-11) and `[2, 640, 32, 32]` 38 / — (34-35). Where the windows are `small` (XLA's
/// product) only from `BF16_DIRECT_MIN_PLANE` positions an image.
fn host_bf16_conv3x3<'a>(
    n: &NodeCtx<'a>,
    x: &Val<'a>,
    w: &Val<'a>,
    (stride, pads, dilation): (&[i64], &[(i64, i64)], &[i64]),
    out: DType,
    small: bool,
) -> R<Option<Val<'a>>> {
    let b = &n.b;
    let Some(target) = lowering_target().host_bf16_conv3x3 else { return Ok(None) };
    let bias = n.opt_tensor(2, "bias")?;
    let out_channels = w.shape()[0];
    let fits = same_3x3(x, w, (stride, pads, dilation))
        && (!small || x.shape()[2] * x.shape()[3] >= BF16_DIRECT_MIN_PLANE)
        && [x.dtype(), w.dtype(), out] == [DType::Bf16; 3]
        && bias.as_ref().is_none_or(|bias| bf16_kernel_bias(bias, out_channels));
    if !fits {
        return Ok(None);
    }
    let (batch, channels, height, width) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let pairs = (channels + 1) / 2;
    let zero = b.scalar(Scalar::Int(0), DType::Bf16)?;
    let even = |v: &Val<'a>| if channels % 2 == 0 { Ok(v.clone()) } else { b.pad(v, &zero, &[0; 4], &[0, 1, 0, 0], &[0; 4]) };
    let x = b.transpose(&b.reshape(&even(x)?, &[batch, pairs, 2, height, width])?, &[0, 1, 3, 4, 2])?;
    let operands: Vec<&Val<'a>> = [&x, w].into_iter().chain(bias.as_ref()).collect();
    let result = TensorType::new(DType::Bf16, vec![batch, out_channels, height, width]);
    Ok(Some(b.host_call(target, &operands, vec![result])?.remove(0)))
}

/// Output positions over all images: `N·P` of the `[N, O, *P]` output shape.
fn output_positions(out_shape: &[i64]) -> i64 {
    out_shape[0] * out_shape[2..].iter().product::<i64>()
}

/// Kernel offsets beyond which overlapping windows are not stacked (each is one slice op).
const MAX_WINDOW_OFFSETS: i64 = 64;

/// Whether to compute the convolution as one product (`windows_product`): when the input's
/// windows (`C·K` rows, one column per output position: `N·P`) hold no more elements than the
/// padded input or the weight. XLA:CPU's convolution transposes the whole weight to HWIO on
/// every call and runs well below its own GEMM: SD1.5's UNet at 1280 channels on 8×8 (windows
/// a tenth of the weight) took 45-60 ms where eager takes 16-25 and the product 11-22; a patch
/// embedding (windows that do not overlap: the input rearranged), SD3's 2×2 at 1024 pixels,
/// 23 ms against the product's 7 (eager 26); a 1×1 convolution, 128 channels at 256×256, 37
/// against 16. Where overlapping windows outgrow both (3×3 at 320 channels on 64×64: 9× the
/// input, 26× the weight) stacking them costs more than it saves, and the convolution stays
/// (asked first, `winograd` takes the wide 3×3 ones in f32).
fn windows_are_small(
    x: &Val<'_>,
    w: &Val<'_>,
    out_shape: &[i64],
    stride: &[i64],
    dilation: &[i64],
    pads: &[(i64, i64)],
) -> bool {
    let positions = output_positions(out_shape);
    let offsets: i64 = w.shape()[2..].iter().product();
    let windows = x.shape()[1] * offsets * positions;
    let padded: i64 = x.shape()[..2].iter().product::<i64>()
        * x.shape()[2..]
            .iter()
            .zip(pads)
            .map(|(&n, p)| n + p.0 + p.1)
            .product::<i64>();
    let fits = windows <= padded.max(w.shape().iter().product());
    windows > 0 && fits && (offsets <= MAX_WINDOW_OFFSETS || tiles(w, stride, dilation))
}

/// Whether the windows tile the input: each as long as its stride, undilated (a patch embedding).
fn tiles(w: &Val<'_>, stride: &[i64], dilation: &[i64]) -> bool {
    w.shape()[2..]
        .iter()
        .zip(stride)
        .zip(dilation)
        .all(|((&k, &s), &d)| k == s && (d == 1 || k == 1))
}

/// The convolution (no groups, not transposed) as `weight[O, C·K] × windows[C·K, N·P]`, where
/// OIHW already lays the weight out as that matrix (no copy of it); the `[O, N, P]` product is
/// then put in NCHW order. Accumulates in `acc`.
#[allow(clippy::too_many_arguments)]
fn windows_product<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    w: &Val<'a>,
    stride: &[i64],
    pads: &[(i64, i64)],
    dilation: &[i64],
    out_spatial: &[i64],
    acc: DType,
) -> R<Val<'a>> {
    let (batch, out_channels) = (x.shape()[0], w.shape()[0]);
    let x = channels_first_padded(b, x, pads)?;
    let windows = if tiles(w, stride, dilation) {
        tiled_windows(b, &x, &w.shape()[2..], out_spatial)?
    } else {
        stacked_windows(b, &x, &w.shape()[2..], stride, dilation, out_spatial)?
    };
    let w = b.reshape(w, &[out_channels, windows.shape()[0]])?;
    let y = b.dot_general(&w, &windows, (&[], &[]), (&[1], &[0]), acc)?;
    let shape: Vec<i64> = [out_channels, batch]
        .into_iter()
        .chain(out_spatial.iter().copied())
        .collect();
    b.transpose(&b.reshape(&y, &shape)?, &swap_leading(out_spatial.len()))
}

/// The permutation swapping the batch and channel dims of a tensor with `spatial` more dims.
fn swap_leading(spatial: usize) -> Vec<usize> {
    [1, 0].into_iter().chain(2..2 + spatial).collect()
}

/// `x` [N, C, *S] as [C, N, *S] (so that channels and positions are a product's rows and
/// columns), zero-padded by `pads` along the spatial dims.
fn channels_first_padded<'a>(b: &Builder<'a>, x: &Val<'a>, pads: &[(i64, i64)]) -> R<Val<'a>> {
    padded(b, &b.transpose(x, &swap_leading(pads.len()))?, pads)
}

/// `x` `[_, _, *S]` zero-padded by `pads` along the spatial dims.
fn padded<'a>(b: &Builder<'a>, x: &Val<'a>, pads: &[(i64, i64)]) -> R<Val<'a>> {
    let zero = b.scalar(Scalar::Int(0), x.dtype())?;
    let low: Vec<i64> = [0, 0].into_iter().chain(pads.iter().map(|p| p.0)).collect();
    let high: Vec<i64> = [0, 0].into_iter().chain(pads.iter().map(|p| p.1)).collect();
    b.pad(x, &zero, &low, &high, &vec![0; pads.len() + 2])
}

/// `[C·K, N·P]` windows of the padded `[C, N, *S]` input `x` that tile it: the input cropped
/// to whole windows, each spatial dim split into (window, offset) and the offsets moved after
/// the channels; one transpose, nothing duplicated.
fn tiled_windows<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    kernel: &[i64],
    out_spatial: &[i64],
) -> R<Val<'a>> {
    let (channels, batch) = (x.shape()[0], x.shape()[1]);
    let mut x = x.clone();
    let mut split = vec![channels, batch];
    for (d, (&k, &n)) in kernel.iter().zip(out_spatial).enumerate() {
        x = b.slice_dim(&x, 2 + d, 0, n * k, 1)?;
        split.extend([n, k]);
    }
    let spatial = kernel.len();
    // [C, N, n1, k1, n2, k2, ...] -> [C, k1, k2, ..., N, n1, n2, ...]
    let perm: Vec<usize> = [0]
        .into_iter()
        .chain((0..spatial).map(|d| 3 + 2 * d))
        .chain([1])
        .chain((0..spatial).map(|d| 2 + 2 * d))
        .collect();
    let windows = b.transpose(&b.reshape(&x, &split)?, &perm)?;
    let rows = channels * kernel.iter().product::<i64>();
    b.reshape(
        &windows,
        &[rows, batch * out_spatial.iter().product::<i64>()],
    )
}

/// `[C·K, N·P]` windows of the padded `[C, N, *S]` input `x`, overlapping or strided: per kernel
/// offset the strided slice it reads, stacked in OIHW's (channel, offset) order.
fn stacked_windows<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    kernel: &[i64],
    stride: &[i64],
    dilation: &[i64],
    out_spatial: &[i64],
) -> R<Val<'a>> {
    let (channels, batch) = (x.shape()[0], x.shape()[1]);
    let positions = batch * out_spatial.iter().product::<i64>();
    let offsets: i64 = kernel.iter().product();
    let one_offset = [channels, 1, positions];
    stacked_offsets(b, x, 2, (kernel, stride, dilation), out_spatial, (&one_offset, 1), [channels * offsets, positions])
}

/// Every kernel offset's slice of the padded `x` (`offset_slice`; its spatial dims from dim
/// `first`), each reshaped to `one_offset` and concatenated along `axis`, read as `matrix`.
fn stacked_offsets<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    first: usize,
    (kernel, stride, dilation): (&[i64], &[i64], &[i64]),
    out_spatial: &[i64],
    (one_offset, axis): (&[i64], usize),
    matrix: [i64; 2],
) -> R<Val<'a>> {
    let offsets: i64 = kernel.iter().product();
    let slices = (0..offsets)
        .map(|k| b.reshape(&offset_slice(b, x, first, k, kernel, stride, dilation, out_spatial)?, one_offset))
        .collect::<R<Vec<_>>>()?;
    b.reshape(&b.concat(&slices.iter().collect::<Vec<_>>(), axis)?, &matrix)
}

/// What kernel offset `k` (row-major over `kernel`) reads of the padded `x`, whose spatial dims
/// start at dim `first`: the strided slice with `out_spatial` there, one value per output
/// position.
#[allow(clippy::too_many_arguments)]
fn offset_slice<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    first: usize,
    k: i64,
    kernel: &[i64],
    stride: &[i64],
    dilation: &[i64],
    out_spatial: &[i64],
) -> R<Val<'a>> {
    let spatial = kernel.len();
    let (mut start, mut limit, mut strides) = (vec![0; x.rank()], x.shape().to_vec(), vec![1; x.rank()]);
    let mut rest = k;
    for d in (0..spatial).rev() {
        let at = first + d;
        start[at] = rest % kernel[d] * dilation[d];
        rest /= kernel[d];
        limit[at] = start[at] + (out_spatial[d] - 1) * stride[d] + 1;
        strides[at] = stride[d];
    }
    b.slice(x, &start, &limit, &strides)
}

/// The bytes of a bf16 convolution's windows that `bf16_windows_on_tiles` writes out at once at
/// most: larger ones are taken in bands of output rows, each band's windows written and then
/// multiplied (a VAE decoder's `[1, 128, 512, 512]` would need 604 MB at once). Measured on 3×3
/// ones (now `host_bf16_conv3x3`'s): SD1.5's `[2, 320, 64, 64]` in bands of 8 MiB 55 ms, of 16
/// 59 (XLA's 76, eager's 40); bands of 2 MiB re-read the weight too often (`[2, 320, 32, 32]`:
/// 23 ms against 13).
const BF16_WINDOWS_BAND_BYTES: i64 = 8 << 20;
/// Output channels from which the windows' product pays for writing the windows out and
/// splitting them into the tiles' layout (3×3 ones, ms, ours against XLA's, eager's): `[1, 128,
/// 64, 64]` → 128 8.1 / 7.6 (4.1), `[1, 256, 128, 128]` → 256 82 / 96 (55), `[2, 320, 32, 32]` →
/// 320 13 / 21 (9).
const BF16_WINDOWS_MIN_OUTPUTS: i64 = 256;

/// A bf16 convolution (no groups, not transposed; a strided, dilated or larger kernel, where
/// `host_bf16_conv3x3` does not take it) as our product kernel's `windows[N·P, T·C] ×
/// weight[O, C, *kernel]` on the tiles (AMX, or AVX-512 BF16's vectors), the weight kept there as
/// it lies (`weights_kept_on_tiles`; the kernel reads its K in the windows' order), the bias
/// added to the f32 sums before their one rounding, as eager's oneDNN does. XLA:CPU computes a
/// bf16 convolution in f32, at its f32 product's rate (SD1.5's `[2, 320, 32, 32]` 3×3: 21 ms,
/// eager 9, this 14). `None` where the product is not one our kernel takes on the tiles.
fn bf16_windows_on_tiles<'a>(
    n: &NodeCtx<'a>,
    x: &Val<'a>,
    w: &Val<'a>,
    (stride, pads, dilation): (&[i64], &[(i64, i64)], &[i64]),
    out_shape: &[i64],
    out: DType,
) -> R<Option<Val<'a>>> {
    let b = &n.b;
    let bias = n.opt_tensor(2, "bias")?;
    let target = lowering_target().host_bf16_conv.map(|(plain, biased)| if bias.is_some() { biased } else { plain });
    let (Some(target), [DType::Bf16, DType::Bf16, DType::Bf16]) = (target, [x.dtype(), w.dtype(), out]) else {
        return Ok(None);
    };
    let (batch, channels, out_channels) = (x.shape()[0], x.shape()[1], w.shape()[0]);
    let (kernel, out_spatial) = (&w.shape()[2..], &out_shape[2..]);
    let contract: Vec<i64> = (1..w.rank() as i64).collect();
    let positions = output_positions(out_shape);
    let wide = out_channels >= BF16_WINDOWS_MIN_OUTPUTS;
    if !(wide && bias.as_ref().is_none_or(|bias| bf16_kernel_bias(bias, out_channels)) && b.bf16_rows_on_tiles(positions, w, &[], &contract)) {
        return Ok(None);
    }
    // Padded, with the channels last: each kernel offset then reads runs of channels.
    let spatial = kernel.len();
    let to_last: Vec<usize> = [0].into_iter().chain(2..2 + spatial).chain([1]).collect();
    let x = b.transpose(&padded(b, x, pads)?, &to_last)?;
    let offsets: i64 = kernel.iter().product();
    let row_bytes = 2 * (positions / out_spatial[0]) * channels * offsets;
    let band = (BF16_WINDOWS_BAND_BYTES / row_bytes).clamp(1, out_spatial[0]);
    let bands = (0..out_spatial[0])
        .step_by(band as usize)
        .map(|first| {
            let rows = band.min(out_spatial[0] - first);
            let reach = (rows - 1) * stride[0] + dilation[0] * (kernel[0] - 1) + 1;
            let x = b.slice_dim(&x, 1, first * stride[0], first * stride[0] + reach, 1)?;
            let band_spatial: Vec<i64> = [rows].into_iter().chain(out_spatial[1..].iter().copied()).collect();
            // [N·P, T·C]: a row per output position, its window's values offset by offset, each
            // offset's channels together.
            let one_offset: Vec<i64> = [batch].into_iter().chain(band_spatial.iter().copied()).chain([1, channels]).collect();
            let matrix = [batch * band_spatial.iter().product::<i64>(), channels * offsets];
            let windows = stacked_offsets(b, &x, 1, (kernel, stride, dilation), &band_spatial, (&one_offset, spatial + 1), matrix)?;
            let operands: Vec<&Val<'a>> = [&windows, w].into_iter().chain(bias.as_ref()).collect();
            let result = TensorType::new(DType::Bf16, vec![windows.shape()[0], out_channels]);
            let y = b.host_call(target, &operands, vec![result])?.remove(0);
            let by_position: Vec<i64> = [batch].into_iter().chain(band_spatial).chain([out_channels]).collect();
            b.reshape(&y, &by_position)
        })
        .collect::<R<Vec<_>>>()?;
    // [N, *P, O] -> [N, O, *P]
    let y = if bands.len() == 1 { bands[0].clone() } else { b.concat(&bands.iter().collect::<Vec<_>>(), 1)? };
    let perm: Vec<usize> = [0, spatial + 1].into_iter().chain(1..=spatial).collect();
    Ok(Some(b.transpose(&y, &perm)?))
}


/// Channels (in and out) and output positions (all images) from which a 3×3 convolution is
/// computed by `winograd`: there its 16 products of `[O, C] × [C, tiles]` do 4/9 of the direct
/// convolution's multiplications, against transforms that read and write 4× the input and the
/// output. At SD1.5's sizes (VAE decoder, UNet), per convolution, XLA's convolution → Winograd
/// (eager): 512 channels on 64×64 121 → 65 ms (126), on 32×32 33 → 18 (24); 640 on 32×32
/// batch 2 51 → 23 (35); 1280 on 16×16 batch 2 91 → 63 (85); 128 on 128×128 30 → 25 (24). With
/// 64 channels the transforms cost more than they save (10 → 11 ms on 128×128), and on 8×8
/// (128 positions at batch 2) the windows' product is faster (21 against 24 ms).
const WINOGRAD_MIN_CHANNELS: i64 = 128;
const WINOGRAD_MIN_POSITIONS: i64 = 512;
/// Output positions up to which our convolution kernel (`host_conv3x3`, where the plugin has it)
/// computes a convolution of `WINOGRAD_MIN_CHANNELS` in place of Winograd's transforms (µs, ours
/// against Winograd's, eager): `[1, 128, 32, 32]` 1545 / 2149 (1469), at batch 2 3161 / 5091
/// (2833); on 64×64 the two are even (6260 / 5347-6894), and from 192 channels Winograd leads
/// (`[1, 192, 32, 32]` 3583 / 3231).
const DIRECT_MAX_POSITIONS: i64 = 2048;

/// Whether `winograd` computes this convolution (no groups, not transposed): 2-D, 3×3, stride 1,
/// undilated, in f32 (in half types the transformed input and weight would be rounded to them
/// before the products, an error the direct convolution does not make), wide enough and with
/// enough positions to pay for the transforms, and not at the narrowest width with few positions
/// where our kernel takes it (`DIRECT_MAX_POSITIONS`).
fn winograd_pays(
    x: &Val<'_>,
    w: &Val<'_>,
    out_shape: &[i64],
    (stride, pads, dilation): (&[i64], &[(i64, i64)], &[i64]),
    out: DType,
) -> bool {
    let positions = output_positions(out_shape);
    let channels = x.shape()[1].min(w.shape()[0]);
    let direct = lowering_target().host_conv3x3.is_some() && pads == [(1, 1), (1, 1)] && channels == WINOGRAD_MIN_CHANNELS && positions <= DIRECT_MAX_POSITIONS;
    !direct
        && x.rank() == 4
        && w.shape()[2..] == [3, 3]
        && stride == [1, 1]
        && dilation == [1, 1]
        && x.dtype() == DType::F32
        && out == DType::F32
        && channels >= WINOGRAD_MIN_CHANNELS
        && positions >= WINOGRAD_MIN_POSITIONS
}

/// `Bᵀ·[d0, d1, d2, d3]` for F(2×2, 3×3)'s input transform `Bᵀ = [[1, 0, -1, 0], [0, 1, 1, 0],
/// [0, -1, 1, 0], [0, 1, 0, -1]]`, applied along one tile axis.
fn input_transform<'a>(b: &Builder<'a>, d: [&Val<'a>; 4]) -> R<[Val<'a>; 4]> {
    Ok([
        b.sub(d[0], d[2])?,
        b.add(d[1], d[2])?,
        b.sub(d[2], d[1])?,
        b.sub(d[1], d[3])?,
    ])
}

/// `Aᵀ·[m0, m1, m2, m3]` for F(2×2, 3×3)'s output transform `Aᵀ = [[1, 1, 1, 0], [0, 1, -1, -1]]`,
/// applied along one tile axis.
fn output_transform<'a>(b: &Builder<'a>, m: [&Val<'a>; 4]) -> R<[Val<'a>; 2]> {
    Ok([
        b.add(&b.add(m[0], m[1])?, m[2])?,
        b.sub(&b.sub(m[1], m[2])?, m[3])?,
    ])
}

/// A 3×3, stride-1 convolution of `x` [N, C, H, W] by `w` [O, C, 3, 3] as Winograd's F(2×2, 3×3)
/// (Lavin & Gray, 2015): the output in 2×2 tiles, each from the 4×4 input tile `d` under it as
/// `Aᵀ[(G g Gᵀ) ⊙ (Bᵀ d B)]A`, the sum over channels of the elementwise products being, per
/// position in the 4×4 tile, one product `U[O, C] × V[C, N·tiles]`. An odd output size is
/// computed one larger (the input padded by one more) and cropped.
fn winograd<'a>(
    b: &Builder<'a>,
    x: &Val<'a>,
    w: &Val<'a>,
    pads: &[(i64, i64)],
    out_spatial: &[i64],
) -> R<Val<'a>> {
    let (batch, channels, out_channels) = (x.shape()[0], x.shape()[1], w.shape()[0]);
    let (rows, cols) = ((out_spatial[0] + 1) / 2, (out_spatial[1] + 1) / 2);
    let tiles = batch * rows * cols;
    // [C, N, H, W], padded to whole tiles.
    let whole_tiles = [
        (pads[0].0, pads[0].1 + 2 * rows - out_spatial[0]),
        (pads[1].0, pads[1].1 + 2 * cols - out_spatial[1]),
    ];
    let x = channels_first_padded(b, x, &whole_tiles)?;
    // d[i][j]: the element at (i, j) of every input tile, [C, N, rows, cols].
    let d = (0..4)
        .map(|i| {
            (0..4)
                .map(|j| {
                    b.slice(
                        &x,
                        &[0, 0, i, j],
                        &[channels, batch, i + 2 * rows - 1, j + 2 * cols - 1],
                        &[1, 1, 2, 2],
                    )
                })
                .collect::<R<Vec<_>>>()
        })
        .collect::<R<Vec<_>>>()?;
    // t[j][k] = (Bᵀ d)[k][j]; V[4k + l] = (Bᵀ d B)[k][l].
    let t = (0..4)
        .map(|j| input_transform(b, [&d[0][j], &d[1][j], &d[2][j], &d[3][j]]))
        .collect::<R<Vec<_>>>()?;
    // U[4k + l] = (G g Gᵀ)[k][l] for every (o, c), as one product with kron(G, G) [16, 9].
    const G: [[f32; 3]; 4] = [
        [1.0, 0.0, 0.0],
        [0.5, 0.5, 0.5],
        [0.5, -0.5, 0.5],
        [0.0, 0.0, 1.0],
    ];
    let kron: Vec<f32> = (0..16)
        .flat_map(|kl| (0..9).map(move |ij| G[kl / 4][ij / 3] * G[kl % 4][ij % 3]))
        .collect();
    let kron = b.constant_f32(&kron, &[16, 9])?;
    let g = b.reshape(w, &[out_channels * channels, 9])?;
    let u = b.dot_general(&kron, &g, (&[], &[]), (&[1], &[1]), DType::F32)?;
    // M[4k + l] = U[4k + l] × V[4k + l], each [O, N, rows, cols]: one product per position in
    // the tile rather than one batched product, whose stacked operand XLA would copy. XLA's
    // products, not our host kernel: faster alone, it made these 16 slower (bare executes of
    // `[1, 128, 64, 64]` 5.8 against 5.2 ms, `[2, 256, 32, 32]` 9.9-10.2 against 9.0-9.1).
    let m = (0..4)
        .map(|k| input_transform(b, [&t[0][k], &t[1][k], &t[2][k], &t[3][k]]))
        .collect::<R<Vec<_>>>()?
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(kl, v)| {
            let kl = kl as i64;
            let u = b.slice_dim(&u, 0, kl, kl + 1, 1)?;
            let u = b.reshape(&u, &[out_channels, channels])?;
            let v = b.reshape(&v, &[channels, tiles])?;
            let product = b.xla_dot_general(&u, &v, (&[], &[]), (&[1], &[0]), DType::F32)?;
            b.reshape(&product, &[out_channels, batch, rows, cols])
        })
        .collect::<R<Vec<_>>>()?;
    // s[l][a] = (Aᵀ M)[a][l]; y[2a + c] = (Aᵀ M A)[a][c], each [O, N, rows, cols].
    let s = (0..4)
        .map(|l| output_transform(b, [&m[l], &m[4 + l], &m[8 + l], &m[12 + l]]))
        .collect::<R<Vec<_>>>()?;
    let y = (0..2)
        .map(|a| output_transform(b, [&s[0][a], &s[1][a], &s[2][a], &s[3][a]]))
        .collect::<R<Vec<_>>>()?
        .into_iter()
        .flatten()
        .map(|out| b.reshape(&out, &[1, out_channels, batch, rows, cols]))
        .collect::<R<Vec<_>>>()?;
    // [2a + c, O, N, rows, cols] -> [N, O, rows, a, cols, c] -> [N, O, H, W], cropped.
    let y = b.reshape(
        &b.concat(&y.iter().collect::<Vec<_>>(), 0)?,
        &[2, 2, out_channels, batch, rows, cols],
    )?;
    let y = b.transpose(&y, &[3, 2, 4, 0, 5, 1])?;
    let y = b.reshape(&y, &[batch, out_channels, 2 * rows, 2 * cols])?;
    let y = b.slice_dim(&y, 2, 0, out_spatial[0], 1)?;
    b.slice_dim(&y, 3, 0, out_spatial[1], 1)
}

/// `y + bias[None, :, None, ...]`.
fn add_channel_bias<'a>(b: &Builder<'a>, y: &Val<'a>, bias: &Val<'a>) -> R<Val<'a>> {
    let bias = b.broadcast_in_dim(&b.convert(bias, y.dtype())?, y.shape(), &[1])?;
    b.binary("add", y, &bias)
}
