//! CPU backend kernels against hand-computed cases and naive reference
//! implementations (triple-loop matmul, direct convolution), adjoint
//! identities for the convolution and pooling gradients, finite differences
//! for the normalisation and softmax gradients, the optimizers' first steps,
//! and `CpuProgram`'s feed / fetch / in-place contract.
#![allow(
    clippy::cloned_ref_to_slice_refs,
    clippy::unwrap_used,
    clippy::expect_used
)]

use std::collections::BTreeMap;

use lanes::exec::cpu::{run_op, CpuProgram};
use lanes::exec::{DataMut, DataRef, ExecError, TensorMut, TensorRef};
use lanes_adaptor::graph::infer::infer;
use lanes_adaptor::{
    validate, Conv2dAttrs, GraphBuilder, GraphLimits, Op, Pool2dAttrs, Tensor, TensorData,
    TensorType,
};
use proptest::prelude::*;

fn t(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::from_f32(shape.to_vec(), v.to_vec()).unwrap()
}

fn ti(shape: &[usize], v: &[i64]) -> Tensor {
    Tensor::from_i64(shape.to_vec(), v.to_vec()).unwrap()
}

fn view(x: &Tensor) -> (TensorType, &TensorData) {
    (x.ty(), x.data())
}

/// Runs `op` on `inputs` (in-place views are copies of the mutated inputs);
/// returns the outputs and the updated in-place values.
fn exec(op: &Op, inputs: &[Tensor]) -> Result<(Vec<Tensor>, Vec<Tensor>), ExecError> {
    let types: Vec<TensorType> = inputs.iter().map(Tensor::ty).collect();
    let out_types = infer(op, &types).map_err(|reason| ExecError::Op {
        node: "t".into(),
        op: op.name(),
        reason,
    })?;
    let held: Vec<(TensorType, &TensorData)> = inputs.iter().map(view).collect();
    let refs: Vec<TensorRef<'_>> = held
        .iter()
        .map(|(ty, d)| TensorRef {
            ty,
            data: DataRef::from(*d),
        })
        .collect();
    let mut outs: Vec<TensorData> = out_types
        .iter()
        .map(|ty| Tensor::zeros(ty).into_data())
        .collect();
    let mut upd: Vec<TensorData> = op
        .mutated_inputs()
        .iter()
        .map(|&k| inputs[k].data().clone())
        .collect();
    let upd_types: Vec<TensorType> = op
        .mutated_inputs()
        .iter()
        .map(|&k| inputs[k].ty())
        .collect();
    {
        let mut out_views: Vec<TensorMut<'_>> = out_types
            .iter()
            .zip(outs.iter_mut())
            .map(|(ty, d)| mk_mut(ty, d))
            .collect();
        let mut in_views: Vec<TensorMut<'_>> = upd_types
            .iter()
            .zip(upd.iter_mut())
            .map(|(ty, d)| mk_mut(ty, d))
            .collect();
        run_op("t", op, &refs, &mut in_views, &mut out_views)?;
    }
    let outs = out_types
        .iter()
        .zip(outs)
        .map(|(ty, d)| Tensor::new(ty.shape.clone(), d).unwrap())
        .collect();
    let upd = upd_types
        .iter()
        .zip(upd)
        .map(|(ty, d)| Tensor::new(ty.shape.clone(), d).unwrap())
        .collect();
    Ok((outs, upd))
}

fn mk_mut<'a>(ty: &'a TensorType, d: &'a mut TensorData) -> TensorMut<'a> {
    TensorMut {
        ty,
        data: DataMut::from(d),
    }
}

fn run1(op: &Op, inputs: &[Tensor]) -> Vec<f32> {
    exec(op, inputs).unwrap().0[0].f32s().unwrap().to_vec()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "lengths differ");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "element {i}: {x} vs {y}\n{a:?}\n{b:?}"
        );
    }
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum()
}

