//! The jobs waiting for memory, in the policy's admission order. After
//! memory is freed the engine needs the first waiting job, in that order,
//! that fits a lane (`sum P + P + max(max T, T) <= C`) without looking at
//! every one that does not.
//!
//! Jobs are split into classes by the bit length of their T (so within a
//! class T varies by less than a factor of two), and each class is a
//! segment tree over its jobs' places in the admission order whose nodes
//! keep the least P and the least P + T below them. For a lane whose
//! largest T is `M`, the jobs of a class whose T are all at most `M` fit
//! exactly when `sum P + P + M <= C`, and those whose T all exceed `M`
//! exactly when `sum P + P + T <= C`: both are tests on one minimum, so a
//! subtree is entered only if a job in it fits. Only in the class that
//! holds `M` itself is the test a necessary condition.

use lanes_policies::LaneView;

/// An empty node.
const NONE: u128 = u128::MAX;

/// A segment tree of (least P, least P + T) over one class's slots.
struct Tree {
    size: usize,
    min_p: Vec<u128>,
    min_pt: Vec<u128>,
}

impl Tree {
    fn new(slots: usize) -> Self {
        let size = slots.max(1).next_power_of_two();
        Tree {
            size,
            min_p: vec![NONE; 2 * size],
            min_pt: vec![NONE; 2 * size],
        }
    }

    fn set(&mut self, slot: usize, p: u128, pt: u128) {
        let mut n = self.size + slot;
        self.min_p[n] = p;
        self.min_pt[n] = pt;
        while n > 1 {
            n /= 2;
            self.min_p[n] = self.min_p[2 * n].min(self.min_p[2 * n + 1]);
            self.min_pt[n] = self.min_pt[2 * n].min(self.min_pt[2 * n + 1]);
        }
    }

    /// The first slot at or after `from` holding a job, in a subtree that
    /// passes `test(least P, least P + T)` at every level.
    fn next(&self, from: usize, test: &dyn Fn(u128, u128) -> bool) -> Option<usize> {
        self.descend(1, 0, self.size, from, test)
    }

    fn descend(
        &self,
        node: usize,
        lo: usize,
        hi: usize,
        from: usize,
        test: &dyn Fn(u128, u128) -> bool,
    ) -> Option<usize> {
        if hi <= from || self.min_p[node] == NONE || !test(self.min_p[node], self.min_pt[node]) {
            return None;
        }
        if hi - lo == 1 {
            return Some(lo);
        }
        let mid = lo + (hi - lo) / 2;
        self.descend(2 * node, lo, mid, from, test)
            .or_else(|| self.descend(2 * node + 1, mid, hi, from, test))
    }
}

/// Jobs whose T has one bit length.
struct Class {
    /// Least and greatest T of the class's range.
    t_lo: u64,
    t_hi: u64,
    /// Its jobs' places in the admission order, increasing.
    slots: Vec<usize>,
    tree: Tree,
}

/// Waiting jobs by their place in the admission order (a slot per job).
pub(super) struct Waiting {
    classes: Vec<Class>,
    /// Per slot: its class and its index in that class.
    place: Vec<(usize, usize)>,
}

impl Waiting {
    /// Room for one job per slot, `ephemeral[slot]` being its T; none
    /// waiting yet.
    pub(super) fn new(ephemeral: &[u64]) -> Self {
        let mut by_bits: Vec<Vec<usize>> = vec![Vec::new(); 65];
        for (slot, &t) in ephemeral.iter().enumerate() {
            by_bits[(64 - t.leading_zeros()) as usize].push(slot);
        }
        let mut classes = Vec::new();
        let mut place = vec![(0, 0); ephemeral.len()];
        for (bits, slots) in by_bits.into_iter().enumerate() {
            if slots.is_empty() {
                continue;
            }
            for (k, &slot) in slots.iter().enumerate() {
                place[slot] = (classes.len(), k);
            }
            let (t_lo, t_hi) = match bits {
                0 => (0, 0),
                b => (1u64 << (b - 1), u64::MAX >> (64 - b)),
            };
            classes.push(Class {
                t_lo,
                t_hi,
                tree: Tree::new(slots.len()),
                slots,
            });
        }
        Waiting { classes, place }
    }

