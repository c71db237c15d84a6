//! Backward ops and in-place updates (optimizers, assignments) against
//! the CPU.

use super::*;

#[test]
#[ignore = "needs a GPU"]
fn backward_ops() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut cases = Vec::new();
    let s = [3, 5, 6];
    let xt = |rng: &mut StdRng| rnd(rng, &s, -2.0, 2.0);
    cases.push(single(
        "relu_grad",
        Op::ReluGrad,
        vec![xt(&mut rng), xt(&mut rng)],
        FP32,
    ));
    cases.push(single(
        "gelu_grad",
        Op::GeluGrad,
        vec![xt(&mut rng), xt(&mut rng)],
        FP32,
    ));
    for (name, op) in [
        ("hard_sigmoid_grad", Op::HardSigmoidGrad),
        ("hard_swish_grad", Op::HardSwishGrad),
    ] {
        let x = rnd(&mut rng, &s, -5.0, 5.0);
        cases.push(single(name, op, vec![x, xt(&mut rng)], FP32));
    }
    cases.push(single(
        "sigmoid_grad",
        Op::SigmoidGrad,
        vec![rnd(&mut rng, &s, 0.0, 1.0), xt(&mut rng)],
        FP32,
    ));
    cases.push(single(
        "tanh_grad",
        Op::TanhGrad,
        vec![rnd(&mut rng, &s, -1.0, 1.0), xt(&mut rng)],
        FP32,
    ));
    // y must be a real softmax output for the identities to hold; any y
    // still checks the formula.
    cases.push(single(
        "softmax_grad",
        Op::SoftmaxGrad { axis: 1 },
        vec![rnd(&mut rng, &s, 0.0, 1.0), xt(&mut rng)],
        FP32,
    ));
    cases.push(single(
        "log_softmax_grad",
        Op::LogSoftmaxGrad { axis: 2 },
        vec![rnd(&mut rng, &s, -3.0, 0.0), xt(&mut rng)],
        FP32,
    ));
    {
        // ReduceMaxGrad needs y = max(x): build it from ReduceMax.
        let mut c = Case::new("reduce_max_grad");
        let x = c.input("x", xt(&mut rng));
        let dy = c.input("dy", rnd(&mut rng, &[3, 6], -1.0, 1.0));
        let y = c.g.max(x, &[1], false);
        let dx = c.g.op1(
            Op::ReduceMaxGrad {
                axes: vec![1],
                keep_dims: false,
            },
            &[x, y, dy],
        );
        c.fetch(dx, "dx");
        cases.push(c);
    }
    cases.push(single(
        "slice_grad",
        Op::SliceGrad {
            axis: 1,
            start: 2,
            input_dim: 9,
        },
        vec![xt(&mut rng)],
        FP32,
    ));
    let a = conv_attrs(2, 1, 1, 1);
    let x = rnd(&mut rng, &[2, 4, 9, 9], -1.0, 1.0);
    let w = rnd(&mut rng, &[6, 4, 3, 3], -0.5, 0.5);
    let dy = rnd(&mut rng, &[2, 6, 5, 5], -1.0, 1.0);
    cases.push(single(
        "conv2d_grad_input",
        Op::Conv2dGradInput {
            attrs: a,
            input_shape: [2, 4, 9, 9],
        },
        vec![dy.clone(), w],
        ACCUM,
    ));
    cases.push(single(
        "conv2d_grad_filter",
        Op::Conv2dGradFilter {
            attrs: a,
            filter_shape: [6, 4, 3, 3],
        },
        vec![x.clone(), dy],
        ACCUM,
    ));
    let p = Pool2dAttrs {
        kernel: [3, 3],
        stride: [2, 2],
        padding: [1, 1],
    };
    let dyp = rnd(&mut rng, &[2, 4, 5, 5], -1.0, 1.0);
    cases.push(single(
        "max_pool2d_grad",
        Op::MaxPool2dGrad(p),
        vec![x.clone(), dyp.clone()],
        FP32,
    ));
    for inc in [true, false] {
        cases.push(single(
            &format!("avg_pool2d_grad pad {inc}"),
            Op::AvgPool2dGrad {
                pool: p,
                count_include_pad: inc,
            },
            vec![x.clone(), dyp.clone()],
            FP32,
        ));
    }
    // Batch norm with batch statistics: cuDNN's kernels (eps >= 1e-5) and
    // ours (cuDNN off, or eps below cuDNN's minimum) over planes of a
    // multiple of 4 floats (float4 paths), odd planes (9x9, 7x7), planes
    // under 32 floats and one value per plane (rank 2 and 3: flat kernels).
    let shapes: [(&[usize], f32); 7] = [
        (&[2, 4, 9, 9], 1e-5),
        (&[2, 4, 9, 9], 1e-6),
        (&[4, 8, 7, 7], 1e-3),
        (&[3, 2, 64, 64], 1e-5),
        (&[6, 4], 1e-5),
        (&[2, 4, 3], 1e-5),
        // 66,000 planes: more than a grid's y dimension holds.
        (&[2, 33_000, 2, 16], 1e-5),
    ];
    for ((dims, eps), cudnn) in shapes.iter().flat_map(|&s| [(s, true), (s, false)]) {
        let dims = dims.to_vec();
        let what = if cudnn && eps >= 1e-5 {
            "cudnn"
        } else {
            "ours"
        };
        let ch = dims[1];
        let mut c = Case::new(&format!(
            "batch_norm_train (+grad) {what} {dims:?} eps {eps:e}"
        ))
        .tol(ACCUM);
        c.opts.cudnn_batch_norm = cudnn;
        let xi = c.input("x", rnd(&mut rng, &dims, -2.0, 3.0));
        let g = c.var("gamma", rnd(&mut rng, &[ch], 0.5, 1.5));
        let b = c.var("beta", rnd(&mut rng, &[ch], -0.5, 0.5));
        let rm = c.var("rm", Tensor::full([ch], 0.0));
        let rv = c.var("rv", Tensor::full([ch], 1.0));
        let outs = c.g.op(
            Op::BatchNormTrain { eps, momentum: 0.1 },
            &[xi, g, b, rm, rv],
        );
        let dyi = c.input("dy", rnd(&mut rng, &dims, -1.0, 1.0));
        let grads =
            c.g.op(Op::BatchNormTrainGrad, &[xi, g, outs[1], outs[2], dyi]);
        c.fetch_all(&outs, "bn");
        c.fetch_all(&grads, "bn_grad");
        c.runs = 2;
        cases.push(c);
    }
    cases.push(single(
        "layer_norm_grad",
        Op::LayerNormGrad { eps: 1e-5 },
        vec![
            rnd(&mut rng, &[3, 5, 48], -2.0, 2.0),
            rnd(&mut rng, &[48], 0.5, 1.5),
            rnd(&mut rng, &[3, 5, 48], -1.0, 1.0),
        ],
        ACCUM,
    ));
    // Many rows: blocks of 8 warps stride over 2,800 rows (more than 256
    // blocks' worth) and sum dgamma/dbeta in shared memory; and rows too
    // wide for it (2·6,200 floats > 48 KiB).
    for (name, dims) in [
        ("layer_norm_grad many rows", [40usize, 70, 24]),
        ("layer_norm_grad wide rows", [1, 3, 6200]),
    ] {
        let d = dims[2];
        cases.push(single(
            name,
            Op::LayerNormGrad { eps: 1e-5 },
            vec![
                rnd(&mut rng, &dims, -2.0, 2.0),
                rnd(&mut rng, &[d], 0.5, 1.5),
                rnd(&mut rng, &dims, -1.0, 1.0),
            ],
            ACCUM,
        ));
    }
    cases.push(single(
        "embedding_grad",
        Op::EmbeddingGrad { num_embeddings: 11 },
        vec![
            ints(&mut rng, &[3, 4], 11),
            rnd(&mut rng, &[3, 4, 6], -1.0, 1.0),
        ],
        FP32,
    ));
    cases.push(single(
        "cross_entropy_grad",
        Op::CrossEntropyGrad,
        vec![
            rnd(&mut rng, &[7, 10], -3.0, 3.0),
            ints(&mut rng, &[7], 10),
            Tensor::scalar(1.5),
        ],
        FP32,
    ));
    run_all(cases);
}

