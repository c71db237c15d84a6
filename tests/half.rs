//! Half-precision tensors on the CPU reference (docs/precision.md): casts
//! bit for bit against the `half` crate, the dtype rules of shape
//! inference, half ops equal to the f32 kernel on the widened inputs
//! rounded once, gradients through casts, and the memory plan of a bf16
//! model.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use lanes::exec::cpu::CpuProgram;
use lanes_adaptor::graph::Conv2dAttrs;
use lanes_adaptor::{
    bf16, f16, gradients, validate, DType, GraphBuilder, GraphLimits, Op, Outlet, Tensor,
    TensorData, TensorType, VarValues,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Runs a finished graph once on the CPU reference and fetches `names`.
fn run(g: GraphBuilder, feeds: &BTreeMap<String, Tensor>, names: &[&str]) -> Vec<Tensor> {
    let (graph, vars) = g.finish().unwrap();
    run_parts(graph, vars, feeds, names)
}

fn run_parts(
    graph: lanes_adaptor::Graph,
    vars: VarValues,
    feeds: &BTreeMap<String, Tensor>,
    names: &[&str],
) -> Vec<Tensor> {
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    let mut p = CpuProgram::new(vg, vars).unwrap();
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    p.run(feeds, &names).unwrap()
}

fn bits16(t: &Tensor) -> Vec<u16> {
    match t.data() {
        TensorData::F16(v) => v.iter().map(|x| x.to_bits()).collect(),
        TensorData::BF16(v) => v.iter().map(|x| x.to_bits()).collect(),
        d => panic!("not a half tensor: {}", d.dtype()),
    }
}

/// f32 values rounded to `dtype` by the `half` crate.
fn round(dtype: DType, v: &[f32]) -> Tensor {
    Tensor::new([v.len()], TensorData::from_f32_rounded(dtype, v).unwrap()).unwrap()
}

/// Values that exercise rounding: ties both ways, NaN, infinities,
/// subnormals of both formats, overflow, signed zeros.
fn hard_values() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN_POSITIVE,
        1.0e-40, // f32 subnormal
        65504.0, // f16 max
        65519.99,
        65520.0, // f16: rounds to inf
        1.0e6,
        6.0e-8, // f16 smallest subnormal
        2.9e-8, // f16: below half the smallest subnormal, to zero
        3.0e-8, // f16: above half, to the smallest subnormal
        6.1e-5, // f16 near the smallest normal
        3.0e38, // bf16: rounds to inf? (bf16 max is about 3.39e38)
        3.4e38, // bf16: to inf
        0.1,
        1.0 / 3.0,
    ];
    // f16 ties: 1 + k/2048 lies halfway between f16 neighbours (ulp 1/1024).
    for k in [1u32, 3, 5, 7] {
        v.push(1.0 + k as f32 / 2048.0);
        v.push(-(1.0 + k as f32 / 2048.0));
    }
    // bf16 ties: 1 + k/256 lies halfway (ulp 1/128).
    for k in [1u32, 3, 5, 7] {
        v.push(1.0 + k as f32 / 256.0);
    }
    // Just above and below ties.
    v.push(f32::from_bits((1.0f32 + 1.0 / 2048.0).to_bits() + 1));
    v.push(f32::from_bits((1.0f32 + 1.0 / 2048.0).to_bits() - 1));
    v.push(f32::from_bits((1.0f32 + 1.0 / 256.0).to_bits() + 1));
    v.push(f32::from_bits((1.0f32 + 1.0 / 256.0).to_bits() - 1));
    // A spread of magnitudes.
    let mut rng = StdRng::seed_from_u64(3);
    for _ in 0..200 {
        let e: i32 = rng.gen_range(-30..20);
        v.push(rng.gen_range(-1.0f32..1.0) * 2f32.powi(e));
    }
    v
}