/// Deterministic values in [-1, 1).
fn vals(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn rnd(seed: u64, shape: &[usize]) -> Tensor {
    t(shape, &vals(seed, shape.iter().product()))
}

// ---- hand-computed forward cases ----------------------------------------

#[test]
fn add_broadcasts_rows_and_columns() {
    let a = t(&[2, 1], &[1.0, 2.0]);
    let b = t(&[3], &[10.0, 20.0, 30.0]);
    assert_eq!(
        run1(&Op::Add, &[a.clone(), b.clone()]),
        vec![11.0, 21.0, 31.0, 12.0, 22.0, 32.0]
    );
    assert_eq!(
        run1(&Op::Div, &[b, a]),
        vec![10.0, 20.0, 30.0, 5.0, 10.0, 15.0]
    );
}

#[test]
fn activations_and_softmax() {
    let x = t(&[4], &[-1.0, 0.0, 0.5, 2.0]);
    assert_eq!(run1(&Op::Relu, &[x.clone()]), vec![0.0, 0.0, 0.5, 2.0]);
    close(
        &run1(&Op::Gelu, &[x.clone()]),
        &[-0.158_655_3, 0.0, 0.345_731_1, 1.954_5],
        1e-4,
    );
    let s = run1(&Op::Softmax { axis: 0 }, &[x.clone()]);
    let e: Vec<f32> = [-1.0f32, 0.0, 0.5, 2.0].iter().map(|v| v.exp()).collect();
    let z: f32 = e.iter().sum();
    close(&s, &e.iter().map(|v| v / z).collect::<Vec<_>>(), 1e-6);
    let ls = run1(&Op::LogSoftmax { axis: 0 }, &[x]);
    close(
        &ls,
        &e.iter().map(|v| (v / z).ln()).collect::<Vec<_>>(),
        1e-5,
    );
}

#[test]
fn shape_ops() {
    let x = t(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(
        run1(&Op::Transpose { perm: vec![1, 0] }, &[x.clone()]),
        vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
    );
    assert_eq!(
        run1(
            &Op::Slice {
                axis: 1,
                start: 1,
                end: 3
            },
            &[x.clone()]
        ),
        vec![2.0, 3.0, 5.0, 6.0]
    );
    assert_eq!(
        run1(
            &Op::Concat { axis: 1 },
            &[x.clone(), t(&[2, 1], &[7.0, 8.0])]
        ),
        vec![1.0, 2.0, 3.0, 7.0, 4.0, 5.0, 6.0, 8.0]
    );
    assert_eq!(
        run1(&Op::SumTo { shape: vec![3] }, &[x.clone()]),
        vec![5.0, 7.0, 9.0]
    );
    assert_eq!(
        run1(
            &Op::ReduceMax {
                axes: vec![1],
                keep_dims: false
            },
            &[x.clone()]
        ),
        vec![3.0, 6.0]
    );
    assert_eq!(
        run1(
            &Op::ReduceMean {
                axes: vec![0],
                keep_dims: true
            },
            &[x]
        ),
        vec![2.5, 3.5, 4.5]
    );
}

#[test]
fn embedding_and_cross_entropy_reject_bad_indices() {
    let table = t(&[3, 2], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(
        run1(&Op::Embedding, &[table.clone(), ti(&[2], &[2, 0])]),
        vec![4.0, 5.0, 0.0, 1.0]
    );
    for bad in [3, -1] {
        let e = exec(&Op::Embedding, &[table.clone(), ti(&[1], &[bad])]).unwrap_err();
        assert!(
            matches!(e, ExecError::Op { ref node, .. } if node == "t"),
            "{e}"
        );
        let e = exec(
            &Op::EmbeddingGrad { num_embeddings: 3 },
            &[ti(&[1], &[bad]), t(&[1, 2], &[1.0, 1.0])],
        )
        .unwrap_err();
        assert!(matches!(e, ExecError::Op { .. }), "{e}");
    }
    let logits = t(&[1, 3], &[1.0, 2.0, 3.0]);
    let e = exec(&Op::CrossEntropy, &[logits.clone(), ti(&[1], &[3])]).unwrap_err();
    assert!(matches!(e, ExecError::Op { .. }), "{e}");
    let ce = run1(&Op::CrossEntropy, &[logits, ti(&[1], &[2])])[0];
    let lse = (1f32.exp() + 2f32.exp() + 3f32.exp()).ln();
    assert!((ce - (lse - 3.0)).abs() < 1e-5);
}

#[test]
fn run_op_rejects_inconsistent_views() {
    // Output buffer of the wrong length: an error, not a panic.
    let a = t(&[2], &[1.0, 2.0]);
    let ty = a.ty();
    let refs = [
        TensorRef {
            ty: &ty,
            data: DataRef::F32(a.f32s().unwrap()),
        },
        TensorRef {
            ty: &ty,
            data: DataRef::F32(a.f32s().unwrap()),
        },
    ];
    let mut buf = vec![0.0f32; 3];
    let mut outs = [TensorMut {
        ty: &ty,
        data: DataMut::F32(&mut buf),
    }];
    let e = run_op("n", &Op::Add, &refs, &mut [], &mut outs).unwrap_err();
    assert!(
        matches!(e, ExecError::Op { ref node, .. } if node == "n"),
        "{e}"
    );
}

// ---- matmul and convolution against naive references ----------------------

fn naive_matmul(
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    ta: bool,
    tb: bool,
) -> Vec<f32> {
    let mut y = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f32;
            for l in 0..k {
                let av = if ta { a[l * m + i] } else { a[i * k + l] };
                let bv = if tb { b[j * k + l] } else { b[l * n + j] };
                s += av * bv;
            }
            y[i * n + j] = s;
        }
    }
    y
}

#[allow(clippy::too_many_arguments)]
fn naive_conv(
    x: &[f32],
    w: &[f32],
    (n, c, h, wd): (usize, usize, usize, usize),
    (o, kh, kw): (usize, usize, usize),
    a: &Conv2dAttrs,
    (oh, ow): (usize, usize),
) -> Vec<f32> {
    let cg = c / a.groups;
    let og = o / a.groups;
    let mut y = vec![0.0f32; n * o * oh * ow];
    for b in 0..n {
        for oc in 0..o {
            let g = oc / og;
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut s = 0.0;
                    for ci in 0..cg {
                        for i in 0..kh {
                            for j in 0..kw {
                                let iy = (oy * a.stride[0] + i * a.dilation[0]) as isize
                                    - a.padding[0] as isize;
                                let ix = (ox * a.stride[1] + j * a.dilation[1]) as isize
                                    - a.padding[1] as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                let xc = g * cg + ci;
                                s += x[((b * c + xc) * h + iy as usize) * wd + ix as usize]
                                    * w[((oc * cg + ci) * kh + i) * kw + j];
                            }
                        }
                    }
                    y[((b * o + oc) * oh + oy) * ow + ox] = s;
                }
            }
        }
    }
    y
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn matmul_matches_triple_loop(
        m in 1usize..6, k in 1usize..6, n in 1usize..6, batch in 1usize..3,
        ta: bool, tb: bool, bcast_b: bool, seed in 0u64..1000,
    ) {
        let ashape = if ta { vec![batch, k, m] } else { vec![batch, m, k] };
        let bcore = if tb { vec![n, k] } else { vec![k, n] };
        let bshape = if bcast_b { bcore.clone() } else { [vec![batch], bcore.clone()].concat() };
        let a = rnd(seed, &ashape);
        let b = rnd(seed + 1, &bshape);
        let y = run1(&Op::MatMul { transpose_a: ta, transpose_b: tb }, &[a.clone(), b.clone()]);
        let (av, bv) = (a.f32s().unwrap(), b.f32s().unwrap());
        for i in 0..batch {
            let bo = if bcast_b { 0 } else { i * k * n };
            let want = naive_matmul(&av[i * m * k..(i + 1) * m * k], &bv[bo..bo + k * n], m, k, n, ta, tb);
            close(&y[i * m * n..(i + 1) * m * n], &want, 1e-5);
        }
    }

    #[test]
    fn conv_matches_direct_and_grads_are_adjoint(
        n in 1usize..3, cg in 1usize..3, og in 1usize..3, groups in 1usize..3,
        h in 3usize..7, w in 3usize..7, kh in 1usize..4, kw in 1usize..4,
        s in 1usize..3, p in 0usize..2, d in 1usize..3, seed in 0u64..1000,
    ) {
        let (c, o) = (cg * groups, og * groups);
        let a = Conv2dAttrs { stride: [s, s], padding: [p, p + 1], dilation: [d, 1], groups };
        let eh = (kh - 1) * d + 1;
        prop_assume!(h + 2 * p >= eh && w + 2 * (p + 1) >= kw);
        let x = rnd(seed, &[n, c, h, w]);
        let wt = rnd(seed + 7, &[o, cg, kh, kw]);
        let (outs, _) = exec(&Op::Conv2d(a), &[x.clone(), wt.clone()]).unwrap();
        let yd = outs[0].shape().dims().to_vec();
        let want = naive_conv(
            x.f32s().unwrap(), wt.f32s().unwrap(), (n, c, h, w), (o, kh, kw), &a, (yd[2], yd[3]),
        );
        close(outs[0].f32s().unwrap(), &want, 1e-5);
        // <conv(x, w), dy> = <x, dX(dy, w)> = <w, dW(x, dy)>
        let dy = rnd(seed + 3, &yd);
        let lhs = dot(outs[0].f32s().unwrap(), dy.f32s().unwrap());
        let dx = run1(&Op::Conv2dGradInput { attrs: a, input_shape: [n, c, h, w] }, &[dy.clone(), wt.clone()]);
        let dw = run1(&Op::Conv2dGradFilter { attrs: a, filter_shape: [o, cg, kh, kw] }, &[x.clone(), dy]);
        prop_assert!((lhs - dot(x.f32s().unwrap(), &dx)).abs() < 1e-3 * (1.0 + lhs.abs()));
        prop_assert!((lhs - dot(wt.f32s().unwrap(), &dw)).abs() < 1e-3 * (1.0 + lhs.abs()));
    }

    #[test]
    fn avg_pool_grad_is_adjoint(
        h in 2usize..7, w in 2usize..7, k in 1usize..4, s in 1usize..3, p in 0usize..2,
        include: bool, seed in 0u64..1000,
    ) {
        prop_assume!(k <= h + 2 * p && k <= w + 2 * p && p <= k / 2);
        let pool = Pool2dAttrs { kernel: [k, k], stride: [s, s], padding: [p, p] };
        let x = rnd(seed, &[2, 2, h, w]);
        let (y, _) = exec(&Op::AvgPool2d { pool, count_include_pad: include }, &[x.clone()]).unwrap();
        let dy = rnd(seed + 1, y[0].shape().dims());
        let dx = run1(&Op::AvgPool2dGrad { pool, count_include_pad: include }, &[x.clone(), dy.clone()]);
        let lhs = dot(y[0].f32s().unwrap(), dy.f32s().unwrap());
        prop_assert!((lhs - dot(x.f32s().unwrap(), &dx)).abs() < 1e-4 * (1.0 + lhs.abs()));
    }
}

