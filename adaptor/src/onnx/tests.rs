//! Typed errors for broken and unsupported models, and no panic on any
//! mutation of a real file's bytes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use proptest::prelude::*;

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/../tests/data/onnx/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn model(name: &str) -> proto::ModelProto {
    proto::ModelProto::decode(fixture(name).as_slice()).unwrap()
}

fn import_model(m: &proto::ModelProto) -> Result<OnnxModel, OnnxError> {
    import(&m.encode_to_vec(), &ImportOptions::default())
}

fn node_mut<'a>(m: &'a mut proto::ModelProto, op: &str) -> &'a mut proto::NodeProto {
    m.graph
        .as_mut()
        .unwrap()
        .node
        .iter_mut()
        .find(|n| n.op_type.as_deref() == Some(op))
        .unwrap()
}

#[test]
fn the_fixture_imports_and_reencodes() {
    let m = import_model(&model("resnet18.onnx")).unwrap();
    assert_eq!(m.opset, 17);
    assert_eq!(m.inputs[0].1.shape.dims(), &[1, 3, 32, 32]);
    assert_eq!(m.outputs[0].1.shape.dims(), &[1, 10]);
}

#[test]
fn unknown_op_and_foreign_domain_name_node_and_op() {
    let mut m = model("resnet18.onnx");
    let n = node_mut(&mut m, "Relu");
    n.op_type = Some("Mish".into());
    let want = n.name.clone().unwrap();
    match import_model(&m).unwrap_err() {
        OnnxError::Unsupported { node, op, .. } => {
            assert_eq!((node, op.as_str()), (want, "Mish"));
        }
        e => panic!("{e}"),
    }
    let mut m = model("resnet18.onnx");
    node_mut(&mut m, "Relu").domain = Some("com.microsoft".into());
    let e = import_model(&m).unwrap_err();
    assert!(
        matches!(&e, OnnxError::Unsupported { op, .. } if op == "com.microsoft.Relu"),
        "{e}"
    );
}

#[test]
fn old_opset_missing_input_and_bad_attributes_are_typed() {
    let mut m = model("resnet18.onnx");
    m.opset_import[0].version = Some(11);
    assert!(matches!(
        import_model(&m).unwrap_err(),
        OnnxError::Opset { found: 11, .. }
    ));

    let mut m = model("resnet18.onnx");
    node_mut(&mut m, "Gemm").input[0] = "nowhere".into();
    let e = import_model(&m).unwrap_err();
    assert!(
        matches!(&e, OnnxError::Node { op, reason, .. } if op == "Gemm" && reason.contains("nowhere")),
        "{e}"
    );

    // Asymmetric padding has no Lanes form: refused, naming the Conv.
    let mut m = model("resnet18.onnx");
    let conv = node_mut(&mut m, "Conv");
    for a in conv.attribute.iter_mut() {
        if a.name.as_deref() == Some("pads") {
            a.ints = vec![1, 1, 0, 0];
        }
    }
    let e = import_model(&m).unwrap_err();
    assert!(
        matches!(&e, OnnxError::Unsupported { op, reason, .. } if op == "Conv" && reason.contains("asymmetric")),
        "{e}"
    );

    // Weights that do not fit the input: the Lanes shape rules refuse them.
    let mut m = model("resnet18.onnx");
    let conv_w = node_mut(&mut m, "Conv").input[1].clone();
    let g = m.graph.as_mut().unwrap();
    let w = g
        .initializer
        .iter_mut()
        .find(|t| t.name.as_deref() == Some(conv_w.as_str()))
        .unwrap();
    w.dims[1] = 1;
    let n: i64 = w.dims.iter().product();
    w.raw_data = Some(vec![0u8; n as usize * 4]);
    let e = import_model(&m).unwrap_err();
    assert!(
        matches!(&e, OnnxError::Node { op, .. } if op == "Conv"),
        "{e}"
    );

    // Raw data that does not match the dims.
    let mut m = model("resnet18.onnx");
    m.graph.as_mut().unwrap().initializer[0].raw_data = Some(vec![0u8; 3]);
    assert!(matches!(
        import_model(&m).unwrap_err(),
        OnnxError::Input { .. }
    ));

    assert!(matches!(
        import(&[], &ImportOptions::default()).unwrap_err(),
        OnnxError::Malformed(_)
    ));
}

