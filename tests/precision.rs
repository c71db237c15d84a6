//! Mixed and half precision on the CPU reference backend (docs/precision.md):
//! a bf16-mixed or fp16-mixed (loss-scaled) training run learns a real task
//! as fp32 does, a model served in bf16 or fp16 answers as in fp32 within
//! the dtype's rounding, and its weights take half the persistent memory.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use anyhow::{ensure, Result};
use lanes::exec::cpu::CpuProgram;
use lanes_adaptor::zoo::Arch;
use lanes_adaptor::{amp, validate, GraphLimits, Optimizer, Precision, Tensor, VarValues};

#[path = "util/digits.rs"]
mod data;
use data::*;

/// Trains the digits MLP in `precision` from seed 1 (the same initial
/// weights for every precision) on the CPU backend; returns the mean loss
/// of the last epoch and the held-out accuracy.
fn train_digits(precision: Precision) -> Result<(f32, f32)> {
    let d = load_digits()?;
    let (test, train) = split(&d);
    let (t, _) = mlp().training_at(BATCH, 1, &Optimizer::adam(1e-2), precision)?;
    let loss_key = t.loss.clone();
    let mut p = CpuProgram::new(validate(t.graph, &GraphLimits::default())?, t.vars)?;
    let per_epoch = train.len() / BATCH;
    let mut losses = Vec::new();
    train_epochs(&d, &train, |x, y| {
        let feeds = BTreeMap::from([("input".to_string(), x), ("labels".to_string(), y)]);
        let l = p.run(&feeds, std::slice::from_ref(&loss_key))?[0].f32s()?[0];
        losses.push(l);
        Ok(l)
    })?;
    let last: f32 = losses[losses.len() - per_epoch..].iter().sum::<f32>() / per_epoch as f32;
    // The trained f32 master weights, evaluated in f32.
    let m = mlp().inference(test.len(), 0)?;
    let params: VarValues = p
        .read_variables(&[])?
        .into_iter()
        .filter(|(k, _)| m.vars.contains_key(k))
        .collect();
    for (k, v) in &params {
        ensure!(
            v.dtype() == lanes_adaptor::DType::F32,
            "{k} is {}",
            v.dtype()
        );
    }
    let mut e = CpuProgram::new(validate(m.graph, &GraphLimits::default())?, params)?;
    let (x, _) = batch(&d, &test);
    let logits = e.run(&BTreeMap::from([("input".to_string(), x)]), &[m.output])?;
    Ok((last, accuracy(&d, &test, &logits[0])?))
}

/// bf16-mixed and fp16-mixed reach fp32's accuracy on held-out digits
/// (within 2 points: 7 of 359 images) and a last-epoch loss within 0.05 of
/// fp32's. bf16 keeps 8 significant bits, so its products differ from
/// fp32's by up to 2⁻⁸ relative; fp16 keeps 11 but has a narrow range, so
/// its step scales the loss (2^16 at first, halved on an overflow). Adam's
/// steps are in f32 on f32 master weights, so the difference stays a
/// perturbation of the path, not a bias.
#[test]
fn mixed_training_learns_digits_as_fp32_does() -> Result<()> {
    let (loss32, acc32) = train_digits(Precision::F32)?;
    for precision in [Precision::Bf16Mixed, Precision::F16Mixed] {
        let (loss16, acc16) = train_digits(precision)?;
        eprintln!(
            "digits MLP, last-epoch loss / held-out accuracy: fp32 {loss32:.4} / {acc32:.3}, \
             {precision} {loss16:.4} / {acc16:.3}"
        );
        ensure!(acc16 >= 0.95, "{precision} accuracy {acc16} < 0.95");
        ensure!(
            (acc16 - acc32).abs() <= 0.02,
            "{precision} accuracy {acc16} vs fp32 {acc32}"
        );
        ensure!(
            (loss16 - loss32).abs() <= 0.05,
            "{precision} loss {loss16} vs fp32 {loss32}"
        );
    }
    Ok(())
}

/// The logits of a model served in `precision`, and its persistent bytes,
/// beside fp32's for the same weights and input.
fn serve(arch: &Arch, batch: usize, precision: Precision) -> Result<(Vec<f32>, u64)> {
    let m = arch.inference(batch, 3)?;
    let (graph, vars) = amp::apply(m.graph, m.vars, precision)?;
    let mut p = CpuProgram::new(validate(graph, &GraphLimits::default())?, vars)?;
    let feeds: BTreeMap<String, Tensor> = m
        .inputs
        .iter()
        .map(|(name, ty)| {
            let n = ty.shape.numel();
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
                .collect();
            (name.clone(), Tensor::from_f32(ty.shape.clone(), v).unwrap())
        })
        .collect();
    let out = p.run(&feeds, &[m.output])?;
    ensure!(
        out[0].dtype() == lanes_adaptor::DType::F32,
        "outputs come back f32"
    );
    Ok((out[0].f32s()?.to_vec(), p.persistent_bytes()))
}

/// Served in bf16 / fp16 (weights stored in half), an MLP and a small
/// CNN answer like fp32 within the rounding of a few layers of half
/// products (bf16: 3 % of the logits' range, fp16: 0.5 %), and their
/// weights take half the persistent bytes.
#[test]
fn half_serving_answers_like_fp32_in_half_the_weight_memory() -> Result<()> {
    let mlp = Arch::Mlp {
        inputs: 64,
        hidden: vec![128, 64],
        classes: 10,
    };
    let lenet = Arch::LeNet {
        channels: 1,
        image: 28,
        classes: 10,
    };
    for (arch, name) in [(&mlp, "mlp"), (&lenet, "lenet")] {
        let (want, p32) = serve(arch, 4, Precision::F32)?;
        let range = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
        for (precision, tol) in [(Precision::Bf16, 3e-2), (Precision::F16, 5e-3)] {
            let (got, p16) = serve(arch, 4, precision)?;
            let worst = want
                .iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs() / range)
                .fold(0f32, f32::max);
            eprintln!(
                "{name} at {precision}: worst difference {worst:.2e} of the range {range:.3}"
            );
            ensure!(worst <= tol, "{name} at {precision}: {worst} > {tol}");
            ensure!(got != want, "{name} at {precision}: no rounding at all?");
            // Within alignment padding of half (LeNet's are all products'
            // weights too: convolutions and linear layers).
            let half = p32 as f64 / 2.0;
            ensure!(
                (p16 as f64 - half).abs() <= 0.01 * half + 1024.0,
                "{name}: P {p16} at {precision}, {p32} at fp32"
            );
        }
    }
    Ok(())
}
