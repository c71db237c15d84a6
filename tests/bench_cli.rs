//! `lanes bench` end to end on small settings: the `lanes` binary is run as
//! a user would, its stdout must be one JSON report, and both timed paths
//! (the executor alone and the embedded service) must have run the same
//! computation. CPU here; `LANES_TEST_DEVICE=cuda` runs the same cases on
//! the GPU machine (with `LANES_BIN` pointing at the staged binary).
//! Whole file: a few seconds on the 2-core development VM.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::process::Command;

use serde_json::Value;

fn device() -> &'static str {
    match std::env::var("LANES_TEST_DEVICE").as_deref() {
        Ok("cuda") => "cuda",
        _ => "cpu",
    }
}

/// Runs `lanes bench <args> --device <device>`; returns the parsed report
/// and stderr.
fn bench(args: &[&str]) -> (Value, String) {
    let out = Command::new(util::lanes_bin())
        .arg("bench")
        .args(args)
        .args(["--device", device()])
        .output()
        .expect("lanes runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "lanes bench {args:?} failed:\n{stderr}"
    );
    let stdout = String::from_utf8(out.stdout).expect("utf-8 stdout");
    assert_eq!(stdout.trim().lines().count(), 1, "one JSON line:\n{stdout}");
    let v: Value = serde_json::from_str(stdout.trim()).expect("stdout is JSON");
    (v, stderr)
}

fn ms(v: &Value, path: &str, key: &str) -> f64 {
    v[path][key]
        .as_f64()
        .unwrap_or_else(|| panic!("{path}.{key} is a number in {v}"))
}

/// Every statistic of a path is positive and ordered.
fn check_path(v: &Value, path: &str) {
    let (min, p10, med, p90, max) = (
        ms(v, path, "min_ms"),
        ms(v, path, "p10_ms"),
        ms(v, path, "median_ms"),
        ms(v, path, "p90_ms"),
        ms(v, path, "max_ms"),
    );
    assert!(min > 0.0, "{v}");
    assert!(min <= p10 && p10 <= med && med <= p90 && p90 <= max, "{v}");
    assert!(ms(v, path, "load_ms") >= 0.0);
}

fn close(a: f64, b: f64, rtol: f64) -> bool {
    (a - b).abs() <= rtol * a.abs().max(b.abs()).max(1e-6)
}

#[test]
fn train_on_both_paths_runs_the_same_steps() {
    for model in ["mlp", "resnet18_cifar"] {
        let (v, stderr) = bench(&[
            "train", "--model", model, "--batch", "2", "--iters", "2", "--warmup", "0",
        ]);
        assert_eq!(v["bench"], "train");
        assert_eq!(v["model"], model);
        assert_eq!(v["batch"], 2);
        assert_eq!(v["device"], device());
        assert_eq!(v["fetch"], "loss");
        assert_eq!(v["isolation"], "a process per path");
        assert_eq!(v["precision"]["dtype"], "f32");
        if device() == "cuda" {
            // PyTorch's defaults, which benches/torch_ref.py sets.
            assert_eq!(v["precision"]["conv_tf32"], Value::Bool(true), "{v}");
            assert_eq!(v["precision"]["matmul_tf32"], Value::Bool(false), "{v}");
        }
        assert_eq!(v["optimizer"]["momentum"].as_f64(), Some(0.9));
        assert!(v["params"].as_u64().unwrap() > 0);
        check_path(&v, "executor");
        check_path(&v, "service");
        let ratio = v["service_over_executor"].as_f64().expect("a ratio");
        assert!(ratio > 0.0 && ratio.is_finite(), "{v}");
        assert!(
            close(
                ratio,
                ms(&v, "service", "median_ms") / ms(&v, "executor", "median_ms"),
                1e-9
            ),
            "{v}"
        );
        // Same initial variables and feeds on both paths, no warm-up: the
        // first timed step's loss is the loss at the initial weights, the
        // last one after one update. The GPU's reductions with atomics are
        // not bit-reproducible and training amplifies that from step to step
        // (run to run, even on one path), so after an update the GPU
        // tolerance is looser; seen on the H100: 2e-4 apart after one step,
        // identical at the initial weights.
        for (key, cuda_rtol) in [("loss_first", 1e-4), ("loss_last", 5e-3)] {
            let (e, s) = (ms(&v, "executor", key), ms(&v, "service", key));
            assert!(e.is_finite() && e >= 0.0, "{v}");
            let rtol = if device() == "cuda" { cuda_rtol } else { 1e-4 };
            assert!(close(e, s, rtol), "{key}: executor {e} service {s}");
        }
        assert_ne!(
            ms(&v, "executor", "loss_first"),
            ms(&v, "executor", "loss_last"),
            "the loss changes from step to step: {v}"
        );
        for phase in ["building", "warm-up", "service: loading"] {
            assert!(
                stderr.contains(phase),
                "progress `{phase}` on stderr:\n{stderr}"
            );
        }
    }
}

