//! View/layout and indexing rules, executed on the PJRT CPU plugin. Inputs are iota-like so
//! each output element names the source element it came from.
mod common;
use common::*;
use tpu_dynamo_compiler::ir::{Arg, DType::*};

/// `0, 1, 2, …` for a tensor of `n` elements.
fn iota(n: usize) -> Vec<f64> {
    (0..n).map(|v| v as f64).collect()
}

/// Reference gather by multi-index: `out[k] = x[src(unravel(k, shape))]`.
fn pick(
    x: &[f64],
    x_shape: &[i64],
    out_shape: &[i64],
    src: impl Fn(&[usize]) -> Vec<usize>,
) -> Vec<f64> {
    let n: i64 = out_shape.iter().product();
    let st = strides(x_shape);
    (0..n as usize)
        .map(|k| {
            x[src(&unravel(k, out_shape))
                .iter()
                .zip(&st)
                .map(|(i, s)| i * s)
                .sum::<usize>()]
        })
        .collect()
}

#[test]
fn views() {
    let mut g = G::new();
    let x = g.input(F32, &[2, 3, 4]);
    let v = g.op(
        "aten.view.default",
        vec![x.clone(), ints(&[6, -1])],
        t(F32, &[6, 4]),
    );
    let p = g.op(
        "aten.permute.default",
        vec![x.clone(), ints(&[2, 0, 1])],
        t(F32, &[4, 2, 3]),
    );
    let u = g.op(
        "aten.unsqueeze.default",
        vec![x.clone(), i(-1)],
        t(F32, &[2, 3, 4, 1]),
    );
    let e = g.op(
        "aten.expand.default",
        vec![u.clone(), ints(&[-1, -1, -1, 2])],
        t(F32, &[2, 3, 4, 2]),
    );
    let s = g.op(
        "aten.squeeze.dims",
        vec![u.clone(), ints(&[-1, 0])],
        t(F32, &[2, 3, 4]),
    );
    let sl = g.op(
        "aten.slice.Tensor",
        vec![x.clone(), i(2), i(1), i(i64::MAX), i(2)],
        t(F32, &[2, 3, 2]),
    );
    let se = g.op(
        "aten.select.int",
        vec![x.clone(), i(1), i(-1)],
        t(F32, &[2, 4]),
    );
    let c = g.op(
        "aten.cat.default",
        vec![Arg::List(vec![x.clone(), x.clone()]), i(1)],
        t(F32, &[2, 6, 4]),
    );
    let parts = g.node(
        "aten.split_with_sizes.default",
        vec![x.clone(), ints(&[1, 3]), i(-1)],
        vec![],
        vec![t(F32, &[2, 3, 1]), t(F32, &[2, 3, 3])],
    );
    let cl = g.op("aten.clone.default", vec![x.clone()], t(F32, &[2, 3, 4]));
    let al = g.op("aten.alias.default", vec![x.clone()], t(F32, &[2, 3, 4]));
    let rp = g.op(
        "aten.repeat.default",
        vec![x.clone(), ints(&[2, 1, 1, 1])],
        t(F32, &[2, 2, 3, 4]),
    );
    let pd = g.op(
        "aten.constant_pad_nd.default",
        vec![x.clone(), ints(&[1, -1]), f(9.0)],
        t(F32, &[2, 3, 4]),
    );
    g.output(&[
        &v, &p, &e, &s, &sl, &se, &c, &parts[0], &parts[1], &cl, &al, &rp, &pd,
    ]);
    let xs = iota(24);
    let out = run(&g.graph, std::slice::from_ref(&xs));
    let xsh = [2, 3, 4];
    assert_close(&out[0], &xs, 0.0, 0.0);
    assert_close(
        &out[1],
        &pick(&xs, &xsh, &[4, 2, 3], |i| vec![i[1], i[2], i[0]]),
        0.0,
        0.0,
    );
    assert_close(
        &out[2],
        &pick(&xs, &xsh, &[2, 3, 4, 2], |i| i[..3].to_vec()),
        0.0,
        0.0,
    );
    assert_close(&out[3], &xs, 0.0, 0.0);
    assert_close(
        &out[4],
        &pick(&xs, &xsh, &[2, 3, 2], |i| vec![i[0], i[1], 1 + 2 * i[2]]),
        0.0,
        0.0,
    );
    assert_close(
        &out[5],
        &pick(&xs, &xsh, &[2, 4], |i| vec![i[0], 2, i[1]]),
        0.0,
        0.0,
    );
    assert_close(
        &out[6],
        &pick(&xs, &xsh, &[2, 6, 4], |i| vec![i[0], i[1] % 3, i[2]]),
        0.0,
        0.0,
    );
    assert_close(
        &out[7],
        &pick(&xs, &xsh, &[2, 3, 1], |i| vec![i[0], i[1], 0]),
        0.0,
        0.0,
    );
    assert_close(
        &out[8],
        &pick(&xs, &xsh, &[2, 3, 3], |i| vec![i[0], i[1], 1 + i[2]]),
        0.0,
        0.0,
    );
    assert_close(&out[9], &xs, 0.0, 0.0);
    assert_close(&out[10], &xs, 0.0, 0.0);
    assert_close(
        &out[11],
        &pick(&xs, &xsh, &[2, 2, 3, 4], |i| i[1..].to_vec()),
        0.0,
        0.0,
    );
    let padded: Vec<f64> = (0..24)
        .map(|k| if k % 4 == 0 { 9.0 } else { xs[k - 1] })
        .collect();
    assert_close(&out[12], &padded, 0.0, 0.0);
}

