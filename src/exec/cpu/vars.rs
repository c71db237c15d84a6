//! The CPU executor's persistent memory: every variable and constant of a
//! program at a fixed place in one buffer of P bytes (8-byte words), in the
//! residency layout's unit order (first use), each tensor's bytes rounded
//! up to the memory plan's alignment — so the buffer is exactly the P the
//! service reports and admits, and a group of units (what a switch brings
//! back at once) is one contiguous range of it.
//!
//! The buffer is the program's own, or under a service with a reservation
//! the job's persistent region of it, handed in for each call
//! (`CpuMemory`). During an iteration the buffer may be split into pieces
//! (one per group of a switch: the copier thread hands each back once it
//! is filled); [`Vars`] finds a tensor in whichever piece holds it.

use lanes_adaptor::{NodeId, Op, Tensor, TensorType, ValidGraph, VarValues};

use super::arena::{self, Span};
use crate::compile::DEFAULT_ALIGNMENT;
use crate::exec::{ExecError, TensorMut};
use crate::residency::Layout;

const WORD: usize = std::mem::size_of::<u64>();

fn err(reason: String) -> ExecError {
    ExecError::Op {
        node: String::new(),
        op: "persistent memory",
        reason,
    }
}

/// Where the persistent tensors live in the buffer.
#[derive(Debug, Clone)]
pub(super) struct Places {
    /// Per node: its span, for variables and constants.
    spans: Vec<Option<Span>>,
    /// Per unit of the layout: its first word; then the total.
    unit_starts: Vec<usize>,
}

impl Places {
    /// Places the persistent tensors of `graph` in the order of `layout`.
    pub fn new(graph: &ValidGraph, layout: &Layout) -> Result<Self, ExecError> {
        let g = graph.graph();
        let mut spans = vec![None; g.nodes.len()];
        let mut unit_starts = Vec::with_capacity(layout.units.len() + 1);
        let mut at = 0usize;
        let align = usize::try_from(DEFAULT_ALIGNMENT).unwrap_or(256).max(WORD);
        for unit in &layout.units {
            unit_starts.push(at);
            for id in &unit.tensors {
                let node = g
                    .nodes
                    .get(id.index())
                    .ok_or_else(|| err(format!("layout names node {}", id.index())))?;
                let bytes = node.outputs.first().map_or(0, TensorType::bytes);
                let size = bytes
                    .checked_next_multiple_of(align)
                    .ok_or_else(|| err("sizes overflow".into()))?;
                spans[id.index()] = Some(Span {
                    start: at,
                    len: bytes.div_ceil(WORD),
                });
                at = at
                    .checked_add(size / WORD)
                    .ok_or_else(|| err("sizes overflow".into()))?;
            }
        }
        unit_starts.push(at);
        Ok(Places { spans, unit_starts })
    }

    /// Words of the buffer.
    pub fn words(&self) -> usize {
        self.unit_starts.last().copied().unwrap_or(0)
    }

    /// Where node `id` (a variable or constant) lives.
    pub fn span(&self, id: NodeId) -> Option<Span> {
        self.spans.get(id.index()).copied().flatten()
    }

    /// The words of units `units` (a group of a switch).
    pub fn unit_range(&self, units: std::ops::Range<usize>) -> std::ops::Range<usize> {
        let at = |k: usize| self.unit_starts.get(k).copied().unwrap_or(self.words());
        at(units.start)..at(units.end)
    }

    /// A new buffer holding `vars` and the graph's constants.
    pub fn fill(&self, graph: &ValidGraph, vars: &VarValues) -> Result<Vec<u64>, ExecError> {
        let mut words = Vec::new();
        words.try_reserve_exact(self.words()).map_err(|e| {
            err(format!(
                "cannot allocate {} bytes: {e}",
                self.words() * WORD
            ))
        })?;
        words.resize(self.words(), 0);
        for (i, node) in graph.graph().nodes.iter().enumerate() {
            let t = match &node.op {
                Op::Variable(_) => {
                    vars.get(&node.name)
                        .ok_or_else(|| ExecError::MissingVariable {
                            name: node.name.clone(),
                        })?
                }
                Op::Constant(t) => t,
                _ => continue,
            };
            let span = self.span(NodeId(i as u32)).ok_or_else(|| {
                err(format!(
                    "`{}` has no place in the persistent memory",
                    node.name
                ))
            })?;
            write(&mut words, span, t)?;
        }
        Ok(words)
    }
}

/// Writes tensor `t` at `span` of `words`.
pub(super) fn write(words: &mut [u64], span: Span, t: &Tensor) -> Result<(), ExecError> {
    arena::write(words, span, t).map_err(err)
}

