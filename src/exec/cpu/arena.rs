//! The CPU executor's ephemeral memory, laid out by the compile stage's
//! memory plan (`compile::plan_outlets`): every op output of an iteration
//! lives at its planned offset in one buffer of T bytes — the T the
//! service reports, with nothing added: the plan's offsets and sizes are
//! multiples of its alignment (256 bytes), the buffer is made of 8-byte
//! words.
//!
//! - **Whose buffer.** A program alone uses its own. Under a service
//!   whose lanes own a reservation, each iteration runs in the arena its
//!   lane's turn hands in ([`Arena::hold_given`]): the lane's programs
//!   take turns, so they share one arena as large as the largest T among
//!   them, and a lane holds `sum P + max T` bytes — as the lane manager
//!   counts and as the CUDA executor maps.
//! - **Feeds** are copied into their slots (the plan keeps a feed's slot
//!   from the start of the iteration to its last reader), so an
//!   iteration's inputs are in the arena too, as on the GPU. Variables and
//!   constants are persistent, not in the buffer (`vars.rs`).
//! - **Outputs** are zeroed before their kernel runs, as fresh buffers
//!   would be (some kernels accumulate into their outputs: reductions,
//!   convolution and normalisation gradients).
//! - **Views.** An op's inputs and outputs are live at the same step, so the
//!   plan gives them disjoint ranges (checked again here: overlapping ranges
//!   are an error, not a panic); [`carve`] splits the buffer into them with
//!   `split_at_mut`, the outputs writable and the inputs shared. The one
//!   exception, a reshape planned as a view of its input (one range for
//!   both, `compile::views`), is never carved: the program skips it.
//! - **Fetches.** The plan keeps the graph's sinks to the end of an
//!   iteration; an output the plan lets die early is copied out right
//!   after its op ran (`program::run_iteration`), so fetching never grows
//!   the buffer past the T the job was admitted with.
//! - The own buffer is allocated at the first iteration and again after
//!   an eviction (which gives it up) — never per iteration in the steady
//!   state.
//! - **Scratch.** In-place ops (optimizer steps, running statistics) write
//!   the variables where they are; the old values their kernels read as
//!   inputs are copied into a second buffer of the arena, grown to the
//!   largest update during the first iteration.

use half::slice::HalfBitsSliceExt;
use lanes_adaptor::{DType, Op, Tensor, TensorType, ValidGraph};

use crate::compile::{self, PlanOptions};
use crate::exec::{DataMut, DataRef, ExecError, TensorMut, TensorRef};

/// Bytes of one word of the buffer (the alignment of `f32` and `i64` slices
/// cast from it).
const WORD: usize = std::mem::size_of::<u64>();

/// A tensor's place in the buffer, in words (its exact bytes, rounded up to
/// a word; the plan's slot may be larger).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Span {
    pub start: usize,
    pub len: usize,
}

/// The ephemeral tensors of a program at the offsets of its memory plan.
#[derive(Debug)]
pub(super) struct Arena {
    /// T of the plan, bytes.
    planned: usize,
    /// Per node, per output slot: where it lives (read only for outputs of
    /// ops: sources — feeds, variables, constants — are not in the buffer).
    spans: Vec<Vec<Span>>,
    /// The program's own buffer (empty before the first iteration, after
    /// an eviction, and while it runs in memory handed in).
    own: Vec<u64>,
    /// Old values of the variables an in-place op updates (see
    /// `program::update_in_place`), as large as the largest update.
    scratch: Vec<u64>,
}

/// An arena held for one iteration: the buffer (at least T bytes), the
/// output spans and the scratch buffer, borrowed apart.
#[derive(Debug)]
pub(super) struct Held<'a> {
    /// The program's own buffer or the arena handed in.
    pub words: &'a mut [u64],
    pub spans: &'a [Vec<Span>],
    pub scratch: &'a mut Vec<u64>,
}

fn err(reason: String) -> ExecError {
    ExecError::Op {
        node: String::new(),
        op: "arena",
        reason,
    }
}