#[test]
fn embedding_gather_index() {
    let mut g = G::new();
    let w = g.input(F32, &[5, 3]);
    let ids = g.input(I64, &[2, 2]);
    let x = g.input(F32, &[3, 4, 5]);
    let idx = g.input(I64, &[2]);
    let gi = g.input(I64, &[3, 2]);
    let emb = g.op(
        "aten.embedding.default",
        vec![w.clone(), ids.clone()],
        t(F32, &[2, 2, 3]),
    );
    // x[:, idx] keeps B in place of dim 1; x[idx, :, idx] (non-adjacent) puts B first.
    let mid = g.op(
        "aten.index.Tensor",
        vec![x.clone(), Arg::List(vec![Arg::None, idx.clone()])],
        t(F32, &[3, 2, 5]),
    );
    let split = g.op(
        "aten.index.Tensor",
        vec![
            x.clone(),
            Arg::List(vec![idx.clone(), Arg::None, idx.clone()]),
        ],
        t(F32, &[2, 4]),
    );
    let gat = g.op(
        "aten.gather.default",
        vec![w.clone(), i(1), gi.clone()],
        t(F32, &[3, 2]),
    );
    g.output(&[&emb, &mid, &split, &gat]);
    let (ws, xs) = (iota(15), iota(60));
    let ids_v = vec![4.0, 0.0, 2.0, 2.0];
    let idx_v = vec![2.0, -1.0];
    let gi_v = vec![0.0, 2.0, 1.0, 1.0, -1.0, 0.0];
    let out = run(
        &g.graph,
        &[
            ws.clone(),
            ids_v.clone(),
            xs.clone(),
            idx_v.clone(),
            gi_v.clone(),
        ],
    );
    let wrap = |v: f64, n: usize| {
        if v < 0.0 {
            (v + n as f64) as usize
        } else {
            v as usize
        }
    };
    assert_close(
        &out[0],
        &pick(&ws, &[5, 3], &[2, 2, 3], |i| {
            vec![ids_v[i[0] * 2 + i[1]] as usize, i[2]]
        }),
        0.0,
        0.0,
    );
    assert_close(
        &out[1],
        &pick(&xs, &[3, 4, 5], &[3, 2, 5], |i| {
            vec![i[0], wrap(idx_v[i[1]], 4), i[2]]
        }),
        0.0,
        0.0,
    );
    assert_close(
        &out[2],
        &pick(&xs, &[3, 4, 5], &[2, 4], |i| {
            vec![wrap(idx_v[i[0]], 3), i[1], wrap(idx_v[i[0]], 5)]
        }),
        0.0,
        0.0,
    );
    assert_close(
        &out[3],
        &pick(&ws, &[5, 3], &[3, 2], |i| {
            vec![i[0], wrap(gi_v[i[0] * 2 + i[1]], 3)]
        }),
        0.0,
        0.0,
    );
}

