//! A yielding program's iteration as segments the device's gate lets
//! through (`exec::gate`).
//!
//! While an urgent session is loaded the iteration is not replayed as one
//! graph: the first such iteration runs op by op with a timing event at
//! every launch; from those times the order is cut into segments of about
//! the gate's segment time ([`gate::cut`]), each recorded as a CUDA graph
//! once; then every iteration launches them one at a time, asking the gate
//! before each and waiting for each to finish before the next, so an
//! urgent Run finds at most one of them on the GPU.

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

use super::wait::{spin_for, wait_idle_spinning};
use super::{dev_err, CudaProgram};
use crate::exec::gate::{self, Gate};
use crate::exec::ExecError;

/// Most segments an iteration is cut into (the target time grows to fit).
const MAX_SEGMENTS: usize = 1024;

/// A yielding program's gate and its segments.
pub(super) struct Gated {
    pub(super) gate: Arc<Gate>,
    /// GPU time of each launch position (seconds), from one timed
    /// iteration.
    times: Option<Vec<f64>>,
    /// The recorded segments: each's first position, and its graph (`None`
    /// where it launches nothing).
    segments: Option<Vec<(usize, Option<CudaGraph>)>>,
}

impl Gated {
    pub(super) fn new(gate: Arc<Gate>) -> Gated {
        Gated {
            gate,
            times: None,
            segments: None,
        }
    }

    /// The arena's layout changed: times and recordings are stale.
    pub(super) fn invalidate(&mut self) {
        self.times = None;
        self.segments = None;
    }

    /// Segments recorded so far.
    pub(super) fn segment_count(&self) -> usize {
        self.segments.as_ref().map_or(0, Vec::len)
    }
}

impl CudaProgram {
    /// Passes this program's iterations through `gate` while urgent
    /// sessions exist (a yielding job's, see `GpuShare`).
    pub fn set_gate(&mut self, gate: Option<Arc<Gate>>) {
        self.gated = gate.map(Gated::new);
    }

    /// Segments the gated iteration was cut into (0 before it was).
    pub fn gated_segments(&self) -> usize {
        self.gated.as_ref().map_or(0, Gated::segment_count)
    }

    /// Whether this iteration goes through the gate.
    pub(super) fn gating(&self) -> bool {
        self.gated.as_ref().is_some_and(|g| g.gate.armed())
    }

    /// One iteration through the gate (see the module comment).
    pub(super) fn launch_gated(&mut self) -> Result<(), ExecError> {
        let Some(gated) = &self.gated else {
            return self.launch_nodes();
        };
        let gate = Arc::clone(&gated.gate);
        let Some(times) = &gated.times else {
            // This iteration, timed op by op (gated as one segment).
            gate.acquire();
            let timed = self.launch_timed();
            let waited = wait_idle_spinning(&self.stream, spin_for(std::time::Duration::ZERO));
            gate.finished();
            let times = timed?;
            waited?;
            if let Some(g) = &mut self.gated {
                g.times = Some(times);
            }
            return Ok(());
        };
        if gated.segments.is_none() {
            let target = gate.config().segment.as_secs_f64();
            let mut starts = vec![0];
            starts.extend(gate::cut(times, target, MAX_SEGMENTS));
            let recorded = self.record_cut(&starts)?;
            tracing::debug!(
                segments = recorded.len(),
                target_us = target * 1e6,
                iteration_ms = times.iter().sum::<f64>() * 1e3,
                "recorded the gated iteration"
            );
            if let Some(g) = &mut self.gated {
                g.segments = Some(recorded);
            }
        }
        let Some(segments) = self.gated.as_ref().and_then(|g| g.segments.as_ref()) else {
            return self.launch_nodes();
        };
        let spin = spin_for(std::time::Duration::ZERO);
        for (_, graph) in segments {
            let Some(graph) = graph else { continue };
            gate.acquire();
            let launched = graph
                .launch()
                .map_err(|e| dev_err("graph launch", e))
                .and_then(|()| wait_idle_spinning(&self.stream, spin));
            gate.finished();
            launched?;
        }
        Ok(())
    }

    /// Records the order cut at `starts` (0 first, increasing), one graph
    /// per segment.
    fn record_cut(&self, starts: &[usize]) -> Result<Vec<(usize, Option<CudaGraph>)>, ExecError> {
        let n = self.graph.main_order().len();
        let mut out = Vec::with_capacity(starts.len());
        for (k, &a) in starts.iter().enumerate() {
            let b = starts.get(k + 1).copied().unwrap_or(n);
            out.push((a, self.record_range(a, b)?));
        }
        Ok(out)
    }

    /// Records the launches of positions `a..b` of the main order as one CUDA
    /// graph (`None` if they launch nothing or the range is empty).
    pub(super) fn record_range(&self, a: usize, b: usize) -> Result<Option<CudaGraph>, ExecError> {
        let order = self.graph.main_order();
        let (a, b) = (a.min(order.len()), b.min(order.len()));
        if a >= b {
            return Ok(None);
        }
        let (launched, ended) = crate::exec::cuda::handles::recording(|| {
            self.stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(|e| dev_err("begin capture", e))?;
            let launched = order[a..b].iter().try_for_each(|&id| self.step(id));
            Ok::<_, ExecError>((
                launched,
                self.stream.end_capture(CUgraphInstantiate_flags(0)),
            ))
        })?;
        match (launched, ended) {
            (Ok(()), Ok(g)) => Ok(g),
            (Err(e), _) => Err(e),
            (_, Err(e)) => Err(dev_err("end capture", e)),
        }
    }
}
