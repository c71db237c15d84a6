//! Optimizers as graph ops, and the training graph.
//!
//! [`training_graph`] takes a forward graph with a scalar loss, appends the
//! gradients of every trainable variable ([`crate::autodiff`]) and one
//! in-place update per variable (`SgdUpdate` / `AdamUpdate`). Optimizer
//! state — momentum buffers, Adam's moments and step counters — are extra
//! variables (persistent memory of the job) whose initial values come with
//! the graph. One Run of the training graph, fetching the loss, is one
//! training iteration.

use crate::autodiff::{gradients, trainable_variables, AutodiffError};
use crate::graph::{Graph, GraphBuilder, GraphError, Op, Outlet, VarValues};
use crate::tensor::Tensor;

/// An optimizer and its hyper-parameters (PyTorch's semantics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// `torch.optim.SGD`: L2 weight decay added to the gradient, then
    /// (optionally Nesterov) momentum.
    Sgd {
        lr: f32,
        momentum: f32,
        weight_decay: f32,
        nesterov: bool,
    },
    /// `torch.optim.Adam` (L2 weight decay added to the gradient).
    Adam {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    },
    /// `torch.optim.AdamW` (decoupled weight decay).
    AdamW {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    },
}

impl Optimizer {
    /// Plain SGD.
    pub fn sgd(lr: f32) -> Self {
        Optimizer::Sgd {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
    /// SGD with momentum and weight decay.
    pub fn sgd_momentum(lr: f32, momentum: f32, weight_decay: f32) -> Self {
        Optimizer::Sgd {
            lr,
            momentum,
            weight_decay,
            nesterov: false,
        }
    }
    /// Adam with PyTorch's defaults (betas 0.9/0.999, eps 1e-8, no decay).
    pub fn adam(lr: f32) -> Self {
        Optimizer::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
    /// AdamW with PyTorch's default betas and eps.
    pub fn adamw(lr: f32, weight_decay: f32) -> Self {
        Optimizer::AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
        }
    }
    /// Learning rate.
    pub fn lr(&self) -> f32 {
        match *self {
            Optimizer::Sgd { lr, .. }
            | Optimizer::Adam { lr, .. }
            | Optimizer::AdamW { lr, .. } => lr,
        }
    }
    /// Optimizer state tensors per parameter (to size persistent memory).
    pub fn state_per_param(&self) -> usize {
        match self {
            Optimizer::Sgd { .. } => 1,
            Optimizer::Adam { .. } | Optimizer::AdamW { .. } => 2,
        }
    }

    /// Appends the in-place update of `param` by `grad`; returns the names
    /// of the state variables it created.
    fn append_update(&self, g: &mut GraphBuilder, param: Outlet, grad: Outlet) -> Vec<String> {
        let name = g.name_of(param).to_string();
        let ty = g.ty(param).cloned();
        let Some(ty) = ty else {
            return Vec::new();
        };
        match *self {
            Optimizer::Sgd {
                lr,
                momentum,
                weight_decay,
                nesterov,
            } => {
                let buf_name = format!("opt/{name}/momentum");
                let buf = g.variable(&buf_name, Tensor::zeros(&ty));
                let upd = g.op(
                    Op::SgdUpdate {
                        lr,
                        momentum,
                        weight_decay,
                        nesterov,
                    },
                    &[param, grad, buf],
                );
                debug_assert!(upd.is_empty());
                vec![buf_name]
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            }
            | Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let decoupled = matches!(self, Optimizer::AdamW { .. });
                let names = [
                    format!("opt/{name}/exp_avg"),
                    format!("opt/{name}/exp_avg_sq"),
                    format!("opt/{name}/step"),
                ];
                let m = g.variable(&names[0], Tensor::zeros(&ty));
                let v = g.variable(&names[1], Tensor::zeros(&ty));
                let step = g.variable(&names[2], Tensor::full([1], 0.0));
                g.op(
                    Op::AdamUpdate {
                        lr,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        decoupled,
                    },
                    &[param, grad, m, v, step],
                );
                names.to_vec()
            }
        }
    }
}

/// Why a training graph could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Autodiff(#[from] AutodiffError),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error("no node named `{name}` to use as the loss")]
    UnknownLoss { name: String },
    #[error("the loss depends on no trainable variable")]
    NoParameters,
}

