//! Where the simulator puts admitted jobs.
//!
//! [`LanePlacement::Policy`] (the default) splits the memory into equal
//! lanes and lets the policy choose ([`lanes_policies::Policy::place`],
//! first fit unless the policy says otherwise). [`LanePlacement::Service`]
//! runs a copy of the service's lane manager ([`ServicePlacement`]): lanes
//! opened, grown and re-partitioned inside one reservation exactly as
//! `lanes serve --max-lanes N` does, so a simulation of a replay against a
//! service places jobs as the service did.

use lanes_policies::JobId;

use crate::lanes::{Admission, AdmitError, LaneManager, LanesConfig};

/// How the simulator places admitted jobs (`lanes simulate --placement`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LanePlacement {
    /// Equal lanes, the policy's [`lanes_policies::Policy::place`].
    #[default]
    Policy,
    /// The service's lane manager over the whole memory, at most `lanes`
    /// lanes open.
    Service,
}

impl std::str::FromStr for LanePlacement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "policy" | "equal-lanes" => Ok(LanePlacement::Policy),
            "service" => Ok(LanePlacement::Service),
            other => Err(format!(
                "placement {other:?}: expected policy (= equal-lanes) or service"
            )),
        }
    }
}

/// A copy of the service's lane manager that hands out the simulator's
/// lane slots: each lane the manager opens takes a free slot (the lowest)
/// until it closes. The manager's own queue is never used: a job that does
/// not fit is taken out again and the simulator retries it, in the
/// policy's admission order, whenever memory is freed.
#[derive(Debug)]
pub struct ServicePlacement {
    manager: LaneManager,
    slots: Vec<Option<crate::lanes::LaneId>>,
}

impl ServicePlacement {
    /// `memory` bytes, at most `lanes` lanes, the service's alignment.
    pub fn new(memory: u64, lanes: usize) -> Result<Self, AdmitError> {
        let cfg = LanesConfig {
            max_lanes: lanes,
            ..LanesConfig::new(memory)
        };
        Ok(ServicePlacement {
            manager: LaneManager::new(cfg)?,
            slots: vec![None; lanes],
        })
    }

    /// The slot of the lane `job` (P `p`, T `t`) is admitted into now, or
    /// `None` when it does not fit yet.
    pub fn admit(&mut self, job: JobId, p: u64, t: u64) -> Result<Option<usize>, AdmitError> {
        let id = crate::lanes::JobId(job);
        match self.manager.admit(id, p, t)? {
            Admission::Admitted { placement, .. } => {
                if let Some(s) = self.slots.iter().position(|&s| s == Some(placement.lane)) {
                    return Ok(Some(s));
                }
                // At most `lanes` lanes are open, so a slot is free.
                let free = self.slots.iter().position(Option::is_none);
                if let Some(s) = free {
                    self.slots[s] = Some(placement.lane);
                }
                Ok(free)
            }
            Admission::Queued { .. } => {
                self.manager.release(id)?;
                Ok(None)
            }
        }
    }

    /// `job` finished: its memory is freed, an empty lane closes.
    pub fn release(&mut self, job: JobId) -> Result<(), AdmitError> {
        let released = self.manager.release(crate::lanes::JobId(job))?;
        for lane in released.closed {
            for s in &mut self.slots {
                if *s == Some(lane) {
                    *s = None;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn opens_a_lane_per_job_then_grows_and_frees_slots() {
        let mut s = ServicePlacement::new(100 * MIB, 2).unwrap();
        // The first two jobs get a lane each (a lane is sized to its
        // first job), the third joins one of them.
        assert_eq!(s.admit(1, 10 * MIB, 0).unwrap(), Some(0));
        assert_eq!(s.admit(2, 10 * MIB, 0).unwrap(), Some(1));
        assert!(s.admit(3, 10 * MIB, 0).unwrap().is_some());
        // Too large for what is left: not admitted, and not queued either.
        assert_eq!(s.admit(4, 95 * MIB, 0).unwrap(), None);
        assert_eq!(s.admit(4, 95 * MIB, 0).unwrap(), None);
        s.release(1).unwrap();
        s.release(2).unwrap();
        s.release(3).unwrap();
        // Everything closed: the big job fits now, in the lowest slot.
        assert_eq!(s.admit(4, 95 * MIB, 0).unwrap(), Some(0));
        assert_eq!("service".parse(), Ok(LanePlacement::Service));
        assert_eq!("equal-lanes".parse(), Ok(LanePlacement::Policy));
        assert!("best".parse::<LanePlacement>().is_err());
    }
}