#[test]
fn infer_on_the_service_path_alone() {
    let (v, _) = bench(&[
        "infer", "--model", "lenet", "--batch", "2", "--iters", "3", "--warmup", "1", "--path",
        "service",
    ]);
    assert_eq!(v["bench"], "infer");
    assert_eq!(v["model"], "lenet");
    assert!(v["executor"].is_null(), "{v}");
    assert!(v["service_over_executor"].is_null(), "{v}");
    check_path(&v, "service");
    assert!(v["service"]["endpoint"]
        .as_str()
        .unwrap()
        .starts_with("tcp://127.0.0.1:"));
    assert!(v["service"]["output_checksum"]
        .as_f64()
        .unwrap()
        .is_finite());
}

/// `--precision` reaches the graph: a bf16-mixed training step and an
/// fp16-served model run, and the JSON says in which precision.
#[test]
fn precision_is_chosen_per_bench() {
    for (kind, precision, dtype) in [("train", "bf16-mixed", "bf16"), ("infer", "fp16", "f16")] {
        let (v, _) = bench(&[
            kind,
            "--model",
            "lenet",
            "--batch",
            "2",
            "--iters",
            "2",
            "--warmup",
            "0",
            "--path",
            "executor",
            "--precision",
            precision,
        ]);
        assert_eq!(v["precision"]["dtype"], dtype, "{v}");
        assert_eq!(v["precision"]["amp"], precision, "{v}");
        check_path(&v, "executor");
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lanes"))
        .args(["bench", "infer", "--model", "lenet", "--precision", "int8"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown precision"));
}

#[test]
fn infer_on_both_paths_gives_the_same_output() {
    let (v, _) = bench(&[
        "infer",
        "--model",
        "transformer",
        "--seq",
        "8",
        "--batch",
        "2",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--same-process",
    ]);
    assert_eq!(v["seq"], 8);
    assert_eq!(v["isolation"], "one process");
    check_path(&v, "executor");
    check_path(&v, "service");
    assert!(v["service_over_executor"].as_f64().unwrap() > 0.0);
    let (e, s) = (
        ms(&v, "executor", "output_checksum"),
        ms(&v, "service", "output_checksum"),
    );
    assert!(close(e, s, 1e-3), "executor {e} service {s}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let run = |args: &[&str]| {
        let out = Command::new(util::lanes_bin())
            .arg("bench")
            .args(args)
            .output()
            .expect("lanes runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = run(&["train", "--model", "vgg", "--device", "cpu", "--iters", "1"]);
    assert!(!ok);
    assert!(
        err.contains("unknown model `vgg`") && err.contains("resnet50"),
        "{err}"
    );
    let (ok, err) = run(&["infer", "--model", "mlp", "--device", "cpu", "--iters", "0"]);
    assert!(!ok);
    assert!(err.contains("--iters must be positive"), "{err}");
    let (ok, err) = run(&["infer", "--model", "mlp", "--path", "nowhere"]);
    assert!(!ok);
    assert!(err.contains("nowhere"), "{err}");
    // Without a GPU, `--device cuda` fails with the reason on both paths,
    // never a panic.
    if lanes::exec::cuda::probe().is_err() {
        for path in ["executor", "service"] {
            let (ok, err) = run(&[
                "train", "--model", "mlp", "--batch", "2", "--iters", "1", "--device", "cuda",
                "--path", path,
            ]);
            assert!(!ok, "{path}");
            assert!(!err.contains("panicked"), "{path}: {err}");
            assert!(
                err.to_lowercase().contains("gpu") || err.contains("libcuda"),
                "{path}: {err}"
            );
        }
    }
}

/// `bench switch`: every strategy switched the model back and its output was
/// bit-identical to the resident run; the plan's groups match the strategy.
#[test]
fn switch_reports_every_strategy_with_identical_outputs() {
    let (v, stderr) = bench(&["switch", "--model", "lenet", "--batch", "2", "--iters", "2"]);
    assert!(stderr.contains("switching with pipelined"), "{stderr}");
    assert_eq!(v["outputs_identical_to_resident"], Value::Bool(true), "{v}");
    let units = v["units"].as_u64().unwrap();
    assert!(units > 1, "{v}");
    for s in ["pipelined", "per_layer", "single"] {
        assert!(
            v["strategies"][s]["median_ms"].as_f64().unwrap() > 0.0,
            "{v}"
        );
    }
    assert_eq!(v["strategies"]["single"]["groups"].as_u64(), Some(1));
    assert_eq!(v["strategies"]["per_layer"]["groups"].as_u64(), Some(units));
    assert!(v["persistent_bytes"].as_u64().unwrap() > 0);
    let bound = v["lower_bound_ms"].as_f64().unwrap();
    assert!(bound > 0.0);
    // lenet b2's input: 2 × 1 × 28 × 28 f32.
    assert_eq!(v["feed_bytes"].as_u64(), Some(2 * 28 * 28 * 4), "{v}");
    // The link carries the feeds too: that bound is never the lower one.
    assert!(v["bound_with_feeds_ms"].as_f64().unwrap() >= bound, "{v}");
    assert!(
        v["pipelined_over_bound_with_feeds"].as_f64().unwrap() > 0.0,
        "{v}"
    );
}

/// `--reserve` maps the arenas from a device reservation's chunks, as the
/// service does: on the GPU the switches still match the resident run; on
/// the CPU, which has no reservation, it is refused.
#[test]
fn switch_inside_a_device_reservation() {
    let args = [
        "switch",
        "--model",
        "lenet",
        "--batch",
        "2",
        "--iters",
        "2",
        "--keep",
        "none",
        "--reserve",
        "1GiB",
    ];
    if device() == "cpu" {
        let out = Command::new(util::lanes_bin())
            .arg("bench")
            .args(args)
            .args(["--device", "cpu"])
            .output()
            .expect("lanes runs");
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("--reserve is for --device cuda"),
            "{stderr}"
        );
        return;
    }
    let (v, _) = bench(&args);
    assert_eq!(v["reserved_bytes"].as_u64(), Some(1 << 30), "{v}");
    assert_eq!(v["outputs_identical_to_resident"], Value::Bool(true), "{v}");
}

/// `bench switch --keep`: the partially evicted model (its first units
/// kept) switches back bit-identical too; the report says what was kept and
/// what was copied, and its ratios against both bounds. `--keep none`
/// leaves the row out.
#[test]
fn switch_with_a_kept_prefix_reports_it() {
    let keep = |k: &str| {
        bench(&[
            "switch", "--model", "lenet", "--batch", "2", "--iters", "2", "--keep", k,
        ])
        .0
    };
    let v = keep("1");
    assert_eq!(v["outputs_identical_to_resident"], Value::Bool(true), "{v}");
    let row = &v["strategies"]["pipelined_keep"];
    let p = v["persistent_bytes"].as_u64().unwrap();
    let kept = row["kept_persistent_bytes"].as_u64().unwrap();
    assert!(kept > 0, "{v}");
    assert_eq!(kept + row["copied_bytes"].as_u64().unwrap(), p, "{v}");
    assert!(row["kept_units"].as_u64().unwrap() >= 1, "{v}");
    assert!(row["kept_bytes"].as_u64().unwrap() >= kept, "{v}");
    assert!(row["kept_percent_of_p"].as_f64().unwrap() > 0.0, "{v}");
    assert!(row["median_ms"].as_f64().unwrap() > 0.0, "{v}");
    assert!(
        v["pipelined_keep_over_bound"].as_f64().unwrap() > 0.0,
        "{v}"
    );
    assert!(
        v["pipelined_keep_over_rest_bound"].as_f64().unwrap() > 0.0,
        "{v}"
    );
    // The default is auto: a row, whatever it kept.
    let v = bench(&["switch", "--model", "lenet", "--batch", "2", "--iters", "2"]).0;
    assert!(
        v["strategies"]["pipelined_keep"]["kept_bytes"].is_u64(),
        "{v}"
    );
    let v = keep("none");
    assert!(v["strategies"].get("pipelined_keep").is_none(), "{v}");
    assert!(v["pipelined_keep_over_bound"].is_null(), "{v}");
}

/// `bench switch --precision bf16`: the weights stored in bf16 switch back
/// with outputs bit-identical to the resident run under every strategy, as
/// in fp32, and the bytes a switch copies (P) are at most 0.55× fp32's.
#[test]
fn switch_at_bf16_copies_half_the_bytes() {
    let run = |precision: &str| {
        bench(&[
            "switch",
            "--model",
            "lenet",
            "--batch",
            "2",
            "--iters",
            "2",
            "--precision",
            precision,
        ])
        .0
    };
    let (f32_run, bf16_run) = (run("fp32"), run("bf16"));
    for v in [&f32_run, &bf16_run] {
        assert_eq!(v["outputs_identical_to_resident"], Value::Bool(true), "{v}");
        assert_eq!(v["strategies"]["single"]["groups"].as_u64(), Some(1), "{v}");
    }
    assert_eq!(bf16_run["precision"], "bf16", "{bf16_run}");
    assert_eq!(f32_run["precision"], "fp32", "{f32_run}");
    let p = |v: &Value| v["persistent_bytes"].as_u64().unwrap() as f64;
    let ratio = p(&bf16_run) / p(&f32_run);
    assert!(ratio <= 0.55 && ratio > 0.25, "P bf16 / fp32 = {ratio}");
    if device() == "cuda" {
        let copied = |v: &Value| v["first_evict_copied_bytes"].as_u64().unwrap() as f64;
        assert!(copied(&bf16_run) <= 0.55 * copied(&f32_run));
    }
}

/// `bench pack --precision bf16`: the memory sized for `--fit` fp32 models
/// holds about twice as many bf16 ones; the report says how many and the
/// service held more resident at once than in fp32.
#[test]
fn pack_at_bf16_fits_about_twice_the_models() {
    let run = |precision: &str| {
        bench(&[
            "pack",
            "--model",
            "mlp",
            "--batch",
            "2",
            "--models",
            "8",
            "--fit",
            "2",
            "--requests",
            "40",
            "--precision",
            precision,
        ])
        .0
    };
    let (f32_run, bf16_run) = (run("fp32"), run("bf16"));
    assert_eq!(bf16_run["precision"], "bf16", "{bf16_run}");
    assert_eq!(f32_run["fits"].as_u64(), Some(2), "{f32_run}");
    assert_eq!(
        f32_run["memory_bytes"], bf16_run["memory_bytes"],
        "one memory for both"
    );
    let p = |v: &Value| v["persistent_bytes"].as_u64().unwrap() as f64;
    assert!(p(&bf16_run) <= 0.55 * p(&f32_run), "{f32_run} {bf16_run}");
    assert_eq!(
        bf16_run["fp32_persistent_bytes"],
        f32_run["persistent_bytes"]
    );
    let fits = bf16_run["fits"].as_u64().unwrap();
    assert!(fits >= 3, "{bf16_run}");
    let resident = |v: &Value| v["max_resident"].as_u64().unwrap();
    assert!(resident(&f32_run) <= 2, "{f32_run}");
    assert!(
        resident(&bf16_run) > resident(&f32_run),
        "{f32_run} {bf16_run}"
    );
    assert!(resident(&bf16_run) <= fits, "{bf16_run}");
}

/// `bench pack`: three times more models than memory; every request is
/// answered, some found their model evicted, and the counts add up.
#[test]
fn pack_oversubscribed_models_report_misses() {
    let (v, _) = bench(&[
        "pack",
        "--model",
        "mlp",
        "--batch",
        "2",
        "--models",
        "6",
        "--fit",
        "2",
        "--requests",
        "40",
    ]);
    let requests = v["requests"].as_u64().unwrap();
    let hits = v["resident"]["count"].as_u64().unwrap();
    let misses = v["evicted"]["count"].as_u64().unwrap();
    assert_eq!(hits + misses, requests, "{v}");
    assert!(misses > 0 && hits > 0, "{v}");
    assert!(v["evictions"].as_u64().unwrap() >= misses, "{v}");
    assert!(v["p99_ms"].as_f64().unwrap() >= v["p50_ms"].as_f64().unwrap());
}

/// `bench pack` with more models than the old per-client session cap (64)
/// allowed: a hundred models over one connection, ten fitting at once
/// (issue 32: this stopped at model 64 with `Overloaded`).
#[test]
fn pack_a_hundred_models_from_one_client() {
    let (v, _) = bench(&[
        "pack",
        "--model",
        "mlp",
        "--batch",
        "2",
        "--models",
        "100",
        "--fit",
        "10",
        "--requests",
        "30",
    ]);
    assert_eq!(v["models"].as_u64(), Some(100), "{v}");
    let requests = v["requests"].as_u64().unwrap();
    let hits = v["resident"]["count"].as_u64().unwrap();
    let misses = v["evicted"]["count"].as_u64().unwrap();
    assert_eq!(hits + misses, requests, "{v}");
    assert!(v["evictions"].as_u64().unwrap() > 0, "{v}");
}

/// `bench load`: per-phase medians of uncached, cold and warm loads; only
/// the warm ones hit the load cache, and every phase is timed.
#[test]
fn load_breaks_a_load_down_by_phase() {
    let (v, _) = bench(&["load", "--model", "mlp", "--batch", "2", "--loads", "2"]);
    assert_eq!(v["bench"], "load");
    assert!(v["weights_bytes"].as_u64().unwrap() > 0, "{v}");
    for (kind, hits) in [("uncached", 0), ("cold", 0), ("warm", 2)] {
        assert_eq!(v[kind]["cache_hits"].as_u64(), Some(hits), "{kind}: {v}");
        for phase in [
            "decode",
            "validate",
            "variables",
            "plan",
            "admit",
            "build",
            "warm",
            "total",
        ] {
            let ms = v[kind][format!("{phase}_ms")].as_f64();
            assert!(ms.is_some_and(|m| m >= 0.0), "{kind}.{phase}: {v}");
        }
        assert!(v[kind]["total_ms"].as_f64().unwrap() > 0.0, "{v}");
    }
}

/// `bench lanes`: the three cases ran every iteration; two jobs are in one
/// lane when at most one lane may open and in two lanes otherwise; on the
/// GPU two jobs in one lane hold less device memory than in two lanes
/// (they share the lane's ephemeral block).
#[test]
fn lanes_places_jobs_and_reports_throughput() {
    let (v, _) = bench(&["lanes", "--model", "mlp", "--batch", "2", "--iters", "5"]);
    assert_eq!(v["bench"], "lanes");
    let cases = v["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 3, "{v}");
    for c in cases {
        assert!(c["iterations_per_s"].as_f64().unwrap() > 0.0, "{c}");
        let jobs = c["jobs"].as_u64().unwrap() as usize;
        assert_eq!(c["per_job_s"].as_array().unwrap().len(), jobs, "{c}");
    }
    let lanes_of = |k: usize| -> Vec<u64> {
        cases[k]["lanes_of_jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_u64().expect("every job admitted"))
            .collect()
    };
    let one = lanes_of(1);
    assert_eq!(one[0], one[1], "{v}");
    let two = lanes_of(2);
    assert_ne!(two[0], two[1], "{v}");
    if device() == "cuda" {
        let total = |k: usize| cases[k]["device_bytes"]["total"].as_u64().unwrap();
        assert!(total(1) < total(2), "{v}");
    }
}

/// `lanes bench doorbell`: a garbage ringer and a huge doorbell against a
/// real service; the service's own counts say what they cost it (16
/// garbage rings examined, then the ringer's doorbells closed; nothing
/// copied; the huge doorbell refused at its Run).
#[test]
fn doorbell_abuse_costs_the_service_counted_work_only() {
    // One JSON document (pretty-printed, as `bench soak` prints).
    let out = Command::new(util::lanes_bin())
        .args(["bench", "doorbell", "--runs", "20", "--device", "cpu"])
        .output()
        .expect("lanes runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "lanes bench doorbell failed:\n{stderr}"
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    for phase in ["garbage", "huge"] {
        let s = &v[phase]["service"];
        assert_eq!(s["copied_bytes"], 0, "{phase}: {v}\n{stderr}");
        assert_eq!(s["garbage_rings"], 16, "{phase}: {v}");
        assert_eq!(s["doorbells_closed"], 1, "{phase}: {v}");
        assert!(v[phase]["bystander"]["p50_ms"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(v["garbage"]["ringer_run_reply"], "RunDone", "{v}");
    let huge = v["huge"]["ringer_run_reply"].as_str().unwrap();
    assert!(huge.contains("max_doorbell_bytes"), "{huge}");
}

fn positive(v: &Value, what: &str) -> f64 {
    let x = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is a number: {v}"));
    assert!(x > 0.0 && x.is_finite(), "{what} = {x}");
    x
}

/// `bench colocate` with issue 31's protocol on tiny models: Poisson
/// arrivals at one load, two repetitions, two inference jobs beside one
/// training job. The shape of the report and that every number is
/// positive and finite; no timing asserts.
#[test]
fn colocate_runs_the_protocol_and_reports_each_repetition() {
    let (v, stderr) = bench(&[
        "colocate",
        "--train-model",
        "mlp",
        "--train-batch",
        "2",
        "--infer-model",
        "lenet",
        "--infer-batch",
        "2",
        "--requests",
        "20",
        "--warmup",
        "2",
        "--calibrate",
        "5",
        "--train-window",
        "0.2",
        "--arrivals",
        "poisson",
        "--load",
        "0.3",
        "--repeat",
        "2",
        "--inference-jobs",
        "2",
        "--slo-ms",
        "60000",
    ]);
    assert_eq!(v["bench"], "colocate");
    assert_eq!(v["system"], "lanes");
    assert_eq!(v["arrivals"], "poisson");
    assert_eq!(
        (v["requests"].as_u64(), v["repeat"].as_u64()),
        (Some(20), Some(2))
    );
    assert_eq!(v["inference"]["jobs"], 2);
    assert_eq!(v["training"]["jobs"], 1);
    for m in v["inference"]["alone_median_ms"].as_array().unwrap() {
        positive(m, "alone median");
    }
    positive(&v["arrival"]["open_to_first_reply_ms"], "arrival");
    // The service counted every timed request (and the calibration's and
    // warm-up's) against the inference sessions' objective.
    let slo = v["inference"]["slo"].as_array().unwrap();
    assert_eq!(slo.len(), 2, "{v}");
    for s in slo {
        assert_eq!(s["slo_ms"].as_f64(), Some(60_000.0), "{s}");
        let (runs, within) = (s["runs"].as_u64().unwrap(), s["within"].as_u64().unwrap());
        assert!(runs >= 2 * 2 * 20, "alone and beside, two repetitions: {s}");
        assert!(within <= runs, "{s}");
    }
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "one per repetition: {v}");
    for (rep, r) in runs.iter().enumerate() {
        assert_eq!(r["repetition"], rep);
        assert_eq!(r["load"].as_f64(), Some(0.3));
        let jobs = r["inference"].as_array().unwrap();
        assert_eq!(jobs.len(), 2);
        for j in jobs {
            positive(&j["interval_ms"], "interval");
            for side in ["alone", "beside_training"] {
                assert_eq!(j[side]["n"], 20, "{j}");
                let (p50, p99, max) = (
                    positive(&j[side]["p50_ms"], "p50"),
                    positive(&j[side]["p99_ms"], "p99"),
                    positive(&j[side]["max_ms"], "max"),
                );
                assert!(p50 <= p99 && p99 <= max, "{j}");
            }
            positive(&j["p99_beside_over_alone"], "p99 ratio");
            positive(&j["max_beside_over_alone"], "max ratio");
        }
        for k in ["alone_it_per_s", "beside_it_per_s", "kept"] {
            positive(&r["training"][k], k);
        }
        let g = &r["goals"];
        assert_eq!(g["p99_bound"].as_f64(), Some(1.10), "{g}");
        assert!(
            (g["kept_bound"].as_f64().unwrap() - 0.8).abs() < 1e-9,
            "{g}"
        );
        for k in ["p99_within", "max_within_1_5x", "kept_at_least", "all"] {
            assert!(g[k].is_boolean(), "{k}: {g}");
        }
    }
    let summary = v["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 1);
    let s = &summary[0];
    for k in [
        "p99_beside_over_alone",
        "max_beside_over_alone",
        "training_kept",
    ] {
        let (min, med, max) = (
            positive(&s[k]["min"], k),
            positive(&s[k]["median"], k),
            positive(&s[k]["max"], k),
        );
        assert!(min <= med && med <= max, "{s}");
    }
    assert!(s["goals_met"].as_u64().unwrap() <= 2);
    assert!(stderr.contains("repetition 1"), "{stderr}");
}

/// `bench preempt` on tiny models: with memory for both the model stays
/// resident (no request finds it evicted); with memory for one, training
/// yields to the model's requests and comes back (both counted by the
/// service). The report's shape and its counts; no timing asserts.
#[test]
fn preempt_reports_resident_and_preempting_requests() {
    let (v, stderr) = bench(&[
        "preempt",
        "--train-model",
        "mlp",
        "--train-batch",
        "16",
        "--model",
        "lenet",
        "--batch",
        "2",
        "--requests",
        "4",
        "--interval-ms",
        "100",
        "--train-window",
        "0.3",
        "--warmup",
        "2",
    ]);
    assert_eq!(v["bench"], "preempt");
    assert_eq!(v["requests"], 4);
    let (resident, preempting) = (&v["resident"], &v["preempting"]);
    assert!(
        resident["memory_bytes"].as_u64().unwrap() > preempting["memory_bytes"].as_u64().unwrap(),
        "{v}"
    );
    for m in [resident, preempting] {
        assert_eq!(m["latency"]["n"], 4, "{m}");
        let (p50, p99) = (
            positive(&m["latency"]["p50_ms"], "p50"),
            positive(&m["latency"]["p99_ms"], "p99"),
        );
        assert!(p50 <= p99, "{m}");
        positive(&m["model_alone_median_ms"], "alone");
        positive(&m["training"]["alone_it_per_s"], "training alone");
        positive(
            &m["training"]["during_requests_it_per_s"],
            "training beside",
        );
    }
    // Both fit: nothing is evicted.
    assert_eq!(resident["misses"], 0, "{resident}");
    assert_eq!(resident["training"]["evictions"], 0, "{resident}");
    // One fits: the model was evicted for training, brought back for the
    // requests, and training yielded to them and came back.
    assert!(preempting["misses"].as_u64().unwrap() >= 1, "{preempting}");
    assert!(
        preempting["model_returns"].as_u64().unwrap() >= 1,
        "{preempting}"
    );
    let t = &preempting["training"];
    assert!(t["evictions"].as_u64().unwrap() >= 1, "{t}");
    assert!(t["returns"].as_u64().unwrap() >= 1, "{t}");
    positive(&v["p50_preempting_over_resident"], "p50 ratio");
    assert!(stderr.contains("preempting: 4 requests"), "{stderr}");
}
