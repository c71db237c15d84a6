//! Requests of jobs that wait for admission. A service loop that must not
//! block parks a waiting job's Runs here and takes them back when a
//! release admits the job ([`Released::admitted`]), or when the job goes
//! away (to answer them with an error).

use std::collections::HashMap;

use super::manager::{JobId, Released};

/// Parked requests per waiting job, in arrival order.
#[derive(Debug)]
pub struct Parked<R> {
    by_job: HashMap<JobId, Vec<R>>,
    limit: usize,
}

/// The job already has `limit` requests parked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{job} already has {limit} requests waiting for admission")]
pub struct ParkFull {
    pub job: JobId,
    pub limit: usize,
}

impl<R> Parked<R> {
    /// At most `limit` requests per job (a bound on what a client can make
    /// the service hold).
    pub fn new(limit: usize) -> Self {
        Parked {
            by_job: HashMap::new(),
            limit,
        }
    }

    /// Parks `req` behind `job`'s earlier ones; gives it back when full.
    pub fn park(&mut self, job: JobId, req: R) -> Result<(), (ParkFull, R)> {
        let q = self.by_job.entry(job).or_default();
        if q.len() >= self.limit {
            return Err((
                ParkFull {
                    job,
                    limit: self.limit,
                },
                req,
            ));
        }
        q.push(req);
        Ok(())
    }

    /// Requests of the jobs a release admitted, job by job in admission order.
    pub fn admitted(&mut self, released: &Released) -> Vec<(JobId, Vec<R>)> {
        released
            .admitted
            .iter()
            .filter_map(|p| self.by_job.remove(&p.job).map(|v| (p.job, v)))
            .collect()
    }

    /// Takes all of `job`'s requests (it was admitted, or it went away).
    pub fn take(&mut self, job: JobId) -> Vec<R> {
        self.by_job.remove(&job).unwrap_or_default()
    }

    /// Requests parked in total.
    pub fn len(&self) -> usize {
        self.by_job.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_job.values().all(Vec::is_empty)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::lanes::{Admission, LaneManager, LanesConfig};

    #[test]
    fn runs_of_a_waiting_job_come_back_when_it_is_admitted() {
        let mut m = LaneManager::new(LanesConfig {
            capacity: 1000,
            alignment: 1,
            max_lanes: 1,
        })
        .unwrap();
        let mut parked = Parked::new(2);
        m.admit(JobId(1), 500, 500).unwrap();
        assert!(matches!(
            m.admit(JobId(2), 500, 500).unwrap(),
            Admission::Queued { .. }
        ));
        parked.park(JobId(2), "run a").unwrap();
        parked.park(JobId(2), "run b").unwrap();
        let (full, back) = parked.park(JobId(2), "run c").unwrap_err();
        assert_eq!((full.limit, back), (2, "run c"));
        assert_eq!(parked.len(), 2);
        let r = m.release(JobId(1)).unwrap();
        assert_eq!(
            parked.admitted(&r),
            vec![(JobId(2), vec!["run a", "run b"])]
        );
        assert!(parked.is_empty());
        assert!(parked.take(JobId(2)).is_empty());
    }
}
