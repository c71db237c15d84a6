//! Planner quality on model-sized graphs: planned T against the lower bound
//! (largest total of tensors live at one step) and against no reuse.
//! Goal: T <= 1.10 × lower bound. Every plan is also checked by `verify`,
//! and planned again without views (`PlanOptions::views` off: every
//! reshape a copy) to check that views never make T larger.
//!
//! The graphs come from `tests/memory/models.rs` (built with
//! `GraphBuilder`): ResNet-50/152, Inception-v3 and BERT-base, inference
//! and training. In training graphs forward activations live until their
//! backward use, as in any training step.
//!
//! `cargo test --test memory_zoo -- --nocapture` prints the table
//! that docs/memory.md quotes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use lanes::compile::{self, MemoryPlan, PlanOptions};
use lanes_adaptor::ValidGraph;

#[path = "memory/models.rs"]
mod models;
use models::{bert_base, inception_v3, resnet};

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// Plans `g` with views and without (every reshape a copy, as before
/// views); prints the row and checks that views never make P or T larger.
fn row(name: &str, g: &ValidGraph) -> MemoryPlan {
    let p = compile::plan(g).unwrap();
    compile::verify(&p).unwrap();
    let apart = compile::plan_outlets(
        g,
        compile::sinks(g),
        PlanOptions {
            views: false,
            ..PlanOptions::default()
        },
    )
    .unwrap();
    compile::verify(&apart).unwrap();
    assert_eq!(apart.views(), 0);
    assert_eq!(p.persistent, apart.persistent, "{name}: P changed");
    assert!(p.ephemeral <= apart.ephemeral, "{name}: views grew T");
    assert!(p.lower_bound <= apart.lower_bound, "{name}");
    println!(
        "| {name} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.3} | {:.1} | {} |",
        p.tensors.len(),
        p.views(),
        mib(p.persistent),
        mib(p.ephemeral),
        mib(apart.ephemeral),
        mib(p.lower_bound),
        p.ratio_to_lower_bound(),
        mib(p.no_reuse),
        p.strategy
    );
    p
}

#[test]
fn zoo_plans_within_ten_percent_of_the_lower_bound() {
    println!(
        "| model | tensors | views | P MiB | T MiB | T without views MiB | lower bound MiB | T / bound | no reuse MiB | order |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let cases: Vec<(&str, ValidGraph)> = vec![
        ("ResNet-50 inference b8", resnet([3, 4, 6, 3], 8, false)),
        ("ResNet-50 training b8", resnet([3, 4, 6, 3], 8, true)),
        ("ResNet-152 inference b8", resnet([3, 8, 36, 3], 8, false)),
        ("ResNet-152 training b8", resnet([3, 8, 36, 3], 8, true)),
        ("Inception-v3 inference b8", inception_v3(8, false)),
        ("Inception-v3 training b8", inception_v3(8, true)),
        ("BERT-base inference b8 s128", bert_base(8, 128, false)),
        ("BERT-base training b8 s128", bert_base(8, 128, true)),
    ];
    let mut worst: f64 = 0.0;
    for (name, g) in &cases {
        let p = row(name, g);
        worst = worst.max(p.ratio_to_lower_bound());
        assert!(p.lower_bound <= p.ephemeral && p.ephemeral < p.no_reuse);
    }
    assert!(worst <= 1.10, "worst T / lower bound is {worst:.3}");
}
