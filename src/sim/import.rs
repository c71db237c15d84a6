//! `lanes trace import`: a public cluster trace's job table (CSV) turned
//! into a Lanes trace.
//!
//! A [`Mapping`] names the table's columns (submit time, duration or
//! iterations, GPU count, memory, kind, priority, model) and their units;
//! a table of [`Profile`]s gives each model's iteration time, P and T, so
//! that a duration becomes a number of iterations. Jobs that ask for more
//! than one GPU (or none) are left out and counted: a Lanes service owns
//! one GPU. Every bad line is refused with its line number, its column and
//! what is wrong ([`ImportError`]).

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::time::Duration;

use lanes_policies::{JobId, JobKind};
use serde::Deserialize;

use super::trace::{TraceJob, MAX_ITERATIONS, MAX_SECONDS};

/// Why an import failed.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The mapping is incomplete or contradictory.
    #[error("mapping: {reason}")]
    Mapping {
        /// What is wrong.
        reason: String,
    },
    /// A table has no header line or a mapped column is missing from it.
    #[error("{table}: column {column:?} (mapped as {field}) is not in the header {header:?}")]
    MissingColumn {
        /// Which table.
        table: &'static str,
        /// The mapped field.
        field: &'static str,
        /// The column name the mapping gives.
        column: String,
        /// The header found.
        header: String,
    },
    /// A line is not valid CSV.
    #[error("{table} line {line}: {reason}")]
    Syntax {
        /// Which table.
        table: &'static str,
        /// 1-based line number.
        line: u64,
        /// What is wrong.
        reason: String,
    },
    /// A field has an invalid value.
    #[error("{table} line {line}, column {column:?}: {reason}")]
    Field {
        /// Which table.
        table: &'static str,
        /// 1-based line number.
        line: u64,
        /// Column name in that table.
        column: String,
        /// What is wrong.
        reason: String,
    },
    /// No job is left after filtering.
    #[error("no single-GPU job in the table ({read} read)")]
    Empty {
        /// Jobs read.
        read: usize,
    },
}

/// A unit of time in the job table.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TimeUnit {
    /// Microseconds.
    Us,
    /// Milliseconds.
    Ms,
    /// Seconds.
    #[default]
    S,
    /// Minutes.
    Min,
    /// Hours.
    H,
}

impl TimeUnit {
    fn seconds(self) -> f64 {
        match self {
            TimeUnit::Us => 1e-6,
            TimeUnit::Ms => 1e-3,
            TimeUnit::S => 1.0,
            TimeUnit::Min => 60.0,
            TimeUnit::H => 3600.0,
        }
    }
}

impl std::str::FromStr for TimeUnit {
    type Err = ImportError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "us" => Ok(TimeUnit::Us),
            "ms" => Ok(TimeUnit::Ms),
            "s" => Ok(TimeUnit::S),
            "min" => Ok(TimeUnit::Min),
            "h" => Ok(TimeUnit::H),
            other => Err(ImportError::Mapping {
                reason: format!("unknown time unit {other:?} (us, ms, s, min or h)"),
            }),
        }
    }
}

/// A unit of memory in the job table.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Default)]
pub enum MemoryUnit {
    /// Bytes.
    #[serde(rename = "B")]
    B,
    /// 2^10 bytes.
    #[serde(rename = "KiB")]
    KiB,
    /// 2^20 bytes.
    #[serde(rename = "MiB")]
    #[default]
    MiB,
    /// 2^30 bytes.
    #[serde(rename = "GiB")]
    GiB,
}

impl MemoryUnit {
    fn bytes(self) -> f64 {
        match self {
            MemoryUnit::B => 1.0,
            MemoryUnit::KiB => 1024.0,
            MemoryUnit::MiB => 1024.0 * 1024.0,
            MemoryUnit::GiB => 1024.0 * 1024.0 * 1024.0,
        }
    }
}