/// A copy of the tensor of type `ty` at `span` of `words`.
pub(super) fn read(ty: &TensorType, words: &[u64], span: Span) -> Result<Tensor, ExecError> {
    arena::copy_out(ty, words, span).map_err(err)
}

/// The persistent buffer during an iteration: whole, or in the pieces of a
/// switch's groups, each present once it holds its values.
#[derive(Debug)]
pub(super) struct Vars<'p> {
    /// First word of each piece.
    starts: Vec<usize>,
    pieces: Vec<Option<&'p mut [u64]>>,
}

impl<'p> Vars<'p> {
    /// The whole buffer.
    pub fn whole(words: &'p mut [u64]) -> Self {
        Vars {
            starts: vec![0],
            pieces: vec![Some(words)],
        }
    }

    /// A buffer whose pieces start at `starts` (ascending, the first 0),
    /// none present yet.
    pub fn pieces(starts: Vec<usize>) -> Self {
        let pieces = starts.iter().map(|_| None).collect();
        Vars { starts, pieces }
    }

    /// Piece `k` now holds its values.
    pub fn insert(&mut self, k: usize, piece: &'p mut [u64]) -> Result<(), ExecError> {
        let slot = self
            .pieces
            .get_mut(k)
            .ok_or_else(|| err(format!("no piece {k}")))?;
        *slot = Some(piece);
        Ok(())
    }

    /// The piece holding `span` and the span within it.
    fn locate(&self, span: Span) -> Result<(usize, Span), ExecError> {
        let k = self
            .starts
            .partition_point(|&s| s <= span.start)
            .checked_sub(1)
            .ok_or_else(|| err("a tensor lies before the buffer".into()))?;
        let local = Span {
            start: span.start - self.starts[k],
            len: span.len,
        };
        Ok((k, local))
    }

    /// The words at `span` (the tensor's values must have arrived).
    pub fn get(&self, span: Span) -> Result<&[u64], ExecError> {
        let (k, local) = self.locate(span)?;
        let piece = self
            .pieces
            .get(k)
            .and_then(|p| p.as_deref())
            .ok_or_else(|| err("a persistent tensor was used before it arrived".into()))?;
        piece
            .get(local.start..local.start + local.len)
            .ok_or_else(|| err("a tensor lies past its piece".into()))
    }

    /// The words of `reads` (shared; a span may repeat) and of `writes`
    /// (writable, not zeroed), borrowed apart. The spans must not overlap
    /// except a read with itself, and must have arrived.
    #[allow(clippy::type_complexity)]
    pub fn split(
        &mut self,
        reads: &[Span],
        writes: &[Span],
    ) -> Result<(Vec<&[u64]>, Vec<&mut [u64]>), ExecError> {
        let mut ins: Vec<Option<&[u64]>> = vec![None; reads.len()];
        let mut outs: Vec<Option<&mut [u64]>> = writes.iter().map(|_| None).collect();
        // Per piece: the spans it holds, carved apart.
        let mut located_r = Vec::with_capacity(reads.len());
        for s in reads {
            located_r.push(self.locate(*s)?);
        }
        let mut located_w = Vec::with_capacity(writes.len());
        for s in writes {
            located_w.push(self.locate(*s)?);
        }
        for (k, piece) in self.pieces.iter_mut().enumerate() {
            let r: Vec<Option<Span>> = located_r
                .iter()
                .map(|(p, s)| (*p == k).then_some(*s))
                .collect();
            let w_idx: Vec<usize> = (0..located_w.len())
                .filter(|&j| located_w[j].0 == k)
                .collect();
            if r.iter().all(Option::is_none) && w_idx.is_empty() {
                continue;
            }
            let piece = piece
                .as_deref_mut()
                .ok_or_else(|| err("a persistent tensor was used before it arrived".into()))?;
            let w: Vec<Span> = w_idx.iter().map(|&j| located_w[j].1).collect();
            let (rs, ws) = arena::carve_with(piece, &r, &w, false).map_err(err)?;
            for (j, v) in rs.into_iter().enumerate() {
                if let Some(v) = v {
                    ins[j] = Some(v);
                }
            }
            for (j, v) in w_idx.into_iter().zip(ws) {
                outs[j] = Some(v);
            }
        }
        let ins = ins
            .into_iter()
            .map(|v| v.ok_or_else(|| err("a read has no range".into())))
            .collect::<Result<_, _>>()?;
        let outs = outs
            .into_iter()
            .map(|v| v.ok_or_else(|| err("a write has no range".into())))
            .collect::<Result<_, _>>()?;
        Ok((ins, outs))
    }
}

/// Writable kernel view of a persistent tensor.
pub(super) fn view_mut<'a>(
    ty: &'a TensorType,
    words: &'a mut [u64],
) -> Result<TensorMut<'a>, ExecError> {
    arena::view_mut(ty, words).map_err(err)
}