#[test]
fn casts_round_to_nearest_even_as_the_half_crate() {
    let v = hard_values();
    let n = v.len();
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([n]));
    let h = g.cast(x, DType::F16);
    let b = g.cast(x, DType::BF16);
    let h_back = g.cast(h, DType::F32);
    let b_back = g.cast(b, DType::F32);
    let h_to_b = g.cast(h, DType::BF16);
    for (o, name) in [
        (h, "h"),
        (b, "b"),
        (h_back, "h_back"),
        (b_back, "b_back"),
        (h_to_b, "h_to_b"),
    ] {
        g.set_name(o, name);
    }
    let feeds = BTreeMap::from([("x".to_string(), Tensor::from_f32([n], v.clone()).unwrap())]);
    let out = run(g, &feeds, &["h", "b", "h_back", "b_back", "h_to_b"]);
    let want_h: Vec<u16> = v.iter().map(|&x| f16::from_f32(x).to_bits()).collect();
    let want_b: Vec<u16> = v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
    assert_eq!(bits16(&out[0]), want_h);
    assert_eq!(bits16(&out[1]), want_b);
    // A few facts the crate's rounding gives, checked by hand.
    let at = |x: f32| v.iter().position(|&y| y.to_bits() == x.to_bits()).unwrap();
    assert_eq!(bits16(&out[0])[at(65520.0)], 0x7c00, "f16 overflow to inf");
    assert_eq!(
        bits16(&out[0])[at(6.0e-8)],
        0x0001,
        "f16 smallest subnormal"
    );
    assert_eq!(bits16(&out[0])[at(2.9e-8)], 0x0000, "f16 underflow to zero");
    assert_eq!(bits16(&out[1])[at(3.4e38)], 0x7f80, "bf16 overflow to inf");
    // Ties to even: 1 + 1/2048 rounds down to 1.0, 1 + 3/2048 up to 1 + 4/2048.
    assert_eq!(bits16(&out[0])[at(1.0 + 1.0 / 2048.0)], 0x3c00);
    assert_eq!(bits16(&out[0])[at(1.0 + 3.0 / 2048.0)], 0x3c02);
    assert_eq!(bits16(&out[1])[at(1.0 + 1.0 / 256.0)], 0x3f80);
    assert_eq!(bits16(&out[1])[at(1.0 + 3.0 / 256.0)], 0x3f82);
    // NaN stays NaN in every direction.
    assert!(f16::from_bits(bits16(&out[0])[at(f32::NAN)]).is_nan());
    assert!(bf16::from_bits(bits16(&out[1])[at(f32::NAN)]).is_nan());
    // Widening is exact.
    let hb = out[2].f32s().unwrap();
    let bb = out[3].f32s().unwrap();
    for i in 0..n {
        let (wh, wb) = (f16::from_bits(want_h[i]), bf16::from_bits(want_b[i]));
        assert!(
            hb[i].to_bits() == wh.to_f32().to_bits() || (hb[i].is_nan() && wh.is_nan()),
            "f16 widening of {}",
            v[i]
        );
        assert!(
            bb[i].to_bits() == wb.to_f32().to_bits() || (bb[i].is_nan() && wb.is_nan()),
            "bf16 widening of {}",
            v[i]
        );
    }
    // f16 -> bf16 rounds once from the (exact) f16 value.
    let want_hb: Vec<u16> = want_h
        .iter()
        .map(|&h| bf16::from_f32(f16::from_bits(h).to_f32()).to_bits())
        .collect();
    assert_eq!(bits16(&out[4]), want_hb);
}

#[test]
fn casts_from_i64_round_once() {
    let v: Vec<i64> = vec![
        0,
        1,
        -1,
        2049,
        2051,
        65504,
        65520,
        1 << 40,
        (1 << 24) + 1,
        -257,
    ];
    let n = v.len();
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::i64([n]));
    let h = g.cast(x, DType::F16);
    let b = g.cast(x, DType::BF16);
    g.set_name(h, "h");
    g.set_name(b, "b");
    let feeds = BTreeMap::from([("x".to_string(), Tensor::from_i64([n], v.clone()).unwrap())]);
    let out = run(g, &feeds, &["h", "b"]);
    let want_h: Vec<u16> = v
        .iter()
        .map(|&x| f16::from_f64(x as f64).to_bits())
        .collect();
    let want_b: Vec<u16> = v
        .iter()
        .map(|&x| bf16::from_f64(x as f64).to_bits())
        .collect();
    assert_eq!(bits16(&out[0]), want_h);
    assert_eq!(bits16(&out[1]), want_b);
    // 2049 is a tie between the f16 values 2048 and 2050: to even, 2048.
    assert_eq!(f16::from_bits(bits16(&out[0])[3]).to_f32(), 2048.0);
    assert_eq!(f16::from_bits(bits16(&out[0])[4]).to_f32(), 2052.0);
}

