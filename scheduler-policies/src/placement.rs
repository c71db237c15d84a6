//! Lanes as placement sees them, the safety condition, and the two placement
//! rules the policies use.

use crate::job::{JobSpec, LaneId};

/// A lane's memory state: capacity `C`, the sum of its jobs' persistent bytes
/// and the largest ephemeral need among them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneView {
    /// Lane index.
    pub id: LaneId,
    /// Capacity C in bytes.
    pub capacity: u64,
    /// `sum P` of the jobs already in the lane.
    pub persistent_sum: u64,
    /// `max T` of the jobs already in the lane (0 when empty).
    pub max_ephemeral: u64,
    /// Number of jobs in the lane.
    pub jobs: usize,
}

impl LaneView {
    /// An empty lane.
    pub fn empty(id: LaneId, capacity: u64) -> Self {
        LaneView {
            id,
            capacity,
            persistent_sum: 0,
            max_ephemeral: 0,
            jobs: 0,
        }
    }

    /// Bytes the lane would need with `job` added: `sum P + P + max(max T, T)`
    /// (saturating, so absurd sizes never fit rather than wrap).
    pub fn need_with(&self, job: &JobSpec) -> u64 {
        self.persistent_sum
            .saturating_add(job.persistent_bytes)
            .saturating_add(self.max_ephemeral.max(job.ephemeral_bytes))
    }

    /// The safety condition: `sum P + max T <= C` still holds with `job` added.
    pub fn fits(&self, job: &JobSpec) -> bool {
        self.need_with(job) <= self.capacity
    }
}

/// The lowest-numbered lane where the job fits.
pub fn first_fit(job: &JobSpec, lanes: &[LaneView]) -> Option<LaneId> {
    lanes.iter().find(|l| l.fits(job)).map(|l| l.id)
}

/// Packing placement: an empty lane where the job fits comes first (so that as
/// many lanes as possible run concurrently); otherwise the lane that is left
/// with the fewest free bytes (best fit), which keeps large holes for large
/// jobs. Ties go to the lower lane id.
pub fn best_fit(job: &JobSpec, lanes: &[LaneView]) -> Option<LaneId> {
    lanes
        .iter()
        .filter(|l| l.fits(job))
        .min_by_key(|l| (l.jobs != 0, l.capacity - l.need_with(job), l.id))
        .map(|l| l.id)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::job::JobKind;

    fn job(p: u64, t: u64) -> JobSpec {
        JobSpec::new(1, JobKind::Training, 1).with_memory(p, t)
    }

    #[test]
    fn safety_condition_counts_sum_p_plus_max_t() {
        let lane = LaneView {
            id: 0,
            capacity: 100,
            persistent_sum: 50,
            max_ephemeral: 20,
            jobs: 2,
        };
        assert!(lane.fits(&job(30, 20))); // 80 + 20
        assert!(lane.fits(&job(20, 30))); // 70 + 30
        assert!(!lane.fits(&job(31, 20)));
        assert!(!lane.fits(&job(20, 31)));
        assert!(!lane.fits(&job(u64::MAX, u64::MAX)));
    }

    #[test]
    fn first_fit_takes_lowest_and_best_fit_prefers_empty_then_tightest() {
        let lanes = [
            LaneView {
                id: 0,
                capacity: 100,
                persistent_sum: 10,
                max_ephemeral: 10,
                jobs: 1,
            },
            LaneView {
                id: 1,
                capacity: 100,
                persistent_sum: 60,
                max_ephemeral: 10,
                jobs: 1,
            },
            LaneView::empty(2, 100),
        ];
        let j = job(20, 10);
        assert_eq!(first_fit(&j, &lanes), Some(0));
        assert_eq!(best_fit(&j, &lanes), Some(2));
        assert_eq!(best_fit(&j, &lanes[..2]), Some(1));
        assert_eq!(first_fit(&job(95, 10), &lanes), None);
        assert_eq!(best_fit(&job(95, 10), &lanes), None);
    }
}
