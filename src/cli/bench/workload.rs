//! What `lanes bench` runs: a graph, its initial variables, the placeholders
//! to feed (with the range of every integer input) and the one tensor to
//! fetch.
//!
//! - Inference of the reference architectures (ResNet-50/152, Inception-v3,
//!   BERT-base) uses [`super::models`], built layer for layer like
//!   torchvision / transformers in eval mode; the small zoo models (MLP,
//!   LeNet, ResNet-18 for 32×32, a 2-layer transformer) use
//!   [`lanes_adaptor::zoo`]'s inference form.
//! - Training uses the zoo's training form: batch-norm with batch
//!   statistics, the model's loss (cross-entropy against `labels`; BERT's
//!   pooled output against a `target` with MSE; Inception-v3 adds its
//!   auxiliary head with weight 0.4), the gradients the adaptor's autodiff
//!   builds and one in-place SGD update per parameter — exactly
//!   [`Arch::training`]. One Run is one training step; the loss is fetched.

use std::collections::BTreeMap;

use anyhow::{bail, Context};
use lanes_adaptor::{Arch, DType, Graph, Optimizer, Tensor, TensorData, TensorType, VarValues};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::models;

/// Models `bench infer` and `bench train` know.
pub const MODELS: &str = "resnet50, resnet152, inception_v3, bert_base, \
                          resnet18_cifar, lenet, mlp, transformer";

/// Refuses an unknown model name before anything is built.
pub fn check_model(model: &str, seq: usize) -> anyhow::Result<()> {
    if zoo_arch(model, seq).is_some() {
        Ok(())
    } else {
        bail!("unknown model `{model}`: give one of {MODELS}")
    }
}

/// Inference or one training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Infer,
    Train,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Infer => "infer",
            Kind::Train => "train",
        }
    }
}

/// A graph ready to be timed.
#[derive(Debug)]
pub struct Workload {
    pub kind: Kind,
    pub model: String,
    pub graph: Graph,
    pub vars: VarValues,
    /// Placeholders to feed, in order.
    pub inputs: Vec<(String, TensorType)>,
    /// Exclusive upper bound of each integer placeholder (token ids, labels).
    pub int_ranges: BTreeMap<String, usize>,
    /// The fetch key: the logits / pooled output, or the loss.
    pub fetch: String,
    /// Trained scalars (training) or all variable scalars (inference).
    pub params: usize,
    /// The feeds to time with, when the workload came with them (a saved
    /// job); else seeded random ones.
    pub example: Option<BTreeMap<String, Tensor>>,
}

impl Workload {
    /// An inference workload rewritten to compute in `precision`
    /// (`lanes_adaptor::amp`); a training workload is built at its
    /// precision instead ([`training_at`]).
    pub fn at_precision(mut self, precision: lanes_adaptor::Precision) -> anyhow::Result<Self> {
        if precision == lanes_adaptor::Precision::F32 {
            return Ok(self);
        }
        if self.kind != Kind::Infer {
            bail!("a training workload takes its precision when it is built");
        }
        let (graph, vars) = lanes_adaptor::amp::apply(self.graph, self.vars, precision)
            .with_context(|| format!("{} at {precision}", self.model))?;
        self.graph = graph;
        self.vars = vars;
        Ok(self)
    }

    /// Seeded random feeds: float inputs uniform in [-1, 1), integer inputs
    /// uniform over their range.
    pub fn random_feeds(&self, seed: u64) -> anyhow::Result<BTreeMap<String, Tensor>> {
        if let Some(ex) = &self.example {
            return Ok(ex.clone());
        }
        let mut rng = StdRng::seed_from_u64(seed);
        self.inputs
            .iter()
            .map(|(name, ty)| {
                let n = ty.shape.numel();
                let t = match ty.dtype {
                    DType::F32 | DType::F16 | DType::BF16 => {
                        let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                        let data = TensorData::from_f32_rounded(ty.dtype, &v)
                            .context("a float dtype rounds")?;
                        Tensor::new(ty.shape.clone(), data)?
                    }
                    DType::I64 => {
                        let hi = *self
                            .int_ranges
                            .get(name)
                            .with_context(|| format!("no value range known for input `{name}`"))?;
                        if hi == 0 {
                            bail!("input `{name}` has an empty value range");
                        }
                        Tensor::from_i64(
                            ty.shape.clone(),
                            (0..n).map(|_| rng.gen_range(0..hi as i64)).collect(),
                        )?
                    }
                };
                Ok((name.clone(), t))
            })
            .collect()
    }
}

