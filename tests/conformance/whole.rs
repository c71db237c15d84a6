//! Whole models (inference, a training step, imported ONNX fixtures) and
//! a CUDA program's own behaviour: graph replay, bad requests, re-planning.

use super::*;

fn model_case(name: &str, built: models::Built, seed: u64) -> Case {
    let mut c = Case::new(name);
    c.feeds = model_feeds(&built, seed);
    c.fetches.push(built.output.clone());
    c.prebuilt = Some((built.graph, built.vars));
    c.opts = CudaOptions::default();
    c.tol = TF32;
    c.runs = 2;
    c
}

#[test]
#[ignore = "needs a GPU"]
fn models_inference() {
    let small_bert = small_bert();
    let cases = vec![
        model_case(
            "resnet50 b2 64x64",
            models::resnet(&[3, 4, 6, 3], 2, 64).unwrap(),
            1,
        ),
        model_case(
            "inception_v3 b1 96x96",
            models::inception_v3(1, 96).unwrap(),
            2,
        ),
        model_case(
            "bert small b2 s16",
            models::bert(2, 16, &small_bert).unwrap(),
            3,
        ),
    ];
    run_all(cases);
}

/// A small ResNet's training graph (batch-norm batch statistics, SGD with
/// momentum and weight decay) and feeds for it.
pub(crate) fn small_training() -> (lanes_adaptor::TrainingGraph, BTreeMap<String, Tensor>) {
    use lanes_adaptor::{Arch, DType, Optimizer};
    let (t, inputs) = Arch::ResNet18Cifar { classes: 10 }
        .training(4, 5, &Optimizer::sgd_momentum(0.01, 0.9, 1e-4))
        .unwrap();
    let mut rng = StdRng::seed_from_u64(11);
    let feeds = inputs
        .iter()
        .map(|(n, ty)| {
            let v = match ty.dtype {
                DType::F32 => rnd(&mut rng, ty.shape.dims(), -1.0, 1.0),
                DType::I64 => ints(&mut rng, ty.shape.dims(), 10),
                DType::F16 | DType::BF16 => unreachable!("the models take f32 and i64 inputs"),
            };
            (n.clone(), v)
        })
        .collect();
    (t, feeds)
}

/// A training step of a small ResNet on both backends, FP32 convolutions:
/// the loss, the parameters and running statistics after it within
/// `ACCUM`, the momentum buffers (the gradients) within `TRAIN_VARS`, with
/// cuDNN's batch norm and with ours. One step: after a second the
/// parameters have moved apart by the gradients' differences, and those
/// grow (see `TRAIN_VARS`).
#[test]
#[ignore = "needs a GPU"]
fn models_training() {
    let mut cases = Vec::new();
    for cudnn in [true, false] {
        let (t, feeds) = small_training();
        let mut c = Case::new(&format!("resnet18-cifar b4 step, cuDNN BN {cudnn}"));
        c.feeds = feeds;
        c.fetches.push(t.loss.clone());
        c.prebuilt = Some((t.graph, t.vars));
        c.opts.cudnn_batch_norm = cudnn;
        c.tol = ACCUM;
        c.opt_state_tol = Some(TRAIN_VARS);
        cases.push(c);
    }
    run_all(cases);
}

