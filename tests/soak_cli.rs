//! `lanes bench soak` as a user runs it, briefly: a real `lanes serve`
//! child on the CPU backend, three clients opening, running, closing,
//! dropping and being killed for 12 s; the verdict holds (every Run
//! answered, killed clients' sessions reclaimed within 5 s, the heap back
//! near its start once the sessions are gone). About 20 s.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::process::Command;

#[test]
fn a_short_soak_holds_its_verdict() {
    let out = Command::new(util::lanes_bin())
        .args(["bench", "soak", "--device", "cpu", "--duration", "12"])
        .args([
            "--clients",
            "3",
            "--kill-share",
            "0.2",
            "--sample-every",
            "0.5",
        ])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "one JSON object ({e}):\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let verdict = &v["verdict"];
    assert_eq!(
        verdict["ok"], true,
        "{verdict}\n{}\n{}",
        v["counts"], v["rss_kib"]
    );
    assert!(out.status.success());
    let counts = &v["counts"];
    assert!(counts["runs"].as_u64().unwrap() > 0, "{counts}");
    assert_eq!(counts["runs"], counts["runs_ok"], "{counts}");
    assert!(counts["killed_clients"].as_u64().unwrap() > 0, "{counts}");
    assert!(counts["dropped"].as_u64().unwrap() > 0, "{counts}");
    assert!(v["samples"].as_array().unwrap().len() >= 10);
    let watched = v["reclaim_s"]["killed_clients_watched"].as_u64().unwrap();
    assert!(watched > 0, "{}", v["reclaim_s"]);
}
