//! Packing many models from one client: no count of sessions meant for
//! hostile clients refuses a deployment (docs/protocol.md, *Limits*), and
//! loads of an architecture the service has seen reuse what a load
//! computes that does not depend on the weights (the load cache,
//! docs/memory.md). CPU here; `LANES_TEST_DEVICE=cuda` runs the same cases
//! against a GPU-backed service.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use lanes_adaptor::wire::{Reply, Request, SessionId};
use lanes_adaptor::{Client, SessionSpec, Tensor};
use util::*;

fn open(c: &mut Client, name: &str) -> SessionId {
    match c
        .request(&Request::OpenSession(SessionSpec::inference(name)))
        .unwrap()
    {
        Reply::SessionOpened { session } => session,
        other => panic!("{other:?}"),
    }
}

fn x_for(seed: u64) -> Tensor {
    Tensor::from_f32([BATCH, IN], values(seed, BATCH * IN)).unwrap()
}

/// 200 sessions, each with a graph and weights of its own, opened and
/// loaded over one connection under the default limits (the old per-client
/// cap was 64), and every one of them answers its Runs correctly.
#[test]
fn two_hundred_packed_models_from_one_client_all_answer() {
    const MODELS: u64 = 200;
    let service = start();
    let mut c = Client::connect(service.endpoint()).unwrap();
    let mut models = Vec::new();
    for m in 0..MODELS {
        let id = open(&mut c, &format!("model-{m}"));
        let (graph, vars) = linear_relu(1000 + 2 * m);
        c.load_in(id, &graph, vars).unwrap();
        models.push(id);
    }
    assert_eq!(c.status().unwrap().sessions.len(), MODELS as usize);
    for (m, id) in models.iter().enumerate() {
        let seed = 1000 + 2 * m as u64;
        let x = x_for(m as u64);
        let out = c.run_in(*id, vec![("x", x.clone())], &["y"]).unwrap();
        let want = linear_relu_ref(
            &x.f32s().unwrap(),
            &values(seed, IN * OUT),
            &values(seed + 1, OUT),
        );
        assert_close(&out[0].f32s().unwrap(), &want);
    }
}
