//! Running a validated graph on the CPU: feeds, the set of nodes an
//! iteration needs, topological execution with every op output at its
//! planned offset in the arena and every variable and constant at its
//! place in the persistent memory, in-place updates of variables.

use std::collections::BTreeMap;

use lanes_adaptor::{Node, NodeId, Op, Part, Tensor, TensorType, ValidGraph, VarValues};

use super::arena::{self, Held, Span};
use super::run_op;
use super::vars::{self, Places, Vars};
use crate::exec::{ExecError, HostFeed, TensorMut, TensorRef};

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

/// Called before the node at each position of the execution order (and once
/// more with the order's length at the end); it may hand in pieces of the
/// persistent memory (pipelined restore) or take the time (profiling).
pub(super) type BeforeNode<'h, 'p> = dyn FnMut(usize, &mut Vars<'p>) -> Result<(), ExecError> + 'h;

/// The program's memory during one iteration.
pub(super) struct Memory<'m, 'p, 'a> {
    pub places: &'m Places,
    pub vars: &'m mut Vars<'p>,
    pub arena: &'m mut Held<'a>,
}

/// Runs one iteration of `graph`: variables updated in place in the
/// persistent memory, every op output in the arena at its planned offset
/// (see `arena.rs`, `vars.rs`).
pub(super) fn run_iteration<'p, F: HostFeed>(
    graph: &ValidGraph,
    mem: Memory<'_, 'p, '_>,
    feeds: &BTreeMap<String, F>,
    fetches: &[String],
    before: &mut BeforeNode<'_, 'p>,
) -> Result<Vec<Tensor>, ExecError> {
    let Memory {
        places,
        vars,
        arena: held,
    } = mem;
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
    let outlets = crate::exec::resolve_fetches(g, fetches)?;
    // Fetched outputs of ops, by node: copied out right after their op
    // ran (the plan may let them die before the end of the iteration).
    let mut fetched_at: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (k, o) in outlets.iter().enumerate() {
        if !g.nodes[o.node.index()].op.is_source() {
            fetched_at.entry(o.node.index()).or_default().push(k);
        }
    }
    let mut results: Vec<Option<Tensor>> = vec![None; outlets.len()];
    let all_spans = held.spans;
    let part = crate::exec::part_for(graph, &outlets)?;
    // Needed: fetched nodes, the part's in-place updates, and everything
    // they read.
    let mut needed = vec![false; n];
    let mut stack: Vec<NodeId> = outlets.iter().map(|o| o.node).collect();
    stack.extend(
        g.nodes
            .iter()
            .enumerate()
            .filter(|(i, nd)| {
                !nd.op.mutated_inputs().is_empty() && graph.runs(part, NodeId(*i as u32))
            })
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
    // The main iteration's positions (the residency units' first uses
    // count there), or all for an entry.
    let order = match part {
        Part::Main => graph.main_order(),
        Part::Entry(_) => graph.order(),
    };
    for (pos, &id) in order.iter().enumerate() {
        before(pos, vars)?;
        let i = id.index();
        if !needed[i] {
            continue;
        }
        let node = &g.nodes[i];
        match &node.op {
            Op::Placeholder(_) => {
                // Into its slot: its readers find it in the arena.
                let feed = feeds
                    .get(&node.name)
                    .ok_or_else(|| ExecError::MissingFeed {
                        name: node.name.clone(),
                    })?;
                let span = all_spans
                    .get(i)
                    .and_then(|s| s.first())
                    .copied()
                    .ok_or_else(|| bad(node, "the feed has no place in the arena"))?;
                arena::write_bytes(held.words, span, feed.bytes()).map_err(|r| bad(node, &r))?;
                done[i] = true;
            }
            // Read where they are when used.
            Op::Constant(_) | Op::Variable(_) => {}
            op => {
                // The variables the op updates in place.
                let mut mutated: Vec<NodeId> = Vec::with_capacity(op.mutated_inputs().len());
                for &k in op.mutated_inputs() {
                    let src = node
                        .inputs
                        .get(k)
                        .ok_or_else(|| bad(node, "missing mutated input"))?;
                    if !matches!(g.nodes[src.node.index()].op, Op::Variable(_)) {
                        return Err(bad(node, "in-place update of a non-variable"));
                    }
                    mutated.push(src.node);
                }
                let spans: Vec<Option<Span>> =
                    node.inputs.iter().map(|o| held.span(graph, *o)).collect();
                for (o, s) in node.inputs.iter().zip(&spans) {
                    if s.is_some() && !done[o.node.index()] {
                        return Err(bad(node, "value used before it was computed"));
                    }
                }
                let outputs = all_spans.get(i).map_or(&[][..], Vec::as_slice);
                // A view (`compile::views`): the reshape's output is its
                // input's bytes, so there is nothing to run, and no range
                // is carved twice.
                let view = matches!(op, Op::Reshape { .. })
                    && matches!((spans.first(), outputs.first()), (Some(Some(a)), Some(b)) if a == b);
                if !view {
                    let (in_words, out_words) =
                        arena::carve(held.words, &spans, outputs).map_err(|r| bad(node, &r))?;
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
                        places,
                        mutated: &mutated,
                        in_words,
                    };
                    if !mutated.is_empty() && in_place_ok(&mutated) {
                        update_in_place(io, vars, held.scratch, &mut out_views)?;
                    } else {
                        update_copied(io, vars, &mut out_views)?;
                    }
                    drop(out_views);
                }
                done[i] = true;
                for &k in fetched_at.get(&i).map_or(&[][..], Vec::as_slice) {
                    let o = outlets[k];
                    let (span, ty) = outputs
                        .get(o.slot as usize)
                        .zip(node.outputs.get(o.slot as usize))
                        .ok_or_else(|| bad(node, "fetched output has no place"))?;
                    results[k] =
                        Some(arena::copy_out(ty, held.words, *span).map_err(|r| bad(node, &r))?);
                }
            }
        }
    }
    before(order.len(), vars)?;
    outlets
        .iter()
        .zip(fetches)
        .zip(results)
        .map(|((o, key), result)| {
            let node = &g.nodes[o.node.index()];
            let unknown = || ExecError::UnknownFetch { key: key.clone() };
            match &node.op {
                Op::Variable(ty) => {
                    let span = places.span(o.node).ok_or_else(unknown)?;
                    let w = vars.get(span)?;
                    vars::read(ty, w, whole(w))
                }
                Op::Constant(t) => Ok(t.clone()),
                Op::Placeholder(_) => feeds.get(&node.name).ok_or_else(unknown)?.to_tensor(),
                // Copied out after its op ran.
                _ => result.ok_or_else(unknown),
            }
        })
        .collect()
}

