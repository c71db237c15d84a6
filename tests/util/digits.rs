//! The UCI optical digits data (`tests/data/digits.csv.gz`, 1797 8×8
//! images, 10 classes) and a small MLP trained on it: shared by the tests
//! that check real learning (digits.rs, precision.rs).

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use anyhow::{ensure, Context, Result};
use lanes_adaptor::zoo::Arch;
use lanes_adaptor::Tensor;

#[path = "../../src/cli/digits.rs"]
mod csv;

pub const BATCH: usize = 64;
pub const EPOCHS: usize = 25;

#[derive(Debug)]
pub struct Digits {
    pub x: Vec<[f32; 64]>,
    pub y: Vec<i64>,
}

/// Reads the gzipped CSV: 64 pixel values 0..16, then the label 0..9.
pub fn load_digits() -> Result<Digits> {
    // Cargo's path, or the repository-relative one where test binaries were
    // copied to another machine (the GPU machine runs them from the repo root).
    let built = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/digits.csv.gz");
    let path = if std::path::Path::new(built).exists() {
        built
    } else {
        "tests/data/digits.csv.gz"
    };
    let f = std::fs::File::open(path).with_context(|| path.to_string())?;
    let (x, y) = csv::parse(f)?;
    Ok(Digits { x, y })
}

/// Deterministic permutation (Fisher–Yates with an LCG).
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut s = seed;
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        p.swap(i, (s >> 33) as usize % (i + 1));
    }
    p
}

pub fn batch(d: &Digits, idx: &[usize]) -> (Tensor, Tensor) {
    let x: Vec<f32> = idx.iter().flat_map(|&i| d.x[i]).collect();
    let y: Vec<i64> = idx.iter().map(|&i| d.y[i]).collect();
    (
        Tensor::from_f32([idx.len(), 64], x).unwrap(),
        Tensor::from_i64([idx.len()], y).unwrap(),
    )
}

pub fn mlp() -> Arch {
    Arch::Mlp {
        inputs: 64,
        hidden: vec![64],
        classes: 10,
    }
}

/// Fraction of `test` rows whose arg-max logit is the label.
pub fn accuracy(d: &Digits, test: &[usize], logits: &Tensor) -> Result<f32> {
    let l = logits.f32s()?;
    ensure!(l.len() == test.len() * 10, "logits {}", logits.shape());
    let correct = test
        .iter()
        .enumerate()
        .filter(|(r, &i)| {
            let row = &l[r * 10..(r + 1) * 10];
            (0..10)
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .is_some_and(|c| c as i64 == d.y[i])
        })
        .count();
    Ok(correct as f32 / test.len() as f32)
}

/// Runs `EPOCHS` epochs of shuffled mini-batches through `step`, which runs
/// one iteration and returns the loss; returns the first and last loss.
pub fn train_epochs(
    d: &Digits,
    train: &[usize],
    mut step: impl FnMut(Tensor, Tensor) -> Result<f32>,
) -> Result<(f32, f32)> {
    let mut first = None;
    let mut last = f32::NAN;
    for epoch in 0..EPOCHS {
        let order = permutation(train.len(), epoch as u64);
        for chunk in order.chunks_exact(BATCH) {
            let idx: Vec<usize> = chunk.iter().map(|&i| train[i]).collect();
            let (x, y) = batch(d, &idx);
            last = step(x, y)?;
            first.get_or_insert(last);
        }
    }
    Ok((first.unwrap_or(f32::NAN), last))
}

/// The held-out 20 % (test) and the rest (train), a fixed permutation.
pub fn split(d: &Digits) -> (Vec<usize>, Vec<usize>) {
    let perm = permutation(d.x.len(), 2024);
    let (test, train) = perm.split_at(d.x.len() / 5);
    (test.to_vec(), train.to_vec())
}
