//! Placement across the services of a host: one `lanes serve` per GPU
//! (`lanes host` starts them and writes a [`Directory`]), and a job that
//! does not name its GPU goes where it is admitted soonest.
//!
//! The rule is [`choose`], a pure function of the services' Status
//! reports: among the services where a job of P persistent and T
//! ephemeral bytes fits now, the least loaded; if it fits nowhere, the
//! one with the shortest admission queue; unreachable services are
//! skipped, and when none answers the error names each endpoint and why.
//! [`connect_best`] asks each service's Status and connects to the one
//! chosen. See docs/multi-gpu.md.
//!
//! "Fits now" is the client's forecast from the report's lanes (the
//! `lanes_json` view: each lane's capacity and its jobs' P and T, the
//! largest free range, the admission queue), under the service's safety
//! condition `sum P + max T <= C` per lane: the job fits an open lane if
//! that lane's jobs and it keep the condition, or a new lane if one more
//! may open and `P + T` (rounded up to the lanes' alignment) fits the
//! largest free range. The service's admission stays the authority: it
//! may also make room by evicting idle jobs or moving lanes (so a job the
//! forecast sends elsewhere might have fitted), and a service whose queue
//! is not empty is never counted as having room (its waiting jobs come
//! first). Without a size (`need` = `None`) a job is placed by load only.
//! This module reads the report's lanes view as data; it knows nothing of
//! how the service keeps its lanes.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::client::{Client, ClientOptions};
use crate::wire::StatusReport;

/// The services of one host, as `lanes host --directory FILE` writes them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Directory {
    pub services: Vec<ServiceEntry>,
}

/// One service of a [`Directory`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceEntry {
    /// The GPU's ordinal (or, for CPU services, the service's number).
    pub index: usize,
    /// The device as the service names it (`cuda:1 (NVIDIA H100 …)`, `cpu`).
    pub device: String,
    /// Where its clients connect.
    pub endpoint: String,
    /// Its Prometheus metrics address (`HOST:PORT`), if it serves them.
    #[serde(default)]
    pub metrics: Option<String>,
    /// Its process id.
    #[serde(default)]
    pub pid: Option<u32>,
    /// False once the launcher has seen it exit.
    #[serde(default = "yes")]
    pub running: bool,
}

fn yes() -> bool {
    true
}

impl Directory {
    /// Reads a directory file.
    pub fn read(path: &Path) -> Result<Directory, PlacementError> {
        let fail = |reason: String| PlacementError::Directory {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
        serde_json::from_str(&text).map_err(|e| fail(e.to_string()))
    }

    /// The endpoints of the services still running, in the file's order.
    pub fn endpoints(&self) -> Vec<String> {
        self.services
            .iter()
            .filter(|s| s.running)
            .map(|s| s.endpoint.clone())
            .collect()
    }
}

/// What a job needs: P persistent and T ephemeral bytes (what the
/// service's memory plan reports when the graph is loaded,
/// `GraphLoaded`'s `persistent_bytes` and `ephemeral_bytes`; a caller
/// that has not loaded the graph anywhere yet passes an estimate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobSize {
    pub persistent: u64,
    pub ephemeral: u64,
}

/// The service chosen, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// Its position in the endpoints given.
    pub index: usize,
    pub endpoint: String,
    /// Whether the job fits there now (else it had the shortest queue).
    pub fits_now: bool,
    /// The lanes' memory in use there, as a fraction of their capacity.
    pub load: f64,
    /// Jobs waiting for memory there.
    pub queue: usize,
}

/// Why no service was chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("no endpoints to place the job on")]
    NoEndpoints,
    #[error("no service reachable: {}", list(.0))]
    NoneReachable(Vec<(String, String)>),
    #[error("directory {path}: {reason}")]
    Directory { path: String, reason: String },
}

