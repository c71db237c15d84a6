//! Residency through the service: more inference models than the memory
//! reservation holds, requests round-robin across them over real sockets.
//! Idle models are evicted to host memory (least recently used first), a
//! request for an evicted model brings it back pipelined, and every answer
//! equals the model's own reference output.
//!
//! CPU backend in CI; `LANES_TEST_DEVICE=cuda` runs it on the GPU machine.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::collections::BTreeMap;
use std::time::Duration;

use lanes::exec::cpu::CpuProgram;
use lanes_adaptor::wire::{Reply, Request};
use lanes_adaptor::zoo::Arch;
use lanes_adaptor::{validate, Client, ClientOptions, GraphLimits, SessionSpec, Tensor};

const MODELS: usize = 3;

fn arch() -> Arch {
    Arch::Mlp {
        inputs: 64,
        hidden: vec![256, 128],
        classes: 10,
    }
}

fn client(endpoint: &str) -> Client {
    Client::connect_with(
        endpoint,
        ClientOptions {
            timeout: Duration::from_secs(60),
            name: "residency_e2e".into(),
            ..ClientOptions::default()
        },
    )
    .unwrap()
}

fn input(seed: u64) -> Tensor {
    Tensor::from_f32([2, 64], util::values(seed, 128)).unwrap()
}

#[test]
fn more_models_than_memory_answer_correctly_through_evictions() {
    more_models_than_memory(false);
}

/// The same with `--reserve`: on the GPU every model's memory is carved
/// from one device reservation taken at start-up (on the CPU the flag
/// changes nothing).
#[test]
fn the_same_inside_one_device_reservation() {
    more_models_than_memory(true);
}

fn more_models_than_memory(reserve: bool) {
    // Three models of one size; memory for two (sum P + max T of two, plus
    // half a model of slack).
    let models: Vec<_> = (0..MODELS as u64)
        .map(|seed| arch().inference(2, seed).unwrap())
        .collect();
    let valid = validate(models[0].graph.clone(), &GraphLimits::default()).unwrap();
    // What the lanes count for one job on the test's device (on the GPU:
    // workspaces in T, whole granules).
    let (p, t) = lanes::server::admission_sizes(&util::device(), &valid, reserve).unwrap();
    let memory = 2 * p + t + p / 2 + 4096;
    assert!(3 * p + t > memory, "three models must not fit at once");
    let service = util::start_with(|c| {
        c.memory_bytes = Some(memory);
        c.reserve = reserve;
    });
    let ep = service.endpoint().to_string();

    // The reference output of each model for each input.
    let reference = |m: usize, seed: u64| -> Vec<f32> {
        let v = validate(models[m].graph.clone(), &GraphLimits::default()).unwrap();
        let mut prog = CpuProgram::new(v, models[m].vars.clone()).unwrap();
        let feeds = BTreeMap::from([(models[m].inputs[0].0.clone(), input(seed))]);
        prog.run(&feeds, std::slice::from_ref(&models[m].output))
            .unwrap()[0]
            .f32s()
            .unwrap()
            .to_vec()
    };

    let mut clients: Vec<Client> = (0..MODELS).map(|_| client(&ep)).collect();
    let mut ids = Vec::new();
    for (m, c) in clients.iter_mut().enumerate() {
        let id = match c
            .request(&Request::OpenSession(SessionSpec::inference(format!(
                "model-{m}"
            ))))
            .unwrap()
        {
            Reply::SessionOpened { session } => session,
            other => panic!("unexpected reply {other:?}"),
        };
        c.load_in(id, &models[m].graph, models[m].vars.clone())
            .unwrap();
        ids.push(id);
    }
    // Round robin with the same input per model: after the first round every
    // request finds its model evicted for the one before it. The first answer
    // matches the CPU reference (exactly on the CPU backend, within float
    // tolerance on the GPU); later ones are bit-identical to the first.
    let gpu = std::env::var("LANES_TEST_DEVICE").as_deref() == Ok("cuda");
    let mut first: Vec<Vec<u32>> = Vec::new();
    for round in 0..4u64 {
        for (m, c) in clients.iter_mut().enumerate() {
            let seed = m as u64;
            let out = c
                .run_in(
                    ids[m],
                    vec![(models[m].inputs[0].0.as_str(), input(seed))],
                    &[&models[m].output],
                )
                .unwrap();
            let got = out[0].f32s().unwrap();
            let bits: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
            if round == 0 {
                let want = reference(m, seed);
                if gpu {
                    for (g, w) in got.iter().zip(&want) {
                        assert!(
                            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                            "model {m}: {g} vs {w}"
                        );
                    }
                } else {
                    assert_eq!(got, &want[..], "model {m}");
                }
                first.push(bits);
            } else {
                assert_eq!(bits, first[m], "model {m}, round {round}");
            }
        }
    }
    let st = client(&ep).status().unwrap();
    let evictions: u64 = st.sessions.iter().map(|s| s.evictions).sum();
    let returns: u64 = st.sessions.iter().map(|s| s.returns).sum();
    assert!(evictions >= 4, "evictions {evictions}: {:?}", st.sessions);
    assert!(returns >= 4, "returns {returns}");
    assert!(
        st.sessions.iter().filter(|s| s.resident).count() <= 2,
        "at most two models fit: {:?}",
        st.sessions
    );
    let lanes = st.lanes.expect("lanes in status");
    assert!(lanes.contains("queue: empty"), "{lanes}");
}
