//! Golden schedules: small traces whose schedule under every policy was worked
//! out by hand (the derivations are the comments in each fixture), replayed
//! through the simulator with its simulated clock.
//!
//! Fixture format (`tests/fixtures/sched/*.txt`): `#` comments, `lanes N`,
//! `memory SIZE`, a `trace` … `end` block of CSV, then one `policy NAME` …
//! `end` block per policy with the expected schedule lines and JCT lines.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use lanes::sim::{read_trace, simulate, SimConfig};
use lanes::size::parse_size;
use lanes_policies::{by_name, POLICY_NAMES};

struct Fixture {
    lanes: usize,
    memory: u64,
    trace: String,
    expect: Vec<(String, Vec<String>)>,
}

fn parse(path: &Path) -> anyhow::Result<Fixture> {
    let text = std::fs::read_to_string(path)?;
    let mut lines = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'));
    let (mut lanes, mut memory, mut trace, mut expect) = (None, None, None, Vec::new());
    while let Some(line) = lines.next() {
        let mut block = || -> Vec<String> {
            lines
                .by_ref()
                .take_while(|l| *l != "end")
                .map(String::from)
                .collect()
        };
        match line.split_once(' ').unwrap_or((line, "")) {
            ("lanes", n) => lanes = Some(n.trim().parse()?),
            ("memory", m) => memory = Some(parse_size(m)?),
            ("trace", _) => trace = Some(block().join("\n")),
            ("policy", name) => expect.push((name.trim().to_string(), block())),
            _ => bail!("unexpected line {line:?}"),
        }
    }
    Ok(Fixture {
        lanes: lanes.context("no lanes line")?,
        memory: memory.context("no memory line")?,
        trace: trace.context("no trace block")?,
        expect,
    })
}

fn fixtures() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sched");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_fixture_matches_its_hand_worked_schedule_under_every_policy() {
    let files = fixtures();
    assert!(files.len() >= 2, "fixtures missing: {files:?}");
    let mut failures = Vec::new();
    for path in files {
        let fx = parse(&path).unwrap();
        let trace = read_trace(fx.trace.as_bytes()).unwrap();
        let names: Vec<&str> = fx.expect.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            POLICY_NAMES,
            "{}: one block per policy, in order",
            path.display()
        );
        for (name, expected) in &fx.expect {
            let mut policy = by_name(name).unwrap();
            let cfg = SimConfig {
                memory: fx.memory,
                lanes: fx.lanes,
            };
            let run = simulate(&trace, policy.as_mut(), cfg).unwrap();
            let mut got = run.schedule_lines();
            got.extend(run.jct_lines());
            if &got != expected {
                failures.push(format!(
                    "{} / {name}:\n expected:\n  {}\n got:\n  {}",
                    path.display(),
                    expected.join("\n  "),
                    got.join("\n  ")
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_job_larger_than_a_lane_is_refused_with_its_need() {
    let trace = read_trace(
        "job_id,submit_s,kind,iterations,iter_ms,persistent_bytes,ephemeral_bytes,priority\n\
         1,0,training,1,1,60,50,0\n"
            .as_bytes(),
    )
    .unwrap();
    let mut policy = by_name("fifo").unwrap();
    let err = simulate(
        &trace,
        policy.as_mut(),
        SimConfig {
            memory: 200,
            lanes: 2,
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            lanes::sim::SimError::JobNeverFits {
                job: 1,
                need: 110,
                capacity: 100
            }
        ),
        "{err}"
    );
}