#[test]
#[ignore = "needs a GPU"]
fn in_place_updates() {
    let mut rng = StdRng::seed_from_u64(8);
    let mut cases = Vec::new();
    for (name, momentum, wd, nesterov) in [
        ("sgd plain", 0.0, 0.0, false),
        ("sgd momentum wd", 0.9, 1e-2, false),
        ("sgd nesterov", 0.9, 0.0, true),
    ] {
        let mut c = Case::new(name);
        let p = c.var("p", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let buf = c.var("buf", Tensor::full([5, 7], 0.0));
        let gi = c.input("g", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        c.g.op(
            Op::SgdUpdate {
                lr: 0.1,
                momentum,
                weight_decay: wd,
                nesterov,
            },
            &[p, gi, buf],
        );
        c.runs = 3;
        cases.push(c);
    }
    for decoupled in [false, true] {
        let mut c = Case::new(&format!("adam decoupled {decoupled}"));
        let p = c.var("p", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let m = c.var("m", Tensor::full([5, 7], 0.0));
        let v = c.var("v", Tensor::full([5, 7], 0.0));
        let step = c.var("step", Tensor::full([1], 0.0));
        let gi = c.input("g", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        c.g.op(
            Op::AdamUpdate {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 1e-2,
                decoupled,
            },
            &[p, gi, m, v, step],
        );
        c.runs = 3;
        cases.push(c);
    }
    // The learning rate from a variable (a job's scheduler writes it).
    {
        let mut c = Case::new("sgd lr from a variable");
        let p = c.var("p", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let buf = c.var("buf", Tensor::full([5, 7], 0.0));
        let lr = c.var("lr", Tensor::full([1], 0.05));
        let gi = c.input("g", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let sgd = Op::SgdUpdate {
            lr: 1.0,
            momentum: 0.9,
            weight_decay: 1e-2,
            nesterov: true,
        };
        c.g.op(sgd, &[p, gi, buf, lr]);
        c.runs = 3;
        cases.push(c);
        let mut c = Case::new("adamw lr from a variable");
        let p = c.var("p", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let m = c.var("m", Tensor::full([5, 7], 0.0));
        let v = c.var("v", Tensor::full([5, 7], 0.0));
        let step = c.var("step", Tensor::full([1], 0.0));
        let lr = c.var("lr", Tensor::full([1], 3e-3));
        let gi = c.input("g", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let adam = Op::AdamUpdate {
            lr: 1.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            decoupled: true,
        };
        c.g.op(adam, &[p, gi, m, v, step, lr]);
        c.runs = 3;
        cases.push(c);
    }
    // Dropout masks: the same elements dropped on both backends (exact).
    for (p, salt) in [(0.1f32, 0u32), (0.5, 7)] {
        let mut c = Case::new(&format!("dropout mask p {p}"));
        let seed = c.input("seed", Tensor::from_i64([1], vec![12345]).unwrap());
        let y = c.g.op1(
            Op::DropoutMask {
                p,
                salt,
                shape: vec![3, 33, 65],
            },
            &[seed],
        );
        c.fetch(y, "mask");
        c.tol = Tol {
            rtol: 0.0,
            atol: 0.0,
        };
        cases.push(c);
    }
    {
        let mut c = Case::new("assign");
        let t = c.var("t", Tensor::full([4], 0.0));
        let v = c.input("v", rnd(&mut rng, &[4], -1.0, 1.0));
        c.g.op(Op::Assign, &[t, v]);
        cases.push(c);
    }
    run_all(cases);
}
