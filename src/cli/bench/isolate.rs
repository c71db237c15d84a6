//! `--path both`: each path timed in its own child process (this binary,
//! same arguments, `--path executor` then `--path service`), the two
//! reports merged into one.
//!
//! A fresh process per path keeps one path's leftovers — GPU memory freed
//! but cached, cuDNN/cuBLAS state, a second CUDA-graph capture in the same
//! context — out of the other's timing, as when PyTorch's reference runs
//! in its own process. `--same-process` times both in this process instead.

use std::ffi::OsString;
use std::process::{Command, Stdio};

use anyhow::Context;
use serde_json::Value;

/// The arguments of this invocation with every `--path X` / `--path=X`
/// removed and `--path <path>` appended.
pub fn args_for(argv: impl IntoIterator<Item = OsString>, path: &str) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut skip_next = false;
    for a in argv {
        if skip_next {
            skip_next = false;
            continue;
        }
        if a == "--path" {
            skip_next = true;
            continue;
        }
        if a.to_str().is_some_and(|s| s.starts_with("--path=")) {
            continue;
        }
        out.push(a);
    }
    out.push("--path".into());
    out.push(path.into());
    out
}

/// Runs this binary for one path and returns its JSON report (its progress
/// goes to our stderr).
fn child(path: &str) -> anyhow::Result<Value> {
    let exe = std::env::current_exe().context("locating the lanes binary")?;
    let args = args_for(std::env::args_os().skip(1), path);
    let out = Command::new(&exe)
        .args(&args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {} for the {path} path", exe.display()))?;
    if !out.status.success() {
        return Err(crate::cli::AlreadyReported(format!(
            "the {path} path failed ({})",
            out.status
        ))
        .into());
    }
    let text = String::from_utf8(out.stdout).context("the child's report is not UTF-8")?;
    serde_json::from_str(text.trim())
        .with_context(|| format!("the {path} path's report is not JSON: {text}"))
}

/// Merges the executor-only and service-only reports.
pub fn merge(mut exec: Value, service: Value) -> anyhow::Result<Value> {
    let e = exec["executor"]["median_ms"]
        .as_f64()
        .context("the executor report has no median")?;
    let s = service["service"]["median_ms"]
        .as_f64()
        .context("the service report has no median")?;
    let m = exec
        .as_object_mut()
        .context("the executor report is not an object")?;
    m.insert("service".into(), service["service"].clone());
    m.insert("service_device".into(), service["service_device"].clone());
    m.insert(
        "service_over_executor".into(),
        if e > 0.0 {
            Value::from(s / e)
        } else {
            Value::Null
        },
    );
    m.insert("isolation".into(), "a process per path".into());
    Ok(exec)
}

/// Both paths, each in a fresh process.
pub fn both() -> anyhow::Result<Value> {
    let exec = child("executor")?;
    let service = child("service")?;
    merge(exec, service)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn path_arguments_are_replaced() {
        assert_eq!(
            args_for(
                os(&[
                    "bench",
                    "train",
                    "--path",
                    "both",
                    "--iters",
                    "3",
                    "--path=both"
                ]),
                "service"
            ),
            os(&["bench", "train", "--iters", "3", "--path", "service"])
        );
        assert_eq!(
            args_for(os(&["bench", "infer", "--model", "mlp"]), "executor"),
            os(&["bench", "infer", "--model", "mlp", "--path", "executor"])
        );
    }

    #[test]
    fn reports_merge_with_the_ratio() {
        let exec = json!({"model": "m", "executor": {"median_ms": 2.0}, "service": null});
        let svc = json!({"service": {"median_ms": 3.0}, "service_device": "cpu"});
        let v = merge(exec, svc).unwrap();
        assert_eq!(v["service"]["median_ms"], 3.0);
        assert_eq!(v["service_over_executor"], 1.5);
        assert_eq!(v["service_device"], "cpu");
        assert_eq!(v["model"], "m");
        assert!(merge(json!({"executor": null}), json!({})).is_err());
    }
}
