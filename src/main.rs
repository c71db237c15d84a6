//! The `lanes` command line.

fn main() -> anyhow::Result<()> {
    Ok(())
}