// ---- backward kernels -----------------------------------------------------

/// Central finite difference of `sum(f(x) * r)` with respect to `x[i]`.
fn fd(f: &dyn Fn(&Tensor) -> Vec<f32>, x: &Tensor, r: &[f32], i: usize) -> f32 {
    let h = 1e-2f32;
    let mut v = x.f32s().unwrap().to_vec();
    let shape = x.shape().dims().to_vec();
    v[i] += h;
    let up = dot(&f(&t(&shape, &v)), r);
    v[i] -= 2.0 * h;
    let down = dot(&f(&t(&shape, &v)), r);
    ((up - down) / (2.0 * f64::from(h))) as f32
}

fn check_fd(f: &dyn Fn(&Tensor) -> Vec<f32>, x: &Tensor, r: &[f32], analytic: &[f32]) {
    for (i, &g) in analytic.iter().enumerate() {
        let num = fd(f, x, r, i);
        assert!(
            (num - g).abs() < 2e-2 * (1.0 + g.abs()),
            "element {i}: fd {num} vs {g}"
        );
    }
}

#[test]
fn activation_and_softmax_grads_match_finite_differences() {
    let x = t(&[2, 3], &[-0.7, 0.3, 1.2, 0.9, -1.5, 0.2]);
    let r = vals(5, 6);
    let dy = t(&[2, 3], &r);
    for (fwd, grad, from_output) in [
        (Op::Gelu, Op::GeluGrad, false),
        (Op::Relu, Op::ReluGrad, false),
        (Op::Sigmoid, Op::SigmoidGrad, true),
        (Op::Tanh, Op::TanhGrad, true),
        (Op::Softmax { axis: 1 }, Op::SoftmaxGrad { axis: 1 }, true),
        (
            Op::LogSoftmax { axis: 0 },
            Op::LogSoftmaxGrad { axis: 0 },
            true,
        ),
    ] {
        let y = exec(&fwd, &[x.clone()]).unwrap().0.remove(0);
        let first = if from_output { y } else { x.clone() };
        let g = run1(&grad, &[first, dy.clone()]);
        check_fd(&|v| run1(&fwd, &[v.clone()]), &x, &r, &g);
    }
}