/// Which batch norms cuDNN takes, and cuDNN's against ours in the same
/// training step on the GPU (FP32 convolutions): the loss within `FP32`, the
/// other variables as in [`models_training`].
#[test]
#[ignore = "needs a GPU"]
fn cudnn_batch_norm_matches_ours_in_training() {
    let (t, feeds) = small_training();
    let limits = large_limits();
    let vg = validate(t.graph, &limits).unwrap();
    let fetch = vec![t.loss.clone()];
    let mut results = Vec::new();
    for cudnn in [true, false] {
        let opts = CudaOptions {
            cudnn_batch_norm: cudnn,
            conv_tf32: false,
            ..CudaOptions::default()
        };
        let mut p = CudaProgram::with_options(vg.clone(), t.vars.clone(), opts).unwrap();
        // ResNet-18: 20 batch norms (their gradients run on our kernels).
        let expected = if cudnn { 20 } else { 0 };
        assert_eq!(p.cudnn_batch_norms(), expected, "cuDNN {cudnn}");
        let loss = p.run(&feeds, &fetch).unwrap().remove(0);
        results.push((loss, p.read_variables(&[]).unwrap()));
    }
    let (a, b) = (&results[0], &results[1]);
    let mut worst = compare("loss", &a.0, &b.0, FP32).unwrap();
    assert_eq!(a.1.len(), b.1.len());
    for (name, x) in &a.1 {
        let tol = var_tol(name, ACCUM, Some(TRAIN_VARS));
        worst = worst.max(compare(name, x, &b.1[name], tol).unwrap());
    }
    println!("cuDNN batch norm vs ours, one step: worst {worst:.3} of tolerance");

    // A job that urgent lanes may outrank keeps to our kernels.
    for (yields, expected) in [(true, 0), (false, 20)] {
        let share = GpuShare {
            urgency: 0,
            yields,
            gate: None,
        };
        match Program::sharing(Backend::Cuda, vg.clone(), t.vars.clone(), share).unwrap() {
            Program::Cuda(p) => assert_eq!(p.cudnn_batch_norms(), expected, "yields {yields}"),
            Program::Cpu(_) => panic!("a CPU program for the CUDA backend"),
        }
    }

    // Below cuDNN's smallest eps our kernels run.
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", lanes_adaptor::TensorType::f32([2, 3, 4, 4]));
    for eps in [1e-5, 1e-6] {
        let mut v = |n: &str| g.variable(&format!("{n}{eps}"), Tensor::full([3], 1.0));
        let ins = [x, v("g"), v("b"), v("rm"), v("rv")];
        let outs = g.op(Op::BatchNormTrain { eps, momentum: 0.1 }, &ins);
        g.set_name(outs[0], &format!("y{eps}"));
    }
    let (graph, vars) = g.finish().unwrap();
    let p = CudaProgram::new(validate(graph, &limits).unwrap(), vars).unwrap();
    assert_eq!(p.cudnn_batch_norms(), 1);
}

/// Replaying the recorded CUDA graph gives the same results as launching op
/// by op (no CPU needed). Within 1e-6: only atomics may reorder sums.
#[test]
#[ignore = "needs a GPU"]
fn graph_replay_matches_op_by_op() {
    let small_bert = small_bert();
    for built in [
        models::resnet(&[3, 4, 6, 3], 2, 64).unwrap(),
        models::bert(2, 16, &small_bert).unwrap(),
    ] {
        let feeds = model_feeds(&built, 9);
        let limits = large_limits();
        let vg = validate(built.graph, &limits).unwrap();
        let fetch = vec![built.output.clone()];
        let mut outs = Vec::new();
        for cuda_graph in [true, false] {
            let opts = CudaOptions {
                cuda_graph,
                ..CudaOptions::default()
            };
            let mut p = CudaProgram::with_options(vg.clone(), built.vars.clone(), opts).unwrap();
            // The first iteration warms up, the second is profiled op by
            // op (for switching), the third is recorded and replayed.
            let first = p.run(&feeds, &fetch).unwrap();
            let second = p.run(&feeds, &fetch).unwrap();
            let third = p.run(&feeds, &fetch).unwrap();
            assert_eq!(p.uses_cuda_graph(), cuda_graph);
            assert_eq!(first, second, "repeated runs differ (graph {cuda_graph})");
            assert_eq!(first, third, "repeated runs differ (graph {cuda_graph})");
            outs.push(first);
        }
        let w = compare(
            "graph vs op by op",
            &outs[1][0],
            &outs[0][0],
            Tol {
                rtol: 1e-6,
                atol: 1e-6,
            },
        )
        .unwrap();
        println!("graph replay vs op by op: worst {w:.3} of tolerance");
        assert!(outs[0][0].f32s().unwrap().iter().all(|v| v.is_finite()));
    }
}

