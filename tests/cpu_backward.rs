//! Backward and in-place kernels of the CPU backend, called through
//! `run_op`: each gradient against central finite differences of a naive
//! forward written here, and optimizer steps against PyTorch's formulas.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use lanes::exec::cpu::run_op;
use lanes::exec::{DataMut, DataRef, TensorMut, TensorRef};
use lanes_adaptor::{Conv2dAttrs, Op, Pool2dAttrs, TensorType};

/// Deterministic pseudo-random values in [-1, 1).
fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Runs `op` on f32 inputs (plus i64 ones) and returns its f32 outputs.
fn run(op: &Op, ins: &[(&[usize], &[f32])], outs: &[&[usize]]) -> Vec<Vec<f32>> {
    run_mixed(op, ins, &[], outs)
}

fn run_mixed(
    op: &Op,
    ins: &[(&[usize], &[f32])],
    ints: &[(usize, &[usize], &[i64])],
    outs: &[&[usize]],
) -> Vec<Vec<f32>> {
    let total = ins.len() + ints.len();
    let mut fl = ins.iter();
    let slots: Vec<(TensorType, DataRef<'_>)> = (0..total)
        .map(|pos| match ints.iter().find(|(at, _, _)| *at == pos) {
            Some((_, d, v)) => (TensorType::i64(d.to_vec()), DataRef::I64(v)),
            None => {
                let (d, v) = fl.next().unwrap();
                (TensorType::f32(d.to_vec()), DataRef::F32(v))
            }
        })
        .collect();
    let refs: Vec<TensorRef<'_>> = slots
        .iter()
        .map(|(ty, data)| TensorRef { ty, data: *data })
        .collect();
    let out_tys: Vec<TensorType> = outs.iter().map(|d| TensorType::f32(d.to_vec())).collect();
    let mut bufs: Vec<Vec<f32>> = outs.iter().map(|d| vec![0.0; d.iter().product()]).collect();
    let mut muts: Vec<TensorMut<'_>> = out_tys
        .iter()
        .zip(bufs.iter_mut())
        .map(|(ty, b)| TensorMut {
            ty,
            data: DataMut::F32(b),
        })
        .collect();
    run_op("n", op, &refs, &mut [], &mut muts).unwrap();
    drop(muts);
    bufs
}

/// Checks `grad` (the kernel's dL/dx for L = Σ w·f(x)) against central
/// differences of the naive forward `f`.
fn check(name: &str, x: &[f32], w: &[f32], grad: &[f32], f: impl Fn(&[f32]) -> Vec<f32>) {
    let loss = |x: &[f32]| -> f64 {
        f(x).iter()
            .zip(w)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum()
    };
    let h = 1e-2f32;
    for i in 0..x.len() {
        let (mut xp, mut xm) = (x.to_vec(), x.to_vec());
        xp[i] += h;
        xm[i] -= h;
        let fd = (loss(&xp) - loss(&xm)) / (2.0 * f64::from(h));
        let g = f64::from(grad[i]);
        assert!(
            (fd - g).abs() <= 2e-2 * (1.0 + fd.abs()),
            "{name}: d/dx[{i}] kernel {g} vs finite difference {fd}"
        );
    }
}

#[test]
fn activation_grads_match_finite_differences() {
    let x: Vec<f32> = rand_vec(12, 1).iter().map(|v| v * 3.0 + 0.05).collect();
    let dy = rand_vec(12, 2);
    let d: &[usize] = &[3, 4];
    let erf_gelu = |v: f32| 0.5 * v * (1.0 + libm::erff(v / std::f32::consts::SQRT_2));
    let sig = |v: f32| 1.0 / (1.0 + (-v).exp());
    let g = run(&Op::ReluGrad, &[(d, &x), (d, &dy)], &[d]);
    check("relu", &x, &dy, &g[0], |x| {
        x.iter().map(|v| v.max(0.0)).collect()
    });
    let g = run(&Op::GeluGrad, &[(d, &x), (d, &dy)], &[d]);
    check("gelu", &x, &dy, &g[0], |x| {
        x.iter().map(|v| erf_gelu(*v)).collect()
    });
    // Sigmoid and tanh take the op's output y.
    let y: Vec<f32> = x.iter().map(|v| sig(*v)).collect();
    let g = run(&Op::SigmoidGrad, &[(d, &y), (d, &dy)], &[d]);
    check("sigmoid", &x, &dy, &g[0], |x| {
        x.iter().map(|v| sig(*v)).collect()
    });
    let y: Vec<f32> = x.iter().map(|v| v.tanh()).collect();
    let g = run(&Op::TanhGrad, &[(d, &y), (d, &dy)], &[d]);
    check("tanh", &x, &dy, &g[0], |x| {
        x.iter().map(|v| v.tanh()).collect()
    });
}

fn softmax_rows(x: &[f32], c: usize, log: bool) -> Vec<f32> {
    x.chunks(c)
        .flat_map(|r| {
            let m = r.iter().copied().fold(f32::MIN, f32::max);
            let s: f32 = r.iter().map(|v| (v - m).exp()).sum();
            r.iter()
                .map(move |v| {
                    if log {
                        v - m - s.ln()
                    } else {
                        (v - m).exp() / s
                    }
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn softmax_family_and_cross_entropy_grads() {
    let x = rand_vec(15, 3);
    let dy = rand_vec(15, 4);
    let d: &[usize] = &[3, 5];
    for log in [false, true] {
        let y = softmax_rows(&x, 5, log);
        let op = if log {
            Op::LogSoftmaxGrad { axis: 1 }
        } else {
            Op::SoftmaxGrad { axis: 1 }
        };
        let g = run(&op, &[(d, &y), (d, &dy)], &[d]);
        check("softmax", &x, &dy, &g[0], |x| softmax_rows(x, 5, log));
    }
    let labels = [4i64, 0, 2];
    let dl = [0.7f32];
    let g = run_mixed(
        &Op::CrossEntropyGrad,
        &[(d, &x), (&[], &dl)],
        &[(1, &[3], &labels)],
        &[d],
    );
    let ce = |x: &[f32]| {
        let l = softmax_rows(x, 5, true);
        let s: f32 = labels
            .iter()
            .enumerate()
            .map(|(r, &c)| -l[r * 5 + c as usize])
            .sum();
        vec![s / 3.0]
    };
    check("cross-entropy", &x, &dl, &g[0], ce);
}

#[test]
fn cross_entropy_grad_rejects_bad_labels() {
    let x = rand_vec(6, 5);
    let labels = [0i64, 7];
    let tys = [
        TensorType::f32([2, 3]),
        TensorType::i64([2]),
        TensorType::f32([]),
    ];
    let dl = [1.0f32];
    let ins = [
        TensorRef {
            ty: &tys[0],
            data: DataRef::F32(&x),
        },
        TensorRef {
            ty: &tys[1],
            data: DataRef::I64(&labels),
        },
        TensorRef {
            ty: &tys[2],
            data: DataRef::F32(&dl),
        },
    ];
    let mut out = vec![0.0f32; 6];
    let mut outs = [TensorMut {
        ty: &tys[0],
        data: DataMut::F32(&mut out),
    }];
    let err = run_op("ce", &Op::CrossEntropyGrad, &ins, &mut [], &mut outs).unwrap_err();
    assert!(err.to_string().contains("label 7"), "{err}");
}

/// Naive direct convolution, NCHW / OIHW.
fn conv(
    x: &[f32],
    xd: [usize; 4],
    w: &[f32],
    wd: [usize; 4],
    a: &Conv2dAttrs,
) -> (Vec<f32>, [usize; 4]) {
    let [n, c, h, wi] = xd;
    let [o, cg, kh, kw] = wd;
    let oh = (h + 2 * a.padding[0] - a.dilation[0] * (kh - 1) - 1) / a.stride[0] + 1;
    let ow = (wi + 2 * a.padding[1] - a.dilation[1] * (kw - 1) - 1) / a.stride[1] + 1;
    let og = o / a.groups;
    let mut y = vec![0.0; n * o * oh * ow];
    for ni in 0..n {
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
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wi as isize {
                                    continue;
                                }
                                let xc = g * cg + ci;
                                s += x[((ni * c + xc) * h + iy as usize) * wi + ix as usize]
                                    * w[((oc * cg + ci) * kh + i) * kw + j];
                            }
                        }
                    }
                    y[((ni * o + oc) * oh + oy) * ow + ox] = s;
                }
            }
        }
    }
    (y, [n, o, oh, ow])
}

