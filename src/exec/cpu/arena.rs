//! The CPU executor's ephemeral memory, laid out by the compile stage's
//! memory plan (`compile::plan_outlets`): every op output of an iteration
//! lives at its planned offset in one buffer of T bytes — the T the
//! service reports, with nothing added: the plan's offsets and sizes are
//! multiples of its alignment (256 bytes), the buffer is made of 8-byte
//! words.
//!
//! - **Whose buffer.** A program alone uses its own. Under the service a
//!   program runs in its lane's buffer ([`Arena::bind_lane`]): the
//!   programs of one lane run one iteration at a time, so they share one
//!   buffer as large as the largest T among them, and a lane holds
//!   `sum P + max T` bytes, not `sum (P + T)` — as the lane manager counts
//!   and as the CUDA executor maps. A lane's buffer lives while a program
//!   is bound to it.
//! - **Feeds** stay where the caller holds them (a Run hands them in); their
//!   slots in the buffer are left unused. Variables and constants are
//!   persistent, not in the buffer.
//! - **Outputs** are zeroed before their kernel runs, as fresh buffers
//!   would be (some kernels accumulate into their outputs: reductions,
//!   convolution and normalisation gradients).
//! - **Views.** An op's inputs and outputs are live at the same step, so the
//!   plan gives them disjoint ranges (checked again here: overlapping ranges
//!   are an error, not a panic); [`carve`] splits the buffer into them with
//!   `split_at_mut`, the outputs writable and the inputs shared.
//! - **Fetches.** The plan keeps the graph's sinks to the end of an
//!   iteration; an output the plan lets die early is copied out right
//!   after its op ran (`program::run_iteration`), so fetching never grows
//!   the buffer past the T the job was admitted with.
//! - The buffer is allocated at the first iteration, and again after an
//!   eviction (which gives it up) or when a lane gets a program with a
//!   larger T — never per iteration in the steady state.
//! - **Scratch.** In-place ops (optimizer steps, running statistics) write
//!   the variables where they are; the old values their kernels read as
//!   inputs are copied into a second buffer of the arena, grown to the
//!   largest update during the first iteration.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use lanes_adaptor::{DType, Tensor, TensorData, TensorType, ValidGraph};

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

/// A lane's buffer, shared by the arenas bound to it.
type LaneBuffer = Arc<Mutex<Vec<u64>>>;

/// Each lane's buffer by lane key, while some arena is bound to it.
type LaneBuffers = HashMap<u64, Weak<Mutex<Vec<u64>>>>;
static LANES: Mutex<Option<LaneBuffers>> = Mutex::new(None);

/// The buffer of `lane`: the one its programs use now, or a new empty one.
fn lane_buffer(lane: u64) -> LaneBuffer {
    let mut lanes = LANES.lock().unwrap_or_else(PoisonError::into_inner);
    let lanes = lanes.get_or_insert_with(HashMap::new);
    if let Some(b) = lanes.get(&lane).and_then(Weak::upgrade) {
        return b;
    }
    let b: LaneBuffer = Arc::new(Mutex::new(Vec::new()));
    lanes.insert(lane, Arc::downgrade(&b));
    lanes.retain(|_, w| w.strong_count() > 0);
    b
}

/// Bytes of the buffer of `lane`, while it is alive.
#[cfg(test)]
pub(super) fn lane_bytes(lane: u64) -> Option<usize> {
    let lanes = LANES.lock().unwrap_or_else(PoisonError::into_inner);
    let b = lanes.as_ref()?.get(&lane)?.upgrade()?;
    let n = b.lock().unwrap_or_else(PoisonError::into_inner).len() * WORD;
    Some(n)
}

/// Bytes of the lanes' shared buffers alive now.
pub fn lane_buffer_bytes() -> u64 {
    let lanes = LANES.lock().unwrap_or_else(PoisonError::into_inner);
    lanes.as_ref().map_or(0, |m| {
        m.values()
            .filter_map(Weak::upgrade)
            .map(|b| (b.lock().unwrap_or_else(PoisonError::into_inner).len() * WORD) as u64)
            .sum()
    })
}

/// Where an arena's tensors are.
#[derive(Debug)]
enum Store {
    /// The program's own buffer (empty before the first iteration and
    /// after an eviction).
    Own(Vec<u64>),
    /// Its lane's buffer.
    Lane { key: u64, buffer: LaneBuffer },
}

/// The ephemeral tensors of a program at the offsets of its memory plan.
#[derive(Debug)]
pub(super) struct Arena {
    /// T of the plan, bytes.
    planned: usize,
    /// Per node, per output slot: where it lives (read only for outputs of
    /// ops: sources — feeds, variables, constants — are not in the buffer).
    spans: Vec<Vec<Span>>,
    store: Store,
    /// Old values of the variables an in-place op updates (see
    /// `program::update_in_place`), as large as the largest update.
    scratch: Vec<u64>,
}

/// The buffer during an iteration: the program's own, or its lane's,
/// locked (uncontended: a lane runs one iteration at a time).
#[derive(Debug)]
pub(super) enum Words<'a> {
    Own(&'a mut Vec<u64>),
    Lane(MutexGuard<'a, Vec<u64>>),
    /// Handed in for the iteration (the lane's arena in a reservation).
    Given(&'a mut [u64]),
}

impl std::ops::Deref for Words<'_> {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        match self {
            Words::Own(v) => v,
            Words::Lane(g) => g,
            Words::Given(w) => w,
        }
    }
}