/// Grows `words` to `need` words (zeroed), keeping it when large enough.
fn grow(words: &mut Vec<u64>, need: usize) -> Result<(), ExecError> {
    if words.len() < need {
        let extra = need - words.len();
        words
            .try_reserve_exact(extra)
            .map_err(|e| err(format!("cannot allocate {} bytes: {e}", need * WORD)))?;
        words.resize(need, 0);
    }
    Ok(())
}

impl Arena {
    /// Plans `graph` (its sinks kept to the end of an iteration); the
    /// buffer comes at the first iteration.
    pub fn new(graph: &ValidGraph) -> Result<Self, ExecError> {
        let plan =
            compile::cache::plan_outlets(graph, compile::sinks(graph), PlanOptions::default())
                .map_err(|e| err(format!("memory plan: {e}")))?;
        if plan.alignment % WORD as u64 != 0 {
            return Err(err(format!(
                "plan alignment {} is not a multiple of {WORD} bytes",
                plan.alignment
            )));
        }
        let planned = usize::try_from(plan.ephemeral)
            .map_err(|_| err(format!("T = {} bytes does not fit", plan.ephemeral)))?;
        let g = graph.graph();
        let mut spans: Vec<Vec<Span>> = g
            .nodes
            .iter()
            .map(|n| vec![Span::default(); n.outputs.len()])
            .collect();
        for t in &plan.tensors {
            let end = t
                .offset
                .checked_add(t.bytes)
                .filter(|&e| e <= plan.ephemeral);
            let span = match (end, usize::try_from(t.offset), usize::try_from(t.bytes)) {
                (Some(_), Ok(offset), Ok(bytes)) => Span {
                    start: offset / WORD,
                    len: bytes.div_ceil(WORD),
                },
                _ => return Err(err(format!("slot of {:?} lies outside T", t.outlet))),
            };
            let slot = spans
                .get_mut(t.outlet.node.index())
                .and_then(|s| s.get_mut(t.outlet.slot as usize))
                .ok_or_else(|| err(format!("the plan names {:?}, not in the graph", t.outlet)))?;
            *slot = span;
        }
        Ok(Arena {
            planned,
            spans,
            own: Vec::new(),
            scratch: Vec::new(),
        })
    }

    /// T of the plan the tensors follow, bytes.
    pub fn planned(&self) -> usize {
        self.planned
    }

    /// Bytes of the program's own buffer held now (0 before its first
    /// iteration, while evicted and while it runs in memory handed in).
    pub fn bytes(&self) -> usize {
        self.own.len() * WORD
    }

    /// The arena for one iteration in the program's own buffer, grown to
    /// T when it is smaller (the first iteration, after an eviction),
    /// otherwise as it is.
    pub fn hold(&mut self) -> Result<Held<'_>, ExecError> {
        grow(&mut self.own, self.planned / WORD)?;
        Ok(Held {
            words: &mut self.own,
            spans: &self.spans,
            scratch: &mut self.scratch,
        })
    }

    /// The arena for one iteration in `words`, handed in by the caller
    /// (at least T bytes; the program's own buffer is given up).
    pub fn hold_given<'a>(&'a mut self, words: &'a mut [u64]) -> Result<Held<'a>, ExecError> {
        let need = self.planned / WORD;
        if words.len() < need {
            return Err(err(format!(
                "the arena handed in has {} bytes, T is {}",
                words.len() * WORD,
                self.planned
            )));
        }
        // Running in memory handed in: the own buffer is not needed.
        self.own = Vec::new();
        Ok(Held {
            words,
            spans: &self.spans,
            scratch: &mut self.scratch,
        })
    }

    /// Gives the own buffer up (the program is evicted); the next
    /// iteration takes it again.
    pub fn release(&mut self) {
        self.own = Vec::new();
        self.scratch = Vec::new();
    }

    #[cfg(test)]
    pub fn buffer(&self) -> &Vec<u64> {
        &self.own
    }

    #[cfg(test)]
    pub fn scratch(&self) -> &Vec<u64> {
        &self.scratch
    }
}