#[test]
fn conv_grads_match_finite_differences() {
    let cases = [
        (Conv2dAttrs::default(), [2, 2, 5, 5], [3, 2, 3, 3]),
        (
            Conv2dAttrs {
                stride: [2, 1],
                padding: [1, 2],
                dilation: [1, 2],
                groups: 2,
            },
            [2, 4, 6, 5],
            [4, 2, 3, 2],
        ),
    ];
    for (a, xd, wd) in cases {
        let x = rand_vec(xd.iter().product(), 7);
        let w = rand_vec(wd.iter().product(), 8);
        let (_, yd) = conv(&x, xd, &w, wd, &a);
        let dy = rand_vec(yd.iter().product(), 9);
        let dx = run(
            &Op::Conv2dGradInput {
                attrs: a,
                input_shape: xd,
            },
            &[(&yd, &dy), (&wd, &w)],
            &[&xd],
        );
        check("conv dx", &x, &dy, &dx[0], |x| conv(x, xd, &w, wd, &a).0);
        let dw = run(
            &Op::Conv2dGradFilter {
                attrs: a,
                filter_shape: wd,
            },
            &[(&xd, &x), (&yd, &dy)],
            &[&wd],
        );
        check("conv dw", &w, &dy, &dw[0], |w| conv(&x, xd, w, wd, &a).0);
    }
}