/// A zoo architecture by name, with the ranges of its integer inputs
/// (`labels` included).
fn zoo_arch(model: &str, seq: usize) -> Option<(Arch, BTreeMap<String, usize>)> {
    let ranges = |v: &[(&str, usize)]| v.iter().map(|(n, r)| (n.to_string(), *r)).collect();
    Some(match model {
        "resnet50" => (Arch::ResNet50, ranges(&[("labels", 1000)])),
        "resnet152" => (Arch::ResNet152, ranges(&[("labels", 1000)])),
        "inception_v3" => (Arch::InceptionV3, ranges(&[("labels", 1000)])),
        "bert_base" => (
            Arch::BertBase { seq },
            ranges(&[("input_ids", 30522), ("token_type_ids", 2)]),
        ),
        "resnet18_cifar" => (
            Arch::ResNet18Cifar { classes: 10 },
            ranges(&[("labels", 10)]),
        ),
        "lenet" => (
            Arch::LeNet {
                channels: 1,
                image: 28,
                classes: 10,
            },
            ranges(&[("labels", 10)]),
        ),
        "mlp" => (
            Arch::Mlp {
                inputs: 784,
                hidden: vec![256, 128],
                classes: 10,
            },
            ranges(&[("labels", 10)]),
        ),
        "transformer" => (
            Arch::Transformer {
                vocab: 1000,
                seq,
                dim: 128,
                heads: 4,
                ff: 512,
                classes: 10,
            },
            ranges(&[("input_ids", 1000), ("labels", 10)]),
        ),
        _ => return None,
    })
}

/// The inference graph of `model` at `batch` (BERT and the transformer at
/// sequence length `seq`).
/// [`inference`] and its graph validated (large graphs allowed).
pub fn validated_inference(
    model: &str,
    batch: usize,
    seq: usize,
) -> anyhow::Result<(Workload, lanes_adaptor::ValidGraph)> {
    validated(inference(model, batch, seq)?)
}

/// A workload with its graph validated (a copy: the workload keeps its own).
pub fn validated(w: Workload) -> anyhow::Result<(Workload, lanes_adaptor::ValidGraph)> {
    let valid = lanes_adaptor::validate(
        w.graph.clone(),
        &lanes_adaptor::GraphLimits {
            max_nodes: 1 << 20,
            ..lanes_adaptor::GraphLimits::default()
        },
    )
    .context("model graph does not validate")?;
    Ok((w, valid))
}

pub fn inference(model: &str, batch: usize, seq: usize) -> anyhow::Result<Workload> {
    if batch == 0 {
        bail!("--batch must be positive");
    }
    match model {
        "resnet50" | "resnet152" | "inception_v3" | "bert_base" => {
            let b = models::build(model, batch, seq)?;
            let params = b.vars.values().map(Tensor::numel).sum();
            let int_ranges = b
                .inputs
                .iter()
                .filter(|(_, ty)| ty.dtype == DType::I64)
                .map(|(n, _)| (n.clone(), b.vocab))
                .collect();
            Ok(Workload {
                kind: Kind::Infer,
                model: model.into(),
                graph: b.graph,
                vars: b.vars,
                inputs: b.inputs,
                int_ranges,
                fetch: b.output,
                params,
                example: None,
            })
        }
        _ => {
            let (arch, int_ranges) = zoo_arch(model, seq)
                .with_context(|| format!("unknown model `{model}`: give one of {MODELS}"))?;
            let m = arch.inference(batch, 7)?;
            let params = m.vars.values().map(Tensor::numel).sum();
            Ok(Workload {
                kind: Kind::Infer,
                model: model.into(),
                graph: m.graph,
                vars: m.vars,
                inputs: m.inputs,
                int_ranges,
                fetch: m.output,
                params,
                example: None,
            })
        }
    }
}