fn list(failures: &[(String, String)]) -> String {
    failures
        .iter()
        .map(|(e, why)| format!("{e} ({why})"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The part of the report's lanes JSON placement reads (unknown fields
/// are ignored, missing ones are empty).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct LanesView {
    capacity: u64,
    alignment: u64,
    max_lanes: usize,
    lanes: Vec<LaneView>,
    queue: Vec<serde_json::Value>,
    largest_free: u64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct LaneView {
    capacity: u64,
    used: u64,
    jobs: Vec<JobView>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct JobView {
    p: u64,
    t: u64,
}

/// What placement knows of one service.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Room {
    fits: bool,
    load: f64,
    queue: usize,
    sessions: usize,
}

fn room(report: &StatusReport, need: Option<JobSize>) -> Room {
    let sessions = report.sessions.len();
    let view = report
        .lanes_json
        .as_deref()
        .and_then(|j| serde_json::from_str::<LanesView>(j).ok());
    // No lanes (`--memory none`): no admission, every job is loaded.
    let Some(v) = view else {
        return Room {
            fits: true,
            load: 0.0,
            queue: 0,
            sessions,
        };
    };
    let used: u64 = v.lanes.iter().map(|l| l.used).sum();
    let load = if v.capacity == 0 {
        1.0
    } else {
        used as f64 / v.capacity as f64
    };
    let fits = v.queue.is_empty()
        && match need {
            None => true,
            Some(n) => {
                let in_lane = v.lanes.iter().any(|l| {
                    let sum_p: u64 = l.jobs.iter().map(|j| j.p).sum();
                    let max_t = l.jobs.iter().map(|j| j.t).max().unwrap_or(0);
                    sum_p
                        .saturating_add(n.persistent)
                        .saturating_add(max_t.max(n.ephemeral))
                        <= l.capacity
                });
                let whole = n.persistent.saturating_add(n.ephemeral);
                let aligned = match v.alignment {
                    0 | 1 => whole,
                    a => whole.div_ceil(a).saturating_mul(a),
                };
                let new_lane = v.lanes.len() < v.max_lanes && aligned <= v.largest_free;
                in_lane || new_lane
            }
        };
    Room {
        fits,
        load,
        queue: v.queue.len(),
        sessions,
    }
}

/// The placement rule over the services' reports (`Err`: why a service
/// could not be asked). Ties go to fewer sessions, then to the earlier
/// endpoint.
pub fn choose(
    seen: &[(String, Result<StatusReport, String>)],
    need: Option<JobSize>,
) -> Result<Placement, PlacementError> {
    if seen.is_empty() {
        return Err(PlacementError::NoEndpoints);
    }
    let rooms: Vec<(usize, Room)> = seen
        .iter()
        .enumerate()
        .filter_map(|(i, (_, r))| r.as_ref().ok().map(|s| (i, room(s, need))))
        .collect();
    if rooms.is_empty() {
        return Err(PlacementError::NoneReachable(
            seen.iter()
                .map(|(e, r)| (e.clone(), r.as_ref().err().cloned().unwrap_or_default()))
                .collect(),
        ));
    }
    let by_load = |a: &(usize, Room), b: &(usize, Room)| {
        a.1.load
            .total_cmp(&b.1.load)
            .then(a.1.sessions.cmp(&b.1.sessions))
            .then(a.0.cmp(&b.0))
    };
    let fitting = rooms
        .iter()
        .filter(|(_, r)| r.fits)
        .min_by(|a, b| by_load(a, b));
    let best = fitting.or_else(|| {
        rooms
            .iter()
            .min_by(|a, b| a.1.queue.cmp(&b.1.queue).then_with(|| by_load(a, b)))
    });
    let Some(&(index, r)) = best else {
        return Err(PlacementError::NoEndpoints);
    };
    Ok(Placement {
        index,
        endpoint: seen[index].0.clone(),
        fits_now: r.fits,
        load: r.load,
        queue: r.queue,
    })
}

/// An endpoint and what asking it gave: a connected client and its
/// Status report, or why not.
pub type Surveyed = (String, Result<(Client, StatusReport), String>);

/// Asks each endpoint's Status (a connection each, with `options`).
pub fn survey(endpoints: &[String], options: &ClientOptions) -> Vec<Surveyed> {
    endpoints
        .iter()
        .map(|e| {
            let r = Client::connect_with(e, options.clone())
                .and_then(|mut c| c.status().map(|s| (c, s)))
                .map_err(|err| err.to_string());
            (e.clone(), r)
        })
        .collect()
}

/// Connects to the service among `endpoints` where a job of `need` is
/// admitted soonest ([`choose`] over their Status reports): the client,
/// already connected, and the placement.
pub fn connect_best(
    endpoints: &[String],
    need: Option<JobSize>,
    options: ClientOptions,
) -> Result<(Client, Placement), PlacementError> {
    let mut clients = Vec::new();
    let mut seen = Vec::new();
    for (e, r) in survey(endpoints, &options) {
        match r {
            Ok((c, s)) => {
                clients.push(Some(c));
                seen.push((e, Ok(s)));
            }
            Err(why) => {
                clients.push(None);
                seen.push((e, Err(why)));
            }
        }
    }
    let placement = choose(&seen, need)?;
    let client = clients
        .get_mut(placement.index)
        .and_then(Option::take)
        .ok_or(PlacementError::NoEndpoints)?;
    Ok((client, placement))
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}, load {:.2}, {} waiting)",
            self.endpoint,
            if self.fits_now {
                "fits now"
            } else {
                "shortest queue"
            },
            self.load,
            self.queue
        )
    }
}

#[cfg(test)]
#[path = "placement_tests.rs"]
mod tests;