fn pool(x: &[f32], [n, c, h, w]: [usize; 4], p: &Pool2dAttrs, max: bool) -> Vec<f32> {
    let oh = (h + 2 * p.padding[0] - p.kernel[0]) / p.stride[0] + 1;
    let ow = (w + 2 * p.padding[1] - p.kernel[1]) / p.stride[1] + 1;
    let mut y = Vec::new();
    for pl in 0..n * c {
        for oy in 0..oh {
            for ox in 0..ow {
                let mut vals = Vec::new();
                for i in 0..p.kernel[0] {
                    for j in 0..p.kernel[1] {
                        let iy = (oy * p.stride[0] + i) as isize - p.padding[0] as isize;
                        let ix = (ox * p.stride[1] + j) as isize - p.padding[1] as isize;
                        if iy >= 0 && ix >= 0 && iy < h as isize && ix < w as isize {
                            vals.push(x[(pl * h + iy as usize) * w + ix as usize]);
                        }
                    }
                }
                y.push(if max {
                    vals.iter().copied().fold(f32::MIN, f32::max)
                } else {
                    vals.iter().sum::<f32>() / vals.len() as f32
                });
            }
        }
    }
    y
}

#[test]
fn pool_grads_match_finite_differences() {
    let p = Pool2dAttrs {
        kernel: [3, 2],
        stride: [2, 2],
        padding: [1, 1],
    };
    let xd = [2, 2, 5, 6];
    let x = rand_vec(xd.iter().product(), 11);
    let yd = [2, 2, 3, 4];
    let dy = rand_vec(yd.iter().product(), 12);
    let g = run(&Op::MaxPool2dGrad(p), &[(&xd, &x), (&yd, &dy)], &[&xd]);
    check("maxpool", &x, &dy, &g[0], |x| pool(x, xd, &p, true));
    let op = Op::AvgPool2dGrad {
        pool: p,
        count_include_pad: false,
    };
    let g = run(&op, &[(&xd, &x), (&yd, &dy)], &[&xd]);
    check("avgpool", &x, &dy, &g[0], |x| pool(x, xd, &p, false));
}

