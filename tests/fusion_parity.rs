//! Imported models against their zoo twins: what the CUDA executor would
//! launch for each (ops by kind after fusion and views, fused chains by
//! kind), computed on the CPU from the graph, the order and the plan as the
//! executor computes them (`exec/cuda/fuse.rs`, `compile::chains`).
//!
//! The tiny fixtures (tests/data/onnx, scripts/onnx_fixtures.py) are checked
//! for the patterns the zoo's graphs fuse; the full-size exports against
//! the zoo itself with `LANES_PARITY_DIR` (ignored by default: exported by
//! `python3 scripts/onnx_export_full.py DIR resnet50 inception_v3
//! bert_base`, 630 MB):
//!
//! ```text
//! LANES_PARITY_DIR=DIR cargo test --release --test fusion_parity -- --ignored --nocapture
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashSet};

use lanes::compile;
use lanes::exec::cuda::fuse::{find_chains, Role};
use lanes_adaptor::onnx::{import_file, ImportOptions};
use lanes_adaptor::{validate, Arch, Graph, GraphLimits, Op, Outlet};

/// What runs: launched ops by kind, fused chains by kind, views.
#[derive(Debug, Default)]
struct Profile {
    launched: BTreeMap<String, usize>,
    chains: BTreeMap<String, usize>,
    views: usize,
    nodes: usize,
    /// Softmax chains that take in the scale before them.
    scaled_softmax: usize,
}

impl Profile {
    fn launches(&self) -> usize {
        self.launched.values().sum()
    }

    fn launched(&self, kind: &str) -> usize {
        self.launched.get(kind).copied().unwrap_or(0)
    }
}

fn profile(graph: Graph, fetches: &[String]) -> Profile {
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    let mut fetchable: HashSet<Outlet> = compile::sinks(&vg);
    for f in fetches {
        fetchable.insert(vg.graph().resolve(f).unwrap());
    }
    let plan = compile::plan_outlets(&vg, fetchable.clone(), Default::default()).unwrap();
    let range = |o: Outlet| {
        plan.slot(o)
            .map(|s| (s.offset as usize, (s.offset + s.bytes) as usize))
    };
    let f = find_chains(vg.graph(), vg.order(), &fetchable, &range);
    let mut p = Profile::default();
    for c in &f.chains {
        *p.chains.entry(c.name().to_string()).or_default() += 1;
    }
    for c in &f.softmax {
        *p.chains.entry(c.name().to_string()).or_default() += 1;
        p.scaled_softmax += usize::from(c.scale.is_some());
    }
    for &id in vg.order() {
        let node = &vg.graph().nodes[id.index()];
        if matches!(
            node.op,
            Op::Placeholder(_) | Op::Variable(_) | Op::Constant(_)
        ) {
            continue;
        }
        p.nodes += 1;
        if plan.is_view(Outlet::new(id, 0)) {
            p.views += 1;
            continue;
        }
        let name = match f.role(id) {
            Role::Skip => continue,
            Role::Last(k) => f.chains[k].name().to_string(),
            Role::Softmax(k) => f.softmax[k].name().to_string(),
            Role::ConvWithoutBias => "conv2d (bias fused)".to_string(),
            Role::Plain => node.op.name().to_string(),
        };
        *p.launched.entry(name).or_default() += 1;
    }
    p
}

fn show(what: &str, p: &Profile) {
    eprintln!(
        "== {what}: {} nodes, {} views, {} launches",
        p.nodes,
        p.views,
        p.launches()
    );
    for (k, n) in &p.launched {
        eprintln!("   {k:40} {n}");
    }
}

fn imported(path: &str, dims: &[(&str, usize)]) -> (Profile, lanes_adaptor::onnx::OnnxModel) {
    let opts = ImportOptions {
        batch: 2,
        dims: dims.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        ..ImportOptions::default()
    };
    let m = import_file(path, &opts).unwrap();
    let outs: Vec<String> = m.outputs.iter().map(|(n, _)| n.clone()).collect();
    (profile(m.graph.clone(), &outs), m)
}

fn fixture(name: &str) -> String {
    format!("{}/tests/data/onnx/{name}.onnx", env!("CARGO_MANIFEST_DIR"))
}

/// Every batch norm folds into its convolution at import and every
/// convolution's bias and Relu (and a residual Add) run in its epilogue, as
/// the zoo's convolutions fuse their batch norm and Relu; as in the zoo, a
/// shortcut convolution (the residual of a chain) runs alone.
#[test]
fn imported_cnns_fuse_every_conv_epilogue() {
    for name in ["resnet18", "resnet50", "inception_v3"] {
        let (p, _) = imported(&fixture(name), &[]);
        show(name, &p);
        for plain in ["batch_norm", "relu", "add"] {
            // One Add may stay: the classifier's bias.
            let allowed = usize::from(plain == "add");
            assert!(
                p.launched(plain) <= allowed,
                "{name}: {plain} runs alone: {p:?}"
            );
        }
        let fused: usize = p.chains.values().sum();
        assert!(
            fused > 0 && fused == p.launched("conv2d (bias fused)"),
            "{name}: {p:?}"
        );
    }
}

/// Hugging Face's BERT exported with scaled-dot-product attention (the
/// default): its attention mask is made once, not once per layer, and each
/// layer's softmax takes in the scores' scale and the mask as the zoo's
/// attention does, and the NaN cleanup after it; nothing multiplies q or k.
#[test]
fn imported_bert_attention_fuses_as_the_zoos() {
    let (p, m) = imported(&fixture("bert"), &[]);
    show("bert", &p);
    let layers = 2;
    assert_eq!(p.chains.get("fused softmax"), Some(&layers), "{p:?}");
    assert_eq!(p.chains.get("fused bias_row+gelu"), Some(&layers), "{p:?}");
    assert_eq!(p.scaled_softmax, layers, "{p:?}");
    assert_eq!(p.launched("scale"), 0, "{p:?}");
    // The mask's two Wheres (the cast to bool, then 0/-∞) once; each
    // layer's NaN cleanup after the softmax runs in the softmax's kernel.
    assert!(p.launched("where") <= 2, "{p:?}");
    assert_eq!(p.launched("is_nan"), 0, "{p:?}");
    assert!(
        m.simplified.merged > 0 && m.simplified.scales == layers,
        "{:?}",
        m.simplified
    );
}

#[test]
#[ignore = "needs LANES_PARITY_DIR with full-size exports (see the module docs)"]
fn full_size_exports_against_the_zoo() {
    let dir = std::env::var("LANES_PARITY_DIR").unwrap();
    for (file, arch, dims) in [
        ("resnet50", Arch::ResNet50, vec![]),
        ("inception_v3", Arch::InceptionV3, vec![]),
        (
            "bert_base",
            Arch::BertBase { seq: 128 },
            vec![("sequence", 128)],
        ),
    ] {
        let path = format!("{dir}/{file}.onnx");
        let (p, m) = imported(&path, &dims);
        show(&format!("{file} imported ({:?})", m.simplified), &p);
        let z = arch.inference(2, 0).unwrap();
        let zp = profile(z.graph, &[]);
        show(&format!("{file} zoo"), &zp);
        let chains = |p: &Profile| p.chains.values().sum::<usize>();
        assert!(chains(&p) >= chains(&zp), "{file}: {p:?}\n{zp:?}");
        // BERT's imported graph also makes the padding mask (the zoo's
        // attends to every token): 5 launches.
        let extra = if file == "bert_base" { 5 } else { 0 };
        assert!(
            p.launches() <= zp.launches() + extra,
            "{file}: {p:?}\n{zp:?}"
        );
    }
}
