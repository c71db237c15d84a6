//! The CPU reference backend: every op, forward and backward, plus the
//! in-place optimizer updates. The CUDA backend is tested against it.
//!
//! Contract (used by the service and the tests):
//! - [`CpuProgram::new`] takes a validated graph and the initial values of
//!   its variables and checks every variable is present with its declared type.
//! - [`CpuProgram::run`] runs one iteration: feeds by placeholder name,
//!   fetches by `"node"` or `"node:slot"`, returns fetched tensors in order.
//!   In-place ops (optimizer updates, batch-norm running stats, assign)
//!   update the program's variables.
//! - [`run_op`] runs one op on typed slices: the kernel entry point.
//!
//! Memory: every op output of an iteration lives at the offset the compile
//! stage's memory plan gives it in one buffer of T bytes (the T the
//! service reports; see `arena.rs`), every variable and constant at its
//! place in one buffer of P bytes (`vars.rs`): the program's own, or under
//! a service with a reservation the memory its lane's turn hands in
//! ([`CpuMemory`]). Nothing is allocated per iteration for either.

mod arena;
mod backward;
mod forward;
mod program;
mod vars;
mod widen;

use std::collections::BTreeMap;

use lanes_adaptor::{Op, Tensor, ValidGraph, VarValues};

use self::arena::Arena;
use self::vars::{Places, Vars};
use super::{ExecError, HostFeed, TensorMut, TensorRef};
use crate::residency::{
    Costs, GroupPlan, Layout, PlanCache, Profile, Strategy, SwitchReport, UnitTimer,
};

/// A validated graph and its variables, ready to run iterations on the CPU.
///
/// Memory: the variables and constants at fixed places in one buffer of P
/// bytes (`vars.rs`), the op outputs at their planned offsets in one of T
/// bytes (`arena.rs`). Both are the program's own, or — under a service
/// whose lanes hold a reservation — the job's persistent region and its
/// lane's arena in the reservation, handed in with each call
/// ([`CpuMemory`]; from then on the program holds no persistent memory of
/// its own).
///
/// Residency: [`CpuProgram::evict`] copies the persistent buffer to a host
/// copy (the stand-in for pinned host memory) and gives the buffer up; the
/// next run brings it back in groups on a copier thread while the
/// iteration already computes ([`CpuProgram::run_switching`]). Eviction
/// also gives up the ephemeral arena; the next run takes it again.
/// [`CpuProgram::evict_keeping`] keeps the buffer's first units (the
/// stand-in for the device memory a partially evicted CUDA program keeps
/// mapped): the switch copies only the rest.
#[derive(Debug)]
pub struct CpuProgram {
    graph: ValidGraph,
    /// Where each variable and constant lives in the persistent buffer.
    places: Places,
    /// Where the persistent buffer is.
    persist: Persist,
    /// The ephemeral tensors, at their memory plan's offsets.
    arena: Box<Arena>,
    res: Box<Residency>,
}

/// Where a program's persistent buffer is.
#[derive(Debug)]
enum Persist {
    /// The program's own.
    Own(Vec<u64>),
    /// In the memory handed in with each call ([`CpuMemory`]).
    Given,
    /// Only in the host copy (evicted).
    Evicted,
}

/// Memory a service hands a program for one call: the job's persistent
/// region and its lane's ephemeral arena, as 8-byte words (see
/// `lanes::JobMemory`). The first call that hands it in moves the
/// program's variables there; every later call must hand it in (the
/// region may have moved in the reservation meanwhile: its contents moved
/// with it).
#[derive(Debug)]
pub struct CpuMemory<'a> {
    pub persistent: &'a mut [u64],
    pub arena: &'a mut [u64],
}

