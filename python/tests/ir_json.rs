//! Pins the JSON shapes that `tpu_dynamo/convert.py` writes to what the IR's serde expects.
use tpu_dynamo_compiler::ir::*;

#[test]
fn python_json_decodes_to_the_expected_graph() {
    let text = r#"{"graph": {
        "inputs": [{"ty": {"dtype": "f32", "shape": [2, 3]}, "kind": "parameter"},
                   {"ty": {"dtype": "bf16", "shape": []}, "kind": "constant"}],
        "nodes": [{"op": "aten._to_copy.default", "args": [{"value": 0}],
                   "kwargs": [["dtype", {"dtype": "bf16"}], ["layout", {"str": "torch.strided"}]],
                   "outputs": [{"dtype": "bf16", "shape": [2, 3]}]},
                  {"op": "aten.sum.dim_IntList",
                   "args": [{"value": 2}, {"list": [{"int": -1}]}, {"bool": true}, "none",
                            {"float": 4611686018427387904}],
                   "kwargs": [], "outputs": [{"dtype": "bf16", "shape": [2, 1]}]}],
        "outputs": [3, 1]},
      "sources": ["m.py:3: x.to(torch.bfloat16)", null]}"#;
    let g = GraphWithSources::from_json(text).unwrap();
    assert_eq!(g.graph.inputs[0].kind, InputKind::Parameter);
    assert_eq!(g.graph.inputs[1].ty, TensorType::new(DType::Bf16, vec![]));
    assert_eq!(g.graph.nodes[0].kwargs[0], ("dtype".to_string(), Arg::DType(DType::Bf16)));
    assert_eq!(
        g.graph.nodes[1].args,
        vec![
            Arg::Value(2),
            Arg::List(vec![Arg::Int(-1)]),
            Arg::Bool(true),
            Arg::None,
            Arg::Float(FloatBits(2.0f64.to_bits())),
        ]
    );
    assert_eq!(g.graph.outputs, vec![3, 1]);
    assert_eq!(g.sources, vec![Some("m.py:3: x.to(torch.bfloat16)".to_string()), None]);
    // And back: what Rust writes is what Python writes (modulo whitespace).
    let again: serde_json::Value = serde_json::to_value(&g.graph).unwrap();
    assert_eq!(again["nodes"][1]["args"][3], serde_json::json!("none"));
    assert_eq!(again["nodes"][0]["kwargs"][0], serde_json::json!(["dtype", {"dtype": "bf16"}]));
}
