//! A graph with bf16 variables through a real `lanes serve` (CPU here;
//! `LANES_TEST_DEVICE=cuda` runs it on the GPU machine): loaded, run, its
//! half outputs fetched and its variables read back as they were sent, the
//! results those of the CPU reference.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::collections::BTreeMap;

use lanes::exec::cpu::CpuProgram;
use lanes_adaptor::{
    bf16, validate, Client, DType, Graph, GraphBuilder, GraphLimits, SessionSpec, Tensor,
    TensorType, VarValues,
};
use util::serve::Serve;

/// x (f32) cast to bf16 -> linear (bf16 weight and bias) -> relu, fetched
/// in bf16 ("h") and cast back to f32 ("y").
fn model() -> (Graph, VarValues) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([4, 8]));
    let w: Vec<bf16> = (0..8 * 3)
        .map(|i| bf16::from_f32((i as f32 - 11.5) / 16.0))
        .collect();
    let b: Vec<bf16> = [0.25f32, -0.5, 0.125]
        .iter()
        .map(|&v| bf16::from_f32(v))
        .collect();
    let w = g.variable("w", Tensor::from_bf16([8, 3], w).unwrap());
    let b = g.variable("b", Tensor::from_bf16([3], b).unwrap());
    let xh = g.cast(x, DType::BF16);
    let h = g.matmul(xh, w);
    let h = g.add(h, b);
    let h = g.relu(h);
    g.set_name(h, "h");
    let y = g.cast(h, DType::F32);
    g.set_name(y, "y");
    g.finish().unwrap()
}

#[test]
fn a_bf16_model_loads_runs_and_reads_back_through_the_service() {
    let serve = Serve::start(&[]);
    let (graph, vars) = model();
    let x = Tensor::from_f32([4, 8], (0..32).map(|i| (i as f32 - 16.0) / 10.0).collect()).unwrap();

    let mut reference = CpuProgram::new(
        validate(graph.clone(), &GraphLimits::default()).unwrap(),
        vars.clone(),
    )
    .unwrap();
    let feeds = BTreeMap::from([("x".to_string(), x.clone())]);
    let want = reference
        .run(&feeds, &["h".to_string(), "y".to_string()])
        .unwrap();
    assert_eq!(want[0].dtype(), DType::BF16);
    assert!(want[1].f32s().unwrap().iter().any(|&v| v > 0.0));

    let mut client = Client::connect(&serve.endpoint).unwrap();
    let mut s = client.open_session(SessionSpec::inference("bf16")).unwrap();
    s.load(&graph, vars.clone()).unwrap();
    for _ in 0..2 {
        let got = s.run(vec![("x", x.clone())], &["h", "y"]).unwrap();
        assert_eq!(got, want);
    }
    assert_eq!(s.read_variables(&["w", "b"]).unwrap(), vars);
    // A feed of the wrong dtype is refused with the feed's error.
    let wrong = Tensor::zeros(&TensorType::new(DType::BF16, [4, 8]));
    let e = s.run(vec![("x", wrong)], &["y"]).unwrap_err();
    assert!(e.to_string().contains("bf16"), "{e}");
    s.close().unwrap();
    serve.stop();
}
