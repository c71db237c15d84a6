//! Property tests of the lane manager: random arrivals and departures with
//! random P and T, checked after every step against an independent model.
//!
//! - no two live regions overlap (persistent regions, lane arenas, lanes),
//!   and every job's persistent bytes survive every relocation;
//! - every lane satisfies `sum P + max T <= capacity`;
//! - nothing lies outside the reservation;
//! - a waiting job never fits, even after re-partitioning (so every job
//!   that could fit is admitted), and once everyone leaves, every waiting
//!   job has been admitted;
//! - a job larger than the reservation is refused at once;
//! - jobs of two classes (`Ask::class`) never share a lane, and each class
//!   has at most `max_lanes` lanes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use lanes::lanes::{
    Admission, AdmitError, Ask, JobId, LaneClass, LaneManager, LanesConfig, LanesSnapshot,
    Placement, Reservation,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const ALIGN: u64 = 256;

#[derive(Debug, Clone)]
enum Step {
    /// P and T in bytes (not aligned: the manager rounds up), and the
    /// job's class of lanes.
    Arrive { p: u64, t: u64, class: LaneClass },
    /// Index into the jobs currently known (admitted or waiting).
    Depart { pick: usize },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u64..24 * ALIGN, 0u64..40 * ALIGN, prop_oneof![3 => Just(0), 1 => Just(1)])
            .prop_map(|(p, t, class)| Step::Arrive { p, t, class }),
        2 => any::<usize>().prop_map(|pick| Step::Depart { pick }),
    ]
}

fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

fn pattern(job: JobId) -> u8 {
    (job.0 % 251) as u8 + 1
}

struct Model {
    cfg: LanesConfig,
    mgr: LaneManager,
    mem: Reservation,
    /// Known jobs: aligned (P, T).
    jobs: BTreeMap<JobId, (u64, u64)>,
    /// Their classes.
    classes: BTreeMap<JobId, LaneClass>,
    /// Jobs that waited and have not been admitted or cancelled yet.
    waiting: BTreeSet<JobId>,
    waited_then_admitted: usize,
}

impl Model {
    fn fill(&mut self, p: &Placement) {
        self.mem
            .region_mut(p.p_offset, p.p_bytes)
            .unwrap()
            .fill(pattern(p.job));
    }

    fn arrive(&mut self, job: JobId, p: u64, t: u64, class: LaneClass) {
        let (ap, mut at) = (align(p), align(t));
        if ap == 0 && at == 0 {
            at = ALIGN;
        }
        self.classes.insert(job, class);
        let ask = Ask {
            rank: Default::default(),
            class,
        };
        match self.mgr.admit_asking(job, p, t, ask) {
            Err(AdmitError::TooLarge {
                needed, available, ..
            }) => {
                assert!(
                    ap + at > self.cfg.capacity,
                    "refused a job that fits: {p} {t}"
                );
                assert_eq!((needed, available), (ap + at, self.cfg.capacity));
            }
            Err(e) => panic!("unexpected error {e}"),
            Ok(Admission::Admitted { placement, moves }) => {
                assert!(ap + at <= self.cfg.capacity);
                self.mem.apply_moves(&moves).unwrap();
                self.fill(&placement);
                self.jobs.insert(job, (ap, at));
            }
            Ok(Admission::Queued { reason, .. }) => {
                assert_eq!(reason.needed, ap + at);
                self.jobs.insert(job, (ap, at));
                self.waiting.insert(job);
            }
        }
    }

    fn depart(&mut self, job: JobId) {
        let r = self.mgr.release(job).unwrap();
        assert_eq!(r.was_queued, self.waiting.remove(&job));
        self.jobs.remove(&job);
        self.mem.apply_moves(&r.moves).unwrap();
        for p in &r.admitted {
            assert!(
                self.waiting.remove(&p.job),
                "{:?} admitted but was not waiting",
                p.job
            );
            self.waited_then_admitted += 1;
            self.fill(p);
        }
    }

