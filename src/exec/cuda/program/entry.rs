//! An entry's Run (`lanes_adaptor::Entry`): the nodes its outputs need,
//! launched apart from the main iteration, which keeps its own recorded
//! graph, profile and segments. The first Run of an entry launches op by
//! op (modules load, cuDNN picks its algorithms); the second records its
//! launches as a CUDA graph that later Runs replay. While a yielding
//! program is gated, an entry's Run passes the gate as one segment.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use lanes_adaptor::Part;

use super::wait::{spin_for, wait_idle_spinning};
use super::{dev_err, CudaProgram, CAPTURE_TRIES};
use crate::exec::ExecError;

/// One entry's Runs so far and its recording.
#[derive(Default)]
pub(super) struct EntryRuns {
    runs: u32,
    graph: Option<CudaGraph>,
    failures: u32,
}

impl CudaProgram {
    /// Launches entry `k`'s nodes in order, calling `before` with each
    /// one's position in the whole order.
    pub(super) fn launch_entry_with(
        &self,
        k: usize,
        before: &mut dyn FnMut(usize) -> Result<(), ExecError>,
    ) -> Result<(), ExecError> {
        for (pos, &id) in self.graph.order().iter().enumerate() {
            if self.graph.runs(Part::Entry(k), id) {
                before(pos)?;
                self.step(id)?;
            }
        }
        Ok(())
    }

    /// Entry `k`'s Run on the resident program: op by op the first time,
    /// then from its recorded graph; through the gate while one is armed.
    pub(super) fn launch_entry(&mut self, k: usize) -> Result<(), ExecError> {
        let gate = self
            .gated
            .as_ref()
            .filter(|g| g.gate.armed())
            .map(|g| std::sync::Arc::clone(&g.gate));
        if let Some(gate) = gate {
            gate.acquire();
            let launched = self.launch_entry_once(k).and_then(|()| {
                wait_idle_spinning(&self.stream, spin_for(std::time::Duration::ZERO))
            });
            gate.finished();
            return launched.map(|_| ());
        }
        self.launch_entry_once(k)
    }

    fn launch_entry_once(&mut self, k: usize) -> Result<(), ExecError> {
        let state = self.entries.entry(k).or_default();
        state.runs += 1;
        let record = state.runs >= 2
            && state.graph.is_none()
            && state.failures < CAPTURE_TRIES
            && self.options.cuda_graph;
        if record {
            let (launched, ended) = crate::exec::cuda::handles::recording(|| {
                self.stream
                    .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                    .map_err(|e| dev_err("begin capture", e))?;
                let launched = self.launch_entry_with(k, &mut |_| Ok(()));
                Ok::<_, ExecError>((
                    launched,
                    self.stream.end_capture(CUgraphInstantiate_flags(0)),
                ))
            })?;
            let state = self.entries.entry(k).or_default();
            match (launched, ended) {
                (Ok(()), Ok(Some(g))) => state.graph = Some(g),
                (launched, ended) => {
                    // Nothing ran while recording: op by op this time.
                    state.failures += 1;
                    tracing::warn!(
                        entry = k,
                        launched = ?launched.err(),
                        ended = ?ended.err(),
                        "recording an entry's Run as a CUDA graph failed"
                    );
                }
            }
        }
        match self.entries.get(&k).and_then(|s| s.graph.as_ref()) {
            Some(g) => g.launch().map_err(|e| dev_err("graph launch", e)),
            None => self.launch_entry_with(k, &mut |_| Ok(())),
        }
    }
}
