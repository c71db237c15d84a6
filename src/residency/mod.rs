//! Residency and pipelined switching: a job's persistent memory (variables
//! and constants) lives on the device or only in host memory, and a job that
//! is not resident is brought back in groups of layers while the groups
//! already copied compute (PipeSwitch's pipelined model transmission).
//!
//! This module is backend-neutral and sans-IO:
//! - [`Layout`] cuts a graph's persistent tensors into *units*: the tensors
//!   whose first consumer is the same node, in execution order. A unit is the
//!   smallest thing a group can hold; its compute is the run of nodes from
//!   its first consumer up to the next unit's.
//! - [`Costs`] are measured per unit by the executors (copy time from bytes
//!   and bandwidth, compute time from a profiled iteration).
//! - [`plan_groups`] cuts the units into contiguous groups for a
//!   [`Strategy`]; for [`Strategy::Pipelined`] it minimises the predicted
//!   time of the first iteration with an exact dynamic program (see
//!   `docs/switching.md`). [`plan_groups_keeping`] does the same for a
//!   program evicted *partially*: its first units stayed on the device and
//!   cost no copy; [`auto_keep`] picks how many to keep from the costs.
//!
//! The executors (`exec::cpu`, `exec::cuda`) carry out a plan: copy group k
//! on a copy stream (a copier thread on the CPU backend) while the compute
//! stream runs the nodes whose weights are already there, each group's first
//! node waiting for that group's copy.

use lanes_adaptor::{NodeId, Op, ValidGraph};

/// One unit: persistent tensors first consumed by the same node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// Position in `graph.main_order()` of the first node that reads them
    /// (the main order's length for tensors nothing there reads: only an
    /// entry's nodes, or none).
    pub first_use: usize,
    /// The variable and constant nodes, in layout order.
    pub tensors: Vec<NodeId>,
    /// Their bytes.
    pub bytes: u64,
}

/// The persistent tensors of a graph in first-use order, cut into units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Units by increasing `first_use`.
    pub units: Vec<Unit>,
    /// Nodes in the main iteration's order.
    pub nodes: usize,
}

impl Layout {
    /// Units of `graph`: every `Variable` and `Constant` node, grouped by the
    /// position of its first consumer in the main iteration's order.
    pub fn of(graph: &ValidGraph) -> Layout {
        let g = graph.graph();
        let order = graph.order();
        let main = graph.main_order();
        let mut pos = vec![usize::MAX; g.nodes.len()];
        for (p, id) in order.iter().enumerate() {
            pos[id.index()] = p;
        }
        let mut first = vec![main.len(); g.nodes.len()];
        for &id in main {
            let p = pos[id.index()];
            for o in &g.nodes[id.index()].inputs {
                let f = &mut first[o.node.index()];
                *f = (*f).min(p);
            }
        }
        let mut persistent: Vec<(usize, usize, NodeId)> = order
            .iter()
            .filter(|id| matches!(g.nodes[id.index()].op, Op::Variable(_) | Op::Constant(_)))
            .map(|&id| (first[id.index()], pos[id.index()], id))
            .collect();
        persistent.sort();
        let mut units: Vec<Unit> = Vec::new();
        for (first_use, _, id) in persistent {
            let bytes = g.nodes[id.index()]
                .outputs
                .first()
                .map_or(0, |t| t.bytes() as u64);
            match units.last_mut() {
                Some(u) if u.first_use == first_use => {
                    u.tensors.push(id);
                    u.bytes += bytes;
                }
                _ => units.push(Unit {
                    first_use,
                    tensors: vec![id],
                    bytes,
                }),
            }
        }
        Layout {
            units,
            nodes: main.len(),
        }
    }

    /// Persistent bytes in all.
    pub fn bytes(&self) -> u64 {
        self.units.iter().map(|u| u.bytes).sum()
    }