    /// Every invariant, from the snapshot, with code independent of the manager's.
    fn check(&self) {
        let s: LanesSnapshot = self.mgr.snapshot();
        let cap = self.cfg.capacity;
        let mut seen = BTreeSet::new();
        let mut prev_end = 0;
        let mut used_total = 0;
        let mut lane_class = Vec::new();
        for l in &s.lanes {
            let class = self.classes[&l.jobs[0].job];
            assert_eq!(l.class, class, "the lane shows another class: {s}");
            assert!(
                l.jobs.iter().all(|j| self.classes[&j.job] == class),
                "a lane holds jobs of two classes: {s}"
            );
            lane_class.push(class);
            assert!(l.start >= prev_end, "lanes overlap or are unsorted: {s}");
            assert!(l.start % ALIGN == 0 && l.capacity % ALIGN == 0);
            prev_end = l.start + l.capacity;
            assert!(prev_end <= cap, "lane outside the reservation: {s}");
            assert!(!l.jobs.is_empty(), "an empty lane stays open: {s}");
            let p_sum: u64 = l.jobs.iter().map(|j| j.p).sum();
            let max_t = l.jobs.iter().map(|j| j.t).max().unwrap_or(0);
            assert_eq!(l.used, p_sum + max_t);
            assert!(p_sum + max_t <= l.capacity, "safety condition broken: {s}");
            assert_eq!((l.arena_offset, l.arena_bytes), (l.start + p_sum, max_t));
            used_total += l.used;
            let mut cursor = l.start;
            for j in &l.jobs {
                assert_eq!(j.p_offset, cursor, "persistent regions not side by side");
                cursor += j.p;
                assert_eq!(self.jobs.get(&j.job), Some(&(j.p, j.t)));
                assert!(seen.insert(j.job), "job in two places");
                assert!(!self.waiting.contains(&j.job));
                let bytes = self.mem.region(j.p_offset, j.p).unwrap();
                assert!(
                    bytes.iter().all(|&b| b == pattern(j.job)),
                    "{:?} lost its persistent bytes",
                    j.job
                );
            }
        }
        for class in [0, 1] {
            let n = lane_class.iter().filter(|&&c| c == class).count();
            assert!(n <= self.cfg.max_lanes, "{n} lanes of class {class}: {s}");
        }
        let free = cap - used_total;
        for q in &s.queue {
            let class = self.classes[&q.job];
            let of_class = lane_class.iter().filter(|&&c| c == class).count();
            assert!(seen.insert(q.job), "job in two places");
            assert!(self.waiting.contains(&q.job));
            assert_eq!(self.jobs.get(&q.job), Some(&(q.p, q.t)));
            let new_lane = of_class < self.cfg.max_lanes && q.p + q.t <= free;
            let join = s
                .lanes
                .iter()
                .zip(&lane_class)
                .filter(|(_, &c)| c == class)
                .any(|(l, _)| {
                    let max_t = l.jobs.iter().map(|j| j.t).max().unwrap_or(0);
                    q.p + max_t.max(q.t) - max_t <= free
                });
            assert!(
                !new_lane && !join,
                "{:?} waits but fits after re-partitioning: {s}",
                q.job
            );
            assert_eq!(q.reason.free_after_repartition, free);
        }
        assert_eq!(seen.len(), self.jobs.len(), "a job was lost");
        let in_gaps = cap - s.lanes.iter().map(|l| l.capacity).sum::<u64>();
        assert_eq!(s.free, in_gaps);
        assert!(s.largest_free <= s.free);
        assert!((0.0..=1.0).contains(&s.fragmentation));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn random_arrivals_and_departures(
        units in 16u64..96,
        max_lanes in 1usize..6,
        steps in prop::collection::vec(step(), 1..120),
        exit_order in any::<u64>(),
    ) {
        let cfg = LanesConfig { capacity: units * ALIGN, alignment: ALIGN, max_lanes };
        let mut m = Model {
            cfg,
            mgr: LaneManager::new(cfg).unwrap(),
            mem: Reservation::new(cfg.capacity).unwrap(),
            jobs: BTreeMap::new(),
            classes: BTreeMap::new(),
            waiting: BTreeSet::new(),
            waited_then_admitted: 0,
        };
        let mut next = 0u64;
        for s in steps {
            match s {
                Step::Arrive { p, t, class } => {
                    next += 1;
                    m.arrive(JobId(next), p, t, class);
                }
                Step::Depart { pick } => {
                    if !m.jobs.is_empty() {
                        let job = *m.jobs.keys().nth(pick % m.jobs.len()).unwrap();
                        m.depart(job);
                    }
                }
            }
            m.check();
        }
        // Everyone leaves, in a scrambled order: every waiting job gets in first.
        let mut rot = exit_order;
        while !m.jobs.is_empty() {
            let admitted: Vec<JobId> = m.jobs.keys().copied().filter(|j| !m.waiting.contains(j)).collect();
            prop_assert!(!admitted.is_empty(), "jobs wait while no job holds memory");
            let job = admitted[(rot % admitted.len() as u64) as usize];
            rot = rot.rotate_left(7) ^ 0x9e37_79b9;
            m.depart(job);
            m.check();
        }
        prop_assert!(m.waiting.is_empty());
        let s = m.mgr.snapshot();
        prop_assert!(s.lanes.is_empty() && s.queue.is_empty());
        prop_assert_eq!(s.free, cfg.capacity);
    }
}

#[test]
fn some_sequences_do_wait() {
    // A guard that the property above exercises the queue: a fixed sequence
    // where jobs must wait and are admitted later.
    let cfg = LanesConfig {
        capacity: 8 * ALIGN,
        alignment: ALIGN,
        max_lanes: 2,
    };
    let mut m = Model {
        cfg,
        mgr: LaneManager::new(cfg).unwrap(),
        mem: Reservation::new(cfg.capacity).unwrap(),
        jobs: BTreeMap::new(),
        classes: BTreeMap::new(),
        waiting: BTreeSet::new(),
        waited_then_admitted: 0,
    };
    for j in 1..=6 {
        m.arrive(JobId(j), 2 * ALIGN, 2 * ALIGN, 0);
        m.check();
    }
    assert_eq!(m.waiting.len(), 4);
    for j in 1..=6 {
        if !m.waiting.contains(&JobId(j)) {
            m.depart(JobId(j));
            m.check();
        }
    }
    while let Some(&j) = m.jobs.keys().next() {
        m.depart(j);
        m.check();
    }
    assert_eq!(m.waited_then_admitted, 4);
}
