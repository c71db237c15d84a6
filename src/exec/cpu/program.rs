//! Running a validated graph on the CPU: feeds, the set of nodes an
//! iteration needs, topological execution with every op output at its
//! planned offset in the program's arena, in-place updates of variables.

use std::collections::BTreeMap;

use lanes_adaptor::{
    DType, Graph, Node, NodeId, Op, Outlet, Tensor, TensorData, TensorType, ValidGraph, VarValues,
};

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
    // Fetched outputs of ops, by node: copied out right after their op
    // ran (the plan may let them die before the end of the iteration).
    let mut fetched_at: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (k, o) in outlets.iter().enumerate() {
        if !g.nodes[o.node.index()].op.is_source() {
            fetched_at.entry(o.node.index()).or_default().push(k);
        }
    }
    let mut results: Vec<Option<Tensor>> = vec![None; outlets.len()];
    let mut held = arena.hold()?;
    let all_spans = held.spans;
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
                // The variables the op updates in place.
                let mut names: Vec<&str> = Vec::with_capacity(op.mutated_inputs().len());
                for &k in op.mutated_inputs() {
                    let src = node
                        .inputs
                        .get(k)
                        .ok_or_else(|| bad(node, "missing mutated input"))?;
                    let var = &g.nodes[src.node.index()];
                    if !matches!(var.op, Op::Variable(_)) {
                        return Err(bad(node, "in-place update of a non-variable"));
                    }
                    names.push(&var.name);
                }
                let spans: Vec<Option<Span>> =
                    node.inputs.iter().map(|o| held.span(graph, *o)).collect();
                for (o, s) in node.inputs.iter().zip(&spans) {
                    if s.is_some() && !done[o.node.index()] {
                        return Err(bad(node, "value used before it was computed"));
                    }
                }
                let outputs = all_spans.get(i).map_or(&[][..], Vec::as_slice);
                let (in_words, out_words) =
                    arena::carve(&mut held.words, &spans, outputs).map_err(|r| bad(node, &r))?;
                let mut out_views: Vec<TensorMut<'_>> = node
                    .outputs
                    .iter()
                    .zip(out_words)
                    .map(|(ty, w)| arena::view_mut(ty, w))
                    .collect::<Result<_, _>>()
                    .map_err(|r| bad(node, &r))?;
                let io = Io {
                    graph,
                    node,
                    names: &names,
                    feeds,
                    in_words,
                };
                if !names.is_empty() && in_place_ok(&names, vars) {
                    update_in_place(io, vars, held.scratch, &mut out_views)?;
                } else {
                    update_cloned(io, vars, &mut out_views)?;
                }
                drop(out_views);
                done[i] = true;
                for &k in fetched_at.get(&i).map_or(&[][..], Vec::as_slice) {
                    let o = outlets[k];
                    let (span, ty) = outputs
                        .get(o.slot as usize)
                        .zip(node.outputs.get(o.slot as usize))
                        .ok_or_else(|| bad(node, "fetched output has no place"))?;
                    results[k] =
                        Some(arena::copy_out(ty, &held.words, *span).map_err(|r| bad(node, &r))?);
                }
            }
        }
    }
    before(graph.order().len(), vars)?;
    drop(held);
    outlets
        .iter()
        .zip(fetches)
        .zip(results)
        .map(|((o, key), result)| {
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
                // Copied out after its op ran.
                _ => result.ok_or_else(unknown),
            }
        })
        .collect()
}

/// What an op reads: the graph, the node, the names of the
/// variables it updates (in the order of `Op::mutated_inputs`), the feeds,
/// and its inputs' ranges of the arena.
struct Io<'g, 'w> {
    graph: &'g ValidGraph,
    node: &'g Node,
    names: &'g [&'g str],
    feeds: &'g BTreeMap<String, Tensor>,
    in_words: Vec<Option<&'w [u64]>>,
}

/// The declared type of the `j`-th variable `node` updates.
fn mutated_type<'g>(g: &'g Graph, node: &Node, j: usize) -> Result<&'g TensorType, ExecError> {
    node.op
        .mutated_inputs()
        .get(j)
        .and_then(|&k| node.inputs.get(k))
        .and_then(|o| g.outlet_type(*o))
        .ok_or_else(|| bad(node, "missing mutated input"))
}

/// Whether the updated variables can be written where they are: distinct
/// and `f32` (an `i64` variable, or one updated twice by the same op, goes
/// through copies: [`update_cloned`]).
fn in_place_ok(names: &[&str], vars: &VarValues) -> bool {
    #[cfg(test)]
    if FORCE_CLONED.get() {
        return false;
    }
    names.iter().enumerate().all(|(j, n)| {
        !names[..j].contains(n) && vars.get(*n).is_some_and(|t| t.dtype() == DType::F32)
    })
}