    /// For each position in the execution order, the unit whose compute it
    /// belongs to (`None` before the first unit's first use).
    pub fn unit_of_position(&self) -> Vec<Option<usize>> {
        let mut out = vec![None; self.nodes];
        let mut u = None;
        let mut next = 0;
        for (p, slot) in out.iter_mut().enumerate() {
            while next < self.units.len() && self.units[next].first_use <= p {
                u = Some(next);
                next += 1;
            }
            *slot = u;
        }
        out
    }
}

/// How a non-resident job is brought back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Groups chosen by [`plan_groups`] to minimise the first iteration.
    Pipelined,
    /// One group per unit (per layer).
    PerLayer,
    /// One group: copy everything, then compute (load-then-run).
    Single,
}

impl Strategy {
    pub const ALL: [Strategy; 3] = [Strategy::Pipelined, Strategy::PerLayer, Strategy::Single];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Pipelined => "pipelined",
            Strategy::PerLayer => "per_layer",
            Strategy::Single => "single",
        }
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Measured costs, in seconds.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Costs {
    /// Copy time of each unit's bytes at the measured bandwidth.
    pub copy: Vec<f64>,
    /// Compute time of each unit's nodes.
    pub compute: Vec<f64>,
    /// Compute before the first unit (nodes that read no weights).
    pub prefix: f64,
    /// Fixed cost of one more group on the copy side (one more copy call
    /// and event).
    pub copy_overhead: f64,
    /// Fixed cost of one more group on the compute side (one more wait).
    pub compute_overhead: f64,
}

impl Costs {
    /// Costs from unit bytes and a bandwidth (bytes per second).
    pub fn from_bandwidth(
        layout: &Layout,
        bandwidth: f64,
        compute: Vec<f64>,
        prefix: f64,
        copy_overhead: f64,
        compute_overhead: f64,
    ) -> Costs {
        let bw = if bandwidth > 0.0 { bandwidth } else { f64::MAX };
        Costs {
            copy: layout.units.iter().map(|u| u.bytes as f64 / bw).collect(),
            compute,
            prefix,
            copy_overhead,
            compute_overhead,
        }
    }
}

/// A cut of the units into contiguous groups.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GroupPlan {
    pub strategy: Strategy,
    /// Index of the first unit of each group (the first is 0); empty when
    /// there are no units.
    pub starts: Vec<usize>,
    /// Predicted time of the first iteration under [`Costs`], seconds.
    pub predicted: f64,
    /// Units at the start that stayed on the device (a partial eviction):
    /// they are the first group, which copies nothing (so `starts[1]`, when
    /// there is one, is `kept`). 0 for a program evicted whole.
    pub kept: usize,
}

impl GroupPlan {
    /// Number of groups.
    pub fn groups(&self) -> usize {
        self.starts.len()
    }

    /// Unit range of group `k`.
    pub fn range(&self, k: usize, units: usize) -> std::ops::Range<usize> {
        let end = self.starts.get(k + 1).copied().unwrap_or(units);
        self.starts[k]..end
    }

    /// Whether group `k` is copied (not the kept prefix).
    pub fn copies(&self, k: usize) -> bool {
        !(k == 0 && self.kept > 0)
    }

    /// Groups that are copied.
    pub fn copied_groups(&self) -> usize {
        self.starts.len() - usize::from(self.kept > 0 && !self.starts.is_empty())
    }
}

/// Predicted time of the first iteration when the units are copied in the
/// groups starting at `starts` (copies back to back on one stream, each
/// group's compute waiting for its copy and for the previous compute).
pub fn predict(costs: &Costs, starts: &[usize]) -> f64 {
    predict_keeping(costs, starts, 0)
}