/// The graph error of `build` applied to inputs of `types`.
fn refusal(types: &[TensorType], build: impl FnOnce(&mut GraphBuilder, &[Outlet])) -> String {
    let mut g = GraphBuilder::new();
    let xs: Vec<Outlet> = types
        .iter()
        .enumerate()
        .map(|(i, t)| g.placeholder(&format!("x{i}"), t.clone()))
        .collect();
    build(&mut g, &xs);
    g.finish()
        .expect_err("the graph must be refused")
        .to_string()
}

#[test]
fn f32_only_ops_refuse_half_inputs_naming_op_and_dtype() {
    let bf = TensorType::new(DType::BF16, [2, 3]);
    let h = TensorType::new(DType::F16, [2, 3]);
    let e = refusal(std::slice::from_ref(&bf), |g, x| {
        g.softmax(x[0], 1);
    });
    assert!(
        e.contains("softmax") && e.contains("bf16") && e.contains("Cast it to f32"),
        "{e}"
    );
    let e = refusal(std::slice::from_ref(&h), |g, x| {
        g.log_softmax(x[0], 1);
    });
    assert!(e.contains("log_softmax") && e.contains("f16"), "{e}");
    let e = refusal(
        &[
            h.clone(),
            TensorType::new(DType::F16, [3]),
            TensorType::new(DType::F16, [3]),
        ],
        |g, x| {
            g.layer_norm(x[0], x[1], x[2], 1e-5);
        },
    );
    assert!(e.contains("layer_norm") && e.contains("f16"), "{e}");
    let e = refusal(&[bf.clone(), TensorType::i64([2])], |g, x| {
        g.cross_entropy(x[0], x[1]);
    });
    assert!(e.contains("cross_entropy") && e.contains("bf16"), "{e}");
    let e = refusal(&[bf.clone(), bf.clone()], |g, x| {
        g.mse_loss(x[0], x[1]);
    });
    assert!(e.contains("mse_loss") && e.contains("bf16"), "{e}");
    // Mixed float dtypes are refused: one dtype per op.
    let e = refusal(&[bf.clone(), TensorType::f32([2, 3])], |g, x| {
        g.add(x[0], x[1]);
    });
    assert!(e.contains("add") && e.contains("share one dtype"), "{e}");
    let e = refusal(&[bf.clone(), h.clone()], |g, x| {
        g.matmul_t(x[0], x[1], false, true);
    });
    assert!(e.contains("matmul"), "{e}");
    // Casts: half to i64 is not one.
    let e = refusal(std::slice::from_ref(&bf), |g, x| {
        g.cast(x[0], DType::I64);
    });
    assert!(e.contains("cannot cast bf16 to i64"), "{e}");
    // And the half-capable ops take them, keeping the dtype.
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", bf.clone());
    let w = g.placeholder("w", TensorType::new(DType::BF16, [3, 4]));
    let y = g.matmul(x, w);
    let r = g.gelu(y);
    let s = g.sum(r, &[1], false);
    assert_eq!(g.ty(y).unwrap().dtype, DType::BF16);
    assert_eq!(g.ty(s).unwrap(), &TensorType::new(DType::BF16, [2]));
    g.finish().unwrap();
}

