//! Job traces: the CSV format read by `lanes simulate` and `lanes replay`
//! and written by `lanes trace gen`.
//!
//! One header line, then one job per line:
//!
//! ```text
//! job_id,submit_s,kind,iterations,iter_ms,persistent_bytes,ephemeral_bytes,priority
//! 1,0.000,training,120,20.5,268435456,536870912,0
//! 2,0.730,inference,15,4.2,134217728,33554432,2
//! ```
//!
//! `submit_s` is seconds from the trace's start, `iter_ms` the duration of one
//! iteration in milliseconds (both decimal, non-negative, finite). The byte
//! columns take plain bytes or a size with a unit (`256MiB`, `16G` = 16 GiB,
//! `1.5GB` = 1.5e9; see [`crate::size`]).

use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use lanes_policies::{JobId, JobKind, JobSpec};

/// The header line, in column order.
pub const HEADER: [&str; 8] = [
    "job_id",
    "submit_s",
    "kind",
    "iterations",
    "iter_ms",
    "persistent_bytes",
    "ephemeral_bytes",
    "priority",
];

/// Largest time a trace may mention, in seconds (about 3.2 years: long
/// enough for a public cluster trace), so durations never overflow when
/// added up.
pub const MAX_SECONDS: f64 = 1.0e8;
/// Most iterations one job may declare.
pub const MAX_ITERATIONS: u64 = 10_000_000;

/// One job of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceJob {
    /// Unique id.
    pub id: JobId,
    /// When it is submitted, from the trace's start.
    pub submit: Duration,
    /// Training or inference.
    pub kind: JobKind,
    /// Number of iterations (at least 1).
    pub iterations: u64,
    /// Duration of each iteration.
    pub iteration: Duration,
    /// Persistent bytes P.
    pub persistent_bytes: u64,
    /// Ephemeral bytes T.
    pub ephemeral_bytes: u64,
    /// Priority (larger is more urgent).
    pub priority: i32,
}

impl TraceJob {
    /// The spec a policy sees: everything but the submit time, with the
    /// trace's iteration duration as the hint.
    pub fn spec(&self) -> JobSpec {
        JobSpec::new(self.id, self.kind, self.iterations)
            .with_priority(self.priority)
            .with_memory(self.persistent_bytes, self.ephemeral_bytes)
            .with_hint(self.iteration)
    }

    /// Total service time: iterations × iteration duration.
    pub fn service(&self) -> Duration {
        self.iteration
            .saturating_mul(u32::try_from(self.iterations).unwrap_or(u32::MAX))
    }
}

/// Why a trace was refused.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read or written.
    #[error("trace {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A line is not valid CSV or does not have the expected columns.
    #[error("trace line {line}: {reason}")]
    Syntax {
        /// 1-based line number (the header is line 1).
        line: u64,
        /// What is wrong.
        reason: String,
    },
    /// The header is not the expected one.
    #[error("trace header is {found:?}, expected {expected:?}")]
    Header {
        /// What the file has.
        found: String,
        /// What it must have.
        expected: String,
    },
    /// A field has an invalid value.
    #[error("trace line {line}, column {column}: {reason}")]
    Field {
        /// 1-based line number.
        line: u64,
        /// Column name.
        column: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Two jobs share an id.
    #[error("trace line {line}: job id {id} appears twice")]
    DuplicateId {
        /// 1-based line number of the second one.
        line: u64,
        /// The id.
        id: JobId,
    },
    /// The trace has no jobs.
    #[error("trace has no jobs")]
    Empty,
}

fn field_err(line: u64, column: &'static str, reason: impl Into<String>) -> TraceError {
    TraceError::Field {
        line,
        column,
        reason: reason.into(),
    }
}

fn seconds(
    line: u64,
    column: &'static str,
    text: &str,
    scale: f64,
) -> Result<Duration, TraceError> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| field_err(line, column, format!("{text:?} is not a number")))?;
    if !v.is_finite() || v < 0.0 {
        return Err(field_err(
            line,
            column,
            format!("{v} is not a finite non-negative number"),
        ));
    }
    let secs = v * scale;
    if secs > MAX_SECONDS {
        return Err(field_err(line, column, format!("{v} is too large")));
    }
    // Round to whole nanoseconds so that a trace reads back identically.
    Ok(Duration::from_nanos((secs * 1e9).round() as u64))
}

fn integer<T: std::str::FromStr>(
    line: u64,
    column: &'static str,
    text: &str,
) -> Result<T, TraceError> {
    text.trim()
        .parse()
        .map_err(|_| field_err(line, column, format!("{text:?} is not a valid integer")))
}