/// [`predict`] when the first `kept` units stayed on the device: they copy
/// nothing and their compute waits for no copy.
pub fn predict_keeping(costs: &Costs, starts: &[usize], kept: usize) -> f64 {
    let n = costs.copy.len().min(costs.compute.len());
    let mut copy_end = 0.0;
    let mut compute_end = costs.prefix;
    for (k, &s) in starts.iter().enumerate() {
        let e = starts.get(k + 1).copied().unwrap_or(n).min(n);
        if s >= e {
            continue;
        }
        let work: f64 = costs.compute[s..e].iter().sum();
        if e <= kept {
            compute_end += work;
            continue;
        }
        copy_end += costs.copy[s.max(kept)..e].iter().sum::<f64>() + costs.copy_overhead;
        compute_end = f64::max(compute_end, copy_end) + work + costs.compute_overhead;
    }
    compute_end
}

/// Cuts the units into groups for `strategy`.
///
/// [`Strategy::Pipelined`] is exact under the cost model of [`predict`]: with
/// `E(j, g)` the earliest end of compute when the first `j` units are copied
/// in `g` groups, the copy of that last group ends at `C(j) + g·o` whatever
/// the cut, so
/// `E(j, g) = min_i max(E(i, g-1), C(j) + g·o) + X(i..j) + o'`,
/// and a smaller `E` is never worse later on. O(n³) in the number of units
/// (a few hundred for the zoo's largest models: milliseconds, once per
/// profile).
pub fn plan_groups(costs: &Costs, strategy: Strategy) -> GroupPlan {
    plan_groups_keeping(costs, strategy, 0)
}

/// [`plan_groups`] for a program whose first `kept` units stayed on the
/// device (a partial eviction; capped at the number of units): they are
/// the first group and copy nothing; the rest is cut as `strategy` says,
/// [`Strategy::Pipelined`] by the same dynamic program started at
/// `E(kept, 0) = prefix + X(0..kept)` with copies counted from unit `kept`.
pub fn plan_groups_keeping(costs: &Costs, strategy: Strategy, kept: usize) -> GroupPlan {
    let n = costs.copy.len().min(costs.compute.len());
    let kept = kept.min(n);
    let rest: Vec<usize> = match strategy {
        _ if n == kept => Vec::new(),
        Strategy::Single => vec![kept],
        Strategy::PerLayer => (kept..n).collect(),
        Strategy::Pipelined => optimal(costs, n, kept),
    };
    let starts: Vec<usize> = (kept > 0).then_some(0).into_iter().chain(rest).collect();
    GroupPlan {
        strategy,
        predicted: predict_keeping(costs, &starts, kept),
        starts,
        kept,
    }
}

/// The pipelined cut of units `kept..n` (their group starts), the first
/// `kept` units' compute running before without a copy.
fn optimal(costs: &Costs, n: usize, kept: usize) -> Vec<usize> {
    let m = n - kept;
    let mut c = vec![0.0; m + 1];
    let mut x = vec![0.0; m + 1];
    for j in 0..m {
        c[j + 1] = c[j] + costs.copy[kept + j];
        x[j + 1] = x[j] + costs.compute[kept + j];
    }
    const INF: f64 = f64::INFINITY;
    // e[g][j]: best compute end covering the copied units 0..j (from
    // `kept`) in g groups; from[g][j]: the start of the last group.
    let mut e = vec![vec![INF; m + 1]; m + 1];
    let mut from = vec![vec![0usize; m + 1]; m + 1];
    e[0][0] = costs.prefix + costs.compute[..kept].iter().sum::<f64>();
    let mut best = (INF, 0usize);
    for g in 1..=m {
        let copy_over = g as f64 * costs.copy_overhead;
        let (prev, cur) = e.split_at_mut(g);
        let prev = &prev[g - 1];
        let cur = &mut cur[0];
        for j in g..=m {
            let copy_end = c[j] + copy_over;
            let mut v_min = INF;
            let mut arg = 0;
            for i in (g - 1)..j {
                if prev[i] == INF {
                    continue;
                }
                let v = f64::max(prev[i], copy_end) + (x[j] - x[i]) + costs.compute_overhead;
                if v < v_min {
                    v_min = v;
                    arg = i;
                }
            }
            cur[j] = v_min;
            from[g][j] = arg;
        }
        if e[g][m] < best.0 {
            best = (e[g][m], g);
        }
    }
    let mut starts = Vec::with_capacity(best.1);
    let (mut g, mut j) = (best.1, m);
    while g > 0 {
        let i = from[g][j];
        starts.push(kept + i);
        j = i;
        g -= 1;
    }
    starts.reverse();
    starts
}

