//! Optimizers as graph ops, and the training graph.
//!
//! [`training_graph`] takes a forward graph with a scalar loss, appends the
//! gradients of every trainable variable ([`crate::autodiff`]) and one
//! in-place update per variable (`SgdUpdate` / `AdamUpdate`). Optimizer
//! state — momentum buffers, Adam's moments and step counters — are extra
//! variables (persistent memory of the job) whose initial values come with
//! the graph. One Run of the training graph, fetching the loss, is one
//! training iteration. Under fp16-mixed the step scales the loss
//! (`optim/scaler.rs`: `GradScaler`'s semantics) and skips an overflowing step.

mod scaler;

pub use scaler::{LossScale, FOUND_INF_NODE, GROWTH_TRACKER_VARIABLE, SCALE_VARIABLE};

use crate::amp::{self, AmpError, Precision};
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
    /// The same optimizer with learning rate `lr`.
    pub fn with_lr(mut self, new: f32) -> Self {
        match &mut self {
            Optimizer::Sgd { lr, .. }
            | Optimizer::Adam { lr, .. }
            | Optimizer::AdamW { lr, .. } => *lr = new,
        }
        self
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
    /// The learning rate is `lr` times the value of `scale` (a one-element
    /// variable) when given; a non-zero `skip` (one element, loss scaling's
    /// overflow flag) leaves the parameter and the state as they were.
    fn append_update(
        &self,
        g: &mut GraphBuilder,
        param: Outlet,
        grad: Outlet,
        scale: Option<Outlet>,
        skip: Option<Outlet>,
    ) -> Vec<String> {
        // The ops take the skip flag after the rate's scale: a rate of 1
        // stands in for an absent one.
        let scale = match (scale, skip) {
            (None, Some(_)) => Some(g.scalar(1.0)),
            _ => scale,
        };
        let extra = [scale.as_slice(), skip.as_slice()].concat();
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
                    &[&[param, grad, buf][..], &extra].concat(),
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
                    &[&[param, grad, m, v, step][..], &extra].concat(),
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
    #[error(
        "parameter group {group} names `{name}`, which is not a trainable variable of the loss"
    )]
    UnknownParameter { group: usize, name: String },
    #[error("`{name}` is in parameter groups {first} and {second}")]
    DuplicateParameter {
        name: String,
        first: usize,
        second: usize,
    },
    #[error("max_grad_norm must be positive and finite, got {0}")]
    BadClipNorm(f32),
    #[error(transparent)]
    Precision(#[from] AmpError),
    #[error("bad loss scaling settings: {0}")]
    BadLossScale(String),
    #[error("{0} keeps weights in half precision, which training does not support; use {1}")]
    HalfWeights(Precision, &'static str),
}

/// One parameter group (as in `torch.optim`): an optimizer and the
/// variables it updates.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup {
    pub params: Vec<String>,
    pub optimizer: Optimizer,
}

/// How [`training_graph_grouped`] builds the step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TrainOptions {
    /// The groups; variables in none are not updated (their gradients are
    /// not computed).
    pub groups: Vec<ParamGroup>,
    /// Clip the gradients by their global 2-norm, as
    /// `torch.nn.utils.clip_grad_norm_(params, max_norm)` before the update.
    pub max_grad_norm: Option<f32>,
    /// The precision the forward and backward compute in (weights,
    /// gradients and optimizer state stay f32; [`crate::amp`]).
    pub precision: Precision,
    /// Loss scaling's settings, used under [`Precision::F16Mixed`] only
    /// (bf16 and f32 train unscaled).
    pub loss_scale: LossScale,
}

/// Name of the variable holding group `k`'s learning rate in a graph built
/// by [`training_graph_grouped`]: writing it changes the rate of the next
/// steps (a scheduler's step).
pub fn lr_variable(group: usize) -> String {
    format!("opt/group{group}/lr")
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
    g: GraphBuilder,
    loss: Outlet,
    opt: &Optimizer,
) -> Result<TrainingGraph, TrainError> {
    training_graph_at(g, loss, opt, Precision::F32)
}