#[test]
fn norm_and_loss_grads_match_finite_differences() {
    let x = rnd(11, &[3, 2, 2]);
    let gamma = t(&[2], &[0.8, 1.3]);
    let beta = t(&[2], &[0.1, -0.2]);
    let r = vals(12, 12);
    let dy = t(&[3, 2, 2], &r);
    // BatchNormTrain + BatchNormTrainGrad (channel axis 1 of [N, C, H]).
    let bn = Op::BatchNormTrain {
        eps: 1e-5,
        momentum: 0.1,
    };
    let stats = |v: &Tensor| {
        vec![
            v.clone(),
            gamma.clone(),
            beta.clone(),
            t(&[2], &[0.0, 0.0]),
            t(&[2], &[1.0, 1.0]),
        ]
    };
    let (outs, upd) = exec(&bn, &stats(&x)).unwrap();
    let g = exec(
        &Op::BatchNormTrainGrad,
        &[
            x.clone(),
            gamma.clone(),
            outs[1].clone(),
            outs[2].clone(),
            dy.clone(),
        ],
    )
    .unwrap()
    .0;
    check_fd(
        &|v| exec(&bn, &stats(v)).unwrap().0[0].f32s().unwrap().to_vec(),
        &x,
        &r,
        g[0].f32s().unwrap(),
    );
    // dbeta = Σ dy per channel; running mean moved 10% towards the batch mean.
    let rv = &r;
    let db: Vec<f32> = (0..2)
        .map(|c| {
            (0..3)
                .map(|n| rv[n * 4 + c * 2] + rv[n * 4 + c * 2 + 1])
                .sum()
        })
        .collect();
    close(g[2].f32s().unwrap(), &db, 1e-5);
    close(
        upd[0].f32s().unwrap(),
        &outs[1]
            .f32s()
            .unwrap()
            .iter()
            .map(|m| 0.1 * m)
            .collect::<Vec<_>>(),
        1e-6,
    );
    // LayerNorm over the last axis.
    let ln = Op::LayerNorm { eps: 1e-5 };
    let gl = exec(
        &Op::LayerNormGrad { eps: 1e-5 },
        &[x.clone(), gamma.clone(), dy.clone()],
    )
    .unwrap()
    .0;
    check_fd(
        &|v| run1(&ln, &[v.clone(), gamma.clone(), beta.clone()]),
        &x,
        &r,
        gl[0].f32s().unwrap(),
    );
    // CrossEntropy.
    let logits = rnd(13, &[3, 4]);
    let labels = ti(&[3], &[0, 3, 1]);
    let dl = run1(
        &Op::CrossEntropyGrad,
        &[logits.clone(), labels.clone(), Tensor::scalar(1.0)],
    );
    check_fd(
        &|v| run1(&Op::CrossEntropy, &[v.clone(), labels.clone()]),
        &logits,
        &[1.0],
        &dl,
    );
}

