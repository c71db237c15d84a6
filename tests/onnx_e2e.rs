//! ONNX models through a real service: the PyTorch fixtures imported at
//! batch 2, loaded into `lanes serve` over ZeroMQ (the new ops cross the
//! wire), run, and compared with PyTorch's outputs. CPU here;
//! `LANES_TEST_DEVICE=cuda` runs it against a GPU-backed service (TF32
//! tolerance there, as the conformance models).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::path::PathBuf;

use lanes::npy;
use lanes_adaptor::onnx::{import_file, ImportOptions};
use lanes_adaptor::{Client, SessionSpec};

#[test]
fn onnx_models_run_through_the_service() {
    let (rtol, atol) = if util::device() == "cpu" {
        (1e-4, 1e-5)
    } else {
        (2e-2, 2e-2)
    };
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/onnx");
    let service = util::start();
    let mut client = Client::connect(service.endpoint()).unwrap();
    for model in ["bert", "mobilenet_v2", "densenet121"] {
        let opts = ImportOptions {
            batch: 2,
            ..ImportOptions::default()
        };
        let m = import_file(dir.join(format!("{model}.onnx")), &opts).unwrap();
        let mut s = client
            .open_session(SessionSpec::inference(model).with_expected_iterations(2))
            .unwrap();
        s.load(&m.graph, m.vars).unwrap();
        let feeds: Vec<(String, lanes_adaptor::Tensor)> = m
            .inputs
            .iter()
            .map(|(n, _)| {
                (
                    n.clone(),
                    npy::read(dir.join(format!("{model}.{n}.npy"))).unwrap(),
                )
            })
            .collect();
        let fetches: Vec<&str> = m.outputs.iter().map(|(n, _)| n.as_str()).collect();
        for _ in 0..2 {
            let out = s.run(feeds.clone(), &fetches).unwrap();
            for (name, got) in fetches.iter().zip(&out) {
                let want = npy::read(dir.join(format!("{model}.{name}.npy"))).unwrap();
                let a = npy::compare(got, &want, rtol, atol).unwrap();
                assert!(
                    a.ok(),
                    "{model}.{name}: {} of {} outside (max abs {:e})",
                    a.outside,
                    a.elements,
                    a.max_abs
                );
            }
        }
        s.close().unwrap();
    }
}
