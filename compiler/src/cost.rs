//! A rough count of the arithmetic in one execute of a graph, for decisions that need only its
//! order of magnitude (whether an extra execute is cheap enough to hide, `python/src/warm_up.rs`).
use crate::ir::{Arg, Graph, TensorType};

/// Floating-point operations: two per multiply-add of the contractions (matrix products,
/// convolutions, attention), one per output element of every other op.
pub fn flops(graph: &Graph) -> f64 {
    let types = graph.value_types();
    let arg_type = |node: &crate::ir::Node, i: usize| match node.args.get(i) {
        Some(Arg::Value(v)) => types.get(*v as usize).copied(),
        _ => None,
    };
    graph
        .nodes
        .iter()
        .map(|node| {
            let first = node.outputs.first().map_or(0.0, elements);
            // Products summed into each element of the first output.
            let summed = match node.op.as_str() {
                "aten.mm.default" | "aten.bmm.default" => arg_type(node, 0).and_then(|a| dim(a, 1)),
                "aten.addmm.default" | "aten.baddbmm.default" => arg_type(node, 1).and_then(|a| dim(a, 1)),
                // The weight: [out channels, in channels / groups, kernel...].
                "aten.convolution.default" => {
                    arg_type(node, 1).map(|w| w.shape.iter().skip(1).product::<i64>() as f64)
                }
                // Scores and their product with V: 2 * S products per output element.
                op if op.contains("scaled_dot_product") => arg_type(node, 1).and_then(|k| dim(k, 2)).map(|s| 2.0 * s),
                _ => None,
            };
            match summed {
                Some(n) => 2.0 * first * n,
                None => node.outputs.iter().map(elements).sum(),
            }
        })
        .sum()
}

fn elements(t: &TensorType) -> f64 {
    t.shape.iter().product::<i64>() as f64
}

/// Dimension `from_end` counted from the last (1 = the last).
fn dim(t: &TensorType, from_end: usize) -> Option<f64> {
    t.shape.len().checked_sub(from_end).map(|i| t.shape[i] as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, Input, InputKind, Node};

    fn f32s(shape: &[i64]) -> TensorType {
        TensorType { dtype: DType::F32, shape: shape.to_vec() }
    }

    #[test]
    fn contractions_count_their_products_and_other_ops_their_outputs() {
        let input = |shape: &[i64]| Input { ty: f32s(shape), kind: InputKind::User };
        let node = |op: &str, args: Vec<Arg>, out: &[i64]| Node {
            op: op.into(),
            args,
            kwargs: vec![],
            outputs: vec![f32s(out)],
        };
        let graph = Graph {
            inputs: vec![input(&[8, 64]), input(&[64, 32]), input(&[2, 3, 16, 16]), input(&[4, 3, 3, 3])],
            nodes: vec![
                node("aten.mm.default", vec![Arg::Value(0), Arg::Value(1)], &[8, 32]),
                node("aten.relu.default", vec![Arg::Value(4)], &[8, 32]),
                node("aten.convolution.default", vec![Arg::Value(2), Arg::Value(3)], &[2, 4, 14, 14]),
            ],
            outputs: vec![5, 6],
            aliases: vec![],
        };
        let (mm, relu, conv) = (2.0 * 8.0 * 32.0 * 64.0, 8.0 * 32.0, 2.0 * (2 * 4 * 14 * 14) as f64 * 27.0);
        assert_eq!(flops(&graph), mm + relu + conv);
    }
}