#[test]
fn routing_grads() {
    // MaxPool2dGrad: each window's gradient lands on its maximum.
    let x = t(&[1, 1, 2, 4], &[1.0, 5.0, 2.0, 0.0, 3.0, 4.0, 9.0, 8.0]);
    let pool = Pool2dAttrs {
        kernel: [2, 2],
        stride: [2, 2],
        padding: [0, 0],
    };
    assert_eq!(run1(&Op::MaxPool2d(pool), &[x.clone()]), vec![5.0, 9.0]);
    assert_eq!(
        run1(
            &Op::MaxPool2dGrad(pool),
            &[x, t(&[1, 1, 1, 2], &[0.5, 2.0])]
        ),
        vec![0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0]
    );
    // ReduceMaxGrad: first maximum of each row.
    let x = t(&[2, 3], &[1.0, 3.0, 3.0, 7.0, 2.0, 0.0]);
    let y = t(&[2], &[3.0, 7.0]);
    assert_eq!(
        run1(
            &Op::ReduceMaxGrad {
                axes: vec![1],
                keep_dims: false
            },
            &[x, y, t(&[2], &[1.0, 2.0])]
        ),
        vec![0.0, 1.0, 0.0, 2.0, 0.0, 0.0]
    );
    // SliceGrad pads with zeros.
    assert_eq!(
        run1(
            &Op::SliceGrad {
                axis: 1,
                start: 1,
                input_dim: 3
            },
            &[t(&[2, 1], &[4.0, 5.0])]
        ),
        vec![0.0, 4.0, 0.0, 0.0, 5.0, 0.0]
    );
    // EmbeddingGrad sums repeated rows.
    assert_eq!(
        run1(
            &Op::EmbeddingGrad { num_embeddings: 3 },
            &[ti(&[3], &[2, 0, 2]), t(&[3, 1], &[1.0, 2.0, 3.0])]
        ),
        vec![2.0, 0.0, 4.0]
    );
}