impl std::ops::DerefMut for Words<'_> {
    fn deref_mut(&mut self) -> &mut [u64] {
        match self {
            Words::Own(v) => v,
            Words::Lane(g) => g,
            Words::Given(w) => w,
        }
    }
}

/// An arena held for one iteration: the buffer (at least T bytes), the
/// output spans and the scratch buffer, borrowed apart.
#[derive(Debug)]
pub(super) struct Held<'a> {
    pub words: Words<'a>,
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
        let plan = compile::plan_outlets(graph, compile::sinks(graph), PlanOptions::default())
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
            store: Store::Own(Vec::new()),
            scratch: Vec::new(),
        })
    }

    /// T of the plan the tensors follow, bytes.
    pub fn planned(&self) -> usize {
        self.planned
    }

    /// Bytes of the program's own buffer held now (0 while it runs in its
    /// lane's buffer, before its first iteration and while evicted).
    pub fn bytes(&self) -> usize {
        match &self.store {
            Store::Own(v) => v.len() * WORD,
            Store::Lane { .. } => 0,
        }
    }

    /// The lane whose buffer the next iterations use (`None`: the own one).
    pub fn lane(&self) -> Option<u64> {
        match &self.store {
            Store::Own(_) => None,
            Store::Lane { key, .. } => Some(*key),
        }
    }

    /// Runs the next iterations in the buffer of `lane` (a key unique in
    /// the process; `None`: the program's own buffer). The caller runs the
    /// iterations of one lane one at a time (they would wait for each
    /// other's lock otherwise). Binding gives the own buffer up.
    pub fn bind_lane(&mut self, lane: Option<u64>) {
        match (lane, &self.store) {
            (Some(k), Store::Lane { key, .. }) if *key == k => {}
            (None, Store::Own(_)) => {}
            (Some(k), _) => {
                self.store = Store::Lane {
                    key: k,
                    buffer: lane_buffer(k),
                }
            }
            (None, Store::Lane { .. }) => self.store = Store::Own(Vec::new()),
        }
    }

    /// The arena for one iteration: the buffer grown to T when it is
    /// smaller (the first iteration, after an eviction, or a lane that got
    /// a program with a larger T), otherwise as it is.
    pub fn hold(&mut self) -> Result<Held<'_>, ExecError> {
        let need = self.planned / WORD;
        let words = match &mut self.store {
            Store::Own(v) => {
                grow(v, need)?;
                Words::Own(v)
            }
            Store::Lane { buffer, .. } => {
                // A panic during an iteration leaves only that iteration's
                // values behind: outputs are zeroed before they are written.
                let mut g = buffer.lock().unwrap_or_else(PoisonError::into_inner);
                grow(&mut g, need)?;
                Words::Lane(g)
            }
        };
        Ok(Held {
            words,
            spans: &self.spans,
            scratch: &mut self.scratch,
        })
    }

    /// The arena for one iteration in `words`, handed in by the caller
    /// (at least T bytes; the program's own or lane buffer is not used).
    pub fn hold_given<'a>(&'a mut self, words: &'a mut [u64]) -> Result<Held<'a>, ExecError> {
        let need = self.planned / WORD;
        if words.len() < need {
            return Err(err(format!(
                "the arena handed in has {} bytes, T is {}",
                words.len() * WORD,
                self.planned
            )));
        }
        Ok(Held {
            words: Words::Given(words),
            spans: &self.spans,
            scratch: &mut self.scratch,
        })
    }

    /// Gives the buffer up (the program is evicted): the own buffer is
    /// freed, the lane's stays with the lane's other programs; the next
    /// iteration (after the service binds the lane again) takes it back.
    pub fn release(&mut self) {
        self.store = Store::Own(Vec::new());
        self.scratch = Vec::new();
    }

    #[cfg(test)]
    pub fn buffer(&self) -> Option<&Vec<u64>> {
        match &self.store {
            Store::Own(v) => Some(v),
            Store::Lane { .. } => None,
        }
    }

    #[cfg(test)]
    pub fn scratch(&self) -> &Vec<u64> {
        &self.scratch
    }
}

impl Held<'_> {
    /// Where output `o` of an op lives; `None` for sources (feeds,
    /// variables, constants), which are not in the buffer.
    pub fn span(&self, graph: &ValidGraph, o: lanes_adaptor::Outlet) -> Option<Span> {
        let node = graph.graph().nodes.get(o.node.index())?;
        if node.op.is_source() {
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
    };
    Ok(TensorMut { ty, data })
}

/// A copy of the tensor of type `ty` at `span` (a fetched result).
pub(super) fn copy_out(ty: &TensorType, words: &[u64], span: Span) -> Result<Tensor, String> {
    let range = words
        .get(span.start..span.start + span.len)
        .ok_or("fetched range past the buffer")?;
    let data = match view(ty, range)?.data {
        DataRef::F32(v) => TensorData::F32(v.to_vec()),
        DataRef::I64(v) => TensorData::I64(v.to_vec()),
    };
    Tensor::new(ty.shape.clone(), data).map_err(|e| e.to_string())
}
