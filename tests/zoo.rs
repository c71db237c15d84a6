//! The model zoo: parameter counts equal to the reference implementations,
//! training graphs that validate, an inference pass of each model on the CPU
//! backend at batch 1, and a checkpoint that round-trips through a fresh
//! program with identical outputs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use lanes::exec::cpu::CpuProgram;
use lanes::server::{self, ServerConfig};
use lanes_adaptor::checkpoint;
use lanes_adaptor::zoo::Arch;
use lanes_adaptor::{validate, Client, GraphLimits, Optimizer, SessionSpec, Tensor};
use util::feeds_for;

fn transformer() -> Arch {
    Arch::Transformer {
        vocab: 50,
        seq: 8,
        dim: 16,
        heads: 2,
        ff: 32,
        classes: 4,
    }
}

fn small_models() -> Vec<(Arch, usize)> {
    vec![
        (
            Arch::Mlp {
                inputs: 64,
                hidden: vec![64],
                classes: 10,
            },
            4_810,
        ),
        (
            Arch::LeNet {
                channels: 1,
                image: 28,
                classes: 10,
            },
            61_706, // the classic LeNet-5 count
        ),
        (
            Arch::LeNet {
                channels: 1,
                image: 8,
                classes: 10,
            },
            21_386,
        ),
        (Arch::ResNet18Cifar { classes: 10 }, 11_173_962),
        (transformer(), 5_444),
    ]
}

#[test]
fn small_model_param_counts() {
    for (arch, count) in small_models() {
        assert_eq!(arch.param_count().unwrap(), count, "{}", arch.name());
    }
}

/// The published counts (torchvision, Hugging Face). Builds each model with
/// its initial values, one at a time to bound memory.
#[test]
fn reference_param_counts() {
    for (arch, count) in [
        (Arch::ResNet50, 25_557_032),
        (Arch::ResNet152, 60_192_808),
        (Arch::InceptionV3, 27_161_264),
        (Arch::BertBase { seq: 8 }, 109_482_240),
    ] {
        assert_eq!(arch.param_count().unwrap(), count, "{}", arch.name());
    }
}

#[test]
fn training_graphs_validate() {
    for (arch, _) in small_models() {
        for opt in [
            Optimizer::sgd_momentum(0.1, 0.9, 1e-4),
            Optimizer::adamw(1e-3, 0.01),
        ] {
            let (t, inputs) = arch.training(2, 0, &opt).unwrap();
            assert!(!inputs.is_empty());
            let n_params = t.params.len();
            assert_eq!(
                t.state.len(),
                n_params
                    * if matches!(opt, Optimizer::Sgd { .. }) {
                        1
                    } else {
                        3
                    }
            );
            validate(t.graph, &GraphLimits::default())
                .unwrap_or_else(|e| panic!("{}: {e}", arch.name()));
        }
    }
}

/// Training graphs of the published models validate (gradients and SGD
/// updates for every parameter; the running statistics are not trained).
#[test]
fn published_training_graphs_validate() {
    for (arch, batch) in [(Arch::ResNet50, 2), (Arch::InceptionV3, 2)] {
        let (t, _) = arch
            .training(batch, 0, &Optimizer::sgd_momentum(0.1, 0.9, 1e-4))
            .unwrap();
        assert_eq!(t.param_count(), arch.param_count().unwrap());
        assert!(t.params.iter().all(|p| !p.contains("running_")));
        validate(t.graph, &GraphLimits::default())
            .unwrap_or_else(|e| panic!("{}: {e}", arch.name()));
    }
}

// Large: BERT-base and ResNet-152 with optimizer state take over a GB of
// initial values; run with `--ignored`.
#[test]
#[ignore]
fn large_training_graphs_validate() {
    for arch in [Arch::ResNet152, Arch::BertBase { seq: 16 }] {
        let (t, _) = arch.training(1, 0, &Optimizer::adamw(1e-4, 0.01)).unwrap();
        assert_eq!(t.param_count(), arch.param_count().unwrap());
        validate(t.graph, &GraphLimits::default())
            .unwrap_or_else(|e| panic!("{}: {e}", arch.name()));
    }
}