#[test]
fn a_symbolic_inner_dimension_needs_a_size() {
    use proto::tensor_shape_proto::dimension::Value;
    let mut m = model("resnet18.onnx");
    let g = m.graph.as_mut().unwrap();
    let Some(proto::type_proto::Value::TensorType(t)) =
        g.input[0].r#type.as_mut().unwrap().value.as_mut()
    else {
        panic!("tensor input");
    };
    t.shape.as_mut().unwrap().dim[2].value = Some(Value::DimParam("height".into()));
    assert!(matches!(
        import_model(&m).unwrap_err(),
        OnnxError::Input { .. }
    ));
    let opts = ImportOptions {
        dims: [("height".to_string(), 32)].into(),
        ..ImportOptions::default()
    };
    assert!(import(&m.encode_to_vec(), &opts).is_ok());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    /// Whatever bytes of a real model are changed or cut, import answers
    /// Ok or a typed error and never panics.
    #[test]
    fn mutated_files_never_panic(
        which in 0usize..2,
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        let mut bytes = fixture(["resnet18.onnx", "bert.onnx"][which]);
        for (at, v) in edits {
            let i = at.index(bytes.len());
            bytes[i] = v;
        }
        if let Some(c) = cut {
            bytes.truncate(c.index(bytes.len()));
        }
        let opts = ImportOptions { max_elements: 1 << 20, ..ImportOptions::default() };
        let _ = import(&bytes, &opts);
    }
}

/// The variables are exactly the float initializers, with their values:
/// nothing is folded into a weight (BERT's position and token-type lookups
/// stay embeddings of the original tables) and tied weights stay one.
#[test]
fn variables_are_the_initializers() {
    for file in ["bert.onnx", "densenet121.onnx", "mobilenet_v2.onnx"] {
        let m = model(file);
        let imported = import_model(&m).unwrap();
        let inits = &m.graph.as_ref().unwrap().initializer;
        let mut want: Vec<&str> = inits
            .iter()
            .filter(|t| t.data_type == Some(proto::tensor_proto::DataType::Float as i32))
            .map(|t| t.name.as_deref().unwrap())
            .collect();
        want.sort_unstable();
        let got: Vec<&str> = imported.vars.keys().map(String::as_str).collect();
        assert_eq!(got, want, "{file}");
        for t in inits {
            let h = value::from_proto(t, 1 << 20).unwrap();
            let v = &imported.vars[t.name.as_deref().unwrap()];
            assert_eq!(v, &h.to_tensor().unwrap());
        }
    }
}

