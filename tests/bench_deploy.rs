//! `lanes bench deploy` end to end (issue 32's deployment bench) on small
//! settings: the binary run as a user would, its stdout one JSON report
//! whose counts must add up. CPU here; `LANES_TEST_DEVICE=cuda` runs the
//! same on the GPU machine (with `LANES_BIN` pointing at the staged
//! binary). About 20 s on the 2-core development VM.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::process::{Command, Output};

use serde_json::Value;

fn device() -> &'static str {
    match std::env::var("LANES_TEST_DEVICE").as_deref() {
        Ok("cuda") => "cuda",
        _ => "cpu",
    }
}

fn deploy(args: &[&str]) -> Output {
    Command::new(util::lanes_bin())
        .args(["bench", "deploy", "--device", device()])
        .args(args)
        .output()
        .expect("lanes runs")
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("`{key}` is not a count in {v}"))
}

/// 84 models of two kinds (more than 64) from 4 clients, memory for 30% of
/// them: every request is counted once, as a hit or a miss; the misses the
/// clients classified are exactly the returns the service counted; the
/// baseline had every model resident and no misses.
#[test]
fn deploy_mix_counts_add_up_and_misses_match_the_services_returns() {
    let out = deploy(&[
        "--mix",
        "mlp:80,resnet18_cifar:4",
        "--batch",
        "2",
        "--clients",
        "4",
        "--requests",
        "200",
        "--warmup",
        "40",
        "--bound-iters",
        "2",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench deploy failed:\n{stderr}");
    assert!(stderr.contains("constrained:"), "{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.trim().lines().count(), 1, "one JSON line:\n{stdout}");
    let v: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["bench"], "deploy");
    assert_eq!(u(&v, "models"), 84);
    assert!(v["rate_rps"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["capacity_rps"].as_f64().unwrap() > 0.0, "{v}");

    // Memory: the constrained phase holds less than every model's P.
    let mem = &v["memory"];
    let sum_p = u(mem, "sum_persistent_bytes");
    assert!(u(mem, "constrained_bytes") < sum_p, "{mem}");
    assert!(u(mem, "baseline_bytes") >= sum_p, "{mem}");
    assert!(
        u(mem, "host_image_bytes") > 0 && u(mem, "host_image_bytes") <= sum_p,
        "{mem}"
    );
    for (kind, n) in [("mlp", 80), ("resnet18_cifar", 4)] {
        let k = &v["kinds"][kind];
        assert_eq!(u(k, "models"), n, "{k}");
        assert!(u(k, "persistent_bytes") > 0, "{k}");
        assert!(k["switch_bound_ms"].as_f64().unwrap() > 0.0, "{k}");
    }

    // Baseline: all models, all resident, nothing evicted.
    let b = &v["baseline"];
    assert_eq!(b["all_models"], true, "{b}");
    assert_eq!(u(b, "models"), 84);
    assert_eq!(u(&b["latency"], "requests"), 200, "{b}");
    assert_eq!(u(b, "misses"), 0, "{b}");
    assert_eq!(u(&b["service"], "evictions"), 0, "{b}");
    assert!(b["latency"]["p99_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(u(&b["loads"], "models"), 84);

    // Constrained: hits + misses = requests, per kind and overall.
    let c = &v["constrained"];
    assert_eq!(u(c, "requests"), 200, "{c}");
    let o = &c["overall"];
    assert_eq!(u(o, "hits") + u(o, "misses"), u(o, "requests"), "{o}");
    assert_eq!(u(o, "requests"), 200);
    assert!(
        u(o, "hits") > 0,
        "memory for 30% holds the popular models: {o}"
    );
    assert!(u(o, "misses") > 0, "memory for 30% must miss: {o}");
    let rate = o["miss_rate"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&rate), "{o}");
    assert!(o["miss_p99_over_bound"].as_f64().unwrap() > 0.0, "{o}");
    assert!(
        o["hit_p99_over_baseline_p99"].as_f64().unwrap() > 0.0,
        "{o}"
    );
    let mut per_kind_requests = 0;
    for kind in ["mlp", "resnet18_cifar"] {
        let k = &c["per_kind"][kind];
        assert_eq!(
            u(k, "hits") + u(k, "misses"),
            u(k, "requests"),
            "{kind}: {k}"
        );
        per_kind_requests += u(k, "requests");
        assert!(k["switch_bound_ms"].as_f64().unwrap() > 0.0, "{k}");
    }
    assert_eq!(per_kind_requests, 200, "{c}");
    // Every miss the clients saw is a return the service counted, and no
    // other (warm-up requests included).
    assert_eq!(
        u(c, "misses_with_warmup"),
        u(c, "returns_during_requests"),
        "{c}"
    );
    assert!(u(&c["service"], "evictions") > 0, "{c}");
    assert_eq!(u(&c["loads"], "models"), 84);
    assert!(c["throughput_rps"].as_f64().unwrap() > 0.0);
}

/// User errors are clear and name what to change.
#[test]
fn deploy_bad_arguments_are_clear_errors() {
    for (args, want) in [
        (vec!["--mix", "vgg:3"], "unknown model `vgg`"),
        (vec!["--mix", "mlp"], "not name:count"),
        (vec!["--mix", "mlp:3", "--zipf=-1"], "--zipf"),
        (
            vec!["--mix", "mlp:3", "--fit-fraction", "1.5"],
            "--fit-fraction",
        ),
        (
            vec!["--mix", "mlp:3", "--memory", "64KiB", "--batch", "2"],
            "largest model alone",
        ),
    ] {
        let out = deploy(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}