impl std::str::FromStr for MemoryUnit {
    type Err = ImportError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "B" => Ok(MemoryUnit::B),
            "KiB" => Ok(MemoryUnit::KiB),
            "MiB" => Ok(MemoryUnit::MiB),
            "GiB" => Ok(MemoryUnit::GiB),
            other => Err(ImportError::Mapping {
                reason: format!("unknown memory unit {other:?} (B, KiB, MiB or GiB)"),
            }),
        }
    }
}

/// Which column of the job table holds what (`None`: not in the table).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Columns {
    /// Job id (u64); without it jobs are numbered 1, 2, … in table order.
    pub id: Option<String>,
    /// Submission time (a number in `units.submit`). Required.
    pub submit: Option<String>,
    /// Run time on its GPU (a number in `units.duration`); iterations =
    /// duration / the model's iteration time, rounded, at least 1.
    pub duration: Option<String>,
    /// Iterations (instead of a duration).
    pub iterations: Option<String>,
    /// GPUs the job asks for; only jobs asking for exactly one are kept.
    pub gpus: Option<String>,
    /// GPU memory the job uses (in `units.memory`): replaces the profile's
    /// P + T, split in the profile's P : T ratio (an empty cell keeps the
    /// profile's).
    pub memory: Option<String>,
    /// Kind; its values are translated through `kinds`.
    pub kind: Option<String>,
    /// Priority (i32).
    pub priority: Option<String>,
    /// Model name, looked up in the profiles (an empty cell: the default
    /// `model`).
    pub model: Option<String>,
}

/// Units of the job table's columns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Units {
    /// Unit of `submit` (default seconds).
    #[serde(default)]
    pub submit: TimeUnit,
    /// Unit of `duration` (default seconds).
    #[serde(default)]
    pub duration: TimeUnit,
    /// Unit of `memory` (default MiB).
    #[serde(default)]
    pub memory: MemoryUnit,
}

/// How to read a job table: the small TOML file `--mapping` names, or
/// the same given on the command line.
///
/// ```toml
/// model = "resnet50"            # profile of jobs without a model column
/// [columns]
/// submit = "submit_time"
/// duration = "duration"
/// gpus = "num_gpu"
/// kind = "task"
/// [units]
/// submit = "s"
/// duration = "min"
/// [kinds]                       # table value → training | inference
/// train = "training"
/// serve = "inference"
/// ```
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mapping {
    /// The columns.
    #[serde(default)]
    pub columns: Columns,
    /// Their units.
    #[serde(default)]
    pub units: Units,
    /// Kind values of the table and what they mean (`training` or
    /// `inference`); `training`/`train`/`inference`/`infer` are always
    /// understood.
    #[serde(default)]
    pub kinds: HashMap<String, String>,
    /// The profile of jobs without a model (or without a model column).
    pub model: Option<String>,
}

impl Mapping {
    /// Parse the TOML form.
    pub fn from_toml(text: &str) -> Result<Mapping, ImportError> {
        toml::from_str(text).map_err(|e| ImportError::Mapping {
            reason: e.to_string(),
        })
    }

    /// Set one field from `field=column` (the command line's `--map`).
    pub fn set(&mut self, assignment: &str) -> Result<(), ImportError> {
        let (field, column) = assignment
            .split_once('=')
            .ok_or_else(|| ImportError::Mapping {
                reason: format!("{assignment:?} is not field=column"),
            })?;
        let column = Some(column.trim().to_string());
        let c = &mut self.columns;
        match field.trim() {
            "id" => c.id = column,
            "submit" => c.submit = column,
            "duration" => c.duration = column,
            "iterations" => c.iterations = column,
            "gpus" => c.gpus = column,
            "memory" => c.memory = column,
            "kind" => c.kind = column,
            "priority" => c.priority = column,
            "model" => c.model = column,
            other => {
                return Err(ImportError::Mapping {
                    reason: format!(
                        "unknown field {other:?} (id, submit, duration, iterations, gpus, memory, kind, priority, model)"
                    ),
                })
            }
        }
        Ok(())
    }
}