/// A model saved with fp16 or bf16 weights (every float initializer
/// rewritten as 16-bit raw data) imports with each weight the exact f32
/// value of its 16-bit one; serving it in half again (`amp`) is lossless.
#[test]
fn half_initializers_import_as_their_exact_values() {
    use proto::tensor_proto::DataType;
    let original = model("mobilenet_v2.onnx");
    let f32_vars = import_model(&original).unwrap().vars;
    for (dt, round) in [
        (
            DataType::Float16,
            (|x: f32| half::f16::from_f32(x).to_bits()) as fn(f32) -> u16,
        ),
        (DataType::Bfloat16, |x: f32| {
            half::bf16::from_f32(x).to_bits()
        }),
    ] {
        let mut m = original.clone();
        for t in &mut m.graph.as_mut().unwrap().initializer {
            if t.data_type != Some(DataType::Float as i32) {
                continue;
            }
            let v = value::from_proto(t, 1 << 24).unwrap().as_f32s();
            t.data_type = Some(dt as i32);
            t.float_data.clear();
            t.raw_data = Some(v.iter().flat_map(|&x| round(x).to_le_bytes()).collect());
        }
        let imported = import_model(&m).unwrap();
        assert_eq!(imported.vars.len(), f32_vars.len());
        for (name, t) in &imported.vars {
            let want: Vec<f32> = f32_vars[name]
                .f32s()
                .unwrap()
                .iter()
                .map(|&x| {
                    let b = round(x);
                    if dt == DataType::Float16 {
                        half::f16::from_bits(b).to_f32()
                    } else {
                        half::bf16::from_bits(b).to_f32()
                    }
                })
                .collect();
            assert_eq!(t.f32s().unwrap(), want.as_slice(), "{name} as {dt:?}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    /// Structured mutations that still decode: an attribute's integers, a
    /// node's input wired to another value, a Constant's or initializer's
    /// dims. Import answers Ok or a typed error and never panics.
    #[test]
    fn mutated_graphs_never_panic(
        which in 0usize..4,
        edits in proptest::collection::vec(
            (0u8..3, any::<prop::sample::Index>(), any::<prop::sample::Index>(), prop_oneof![-3i64..40, Just(i64::MAX), Just(i64::MIN), any::<i64>()]),
            1..4,
        ),
    ) {
        let file = ["bert.onnx", "mobilenet_v2.onnx", "ops_layernorm.onnx", "ops_conv.onnx"][which];
        let mut m = model(file);
        let g = m.graph.as_mut().unwrap();
        let values: Vec<String> = g.node.iter().flat_map(|n| n.output.clone()).collect();
        for (kind, at, pick, v) in edits {
            match kind {
                0 => {
                    let n = at.get_mut(&mut g.node);
                    if let Some(a) = n.attribute.first_mut() {
                        if a.ints.is_empty() {
                            a.i = Some(v);
                        } else {
                            *pick.get_mut(&mut a.ints) = v;
                        }
                    }
                }
                1 => {
                    let n = at.get_mut(&mut g.node);
                    if !n.input.is_empty() {
                        *pick.get_mut(&mut n.input) = pick.get(&values).clone();
                    }
                }
                _ => {
                    if g.initializer.is_empty() {
                        continue;
                    }
                    let t = at.get_mut(&mut g.initializer);
                    if !t.dims.is_empty() {
                        *pick.get_mut(&mut t.dims) = v;
                    }
                }
            }
        }
        let opts = ImportOptions { max_elements: 1 << 20, batch: 2, ..ImportOptions::default() };
        let _ = import(&m.encode_to_vec(), &opts);
    }
}

fn count(m: &OnnxModel, op: &str) -> usize {
    m.graph.nodes.iter().filter(|n| n.op.name() == op).count()
}

/// Inputs and outputs declared float16 or bfloat16 are fed and fetched in
/// that type: a cast to f32 after each such input, one back before each
/// such output; the rest of the graph is the f32 one.
#[test]
fn half_inputs_and_outputs_keep_their_type() {
    use proto::tensor_proto::DataType;
    use proto::type_proto::Value;
    let plain = import_model(&model("ops_conv.onnx")).unwrap();
    assert_eq!(plain.inputs[0].1.dtype, DType::F32);
    for (dt, want) in [
        (DataType::Float16, DType::F16),
        (DataType::Bfloat16, DType::BF16),
    ] {
        let mut m = model("ops_conv.onnx");
        let g = m.graph.as_mut().unwrap();
        for vi in g.input.iter_mut().chain(g.output.iter_mut()) {
            if let Some(Value::TensorType(t)) = vi.r#type.as_mut().and_then(|t| t.value.as_mut()) {
                t.elem_type = Some(dt as i32);
            }
        }
        let half = import_model(&m).unwrap();
        let types = |l: &[(String, TensorType)]| l.iter().map(|(_, t)| t.dtype).collect::<Vec<_>>();
        assert_eq!(types(&half.inputs), vec![want; half.inputs.len()]);
        assert_eq!(types(&half.outputs), vec![want; half.outputs.len()]);
        for ((_, h), (_, p)) in half.inputs.iter().zip(&plain.inputs) {
            assert_eq!(h.shape, p.shape);
        }
        assert_eq!(
            count(&half, "cast"),
            count(&plain, "cast") + half.inputs.len() + half.outputs.len()
        );
        assert_eq!(half.vars, plain.vars);
    }
}

/// The Erf GELU becomes one `gelu`, unless an intermediate value is read
/// elsewhere (here: made a graph output), when it stays `erf` and friends.
#[test]
fn gelu_pattern_is_fused_only_when_private() {
    let m = import_model(&model("bert.onnx")).unwrap();
    assert_eq!((count(&m, "gelu"), count(&m, "erf")), (2, 0));
    let mut p = model("ops_layernorm.onnx");
    let m = import_model(&p).unwrap();
    assert_eq!((count(&m, "gelu"), count(&m, "erf")), (1, 0));
    let g = p.graph.as_mut().unwrap();
    let mut extra = g.output[0].clone();
    extra.name = Some("g1".into());
    extra.r#type = None;
    g.output.push(extra);
    let m = import_model(&p).unwrap();
    assert_eq!((count(&m, "gelu"), count(&m, "erf")), (0, 1));
    assert_eq!(m.outputs.last().unwrap().0, "g1");
}

/// Host folding of extreme values answers errors, not overflow panics.
#[test]
fn folding_extreme_ranges_is_an_error() {
    let a = Attrs(&[]);
    let i = |v: i64| value::Host::i64s(vec![], vec![v]).unwrap();
    let (lo, hi, one) = (i(i64::MIN), i(i64::MAX), i(1));
    let e = fold::eval("Range", &a, &[Some(&lo), Some(&hi), Some(&one)], 1 << 20);
    assert!(e.is_err());
    let f = |v: f32| value::Host::new(vec![], value::HostData::F32(vec![v])).unwrap();
    let (z, inf, d) = (f(0.0), f(f32::INFINITY), f(1.0));
    assert!(fold::eval("Range", &a, &[Some(&z), Some(&inf), Some(&d)], 1 << 20).is_err());
    let r = fold::eval("Range", &a, &[Some(&i(5)), Some(&i(-3)), Some(&i(-2))], 16)
        .unwrap()
        .unwrap();
    assert_eq!(r[0].as_i64s().unwrap(), vec![5, 3, 1, -1]);
}

/// Slices with extreme steps, and pooling/convolution attributes at the
/// ends of i64, are errors or valid results, never overflow panics.
#[test]
fn extreme_attributes_do_not_overflow() {
    let r = fold::slice_ranges(&[5], &[0], &[5], None, Some(&[i64::MAX])).unwrap();
    assert_eq!(r[0].2, 1);
    let r = fold::slice_ranges(&[5], &[4], &[i64::MIN], None, Some(&[i64::MIN])).unwrap();
    assert_eq!(r[0].2, 1);
    for (attr, v) in [
        ("strides", i64::MAX),
        ("pads", i64::MAX),
        ("dilations", i64::MAX),
        ("kernel_shape", i64::MAX),
    ] {
        for op in ["Conv", "MaxPool"] {
            let mut m = model("resnet18.onnx");
            let n = node_mut(&mut m, op);
            for a in n.attribute.iter_mut() {
                if a.name.as_deref() == Some(attr) {
                    a.ints.iter_mut().for_each(|x| *x = v);
                }
            }
            if let Some(a) = n
                .attribute
                .iter_mut()
                .find(|a| a.name.as_deref() == Some("ceil_mode"))
            {
                a.i = Some(1);
            }
            let _ = import_model(&m);
        }
    }
}