impl Held<'_> {
    /// Where output `o` of an op or a feed lives; `None` for variables and
    /// constants, which are not in the buffer.
    pub fn span(&self, graph: &ValidGraph, o: lanes_adaptor::Outlet) -> Option<Span> {
        let node = graph.graph().nodes.get(o.node.index())?;
        if matches!(node.op, Op::Variable(_) | Op::Constant(_)) {
            return None;
        }
        self.spans
            .get(o.node.index())?
            .get(o.slot as usize)
            .copied()
    }
}

/// One op's ranges of the buffer: `inputs[k]` for the inputs that live in
/// it (`None` elsewhere), every output writable and zeroed.
pub(super) type Carved<'a> = (Vec<Option<&'a [u64]>>, Vec<&'a mut [u64]>);

#[derive(Debug, Clone, Copy)]
enum Role {
    In(usize),
    Out(usize),
}

/// Splits `words` into an op's input ranges (shared; an input read twice
/// gets the same range) and output ranges (writable, zeroed). Ranges must
/// not overlap, except an input's with itself.
pub(super) fn carve<'a>(
    words: &'a mut [u64],
    inputs: &[Option<Span>],
    outputs: &[Span],
) -> Result<Carved<'a>, String> {
    carve_with(words, inputs, outputs, true)
}

/// [`carve`], the writable ranges zeroed only when `zero`.
pub(super) fn carve_with<'a>(
    words: &'a mut [u64],
    inputs: &[Option<Span>],
    outputs: &[Span],
    zero: bool,
) -> Result<Carved<'a>, String> {
    let mut order: Vec<(Span, Role)> = Vec::with_capacity(inputs.len() + outputs.len());
    order.extend(
        inputs
            .iter()
            .enumerate()
            .filter_map(|(k, s)| s.map(|s| (s, Role::In(k)))),
    );
    order.extend(outputs.iter().enumerate().map(|(k, &s)| (s, Role::Out(k))));
    order.sort_unstable_by_key(|(s, _)| (s.start, s.len));
    let mut ins: Vec<Option<&'a [u64]>> = vec![None; inputs.len()];
    let mut outs: Vec<Option<&'a mut [u64]>> = outputs.iter().map(|_| None).collect();
    let mut rest: &'a mut [u64] = words;
    let mut pos = 0usize;
    let mut prev: Option<(Span, &'a [u64])> = None;
    for (span, role) in order {
        if span.len == 0 {
            match role {
                Role::In(k) => ins[k] = Some(&[]),
                Role::Out(k) => outs[k] = Some(&mut []),
            }
            continue;
        }
        if let (Role::In(k), Some((p, data))) = (role, prev) {
            if p == span {
                ins[k] = Some(data);
                continue;
            }
        }
        let skip = span
            .start
            .checked_sub(pos)
            .ok_or_else(|| format!("arena ranges overlap at word {}", span.start))?;
        let (_, tail) = std::mem::take(&mut rest)
            .split_at_mut_checked(skip)
            .ok_or("arena range past the buffer")?;
        let (piece, tail) = tail
            .split_at_mut_checked(span.len)
            .ok_or("arena range past the buffer")?;
        rest = tail;
        pos = span.start + span.len;
        match role {
            Role::In(k) => {
                let data: &'a [u64] = piece;
                ins[k] = Some(data);
                prev = Some((span, data));
            }
            Role::Out(k) => {
                if zero {
                    piece.fill(0);
                }
                outs[k] = Some(piece);
                prev = None;
            }
        }
    }
    let outs = outs
        .into_iter()
        .map(|o| o.ok_or("an output has no range"))
        .collect::<Result<_, _>>()?;
    Ok((ins, outs))
}

