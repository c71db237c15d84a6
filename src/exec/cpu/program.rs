//! Running a validated graph on the CPU: feeds, the set of nodes an
//! iteration needs, topological execution, in-place updates of variables.

use std::collections::BTreeMap;

use lanes_adaptor::{
    DType, NodeId, Op, Outlet, Tensor, TensorData, TensorType, ValidGraph, VarValues,
};

use super::run_op;
use crate::exec::{DataMut, DataRef, ExecError, TensorMut, TensorRef};

/// Checks that `vars` holds a value of the declared type for every variable.
pub(super) fn check_vars(graph: &ValidGraph, vars: &VarValues) -> Result<(), ExecError> {
    for (_, name, ty) in graph.graph().variables() {
        let v = vars
            .get(name)
            .ok_or_else(|| ExecError::MissingVariable { name: name.into() })?;
        if &v.ty() != ty {
            return Err(ExecError::VariableType {
                name: name.into(),
                expected: ty.clone(),
                got: v.ty(),
            });
        }
    }
    Ok(())
}

/// Read-only kernel view of a tensor whose type is `ty` (checked equal to its own).
pub(super) fn view<'a>(ty: &'a TensorType, t: &'a Tensor) -> TensorRef<'a> {
    let data = match t.data() {
        TensorData::F32(v) => DataRef::F32(v),
        TensorData::I64(v) => DataRef::I64(v),
    };
    TensorRef { ty, data }
}

/// Zeroed buffer of a type.
fn zeros(ty: &TensorType) -> TensorData {
    let n = ty.shape.numel();
    match ty.dtype {
        DType::F32 => TensorData::F32(vec![0.0; n]),
        DType::I64 => TensorData::I64(vec![0; n]),
    }
}

fn view_mut<'a>(ty: &'a TensorType, d: &'a mut TensorData) -> TensorMut<'a> {
    let data = match d {
        TensorData::F32(v) => DataMut::F32(v),
        TensorData::I64(v) => DataMut::I64(v),
    };
    TensorMut { ty, data }
}

fn into_tensor(ty: &TensorType, d: TensorData) -> Result<Tensor, ExecError> {
    Tensor::new(ty.shape.clone(), d).map_err(|e| ExecError::Op {
        node: String::new(),
        op: "program",
        reason: e.to_string(),
    })
}

/// Called before the node at each position of the execution order (and once
/// more with the order's length at the end); it may add variables to `vars`
/// (pipelined restore) or take the time (profiling).
pub(super) type BeforeNode<'h> = dyn FnMut(usize, &mut VarValues) -> Result<(), ExecError> + 'h;