/// One model's measured iteration: time, P and T.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profile {
    /// Duration of one iteration.
    pub iteration: Duration,
    /// Persistent bytes.
    pub persistent_bytes: u64,
    /// Ephemeral bytes.
    pub ephemeral_bytes: u64,
}

/// Header of the profile table.
pub const PROFILE_HEADER: [&str; 4] = ["model", "iter_ms", "persistent_bytes", "ephemeral_bytes"];

fn field(table: &'static str, line: u64, column: &str, reason: impl Into<String>) -> ImportError {
    ImportError::Field {
        table,
        line,
        column: column.to_string(),
        reason: reason.into(),
    }
}

fn number(table: &'static str, line: u64, column: &str, text: &str) -> Result<f64, ImportError> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| field(table, line, column, format!("{text:?} is not a number")))?;
    if !v.is_finite() || v < 0.0 {
        return Err(field(
            table,
            line,
            column,
            format!("{v} is not a finite non-negative number"),
        ));
    }
    Ok(v)
}

fn csv_reader(reader: impl Read) -> csv::Reader<impl Read> {
    csv::ReaderBuilder::new()
        .has_headers(true)
        .trim(csv::Trim::All)
        .comment(Some(b'#'))
        .flexible(false)
        .from_reader(reader)
}

fn syntax(table: &'static str, e: &csv::Error) -> ImportError {
    ImportError::Syntax {
        table,
        line: e.position().map_or(0, |p| p.line()),
        reason: e.to_string(),
    }
}

/// Read a profile table: `model,iter_ms,persistent_bytes,ephemeral_bytes`.
pub fn read_profiles(reader: impl Read) -> Result<HashMap<String, Profile>, ImportError> {
    const T: &str = "profiles";
    let mut csv = csv_reader(reader);
    let header: Vec<String> = csv
        .headers()
        .map_err(|e| syntax(T, &e))?
        .iter()
        .map(str::to_string)
        .collect();
    if header != PROFILE_HEADER {
        return Err(ImportError::Mapping {
            reason: format!(
                "profile header is {:?}, expected {:?}",
                header.join(","),
                PROFILE_HEADER.join(",")
            ),
        });
    }
    let mut out = HashMap::new();
    for record in csv.records() {
        let record = record.map_err(|e| syntax(T, &e))?;
        let line = record.position().map_or(0, |p| p.line());
        let get = |i: usize| record.get(i).unwrap_or("");
        let model = get(0).to_string();
        if model.is_empty() {
            return Err(field(T, line, "model", "empty model name"));
        }
        let ms = number(T, line, "iter_ms", get(1))?;
        let iteration = Duration::from_nanos((ms * 1e6).round().min(MAX_SECONDS * 1e9) as u64);
        if iteration.is_zero() {
            return Err(field(
                T,
                line,
                "iter_ms",
                "an iteration must take some time",
            ));
        }
        let int = |i: usize, column: &str| -> Result<u64, ImportError> {
            get(i)
                .parse()
                .map_err(|_| field(T, line, column, format!("{:?} is not a byte count", get(i))))
        };
        let profile = Profile {
            iteration,
            persistent_bytes: int(2, "persistent_bytes")?,
            ephemeral_bytes: int(3, "ephemeral_bytes")?,
        };
        if out.insert(model.clone(), profile).is_some() {
            return Err(field(
                T,
                line,
                "model",
                format!("model {model:?} appears twice"),
            ));
        }
    }
    Ok(out)
}

/// What an import read and kept.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ImportStats {
    /// Jobs in the table.
    pub read: usize,
    /// Jobs written to the trace.
    pub kept: usize,
    /// Left out: they ask for more than one GPU.
    pub multi_gpu: usize,
    /// Left out: they ask for no GPU.
    pub no_gpu: usize,
}