#[cfg(test)]
thread_local! {
    /// Tests: every in-place op through [`update_cloned`] (the reference).
    pub(super) static FORCE_CLONED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs an in-place op on the variables where they are. The kernel reads
/// the updated variables' old values (its `inputs`) from copies in
/// `scratch` — a buffer of the program, grown to the largest update once,
/// so no allocation in the steady state — and writes the variables
/// themselves; if it fails, the old values are copied back (the
/// variables are unchanged on error, as with [`update_cloned`]).
fn update_in_place(
    io: Io<'_, '_>,
    vars: &mut VarValues,
    scratch: &mut Vec<u64>,
    out_views: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let Io {
        graph,
        node,
        names,
        feeds,
        in_words,
    } = io;
    let g = graph.graph();
    let missing = |n: &str| ExecError::MissingVariable { name: n.into() };
    let mut lens = Vec::with_capacity(names.len());
    for n in names {
        let t = vars.get(*n).ok_or_else(|| missing(n))?;
        lens.push(t.numel().div_ceil(2));
    }
    let total: usize = lens.iter().sum();
    if scratch.len() < total {
        scratch.resize(total, 0);
    }
    // The old values, in `scratch`.
    let mut olds: Vec<&[u64]> = Vec::with_capacity(names.len());
    let mut rest: &mut [u64] = scratch;
    for (n, &len) in names.iter().zip(&lens) {
        let (piece, tail) = std::mem::take(&mut rest)
            .split_at_mut_checked(len)
            .ok_or_else(|| bad(node, "scratch too small"))?;
        rest = tail;
        let src = vars
            .get(*n)
            .ok_or_else(|| missing(n))?
            .f32s()
            .map_err(|e| bad(node, &e.to_string()))?;
        bytemuck::cast_slice_mut::<u64, f32>(piece)
            .get_mut(..src.len())
            .ok_or_else(|| bad(node, "scratch too small"))?
            .copy_from_slice(src);
        olds.push(piece);
    }
    // The updated variables writable, the other variables it reads shared.
    let is_var = |o: &Outlet, name: &str| {
        let src = &g.nodes[o.node.index()];
        matches!(src.op, Op::Variable(_)) && src.name == name
    };
    let mut muts: Vec<Option<&mut Tensor>> = names.iter().map(|_| None).collect();
    let mut reads: Vec<Option<&Tensor>> = vec![None; node.inputs.len()];
    for (name, t) in vars.iter_mut() {
        if let Some(j) = names.iter().position(|n| *n == name) {
            muts[j] = Some(t);
            continue;
        }
        let t: &Tensor = t;
        for (k, o) in node.inputs.iter().enumerate() {
            if is_var(o, name) {
                reads[k] = Some(t);
            }
        }
    }
    let mut ins = Vec::with_capacity(node.inputs.len());
    for (k, (o, w)) in node.inputs.iter().zip(in_words).enumerate() {
        let old = names
            .iter()
            .position(|n| is_var(o, n))
            .and_then(|j| olds.get(j).copied());
        ins.push(input_view(graph, reads[k], feeds, *o, old.or(w))?);
    }
    let mut inplace: Vec<TensorMut<'_>> = Vec::with_capacity(names.len());
    for (j, m) in muts.into_iter().enumerate() {
        let t = m.ok_or_else(|| missing(names[j]))?;
        let data = t.f32s_mut().map_err(|e| bad(node, &e.to_string()))?;
        inplace.push(TensorMut {
            ty: mutated_type(g, node, j)?,
            data: DataMut::F32(data),
        });
    }
    let result = run_op(&node.name, &node.op, &ins, &mut inplace, out_views);
    if result.is_err() {
        for (v, old) in inplace.iter_mut().zip(&olds) {
            if let (DataMut::F32(d), Ok(o)) =
                (&mut v.data, bytemuck::try_cast_slice::<u64, f32>(old))
            {
                let n = d.len().min(o.len());
                d[..n].copy_from_slice(&o[..n]);
            }
        }
    }
    result
}

/// Runs an op; the variables it updates in place, if any, on copies that
/// replace them once the kernel succeeded (nothing is copied for an op
/// that updates none).
fn update_cloned(
    io: Io<'_, '_>,
    vars: &mut VarValues,
    out_views: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let Io {
        graph,
        node,
        names,
        feeds,
        in_words,
    } = io;
    let g = graph.graph();
    let mut updated = Vec::with_capacity(names.len());
    for n in names {
        let cur = vars.get(*n).ok_or_else(|| ExecError::MissingVariable {
            name: n.to_string(),
        })?;
        updated.push(cur.data().clone());
    }
    {
        let mut ins = Vec::with_capacity(node.inputs.len());
        for (o, w) in node.inputs.iter().zip(in_words) {
            ins.push(input_view(graph, var_of(graph, vars, *o), feeds, *o, w)?);
        }
        let mut inplace = Vec::with_capacity(names.len());
        for (j, d) in updated.iter_mut().enumerate() {
            inplace.push(view_mut(mutated_type(g, node, j)?, d));
        }
        run_op(&node.name, &node.op, &ins, &mut inplace, out_views)?;
    }
    for (n, d) in names.iter().zip(updated) {
        if let Some(v) = vars.get_mut(*n) {
            *v = into_tensor(&v.ty(), d)?;
        }
    }
    Ok(())
}

/// The value of input `o` when it is a variable.
fn var_of<'a>(graph: &ValidGraph, vars: &'a VarValues, o: Outlet) -> Option<&'a Tensor> {
    let src = &graph.graph().nodes[o.node.index()];
    if matches!(src.op, Op::Variable(_)) {
        vars.get(&src.name)
    } else {
        None
    }
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
/// Kernel view of input `o`: in the arena (`words`), a variable (`var`),
/// a feed or a constant.
fn input_view<'a>(
    graph: &'a ValidGraph,
    var: Option<&'a Tensor>,
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
        Op::Variable(_) => var.ok_or_else(|| ExecError::MissingVariable {
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
