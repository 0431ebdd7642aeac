//! Input/output aliasing (in-place updated inputs, e.g. a KV cache): module attributes, execution.
mod common;
use common::*;
use tpu_dynamo_compiler::ir::{Alias, DType::*};
use tpu_dynamo_compiler::lower;

/// `cache + x` written back into `cache` (input 0), plus a regular output.
fn update_graph() -> G {
    let mut g = G::new();
    let cache = g.input(F32, &[2, 3]);
    let x = g.input(F32, &[2, 3]);
    let new = g.op(
        "aten.add.Tensor",
        vec![cache.clone(), x.clone()],
        t(F32, &[2, 3]),
    );
    let y = g.op("aten.mul.Tensor", vec![new.clone(), x], t(F32, &[2, 3]));
    g.output(&[&y, &new]);
    g.graph.aliases.push(Alias {
        input: 0,
        output: 1,
    });
    g
}

#[test]
fn aliased_input_is_marked_and_runs() {
    let g = update_graph();
    let lowered = lower(&g.graph, &[]).unwrap();
    assert!(
        lowered.text.contains("tf.aliasing_output = 1 : i32"),
        "{}",
        lowered.text
    );
    let out = run(&g.graph, &[vec![1.0; 6], vec![2.0; 6]]);
    assert_eq!(out, vec![vec![6.0; 6], vec![3.0; 6]]);
}

#[test]
fn alias_of_another_type_is_rejected() {
    let mut g = update_graph();
    g.graph.aliases[0].output = 0;
    g.graph.inputs[1].ty = t(F32, &[2, 3]);
    g.graph.outputs[0] = 1; // output 0 is now input x: same type, accepted
    assert!(lower(&g.graph, &[]).is_ok());
    g.graph.aliases.push(Alias {
        input: 0,
        output: 1,
    });
    let err = lower(&g.graph, &[]).unwrap_err();
    assert!(err.to_string().contains("aliased twice"), "{err}");
}