/// A graph whose single Run is one training iteration.
#[derive(Debug, Clone)]
pub struct TrainingGraph {
    pub graph: Graph,
    /// Initial values: the model's variables plus the optimizer state.
    pub vars: VarValues,
    /// Fetch key of the loss.
    pub loss: String,
    /// Names of the trained variables, in graph order.
    pub params: Vec<String>,
    /// Names of the optimizer-state variables.
    pub state: Vec<String>,
}

impl TrainingGraph {
    /// Number of trained scalars.
    pub fn param_count(&self) -> usize {
        self.params
            .iter()
            .filter_map(|p| self.vars.get(p))
            .map(Tensor::numel)
            .sum()
    }
}

/// Builds the training graph from a forward graph under construction and its
/// scalar loss: gradients of every trainable variable plus one update each.
pub fn training_graph(
    mut g: GraphBuilder,
    loss: Outlet,
    opt: &Optimizer,
) -> Result<TrainingGraph, TrainError> {
    if let Some(e) = g.error() {
        return Err(TrainError::Graph(e.clone()));
    }
    let params = trainable_variables(&g, loss);
    if params.is_empty() {
        return Err(TrainError::NoParameters);
    }
    let grads = gradients(&mut g, loss, &params)?;
    let mut state = Vec::new();
    let mut names = Vec::with_capacity(params.len());
    for (p, gr) in params.iter().zip(grads) {
        // trainable_variables only returns variables the loss depends on.
        let Some(gr) = gr else { continue };
        names.push(g.name_of(*p).to_string());
        state.extend(opt.append_update(&mut g, *p, gr));
    }
    let loss_key = if loss.slot == 0 {
        g.name_of(loss).to_string()
    } else {
        format!("{}:{}", g.name_of(loss), loss.slot)
    };
    let (graph, vars) = g.finish()?;
    Ok(TrainingGraph {
        graph,
        vars,
        loss: loss_key,
        params: names,
        state,
    })
}

/// [`training_graph`] for a finished forward graph whose loss is fetched as
/// `loss` (`name` or `name:slot`).
pub fn training_graph_from(
    graph: Graph,
    vars: VarValues,
    loss: &str,
    opt: &Optimizer,
) -> Result<TrainingGraph, TrainError> {
    let out = graph.resolve(loss).ok_or_else(|| TrainError::UnknownLoss {
        name: loss.to_string(),
    })?;
    training_graph(GraphBuilder::from_parts(graph, vars), out, opt)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::graph::{validate, GraphLimits};
    use crate::tensor::TensorType;

    fn model() -> (Graph, VarValues) {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([4, 3]));
        let y = g.placeholder("y", TensorType::i64([4]));
        let w = g.variable("w", Tensor::full([3, 2], 0.1));
        let h = g.matmul(x, w);
        let l = g.cross_entropy(h, y);
        g.set_name(l, "loss");
        g.finish().unwrap()
    }

    #[test]
    fn every_optimizer_gives_a_valid_graph_with_state() {
        for (opt, per) in [
            (Optimizer::sgd_momentum(0.1, 0.9, 1e-4), 1),
            (Optimizer::adam(1e-3), 3),
            (Optimizer::adamw(1e-3, 0.01), 3),
        ] {
            let (graph, vars) = model();
            let t = training_graph_from(graph, vars, "loss", &opt).unwrap();
            assert_eq!(t.params, vec!["w".to_string()]);
            assert_eq!(t.state.len(), per);
            assert_eq!(t.param_count(), 6);
            for s in &t.state {
                assert!(t.vars.contains_key(s), "{s}");
            }
            assert_eq!(t.loss, "loss");
            validate(t.graph, &GraphLimits::default()).unwrap();
        }
    }

    #[test]
    fn unknown_loss_and_no_parameters() {
        let (graph, vars) = model();
        assert!(matches!(
            training_graph_from(graph, vars, "nope", &Optimizer::sgd(0.1)),
            Err(TrainError::UnknownLoss { .. })
        ));
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2]));
        let l = g.sum(x, &[0], false);
        assert!(matches!(
            training_graph(g, l, &Optimizer::sgd(0.1)),
            Err(TrainError::NoParameters)
        ));
    }
}