/// Residency state of a [`CpuProgram`].
#[derive(Debug)]
struct Residency {
    layout: Layout,
    /// The host copy of the persistent buffer; current unless `dirty`.
    host: Option<Vec<u64>>,
    /// The resident variables changed since the host copy was taken.
    dirty: bool,
    /// Per-unit copy seconds, measured when the host copy was taken.
    copy: Option<Vec<f64>>,
    /// While evicted partially: the persistent buffer's first words (the
    /// first `kept_units` units), still held; empty otherwise.
    kept: Vec<u64>,
    kept_units: usize,
    profile: Option<Profile>,
    plans: PlanCache,
}

impl Residency {
    /// The measured costs (zeros where nothing was measured yet).
    fn costs(&self) -> Costs {
        let n = self.layout.units.len();
        let profile = self.profile.clone().unwrap_or_else(|| Profile::zeros(n));
        Costs {
            copy: self.copy.clone().unwrap_or_else(|| vec![0.0; n]),
            compute: profile.compute,
            prefix: profile.prefix,
            copy_overhead: GROUP_OVERHEAD,
            compute_overhead: GROUP_OVERHEAD,
        }
    }
}

/// Per-group cost of the copier (a channel send and wake-up), seconds.
const GROUP_OVERHEAD: f64 = 10e-6;

fn no_memory() -> ExecError {
    ExecError::Op {
        node: String::new(),
        op: "persistent memory",
        reason: "the program's variables live in memory handed in with each call, and none was"
            .into(),
    }
}

/// A persistent region handed in that is shorter than P (`n` words).
fn too_short(len: usize, n: usize) -> ExecError {
    ExecError::Op {
        node: String::new(),
        op: "persistent memory",
        reason: format!(
            "the persistent region handed in has {} bytes, P is {}",
            len * 8,
            n * 8
        ),
    }
}

/// The first `n` words of `region`, the memory handed in for P.
fn given(region: &mut [u64], n: usize) -> Result<&mut [u64], ExecError> {
    let len = region.len();
    region.get_mut(..n).ok_or_else(|| too_short(len, n))
}

/// The persistent buffer of `n` words: the program's own, the memory
/// handed in (`region`), or the host copy while evicted.
fn persistent_words<'a>(
    persist: &'a Persist,
    host: Option<&'a [u64]>,
    region: Option<&'a [u64]>,
    n: usize,
) -> Result<&'a [u64], ExecError> {
    match (persist, region) {
        (Persist::Own(v), _) => Ok(v),
        (Persist::Given, Some(p)) => p.get(..n).ok_or_else(|| too_short(p.len(), n)),
        (Persist::Given, None) => Err(no_memory()),
        (Persist::Evicted, _) => host.ok_or_else(no_memory),
    }
}

