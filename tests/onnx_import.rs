//! ONNX import: the PyTorch-exported fixtures in `tests/data/onnx` (tiny
//! randomly initialised resnet18/50, inception_v3, mobilenet_v2, vgg16,
//! densenet121 and a 2-layer BERT with an attention mask; written by
//! `scripts/onnx_fixtures.py`) import, run on the CPU backend at batch 2 and
//! match PyTorch's outputs saved beside them; hand-built models
//! (`scripts/onnx_op_fixtures.py`) match onnxruntime; broken files are typed
//! errors; `lanes import` prints P and T and checks references.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use lanes::exec::cpu::CpuProgram;
use lanes::npy;
use lanes_adaptor::onnx::{import, import_file, ImportOptions, OnnxError};
use lanes_adaptor::{validate, GraphLimits};

/// Tolerance against PyTorch's outputs (numpy `allclose` form).
const RTOL: f64 = 1e-4;
const ATOL: f64 = 1e-5;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/onnx")
}

fn manifest() -> serde_json::Value {
    let text = std::fs::read_to_string(dir().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn names(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// Imports `model` at batch 2, runs it on the CPU backend on the saved
/// inputs and compares every output with PyTorch's.
fn check(model: &str) {
    let m = manifest();
    let opts = ImportOptions {
        batch: 2,
        ..ImportOptions::default()
    };
    let imported = import_file(dir().join(format!("{model}.onnx")), &opts)
        .unwrap_or_else(|e| panic!("{model}: {e}"));
    assert!(
        !imported.vars.is_empty(),
        "{model}: initializers become variables"
    );
    let inputs: Vec<String> = imported.inputs.iter().map(|(n, _)| n.clone()).collect();
    let outputs: Vec<String> = imported.outputs.iter().map(|(n, _)| n.clone()).collect();
    // The PyTorch fixtures' manifest names their inputs and outputs.
    if let Some(entry) = m["models"].get(model) {
        assert_eq!(inputs, names(&entry["inputs"]));
        assert_eq!(outputs, names(&entry["outputs"]));
    }
    let vg = validate(imported.graph, &GraphLimits::default()).unwrap();
    let mut p = CpuProgram::new(vg, imported.vars).unwrap();
    let mut feeds = BTreeMap::new();
    for name in &inputs {
        let t = npy::read(dir().join(format!("{model}.{name}.npy"))).unwrap();
        feeds.insert(name.clone(), t);
    }
    let got = p.run(&feeds, &outputs).unwrap();
    for (name, g) in outputs.iter().zip(&got) {
        let want = npy::read(dir().join(format!("{model}.{name}.npy"))).unwrap();
        let a = npy::compare(g, &want, RTOL, ATOL).unwrap();
        assert!(
            a.ok(),
            "{model}.{name}: {} of {} elements outside rtol {RTOL} / atol {ATOL} (max abs {:e}, max rel {:e})",
            a.outside,
            a.elements,
            a.max_abs,
            a.max_rel
        );
    }
}

#[test]
fn resnet18_matches_pytorch() {
    check("resnet18");
}

#[test]
fn resnet50_matches_pytorch() {
    check("resnet50");
}

#[test]
fn inception_v3_matches_pytorch() {
    check("inception_v3");
}

#[test]
fn mobilenet_v2_matches_pytorch() {
    check("mobilenet_v2");
}

#[test]
fn vgg16_matches_pytorch() {
    check("vgg16");
}

#[test]
fn densenet121_matches_pytorch() {
    check("densenet121");
}

#[test]
fn bert_with_attention_mask_matches_pytorch() {
    check("bert");
}

/// Hand-built models (`scripts/onnx_op_fixtures.py`, references from
/// onnxruntime): decomposed LayerNorm and Erf GELU, Gather on inner axes
/// with index arrays, Softmax on a middle axis, ReduceSum with axes as an
/// input, a 1-D MatMul operand.
#[test]
fn decomposed_layernorm_gelu_and_inner_gathers_match_onnxruntime() {
    check("ops_layernorm");
}

/// Depthwise Conv with auto_pad SAME_UPPER, AveragePool counting padding,
/// MaxPool in ceil mode where it fits, Clip, Gemm with alpha and beta.
#[test]
fn depthwise_same_conv_pools_clip_and_gemm_match_onnxruntime() {
    check("ops_conv");
}

#[test]
fn unsupported_op_names_the_op_and_the_node() {
    let e = import_file(dir().join("unsupported_op.onnx"), &ImportOptions::default()).unwrap_err();
    match &e {
        OnnxError::Unsupported { node, op, .. } => {
            assert_eq!(node, "the_hardmax");
            assert_eq!(op, "Hardmax");
        }
        other => panic!("expected Unsupported, got {other}"),
    }
    assert_eq!(e.kind(), "unsupported");
}

#[test]
fn truncated_and_garbage_files_are_typed_errors() {
    let bytes = std::fs::read(dir().join("resnet18.onnx")).unwrap();
    let opts = ImportOptions::default();
    for cut in [1, 17, bytes.len() / 3, bytes.len() / 2, bytes.len() - 1] {
        let e = import(&bytes[..cut], &opts).unwrap_err();
        assert!(
            matches!(e, OnnxError::Decode(_) | OnnxError::Malformed(_)),
            "cut at {cut}: {e}"
        );
    }
    let e = import(b"this is not a protobuf message at all", &opts).unwrap_err();
    assert!(
        matches!(e, OnnxError::Decode(_) | OnnxError::Malformed(_)),
        "{e}"
    );
    let e = import_file(dir().join("no-such-file.onnx"), &opts).unwrap_err();
    assert_eq!(e.kind(), "io");
}

#[test]
fn a_symbolic_batch_follows_the_option() {
    for batch in [1, 5] {
        let opts = ImportOptions {
            batch,
            ..ImportOptions::default()
        };
        let m = import_file(dir().join("bert.onnx"), &opts).unwrap();
        assert_eq!(m.inputs[0].1.shape.dims(), &[batch, 16]);
        assert_eq!(m.outputs[0].1.shape.dims(), &[batch, 16, 32]);
        assert_eq!(m.outputs[1].1.shape.dims(), &[batch, 32]);
        assert!(m.folded > 100, "shape arithmetic is folded: {}", m.folded);
    }
}

/// The `lanes` binary: `LANES_BIN` when set (a GPU host runs a copied
/// binary), else the one cargo built.
fn lanes(args: &[&str]) -> std::process::Output {
    let bin = std::env::var_os("LANES_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_lanes").into());
    std::process::Command::new(bin).args(args).output().unwrap()
}

/// `lanes import --check` prints the summary with the memory planner's
/// exact P and T, runs the model and reports agreement.
#[test]
fn cli_import_prints_p_and_t_and_checks_references() {
    let d = dir();
    let model = d.join("resnet18.onnx");
    let out = lanes(&[
        "import",
        model.to_str().unwrap(),
        "--batch",
        "2",
        "--check",
        d.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("input  f32[2, 3, 32, 32]"), "{stdout}");
    assert!(stdout.contains("conv2d 6"), "{stdout}");
    assert!(stdout.contains("output: ok"), "{stdout}");
    // P and T are the planner's, for the graph fetching the outputs.
    let opts = ImportOptions {
        batch: 2,
        ..ImportOptions::default()
    };
    let m = import_file(&model, &opts).unwrap();
    let vg = validate(m.graph, &GraphLimits::default()).unwrap();
    let plan = lanes::compile::plan_with_fetches(&vg, &["output"], Default::default()).unwrap();
    let line = format!(
        "memory at batch 2: P = {} B, T = {} B",
        plan.persistent, plan.ephemeral
    );
    assert!(stdout.contains(&line), "{line} not in {stdout}");
    assert!(plan.persistent >= 4 * m.vars.values().map(|t| t.numel() as u64).sum::<u64>());
}

#[test]
fn cli_import_with_named_feeds_and_a_mismatch() {
    let d = dir();
    let f = |n: &str| d.join(n).to_str().unwrap().to_string();
    let ok = lanes(&[
        "import",
        &f("bert.onnx"),
        "--batch",
        "2",
        "--input",
        &format!("input_ids={}", f("bert.input_ids.npy")),
        "--input",
        &format!("attention_mask={}", f("bert.attention_mask.npy")),
        "--expect",
        &format!("pooler_output={}", f("bert.pooler_output.npy")),
    ]);
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(stdout.contains("pooler_output: ok"), "{stdout}");
    // resnet18's input against resnet50's output: reported, exit status 1.
    let bad = lanes(&[
        "import",
        &f("resnet18.onnx"),
        "--batch",
        "2",
        "--input",
        &format!("input={}", f("resnet18.input.npy")),
        "--expect",
        &format!("output={}", f("resnet50.output.npy")),
    ]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stdout).contains("MISMATCH"));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("differ from the reference"));
}

#[test]
fn cli_import_of_an_unsupported_model_names_op_and_node() {
    let out = lanes(&[
        "import",
        dir().join("unsupported_op.onnx").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Hardmax") && err.contains("the_hardmax"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// `--device` picks where the check runs (the GPU with
/// `LANES_TEST_DEVICE=cuda`, else the CPU) and `--time N` prints a median
/// of N runs after the check passed.
#[test]
fn cli_import_checks_on_the_chosen_device_and_times() {
    let d = dir();
    let model = d.join("mobilenet_v2.onnx");
    let device = match std::env::var("LANES_TEST_DEVICE").as_deref() {
        Ok("cuda") => "cuda",
        _ => "cpu",
    };
    let mut args = vec![
        "import",
        model.to_str().unwrap(),
        "--batch",
        "2",
        "--check",
        d.to_str().unwrap(),
        "--device",
        device,
        "--time",
        "4",
    ];
    if device == "cuda" {
        args.push("--op-profile");
    }
    let out = lanes(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(&format!("check on {device}")), "{stdout}");
    assert!(stdout.contains("output: ok"), "{stdout}");
    assert!(
        stdout.contains(&format!("time on {device}")) && stdout.contains("over 4 runs"),
        "{stdout}"
    );
    if device == "cuda" {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("op profile on cuda") && stderr.contains("conv2d"),
            "{stderr}"
        );
    }
}

/// `--op-profile` times kernels: asked for on the CPU it is refused before
/// anything runs, with what to give instead.
#[test]
fn cli_import_op_profile_needs_the_gpu() {
    let d = dir();
    let out = lanes(&[
        "import",
        d.join("mobilenet_v2.onnx").to_str().unwrap(),
        "--batch",
        "2",
        "--check",
        d.to_str().unwrap(),
        "--device",
        "cpu",
        "--op-profile",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--device cuda"), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("check on"));
}