/// Seeded values in [-1, 1).
fn values(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// Rounds an f32 intermediate to `dtype` and back (a cast pair), where a
/// half graph's op would have stored it in `dtype`; nothing for `None`.
fn rounded(g: &mut GraphBuilder, o: Outlet, dtype: Option<DType>) -> Outlet {
    match dtype {
        Some(d) => {
            let h = g.cast(o, d);
            g.cast(h, DType::F32)
        }
        None => o,
    }
}

/// Checks a small graph in `dtype` against the f32 graph: bit for bit
/// equal to the f32 kernels on the widened inputs, each op's result rounded
/// once (`build` marks intermediates with [`rounded`]), and within
/// `tol(reference)` of the f32 result on the unrounded inputs.
fn check_op(
    dtype: DType,
    shapes: &[&[usize]],
    build: impl Fn(&mut GraphBuilder, &[Outlet], Option<DType>) -> Outlet,
    tol: impl Fn(f32) -> f32,
) {
    let mut rng = StdRng::seed_from_u64(17);
    let exact: Vec<Vec<f32>> = shapes
        .iter()
        .map(|s| values(&mut rng, s.iter().product()))
        .collect();
    let graph = |d: DType, round_between: Option<DType>| {
        let mut g = GraphBuilder::new();
        let xs: Vec<Outlet> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| g.placeholder(&format!("x{i}"), TensorType::new(d, s.to_vec())))
            .collect();
        let y = build(&mut g, &xs, round_between);
        g.set_name(y, "y");
        g
    };
    let feeds = |d: DType, widen: bool| -> BTreeMap<String, Tensor> {
        shapes
            .iter()
            .zip(&exact)
            .enumerate()
            .map(|(i, (s, v))| {
                let r = TensorData::from_f32_rounded(dtype, v).unwrap();
                let data = match (d, widen) {
                    (DType::F32, true) => TensorData::F32(r.to_f32_vec().unwrap()),
                    (DType::F32, false) => TensorData::F32(v.clone()),
                    _ => r,
                };
                (format!("x{i}"), Tensor::new(s.to_vec(), data).unwrap())
            })
            .collect()
    };
    let half = run(graph(dtype, None), &feeds(dtype, false), &["y"]).remove(0);
    assert_eq!(half.dtype(), dtype);
    let widened = run(
        graph(DType::F32, Some(dtype)),
        &feeds(DType::F32, true),
        &["y"],
    )
    .remove(0);
    let rounded = TensorData::from_f32_rounded(dtype, widened.f32s().unwrap()).unwrap();
    let want = Tensor::new(widened.shape().clone(), rounded).unwrap();
    assert_eq!(
        bits16(&half),
        bits16(&want),
        "not the f32 kernel rounded once"
    );
    let full = run(graph(DType::F32, None), &feeds(DType::F32, false), &["y"]).remove(0);
    for (h, f) in half.to_f32_vec().unwrap().iter().zip(full.f32s().unwrap()) {
        assert!((h - f).abs() <= tol(*f), "{dtype}: {h} against f32 {f}");
    }
}

/// The dtype's unit roundoff (half its ulp at 1): bf16 2^-8, f16 2^-11.
fn unit(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 1.0 / 256.0,
        _ => 1.0 / 2048.0,
    }
}

#[test]
fn half_matmul_linear_and_conv_are_the_f32_kernels_rounded_once() {
    for d in [DType::BF16, DType::F16] {
        let u = unit(d);
        // A product over k terms of inputs rounded once each: each term is
        // off by at most 2u relative, the sum by 2u·k (|x| < 1), the result
        // rounded once more.
        let k = 16.0;
        check_op(
            d,
            &[&[5, 16], &[16, 7]],
            |g, x, _| g.matmul(x[0], x[1]),
            |f| u * (f.abs() + 2.0 * k),
        );
        check_op(
            d,
            &[&[2, 3, 16], &[7, 16], &[7]],
            |g, x, r| {
                let y = g.matmul_t(x[0], x[1], false, true);
                let y = rounded(g, y, r);
                g.add(y, x[2])
            },
            |f| 2.0 * u * (f.abs() + 2.0 * k + 1.0),
        );
        // 3 input channels × 3 × 3 window = 27 terms.
        check_op(
            d,
            &[&[2, 3, 6, 6], &[4, 3, 3, 3], &[4]],
            |g, x, _| {
                let attrs = Conv2dAttrs {
                    padding: [1, 1],
                    ..Conv2dAttrs::default()
                };
                g.conv2d(x[0], x[1], Some(x[2]), attrs)
            },
            |f| u * (f.abs() + 2.0 * 28.0),
        );
    }
}

