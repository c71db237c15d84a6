//! The model zoo: published architectures with the reference parameter
//! counts, and small models for tests.
//!
//! Every [`Arch`] builds an inference graph ([`Arch::inference`]) and a
//! training graph ([`Arch::training`]) at a chosen batch size. Classifiers
//! train with cross-entropy against a `labels` placeholder (Inception-v3 adds
//! its auxiliary head's loss with weight 0.4, as torchvision's reference
//! training does); the BERT encoder, which has no task head, trains its
//! pooled output against a `target` placeholder with mean squared error.
//! Dropout is not part of the op set and is left out (it has no parameters).

mod bert;
mod inception;
mod resnet;
mod small;

use crate::autodiff::trainable_variables;
use crate::graph::{Graph, GraphBuilder, GraphError, Outlet, VarValues};
use crate::nn::{Mode, Nn};
use crate::optim::{training_graph, Optimizer, TrainError, TrainingGraph};
use crate::tensor::{DType, Tensor, TensorType};

/// Placeholders a job feeds: (name, type).
pub type Inputs = Vec<(String, TensorType)>;

/// Deterministic feeds for `inputs` from `seed` (a 64-bit LCG, the same
/// values on every platform): f32 values in [-1, 1) in steps of 0.001,
/// integer inputs (token ids, labels) in `0..int_range` (at least 1).
/// For tests and examples that need the same inputs on both backends.
pub fn seeded_feeds(
    inputs: &[(String, TensorType)],
    seed: u64,
    int_range: i64,
) -> Result<std::collections::BTreeMap<String, Tensor>, crate::tensor::TensorError> {
    let range = int_range.max(1);
    let mut s = seed;
    let mut next = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 33) as u32
    };
    inputs
        .iter()
        .map(|(name, ty)| {
            let n = ty.shape.numel();
            let t = match ty.dtype {
                DType::F32 => Tensor::from_f32(
                    ty.shape.clone(),
                    (0..n)
                        .map(|_| (next() % 2000) as f32 / 1000.0 - 1.0)
                        .collect(),
                ),
                DType::I64 => Tensor::from_i64(
                    ty.shape.clone(),
                    (0..n).map(|_| i64::from(next()) % range).collect(),
                ),
                DType::F16 => Tensor::from_f16(
                    ty.shape.clone(),
                    (0..n)
                        .map(|_| crate::f16::from_f32((next() % 2000) as f32 / 1000.0 - 1.0))
                        .collect(),
                ),
                DType::BF16 => Tensor::from_bf16(
                    ty.shape.clone(),
                    (0..n)
                        .map(|_| crate::bf16::from_f32((next() % 2000) as f32 / 1000.0 - 1.0))
                        .collect(),
                ),
            }?;
            Ok((name.clone(), t))
        })
        .collect()
}

/// A model of the zoo.
#[derive(Debug, Clone, PartialEq)]
pub enum Arch {
    /// Linear + ReLU layers, then a linear classifier.
    Mlp {
        inputs: usize,
        hidden: Vec<usize>,
        classes: usize,
    },
    /// LeNet-5 style: conv5×5(6) → pool → conv5×5(16) → pool → 120 → 84 →
    /// classes, ReLU and max pooling. The second conv is padded for images
    /// smaller than 16 so 8×8 digits fit; at 28×28 it is the classic LeNet-5.
    LeNet {
        channels: usize,
        image: usize,
        classes: usize,
    },
    /// ResNet-18 for 32×32 inputs (CIFAR): 3×3 stem, no max pool.
    ResNet18Cifar { classes: usize },
    /// torchvision `resnet50` (224×224, 1000 classes).
    ResNet50,
    /// torchvision `resnet152` (224×224, 1000 classes).
    ResNet152,
    /// torchvision `inception_v3` with its auxiliary head (299×299).
    InceptionV3,
    /// BERT-base encoder with pooler (`bert-base-uncased` sizes) at sequence length `seq`.
    BertBase { seq: usize },
    /// A 2-layer post-norm transformer encoder classifier over token ids.
    Transformer {
        vocab: usize,
        seq: usize,
        dim: usize,
        heads: usize,
        ff: usize,
        classes: usize,
    },
}

/// What the model's output is trained against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Logits over this many classes: cross-entropy against `labels` [B] i64.
    Classes(usize),
    /// A feature vector of this size: MSE against `target` [B, n] f32.
    Features(usize),
}

/// A model's forward graph under construction.
#[derive(Debug)]
pub struct Forward {
    pub nn: Nn,
    /// Placeholders the job feeds: (name, type).
    pub inputs: Inputs,
    pub output: Outlet,
    /// Auxiliary classifier output (Inception-v3, training form only).
    pub aux: Option<Outlet>,
    pub target: Target,
}

/// A finished inference graph.
#[derive(Debug, Clone)]
pub struct ModelGraph {
    pub graph: Graph,
    pub vars: VarValues,
    pub inputs: Inputs,
    /// Fetch key of the output.
    pub output: String,
}

/// Why a zoo model could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ZooError {
    #[error("model {model}: {source}")]
    Graph {
        model: &'static str,
        #[source]
        source: GraphError,
    },
    #[error("model {model}: {source}")]
    Train {
        model: &'static str,
        #[source]
        source: TrainError,
    },
    #[error("model {model}: batch size must be positive")]
    EmptyBatch { model: &'static str },
}