    /// The job of `slot` (with P and T) waits.
    pub(super) fn insert(&mut self, slot: usize, persistent: u64, ephemeral: u64) {
        let (c, k) = self.place[slot];
        let p = u128::from(persistent);
        self.classes[c].tree.set(k, p, p + u128::from(ephemeral));
    }

    /// The job of `slot` no longer waits.
    pub(super) fn remove(&mut self, slot: usize) {
        let (c, k) = self.place[slot];
        self.classes[c].tree.set(k, NONE, NONE);
    }

    /// The first waiting slot at or after `from` whose job may fit one of
    /// `lanes` (exactly, except for jobs in the class of a lane's largest
    /// T; the caller checks the job itself).
    pub(super) fn next(&self, from: usize, lanes: &[LaneView]) -> Option<usize> {
        let sat = |x: u128| x.min(u128::from(u64::MAX));
        let mut best: Option<usize> = None;
        for class in &self.classes {
            let start = class.slots.partition_point(|&s| s < from);
            let test = |p: u128, pt: u128| {
                lanes.iter().any(|l| {
                    let sum = u128::from(l.persistent_sum);
                    let cap = u128::from(l.capacity);
                    let with_m = sat(sum + p + u128::from(l.max_ephemeral)) <= cap;
                    let with_t = sat(sum + pt) <= cap;
                    if class.t_hi <= l.max_ephemeral {
                        with_m
                    } else if class.t_lo > l.max_ephemeral {
                        with_t
                    } else {
                        with_m && with_t
                    }
                })
            };
            if let Some(k) = class.tree.next(start, &test) {
                let slot = class.slots[k];
                if best.is_none_or(|b| slot < b) {
                    best = Some(slot);
                }
            }
        }
        best
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn lane(sum: u64, max_t: u64) -> LaneView {
        LaneView {
            id: 0,
            capacity: 100,
            persistent_sum: sum,
            max_ephemeral: max_t,
            jobs: 1,
        }
    }

    #[test]
    fn finds_the_first_job_that_may_fit_in_order() {
        // Slots 0..5 with these T.
        let mut w = Waiting::new(&[10, 0, 80, 3, 5]);
        w.insert(0, 50, 10);
        w.insert(2, 10, 80);
        w.insert(4, 5, 5);
        // 60 free, 20 of them T: slot 0 needs 50 + 20, slot 2 10 + 80, slot 4 fits.
        assert_eq!(w.next(0, &[lane(40, 20)]), Some(4));
        // 100 free: slot 0 first, then 2.
        assert_eq!(w.next(0, &[lane(0, 0)]), Some(0));
        assert_eq!(w.next(1, &[lane(0, 0)]), Some(2));
        w.remove(4);
        assert_eq!(w.next(0, &[lane(40, 20)]), None);
        assert_eq!(w.next(5, &[lane(0, 0)]), None);
        // Another lane with room makes slot 0 fit there.
        assert_eq!(w.next(0, &[lane(40, 20), lane(0, 40)]), Some(0));
    }

    /// Against a plain scan on many random queues and lanes: the first
    /// slot found is never after the first job that fits.
    #[test]
    fn never_skips_a_job_that_fits() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..200 {
            let n = 1 + rnd(60) as usize;
            let jobs: Vec<(u64, u64)> = (0..n).map(|_| (rnd(60), rnd(70))).collect();
            let ts: Vec<u64> = jobs.iter().map(|j| j.1).collect();
            let mut w = Waiting::new(&ts);
            let mut live = vec![false; n];
            for (s, &(p, t)) in jobs.iter().enumerate() {
                if rnd(3) > 0 {
                    w.insert(s, p, t);
                    live[s] = true;
                }
            }
            let lanes = [lane(rnd(100), rnd(70)), lane(rnd(100), rnd(70))];
            let from = rnd(n as u64) as usize;
            let first_fit = (from..n).find(|&s| {
                live[s]
                    && lanes.iter().any(|l| {
                        l.persistent_sum + jobs[s].0 + l.max_ephemeral.max(jobs[s].1) <= 100
                    })
            });
            let found = w.next(from, &lanes);
            match (first_fit, found) {
                (Some(f), Some(g)) => assert!(g <= f && g >= from && live[g]),
                (Some(f), None) => panic!("skipped slot {f}"),
                (None, g) => assert!(g.is_none_or(|g| g >= from && live[g])),
            }
        }
    }
}