#[test]
fn half_elementwise_activations_and_reductions_are_the_f32_kernels_rounded_once() {
    for d in [DType::BF16, DType::F16] {
        let u = unit(d);
        // Inputs off by u relative; the functions' slopes are at most e (exp
        // on [-1, 1)); the result rounded once more.
        let elementwise = |f: f32| 4.0 * u * (f.abs() + 1.0);
        type Build = fn(&mut GraphBuilder, &[Outlet], Option<DType>) -> Outlet;
        let unary: [Build; 7] = [
            |g, x, _| g.relu(x[0]),
            |g, x, _| g.gelu(x[0]),
            |g, x, _| g.sigmoid(x[0]),
            |g, x, _| g.tanh(x[0]),
            |g, x, _| g.exp(x[0]),
            |g, x, _| g.scale(x[0], 3.0),
            |g, x, _| g.op1(Op::HardSwish, &[x[0]]),
        ];
        for b in unary {
            check_op(d, &[&[3, 5]], b, elementwise);
        }
        let binary: [Build; 3] = [
            |g, x, _| g.add(x[0], x[1]),
            |g, x, _| g.mul(x[0], x[1]),
            |g, x, _| g.sub(x[0], x[1]),
        ];
        for b in binary {
            check_op(d, &[&[3, 5], &[5]], b, elementwise);
        }
        check_op(
            d,
            &[&[4, 6]],
            |g, x, _| g.sum(x[0], &[1], false),
            |f| u * (f.abs() + 2.0 * 6.0),
        );
        check_op(
            d,
            &[&[4, 6]],
            |g, x, _| g.mean(x[0], &[0], true),
            elementwise,
        );
        check_op(
            d,
            &[&[4, 6]],
            |g, x, _| g.max(x[0], &[1], false),
            elementwise,
        );
        check_op(
            d,
            &[&[4, 6]],
            |g, x, _| g.sum_to(x[0], &[6]),
            |f| u * (f.abs() + 2.0 * 4.0),
        );
        check_op(
            d,
            &[&[1, 2, 4, 4]],
            |g, x, _| g.global_avg_pool(x[0]),
            elementwise,
        );
    }
}

#[test]
fn half_copies_move_the_values_as_they_are() {
    let mut rng = StdRng::seed_from_u64(5);
    let v = values(&mut rng, 24);
    for d in [DType::BF16, DType::F16] {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::new(d, [2, 3, 4]));
        let t = g.transpose(x, &[2, 0, 1]);
        let s = g.slice(x, 2, 1, 3);
        let c = g.concat(&[x, x], 1);
        let r = g.reshape(x, &[6, 4]);
        let b = g.broadcast_to(s, &[2, 2, 3, 2]);
        for (o, n) in [(t, "t"), (s, "s"), (c, "c"), (r, "r"), (b, "b")] {
            g.set_name(o, n);
        }
        let xh = round(d, &v).reshape([2, 3, 4]).unwrap();
        let feeds = BTreeMap::from([("x".to_string(), xh.clone())]);
        let out = run(g, &feeds, &["t", "s", "c", "r", "b"]);
        let xb = bits16(&xh);
        let at = |i: usize, j: usize, k: usize| xb[i * 12 + j * 4 + k];
        let mut want_t = Vec::new();
        for k in 0..4 {
            for i in 0..2 {
                for j in 0..3 {
                    want_t.push(at(i, j, k));
                }
            }
        }
        assert_eq!(bits16(&out[0]), want_t);
        let want_s: Vec<u16> = (0..2)
            .flat_map(|i| (0..3).flat_map(move |j| (1..3).map(move |k| (i, j, k))))
            .map(|(i, j, k)| at(i, j, k))
            .collect();
        assert_eq!(bits16(&out[1]), want_s);
        let want_c: Vec<u16> = (0..2)
            .flat_map(|i| xb[i * 12..(i + 1) * 12].repeat(2))
            .collect();
        assert_eq!(bits16(&out[2]), want_c);
        assert_eq!(bits16(&out[3]), xb);
        assert_eq!(out[4].shape().dims(), &[2, 2, 3, 2]);
        assert_eq!(&bits16(&out[4])[..6], &want_s[..6]);
        assert_eq!(&bits16(&out[4])[6..12], &want_s[6..12]);
    }
}