/// On the GPU machine the probe finds the device and never panics.
#[test]
#[ignore = "needs a GPU"]
fn probe_finds_the_gpu() {
    let info = lanes::exec::cuda::probe().unwrap();
    println!("probe: {} with {} bytes", info.name, info.total_memory);
    assert!(info.total_memory > 0);
    assert!(!info.name.is_empty());
}

/// Errors are typed, never panics: bad feeds and fetches on a CUDA program.
#[test]
#[ignore = "needs a GPU"]
fn cuda_program_rejects_bad_requests() {
    use lanes::exec::ExecError;
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", lanes_adaptor::TensorType::f32([2, 3]));
    let w = g.variable("w", Tensor::full([3, 4], 0.5));
    let y = g.matmul(x, w);
    g.set_name(y, "y");
    let (graph, vars) = g.finish().unwrap();
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    assert!(matches!(
        CudaProgram::new(vg.clone(), VarValues::new()),
        Err(ExecError::MissingVariable { .. })
    ));
    let mut p = CudaProgram::new(vg, vars).unwrap();
    let good: BTreeMap<String, Tensor> = [("x".to_string(), Tensor::full([2, 3], 1.0))].into();
    let out = p.run(&good, &["y".into()]).unwrap();
    assert_eq!(out[0].f32s().unwrap(), &[1.5f32; 8][..]);
    assert!(matches!(
        p.run(&BTreeMap::<String, Tensor>::new(), &["y".into()]),
        Err(ExecError::MissingFeed { .. })
    ));
    let wrong: BTreeMap<String, Tensor> = [("x".to_string(), Tensor::full([3, 3], 1.0))].into();
    assert!(matches!(
        p.run(&wrong, &["y".into()]),
        Err(ExecError::FeedType { .. })
    ));
    assert!(matches!(
        p.run(&good, &["nope".into()]),
        Err(ExecError::UnknownFetch { .. })
    ));
    let vars = p.read_variables(&[]).unwrap();
    assert_eq!(vars["w"], Tensor::full([3, 4], 0.5));
    p.write_variables([("w".to_string(), Tensor::full([3, 4], 1.0))].into())
        .unwrap();
    let out = p.run(&good, &["y".into()]).unwrap();
    assert_eq!(out[0].f32s().unwrap(), &[3.0f32; 8][..]);
    assert!(matches!(
        p.write_variables([("w".to_string(), Tensor::full([4], 1.0))].into()),
        Err(ExecError::VariableType { .. })
    ));
}

/// A Run that fetches an output the memory plan lets die early (not a
/// sink) re-plans the arena: results still match the CPU, before and after
/// the iteration was recorded as a CUDA graph, and across an eviction.
#[test]
#[ignore = "needs a GPU"]
fn fetching_an_intermediate_replans() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", lanes_adaptor::TensorType::f32([64, 256]));
    let w1 = g.variable("w1", rnd(&mut rng, &[256, 512], -0.1, 0.1));
    let w2 = g.variable("w2", rnd(&mut rng, &[512, 2048], -0.1, 0.1));
    let h = g.matmul(x, w1);
    let h = g.relu(h);
    g.set_name(h, "h");
    // After h dies (sinks only), z0 and z1 (512 KiB each) are the peak;
    // keeping h to the end adds its 128 KiB to it.
    let z = g.matmul(h, w2);
    let z = g.tanh(z);
    let z = g.sum(z, &[1], false);
    g.set_name(z, "z");
    let (graph, vars) = g.finish().unwrap();
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    let mut cpu = CpuProgram::new(vg.clone(), vars.clone()).unwrap();
    let mut gpu = CudaProgram::new(vg, vars).unwrap();
    let before = gpu.arena_parts();
    let feeds: BTreeMap<String, Tensor> =
        [("x".to_string(), rnd(&mut rng, &[64, 256], -1.0, 1.0))].into();
    let sets: [&[&str]; 9] = [
        &["z"],
        &["z"],
        &["z"],
        &["z"],
        &["h", "z"],
        &["h", "z"],
        &["h", "z"],
        &["h"],
        &["z", "h"],
    ];
    for (k, set) in sets.iter().enumerate() {
        let fetches: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        if k == 6 {
            gpu.evict().unwrap();
        }
        let a = cpu.run(&feeds, &fetches).unwrap();
        let b = gpu.run(&feeds, &fetches).unwrap();
        for (j, (x, y)) in a.iter().zip(&b).enumerate() {
            compare(&format!("run {k} fetch {}", fetches[j]), x, y, ACCUM).unwrap();
        }
    }
    let after = gpu.arena_parts();
    // Keeping h to the end costs its bytes: T grows by at least 64·512·4.
    assert!(
        after.ephemeral >= before.ephemeral + 64 * 512 * 4,
        "{before:?} -> {after:?}"
    );
}