/// The target of [`auto_keep`] that the executors use: the predicted
/// pipelined switch within 2 % of its bound.
pub const AUTO_KEEP_SLACK: f64 = 1.02;

/// How many leading units to keep on the device at an eviction (`auto`):
/// the smallest prefix with which the predicted pipelined switch is at
/// most `slack` × max(copy of the rest, compute) (its bound with that
/// prefix resident). Keeping every unit always meets it (the switch is
/// then the compute alone), so there is one. Found by bisection over the
/// prefix: the prediction's excess over the bound falls as the prefix
/// grows (a longer head start for the compute, less to copy), though not
/// strictly, so on costs where it does not the prefix found meets the
/// target but may not be the smallest. Each step is one dynamic program
/// (O(n³)): about ten of them.
pub fn auto_keep(costs: &Costs, slack: f64) -> usize {
    let n = costs.copy.len().min(costs.compute.len());
    let compute = costs.prefix + costs.compute[..n].iter().sum::<f64>();
    let meets = |kept: usize| {
        let rest: f64 = costs.copy[kept..n].iter().sum();
        let p = plan_groups_keeping(costs, Strategy::Pipelined, kept);
        p.predicted <= slack * f64::max(rest, compute) + 1e-12
    };
    if meets(0) {
        return 0;
    }
    // meets(hi) holds, meets(lo) does not.
    let (mut lo, mut hi) = (0, n);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if meets(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// The plans of every strategy for one set of costs and kept prefix,
/// kept until a cost or the prefix changes: the dynamic program is O(n³)
/// in units (milliseconds for the largest models), which must not land on
/// a switch.
#[derive(Debug, Default)]
pub struct PlanCache {
    plans: std::collections::HashMap<(Strategy, usize), GroupPlan>,
}

impl PlanCache {
    /// The kept plan for `strategy` with `kept` units on the device, or
    /// one cut now from `costs` (not kept).
    pub fn get(&self, strategy: Strategy, kept: usize, costs: impl FnOnce() -> Costs) -> GroupPlan {
        match self.plans.get(&(strategy, kept)) {
            Some(p) => p.clone(),
            None => plan_groups_keeping(&costs(), strategy, kept),
        }
    }

    /// Cuts and keeps every strategy's plan for `kept` units on the
    /// device, unless kept already.
    pub fn fill(&mut self, costs: &Costs, kept: usize) {
        for &s in &Strategy::ALL {
            self.plans
                .entry((s, kept))
                .or_insert_with(|| plan_groups_keeping(costs, s, kept));
        }
    }

    /// A cost changed: the kept plans are stale.
    pub fn invalidate(&mut self) {
        self.plans.clear();
    }
}

/// Per-unit compute times of one iteration, taken at unit boundaries.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Profile {
    /// Seconds of compute per unit.
    pub compute: Vec<f64>,
    /// Seconds before the first unit.
    pub prefix: f64,
}

/// Takes a host clock reading at each unit boundary of a running iteration
/// (the CPU backend; the CUDA backend records events instead).
#[derive(Debug)]
pub struct UnitTimer {
    unit_of: Vec<Option<usize>>,
    current: Option<usize>,
    last: std::time::Instant,
    profile: Profile,
}

impl Profile {
    /// No compute measured yet, for `units` units.
    pub fn zeros(units: usize) -> Self {
        Profile {
            compute: vec![0.0; units],
            prefix: 0.0,
        }
    }
}

impl UnitTimer {
    pub fn new(layout: &Layout) -> Self {
        UnitTimer {
            unit_of: layout.unit_of_position(),
            current: None,
            last: std::time::Instant::now(),
            profile: Profile::zeros(layout.units.len()),
        }
    }

    /// Called before the node at `pos` (and with the order's length at the end).
    pub fn at(&mut self, pos: usize) {
        let unit = self.unit_of.get(pos).copied().unwrap_or(self.current);
        if pos < self.unit_of.len() && unit == self.current {
            return;
        }
        let now = std::time::Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64();
        match self.current {
            None => self.profile.prefix += dt,
            Some(u) => self.profile.compute[u] += dt,
        }
        self.last = now;
        self.current = unit;
    }

    pub fn finish(self) -> Profile {
        self.profile
    }
}

/// What one switch did, for logs and `lanes bench switch`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SwitchReport {
    pub strategy: Strategy,
    /// The compute replayed recorded segments (CUDA graphs) rather than
    /// launching op by op.
    pub replayed: bool,
    pub groups: usize,
    /// Persistent bytes copied in.
    pub bytes: u64,
    /// Persistent bytes that stayed on the device (a partial eviction's
    /// prefix: not copied).
    pub kept_bytes: u64,
    /// The plan's prediction, seconds.
    pub predicted: f64,
    /// The feeds crossed the link into the staging buffer while the host
    /// mapped the arena (CUDA; docs/switching.md, *Feeds staged*).
    pub feeds_staged: bool,
    /// Where the switch's time went, when asked for (`LANES_SWITCH_TRACE=1`,
    /// CUDA only).
    pub trace: Option<SwitchTrace>,
}