/// The training graph of `model` at `batch` with optimizer `opt`: one Run
/// is forward, loss, backward and the update of every parameter.
pub fn training(
    model: &str,
    batch: usize,
    seq: usize,
    opt: &Optimizer,
) -> anyhow::Result<Workload> {
    training_at(model, batch, seq, opt, lanes_adaptor::Precision::F32)
}

/// [`training`] computing in `precision` (mixed precision: f32 weights).
pub fn training_at(
    model: &str,
    batch: usize,
    seq: usize,
    opt: &Optimizer,
    precision: lanes_adaptor::Precision,
) -> anyhow::Result<Workload> {
    if batch == 0 {
        bail!("--batch must be positive");
    }
    let (arch, int_ranges) = zoo_arch(model, seq)
        .with_context(|| format!("unknown model `{model}`: give one of {MODELS}"))?;
    let (t, inputs) = arch.training_at(batch, 7, opt, precision)?;
    let params = t.param_count();
    Ok(Workload {
        kind: Kind::Train,
        model: model.into(),
        graph: t.graph,
        vars: t.vars,
        inputs,
        int_ranges,
        fetch: t.loss,
        params,
        example: None,
    })
}

/// A job saved by an importer (`lanes.torch`'s `save_to=`), with its own
/// example feeds; the batch is the first input's leading dimension.
pub fn saved(dir: &std::path::Path) -> anyhow::Result<(Workload, usize)> {
    let job = lanes_adaptor::saved::load(dir)
        .with_context(|| format!("reading the saved job in {}", dir.display()))?;
    let inputs: Vec<(String, TensorType)> = job
        .graph
        .nodes
        .iter()
        .filter_map(|n| match &n.op {
            lanes_adaptor::Op::Placeholder(t) => Some((n.name.clone(), t.clone())),
            _ => None,
        })
        .collect();
    let batch = inputs
        .first()
        .and_then(|(_, t)| t.shape.dims().first().copied())
        .unwrap_or(1);
    let params = job.vars.values().map(Tensor::numel).sum();
    let model = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "saved".into());
    Ok((
        Workload {
            kind: if job.training {
                Kind::Train
            } else {
                Kind::Infer
            },
            model,
            graph: job.graph,
            vars: job.vars,
            inputs,
            int_ranges: BTreeMap::new(),
            fetch: job.fetch,
            params,
            example: Some(job.feeds),
        },
        batch,
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn small_models_have_feeds_in_range() {
        for model in ["mlp", "lenet", "resnet18_cifar", "transformer"] {
            for w in [
                inference(model, 2, 8).unwrap(),
                training(model, 2, 8, &Optimizer::sgd_momentum(0.1, 0.9, 0.0)).unwrap(),
            ] {
                let feeds = w.random_feeds(1).unwrap();
                assert_eq!(feeds.len(), w.inputs.len(), "{model}");
                for (name, ty) in &w.inputs {
                    let t = &feeds[name];
                    assert_eq!(t.shape(), &ty.shape, "{model} {name}");
                    if let Ok(v) = t.i64s() {
                        let hi = w.int_ranges[name] as i64;
                        assert!(v.iter().all(|&x| (0..hi).contains(&x)), "{model} {name}");
                    }
                }
                assert!(w.params > 0);
            }
        }
    }

    #[test]
    fn training_fetches_the_loss_and_labels_cover_the_classes() {
        let w = training("lenet", 3, 8, &Optimizer::sgd(0.1)).unwrap();
        assert_eq!(w.kind, Kind::Train);
        assert_eq!(w.fetch, "loss");
        assert_eq!(w.int_ranges["labels"], 10);
        assert!(w.inputs.iter().any(|(n, _)| n == "labels"));
    }

    #[test]
    fn unknown_model_and_empty_batch_are_errors() {
        let e = inference("vgg", 1, 8).unwrap_err().to_string();
        assert!(e.contains("unknown model `vgg`"), "{e}");
        assert!(training("vgg", 1, 8, &Optimizer::sgd(0.1)).is_err());
        assert!(training("mlp", 0, 8, &Optimizer::sgd(0.1)).is_err());
    }
}
