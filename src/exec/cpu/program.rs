//! Running a validated graph on the CPU: feeds, the set of nodes an
//! iteration needs, topological execution with every op output at its
//! planned offset in the program's arena, in-place updates of variables.

use std::collections::BTreeMap;

use lanes_adaptor::{NodeId, Op, Outlet, Tensor, TensorData, TensorType, ValidGraph, VarValues};

use super::arena::{self, Arena, Span};
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

/// Runs one iteration of `graph` with variables `vars` (updated in place)
/// and every op output in `arena`, at its planned offset (see `arena.rs`).
pub(super) fn run_iteration(
    graph: &ValidGraph,
    vars: &mut VarValues,
    arena: &mut Arena,
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
    // Fetched outputs live to the end; the buffer is there.
    arena.cover(graph, &outlets)?;
    arena.ensure()?;
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
    // Ops whose outputs hold this iteration's values.
    let mut done = vec![false; n];
    for (pos, &id) in graph.order().iter().enumerate() {
        before(pos, vars)?;
        let i = id.index();
        if !needed[i] {
            continue;
        }
        let node = &g.nodes[i];
        match &node.op {
            Op::Placeholder(_) => {
                if !feeds.contains_key(&node.name) {
                    return Err(ExecError::MissingFeed {
                        name: node.name.clone(),
                    });
                }
            }
            // Read where they are when used.
            Op::Constant(_) | Op::Variable(_) => {}
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
                {
                    let spans: Vec<Option<Span>> =
                        node.inputs.iter().map(|o| arena.span(graph, *o)).collect();
                    for (o, s) in node.inputs.iter().zip(&spans) {
                        if s.is_some() && !done[o.node.index()] {
                            return Err(bad(node, "value used before it was computed"));
                        }
                    }
                    let (words, outputs) = arena.parts();
                    let outputs = outputs.get(i).map_or(&[][..], Vec::as_slice);
                    let (in_words, out_words) =
                        arena::carve(words, &spans, outputs).map_err(|r| bad(node, &r))?;
                    let mut ins = Vec::with_capacity(node.inputs.len());
                    for (o, w) in node.inputs.iter().zip(in_words) {
                        ins.push(input_view(graph, vars, feeds, *o, w)?);
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
                        .zip(out_words)
                        .map(|(ty, w)| arena::view_mut(ty, w))
                        .collect::<Result<_, _>>()
                        .map_err(|r| bad(node, &r))?;
                    run_op(&node.name, op, &ins, &mut inplace, &mut out_views)?;
                }
                for (name, d) in updated {
                    if let Some(v) = vars.get_mut(&name) {
                        *v = into_tensor(&v.ty(), d)?;
                    }
                }
                done[i] = true;
            }
        }
    }
    before(graph.order().len(), vars)?;
    outlets
        .iter()
        .zip(fetches)
        .map(|(o, key)| {
            let node = &g.nodes[o.node.index()];
            let unknown = || ExecError::UnknownFetch { key: key.clone() };
            match &node.op {
                Op::Variable(_) => {
                    vars.get(&node.name)
                        .cloned()
                        .ok_or_else(|| ExecError::MissingVariable {
                            name: node.name.clone(),
                        })
                }
                Op::Constant(t) => Ok(t.clone()),
                Op::Placeholder(_) => feeds.get(&node.name).cloned().ok_or_else(unknown),
                _ => {
                    let span = arena.span(graph, *o).ok_or_else(unknown)?;
                    let ty = g.outlet_type(*o).ok_or_else(unknown)?;
                    if !done[o.node.index()] {
                        return Err(unknown());
                    }
                    arena::copy_out(ty, arena.words(), span).map_err(|r| bad(node, &r))
                }
            }
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

/// Kernel view of input `o`: in the arena (`words`), a feed, a variable
/// or a constant.
fn input_view<'a>(
    graph: &'a ValidGraph,
    vars: &'a VarValues,
    feeds: &'a BTreeMap<String, Tensor>,
    o: Outlet,
    words: Option<&'a [u64]>,
) -> Result<TensorRef<'a>, ExecError> {
    let g = graph.graph();
    let src = &g.nodes[o.node.index()];
    let ty = g
        .outlet_type(o)
        .ok_or_else(|| bad(src, "dangling outlet"))?;
    if let Some(w) = words {
        return arena::view(ty, w).map_err(|r| bad(src, &r));
    }
    let t = match &src.op {
        Op::Variable(_) => vars
            .get(&src.name)
            .ok_or_else(|| ExecError::MissingVariable {
                name: src.name.clone(),
            })?,
        Op::Constant(t) => t,
        Op::Placeholder(_) => feeds.get(&src.name).ok_or_else(|| ExecError::MissingFeed {
            name: src.name.clone(),
        })?,
        _ => return Err(bad(src, "value used before it was computed")),
    };
    Ok(view(ty, t))
}
