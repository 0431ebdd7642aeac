//! Matmul, convolution, reductions, softmax and normalization, executed on the PJRT CPU plugin.
mod common;
use common::*;
use tpu_dynamo_compiler::ir::{Arg, DType::*};

/// Naive `[m, k] @ [k, n]` on flat row-major data.
fn matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    (0..m * n)
        .map(|p| (0..k).map(|q| a[p / n * k + q] * b[q * n + p % n]).sum())
        .collect()
}

#[test]
fn mm_bmm_addmm() {
    let mut g = G::new();
    let a = g.input(F32, &[2, 3, 4]);
    let b = g.input(F32, &[2, 4, 5]);
    let m = g.input(F32, &[3, 4]);
    let w = g.input(F32, &[4, 5]);
    let bias = g.input(F32, &[5]);
    let bmm = g.op(
        "aten.bmm.default",
        vec![a.clone(), b.clone()],
        t(F32, &[2, 3, 5]),
    );
    let mm = g.op(
        "aten.mm.default",
        vec![m.clone(), w.clone()],
        t(F32, &[3, 5]),
    );
    let addmm = g
        .node(
            "aten.addmm.default",
            vec![bias.clone(), m.clone(), w.clone()],
            vec![("alpha", f(2.0)), ("beta", f(0.5))],
            vec![t(F32, &[3, 5])],
        )
        .remove(0);
    g.output(&[&bmm, &mm, &addmm]);
    let (x, out) = run_random(&g.graph, 21, 1.0);
    let mut want = matmul(&x[0][..12], &x[1][..20], 3, 4, 5);
    want.extend(matmul(&x[0][12..], &x[1][20..], 3, 4, 5));
    assert_close(&out[0], &want, 1e-5, 1e-5);
    let mm_want = matmul(&x[2], &x[3], 3, 4, 5);
    assert_close(&out[1], &mm_want, 1e-5, 1e-5);
    let addmm_want: Vec<f64> = mm_want
        .iter()
        .enumerate()
        .map(|(p, v)| 2.0 * v + 0.5 * x[4][p % 5])
        .collect();
    assert_close(&out[2], &addmm_want, 1e-5, 1e-5);
}

#[test]
fn bf16_mm_accumulates_in_f32() {
    let mut g = G::new();
    let a = g.input(Bf16, &[4, 64]);
    let b = g.input(Bf16, &[64, 3]);
    let mm = g.op(
        "aten.mm.default",
        vec![a.clone(), b.clone()],
        t(Bf16, &[4, 3]),
    );
    g.output(&[&mm]);
    let (x, out) = run_random(&g.graph, 4, 1.0);
    let want: Vec<f64> = matmul(&x[0], &x[1], 4, 64, 3)
        .into_iter()
        .map(|v| quantize(Bf16, v))
        .collect();
    // One rounding of the f32 sum: within one bf16 ulp (2^-8 relative).
    assert_close(&out[0], &want, 1e-3, 8e-3);
}

/// Direct NCHW convolution with groups and per-axis stride, padding, dilation.
struct Conv {
    xs: [usize; 4],
    ws: [usize; 4],
    stride: [usize; 2],
    pad: [usize; 2],
    dil: [usize; 2],
    groups: usize,
}

impl Conv {
    fn run(&self, x: &[f64], w: &[f64], bias: &[f64]) -> Vec<f64> {
        let [n, c, h, wd] = self.xs;
        let [o, ci, kh, kw] = self.ws;
        let (s, p, d) = (self.stride, self.pad, self.dil);
        let oh = (h + 2 * p[0] - d[0] * (kh - 1) - 1) / s[0] + 1;
        let ow = (wd + 2 * p[1] - d[1] * (kw - 1) - 1) / s[1] + 1;
        let mut out = vec![0.0; n * o * oh * ow];
        for (pos, v) in out.iter_mut().enumerate() {
            let (b, oc, y, xx) = (
                pos / (o * oh * ow),
                pos / (oh * ow) % o,
                pos / ow % oh,
                pos % ow,
            );
            let g = oc / (o / self.groups);
            let mut acc = bias[oc];
            for icg in 0..ci {
                for ky in 0..kh {
                    for kx in 0..kw {
                        let iy = (y * s[0] + ky * d[0]) as i64 - p[0] as i64;
                        let ix = (xx * s[1] + kx * d[1]) as i64 - p[1] as i64;
                        if iy >= 0 && ix >= 0 && iy < h as i64 && ix < wd as i64 {
                            acc += x[((b * c + g * ci + icg) * h + iy as usize) * wd + ix as usize]
                                * w[((oc * ci + icg) * kh + ky) * kw + kx];
                        }
                    }
                }
            }
            *v = acc;
        }
        out
    }
}

