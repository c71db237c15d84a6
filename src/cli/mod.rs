//! Subcommands of the `lanes` binary, one module each. Errors are reported
//! with `anyhow`; the library underneath uses typed errors.

pub mod bench;
pub mod demo;
pub mod demo_train;
pub mod import;
pub mod replay;
pub mod serve;
pub mod simulate;
pub mod status;
pub mod trace;