/// One switch step by step, milliseconds. Host times count from the call;
/// device times from an event recorded on the copy stream before the feeds
/// (so the two clocks differ by the host's work before that event).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SwitchTrace {
    /// Host: the Run checked and planned, before any mapping.
    pub host_checked_ms: f64,
    /// Host: the ephemeral part mapped (where the feeds land; after the
    /// own part's first group when the feeds were staged).
    pub host_ephemeral_ms: f64,
    /// Host: the feeds' copies enqueued (on the copy stream, before the
    /// weights).
    pub host_feeds_ms: f64,
    /// Host: the own part's first group mapped (while the feeds copy; its
    /// copy enqueued too when they were staged).
    pub host_mapped_ms: f64,
    /// Host: each group's copy enqueued (its memory mapped first).
    pub host_enqueued_ms: Vec<f64>,
    /// Host: the compute launched (segments or nodes).
    pub host_launched_ms: f64,
    /// Host: the outputs on the host.
    pub host_done_ms: f64,
    /// Device: the feeds in.
    pub feeds_in_ms: f64,
    /// Device: each group's copy done.
    pub copy_done_ms: Vec<f64>,
    /// Device: the prefix's and each group's segment done (replayed
    /// switches only).
    pub compute_done_ms: Vec<f64>,
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_assert, proptest};

    fn costs(copy: Vec<f64>, compute: Vec<f64>, o: f64) -> Costs {
        Costs {
            copy,
            compute,
            prefix: 0.0,
            copy_overhead: o,
            compute_overhead: o,
        }
    }

    /// Every way to cut n units into contiguous groups.
    fn all_cuts(n: usize) -> Vec<Vec<usize>> {
        (0..1u32 << (n - 1))
            .map(|mask| {
                let mut s = vec![0];
                s.extend((1..n).filter(|i| mask & (1 << (i - 1)) != 0));
                s
            })
            .collect()
    }

    #[test]
    fn hand_worked_pipeline() {
        // Copies 2,2,2; computes 1,1,1; no overheads.
        let c = costs(vec![2.0; 3], vec![1.0; 3], 0.0);
        assert_eq!(predict(&c, &[0]), 6.0 + 3.0);
        assert_eq!(predict(&c, &[0, 1, 2]), 7.0);
        let p = plan_groups(&c, Strategy::Pipelined);
        assert_eq!(p.predicted, 7.0);
        // With a large per-group cost one group is best.
        let c = costs(vec![2.0; 3], vec![1.0; 3], 10.0);
        assert_eq!(plan_groups(&c, Strategy::Pipelined).starts, vec![0]);
    }

    proptest! {
        #[test]
        fn dynamic_program_matches_exhaustive_search(
            units in proptest::collection::vec((0.0f64..5.0, 0.0f64..5.0), 1..9),
            o in 0.0f64..2.0,
            prefix in 0.0f64..3.0,
        ) {
            let mut c = costs(
                units.iter().map(|u| u.0).collect(),
                units.iter().map(|u| u.1).collect(),
                o,
            );
            c.prefix = prefix;
            let best = all_cuts(units.len())
                .iter()
                .map(|s| predict(&c, s))
                .fold(f64::INFINITY, f64::min);
            let p = plan_groups(&c, Strategy::Pipelined);
            prop_assert!((p.predicted - best).abs() < 1e-9, "dp {} vs {}", p.predicted, best);
            prop_assert!((predict(&c, &p.starts) - p.predicted).abs() < 1e-12);
            prop_assert!(p.predicted <= plan_groups(&c, Strategy::Single).predicted + 1e-12);
            prop_assert!(p.predicted <= plan_groups(&c, Strategy::PerLayer).predicted + 1e-12);
            // Never below either resource's own total.
            let copy: f64 = c.copy.iter().sum();
            let work: f64 = c.compute.iter().sum();
            prop_assert!(p.predicted + 1e-9 >= f64::max(copy, prefix + work));
        }
    }

    /// Partial eviction: the kept units are the first group, copy nothing
    /// and wait for no copy, however costly their copy would be.
    #[test]
    fn kept_units_cost_no_copy() {
        // Copies 100,2,2; computes 1,1,1; no overheads.
        let c = costs(vec![100.0, 2.0, 2.0], vec![1.0; 3], 0.0);
        for s in Strategy::ALL {
            let p = plan_groups_keeping(&c, s, 1);
            assert_eq!(p.kept, 1);
            assert_eq!(&p.starts[..2], &[0, 1], "{s}");
            assert!(!p.copies(0) && p.copies(1));
            assert_eq!(p.copied_groups(), p.groups() - 1);
            assert!(p.predicted < 10.0, "{s}: {}", p.predicted);
        }
        // Unit 0 computes (0..1) while unit 1 copies (0..2); 1 computes
        // (2..3) while 2 copies (2..4); 2 computes (4..5).
        assert_eq!(
            plan_groups_keeping(&c, Strategy::PerLayer, 1).predicted,
            5.0
        );
        // Single: units 1..3 copy in one group (0..4), then compute 2.
        assert_eq!(plan_groups_keeping(&c, Strategy::Single, 1).predicted, 6.0);
        // Kept whole: the compute alone.
        let all = plan_groups_keeping(&c, Strategy::Pipelined, 3);
        assert_eq!((all.starts.clone(), all.predicted), (vec![0], 3.0));
        // Nothing kept is the ordinary plan.
        assert_eq!(
            plan_groups_keeping(&c, Strategy::Pipelined, 0),
            plan_groups(&c, Strategy::Pipelined)
        );
    }

    /// `auto`: copy and compute equal, so the pipeline's fill is the loss;
    /// the smallest prefix that brings the prediction within 2 % of the
    /// bound with it resident.
    #[test]
    fn auto_keep_is_the_smallest_prefix_that_meets_the_target() {
        let c = costs(vec![1.0; 10], vec![1.0; 10], 0.0);
        let k = auto_keep(&c, 1.02);
        let meets = |kept: usize| {
            let rest: f64 = c.copy[kept..].iter().sum();
            plan_groups_keeping(&c, Strategy::Pipelined, kept).predicted
                <= 1.02 * f64::max(rest, 10.0) + 1e-12
        };
        assert!(k > 0 && meets(k), "{k}");
        assert!((0..k).all(|j| !meets(j)), "{k}");
        // Copy far below compute: no fill worth keeping anything for.
        let c = costs(vec![0.0; 10], vec![1.0; 10], 0.0);
        assert_eq!(auto_keep(&c, 1.02), 0);
    }

    proptest! {
        #[test]
        fn kept_plans_match_exhaustive_search(
            units in proptest::collection::vec((0.0f64..5.0, 0.0f64..5.0), 2..8),
            o in 0.0f64..2.0,
            kept_at in 0.0f64..1.0,
        ) {
            let c = costs(
                units.iter().map(|u| u.0).collect(),
                units.iter().map(|u| u.1).collect(),
                o,
            );
            let n = units.len();
            let kept = ((n as f64 * kept_at) as usize).min(n - 1);
            // Every cut of the rest, the kept prefix its own group.
            let best = all_cuts(n - kept)
                .iter()
                .map(|s| {
                    let starts: Vec<usize> = (kept > 0)
                        .then_some(0)
                        .into_iter()
                        .chain(s.iter().map(|i| i + kept))
                        .collect();
                    predict_keeping(&c, &starts, kept)
                })
                .fold(f64::INFINITY, f64::min);
            let p = plan_groups_keeping(&c, Strategy::Pipelined, kept);
            prop_assert!((p.predicted - best).abs() < 1e-9, "dp {} vs {}", p.predicted, best);
            // Never below the compute, nor the rest's copy.
            let rest: f64 = c.copy[kept..].iter().sum();
            let work: f64 = c.compute.iter().sum();
            prop_assert!(p.predicted + 1e-9 >= f64::max(rest, work));
            // Keeping more never predicts a slower switch than keeping none.
            prop_assert!(p.predicted <= plan_groups(&c, Strategy::Pipelined).predicted + 1e-9);
        }
    }

    #[test]
    fn layout_orders_weights_by_first_use() {
        use lanes_adaptor::{validate, GraphBuilder, GraphLimits, Tensor, TensorType};
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2, 3]));
        // Declared in reverse of use: w2 first.
        let w2 = g.variable("w2", Tensor::from_f32([4, 2], vec![0.0; 8]).unwrap());
        let w1 = g.variable("w1", Tensor::from_f32([3, 4], vec![0.0; 12]).unwrap());
        let b1 = g.variable("b1", Tensor::from_f32([4], vec![0.0; 4]).unwrap());
        let h = g.matmul(x, w1);
        let h = g.add(h, b1);
        let h = g.relu(h);
        let y = g.matmul(h, w2);
        g.set_name(y, "y");
        let (graph, _) = g.finish().unwrap();
        let valid = validate(graph, &GraphLimits::default()).unwrap();
        let l = Layout::of(&valid);
        let names = |u: &Unit| -> Vec<String> {
            u.tensors
                .iter()
                .map(|id| valid.graph().nodes[id.index()].name.clone())
                .collect()
        };
        assert_eq!(l.units.len(), 3);
        assert_eq!(names(&l.units[0]), vec!["w1"]);
        assert_eq!(names(&l.units[1]), vec!["b1"]);
        assert_eq!(names(&l.units[2]), vec!["w2"]);
        assert_eq!(l.bytes(), (12 + 4 + 8) * 4);
        assert!(l.units.windows(2).all(|w| w[0].first_use < w[1].first_use));
        let of = l.unit_of_position();
        assert_eq!(of[l.units[1].first_use], Some(1));
        assert_eq!(of.last().copied().flatten(), Some(2));
    }
}