/// Where each mapped field sits in the table's header.
struct Index {
    id: Option<usize>,
    submit: usize,
    duration: Option<usize>,
    iterations: Option<usize>,
    gpus: Option<usize>,
    memory: Option<usize>,
    kind: Option<usize>,
    priority: Option<usize>,
    model: Option<usize>,
}

/// Read a job table with `mapping`, turning durations into iterations with
/// `profiles`. Submission times are shifted so the earliest is 0.
pub fn import_jobs(
    reader: impl Read,
    mapping: &Mapping,
    profiles: &HashMap<String, Profile>,
) -> Result<(Vec<TraceJob>, ImportStats), ImportError> {
    const T: &str = "jobs";
    let c = &mapping.columns;
    let submit_col = c.submit.as_deref().ok_or_else(|| ImportError::Mapping {
        reason: "the submit column is required".into(),
    })?;
    if c.duration.is_some() == c.iterations.is_some() {
        return Err(ImportError::Mapping {
            reason: "map exactly one of duration and iterations".into(),
        });
    }
    if let Some(m) = &mapping.model {
        if !profiles.contains_key(m) {
            return Err(ImportError::Mapping {
                reason: format!("default model {m:?} has no profile"),
            });
        }
    }
    let mut kinds: HashMap<String, JobKind> = HashMap::new();
    for (value, meaning) in &mapping.kinds {
        let kind: JobKind = meaning.parse().map_err(|_| ImportError::Mapping {
            reason: format!("kind {value:?} maps to {meaning:?}, not training or inference"),
        })?;
        kinds.insert(value.clone(), kind);
    }

    let mut csv = csv_reader(reader);
    let header: Vec<String> = csv
        .headers()
        .map_err(|e| syntax(T, &e))?
        .iter()
        .map(str::to_string)
        .collect();
    let find =
        |field_name: &'static str, column: &Option<String>| -> Result<Option<usize>, ImportError> {
            match column {
                None => Ok(None),
                Some(name) => header
                    .iter()
                    .position(|h| h == name)
                    .map(Some)
                    .ok_or_else(|| ImportError::MissingColumn {
                        table: T,
                        field: field_name,
                        column: name.clone(),
                        header: header.join(","),
                    }),
            }
        };
    let ix = Index {
        id: find("id", &c.id)?,
        submit: find("submit", &Some(submit_col.to_string()))?.unwrap_or(0),
        duration: find("duration", &c.duration)?,
        iterations: find("iterations", &c.iterations)?,
        gpus: find("gpus", &c.gpus)?,
        memory: find("memory", &c.memory)?,
        kind: find("kind", &c.kind)?,
        priority: find("priority", &c.priority)?,
        model: find("model", &c.model)?,
    };
    let name = |i: usize| header.get(i).map_or("", String::as_str);

    let mut stats = ImportStats::default();
    let mut jobs: Vec<TraceJob> = Vec::new();
    let mut seen: HashSet<JobId> = HashSet::new();
    let mut submits: Vec<f64> = Vec::new();
    for record in csv.records() {
        let record = record.map_err(|e| syntax(T, &e))?;
        let line = record.position().map_or(0, |p| p.line());
        let get = |i: usize| record.get(i).unwrap_or("").trim();
        stats.read += 1;
        if let Some(g) = ix.gpus {
            let gpus = number(T, line, name(g), get(g))?;
            if gpus.fract() != 0.0 {
                return Err(field(
                    T,
                    line,
                    name(g),
                    format!("{gpus} is not a whole number"),
                ));
            }
            if gpus > 1.0 {
                stats.multi_gpu += 1;
                continue;
            }
            if gpus == 0.0 {
                stats.no_gpu += 1;
                continue;
            }
        }
        let id: JobId = match ix.id {
            Some(i) => get(i).parse().map_err(|_| {
                field(
                    T,
                    line,
                    name(i),
                    format!("{:?} is not a job id (u64)", get(i)),
                )
            })?,
            None => stats.read as u64,
        };
        if !seen.insert(id) {
            let column = ix.id.map_or("id", name);
            return Err(field(T, line, column, format!("job id {id} appears twice")));
        }
        let submit =
            number(T, line, name(ix.submit), get(ix.submit))? * mapping.units.submit.seconds();
        let model = match ix.model.map(get).filter(|m| !m.is_empty()) {
            Some(m) => m.to_string(),
            None => mapping.model.clone().ok_or_else(|| {
                let column = ix.model.map_or("model", name);
                field(
                    T,
                    line,
                    column,
                    "no model, and the mapping names no default model",
                )
            })?,
        };
        let profile = profiles.get(&model).ok_or_else(|| {
            let column = ix.model.map_or("model", name);
            field(T, line, column, format!("model {model:?} has no profile"))
        })?;
        let iterations: u64 = match (ix.iterations, ix.duration) {
            (Some(i), _) => get(i).parse().map_err(|_| {
                field(
                    T,
                    line,
                    name(i),
                    format!("{:?} is not an iteration count", get(i)),
                )
            })?,
            (None, Some(d)) => {
                let secs = number(T, line, name(d), get(d))? * mapping.units.duration.seconds();
                if secs > MAX_SECONDS {
                    return Err(field(T, line, name(d), format!("{secs} s is too long")));
                }
                ((secs / profile.iteration.as_secs_f64()).round() as u64).max(1)
            }
            (None, None) => 1,
        };
        if iterations == 0 || iterations > MAX_ITERATIONS {
            let column = ix.iterations.or(ix.duration).map_or("iterations", name);
            return Err(field(
                T,
                line,
                column,
                format!("{iterations} iterations is not in 1..={MAX_ITERATIONS}"),
            ));
        }
        let (persistent_bytes, ephemeral_bytes) = match ix.memory.filter(|&m| !get(m).is_empty()) {
            None => (profile.persistent_bytes, profile.ephemeral_bytes),
            Some(m) => {
                let bytes = number(T, line, name(m), get(m))? * mapping.units.memory.bytes();
                if bytes > u64::MAX as f64 / 2.0 {
                    return Err(field(T, line, name(m), "too large"));
                }
                let total = profile.persistent_bytes as f64 + profile.ephemeral_bytes as f64;
                let share = if total > 0.0 {
                    profile.persistent_bytes as f64 / total
                } else {
                    0.5
                };
                let p = (bytes * share).round();
                (p as u64, (bytes - p).max(0.0).round() as u64)
            }
        };
        let kind = match ix.kind {
            None => JobKind::Training,
            Some(k) => {
                let v = get(k);
                match kinds.get(v) {
                    Some(&kind) => kind,
                    None => v.parse().map_err(|_| {
                        field(
                            T,
                            line,
                            name(k),
                            format!("kind {v:?} is neither training nor inference (map it under [kinds])"),
                        )
                    })?,
                }
            }
        };
        let priority: i32 = match ix.priority {
            None => 0,
            Some(p) => get(p).parse().map_err(|_| {
                field(
                    T,
                    line,
                    name(p),
                    format!("{:?} is not a priority (i32)", get(p)),
                )
            })?,
        };
        submits.push(submit);
        jobs.push(TraceJob {
            id,
            submit: Duration::ZERO,
            kind,
            iterations,
            iteration: profile.iteration,
            persistent_bytes,
            ephemeral_bytes,
            priority,
        });
    }
    let first = submits.iter().copied().fold(f64::INFINITY, f64::min);
    for (job, s) in jobs.iter_mut().zip(&submits) {
        let secs = s - first;
        if secs > MAX_SECONDS {
            return Err(ImportError::Mapping {
                reason: format!(
                    "job {} is submitted {secs} s after the first; a trace spans at most {MAX_SECONDS} s",
                    job.id
                ),
            });
        }
        job.submit = Duration::from_nanos((secs * 1e9).round() as u64);
    }
    stats.kept = jobs.len();
    if jobs.is_empty() {
        return Err(ImportError::Empty { read: stats.read });
    }
    Ok((jobs, stats))
}
