//! The training part of `lanes demo`: a training job and a small
//! learning-rate sweep on the UCI digits data, each configuration its own
//! session on its own connection, trained side by side through the embedded
//! service. Prints each configuration's loss at the start and the end, its
//! held-out accuracy, and the best configuration.

use std::time::Instant;

use anyhow::{Context, Result};
use lanes_adaptor::zoo::Arch;
use lanes_adaptor::{Client, Optimizer, SessionSpec, Tensor};

/// The UCI optical digits (see `tests/data/README.md`), embedded so the demo
/// needs no files.
const DIGITS_GZ: &[u8] = include_bytes!("../../tests/data/digits.csv.gz");
const BATCH: usize = 64;

struct Digits {
    x: Vec<f32>,
    y: Vec<i64>,
}

impl Digits {
    fn len(&self) -> usize {
        self.y.len()
    }
    fn batch(&self, idx: &[usize]) -> Result<(Tensor, Tensor)> {
        let x: Vec<f32> = idx
            .iter()
            .flat_map(|&i| self.x[i * 64..(i + 1) * 64].iter().copied())
            .collect();
        let y: Vec<i64> = idx.iter().map(|&i| self.y[i]).collect();
        Ok((
            Tensor::from_f32([idx.len(), 64], x)?,
            Tensor::from_i64([idx.len()], y)?,
        ))
    }
}

fn load_digits() -> Result<Digits> {
    let (x, y) = super::digits::parse(DIGITS_GZ)?;
    Ok(Digits {
        x: x.into_iter().flatten().collect(),
        y,
    })
}

fn permutation(n: usize, seed: u64) -> Vec<usize> {
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

/// What one configuration reports.
#[derive(Debug, Clone)]
struct Outcome {
    name: String,
    loss_start: f32,
    loss_end: f32,
    accuracy: f32,
    seconds: f64,
}

fn mlp() -> Arch {
    Arch::Mlp {
        inputs: 64,
        hidden: vec![64],
        classes: 10,
    }
}

/// Trains one configuration in its own session, then evaluates the trained
/// variables in an inference session.
fn train_one(
    endpoint: &str,
    name: &str,
    opt: Optimizer,
    iterations: usize,
    d: &Digits,
    train: &[usize],
    test: &[usize],
) -> Result<Outcome> {
    let start = Instant::now();
    let (t, _) = mlp().training(BATCH, 1, &opt)?;
    let mut client = Client::connect(endpoint).with_context(|| format!("{name}: connect"))?;
    let mut s = client
        .open_session(SessionSpec::training(name).with_expected_iterations(iterations as u64))?;
    s.load(&t.graph, t.vars)
        .with_context(|| format!("{name}: load"))?;
    let (mut first, mut last) = (f32::NAN, f32::NAN);
    let mut order = Vec::new();
    for it in 0..iterations {
        let per_epoch = train.len() / BATCH;
        if it % per_epoch == 0 {
            order = permutation(train.len(), (it / per_epoch) as u64);
        }
        let k = it % per_epoch;
        let idx: Vec<usize> = order[k * BATCH..(k + 1) * BATCH]
            .iter()
            .map(|&i| train[i])
            .collect();
        let (x, y) = d.batch(&idx)?;
        let out = s
            .run(vec![("input", x), ("labels", y)], &[t.loss.as_str()])
            .with_context(|| format!("{name}: iteration {it}"))?;
        let l = out
            .first()
            .map(|t| t.f32s())
            .transpose()?
            .and_then(|v| v.first().copied());
        last = l.unwrap_or(f32::NAN);
        if it == 0 {
            first = last;
        }
    }
    let params = s.read_variables(&[])?;
    s.close()?;
    // Evaluate on the held-out rows in an inference session.
    let m = mlp().inference(test.len(), 0)?;
    let vars = params
        .into_iter()
        .filter(|(k, _)| m.vars.contains_key(k))
        .collect();
    let mut e = client.open_session(SessionSpec::inference(format!("{name}-eval")))?;
    e.load(&m.graph, vars)?;
    let (x, _) = d.batch(test)?;
    let logits = e.run(vec![("input", x)], &[m.output.as_str()])?;
    e.close()?;
    let l = logits.first().context("no logits")?.f32s()?;
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
    Ok(Outcome {
        name: name.to_string(),
        loss_start: first,
        loss_end: last,
        accuracy: correct as f32 / test.len().max(1) as f32,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Runs the training job and the sweep against the service at `endpoint`.
pub fn run(endpoint: &str, iterations: usize) -> Result<()> {
    let d = load_digits()?;
    let perm = permutation(d.len(), 2024);
    let (test, train) = perm.split_at(d.len() / 5);
    let mut configs: Vec<(String, Optimizer)> =
        vec![("train-adam-1e-2".into(), Optimizer::adam(1e-2))];
    for lr in [0.003f32, 0.03, 0.3] {
        configs.push((
            format!("sweep-sgd-lr{lr}"),
            Optimizer::sgd_momentum(lr, 0.9, 0.0),
        ));
    }
    outln!(
        "training on UCI digits: MLP 64-64-10, batch {BATCH}, {iterations} iterations, {} train / {} held out",
        train.len(),
        test.len()
    )?;
    let outcomes: Vec<Result<Outcome>> = std::thread::scope(|scope| {
        let handles: Vec<_> = configs
            .iter()
            .map(|(name, opt)| {
                let d = &d;
                scope.spawn(move || train_one(endpoint, name, *opt, iterations, d, train, test))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("training thread panicked")))
            })
            .collect()
    });
    outln!(
        "{:<20} {:>11} {:>9} {:>9} {:>9}",
        "config",
        "loss start",
        "loss end",
        "held-out",
        "seconds"
    )?;
    let mut best: Option<Outcome> = None;
    for o in outcomes {
        let o = o?;
        outln!(
            "{:<20} {:>11.4} {:>9.4} {:>8.1}% {:>9.2}",
            o.name,
            o.loss_start,
            o.loss_end,
            o.accuracy * 100.0,
            o.seconds
        )?;
        if o.name.starts_with("sweep") && best.as_ref().is_none_or(|b| o.accuracy > b.accuracy) {
            best = Some(o);
        }
    }
    if let Some(b) = best {
        outln!(
            "best sweep configuration: {} ({:.1}% held out, loss {:.4})",
            b.name,
            b.accuracy * 100.0,
            b.loss_end
        )?;
    }
    Ok(())
}