/// Read-only kernel view of a tensor of type `ty` in `words`.
pub(super) fn view<'a>(ty: &'a TensorType, words: &'a [u64]) -> Result<TensorRef<'a>, String> {
    let n = ty.shape.numel();
    let short = || format!("{ty} does not fit its range of {} words", words.len());
    let data = match ty.dtype {
        DType::F32 => DataRef::F32(
            bytemuck::try_cast_slice::<u64, f32>(words)
                .map_err(|e| e.to_string())?
                .get(..n)
                .ok_or_else(short)?,
        ),
        DType::I64 => DataRef::I64(
            bytemuck::try_cast_slice::<u64, i64>(words)
                .map_err(|e| e.to_string())?
                .get(..n)
                .ok_or_else(short)?,
        ),
        DType::F16 => DataRef::F16(bits(words).reinterpret_cast().get(..n).ok_or_else(short)?),
        DType::BF16 => DataRef::BF16(bits(words).reinterpret_cast().get(..n).ok_or_else(short)?),
    };
    Ok(TensorRef { ty, data })
}

/// Writable kernel view of a tensor of type `ty` in `words`.
pub(super) fn view_mut<'a>(
    ty: &'a TensorType,
    words: &'a mut [u64],
) -> Result<TensorMut<'a>, String> {
    let n = ty.shape.numel();
    let len = words.len();
    let short = || format!("{ty} does not fit its range of {len} words");
    let data = match ty.dtype {
        DType::F32 => DataMut::F32(
            bytemuck::try_cast_slice_mut::<u64, f32>(words)
                .map_err(|e| e.to_string())?
                .get_mut(..n)
                .ok_or_else(short)?,
        ),
        DType::I64 => DataMut::I64(
            bytemuck::try_cast_slice_mut::<u64, i64>(words)
                .map_err(|e| e.to_string())?
                .get_mut(..n)
                .ok_or_else(short)?,
        ),
        DType::F16 => DataMut::F16(
            bits_mut(words)
                .reinterpret_cast_mut()
                .get_mut(..n)
                .ok_or_else(short)?,
        ),
        DType::BF16 => DataMut::BF16(
            bits_mut(words)
                .reinterpret_cast_mut()
                .get_mut(..n)
                .ok_or_else(short)?,
        ),
    };
    Ok(TensorMut { ty, data })
}

/// 64-bit words as 16-bit values (four a word, in memory order).
fn bits(words: &[u64]) -> &[u16] {
    bytemuck::cast_slice(words)
}

/// [`bits`], writable.
fn bits_mut(words: &mut [u64]) -> &mut [u16] {
    bytemuck::cast_slice_mut(words)
}

/// Writes tensor `t` at `span` of `words` (a feed, a variable).
pub(super) fn write(words: &mut [u64], span: Span, t: &Tensor) -> Result<(), String> {
    let dst = words
        .get_mut(span.start..span.start + span.len)
        .ok_or("a tensor's range lies past the buffer")?;
    let bytes = t.data().ne_bytes();
    bytemuck::cast_slice_mut::<u64, u8>(dst)
        .get_mut(..bytes.len())
        .ok_or("a tensor does not fit its range")?
        .copy_from_slice(bytes);
    Ok(())
}

/// Writes a feed's little-endian `bytes` at `span` of `words`.
pub(super) fn write_bytes(words: &mut [u64], span: Span, bytes: &[u8]) -> Result<(), String> {
    let dst = words
        .get_mut(span.start..span.start + span.len)
        .ok_or("a tensor's range lies past the buffer")?;
    bytemuck::cast_slice_mut::<u64, u8>(dst)
        .get_mut(..bytes.len())
        .ok_or("a tensor does not fit its range")?
        .copy_from_slice(bytes);
    Ok(())
}

/// A copy of the tensor of type `ty` at `span` (a fetched result).
pub(super) fn copy_out(ty: &TensorType, words: &[u64], span: Span) -> Result<Tensor, String> {
    let range = words
        .get(span.start..span.start + span.len)
        .ok_or("fetched range past the buffer")?;
    let data = view(ty, range)?.data.to_data();
    Tensor::new(ty.shape.clone(), data).map_err(|e| e.to_string())
}
