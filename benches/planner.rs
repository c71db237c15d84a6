//! How long the memory planner takes on a ResNet-50-shaped inference graph
//! (batch 8, 224×224), and what it plans. Weights are declared as variables
//! without values: planning needs types only.
//!
//! `cargo bench --bench planner` (prints P, T, lower bound and no-reuse once).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use lanes::compile;
use lanes_adaptor::{
    validate, Conv2dAttrs, GraphBuilder, GraphLimits, Op, Outlet, Pool2dAttrs, TensorType,
    ValidGraph,
};

fn var(b: &mut GraphBuilder, shape: &[usize]) -> Outlet {
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

fn resnet50(batch: usize) -> ValidGraph {
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
    for (stage, (&blocks, &width)) in [3usize, 4, 6, 3]
        .iter()
        .zip(&[64usize, 128, 256, 512])
        .enumerate()
    {
        for i in 0..blocks {
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

fn bench(c: &mut Criterion) {
    let g = resnet50(8);
    let plan = compile::plan(&g).unwrap();
    compile::verify(&plan).unwrap();
    println!("resnet50-shaped inference, batch 8: {plan}");
    c.bench_function("plan resnet50-shaped inference b8", |bch| {
        bch.iter(|| compile::plan(std::hint::black_box(&g)).unwrap())
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
