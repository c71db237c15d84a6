//! The `lanes` command line.

mod cli;

use clap::{Parser, Subcommand};

/// Lanes: many deep-learning jobs sharing one GPU.
#[derive(Debug, Parser)]
#[command(name = "lanes", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the execution service.
    Serve(cli::serve::Args),
    /// Every GPU of the host: one `lanes serve` per GPU, each on its own
    /// endpoint (a directory file lists them).
    Host(cli::host::Args),
    /// Start an embedded service and run several jobs through real sockets.
    Demo(cli::demo::Args),
    /// Show a running service's sessions, lanes and queues.
    Status(cli::status::Args),
    /// Simulate a job trace under one or all scheduling policies.
    Simulate(cli::simulate::Args),
    /// Job traces: generate synthetic ones.
    Trace(cli::trace::Args),
    /// Replay a trace against a live service with real jobs.
    Replay(cli::replay::Args),
    /// Benchmarks: executor latency of reference models (JSON).
    Bench(cli::bench::Args),
    /// Import an ONNX model: summary, exact P and T, and a check against
    /// reference outputs on the CPU backend.
    Import(cli::import::Args),
}

/// Runs the command; an error is printed as its message and causes, never
/// with a stack trace (a user's mistake is not a crash, whatever
/// `RUST_BACKTRACE` says), and the exit status is 1. A cause whose text the
/// message already shows is not repeated, a closed standard output
/// (`lanes simulate … | head -1`) ends the command quietly, and an error a
/// child process already printed is not printed again.
fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(a) => cli::serve::run(a),
        Command::Host(a) => cli::host::run(a),
        Command::Demo(a) => cli::demo::run(a),
        Command::Status(a) => cli::status::run(a),
        Command::Simulate(a) => cli::simulate::run(a),
        Command::Trace(a) => cli::trace::run(a),
        Command::Replay(a) => cli::replay::run(a),
        Command::Bench(a) => cli::bench::run(a),
        Command::Import(a) => cli::import::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) if cli::broken_pipe(&e) => std::process::ExitCode::SUCCESS,
        Err(e) if e.is::<cli::AlreadyReported>() => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprint!("{}", cli::report(&e));
            std::process::ExitCode::FAILURE
        }
    }
}