/// The gradients of an f32 graph and of the same graph computed in bf16
/// between casts (what autocast builds) agree within bf16's tolerance.
#[test]
fn gradients_through_casts_match_the_f32_graph() {
    let mut rng = StdRng::seed_from_u64(23);
    let xv = values(&mut rng, 2 * 3 * 5 * 5);
    let wv = values(&mut rng, 4 * 3 * 3 * 3);
    let bv = values(&mut rng, 4);
    let lv = values(&mut rng, 4 * 3);
    let tv = values(&mut rng, 2 * 3);
    // conv -> relu -> global pool -> linear -> mse, in f32 or with the
    // conv and the linear layer in `half` between casts.
    let build = |half: Option<DType>| {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2, 3, 5, 5]));
        let t = g.placeholder("t", TensorType::f32([2, 3]));
        let w = g.variable("w", Tensor::from_f32([4, 3, 3, 3], wv.clone()).unwrap());
        let b = g.variable("b", Tensor::from_f32([4], bv.clone()).unwrap());
        let l = g.variable("l", Tensor::from_f32([4, 3], lv.clone()).unwrap());
        let c = |g: &mut GraphBuilder, o: Outlet| match half {
            Some(d) => g.cast(o, d),
            None => o,
        };
        let (xc, wc, bc, lc) = (c(&mut g, x), c(&mut g, w), c(&mut g, b), c(&mut g, l));
        let attrs = Conv2dAttrs {
            padding: [1, 1],
            ..Conv2dAttrs::default()
        };
        let y = g.conv2d(xc, wc, Some(bc), attrs);
        let y = g.relu(y);
        let y = g.global_avg_pool(y);
        let y = g.matmul(y, lc);
        let y = match half {
            Some(_) => g.cast(y, DType::F32),
            None => y,
        };
        let loss = g.mse_loss(y, t);
        let grads = gradients(&mut g, loss, &[w, b, l]).unwrap();
        for (o, n) in grads.iter().zip(["dw", "db", "dl"]) {
            let o = o.unwrap();
            assert_eq!(
                g.ty(o).unwrap().dtype,
                DType::F32,
                "master gradients are f32"
            );
            g.set_name(o, n);
        }
        g.set_name(loss, "loss");
        g
    };
    let feeds = BTreeMap::from([
        (
            "x".to_string(),
            Tensor::from_f32([2, 3, 5, 5], xv.clone()).unwrap(),
        ),
        (
            "t".to_string(),
            Tensor::from_f32([2, 3], tv.clone()).unwrap(),
        ),
    ]);
    let names = ["loss", "dw", "db", "dl"];
    let full = run(build(None), &feeds, &names);
    let mixed = run(build(Some(DType::BF16)), &feeds, &names);
    for (i, n) in names.iter().enumerate() {
        let (f, m) = (full[i].f32s().unwrap(), mixed[i].f32s().unwrap());
        let scale = f.iter().fold(0f32, |a, x| a.max(x.abs())).max(1e-3);
        for (a, b) in f.iter().zip(m) {
            // A few bf16 roundings (1/256 each) along a short chain.
            assert!(
                (a - b).abs() <= 0.05 * scale,
                "{n}: f32 {a} against bf16 {b} (scale {scale})"
            );
        }
        assert!(m.iter().any(|&v| v != 0.0), "{n} is all zeros");
    }
}

/// A variable stored in bf16 gets a bf16 gradient (the value it
/// differentiates), computed by the half backward ops.
#[test]
fn half_variables_get_half_gradients() {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::new(DType::BF16, [3, 4]));
    let t = g.placeholder("t", TensorType::f32([3, 2]));
    let w0: Vec<f32> = (0..8).map(|i| (i as f32 - 3.5) / 4.0).collect();
    let w = g.variable("w", round(DType::BF16, &w0).reshape([4, 2]).unwrap());
    let y = g.matmul(x, w);
    let y = g.tanh(y);
    let y = g.cast(y, DType::F32);
    let loss = g.mse_loss(y, t);
    let dw = gradients(&mut g, loss, &[w]).unwrap()[0].unwrap();
    assert_eq!(g.ty(dw).unwrap(), &TensorType::new(DType::BF16, [4, 2]));
    g.set_name(dw, "dw");
    let xv: Vec<f32> = (0..12).map(|i| (i as f32) / 12.0 - 0.5).collect();
    let tv: Vec<f32> = (0..6).map(|i| (i as f32) / 6.0).collect();
    let feeds = BTreeMap::from([
        (
            "x".to_string(),
            round(DType::BF16, &xv).reshape([3, 4]).unwrap(),
        ),
        (
            "t".to_string(),
            Tensor::from_f32([3, 2], tv.clone()).unwrap(),
        ),
    ]);
    let got = run(g, &feeds, &["dw"]).remove(0);
    // The same in f32 on the same (bf16-representable) values.
    let mut f = GraphBuilder::new();
    let x = f.placeholder("x", TensorType::f32([3, 4]));
    let t = f.placeholder("t", TensorType::f32([3, 2]));
    let w = f.variable(
        "w",
        Tensor::from_f32([4, 2], round(DType::BF16, &w0).to_f32_vec().unwrap()).unwrap(),
    );
    let y = f.matmul(x, w);
    let y = f.tanh(y);
    let loss = f.mse_loss(y, t);
    let dw = gradients(&mut f, loss, &[w]).unwrap()[0].unwrap();
    f.set_name(dw, "dw");
    let feeds = BTreeMap::from([
        (
            "x".to_string(),
            Tensor::from_f32([3, 4], round(DType::BF16, &xv).to_f32_vec().unwrap()).unwrap(),
        ),
        ("t".to_string(), Tensor::from_f32([3, 2], tv).unwrap()),
    ]);
    let want = run(f, &feeds, &["dw"]).remove(0);
    let want = want.f32s().unwrap();
    let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
    for (a, b) in got.to_f32_vec().unwrap().iter().zip(want) {
        assert!((a - b).abs() <= 0.05 * scale, "bf16 {a} against f32 {b}");
    }
}