impl Arch {
    /// Short name used in errors and node names.
    pub fn name(&self) -> &'static str {
        match self {
            Arch::Mlp { .. } => "mlp",
            Arch::LeNet { .. } => "lenet",
            Arch::ResNet18Cifar { .. } => "resnet18_cifar",
            Arch::ResNet50 => "resnet50",
            Arch::ResNet152 => "resnet152",
            Arch::InceptionV3 => "inception_v3",
            Arch::BertBase { .. } => "bert_base",
            Arch::Transformer { .. } => "transformer",
        }
    }

    /// Builds the forward graph.
    pub fn forward(&self, batch: usize, mode: Mode, seed: u64) -> Forward {
        let nn = Nn::new(seed, mode);
        match self {
            Arch::Mlp {
                inputs,
                hidden,
                classes,
            } => small::mlp(nn, batch, *inputs, hidden, *classes),
            Arch::LeNet {
                channels,
                image,
                classes,
            } => small::lenet(nn, batch, *channels, *image, *classes),
            Arch::ResNet18Cifar { classes } => small::resnet18_cifar(nn, batch, *classes),
            Arch::ResNet50 => resnet::resnet(nn, batch, [3, 4, 6, 3], 1000),
            Arch::ResNet152 => resnet::resnet(nn, batch, [3, 8, 36, 3], 1000),
            Arch::InceptionV3 => inception::inception_v3(nn, batch, 1000),
            Arch::BertBase { seq } => bert::bert_base(nn, batch, *seq),
            Arch::Transformer {
                vocab,
                seq,
                dim,
                heads,
                ff,
                classes,
            } => small::transformer(
                nn,
                batch,
                small::TransformerCfg {
                    vocab: *vocab,
                    seq: *seq,
                    dim: *dim,
                    heads: *heads,
                    ff: *ff,
                    classes: *classes,
                },
            ),
        }
    }

    fn check_batch(&self, batch: usize) -> Result<(), ZooError> {
        if batch == 0 {
            return Err(ZooError::EmptyBatch { model: self.name() });
        }
        Ok(())
    }

    /// The inference graph at `batch`; the output is fetched as `output`.
    pub fn inference(&self, batch: usize, seed: u64) -> Result<ModelGraph, ZooError> {
        self.check_batch(batch)?;
        let mut f = self.forward(batch, Mode::Infer, seed);
        f.nn.g.set_name(f.output, "output");
        let (graph, vars) = f.nn.g.finish().map_err(|source| ZooError::Graph {
            model: self.name(),
            source,
        })?;
        Ok(ModelGraph {
            graph,
            vars,
            inputs: f.inputs,
            output: "output".into(),
        })
    }

    /// The training-form forward graph with its loss (named `loss`), and the
    /// placeholders to feed (model inputs, then `labels` or `target`).
    pub fn with_loss(
        &self,
        batch: usize,
        seed: u64,
    ) -> Result<(GraphBuilder, Outlet, Inputs), ZooError> {
        self.check_batch(batch)?;
        let f = self.forward(batch, Mode::Train, seed);
        let mut g = f.nn.g;
        let mut inputs = f.inputs;
        g.set_name(f.output, "output");
        let loss = match f.target {
            Target::Classes(_) => {
                let ty = TensorType::i64([batch]);
                let labels = g.placeholder("labels", ty.clone());
                inputs.push(("labels".into(), ty));
                let l = g.cross_entropy(f.output, labels);
                match f.aux {
                    Some(aux) => {
                        let la = g.cross_entropy(aux, labels);
                        let la = g.scale(la, 0.4);
                        g.add(l, la)
                    }
                    None => l,
                }
            }
            Target::Features(n) => {
                let ty = TensorType::f32([batch, n]);
                let t = g.placeholder("target", ty.clone());
                inputs.push(("target".into(), ty));
                g.mse_loss(f.output, t)
            }
        };
        g.set_name(loss, "loss");
        if let Some(e) = g.error() {
            return Err(ZooError::Graph {
                model: self.name(),
                source: e.clone(),
            });
        }
        Ok((g, loss, inputs))
    }

    /// The training graph at `batch`: one Run is one iteration; fetch `loss`.
    pub fn training(
        &self,
        batch: usize,
        seed: u64,
        opt: &Optimizer,
    ) -> Result<(TrainingGraph, Inputs), ZooError> {
        let (g, loss, inputs) = self.with_loss(batch, seed)?;
        let t = training_graph(g, loss, opt).map_err(|source| ZooError::Train {
            model: self.name(),
            source,
        })?;
        Ok((t, inputs))
    }

    /// Trainable parameters (running statistics excluded), counted on the
    /// training form at batch 1 (so Inception-v3's auxiliary head counts).
    pub fn param_count(&self) -> Result<usize, ZooError> {
        let (g, loss, _) = self.with_loss(1, 0)?;
        let vars = g.var_values();
        Ok(trainable_variables(&g, loss)
            .iter()
            .filter_map(|v| vars.get(g.name_of(*v)))
            .map(|t| t.numel())
            .sum())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn seeded_feeds_are_deterministic_and_in_range() {
        let inputs = vec![
            ("x".to_string(), TensorType::f32([4, 50])),
            ("labels".to_string(), TensorType::i64([200])),
        ];
        let a = seeded_feeds(&inputs, 3, 10).unwrap();
        assert_eq!(a, seeded_feeds(&inputs, 3, 10).unwrap());
        assert_ne!(a, seeded_feeds(&inputs, 4, 10).unwrap());
        let x = a["x"].f32s().unwrap();
        assert!(x.iter().all(|v| (-1.0..1.0).contains(v)));
        let l = a["labels"].i64s().unwrap();
        assert!(l.iter().all(|v| (0..10).contains(v)));
        // Every label value shows up in 200 draws; a range below 1 is 1.
        assert!((0..10).all(|k| l.contains(&k)));
        let one = seeded_feeds(&inputs, 3, 0).unwrap();
        assert!(one["labels"].i64s().unwrap().iter().all(|&v| v == 0));
    }
}