#[test]
fn conv2d_groups_stride_padding_dilation() {
    let mut g = G::new();
    let x = g.input(F32, &[2, 4, 7, 6]);
    let w = g.input(F32, &[6, 2, 3, 3]);
    let bias = g.input(F32, &[6]);
    let args = vec![
        x.clone(),
        w.clone(),
        bias.clone(),
        ints(&[2, 1]),
        ints(&[1, 1]),
        ints(&[1, 2]),
        Arg::Bool(false),
        ints(&[0, 0]),
        i(2),
    ];
    // h: (7 + 2 - 2 - 1)/2 + 1 = 4; w: (6 + 2 - 4 - 1)/1 + 1 = 4
    let y = g.op("aten.convolution.default", args, t(F32, &[2, 6, 4, 4]));
    g.output(&[&y]);
    let (inp, out) = run_random(&g.graph, 8, 1.0);
    let conv = Conv {
        xs: [2, 4, 7, 6],
        ws: [6, 2, 3, 3],
        stride: [2, 1],
        pad: [1, 1],
        dil: [1, 2],
        groups: 2,
    };
    assert_close(&out[0], &conv.run(&inp[0], &inp[1], &inp[2]), 1e-5, 1e-5);
}

#[test]
fn conv1d_and_transposed() {
    let mut g = G::new();
    let x = g.input(F32, &[1, 2, 5]);
    let w = g.input(F32, &[3, 2, 2]);
    let wt = g.input(F32, &[3, 2, 2]);
    let y = g.op(
        "aten.convolution.default",
        vec![
            x.clone(),
            w.clone(),
            Arg::None,
            ints(&[1]),
            ints(&[0]),
            ints(&[1]),
            Arg::Bool(false),
            ints(&[0]),
            i(1),
        ],
        t(F32, &[1, 3, 4]),
    );
    // Transposed: weight [in=3, out=2, k=2], stride 2 -> length (4-1)*2 + 2 = 8.
    let z = g.op(
        "aten.convolution.default",
        vec![
            y.clone(),
            wt.clone(),
            Arg::None,
            ints(&[2]),
            ints(&[0]),
            ints(&[1]),
            Arg::Bool(true),
            ints(&[0]),
            i(1),
        ],
        t(F32, &[1, 2, 8]),
    );
    g.output(&[&y, &z]);
    let (inp, out) = run_random(&g.graph, 12, 1.0);
    // Reuse the 2-d reference with a height of 1.
    let conv = Conv {
        xs: [1, 2, 1, 5],
        ws: [3, 2, 1, 2],
        stride: [1, 1],
        pad: [0, 0],
        dil: [1, 1],
        groups: 1,
    };
    let want = conv.run(&inp[0], &inp[1], &[0.0; 3]);
    assert_close(&out[0], &want, 1e-5, 1e-5);
    let mut zt = vec![0.0; 16];
    for ic in 0..3 {
        for i in 0..4 {
            for oc in 0..2 {
                for k in 0..2 {
                    zt[oc * 8 + i * 2 + k] += want[ic * 4 + i] * inp[2][(ic * 2 + oc) * 2 + k];
                }
            }
        }
    }
    assert_close(&out[1], &zt, 1e-5, 1e-5);
}