// ---- optimizers -------------------------------------------------------------

#[test]
fn sgd_momentum_and_weight_decay() {
    let op = Op::SgdUpdate {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.5,
        nesterov: false,
    };
    let p = t(&[2], &[1.0, -2.0]);
    let g = t(&[2], &[0.2, 0.4]);
    let (_, upd) = exec(&op, &[p, g.clone(), t(&[2], &[0.0, 0.0])]).unwrap();
    // g' = g + 0.5 p = [0.7, -0.6]; buf = g'; p -= 0.1 g'.
    close(upd[0].f32s().unwrap(), &[0.93, -1.94], 1e-6);
    close(upd[1].f32s().unwrap(), &[0.7, -0.6], 1e-6);
    let (_, upd2) = exec(&op, &[upd[0].clone(), g, upd[1].clone()]).unwrap();
    // g' = [0.2 + 0.465, 0.4 - 0.97]; buf = 0.9 buf + g'.
    let buf = [0.9 * 0.7 + 0.665, 0.9 * -0.6 - 0.57];
    close(upd2[1].f32s().unwrap(), &buf, 1e-5);
    close(
        upd2[0].f32s().unwrap(),
        &[0.93 - 0.1 * buf[0], -1.94 - 0.1 * buf[1]],
        1e-5,
    );
}

