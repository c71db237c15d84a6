//! Real learning: an MLP trained on the UCI optical digits data
//! (`tests/data/digits.csv.gz`, 1797 8×8 images) reaches at least 95 %
//! accuracy on a held-out 20 % split. One Run of the training graph is one
//! iteration (forward, gradients, Adam updates in place). The main test
//! trains through real sockets against an embedded service.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::Read;

use anyhow::{ensure, Context, Result};
use lanes::exec::cpu::CpuProgram;
use lanes::server::{self, ServerConfig};
use lanes_adaptor::zoo::Arch;
use lanes_adaptor::{validate, Client, GraphLimits, Optimizer, SessionSpec, Tensor, VarValues};

const BATCH: usize = 64;
const EPOCHS: usize = 25;

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
    let mut text = String::new();
    flate2::read::GzDecoder::new(f).read_to_string(&mut text)?;
    let mut d = Digits {
        x: Vec::new(),
        y: Vec::new(),
    };
    for (i, line) in text.lines().enumerate() {
        let v: Vec<f32> = line
            .split(',')
            .map(|s| s.trim().parse::<f32>())
            .collect::<Result<_, _>>()
            .with_context(|| format!("line {}", i + 1))?;
        ensure!(v.len() == 65, "line {}: {} values", i + 1, v.len());
        let mut px = [0f32; 64];
        for (p, &s) in px.iter_mut().zip(&v[..64]) {
            *p = s / 16.0;
        }
        d.x.push(px);
        d.y.push(v[64] as i64);
    }
    ensure!(d.x.len() == 1797, "expected 1797 rows, got {}", d.x.len());
    Ok(d)
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

fn split(d: &Digits) -> (Vec<usize>, Vec<usize>) {
    let perm = permutation(d.x.len(), 2024);
    let (test, train) = perm.split_at(d.x.len() / 5);
    (test.to_vec(), train.to_vec())
}

fn report(how: &str, first: f32, last: f32, acc: f32, n: usize) -> Result<()> {
    eprintln!(
        "digits MLP ({how}): loss {first:.3} -> {last:.3}, held-out accuracy {:.1}% on {n} images",
        acc * 100.0
    );
    ensure!(last < first, "loss did not fall: {first} -> {last}");
    ensure!(acc >= 0.95, "held-out accuracy {acc} < 0.95");
    Ok(())
}

/// The requirement: training through real sockets. An embedded service on a
/// loopback port; the job trains through `Client` (LoadGraph once, one Run
/// per iteration), reads the trained variables back (ReadVariables) and
/// evaluates them in a second, inference session.
#[test]
fn mlp_learns_digits_through_the_service() -> Result<()> {
    let d = load_digits()?;
    let (test, train) = split(&d);
    let service = server::start(ServerConfig {
        endpoint: "tcp://127.0.0.1:*".into(),
        workers: 2,
        ..ServerConfig::default()
    })?;
    let mut client = Client::connect(service.endpoint())?;
    let (t, _) = mlp().training(BATCH, 1, &Optimizer::adam(1e-2))?;
    let mut s = client.open_session(SessionSpec::training("digits-mlp"))?;
    s.load(&t.graph, t.vars)?;
    let (first, last) = train_epochs(&d, &train, |x, y| {
        let out = s.run(vec![("input", x), ("labels", y)], &[t.loss.as_str()])?;
        Ok(out.first().context("no loss")?.f32s()?[0])
    })?;
    let trained = s.read_variables(&[])?;
    s.close()?;

    let m = mlp().inference(test.len(), 0)?;
    let params: VarValues = trained
        .into_iter()
        .filter(|(k, _)| m.vars.contains_key(k))
        .collect();
    ensure!(params.len() == m.vars.len(), "trained variables missing");
    let mut e = client.open_session(SessionSpec::inference("digits-eval"))?;
    e.load(&m.graph, params)?;
    let (x, _) = batch(&d, &test);
    let logits = e.run(vec![("input", x)], &[m.output.as_str()])?;
    e.close()?;
    drop(client);
    service.shutdown()?;
    let acc = accuracy(&d, &test, logits.first().context("no logits")?)?;
    report("through the service", first, last, acc, test.len())
}

/// The same training on the CPU backend directly (cheap; isolates the
/// numerics from the transport when the socket test fails).
#[test]
fn mlp_learns_digits_on_the_cpu_backend() -> Result<()> {
    let d = load_digits()?;
    let (test, train) = split(&d);
    let (t, _) = mlp().training(BATCH, 1, &Optimizer::adam(1e-2))?;
    let loss_key = t.loss.clone();
    let mut p = CpuProgram::new(validate(t.graph, &GraphLimits::default())?, t.vars)?;
    let (first, last) = train_epochs(&d, &train, |x, y| {
        let feeds = BTreeMap::from([("input".to_string(), x), ("labels".to_string(), y)]);
        Ok(p.run(&feeds, std::slice::from_ref(&loss_key))?[0].f32s()?[0])
    })?;
    let m = mlp().inference(test.len(), 0)?;
    let params: VarValues = p
        .read_variables(&[])?
        .into_iter()
        .filter(|(k, _)| m.vars.contains_key(k))
        .collect();
    let mut e = CpuProgram::new(validate(m.graph, &GraphLimits::default())?, params)?;
    let (x, _) = batch(&d, &test);
    let logits = e.run(&BTreeMap::from([("input".to_string(), x)]), &[m.output])?;
    let acc = accuracy(&d, &test, &logits[0])?;
    report("CPU backend direct", first, last, acc, test.len())
}