#[test]
fn reductions_softmax_cumsum() {
    let mut g = G::new();
    let x = g.input(F32, &[3, 4]);
    let b = g.input(Bool, &[3, 4]);
    let sum = g
        .node(
            "aten.sum.dim_IntList",
            vec![x.clone(), ints(&[1])],
            vec![],
            vec![t(F32, &[3])],
        )
        .remove(0);
    let mean = g.op(
        "aten.mean.dim",
        vec![x.clone(), ints(&[-1]), Arg::Bool(true)],
        t(F32, &[3, 1]),
    );
    let amax = g.op(
        "aten.amax.default",
        vec![x.clone(), ints(&[0])],
        t(F32, &[4]),
    );
    let any = g.op("aten.any.dim", vec![b.clone(), i(1)], t(Bool, &[3]));
    let sm = g.op(
        "aten._softmax.default",
        vec![x.clone(), i(-1), Arg::Bool(false)],
        t(F32, &[3, 4]),
    );
    let lsm = g.op(
        "aten._log_softmax.default",
        vec![x.clone(), i(1), Arg::Bool(false)],
        t(F32, &[3, 4]),
    );
    let cs = g.op(
        "aten.cumsum.default",
        vec![x.clone(), i(1)],
        t(F32, &[3, 4]),
    );
    let bsum = g.op(
        "aten.sum.dim_IntList",
        vec![b.clone(), ints(&[0])],
        t(I64, &[4]),
    );
    g.output(&[&sum, &mean, &amax, &any, &sm, &lsm, &cs, &bsum]);
    let (inp, out) = run_random(&g.graph, 2, 5.0);
    let (xs, bs) = (&inp[0], &inp[1]);
    let row = |r: usize| &xs[r * 4..r * 4 + 4];
    let sums: Vec<f64> = (0..3).map(|r| row(r).iter().sum()).collect();
    assert_close(&out[0], &sums, 1e-5, 1e-5);
    assert_close(
        &out[1],
        &sums.iter().map(|s| s / 4.0).collect::<Vec<_>>(),
        1e-5,
        1e-5,
    );
    assert_close(
        &out[2],
        &(0..4)
            .map(|c| (0..3).map(|r| xs[r * 4 + c]).fold(f64::MIN, f64::max))
            .collect::<Vec<_>>(),
        0.0,
        0.0,
    );
    assert_close(
        &out[3],
        &(0..3)
            .map(|r| bs[r * 4..r * 4 + 4].iter().any(|&v| v != 0.0) as i64 as f64)
            .collect::<Vec<_>>(),
        0.0,
        0.0,
    );
    let mut sm_want = vec![];
    let mut lsm_want = vec![];
    let mut cs_want = vec![];
    for r in 0..3 {
        let m = row(r).iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = row(r).iter().map(|v| (v - m).exp()).sum();
        sm_want.extend(row(r).iter().map(|v| (v - m).exp() / z));
        lsm_want.extend(row(r).iter().map(|v| v - m - z.ln()));
        cs_want.extend(row(r).iter().scan(0.0, |acc, v| {
            *acc += v;
            Some(*acc)
        }));
    }
    assert_close(&out[4], &sm_want, 1e-6, 1e-5);
    assert_close(&out[5], &lsm_want, 1e-5, 1e-5);
    assert_close(&out[6], &cs_want, 1e-5, 1e-5);
    assert_close(
        &out[7],
        &(0..4)
            .map(|c| (0..3).map(|r| bs[r * 4 + c]).sum())
            .collect::<Vec<_>>(),
        0.0,
        0.0,
    );
}

#[test]
fn softmax_bf16_is_computed_in_f32() {
    let mut g = G::new();
    let x = g.input(Bf16, &[2, 8]);
    let sm = g.op(
        "aten._softmax.default",
        vec![x.clone(), i(1), Arg::Bool(false)],
        t(Bf16, &[2, 8]),
    );
    g.output(&[&sm]);
    let (inp, out) = run_random(&g.graph, 6, 4.0);
    let mut want = vec![];
    for r in 0..2 {
        let row = &inp[0][r * 8..r * 8 + 8];
        let m = row.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
        want.extend(row.iter().map(|v| quantize(Bf16, (v - m).exp() / z)));
    }
    assert_close(&out[0], &want, 1e-6, 8e-3);
}

#[test]
fn layer_norm_and_group_norm() {
    let mut g = G::new();
    let x = g.input(F32, &[2, 3, 4]);
    let w = g.input(F32, &[4]);
    let b = g.input(F32, &[4]);
    let ln = g.node(
        "aten.native_layer_norm.default",
        vec![x.clone(), ints(&[4]), w.clone(), b.clone(), f(1e-5)],
        vec![],
        vec![t(F32, &[2, 3, 4]), t(F32, &[2, 3, 1]), t(F32, &[2, 3, 1])],
    );
    g.output(&[&ln[0], &ln[1], &ln[2]]);
    let (inp, out) = run_random(&g.graph, 13, 2.0);
    let (xs, ws, bs) = (&inp[0], &inp[1], &inp[2]);
    let mut y = vec![];
    let mut means = vec![];
    let mut rstds = vec![];
    for r in 0..6 {
        let row = &xs[r * 4..r * 4 + 4];
        let m = row.iter().sum::<f64>() / 4.0;
        let v = row.iter().map(|a| (a - m).powi(2)).sum::<f64>() / 4.0;
        let rs = 1.0 / (v + 1e-5).sqrt();
        y.extend(
            row.iter()
                .enumerate()
                .map(|(c, a)| (a - m) * rs * ws[c] + bs[c]),
        );
        means.push(m);
        rstds.push(rs);
    }
    assert_close(&out[0], &y, 1e-5, 1e-5);
    assert_close(&out[1], &means, 1e-6, 1e-6);
    assert_close(&out[2], &rstds, 1e-5, 1e-5);
}