/// The hook that hands the iteration each group's piece of the persistent
/// buffer (received from the copier) before the first node that needs it.
fn installer<'p, 'r>(
    groups: &'r [(usize, std::ops::Range<usize>)],
    rx: &'r crossbeam_channel::Receiver<(usize, &'p mut [u64])>,
) -> impl FnMut(usize, &mut Vars<'p>) -> Result<(), ExecError> + 'r {
    let mut next = 0;
    move |pos, vars| {
        while next < groups.len() && groups[next].0 <= pos {
            let (k, piece) = rx.recv().map_err(|_| ExecError::MissingVariable {
                name: "(the copier stopped early)".into(),
            })?;
            vars.insert(k, piece)?;
            next += 1;
        }
        Ok(())
    }
}

impl CpuProgram {
    /// Checks that every variable of `graph` has a value of its declared
    /// type, places the variables and constants in the program's
    /// persistent buffer and plans the ephemeral memory (the arena, T
    /// bytes, comes at the first iteration).
    pub fn new(graph: ValidGraph, vars: VarValues) -> Result<Self, ExecError> {
        program::check_vars(&graph, &vars)?;
        let arena = Box::new(Arena::new(&graph)?);
        let layout = Layout::of(&graph);
        let places = Places::new(&graph, &layout)?;
        let own = places.fill(&graph, &vars)?;
        drop(vars);
        Ok(CpuProgram {
            graph,
            places,
            persist: Persist::Own(own),
            arena,
            res: Box::new(Residency {
                layout,
                host: None,
                dirty: true,
                copy: None,
                kept: Vec::new(),
                kept_units: 0,
                profile: None,
                plans: PlanCache::default(),
            }),
        })
    }

    pub fn graph(&self) -> &ValidGraph {
        &self.graph
    }

    /// Runs one iteration (bringing the variables back first if evicted).
    pub fn run<F: HostFeed>(
        &mut self,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
    ) -> Result<Vec<Tensor>, ExecError> {
        self.run_switching(feeds, fetches, Strategy::Pipelined)
            .map(|(out, _)| out)
    }

    /// Whether the variables are in the program's memory (not only in the
    /// host copy).
    pub fn is_resident(&self) -> bool {
        !matches!(self.persist, Persist::Evicted)
    }

    /// Whether the variables live in memory handed in with each call.
    pub fn is_given(&self) -> bool {
        matches!(self.persist, Persist::Given)
    }

    /// Persistent bytes (variables and constants).
    pub fn persistent_bytes(&self) -> u64 {
        self.res.layout.bytes()
    }

    /// Bytes of the persistent buffer: P of the memory plan (every tensor
    /// rounded up to the plan's alignment).
    pub fn persistent_buffer_bytes(&self) -> u64 {
        (self.places.words() * 8) as u64
    }

    /// The unit layout (persistent tensors by first use).
    pub fn layout(&self) -> &Layout {
        &self.res.layout
    }

    /// T of the memory plan the ephemeral tensors follow, bytes (the
    /// graph's sinks kept to the end).
    pub fn ephemeral_bytes(&self) -> u64 {
        self.arena.planned() as u64
    }

    /// Bytes of the program's own ephemeral buffer held now: T once it
    /// ran alone; 0 before, while evicted and while it runs in memory
    /// handed in.
    pub fn arena_bytes(&self) -> u64 {
        self.arena.bytes() as u64
    }

    /// Bytes of persistent memory the program holds of its own now (P
    /// while resident in its own buffer; the kept prefix while evicted
    /// partially; 0 while evicted whole or given memory).
    pub fn own_persistent_bytes(&self) -> u64 {
        match &self.persist {
            Persist::Own(v) => (v.len() * 8) as u64,
            Persist::Evicted => self.kept_bytes(),
            Persist::Given => 0,
        }
    }

    /// Bytes of the persistent buffer still held while evicted partially
    /// ([`CpuProgram::evict_keeping`]); 0 while resident or evicted whole.
    pub fn kept_bytes(&self) -> u64 {
        (self.res.kept.len() * 8) as u64
    }

    /// Units kept while evicted partially (0 otherwise).
    pub fn kept_units(&self) -> usize {
        self.res.kept_units
    }

    /// The units and words a partial eviction asked to keep `bytes` holds:
    /// the fewest whole units whose words cover `bytes` (all of them when
    /// `bytes` is P or more).
    fn keep_for(&self, bytes: u64) -> (usize, usize) {
        let n = self.res.layout.units.len();
        let units = (0..=n)
            .find(|&u| (self.places.unit_range(0..u).end * 8) as u64 >= bytes)
            .unwrap_or(n);
        (units, self.places.unit_range(0..units).end)
    }

    /// The bytes `auto` keeps ([`crate::residency::auto_keep`] on the
    /// measured costs, as whole units); `None` until the program has been
    /// profiled (a resident run) and evicted once (the copy costs).
    pub fn auto_keep_bytes(&self) -> Option<u64> {
        self.res.copy.as_ref()?;
        self.res.profile.as_ref()?;
        let units = crate::residency::auto_keep(&self.costs(), crate::residency::AUTO_KEEP_SLACK);
        Some((self.places.unit_range(0..units).end * 8) as u64)
    }

    /// Host copy bandwidth in bytes/s, measured when the host copy was taken.
    pub fn bandwidth(&self) -> Option<f64> {
        let secs: f64 = self.res.copy.as_ref()?.iter().sum();
        (secs > 0.0).then(|| self.res.layout.bytes() as f64 / secs)
    }

    /// The per-unit compute profile of a resident iteration, once one ran.
    pub fn profile(&self) -> Option<&Profile> {
        self.res.profile.as_ref()
    }

    /// Moves the variables out to the host copy, copying them only when the
    /// host copy is stale (training state; never for an inference graph
    /// evicted twice). Returns the bytes copied.
    pub fn evict(&mut self) -> Result<u64, ExecError> {
        self.evict_in(None)
    }

    /// [`CpuProgram::evict`] of a program whose variables live in
    /// `persistent` (handed in: see [`CpuMemory`]).
    pub fn evict_in(&mut self, persistent: Option<&[u64]>) -> Result<u64, ExecError> {
        self.evict_keeping_in(persistent, 0)
    }

    /// [`CpuProgram::evict`] that keeps the persistent buffer's first
    /// units, at least `bytes` of it (whole units; 0: evict whole): the
    /// next switch copies only the rest while the kept units already
    /// compute. Evicting a partially evicted program whole (`bytes` 0)
    /// gives the kept prefix up too; otherwise a program already evicted
    /// is left as it is. Only for a program in its own memory: one whose
    /// variables live in memory the service hands in is evicted whole.
    pub fn evict_keeping(&mut self, bytes: u64) -> Result<u64, ExecError> {
        if bytes > 0 && self.is_given() {
            return Err(ExecError::Op {
                node: String::new(),
                op: "evict",
                reason: "a program whose memory the service hands in is evicted whole".into(),
            });
        }
        self.evict_keeping_in(None, bytes)
    }

    fn evict_keeping_in(
        &mut self,
        persistent: Option<&[u64]>,
        bytes: u64,
    ) -> Result<u64, ExecError> {
        if !self.is_resident() {
            if bytes == 0 && self.res.kept_units > 0 {
                self.res.kept = Vec::new();
                self.res.kept_units = 0;
                let costs = self.costs();
                self.res.plans.fill(&costs, 0);
            }
            return Ok(0);
        }
        let n = self.places.words();
        let words = persistent_words(&self.persist, None, persistent, n)?;
        let res = &mut self.res;
        let mut copied = 0;
        if res.dirty || res.host.is_none() {
            let mut host = Vec::new();
            host.try_reserve_exact(n).map_err(|e| ExecError::Op {
                node: String::new(),
                op: "evict",
                reason: format!("cannot allocate the host copy: {e}"),
            })?;
            let mut copy = Vec::with_capacity(res.layout.units.len());
            for k in 0..res.layout.units.len() {
                let t0 = std::time::Instant::now();
                let r = self.places.unit_range(k..k + 1);
                host.extend_from_slice(&words[r]);
                copy.push(t0.elapsed().as_secs_f64());
            }
            host.resize(n, 0);
            copied = (n * 8) as u64;
            res.host = Some(host);
            res.copy = Some(copy);
            res.plans.invalidate();
            res.dirty = false;
        }
        let (units, words) = if bytes > 0 {
            self.keep_for(bytes)
        } else {
            (0, 0)
        };
        self.res.kept = match std::mem::replace(&mut self.persist, Persist::Evicted) {
            Persist::Own(mut v) if units > 0 => {
                v.truncate(words);
                v.shrink_to_fit();
                v
            }
            _ => Vec::new(),
        };
        self.res.kept_units = if self.res.kept.is_empty() { 0 } else { units };
        self.arena.release();
        let costs = self.costs();
        self.res.plans.fill(&costs, self.res.kept_units);
        Ok(copied)
    }

    /// The group plan `strategy` would use now (copy costs are known once
    /// the program was evicted; compute costs once it ran resident).
    pub fn plan(&self, strategy: Strategy) -> GroupPlan {
        let kept = if self.is_resident() {
            0
        } else {
            self.res.kept_units
        };
        self.res.plans.get(strategy, kept, || self.costs())
    }

    /// The measured costs (zeros where nothing was measured yet).
    fn costs(&self) -> Costs {
        self.res.costs()
    }

    /// The iteration time the switching planner plans with (its profile's
    /// prefix and per-unit compute), seconds; `None` before a profile.
    pub fn planned_compute_secs(&self) -> Option<f64> {
        self.res.profile.as_ref()?;
        let c = self.costs();
        Some(c.prefix + c.compute.iter().sum::<f64>())
    }

    /// Runs one iteration; when the program is not resident, its variables
    /// come back in the groups of `strategy` while the iteration computes.
    /// The report says how (`None` when it was resident).
    pub fn run_switching<F: HostFeed>(
        &mut self,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
        strategy: Strategy,
    ) -> Result<(Vec<Tensor>, Option<SwitchReport>), ExecError> {
        self.run_in(None, feeds, fetches, strategy)
    }

    /// [`CpuProgram::run_switching`] in `mem` when given: the job's
    /// persistent region (the variables move there at the first such call,
    /// or come back there after an eviction) and its lane's arena.
    pub fn run_in<F: HostFeed>(
        &mut self,
        mem: Option<CpuMemory<'_>>,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
        strategy: Strategy,
    ) -> Result<(Vec<Tensor>, Option<SwitchReport>), ExecError> {
        let n = self.places.words();
        let (mut region, arena_words) = match mem {
            Some(m) => (Some(given(m.persistent, n)?), Some(m.arena)),
            None => (None, None),
        };
        // Own variables move into the memory handed in.
        if let (Persist::Own(own), Some(dst)) = (&self.persist, region.as_deref_mut()) {
            if own.len() != dst.len() {
                return Err(too_short(dst.len(), own.len()));
            }
            dst.copy_from_slice(own);
            self.persist = Persist::Given;
        }
        if matches!(self.persist, Persist::Given) && region.is_none() {
            return Err(no_memory());
        }
        // An entry's Run is not the iteration the switching profile times,
        // and may update nothing.
        let part = crate::exec::part_of(&self.graph, fetches)?;
        let main = part == lanes_adaptor::Part::Main;
        let updates = self.graph.part_updates(part);
        let CpuProgram {
            graph,
            places,
            persist,
            arena,
            res,
        } = self;
        let mut held = match arena_words {
            Some(w) => arena.hold_given(w)?,
            None => arena.hold()?,
        };
        if !matches!(persist, Persist::Evicted) {
            let words: &mut [u64] = match (persist, region) {
                (Persist::Own(v), _) => v,
                (_, Some(r)) => r,
                _ => return Err(no_memory()),
            };
            let mut vars = Vars::whole(words);
            let mem = program::Memory {
                places,
                vars: &mut vars,
                arena: &mut held,
            };
            let out = if res.profile.is_none() && main {
                let mut timer = UnitTimer::new(&res.layout);
                let out = program::run_iteration(graph, mem, feeds, fetches, &mut |pos, _| {
                    timer.at(pos);
                    Ok(())
                });
                if out.is_ok() {
                    res.profile = Some(timer.finish());
                    res.plans.invalidate();
                }
                out
            } else {
                program::run_iteration(graph, mem, feeds, fetches, &mut |_, _| Ok(()))
            };
            if updates {
                res.dirty = true;
            }
            return out.map(|o| (o, None));
        }
        // Evicted: back into the memory handed in, or a new own buffer.
        let plan = res.plans.get(strategy, res.kept_units, || res.costs());
        // The kept prefix (a partial eviction) is already in place below.
        let kept = std::mem::take(&mut res.kept);
        res.kept_units = 0;
        let kw = kept.len();
        let host = res
            .host
            .as_deref()
            .ok_or_else(|| ExecError::MissingVariable {
                name: "(the evicted program has no host copy)".into(),
            })?;
        let to_own = region.is_none();
        let mut own: Vec<u64> = Vec::new();
        let target: &mut [u64] = match region {
            Some(r) => {
                r.get_mut(..kw)
                    .ok_or_else(no_memory)?
                    .copy_from_slice(&kept);
                r
            }
            None => {
                own = kept;
                own.try_reserve_exact(n.saturating_sub(kw))
                    .map_err(|e| ExecError::Op {
                        node: String::new(),
                        op: "restore",
                        reason: format!("cannot allocate {} bytes: {e}", n * 8),
                    })?;
                own.resize(n, 0);
                &mut own
            }
        };
        let units = &res.layout.units;
        let kept_bytes: u64 = units[..plan.kept.min(units.len())]
            .iter()
            .map(|u| u.bytes)
            .sum();
        // Per group: where the iteration first needs it, and its words.
        let groups: Vec<(usize, std::ops::Range<usize>)> = (0..plan.groups())
            .map(|k| {
                let r = plan.range(k, units.len());
                let first = units.get(r.start).map_or(usize::MAX, |u| u.first_use);
                (first, places.unit_range(r))
            })
            .collect();
        let out = if groups.len() <= 1 {
            // One group: copy (all but the kept prefix), then run (no
            // copier thread to start).
            target
                .get_mut(kw..)
                .ok_or_else(no_memory)?
                .copy_from_slice(host.get(kw..n).ok_or_else(no_memory)?);
            let mut vars = Vars::whole(target);
            let mem = program::Memory {
                places,
                vars: &mut vars,
                arena: &mut held,
            };
            program::run_iteration(graph, mem, feeds, fetches, &mut |_, _| Ok(()))
        } else {
            // The target in the groups' pieces; the copier fills each and
            // hands it back.
            let mut pieces: Vec<&mut [u64]> = Vec::with_capacity(groups.len());
            let mut rest: &mut [u64] = target;
            let mut at = 0;
            for (_, r) in &groups {
                let (piece, tail) = std::mem::take(&mut rest)
                    .split_at_mut_checked(r.end - at)
                    .ok_or_else(no_memory)?;
                pieces.push(piece);
                rest = tail;
                at = r.end;
            }
            let starts: Vec<usize> = groups.iter().map(|(_, r)| r.start).collect();
            let copier_groups = &groups;
            let copier_plan = &plan;
            std::thread::scope(|s| {
                let (tx, rx) = crossbeam_channel::unbounded::<(usize, &mut [u64])>();
                s.spawn(move || {
                    for (k, (piece, (_, r))) in pieces.into_iter().zip(copier_groups).enumerate() {
                        // The kept group is in place already.
                        if let (true, Some(src)) = (copier_plan.copies(k), host.get(r.clone())) {
                            piece.copy_from_slice(src);
                        }
                        if tx.send((k, piece)).is_err() {
                            break;
                        }
                    }
                });
                let mut vars = Vars::pieces(starts);
                let mut install = installer(&groups, &rx);
                let mem = program::Memory {
                    places,
                    vars: &mut vars,
                    arena: &mut held,
                };
                let out = program::run_iteration(graph, mem, feeds, fetches, &mut install);
                // Whatever happened, the buffer ends whole.
                let drained = install(usize::MAX, &mut vars);
                out.and_then(|o| drained.map(|()| o))
            })
        };
        *persist = if to_own {
            Persist::Own(own)
        } else {
            Persist::Given
        };
        // A Run that updates nothing leaves the host image as good as it was.
        res.dirty = updates;
        let report = SwitchReport {
            strategy,
            replayed: false,
            groups: plan.groups(),
            bytes: res.layout.bytes() - kept_bytes,
            kept_bytes,
            predicted: plan.predicted,
            feeds_staged: false,
            trace: None,
        };
        out.map(|o| (o, Some(report)))
    }

    /// Current values of the named variables (all variables when `names` is empty).
    pub fn read_variables(&self, names: &[String]) -> Result<VarValues, ExecError> {
        self.read_variables_in(None, names)
    }

    /// [`CpuProgram::read_variables`] of a program whose variables may
    /// live in `persistent` (handed in).
    pub fn read_variables_in(
        &self,
        persistent: Option<&[u64]>,
        names: &[String],
    ) -> Result<VarValues, ExecError> {
        let words = self.words(persistent)?;
        let g = self.graph.graph();
        let mut out = VarValues::new();
        for (id, name, ty) in g.variables() {
            if !names.is_empty() && !names.iter().any(|n| n == name) {
                continue;
            }
            let span = self
                .places
                .span(id)
                .ok_or_else(|| ExecError::MissingVariable { name: name.into() })?;
            out.insert(name.to_string(), vars::read(ty, words, span)?);
        }
        if let Some(n) = names.iter().find(|n| !out.contains_key(*n)) {
            return Err(ExecError::MissingVariable { name: n.clone() });
        }
        Ok(out)
    }

    /// The persistent buffer wherever it is now.
    fn words<'a>(&'a self, persistent: Option<&'a [u64]>) -> Result<&'a [u64], ExecError> {
        persistent_words(
            &self.persist,
            self.res.host.as_deref(),
            persistent,
            self.places.words(),
        )
    }

    /// Overwrites variables; each must exist and keep its type.
    pub fn write_variables(&mut self, values: VarValues) -> Result<(), ExecError> {
        self.write_variables_in(None, values)
    }

    /// [`CpuProgram::write_variables`] of a program whose variables may
    /// live in `persistent` (handed in). Nothing is written unless every
    /// value is acceptable.
    pub fn write_variables_in(
        &mut self,
        persistent: Option<&mut [u64]>,
        values: VarValues,
    ) -> Result<(), ExecError> {
        let g = self.graph.graph();
        let mut spans = Vec::with_capacity(values.len());
        for (name, t) in &values {
            let (id, ty) = g
                .variables()
                .find(|(_, n, _)| n == name)
                .map(|(id, _, ty)| (id, ty))
                .ok_or_else(|| ExecError::MissingVariable { name: name.clone() })?;
            if &t.ty() != ty {
                return Err(ExecError::VariableType {
                    name: name.clone(),
                    expected: ty.clone(),
                    got: t.ty(),
                });
            }
            let span = self
                .places
                .span(id)
                .ok_or_else(|| ExecError::MissingVariable { name: name.clone() })?;
            spans.push(span);
        }
        let n = self.places.words();
        let words: &mut [u64] = match (&mut self.persist, persistent) {
            (Persist::Own(v), _) => {
                self.res.dirty = true;
                v
            }
            (Persist::Given, Some(p)) => {
                self.res.dirty = true;
                given(p, n)?
            }
            (Persist::Given, None) => return Err(no_memory()),
            (Persist::Evicted, _) => {
                // The kept prefix (a partial eviction) gets its values too.
                let kept = &mut self.res.kept;
                for ((_, t), span) in values.iter().zip(&spans) {
                    if span.start + span.len <= kept.len() {
                        vars::write(kept, *span, t)?;
                    }
                }
                self.res.host.as_deref_mut().ok_or_else(no_memory)?
            }
        };
        for ((_, t), span) in values.iter().zip(spans) {
            vars::write(words, span, t)?;
        }
        Ok(())
    }
}

/// Runs one op. `inputs` are all of the node's inputs in order (for in-place
/// ops, the mutated ones too, read-only); `inplace` are the mutated inputs in
/// the order of [`Op::mutated_inputs`]; `outputs` are preallocated to their
/// inferred types.
pub fn run_op(
    node: &str,
    op: &Op,
    inputs: &[TensorRef<'_>],
    inplace: &mut [TensorMut<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    if widen::needed(op, inputs, inplace, outputs) {
        return widen::run(node, op, inputs, inplace, outputs, |i, u, o| {
            run_f32(node, op, i, u, o)
        });
    }
    run_f32(node, op, inputs, inplace, outputs)
}

/// [`run_op`] for ops whose tensors hold no half values (or that move
/// them as they are).
fn run_f32(
    node: &str,
    op: &Op,
    inputs: &[TensorRef<'_>],
    inplace: &mut [TensorMut<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    match backward::run(node, op, inputs, inplace, outputs) {
        Some(result) => result,
        None => forward::run(node, op, inputs, outputs),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