#[test]
fn scatters() {
    let mut g = G::new();
    let x = g.input(F32, &[4, 3]);
    let rows = g.input(I64, &[2]);
    let vals = g.input(F32, &[2, 3]);
    let src = g.input(F32, &[2, 3]);
    let put = g.op(
        "aten.index_put.default",
        vec![x.clone(), Arg::List(vec![rows.clone()]), vals.clone()],
        t(F32, &[4, 3]),
    );
    let acc = g.op(
        "aten.index_put.default",
        vec![
            x.clone(),
            Arg::List(vec![rows.clone()]),
            vals.clone(),
            Arg::Bool(true),
        ],
        t(F32, &[4, 3]),
    );
    let ss = g.op(
        "aten.slice_scatter.default",
        vec![x.clone(), src.clone(), i(0), i(0), i(4), i(2)],
        t(F32, &[4, 3]),
    );
    let sel = g.op(
        "aten.select.int",
        vec![src.clone(), i(0), i(1)],
        t(F32, &[3]),
    );
    let sc = g.op(
        "aten.select_scatter.default",
        vec![x.clone(), sel.clone(), i(0), i(-1)],
        t(F32, &[4, 3]),
    );
    g.output(&[&put, &acc, &ss, &sc]);
    let xs = iota(12);
    let rows_v = vec![3.0, 1.0];
    let vals_v = vec![100.0, 101.0, 102.0, 103.0, 104.0, 105.0];
    let src_v = vec![-1.0, -2.0, -3.0, -4.0, -5.0, -6.0];
    let out = run(
        &g.graph,
        &[xs.clone(), rows_v, vals_v.clone(), src_v.clone()],
    );
    let mut put_want = xs.clone();
    let mut acc_want = xs.clone();
    for (r, row) in [3usize, 1].iter().enumerate() {
        for c in 0..3 {
            put_want[row * 3 + c] = vals_v[r * 3 + c];
            acc_want[row * 3 + c] += vals_v[r * 3 + c];
        }
    }
    assert_close(&out[0], &put_want, 0.0, 0.0);
    assert_close(&out[1], &acc_want, 0.0, 0.0);
    let ss_want: Vec<f64> = (0..12)
        .map(|k| {
            if (k / 3) % 2 == 0 {
                src_v[(k / 3 / 2) * 3 + k % 3]
            } else {
                xs[k]
            }
        })
        .collect();
    assert_close(&out[2], &ss_want, 0.0, 0.0);
    let sc_want: Vec<f64> = (0..12)
        .map(|k| if k / 3 == 3 { src_v[3 + k % 3] } else { xs[k] })
        .collect();
    assert_close(&out[3], &sc_want, 0.0, 0.0);
}

/// Reducing scatters (`include_self=false` starts hit slots from the identity; mean counts),
/// `nonzero_static` padding, and `cummax`'s last-occurrence indices.
#[test]
fn reducing_scatters_and_selections() {
    let mut g = G::new();
    let x = g.input(F32, &[4]);
    let index = g.input(I64, &[3]);
    let src = g.input(F32, &[3]);
    let s = |v: &str| Arg::Str(v.into());
    let mean = g.node(
        "aten.scatter_reduce.two",
        vec![x.clone(), i(0), index.clone(), src.clone(), s("mean")],
        vec![("include_self", Arg::Bool(false))],
        vec![t(F32, &[4])],
    );
    let amax = g.op(
        "aten.index_reduce.default",
        vec![x.clone(), i(0), index.clone(), src.clone(), s("amax")],
        t(F32, &[4]),
    );
    let nz = g.node(
        "aten.nonzero_static.default",
        vec![x.clone()],
        vec![("size", i(4))],
        vec![t(I64, &[4, 1])],
    );
    let cm = g.node(
        "aten.cummax.default",
        vec![x.clone(), i(0)],
        vec![],
        vec![t(F32, &[4]), t(I64, &[4])],
    );
    g.output(&[&mean[0], &amax, &nz[0], &cm[0], &cm[1]]);
    let out = run(
        &g.graph,
        &[
            vec![2.0, 0.0, 5.0, 2.0],
            vec![1.0, 3.0, 1.0],
            vec![4.0, 6.0, 8.0],
        ],
    );
    assert_close(&out[0], &[2.0, 6.0, 5.0, 6.0], 0.0, 0.0);
    assert_close(&out[1], &[2.0, 8.0, 5.0, 6.0], 0.0, 0.0);
    assert_close(&out[2], &[0.0, 2.0, 3.0, -1.0], 0.0, 0.0);
    assert_close(&out[3], &[2.0, 2.0, 5.0, 5.0], 0.0, 0.0);
    assert_close(&out[4], &[0.0, 0.0, 2.0, 2.0], 0.0, 0.0);
}
