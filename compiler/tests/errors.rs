//! Error reporting, type checking of rules, module form (bytecode, pass-through outputs).
mod common;
use common::*;
use tpu_dynamo_compiler::ir::DType::*;
use tpu_dynamo_compiler::{lower, LowerErrorKind};

#[test]
fn unknown_op_names_op_arg_types_and_source() {
    let mut g = G::new();
    let x = g.input(F32, &[2, 3]);
    let y = g.op("aten.foo.default", vec![x.clone(), i(1)], t(F32, &[2, 3]));
    g.output(&[&y]);
    let err = lower(
        &g.graph,
        &[Some("model.py:12 in forward: y = foo(x, 1)".into())],
    )
    .unwrap_err();
    assert_eq!(err.kind, LowerErrorKind::Unsupported);
    assert_eq!(err.op, "aten.foo.default");
    assert_eq!(err.node, Some(0));
    assert_eq!(err.arg_types, vec!["f32[2, 3]", "int 1"]);
    let text = err.to_string();
    assert!(
        text.starts_with("unsupported op aten.foo.default(f32[2, 3], int 1)"),
        "{text}"
    );
    assert!(text.contains("at model.py:12 in forward"), "{text}");
}

#[test]
fn rule_result_must_match_recorded_type() {
    let mut g = G::new();
    let x = g.input(F32, &[2, 3]);
    // The graph claims permute gives [2, 3]; the rule computes [3, 2].
    let y = g.op(
        "aten.permute.default",
        vec![x.clone(), ints(&[1, 0])],
        t(F32, &[2, 3]),
    );
    g.output(&[&y]);
    let err = lower(&g.graph, &[]).unwrap_err();
    assert_eq!(err.kind, LowerErrorKind::Failed);
    assert!(
        err.message.contains("f32[3, 2]") && err.message.contains("f32[2, 3]"),
        "{err}"
    );
    let bad_dtype = {
        let mut g = G::new();
        let x = g.input(F32, &[2]);
        // Elementwise ops take their result dtype from the graph; comparisons compute it.
        let y = g.op("aten.eq.Scalar", vec![x.clone(), i(0)], t(F32, &[2]));
        g.output(&[&y]);
        g
    };
    assert!(lower(&bad_dtype.graph, &[])
        .unwrap_err()
        .to_string()
        .contains("aten.eq.Scalar lowering failed"));
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let mut g = G::new();
    let x = g.input(F32, &[2, 3]);
    let y = g.op(
        "aten.view.default",
        vec![x.clone(), ints(&[4, -1])],
        t(F32, &[4, 2]),
    );
    g.output(&[&y]);
    let err = lower(&g.graph, &[]).unwrap_err();
    assert!(err.message.contains("cannot infer sizes"), "{err}");
}

#[test]
fn bytecode_runs_and_outputs_may_repeat_or_be_inputs() {
    let mut g = G::new();
    let x = g.input(F32, &[3]);
    let y = g.op("aten.exp.default", vec![x.clone()], t(F32, &[3]));
    g.output(&[&y, &x, &y]);
    let xs = vec![0.5, -1.0, 2.0];
    let out = run_form(&g.graph, std::slice::from_ref(&xs), Form::Bytecode);
    let e: Vec<f64> = xs.iter().map(|v: &f64| v.exp()).collect();
    assert_close(&out[0], &e, 1e-6, 1e-6);
    assert_close(&out[1], &xs, 0.0, 0.0);
    assert_close(&out[2], &e, 1e-6, 1e-6);
    let lowered = lower(&g.graph, &[]).unwrap();
    assert!(lowered.text.contains("func.func @main"), "{}", lowered.text);
    assert_eq!(lowered.outputs.len(), 3);
}
