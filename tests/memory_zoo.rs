//! Planner quality on model-sized graphs: planned T against the lower bound
//! (largest total of tensors live at one step) and against no reuse.
//! Goal: T <= 1.10 × lower bound. Every plan is also checked by `verify`.
//!
//! `cargo test --release --test memory_zoo -- --nocapture` prints the table
//! that docs/memory.md quotes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use lanes::compile::{self, MemoryPlan};
use lanes_adaptor::{
    validate, Conv2dAttrs, GraphBuilder, GraphLimits, Op, Outlet, Pool2dAttrs, TensorType,
    ValidGraph,
};

fn var(b: &mut GraphBuilder, shape: &[usize]) -> Outlet {
    // Planning needs types only: variables are declared without values.
    b.op1(Op::Variable(TensorType::f32(shape.to_vec())), &[])
}

fn conv_bn(
    b: &mut GraphBuilder,
    x: Outlet,
    out: usize,
    k: usize,
    stride: usize,
    relu: bool,
) -> Outlet {
    let c = b.dims(x)[1];
    let w = var(b, &[out, c, k, k]);
    let attrs = Conv2dAttrs {
        stride: [stride, stride],
        padding: [k / 2, k / 2],
        ..Conv2dAttrs::default()
    };
    let y = b.conv2d(x, w, None, attrs);
    let (g, be, m, v) = (
        var(b, &[out]),
        var(b, &[out]),
        var(b, &[out]),
        var(b, &[out]),
    );
    let y = b.batch_norm(y, g, be, m, v, 1e-5);
    if relu {
        b.relu(y)
    } else {
        y
    }
}

/// ResNet with bottleneck blocks (ResNet-50: [3, 4, 6, 3]; -152: [3, 8, 36, 3]).
fn resnet(blocks: [usize; 4], batch: usize) -> ValidGraph {
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", TensorType::f32([batch, 3, 224, 224]));
    let mut h = conv_bn(&mut b, x, 64, 7, 2, true);
    h = b.max_pool2d(
        h,
        Pool2dAttrs {
            kernel: [3, 3],
            stride: [2, 2],
            padding: [1, 1],
        },
    );
    let mut c_in = 64;
    for (stage, (&n, &width)) in blocks.iter().zip(&[64usize, 128, 256, 512]).enumerate() {
        for i in 0..n {
            let stride = if i == 0 && stage > 0 { 2 } else { 1 };
            let a = conv_bn(&mut b, h, width, 1, 1, true);
            let a = conv_bn(&mut b, a, width, 3, stride, true);
            let a = conv_bn(&mut b, a, width * 4, 1, 1, false);
            let short = if c_in != width * 4 || stride != 1 {
                conv_bn(&mut b, h, width * 4, 1, stride, false)
            } else {
                h
            };
            let s = b.add(a, short);
            h = b.relu(s);
            c_in = width * 4;
        }
    }
    let p = b.global_avg_pool(h);
    let w = var(&mut b, &[2048, 1000]);
    let logits = b.matmul(p, w);
    b.set_name(logits, "logits");
    let (g, _) = b.finish().unwrap();
    validate(g, &GraphLimits::default()).unwrap()
}

/// BERT-base encoder (12 layers, hidden 768, 12 heads, FFN 3072), inference.
fn bert_base(batch: usize, seq: usize) -> ValidGraph {
    let (hid, heads, ffn) = (768usize, 12usize, 3072usize);
    let dh = hid / heads;
    let mut b = GraphBuilder::new();
    let ids = b.placeholder("ids", TensorType::i64([batch, seq]));
    let table = var(&mut b, &[30522, hid]);
    let pos = var(&mut b, &[seq, hid]);
    let e = b.embedding(table, ids);
    let e = b.add(e, pos);
    let (g0, b0) = (var(&mut b, &[hid]), var(&mut b, &[hid]));
    let mut x = b.layer_norm(e, g0, b0, 1e-12);
    for _ in 0..12 {
        let mut proj = |b: &mut GraphBuilder, x: Outlet, i: usize, o: usize| {
            let w = var(b, &[i, o]);
            let bias = var(b, &[o]);
            let y = b.matmul(x, w);
            b.add(y, bias)
        };
        let heads_of = |b: &mut GraphBuilder, t: Outlet| {
            let t = b.reshape(t, &[batch, seq, heads, dh]);
            b.transpose(t, &[0, 2, 1, 3])
        };
        let q = proj(&mut b, x, hid, hid);
        let k = proj(&mut b, x, hid, hid);
        let v = proj(&mut b, x, hid, hid);
        let (q, k, v) = (
            heads_of(&mut b, q),
            heads_of(&mut b, k),
            heads_of(&mut b, v),
        );
        let s = b.matmul_t(q, k, false, true);
        let s = b.scale(s, 1.0 / (dh as f32).sqrt());
        let p = b.softmax(s, 3);
        let c = b.matmul(p, v);
        let c = b.transpose(c, &[0, 2, 1, 3]);
        let c = b.reshape(c, &[batch, seq, hid]);
        let o = proj(&mut b, c, hid, hid);
        let r = b.add(o, x);
        let (g1, b1) = (var(&mut b, &[hid]), var(&mut b, &[hid]));
        let h = b.layer_norm(r, g1, b1, 1e-12);
        let f = proj(&mut b, h, hid, ffn);
        let f = b.gelu(f);
        let f = proj(&mut b, f, ffn, hid);
        let r = b.add(f, h);
        let (g2, b2) = (var(&mut b, &[hid]), var(&mut b, &[hid]));
        x = b.layer_norm(r, g2, b2, 1e-12);
    }
    b.set_name(x, "hidden");
    let (g, _) = b.finish().unwrap();
    validate(g, &GraphLimits::default()).unwrap()
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn row(name: &str, g: &ValidGraph) -> MemoryPlan {
    let p = compile::plan(g).unwrap();
    compile::verify(&p).unwrap();
    println!(
        "| {name} | {} | {:.1} | {:.1} | {:.1} | {:.3} | {:.1} | {} |",
        p.tensors.len(),
        mib(p.persistent),
        mib(p.ephemeral),
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
        "| model | tensors | P MiB | T MiB | lower bound MiB | T / bound | no reuse MiB | order |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let cases: Vec<(&str, ValidGraph)> = vec![
        ("ResNet-50 inference b8", resnet([3, 4, 6, 3], 8)),
        ("ResNet-152 inference b8", resnet([3, 8, 36, 3], 8)),
        ("BERT-base inference b8 s128", bert_base(8, 128)),
    ];
    for (name, g) in &cases {
        let p = row(name, g);
        assert!(
            p.ephemeral as f64 <= 1.10 * p.lower_bound as f64,
            "{name}: T = {} is more than 1.10 x the lower bound {}",
            p.ephemeral,
            p.lower_bound
        );
        assert!(p.lower_bound <= p.ephemeral && p.ephemeral < p.no_reuse);
    }
}