#[test]
fn adam_and_adamw_first_step() {
    for decoupled in [false, true] {
        let op = Op::AdamUpdate {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled,
        };
        let p = t(&[2], &[1.0, -1.0]);
        let g = t(&[2], &[0.5, 0.25]);
        let z = t(&[2], &[0.0, 0.0]);
        let (_, upd) = exec(&op, &[p, g, z.clone(), z, t(&[1], &[0.0])]).unwrap();
        // First step: m̂ = g', v̂ = g'², so the step is lr · sign(g').
        let want = if decoupled {
            [1.0 * (1.0 - 0.001) - 0.01, -(1.0 - 0.001) - 0.01]
        } else {
            // g' = g + 0.1 p = [0.6, 0.15]
            [1.0 - 0.01, -1.0 - 0.01]
        };
        close(upd[0].f32s().unwrap(), &want, 1e-5);
        assert_eq!(upd[3].f32s().unwrap(), &[1.0]);
    }
}

// ---- CpuProgram -------------------------------------------------------------

fn program() -> CpuProgram {
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", TensorType::f32([2]));
    let w = b.variable("w", t(&[2], &[1.0, 2.0]));
    let buf = b.variable("buf", t(&[2], &[0.0, 0.0]));
    let y = b.mul(x, w);
    b.set_name(y, "y");
    b.op(
        Op::SgdUpdate {
            lr: 1.0,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        },
        &[w, x, buf],
    );
    let (g, vars) = b.finish().unwrap();
    CpuProgram::new(validate(g, &GraphLimits::default()).unwrap(), vars).unwrap()
}

#[test]
fn program_feeds_fetches_and_updates_in_place() {
    let mut p = program();
    let feeds = BTreeMap::from([("x".to_string(), t(&[2], &[0.5, 1.0]))]);
    let out = p.run(&feeds, &["y".into(), "w".into()]).unwrap();
    // y uses w before or after the update depending on order; w is fetched after.
    assert_eq!(out[1].f32s().unwrap(), &[0.5, 1.0]);
    let again = p.run(&feeds, &["w:0".into()]).unwrap();
    assert_eq!(again[0].f32s().unwrap(), &[0.0, 0.0]);
    let vars = p.read_variables(&["w".into()]).unwrap();
    assert_eq!(vars["w"].f32s().unwrap(), &[0.0, 0.0]);

    assert!(matches!(
        p.run(&BTreeMap::<String, Tensor>::new(), &["y".into()]),
        Err(ExecError::MissingFeed { .. })
    ));
    let wrong = BTreeMap::from([("x".to_string(), t(&[3], &[0.0; 3]))]);
    assert!(matches!(
        p.run(&wrong, &["y".into()]),
        Err(ExecError::FeedType { .. })
    ));
    let unknown = BTreeMap::from([("nope".to_string(), t(&[2], &[0.0; 2]))]);
    assert!(matches!(
        p.run(&unknown, &["y".into()]),
        Err(ExecError::UnknownFeed { .. })
    ));
    assert!(matches!(
        p.run(&feeds, &["nope".into()]),
        Err(ExecError::UnknownFetch { .. })
    ));
    assert!(matches!(
        p.run(&feeds, &["y:1".into()]),
        Err(ExecError::UnknownFetch { .. })
    ));
}

#[test]
fn program_checks_variables() {
    let mut b = GraphBuilder::new();
    let w = b.variable("w", t(&[2], &[1.0, 2.0]));
    b.scale(w, 2.0);
    let (g, _) = b.finish().unwrap();
    let g = validate(g, &GraphLimits::default()).unwrap();
    let mut vars = lanes_adaptor::VarValues::new();
    assert!(matches!(
        CpuProgram::new(g.clone(), vars.clone()),
        Err(ExecError::MissingVariable { .. })
    ));
    vars.insert("w".into(), t(&[3], &[0.0; 3]));
    assert!(matches!(
        CpuProgram::new(g, vars),
        Err(ExecError::VariableType { .. })
    ));
}