/// The span of all of `w`.
fn whole(w: &[u64]) -> Span {
    Span {
        start: 0,
        len: w.len(),
    }
}

/// What an op reads: the graph, the node, where the persistent tensors
/// are, the variables it updates (in the order of `Op::mutated_inputs`),
/// and its inputs' ranges of the arena.
struct Io<'g, 'w> {
    graph: &'g ValidGraph,
    node: &'g Node,
    places: &'g Places,
    mutated: &'g [NodeId],
    in_words: Vec<Option<&'w [u64]>>,
}

impl Io<'_, '_> {
    /// The declared type of the `j`-th variable the node updates.
    fn mutated_type(&self, j: usize) -> Result<&TensorType, ExecError> {
        let g = self.graph.graph();
        self.node
            .op
            .mutated_inputs()
            .get(j)
            .and_then(|&k| self.node.inputs.get(k))
            .and_then(|o| g.outlet_type(*o))
            .ok_or_else(|| bad(self.node, "missing mutated input"))
    }

    /// Where persistent node `id` lives.
    fn place(&self, id: NodeId) -> Result<Span, ExecError> {
        self.places.span(id).ok_or_else(|| {
            bad(
                self.node,
                "a persistent input has no place in the persistent memory",
            )
        })
    }

    /// Where the variables the node updates are, in its order.
    fn writes(&self) -> Result<Vec<Span>, ExecError> {
        self.mutated.iter().map(|id| self.place(*id)).collect()
    }

    /// The spans of the node's persistent inputs other than `skip`
    /// (shared reads) and, per input, the index of its read.
    fn reads(&self, skip: &[NodeId]) -> Result<(Vec<Span>, Vec<Option<usize>>), ExecError> {
        let g = self.graph.graph();
        let mut reads = Vec::new();
        let mut of_input = Vec::with_capacity(self.node.inputs.len());
        for o in &self.node.inputs {
            let src = &g.nodes[o.node.index()];
            let persistent = matches!(src.op, Op::Variable(_) | Op::Constant(_));
            if persistent && !skip.contains(&o.node) {
                of_input.push(Some(reads.len()));
                reads.push(self.place(o.node)?);
            } else {
                of_input.push(None);
            }
        }
        Ok((reads, of_input))
    }

    /// Kernel view of input `k`: in the arena (feeds and op outputs), a
    /// persistent read (`read`), or the old value of an updated variable
    /// (`old`).
    fn input<'a>(
        &'a self,
        k: usize,
        read: Option<&'a [u64]>,
        old: Option<&'a [u64]>,
    ) -> Result<TensorRef<'a>, ExecError> {
        let g = self.graph.graph();
        let o = self.node.inputs[k];
        let src = &g.nodes[o.node.index()];
        let ty = g
            .outlet_type(o)
            .ok_or_else(|| bad(src, "dangling outlet"))?;
        // Feeds and op outputs are in the arena, variables and constants
        // in the persistent memory.
        let w = self
            .in_words
            .get(k)
            .copied()
            .flatten()
            .or(old)
            .or(read)
            .ok_or_else(|| bad(src, "value used before it was computed"))?;
        arena::view(ty, w).map_err(|r| bad(src, &r))
    }
}

