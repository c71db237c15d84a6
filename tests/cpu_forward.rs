//! CPU forward ops and program errors on small hand-computed cases.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use lanes::exec::cpu::CpuProgram;
use lanes::exec::ExecError;
use lanes_adaptor::{validate, GraphBuilder, GraphLimits, Tensor, TensorType};

#[test]
fn matmul_add_broadcast_relu_and_program_errors() {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([2, 2]));
    let w = g.variable(
        "w",
        Tensor::from_f32([2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap(),
    );
    let b = g.variable("b", Tensor::from_f32([2], vec![-10.0, 0.0]).unwrap());
    let y = g.matmul(x, w);
    let z = g.add(y, b);
    let r = g.relu(z);
    let name = g.graph_nodes()[r.node.index()].name.clone();
    let (graph, vars) = g.finish().unwrap();
    let mut p = CpuProgram::new(validate(graph, &GraphLimits::default()).unwrap(), vars).unwrap();
    let feeds = BTreeMap::from([(
        "x".to_string(),
        Tensor::from_f32([2, 2], vec![1.0, 0.0, 1.0, 1.0]).unwrap(),
    )]);
    let out = p.run(&feeds, std::slice::from_ref(&name)).unwrap();
    // x·w = [[1,2],[4,6]]; + b = [[-9,2],[-6,6]]; relu.
    assert_eq!(out[0].f32s().unwrap(), &[0.0, 2.0, 0.0, 6.0]);
    assert!(matches!(
        p.run(&BTreeMap::new(), std::slice::from_ref(&name)),
        Err(ExecError::MissingFeed { .. })
    ));
    assert!(matches!(
        p.run(&feeds, &["nope".into()]),
        Err(ExecError::UnknownFetch { .. })
    ));
    let bad = BTreeMap::from([("x".to_string(), Tensor::full([3, 2], 1.0))]);
    assert!(matches!(
        p.run(&bad, &[name]),
        Err(ExecError::FeedType { .. })
    ));
}
