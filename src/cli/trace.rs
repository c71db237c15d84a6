//! `lanes trace gen`: write a synthetic job trace (distributions in
//! docs/scheduling.md); `lanes trace import`: turn a cluster trace's job
//! table into one; `lanes trace contention`: fit a contention table to
//! measured co-runs.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use lanes::sim::import::{MemoryUnit, TimeUnit};
use lanes::sim::{
    generate, import_jobs, read_profiles, write_trace, Contention, GenConfig, Mapping, TraceJob,
};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: TraceCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum TraceCommand {
    /// Generate a synthetic trace.
    Gen(GenArgs),
    /// Import a cluster trace's job table (CSV) with a column mapping and a
    /// model-profile table (see docs/scheduling.md).
    Import(ImportArgs),
    /// Fit a contention table (TOML, for `--contention FILE`) to measured
    /// co-run iteration times (see docs/scheduling.md).
    Contention(ContentionArgs),
}

#[derive(Debug, clap::Args)]
pub struct ContentionArgs {
    /// Co-runs as CSV lines `me,other,alone,beside[,priority]`: a lane's
    /// kind, the other busy lane's kind, its mean iteration time alone and
    /// beside the other (one unit), 1 for runs under `--policy priority`.
    #[arg(long)]
    pub runs: PathBuf,
    /// Output table; `-` for standard output.
    #[arg(long, default_value = "-")]
    pub out: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct ImportArgs {
    /// The job table (CSV with a header line).
    #[arg(long)]
    pub jobs: PathBuf,
    /// Model profiles: CSV `model,iter_ms,persistent_bytes,ephemeral_bytes`.
    #[arg(long)]
    pub profiles: PathBuf,
    /// Column mapping as a TOML file (`[columns]`, `[units]`, `[kinds]`, `model`).
    #[arg(long)]
    pub mapping: Option<PathBuf>,
    /// One column, `field=column` (fields: id, submit, duration,
    /// iterations, gpus, memory, kind, priority, model); repeatable, and
    /// overrides the mapping file.
    #[arg(long = "map", value_name = "FIELD=COLUMN")]
    pub map: Vec<String>,
    /// Unit of the submit column: us, ms, s, min or h.
    #[arg(long)]
    pub submit_unit: Option<String>,
    /// Unit of the duration column: us, ms, s, min or h.
    #[arg(long)]
    pub duration_unit: Option<String>,
    /// Unit of the memory column: B, KiB, MiB or GiB.
    #[arg(long)]
    pub memory_unit: Option<String>,
    /// Profile of jobs that name no model.
    #[arg(long)]
    pub model: Option<String>,
    /// Output trace; `-` for standard output.
    #[arg(long, default_value = "-")]
    pub out: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct GenArgs {
    /// Number of jobs.
    #[arg(long, default_value_t = 100)]
    pub jobs: usize,
    /// Random seed; the same seed gives the same trace.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Mean seconds between submissions (Poisson arrivals).
    #[arg(long, default_value_t = 5.0)]
    pub mean_interarrival: f64,
    /// Fraction of inference jobs, 0..=1.
    #[arg(long, default_value_t = 0.3)]
    pub inference_fraction: f64,
    /// Output file; `-` for standard output.
    #[arg(long, default_value = "-")]
    pub out: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        TraceCommand::Gen(g) => gen(g),
        TraceCommand::Import(i) => import(i),
        TraceCommand::Contention(c) => contention(c),
    }
}

fn contention(a: ContentionArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&a.runs)
        .with_context(|| format!("reading {}", a.runs.display()))?;
    let runs = Contention::read_coruns(&text).with_context(|| format!("{}", a.runs.display()))?;
    let table = Contention::fit(&runs).with_context(|| format!("{}", a.runs.display()))?;
    let body = format!(
        "# Fitted by `lanes trace contention` from {} co-runs in {}: each value\n\
         # is the mean of alone / beside over that pair's co-runs.\n{}",
        runs.len(),
        a.runs.display(),
        table.to_toml()
    );
    if a.out.as_os_str() == "-" {
        out!("{body}")?;
    } else {
        std::fs::write(&a.out, body).with_context(|| format!("writing {}", a.out.display()))?;
        eprintln!("wrote {}", a.out.display());
    }
    Ok(())
}

fn import(a: ImportArgs) -> anyhow::Result<()> {
    let mut mapping = match &a.mapping {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            Mapping::from_toml(&text).with_context(|| format!("{}", path.display()))?
        }
        None => Mapping::default(),
    };
    for m in &a.map {
        mapping.set(m)?;
    }
    if let Some(u) = &a.submit_unit {
        mapping.units.submit = u.parse::<TimeUnit>()?;
    }
    if let Some(u) = &a.duration_unit {
        mapping.units.duration = u.parse::<TimeUnit>()?;
    }
    if let Some(u) = &a.memory_unit {
        mapping.units.memory = u.parse::<MemoryUnit>()?;
    }
    if a.model.is_some() {
        mapping.model.clone_from(&a.model);
    }
    let open = |path: &PathBuf| {
        std::fs::File::open(path)
            .map(std::io::BufReader::new)
            .with_context(|| format!("opening {}", path.display()))
    };
    let profiles =
        read_profiles(open(&a.profiles)?).with_context(|| format!("{}", a.profiles.display()))?;
    let (jobs, stats) = import_jobs(open(&a.jobs)?, &mapping, &profiles)
        .with_context(|| format!("{}", a.jobs.display()))?;
    write_jobs(&a.out, &jobs)?;
    eprintln!(
        "read {} jobs: kept {}, left out {} asking for more than one GPU and {} asking for none",
        stats.read, stats.kept, stats.multi_gpu, stats.no_gpu
    );
    Ok(())
}

fn write_jobs(out: &PathBuf, jobs: &[TraceJob]) -> anyhow::Result<()> {
    if out.as_os_str() == "-" {
        let stdout = std::io::stdout();
        let mut lock = stdout.lock();
        write_trace(&mut lock, jobs)?;
        lock.flush()?;
    } else {
        let file =
            std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
        let mut w = std::io::BufWriter::new(file);
        write_trace(&mut w, jobs)?;
        w.flush()?;
        eprintln!("wrote {} jobs to {}", jobs.len(), out.display());
    }
    Ok(())
}

fn gen(g: GenArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        g.mean_interarrival.is_finite() && g.mean_interarrival > 0.0,
        "--mean-interarrival must be a positive number of seconds"
    );
    anyhow::ensure!(
        (0.0..=1.0).contains(&g.inference_fraction),
        "--inference-fraction must lie in 0..=1"
    );
    let jobs = generate(&GenConfig {
        jobs: g.jobs,
        seed: g.seed,
        mean_interarrival_s: g.mean_interarrival,
        inference_fraction: g.inference_fraction,
    });
    write_jobs(&g.out, &jobs)
}