fn layer_norm(x: &[f32], d: usize, gamma: &[f32], beta: &[f32], eps: f32) -> Vec<f32> {
    x.chunks(d)
        .flat_map(|r| {
            let mu = r.iter().sum::<f32>() / d as f32;
            let var = r.iter().map(|v| (v - mu).powi(2)).sum::<f32>() / d as f32;
            let inv = 1.0 / (var + eps).sqrt();
            r.iter()
                .enumerate()
                .map(|(k, v)| (v - mu) * inv * gamma[k] + beta[k])
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn layer_norm_grad_matches_finite_differences() {
    let (x, gamma, beta, dy) = (
        rand_vec(12, 13),
        rand_vec(4, 14),
        rand_vec(4, 15),
        rand_vec(12, 16),
    );
    let eps = 1e-5;
    let g = run(
        &Op::LayerNormGrad { eps },
        &[(&[3, 4], &x), (&[4], &gamma), (&[3, 4], &dy)],
        &[&[3, 4], &[4], &[4]],
    );
    check("ln dx", &x, &dy, &g[0], |x| {
        layer_norm(x, 4, &gamma, &beta, eps)
    });
    check("ln dgamma", &gamma, &dy, &g[1], |gm| {
        layer_norm(&x, 4, gm, &beta, eps)
    });
    check("ln dbeta", &beta, &dy, &g[2], |b| {
        layer_norm(&x, 4, &gamma, b, eps)
    });
}

#[test]
fn batch_norm_train_forward_grad_and_running_stats() {
    let xd = [3, 2, 2, 2];
    let x = rand_vec(24, 17);
    let (gamma, beta) = (vec![1.5f32, -0.5], vec![0.1f32, 0.2]);
    let (eps, m) = (1e-5f32, 0.1f32);
    // Batch statistics per channel, by hand.
    let mut mean = [0.0f32; 2];
    let mut var = [0.0f32; 2];
    for ch in 0..2 {
        let vals: Vec<f32> = (0..3)
            .flat_map(|n| x[(n * 2 + ch) * 4..(n * 2 + ch) * 4 + 4].to_vec())
            .collect();
        mean[ch] = vals.iter().sum::<f32>() / 12.0;
        var[ch] = vals.iter().map(|v| (v - mean[ch]).powi(2)).sum::<f32>() / 12.0;
    }
    let tys = [TensorType::f32(xd), TensorType::f32([2])];
    let (mut rm, mut rv) = (vec![0.5f32, -0.5], vec![2.0f32, 1.0]);
    let ins = [
        TensorRef {
            ty: &tys[0],
            data: DataRef::F32(&x),
        },
        TensorRef {
            ty: &tys[1],
            data: DataRef::F32(&gamma),
        },
        TensorRef {
            ty: &tys[1],
            data: DataRef::F32(&beta),
        },
        TensorRef {
            ty: &tys[1],
            data: DataRef::F32(&[0.0, 0.0]),
        },
        TensorRef {
            ty: &tys[1],
            data: DataRef::F32(&[0.0, 0.0]),
        },
    ];
    let (mut y, mut sm, mut si) = (vec![0.0f32; 24], vec![0.0f32; 2], vec![0.0f32; 2]);
    {
        let mut inplace = [
            TensorMut {
                ty: &tys[1],
                data: DataMut::F32(&mut rm),
            },
            TensorMut {
                ty: &tys[1],
                data: DataMut::F32(&mut rv),
            },
        ];
        let mut outs = [
            TensorMut {
                ty: &tys[0],
                data: DataMut::F32(&mut y),
            },
            TensorMut {
                ty: &tys[1],
                data: DataMut::F32(&mut sm),
            },
            TensorMut {
                ty: &tys[1],
                data: DataMut::F32(&mut si),
            },
        ];
        run_op(
            "bn",
            &Op::BatchNormTrain { eps, momentum: m },
            &ins,
            &mut inplace,
            &mut outs,
        )
        .unwrap();
    }
    for ch in 0..2 {
        assert!((sm[ch] - mean[ch]).abs() < 1e-5);
        assert!((si[ch] - 1.0 / (var[ch] + eps).sqrt()).abs() < 1e-3);
        let unbiased = var[ch] * 12.0 / 11.0;
        let want_rm = [0.5f32, -0.5][ch] * 0.9 + 0.1 * mean[ch];
        let want_rv = [2.0f32, 1.0][ch] * 0.9 + 0.1 * unbiased;
        assert!((rm[ch] - want_rm).abs() < 1e-5, "running mean {ch}");
        assert!((rv[ch] - want_rv).abs() < 1e-5, "running var {ch}");
    }
    let bn = |x: &[f32], gamma: &[f32]| -> Vec<f32> {
        let mut out = vec![0.0; 24];
        for ch in 0..2 {
            let idx: Vec<usize> = (0..3)
                .flat_map(|n| (n * 2 + ch) * 4..(n * 2 + ch) * 4 + 4)
                .collect();
            let mu = idx.iter().map(|&i| x[i]).sum::<f32>() / 12.0;
            let v = idx.iter().map(|&i| (x[i] - mu).powi(2)).sum::<f32>() / 12.0;
            for &i in &idx {
                out[i] = (x[i] - mu) / (v + eps).sqrt() * gamma[ch] + beta[ch];
            }
        }
        out
    };
    for (a, b) in y.iter().zip(bn(&x, &gamma)) {
        assert!((a - b).abs() < 1e-4);
    }
    let dy = rand_vec(24, 18);
    let g = run(
        &Op::BatchNormTrainGrad,
        &[
            (&xd, &x),
            (&[2], &gamma),
            (&[2], &sm),
            (&[2], &si),
            (&xd, &dy),
        ],
        &[&xd, &[2], &[2]],
    );
    check("bn dx", &x, &dy, &g[0], |x| bn(x, &gamma));
    check("bn dgamma", &gamma, &dy, &g[1], |gm| bn(&x, gm));
}

#[test]
fn routing_grads() {
    // ReduceMax over axis 1 of [2, 3]: dy to the first maximum.
    let x = [1.0f32, 5.0, 5.0, -2.0, -3.0, -1.0];
    let y = [5.0f32, -1.0];
    let dy = [2.0f32, 3.0];
    let g = run(
        &Op::ReduceMaxGrad {
            axes: vec![1],
            keep_dims: false,
        },
        &[(&[2, 3], &x), (&[2], &y), (&[2], &dy)],
        &[&[2, 3]],
    );
    assert_eq!(g[0], vec![0.0, 2.0, 0.0, 0.0, 0.0, 3.0]);
    // SliceGrad: rows 1..3 of a length-4 axis.
    let g = run(
        &Op::SliceGrad {
            axis: 1,
            start: 1,
            input_dim: 4,
        },
        &[(&[2, 2], &[1.0, 2.0, 3.0, 4.0])],
        &[&[2, 4]],
    );
    assert_eq!(g[0], vec![0.0, 1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 0.0]);
    // EmbeddingGrad: repeated indices accumulate.
    let g = run_mixed(
        &Op::EmbeddingGrad { num_embeddings: 3 },
        &[(&[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])],
        &[(0, &[3], &[2, 0, 2])],
        &[&[3, 2]],
    );
    assert_eq!(g[0], vec![3.0, 4.0, 0.0, 0.0, 6.0, 8.0]);
}

/// Runs one in-place update on `state` (mutated inputs) with `grad`.
fn step(op: &Op, grad: &[f32], state: &mut [Vec<f32>]) {
    let ty = TensorType::f32([grad.len()]);
    let one = TensorType::f32([1]);
    let snapshot: Vec<Vec<f32>> = state.to_vec();
    let mut ins: Vec<TensorRef<'_>> = vec![TensorRef {
        ty: &ty,
        data: DataRef::F32(&snapshot[0]),
    }];
    ins.push(TensorRef {
        ty: &ty,
        data: DataRef::F32(grad),
    });
    for s in &snapshot[1..] {
        let t = if s.len() == 1 && grad.len() != 1 {
            &one
        } else {
            &ty
        };
        ins.push(TensorRef {
            ty: t,
            data: DataRef::F32(s),
        });
    }
    let mut muts: Vec<TensorMut<'_>> = state
        .iter_mut()
        .map(|s| {
            let t = if s.len() == 1 && grad.len() != 1 {
                &one
            } else {
                &ty
            };
            TensorMut {
                ty: t,
                data: DataMut::F32(s),
            }
        })
        .collect();
    run_op("opt", op, &ins, &mut muts, &mut []).unwrap();
}

#[test]
fn sgd_matches_pytorch_formula() {
    let grad = [0.5f32, -1.0];
    let mut state = vec![vec![1.0f32, 2.0], vec![0.0f32, 0.0]];
    let op = Op::SgdUpdate {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.01,
        nesterov: false,
    };
    step(&op, &grad, &mut state);
    // d = g + wd p; buf = d; p -= lr buf
    let d0 = [0.5 + 0.01, -1.0 + 0.02];
    assert!((state[0][0] - (1.0 - 0.1 * d0[0])).abs() < 1e-6);
    assert!((state[0][1] - (2.0 - 0.1 * d0[1])).abs() < 1e-6);
    assert!((state[1][0] - d0[0]).abs() < 1e-6);
    let p1 = state[0].clone();
    let b1 = state[1].clone();
    step(&op, &grad, &mut state);
    for k in 0..2 {
        let d = grad[k] + 0.01 * p1[k];
        let b = 0.9 * b1[k] + d;
        assert!((state[1][k] - b).abs() < 1e-6);
        assert!((state[0][k] - (p1[k] - 0.1 * b)).abs() < 1e-6);
    }
}

#[test]
fn adam_and_adamw_match_pytorch_formula() {
    for decoupled in [false, true] {
        let op = Op::AdamUpdate {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled,
        };
        let grad = [0.3f32, -0.2, 0.0];
        let mut state = vec![
            vec![1.0f32, -1.0, 0.5],
            vec![0.0; 3],
            vec![0.0; 3],
            vec![0.0],
        ];
        let (mut p, mut m, mut v) = ([1.0f64, -1.0, 0.5], [0.0f64; 3], [0.0f64; 3]);
        for t in 1..=3 {
            step(&op, &grad, &mut state);
            for k in 0..3 {
                let mut g = f64::from(grad[k]);
                if decoupled {
                    p[k] *= 1.0 - 0.01 * 0.1;
                } else {
                    g += 0.1 * p[k];
                }
                m[k] = 0.9 * m[k] + 0.1 * g;
                v[k] = 0.999 * v[k] + 0.001 * g * g;
                let mh = m[k] / (1.0 - 0.9f64.powi(t));
                let vh = v[k] / (1.0 - 0.999f64.powi(t));
                p[k] -= 0.01 * mh / (vh.sqrt() + 1e-8);
                assert!(
                    (f64::from(state[0][k]) - p[k]).abs() < 1e-5,
                    "decoupled {decoupled} t {t} k {k}"
                );
            }
            assert_eq!(state[3][0], t as f32);
        }
    }
}
