//! `lanes trace gen`: write a synthetic job trace (distributions in
//! docs/scheduling.md).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use lanes::sim::{generate, write_trace, GenConfig};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: TraceCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum TraceCommand {
    /// Generate a synthetic trace.
    Gen(GenArgs),
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
    }
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
    if g.out.as_os_str() == "-" {
        let stdout = std::io::stdout();
        let mut lock = stdout.lock();
        write_trace(&mut lock, &jobs)?;
        lock.flush()?;
    } else {
        let file = std::fs::File::create(&g.out)
            .with_context(|| format!("creating {}", g.out.display()))?;
        let mut w = std::io::BufWriter::new(file);
        write_trace(&mut w, &jobs)?;
        w.flush()?;
        eprintln!("wrote {} jobs to {}", jobs.len(), g.out.display());
    }
    Ok(())
}