/// Runs one iteration of `graph` with variables `vars` (updated in place).
pub(super) fn run_iteration(
    graph: &ValidGraph,
    vars: &mut VarValues,
    feeds: &BTreeMap<String, Tensor>,
    fetches: &[String],
    before: &mut BeforeNode<'_>,
) -> Result<Vec<Tensor>, ExecError> {
    let g = graph.graph();
    let n = g.nodes.len();
    // Feeds must name placeholders of the right type.
    for (name, t) in feeds {
        let id = g
            .find(name)
            .ok_or_else(|| ExecError::UnknownFeed { name: name.clone() })?;
        let node = &g.nodes[id.index()];
        let Op::Placeholder(ty) = &node.op else {
            return Err(ExecError::UnknownFeed { name: name.clone() });
        };
        if &t.ty() != ty {
            return Err(ExecError::FeedType {
                name: name.clone(),
                expected: ty.clone(),
                got: t.ty(),
            });
        }
    }
    // Fetch keys resolve.
    let outlets: Vec<Outlet> = fetches
        .iter()
        .map(|k| {
            g.resolve(k)
                .ok_or_else(|| ExecError::UnknownFetch { key: k.clone() })
        })
        .collect::<Result<_, _>>()?;
    // Needed: fetched nodes, in-place updates, and everything they read.
    let mut needed = vec![false; n];
    let mut stack: Vec<NodeId> = outlets.iter().map(|o| o.node).collect();
    stack.extend(
        g.nodes
            .iter()
            .enumerate()
            .filter(|(_, nd)| !nd.op.mutated_inputs().is_empty())
            .map(|(i, _)| NodeId(i as u32)),
    );
    while let Some(id) = stack.pop() {
        if std::mem::replace(&mut needed[id.index()], true) {
            continue;
        }
        stack.extend(g.nodes[id.index()].inputs.iter().map(|o| o.node));
    }
    // Remaining uses of each node's outputs, to free intermediates early.
    let mut uses = vec![0usize; n];
    for (i, nd) in g.nodes.iter().enumerate() {
        if needed[i] {
            for o in &nd.inputs {
                uses[o.node.index()] += 1;
            }
        }
    }
    for o in &outlets {
        uses[o.node.index()] += 1;
    }
    let mut values: Vec<Option<Vec<Tensor>>> = vec![None; n];
    for (pos, &id) in graph.order().iter().enumerate() {
        before(pos, vars)?;
        let i = id.index();
        if !needed[i] {
            continue;
        }
        let node = &g.nodes[i];
        match &node.op {
            Op::Placeholder(_) => {
                let t = feeds
                    .get(&node.name)
                    .ok_or_else(|| ExecError::MissingFeed {
                        name: node.name.clone(),
                    })?;
                values[i] = Some(vec![t.clone()]);
            }
            Op::Constant(t) => values[i] = Some(vec![t.clone()]),
            Op::Variable(_) => {} // read from `vars` when used
            op => {
                let mutated = op.mutated_inputs();
                // Copies of the mutated variables, written back on success.
                let mut updated: Vec<(String, TensorData)> = Vec::with_capacity(mutated.len());
                for &k in mutated {
                    let src = node
                        .inputs
                        .get(k)
                        .ok_or_else(|| bad(node, "missing mutated input"))?;
                    let var = &g.nodes[src.node.index()];
                    if !matches!(var.op, Op::Variable(_)) {
                        return Err(bad(node, "in-place update of a non-variable"));
                    }
                    let cur = vars
                        .get(&var.name)
                        .ok_or_else(|| ExecError::MissingVariable {
                            name: var.name.clone(),
                        })?;
                    updated.push((var.name.clone(), cur.data().clone()));
                }
                let mut outs: Vec<TensorData> = node.outputs.iter().map(zeros).collect();
                {
                    let mut ins = Vec::with_capacity(node.inputs.len());
                    for o in &node.inputs {
                        ins.push(input_view(graph, vars, &values, *o)?);
                    }
                    let mut inplace: Vec<TensorMut<'_>> = updated
                        .iter_mut()
                        .zip(mutated)
                        .map(|((_, d), &k)| {
                            let src = node.inputs[k];
                            let ty = &g.nodes[src.node.index()].outputs[0];
                            view_mut(ty, d)
                        })
                        .collect();
                    let mut out_views: Vec<TensorMut<'_>> = node
                        .outputs
                        .iter()
                        .zip(outs.iter_mut())
                        .map(|(ty, d)| view_mut(ty, d))
                        .collect();
                    run_op(&node.name, op, &ins, &mut inplace, &mut out_views)?;
                }
                for (name, d) in updated {
                    if let Some(v) = vars.get_mut(&name) {
                        *v = into_tensor(&v.ty(), d)?;
                    }
                }
                let mut produced = Vec::with_capacity(outs.len());
                for (ty, d) in node.outputs.iter().zip(outs) {
                    produced.push(into_tensor(ty, d)?);
                }
                values[i] = Some(produced);
                for o in &node.inputs {
                    let j = o.node.index();
                    uses[j] = uses[j].saturating_sub(1);
                    if uses[j] == 0 {
                        values[j] = None;
                    }
                }
            }
        }
    }
    before(graph.order().len(), vars)?;
    outlets
        .iter()
        .zip(fetches)
        .map(|(o, key)| {
            let node = &g.nodes[o.node.index()];
            if matches!(node.op, Op::Variable(_)) {
                return vars
                    .get(&node.name)
                    .cloned()
                    .ok_or_else(|| ExecError::MissingVariable {
                        name: node.name.clone(),
                    });
            }
            values[o.node.index()]
                .as_ref()
                .and_then(|v| v.get(o.slot as usize))
                .cloned()
                .ok_or_else(|| ExecError::UnknownFetch { key: key.clone() })
        })
        .collect()
}

fn bad(node: &lanes_adaptor::Node, reason: &str) -> ExecError {
    ExecError::Op {
        node: node.name.clone(),
        op: node.op.name(),
        reason: reason.into(),
    }
}

fn input_view<'a>(
    graph: &'a ValidGraph,
    vars: &'a VarValues,
    values: &'a [Option<Vec<Tensor>>],
    o: Outlet,
) -> Result<TensorRef<'a>, ExecError> {
    let g = graph.graph();
    let src = &g.nodes[o.node.index()];
    let ty = g
        .outlet_type(o)
        .ok_or_else(|| bad(src, "dangling outlet"))?;
    let t = if matches!(src.op, Op::Variable(_)) {
        vars.get(&src.name)
            .ok_or_else(|| ExecError::MissingVariable {
                name: src.name.clone(),
            })?
    } else {
        values[o.node.index()]
            .as_ref()
            .and_then(|v| v.get(o.slot as usize))
            .ok_or_else(|| bad(src, "value used before it was computed"))?
    };
    Ok(view(ty, t))
}
