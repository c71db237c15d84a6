//! Real learning: an MLP trained on the UCI optical digits data
//! (`tests/data/digits.csv.gz`, 1797 8×8 images) reaches at least 95 %
//! accuracy on a held-out 20 % split. One Run of the training graph is one
//! iteration (forward, gradients, Adam updates in place). The main test
//! trains through real sockets against an embedded service.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use anyhow::{ensure, Context, Result};
use lanes::exec::cpu::CpuProgram;
use lanes::server::{self, ServerConfig};
use lanes_adaptor::{validate, Client, GraphLimits, Optimizer, SessionSpec, VarValues};

#[path = "util/digits.rs"]
mod data;
use data::*;

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
