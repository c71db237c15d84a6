//! The UCI optical digits CSV (`tests/data/digits.csv.gz`): 1797 rows of
//! 64 pixel values 0..16 and a label 0..9. Read by `lanes demo` and by
//! the tests that check real learning (`tests/util/digits.rs` includes
//! this file).

use std::io::Read;

use anyhow::{ensure, Context, Result};

/// The gzipped CSV's rows: each image's 64 pixels scaled to [0, 1], and
/// its label.
pub fn parse(gz: impl Read) -> Result<(Vec<[f32; 64]>, Vec<i64>)> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(gz).read_to_string(&mut text)?;
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for (i, line) in text.lines().enumerate() {
        let v: Vec<f32> = line
            .split(',')
            .map(|s| s.trim().parse::<f32>())
            .collect::<Result<_, _>>()
            .with_context(|| format!("digits line {}", i + 1))?;
        ensure!(v.len() == 65, "digits line {}: {} values", i + 1, v.len());
        let mut px = [0f32; 64];
        for (p, &s) in px.iter_mut().zip(&v[..64]) {
            *p = s / 16.0;
        }
        x.push(px);
        y.push(v[64] as i64);
    }
    ensure!(
        x.len() == 1797,
        "expected 1797 digits rows, got {}",
        x.len()
    );
    Ok((x, y))
}