/// The ops added for imported models, and the ONNX fixtures (PyTorch
/// exports in `tests/data/onnx`) imported at batch 2.
#[test]
#[ignore = "needs a GPU"]
fn imported_model_ops_and_onnx_fixtures() {
    let mut rng = StdRng::seed_from_u64(11);
    let mask = |rng: &mut StdRng, dims: &[usize]| {
        let n: usize = dims.iter().product();
        Tensor::from_f32(
            dims.to_vec(),
            (0..n)
                .map(|_| f32::from(u8::from(rng.gen_bool(0.5))))
                .collect(),
        )
        .unwrap()
    };
    let mut cases = vec![
        unary("erf", Op::Erf, -3.0, 3.0),
        unary("is_nan", Op::IsNan, -3.0, 3.0),
        unary("hard_sigmoid", Op::HardSigmoid, -5.0, 5.0),
        unary("hard_swish", Op::HardSwish, -5.0, 5.0),
        unary(
            "clip",
            Op::Clip {
                min: -0.5,
                max: 0.7,
            },
            -2.0,
            2.0,
        ),
        single(
            "where bcast",
            Op::Where,
            vec![
                mask(&mut rng, &[4, 1, 6]),
                rnd(&mut rng, &[4, 5, 6], -1.0, 1.0),
                rnd(&mut rng, &[6], -1.0, 1.0),
            ],
            FP32,
        ),
        single(
            "cast f32 to i64",
            Op::Cast {
                to: lanes_adaptor::DType::I64,
            },
            vec![rnd(&mut rng, &[3, 7], -50.0, 50.0)],
            FP32,
        ),
        single(
            "cast i64 to f32",
            Op::Cast {
                to: lanes_adaptor::DType::F32,
            },
            vec![ints(&mut rng, &[3, 7], 1000)],
            FP32,
        ),
    ];
    // Cargo's path, or the repository-relative one where the test binary
    // was copied to another machine (the GPU machine runs it from the repo
    // root), as tests/digits.rs.
    let built = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/onnx");
    let dir = if built.exists() {
        built
    } else {
        std::path::PathBuf::from("tests/data/onnx")
    };
    for (model, ins) in [
        ("resnet18", &["input"][..]),
        ("resnet50", &["input"]),
        ("inception_v3", &["input"]),
        ("mobilenet_v2", &["input"]),
        ("vgg16", &["input"]),
        ("densenet121", &["input"]),
        ("bert", &["input_ids", "attention_mask"]),
    ] {
        let opts = lanes_adaptor::onnx::ImportOptions {
            batch: 2,
            ..Default::default()
        };
        let m = lanes_adaptor::onnx::import_file(dir.join(format!("{model}.onnx")), &opts).unwrap();
        let mut c = Case::new(&format!("onnx {model}"));
        for name in ins {
            let t = lanes::npy::read(dir.join(format!("{model}.{name}.npy"))).unwrap();
            c.feeds.insert(name.to_string(), t);
        }
        c.fetches = m.outputs.iter().map(|(n, _)| n.clone()).collect();
        c.prebuilt = Some((m.graph, m.vars));
        cases.push(c.tol(ACCUM));
    }
    run_all(cases);
}
