//! CPU forward ops and program errors on small hand-computed cases.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use lanes::exec::cpu::CpuProgram;
use lanes::exec::ExecError;
use lanes_adaptor::{validate, GraphBuilder, GraphLimits, Tensor, TensorType};

#[test]
fn matmul_add_broadcast_relu_and_program_errors() {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([2, 2]));
    let w = g.variable(
        "w",
        Tensor::from_f32([2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap(),
    );
    let b = g.variable("b", Tensor::from_f32([2], vec![-10.0, 0.0]).unwrap());
    let y = g.matmul(x, w);
    let z = g.add(y, b);
    let r = g.relu(z);
    let name = g.graph_nodes()[r.node.index()].name.clone();
    let (graph, vars) = g.finish().unwrap();
    let mut p = CpuProgram::new(validate(graph, &GraphLimits::default()).unwrap(), vars).unwrap();
    let feeds = BTreeMap::from([(
        "x".to_string(),
        Tensor::from_f32([2, 2], vec![1.0, 0.0, 1.0, 1.0]).unwrap(),
    )]);
    let out = p.run(&feeds, std::slice::from_ref(&name)).unwrap();
    // x·w = [[1,2],[4,6]]; + b = [[-9,2],[-6,6]]; relu.
    assert_eq!(out[0].f32s().unwrap(), &[0.0, 2.0, 0.0, 6.0]);
    assert!(matches!(
        p.run(
            &BTreeMap::<String, Tensor>::new(),
            std::slice::from_ref(&name)
        ),
        Err(ExecError::MissingFeed { .. })
    ));
    assert!(matches!(
        p.run(&feeds, &["nope".into()]),
        Err(ExecError::UnknownFetch { .. })
    ));
    let bad = BTreeMap::from([("x".to_string(), Tensor::full([3, 2], 1.0))]);
    assert!(matches!(
        p.run(&bad, &[name]),
        Err(ExecError::FeedType { .. })
    ));
}

/// The ops added for imported models, on hand-computed values.
#[test]
fn erf_clip_is_nan_where_and_cast() {
    use lanes_adaptor::{DType, Op};
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([4]));
    let c = g.placeholder("c", TensorType::f32([2, 1]));
    let i = g.placeholder("i", TensorType::i64([3]));
    let erf = g.op1(Op::Erf, &[x]);
    let clip = g.op1(
        Op::Clip {
            min: -1.0,
            max: 0.5,
        },
        &[x],
    );
    let nan = g.op1(Op::IsNan, &[x]);
    let zero = g.scalar(0.0);
    let pick = g.op1(Op::Where, &[c, x, zero]);
    let to_i = g.op1(Op::Cast { to: DType::I64 }, &[x]);
    let to_f = g.op1(Op::Cast { to: DType::F32 }, &[i]);
    for (o, n) in [
        (erf, "erf"),
        (clip, "clip"),
        (nan, "nan"),
        (pick, "pick"),
        (to_i, "to_i"),
        (to_f, "to_f"),
    ] {
        g.set_name(o, n);
    }
    let (graph, vars) = g.finish().unwrap();
    let mut p = CpuProgram::new(validate(graph, &GraphLimits::default()).unwrap(), vars).unwrap();
    let feeds = BTreeMap::from([
        (
            "x".to_string(),
            Tensor::from_f32([4], vec![0.0, 1.0, -2.7, f32::NAN]).unwrap(),
        ),
        (
            "c".to_string(),
            Tensor::from_f32([2, 1], vec![1.0, 0.0]).unwrap(),
        ),
        (
            "i".to_string(),
            Tensor::from_i64([3], vec![-3, 0, 1 << 40]).unwrap(),
        ),
    ]);
    let names: Vec<String> = ["erf", "clip", "nan", "pick", "to_i", "to_f"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let out = p.run(&feeds, &names).unwrap();
    let erf = out[0].f32s().unwrap();
    assert_eq!(erf[0], 0.0);
    assert!((erf[1] - 0.842_700_8).abs() < 1e-6);
    assert!((erf[2] + 0.999_865_7).abs() < 1e-6);
    assert!(erf[3].is_nan());
    let clip = out[1].f32s().unwrap();
    assert_eq!(&clip[..3], &[0.0, 0.5, -1.0]);
    assert!(clip[3].is_nan(), "NaN passes through clip");
    assert_eq!(out[2].f32s().unwrap(), &[0.0, 0.0, 0.0, 1.0]);
    let pick = out[3].f32s().unwrap();
    assert_eq!(pick.len(), 8);
    assert_eq!(&pick[..3], &[0.0, 1.0, -2.7]);
    assert!(pick[3].is_nan());
    assert_eq!(&pick[4..], &[0.0; 4]);
    assert_eq!(out[4].i64s().unwrap(), &[0, 1, -2, 0]);
    assert_eq!(out[5].f32s().unwrap(), &[-3.0, 0.0, (1u64 << 40) as f32]);
}

#[test]
fn dropout_masks_drop_p_of_the_elements_and_follow_the_seed() {
    use lanes_adaptor::Op;
    let p = 0.3f32;
    let mut g = GraphBuilder::new();
    let seed = g.placeholder("seed", TensorType::i64([1]));
    let a = g.op1(
        Op::DropoutMask {
            p,
            salt: 1,
            shape: vec![100, 100],
        },
        &[seed],
    );
    let b = g.op1(
        Op::DropoutMask {
            p,
            salt: 2,
            shape: vec![100, 100],
        },
        &[seed],
    );
    g.set_name(a, "a");
    g.set_name(b, "b");
    let (graph, vars) = g.finish().unwrap();
    let mut prog =
        CpuProgram::new(validate(graph, &GraphLimits::default()).unwrap(), vars).unwrap();
    let run = |prog: &mut CpuProgram, s: i64| {
        let feeds = BTreeMap::from([("seed".to_string(), Tensor::from_i64([1], vec![s]).unwrap())]);
        let out = prog.run(&feeds, &["a".into(), "b".into()]).unwrap();
        (
            out[0].f32s().unwrap().to_vec(),
            out[1].f32s().unwrap().to_vec(),
        )
    };
    let (a1, b1) = run(&mut prog, 1);
    let keep = 1.0 / (1.0 - p);
    assert!(a1.iter().all(|&v| v == 0.0 || v == keep));
    let dropped = a1.iter().filter(|&&v| v == 0.0).count() as f32 / a1.len() as f32;
    // 10,000 draws: the fraction is within 0.02 of p (4.4 standard deviations).
    assert!((dropped - p).abs() < 0.02, "dropped {dropped}");
    assert_ne!(a1, b1, "two dropout ops of one graph draw different masks");
    let (a1_again, _) = run(&mut prog, 1);
    assert_eq!(a1, a1_again, "the mask is a function of the seed");
    let (a2, _) = run(&mut prog, 2);
    assert_ne!(a1, a2, "another seed, another mask");
}
