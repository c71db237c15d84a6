//! Subcommands of the `lanes` binary, one module each. Errors are reported
//! with `anyhow`; the library underneath uses typed errors.

#[macro_use]
mod macros {
    /// `println!` that hands back the write's error instead of panicking, so
    /// that a closed pipe (`lanes simulate … | head -1`) ends the command
    /// quietly (`main` treats a broken pipe as done).
    macro_rules! outln {
        ($($arg:tt)*) => {{
            use std::io::Write as _;
            writeln!(std::io::stdout(), $($arg)*)
        }};
    }

    /// `print!` that hands back the write's error (see [`outln!`]).
    macro_rules! out {
        ($($arg:tt)*) => {{
            use std::io::Write as _;
            write!(std::io::stdout(), $($arg)*)
        }};
    }
}

pub mod bench;
pub mod demo;
pub mod demo_train;
pub mod digits;
pub mod host;
pub mod import;
pub mod replay;
pub mod serve;
pub mod simulate;
pub mod status;
pub mod trace;

/// An error a child process has already printed on our stderr: `main`
/// exits with a failure without printing it again.
#[derive(Debug, thiserror::Error)]
#[error("{0} (reported above)")]
pub struct AlreadyReported(pub String);

/// Whether `e` comes from writing to a closed pipe.
pub fn broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// `Error: message` and one `caused by:` line per cause whose text the
/// lines before do not already contain (a library error that prints its
/// source, as `trace.csv: No such file or directory (os error 2)` does,
/// is then not followed by the same text again).
pub fn report(e: &anyhow::Error) -> String {
    let mut out = format!("Error: {e}\n");
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(&format!("  caused by: {text}\n"));
        }
    }
    out
}

/// A progress bar on stderr for `len` steps of `what`; indicatif draws
/// nothing when stderr is not a terminal (logs and CI stay clean).
pub fn bar(len: usize, what: &str) -> indicatif::ProgressBar {
    let style = indicatif::ProgressStyle::with_template(
        "{prefix} [{elapsed_precise}] {bar:30} {pos}/{len} ({per_sec}, about {eta} left)",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    indicatif::ProgressBar::with_draw_target(
        Some(len as u64),
        indicatif::ProgressDrawTarget::stderr(),
    )
    .with_style(style)
    .with_prefix(what.to_string())
}

/// A spinner on stderr with the elapsed time, for work of unknown length
/// (hidden when stderr is not a terminal).
pub fn spinner(what: &str) -> indicatif::ProgressBar {
    let style = indicatif::ProgressStyle::with_template("{spinner} {prefix} [{elapsed_precise}]")
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner());
    let s = indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr())
        .with_style(style)
        .with_prefix(what.to_string());
    s.enable_steady_tick(std::time::Duration::from_millis(200));
    s
}

/// `--busy-poll MS` as a window: 0 (off) to 1000 ms.
pub fn busy_poll_window(ms: f64) -> anyhow::Result<std::time::Duration> {
    if !(ms.is_finite() && (0.0..=1000.0).contains(&ms)) {
        anyhow::bail!(
            "--busy-poll must be a number of milliseconds from 0 (off) to 1000, not {ms}"
        );
    }
    Ok(std::time::Duration::from_secs_f64(ms / 1e3))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{path}: {source}")]
    struct Io {
        path: String,
        source: std::io::Error,
    }

    #[test]
    fn a_cause_already_in_the_message_is_not_repeated() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let e = anyhow::Error::from(Io {
            path: "t.csv".into(),
            source: io,
        })
        .context("reading the trace");
        let text = report(&e);
        assert_eq!(text.matches("No such file").count(), 1, "{text}");
        assert!(text.starts_with("Error: reading the trace\n"), "{text}");
        assert!(text.contains("caused by: t.csv: No such file"), "{text}");
    }

    #[test]
    fn broken_pipes_are_recognised_through_context() {
        let io = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        assert!(broken_pipe(&anyhow::Error::from(io).context("printing")));
        assert!(!broken_pipe(&anyhow::anyhow!("other")));
    }

    #[test]
    fn busy_poll_windows_are_checked() {
        assert_eq!(
            busy_poll_window(2.5).unwrap(),
            std::time::Duration::from_micros(2500)
        );
        assert!(busy_poll_window(0.0).unwrap().is_zero());
        for bad in [-1.0, 1000.5, f64::NAN, f64::INFINITY] {
            let e = busy_poll_window(bad).unwrap_err().to_string();
            assert!(e.contains("--busy-poll"), "{e}");
        }
    }
}