/// [`training_graph`] computing in `precision` (mixed precision: the
/// forward graph rewritten by [`amp::apply`], f32 master weights;
/// fp16-mixed with [`LossScale::default`]'s loss scaling).
pub fn training_graph_at(
    g: GraphBuilder,
    loss: Outlet,
    opt: &Optimizer,
    precision: Precision,
) -> Result<TrainingGraph, TrainError> {
    if let Some(e) = g.error() {
        return Err(TrainError::Graph(e.clone()));
    }
    let (mut g, loss) = with_precision(g, loss, precision)?;
    let params = trainable_variables(&g, loss);
    if params.is_empty() {
        return Err(TrainError::NoParameters);
    }
    let (scaler, target) = scale_loss(&mut g, loss, precision, LossScale::default())?;
    let grads = gradients(&mut g, target, &params)?;
    // trainable_variables only returns variables the loss depends on.
    let mut grads: Vec<(Outlet, Outlet)> = params
        .iter()
        .zip(grads)
        .filter_map(|(&p, gr)| Some((p, gr?)))
        .collect();
    let found = scaler
        .as_ref()
        .and_then(|s| s.unscale(&mut g, grads.iter_mut().map(|(_, gr)| gr)));
    // The skip flag follows a rate scale: one constant 1 for every update.
    let rate = found.map(|_| g.scalar(1.0));
    let mut state = Vec::new();
    let mut names = Vec::with_capacity(params.len());
    for (p, gr) in grads {
        names.push(g.name_of(p).to_string());
        state.extend(opt.append_update(&mut g, p, gr, rate, found));
    }
    if let (Some(s), Some(f)) = (&scaler, found) {
        state.extend(s.update(&mut g, f));
    }
    finish_training(g, loss, names, state)
}

/// The training graph of `loss` with parameter groups, learning rates held
/// in variables ([`lr_variable`]) and optional gradient clipping.
pub fn training_graph_grouped(
    g: GraphBuilder,
    loss: Outlet,
    opts: &TrainOptions,
) -> Result<TrainingGraph, TrainError> {
    if let Some(e) = g.error() {
        return Err(TrainError::Graph(e.clone()));
    }
    let (mut g, loss) = with_precision(g, loss, opts.precision)?;
    if let Some(c) = opts.max_grad_norm {
        if !(c > 0.0 && c.is_finite()) {
            return Err(TrainError::BadClipNorm(c));
        }
    }
    let trainable = trainable_variables(&g, loss);
    let by_name: std::collections::HashMap<String, Outlet> = trainable
        .iter()
        .map(|o| (g.name_of(*o).to_string(), *o))
        .collect();
    // (variable, group) in group order.
    let mut chosen: Vec<(Outlet, usize)> = Vec::new();
    let mut group_of: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (k, grp) in opts.groups.iter().enumerate() {
        for name in &grp.params {
            let Some(&o) = by_name.get(name) else {
                return Err(TrainError::UnknownParameter {
                    group: k,
                    name: name.clone(),
                });
            };
            if let Some(&first) = group_of.get(name.as_str()) {
                return Err(TrainError::DuplicateParameter {
                    name: name.clone(),
                    first,
                    second: k,
                });
            }
            group_of.insert(name, k);
            chosen.push((o, k));
        }
    }
    if chosen.is_empty() {
        return Err(TrainError::NoParameters);
    }
    let wrt: Vec<Outlet> = chosen.iter().map(|(o, _)| *o).collect();
    let (scaler, target) = scale_loss(&mut g, loss, opts.precision, opts.loss_scale)?;
    let grads = gradients(&mut g, target, &wrt)?;
    let mut grads: Vec<(Outlet, usize, Outlet)> = chosen
        .iter()
        .zip(grads)
        .filter_map(|(&(p, k), gr)| Some((p, k, gr?)))
        .collect();
    // Unscaled before clipping (`scaler.unscale_` before `clip_grad_norm_`).
    let found = scaler
        .as_ref()
        .and_then(|s| s.unscale(&mut g, grads.iter_mut().map(|(_, _, gr)| gr)));
    if let Some(max_norm) = opts.max_grad_norm {
        clip_by_global_norm(&mut g, &mut grads, max_norm);
    }
    let scales: Vec<Outlet> = opts
        .groups
        .iter()
        .enumerate()
        .map(|(k, grp)| g.variable(&lr_variable(k), Tensor::full([1], grp.optimizer.lr())))
        .collect();
    let mut state: Vec<String> = (0..opts.groups.len()).map(lr_variable).collect();
    let mut names = Vec::with_capacity(grads.len());
    for (p, k, gr) in grads {
        names.push(g.name_of(p).to_string());
        // The rate is the variable's value: the op's own factor is 1.
        let opt = opts.groups[k].optimizer.with_lr(1.0);
        state.extend(opt.append_update(&mut g, p, gr, Some(scales[k]), found));
    }
    if let (Some(s), Some(f)) = (&scaler, found) {
        state.extend(s.update(&mut g, f));
    }
    finish_training(g, loss, names, state)
}