fn infer_once(arch: &Arch) -> Tensor {
    let m = arch.inference(1, 3).unwrap();
    let v = validate(m.graph, &GraphLimits::default()).unwrap();
    let mut p = CpuProgram::new(v, m.vars).unwrap();
    let feeds = feeds_for(&m.inputs, 11, 2);
    let out = p
        .run(&feeds, std::slice::from_ref(&m.output))
        .unwrap()
        .remove(0);
    assert!(
        out.f32s().unwrap().iter().all(|x| x.is_finite()),
        "{}",
        arch.name()
    );
    out
}

#[test]
fn small_models_infer_at_batch_1() {
    for (arch, _) in small_models() {
        let out = infer_once(&arch);
        assert_eq!(out.shape().dims()[0], 1);
    }
}

// The published models are slow on the CPU reference backend in the dev
// profile (billions of multiply-adds each); run with `--ignored`.
#[test]
#[ignore]
fn resnet50_infers_at_batch_1() {
    assert_eq!(infer_once(&Arch::ResNet50).shape().dims(), &[1, 1000]);
}

#[test]
#[ignore]
fn resnet152_infers_at_batch_1() {
    assert_eq!(infer_once(&Arch::ResNet152).shape().dims(), &[1, 1000]);
}

#[test]
#[ignore]
fn inception_v3_infers_at_batch_1() {
    assert_eq!(infer_once(&Arch::InceptionV3).shape().dims(), &[1, 1000]);
}

#[test]
#[ignore]
fn bert_base_infers_at_batch_1() {
    assert_eq!(
        infer_once(&Arch::BertBase { seq: 16 }).shape().dims(),
        &[1, 768]
    );
}

/// Through the service: train a few steps in a session, read the variables
/// back (ReadVariables), save them to a safetensors file, load the file into
/// a fresh inference session, and compare with a second inference session
/// whose variables were overwritten in place (WriteVariables): identical
/// outputs, and different from an untrained model's.
#[test]
fn checkpoint_round_trip_gives_identical_outputs() {
    let arch = Arch::LeNet {
        channels: 1,
        image: 8,
        classes: 10,
    };
    let service = server::start(ServerConfig {
        endpoint: "tcp://127.0.0.1:*".into(),
        workers: 2,
        ..ServerConfig::default()
    })
    .unwrap();
    let mut client = Client::connect(service.endpoint()).unwrap();

    let (t, inputs) = arch.training(4, 5, &Optimizer::adam(1e-2)).unwrap();
    let mut train = client
        .open_session(SessionSpec::training("lenet-train"))
        .unwrap();
    train.load(&t.graph, t.vars).unwrap();
    for i in 0..3 {
        let feeds: Vec<(String, Tensor)> = feeds_for(&inputs, i, 2).into_iter().collect();
        train.run(feeds, &[t.loss.as_str()]).unwrap();
    }
    let trained = train.read_variables(&[]).unwrap();
    train.close().unwrap();
    let dir = std::env::temp_dir().join(format!("lanes-zoo-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("lenet.safetensors");
    checkpoint::save(&path, &trained).unwrap();

    // A different seed: the values must come from the checkpoint.
    let m = arch.inference(2, 99).unwrap();
    let x: Vec<(String, Tensor)> = feeds_for(&m.inputs, 77, 2).into_iter().collect();
    let out = [m.output.as_str()];

    let mut fresh = client
        .open_session(SessionSpec::inference("fresh"))
        .unwrap();
    fresh.load(&m.graph, m.vars.clone()).unwrap();
    let y_fresh = fresh.run(x.clone(), &out).unwrap();

    let mut client2 = Client::connect(service.endpoint()).unwrap();
    let mut from_file = client2
        .open_session(SessionSpec::inference("from-file"))
        .unwrap();
    from_file
        .load(&m.graph, checkpoint::load_for(&path, &m.graph).unwrap())
        .unwrap();
    let y_file = from_file.run(x.clone(), &out).unwrap();

    fresh
        .write_variables(checkpoint::select_for(&mut trained.clone(), &m.graph).unwrap())
        .unwrap();
    let y_written = fresh.run(x, &out).unwrap();
    assert_eq!(y_file, y_written);
    assert_ne!(y_file, y_fresh);
    fresh.close().unwrap();
    from_file.close().unwrap();
    drop((client, client2));
    service.shutdown().unwrap();
    std::fs::remove_dir_all(&dir).ok();
}