/// Half variables load, read back and write as they are.
#[test]
fn half_variables_load_read_and_write() {
    let v: Vec<f32> = vec![1.0, -2.5, 0.1, 65504.0, 3.0e-8];
    for d in [DType::F16, DType::BF16] {
        let init = round(d, &v);
        let mut g = GraphBuilder::new();
        let w = g.variable("w", init.clone());
        let y = g.scale(w, 2.0);
        g.set_name(y, "y");
        let (graph, vars) = g.finish().unwrap();
        let vg = validate(graph, &GraphLimits::default()).unwrap();
        let mut p = CpuProgram::new(vg, vars).unwrap();
        assert_eq!(p.read_variables(&[]).unwrap()["w"], init);
        let next = round(d, &[0.5, 0.25, -1.0, 7.0, 9.0]);
        p.write_variables(VarValues::from([("w".to_string(), next.clone())]))
            .unwrap();
        assert_eq!(p.read_variables(&[]).unwrap()["w"], next);
        let out = p
            .run(&BTreeMap::<String, Tensor>::new(), &["y".to_string()])
            .unwrap();
        assert_eq!(
            out[0].to_f32_vec().unwrap(),
            vec![1.0, 0.5, -2.0, 14.0, 18.0]
        );
    }
}

/// The planner sizes tensors by their dtype: an MLP with bf16 variables
/// holds exactly half the persistent bytes of the f32 one (every tensor a
/// multiple of 128 elements, so the 256-byte alignment pads neither).
#[test]
fn a_bf16_models_persistent_bytes_are_half_the_f32_ones() {
    let plan = |d: DType| {
        let mut g = GraphBuilder::new();
        let mut h = g.placeholder("x", TensorType::new(d, [8, 128]));
        for (i, (k, n)) in [(128, 256), (256, 256), (256, 128)].into_iter().enumerate() {
            let w = g.variable(&format!("w{i}"), Tensor::zeros(&TensorType::new(d, [k, n])));
            let b = g.variable(&format!("b{i}"), Tensor::zeros(&TensorType::new(d, [n])));
            h = g.matmul(h, w);
            h = g.add(h, b);
            h = g.relu(h);
        }
        g.set_name(h, "y");
        let (graph, _) = g.finish().unwrap();
        lanes::compile::plan(&validate(graph, &GraphLimits::default()).unwrap()).unwrap()
    };
    let (f, b) = (plan(DType::F32), plan(DType::BF16));
    let params = (128 * 256 + 256 + 256 * 256 + 256 + 256 * 128 + 128) as u64;
    assert_eq!(f.persistent, 4 * params);
    assert_eq!(b.persistent * 2, f.persistent);
    assert!(b.ephemeral < f.ephemeral);
}

/// The trainable variables of a loss reached through casts are the f32
/// master weights behind them, and bf16 variables count too.
#[test]
fn trainable_variables_are_found_through_casts() {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([2, 3]));
    let t = g.placeholder("t", TensorType::f32([2, 4]));
    let w = g.variable("w", Tensor::full([3, 4], 0.5));
    let b = g.variable("b", Tensor::zeros(&TensorType::new(DType::BF16, [4])));
    let xh = g.cast(x, DType::BF16);
    let wh = g.cast(w, DType::BF16);
    let y = g.matmul(xh, wh);
    let y = g.add(y, b);
    let y = g.cast(y, DType::F32);
    let loss = g.mse_loss(y, t);
    let found = lanes_adaptor::trainable_variables(&g, loss);
    assert_eq!(found.len(), 2);
    assert!(found.contains(&w) && found.contains(&b));
}