/// Under fp16-mixed, the scaler's variables and the scaled loss to
/// differentiate; otherwise no scaler and `loss` itself.
fn scale_loss(
    g: &mut GraphBuilder,
    loss: Outlet,
    precision: Precision,
    settings: LossScale,
) -> Result<(Option<scaler::Scaler>, Outlet), TrainError> {
    if precision != Precision::F16Mixed {
        return Ok((None, loss));
    }
    let (s, scaled) = scaler::Scaler::scale_loss(g, loss, settings)?;
    Ok((Some(s), scaled))
}

/// The forward graph `g` rewritten to compute in `precision`, and its
/// loss there. Only the mixed precisions train: half weights would lose
/// small updates (fp16-mixed scales the loss: [`scale_loss`]).
fn with_precision(
    g: GraphBuilder,
    loss: Outlet,
    precision: Precision,
) -> Result<(GraphBuilder, Outlet), TrainError> {
    match precision {
        Precision::F32 => return Ok((g, loss)),
        Precision::Bf16Mixed | Precision::F16Mixed => {}
        Precision::Bf16 => return Err(TrainError::HalfWeights(precision, "bf16-mixed")),
        Precision::F16 => return Err(TrainError::HalfWeights(precision, "bf16-mixed")),
    }
    let key = g.key_of(loss);
    let (graph, vars) = g.finish()?;
    let (graph, vars) = amp::apply(graph, vars, precision)?;
    let loss = graph
        .resolve(&key)
        .ok_or(TrainError::UnknownLoss { name: key })?;
    Ok((GraphBuilder::from_parts(graph, vars), loss))
}

/// The finished training graph: `loss` as a fetch key (`name` or
/// `name:slot`), the trained variables and the optimizer's state.
fn finish_training(
    g: GraphBuilder,
    loss: Outlet,
    params: Vec<String>,
    state: Vec<String>,
) -> Result<TrainingGraph, TrainError> {
    let loss_key = g.key_of(loss);
    let (graph, vars) = g.finish()?;
    Ok(TrainingGraph {
        graph,
        vars,
        loss: loss_key,
        params,
        state,
    })
}

/// Scales every gradient by `min(1, max_norm / (‖g‖ + 1e-6))`, ‖g‖ the
/// 2-norm of all of them together (PyTorch's `clip_grad_norm_`).
fn clip_by_global_norm(g: &mut GraphBuilder, grads: &mut [(Outlet, usize, Outlet)], max_norm: f32) {
    let mut total: Option<Outlet> = None;
    for &(_, _, gr) in grads.iter() {
        let rank = g.dims(gr).len();
        let sq = g.mul(gr, gr);
        let axes: Vec<usize> = (0..rank).collect();
        let s = g.sum(sq, &axes, false);
        total = Some(match total {
            None => s,
            Some(t) => g.add(t, s),
        });
    }
    let Some(total) = total else { return };
    let norm = g.sqrt(total);
    let eps = g.scalar(1e-6);
    let denom = g.add(norm, eps);
    let max = g.scalar(max_norm);
    let coef = g.div(max, denom);
    let coef = g.op1(Op::Clip { min: 0.0, max: 1.0 }, &[coef]);
    for (_, _, gr) in grads.iter_mut() {
        *gr = g.mul(*gr, coef);
    }
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