#[test]
fn group_norm_stats() {
    let mut g = G::new();
    let x = g.input(F32, &[2, 4, 3]);
    let w = g.input(F32, &[4]);
    let b = g.input(F32, &[4]);
    let gn = g.node(
        "aten.native_group_norm.default",
        vec![
            x.clone(),
            w.clone(),
            b.clone(),
            i(2),
            i(4),
            i(3),
            i(2),
            f(1e-5),
        ],
        vec![],
        vec![t(F32, &[2, 4, 3]), t(F32, &[2, 2]), t(F32, &[2, 2])],
    );
    g.output(&[&gn[0], &gn[1], &gn[2]]);
    let (inp, out) = run_random(&g.graph, 17, 2.0);
    let (xs, ws, bs) = (&inp[0], &inp[1], &inp[2]);
    let (mut y, mut means, mut rstds) = (vec![0.0; 24], vec![], vec![]);
    for grp in 0..4 {
        let part = &xs[grp * 6..grp * 6 + 6];
        let m = part.iter().sum::<f64>() / 6.0;
        let rs = 1.0 / (part.iter().map(|a| (a - m).powi(2)).sum::<f64>() / 6.0 + 1e-5).sqrt();
        for (k, a) in part.iter().enumerate() {
            let c = (grp % 2) * 2 + k / 3;
            y[grp * 6 + k] = (a - m) * rs * ws[c] + bs[c];
        }
        means.push(m);
        rstds.push(rs);
    }
    assert_close(&out[0], &y, 1e-5, 1e-5);
    assert_close(&out[1], &means, 1e-6, 1e-6);
    assert_close(&out[2], &rstds, 1e-5, 1e-5);
}

/// Per-row selections and segment/window reductions: `median.dim` (lower middle, with index),
/// `nanmedian` skipping NaN, `segment_reduce` sum with `initial`, and `adaptive_max_pool2d`'s
/// uneven windows with flat indices.
#[test]
fn medians_segments_adaptive_pool() {
    let mut g = G::new();
    let x = g.input(F32, &[2, 4]);
    let lengths = g.input(I64, &[3]);
    let med = g.node(
        "aten.median.dim",
        vec![x.clone(), i(1)],
        vec![],
        vec![t(F32, &[2]), t(I64, &[2])],
    );
    let nanmed = g.op("aten.nanmedian.default", vec![x.clone()], t(F32, &[]));
    let flat = g.op(
        "aten.view.default",
        vec![x.clone(), ints(&[8])],
        t(F32, &[8]),
    );
    let seg = g.node(
        "aten.segment_reduce.default",
        vec![flat, Arg::Str("sum".into())],
        vec![("lengths", lengths), ("initial", f(10.0))],
        vec![t(F32, &[3])],
    );
    let x3 = g.op(
        "aten.view.default",
        vec![x.clone(), ints(&[1, 2, 4])],
        t(F32, &[1, 2, 4]),
    );
    let pool = g.node(
        "aten.adaptive_max_pool2d.default",
        vec![x3, ints(&[1, 3])],
        vec![],
        vec![t(F32, &[1, 1, 3]), t(I64, &[1, 1, 3])],
    );
    g.output(&[&med[0], &med[1], &nanmed, &seg[0], &pool[0], &pool[1]]);
    let nan = f64::NAN;
    let xs = vec![3.0, 1.0, 4.0, 2.0, 7.0, nan, 5.0, 6.0];
    let out = run(&g.graph, &[xs, vec![3.0, 0.0, 5.0]]);
    assert_close(&out[0], &[2.0, nan], 0.0, 0.0);
    assert_close(&out[1], &[3.0, 1.0], 0.0, 0.0);
    assert_close(&out[2], &[4.0], 0.0, 0.0);
    assert_close(&out[3], &[18.0, 10.0, nan], 0.0, 0.0);
    // Windows over 4 columns into 3: [0, 2), [1, 3), [2, 4), both rows; NaN wins.
    assert_close(&out[4], &[nan, nan, 6.0], 0.0, 0.0);
    assert_close(&out[5], &[5.0, 5.0, 7.0], 0.0, 0.0);
}