/// Parse a trace from CSV text.
pub fn read_trace(reader: impl Read) -> Result<Vec<TraceJob>, TraceError> {
    let mut csv = csv::ReaderBuilder::new()
        .has_headers(true)
        .trim(csv::Trim::All)
        .comment(Some(b'#'))
        .from_reader(reader);
    let header = csv.headers().map_err(|e| TraceError::Syntax {
        line: 1,
        reason: e.to_string(),
    })?;
    if header.iter().collect::<Vec<_>>() != HEADER {
        return Err(TraceError::Header {
            found: header.iter().collect::<Vec<_>>().join(","),
            expected: HEADER.join(","),
        });
    }
    let mut jobs = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for record in csv.records() {
        let record = record.map_err(|e| TraceError::Syntax {
            line: e.position().map_or(0, |p| p.line()),
            reason: e.to_string(),
        })?;
        let line = record.position().map_or(0, |p| p.line());
        let f = |i: usize| record.get(i).unwrap_or("");
        let id: JobId = integer(line, "job_id", f(0))?;
        let kind: JobKind = f(2)
            .parse()
            .map_err(|e: lanes_policies::PolicyError| field_err(line, "kind", e.to_string()))?;
        let iterations: u64 = integer(line, "iterations", f(3))?;
        if iterations == 0 || iterations > MAX_ITERATIONS {
            return Err(field_err(
                line,
                "iterations",
                format!("{iterations} is not in 1..={MAX_ITERATIONS}"),
            ));
        }
        let job = TraceJob {
            id,
            submit: seconds(line, "submit_s", f(1), 1.0)?,
            kind,
            iterations,
            iteration: seconds(line, "iter_ms", f(4), 1e-3)?,
            persistent_bytes: bytes(line, "persistent_bytes", f(5))?,
            ephemeral_bytes: bytes(line, "ephemeral_bytes", f(6))?,
            priority: integer(line, "priority", f(7))?,
        };
        if !seen.insert(id) {
            return Err(TraceError::DuplicateId { line, id });
        }
        jobs.push(job);
    }
    if jobs.is_empty() {
        return Err(TraceError::Empty);
    }
    Ok(jobs)
}

/// Read a trace file.
pub fn load_trace(path: &Path) -> Result<Vec<TraceJob>, TraceError> {
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    read_trace(std::io::BufReader::new(file))
}

/// Write a trace as CSV (times with microsecond precision).
pub fn write_trace(mut out: impl Write, jobs: &[TraceJob]) -> std::io::Result<()> {
    writeln!(out, "{}", HEADER.join(","))?;
    for j in jobs {
        writeln!(
            out,
            "{},{:.6},{},{},{:.3},{},{},{}",
            j.id,
            j.submit.as_secs_f64(),
            j.kind.as_str(),
            j.iterations,
            j.iteration.as_secs_f64() * 1e3,
            j.persistent_bytes,
            j.ephemeral_bytes,
            j.priority
        )?;
    }
    Ok(())
}

/// A byte column: plain bytes or a size with a unit (`256MiB`, `1.5GB`;
/// the one parser of [`crate::size`]).
fn bytes(line: u64, column: &'static str, text: &str) -> Result<u64, TraceError> {
    crate::size::parse_size(text).map_err(|e| field_err(line, column, e.to_string()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const GOOD: &str =
        "job_id,submit_s,kind,iterations,iter_ms,persistent_bytes,ephemeral_bytes,priority\n\
        1,0,training,3,10,100,50,0\n\
        # a comment\n\
        2,0.5,inference,2,2.5,10,5,3\n";

    #[test]
    fn reads_and_round_trips() {
        let jobs = read_trace(GOOD.as_bytes()).unwrap();
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[1].submit, Duration::from_millis(500));
        assert_eq!(jobs[1].iteration, Duration::from_micros(2500));
        assert_eq!(jobs[1].kind, JobKind::Inference);
        assert_eq!(jobs[0].service(), Duration::from_millis(30));
        let mut buf = Vec::new();
        write_trace(&mut buf, &jobs).unwrap();
        assert_eq!(read_trace(buf.as_slice()).unwrap(), jobs);
    }

    #[test]
    fn refuses_bad_input_with_the_line_and_column() {
        let h = HEADER.join(",");
        let cases = [
            (format!("{h}\n1,0,training,0,10,1,1,0\n"), "iterations"),
            (format!("{h}\n1,-1,training,1,10,1,1,0\n"), "submit_s"),
            (format!("{h}\n1,0,training,1,NaN,1,1,0\n"), "iter_ms"),
            (format!("{h}\n1,0,gaming,1,10,1,1,0\n"), "kind"),
            (
                format!("{h}\n1,0,training,1,10,-5,1,0\n"),
                "persistent_bytes",
            ),
        ];
        for (text, col) in cases {
            match read_trace(text.as_bytes()) {
                Err(TraceError::Field {
                    line: 2, column, ..
                }) => assert_eq!(column, col),
                other => panic!("{col}: {other:?}"),
            }
        }
        let dup = format!("{h}\n1,0,training,1,10,1,1,0\n1,0,training,1,10,1,1,0\n");
        assert!(matches!(
            read_trace(dup.as_bytes()),
            Err(TraceError::DuplicateId { id: 1, .. })
        ));
        assert!(matches!(
            read_trace(format!("{h}\n").as_bytes()),
            Err(TraceError::Empty)
        ));
        assert!(matches!(
            read_trace("a,b\n1,2\n".as_bytes()),
            Err(TraceError::Header { .. })
        ));
        let short = format!("{h}\n1,0,training\n");
        assert!(matches!(
            read_trace(short.as_bytes()),
            Err(TraceError::Syntax { .. })
        ));
    }

    #[test]
    fn byte_columns_take_units() {
        let h = HEADER.join(",");
        let text = format!("{h}\n1,0,training,1,10,16GiB,1.5GB,0\n2,0,training,1,10,512M,4096,0\n");
        let jobs = read_trace(text.as_bytes()).unwrap();
        assert_eq!(jobs[0].persistent_bytes, 16 << 30);
        assert_eq!(jobs[0].ephemeral_bytes, 1_500_000_000);
        assert_eq!(jobs[1].persistent_bytes, 512 << 20);
        assert_eq!(jobs[1].ephemeral_bytes, 4096);
        let bad = format!("{h}\n1,0,training,1,10,lots,1,0\n");
        match read_trace(bad.as_bytes()) {
            Err(
                e @ TraceError::Field {
                    line: 2,
                    column: "persistent_bytes",
                    ..
                },
            ) => {
                assert!(e.to_string().contains("`lots` is not a size"), "{e}")
            }
            other => panic!("{other:?}"),
        }
    }
}