/// Whether the updated variables can be written where they are: distinct
/// (a variable updated twice by the same op goes through copies:
/// [`update_copied`]).
fn in_place_ok(mutated: &[NodeId]) -> bool {
    #[cfg(test)]
    if FORCE_COPIED.get() {
        return false;
    }
    mutated
        .iter()
        .enumerate()
        .all(|(j, n)| !mutated[..j].contains(n))
}

#[cfg(test)]
thread_local! {
    /// Tests: every in-place op through [`update_copied`] (the reference).
    pub(super) static FORCE_COPIED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs an in-place op on the variables where they are. The kernel reads
/// the updated variables' old values (its `inputs`) from copies in
/// `scratch` — a buffer of the program, grown to the largest update once,
/// so no allocation in the steady state — and writes the variables
/// themselves; if it fails, the old values are copied back (the
/// variables are unchanged on error, as with [`update_copied`]).
fn update_in_place(
    io: Io<'_, '_>,
    vars: &mut Vars<'_>,
    scratch: &mut Vec<u64>,
    out_views: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let node = io.node;
    let writes = io.writes()?;
    let total: usize = writes.iter().map(|s| s.len).sum();
    if scratch.len() < total {
        scratch.resize(total, 0);
    }
    // The old values, in `scratch`.
    let mut olds: Vec<&[u64]> = Vec::with_capacity(writes.len());
    let mut rest: &mut [u64] = scratch;
    for s in &writes {
        let (piece, tail) = std::mem::take(&mut rest)
            .split_at_mut_checked(s.len)
            .ok_or_else(|| bad(node, "scratch too small"))?;
        rest = tail;
        piece.copy_from_slice(vars.get(*s)?);
        olds.push(piece);
    }
    let (reads, of_input) = io.reads(io.mutated)?;
    let (read_words, write_words) = vars.split(&reads, &writes)?;
    let mut ins = Vec::with_capacity(node.inputs.len());
    for (k, o) in node.inputs.iter().enumerate() {
        let old = io
            .mutated
            .iter()
            .position(|id| *id == o.node)
            .and_then(|j| olds.get(j).copied());
        let read = of_input[k].and_then(|r| read_words.get(r).copied());
        ins.push(io.input(k, read, old)?);
    }
    let mut inplace: Vec<TensorMut<'_>> = Vec::with_capacity(writes.len());
    for (j, w) in write_words.into_iter().enumerate() {
        inplace.push(vars::view_mut(io.mutated_type(j)?, w)?);
    }
    let result = run_op(&node.name, &node.op, &ins, &mut inplace, out_views);
    drop(ins);
    if result.is_err() {
        drop(inplace);
        let (_, restore) = vars.split(&[], &writes)?;
        for (w, old) in restore.into_iter().zip(&olds) {
            w.copy_from_slice(old);
        }
    }
    result
}

/// Runs an op; the variables it updates in place, if any, on copies that
/// replace them once the kernel succeeded (nothing is copied for an op
/// that updates none).
fn update_copied(
    io: Io<'_, '_>,
    vars: &mut Vars<'_>,
    out_views: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let node = io.node;
    let writes = io.writes()?;
    let mut updated: Vec<Vec<u64>> = Vec::with_capacity(writes.len());
    for s in &writes {
        updated.push(vars.get(*s)?.to_vec());
    }
    {
        let (reads, of_input) = io.reads(&[])?;
        let (read_words, _) = vars.split(&reads, &[])?;
        let mut ins = Vec::with_capacity(node.inputs.len());
        for (k, r) in of_input.iter().enumerate() {
            let read = r.and_then(|r| read_words.get(r).copied());
            ins.push(io.input(k, read, None)?);
        }
        let mut inplace = Vec::with_capacity(writes.len());
        for (j, d) in updated.iter_mut().enumerate() {
            inplace.push(vars::view_mut(io.mutated_type(j)?, d)?);
        }
        run_op(&node.name, &node.op, &ins, &mut inplace, out_views)?;
    }
    for (s, d) in writes.iter().zip(updated) {
        let (_, mut w) = vars.split(&[], std::slice::from_ref(s))?;
        if let Some(w) = w.pop() {
            w.copy_from_slice(&d);
        }
    }
    Ok(())
}

fn bad(node: &Node, reason: &str) -> ExecError {
    ExecError::Op {
        node: node.name.clone(),
        op: node.op.name(),
        reason: reason.into(),
    }
}
