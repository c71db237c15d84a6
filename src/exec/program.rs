//! [`Program`]: one interface over both executors, for the service's
//! sessions, the benchmarks and the tests that run on either backend.

use std::collections::BTreeMap;
use std::sync::Arc;

use lanes_adaptor::{Tensor, ValidGraph, VarValues};

use super::cpu::{CpuMemory, CpuProgram};
use super::cuda::CudaProgram;
use super::gate::Gate;
use super::{ExecError, FetchInto, Fetched, HostFeed};
use crate::residency::{GroupPlan, Layout, Strategy, SwitchReport};

/// Where an inference program's standby preparation went
/// (`CudaProgram::prepare_standby`; all zero on the CPU and for training).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StandbyTimes {
    /// Warm-up, profiled and recorded iterations on zero feeds.
    pub runs: std::time::Duration,
    /// The pinned host image of the weights (allocated, copied back), and
    /// the link's measurement when this program made it.
    pub host_image: std::time::Duration,
    /// Whether `host_image` includes measuring the link (once per process
    /// and size class of weights).
    pub link_measured: bool,
    /// Recording the pipelined switch's segments as CUDA graphs.
    pub segments: std::time::Duration,
}

/// Which executor a graph runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    #[default]
    Cpu,
    Cuda,
}

/// A graph ready to run on the CPU reference backend or the CUDA backend,
/// which share one contract (run, variables, residency).
#[derive(Debug)]
pub enum Program {
    Cpu(CpuProgram),
    Cuda(Box<CudaProgram>),
}

/// How a job's GPU work shares the device with the other lanes (the
/// service sets it from its policy).
#[derive(Debug, Clone, Default)]
pub struct GpuShare {
    /// Levels above the device's least stream priority
    /// (`CudaOptions::urgency`).
    pub urgency: u8,
    /// Lanes whose streams outrank this job's may run beside it. The job
    /// then keeps to kernels whose thread blocks are short, so the block
    /// scheduler can start an urgent lane's blocks between them: its
    /// training batch norms run on Lanes' own kernels, not cuDNN's, which
    /// keep every block of a channel resident across a grid-wide barrier
    /// (`CudaOptions::cudnn_batch_norm`; docs/scheduling.md has what they
    /// cost an inference lane beside them on the H100).
    pub yields: bool,
    /// The device's gate (`exec::gate`), under a policy that gates: a job
    /// that yields runs its iterations as segments the gate lets through;
    /// an urgent job (not yielding) closes it while its Runs run.
    pub gate: Option<Arc<Gate>>,
}

impl PartialEq for GpuShare {
    fn eq(&self, other: &Self) -> bool {
        self.urgency == other.urgency
            && self.yields == other.yields
            && match (&self.gate, &other.gate) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            }
    }
}

impl Eq for GpuShare {}

impl GpuShare {
    /// The gate this job closes while its Runs run (an urgent job's).
    pub fn urgent_gate(&self) -> Option<&Arc<Gate>> {
        self.gate.as_ref().filter(|_| !self.yields)
    }

    /// The gate this job's iterations pass (a yielding job's).
    pub fn yielding_gate(&self) -> Option<&Arc<Gate>> {
        self.gate.as_ref().filter(|_| self.yields)
    }
}

impl Program {
    /// Builds the program for `backend` (see `CpuProgram::new`, `CudaProgram::new`).
    pub fn new(backend: Backend, graph: ValidGraph, vars: VarValues) -> Result<Self, ExecError> {
        Self::sharing(backend, graph, vars, GpuShare::default())
    }

    /// [`Program::new`] whose GPU work shares the device as `share` says
    /// (the CPU backend's lanes are threads and ignore it).
    pub fn sharing(
        backend: Backend,
        graph: ValidGraph,
        vars: VarValues,
        share: GpuShare,
    ) -> Result<Self, ExecError> {
        Ok(match backend {
            Backend::Cpu => Program::Cpu(CpuProgram::new(graph, vars)?),
            Backend::Cuda => {
                let d = super::cuda::CudaOptions::default();
                let options = super::cuda::CudaOptions {
                    urgency: share.urgency,
                    cudnn_batch_norm: d.cudnn_batch_norm && !share.yields,
                    ..d
                };
                let mut p = CudaProgram::with_options(graph, vars, options)?;
                p.set_gate(share.yielding_gate().cloned());
                Program::Cuda(Box::new(p))
            }
        })
    }

    pub fn graph(&self) -> &ValidGraph {
        match self {
            Program::Cpu(p) => p.graph(),
            Program::Cuda(p) => p.graph(),
        }
    }

    /// One iteration (bringing the persistent memory back first if evicted).
    pub fn run<F: HostFeed>(
        &mut self,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
    ) -> Result<Vec<Tensor>, ExecError> {
        match self {
            Program::Cpu(p) => p.run(feeds, fetches),
            Program::Cuda(p) => p.run(feeds, fetches),
        }
    }

    /// One iteration; when evicted, the persistent memory comes back in the
    /// groups of `strategy` while it computes.
    pub fn run_switching<F: HostFeed>(
        &mut self,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
        strategy: Strategy,
    ) -> Result<(Vec<Tensor>, Option<SwitchReport>), ExecError> {
        match self {
            Program::Cpu(p) => p.run_switching(feeds, fetches, strategy),
            Program::Cuda(p) => p.run_switching(feeds, fetches, strategy),
        }
    }

    /// [`Program::run_switching`] in memory handed in by the service (CPU
    /// programs under lanes with a reservation: see `CpuMemory`; ignored
    /// by the CUDA executor, whose memory is its own blocks), the fetched
    /// values written into `into` when it takes them (by the CUDA
    /// executor, straight from the device; the CPU one returns them).
    pub fn run_in<F: HostFeed>(
        &mut self,
        mem: Option<CpuMemory<'_>>,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
        strategy: Strategy,
        into: Option<&mut dyn FetchInto>,
    ) -> Result<(Fetched, Option<SwitchReport>), ExecError> {
        match self {
            Program::Cpu(p) => {
                let (out, report) = p.run_in(mem, feeds, fetches, strategy)?;
                Ok((Fetched::give(out, into)?, report))
            }
            Program::Cuda(p) => p.run_switching_to(feeds, fetches, strategy, into),
        }
    }

    /// Whether the program's variables live in memory handed in with each
    /// call (a CPU program that ran in a reservation).
    pub fn needs_memory(&self) -> bool {
        match self {
            Program::Cpu(p) => p.is_given(),
            Program::Cuda(_) => false,
        }
    }

    /// [`Program::read_variables`], the CPU program's variables perhaps in
    /// `persistent` (handed in).
    pub fn read_variables_in(
        &self,
        persistent: Option<&[u64]>,
        names: &[String],
    ) -> Result<VarValues, ExecError> {
        match self {
            Program::Cpu(p) => p.read_variables_in(persistent, names),
            Program::Cuda(p) => p.read_variables(names),
        }
    }

    /// [`Program::write_variables`], the CPU program's variables perhaps
    /// in `persistent` (handed in).
    pub fn write_variables_in(
        &mut self,
        persistent: Option<&mut [u64]>,
        values: VarValues,
    ) -> Result<(), ExecError> {
        match self {
            Program::Cpu(p) => p.write_variables_in(persistent, values),
            Program::Cuda(p) => p.write_variables(values),
        }
    }

    /// [`Program::evict`], the CPU program's variables perhaps in
    /// `persistent` (handed in).
    pub fn evict_in(&mut self, persistent: Option<&[u64]>) -> Result<u64, ExecError> {
        match self {
            Program::Cpu(p) => p.evict_in(persistent),
            Program::Cuda(p) => p.evict(),
        }
    }

    /// [`Program::evict`] that keeps the persistent memory's first units
    /// on the device, at least `bytes` of it (whole units; on the GPU whole
    /// pieces of the mapping granularity; 0: evict whole): the next switch
    /// copies only the rest while the kept units compute (partial
    /// eviction, docs/switching.md). The kept bytes stay held
    /// ([`Program::kept_bytes`]). A CPU program whose memory the service
    /// hands in is only evicted whole (an error otherwise): the service's
    /// lanes count a job's memory as all or nothing, so the service never
    /// evicts partially.
    pub fn evict_keeping(&mut self, bytes: u64) -> Result<u64, ExecError> {
        match self {
            Program::Cpu(p) => p.evict_keeping(bytes),
            Program::Cuda(p) => p.evict_keeping(bytes),
        }
    }

    /// Persistent bytes a partial eviction kept on the device (host
    /// memory on the CPU); 0 while resident or evicted whole.
    pub fn kept_bytes(&self) -> u64 {
        match self {
            Program::Cpu(p) => p.kept_bytes(),
            Program::Cuda(p) => p.kept_bytes(),
        }
    }

    /// Units a partial eviction kept (0 while resident or evicted whole).
    pub fn kept_units(&self) -> usize {
        match self {
            Program::Cpu(p) => p.kept_units(),
            Program::Cuda(p) => p.kept_units(),
        }
    }

    /// The bytes to keep at an eviction by the `auto` rule
    /// ([`crate::residency::auto_keep`]: the smallest prefix with which the
    /// predicted pipelined switch is within 2 % of max(copy of the rest,
    /// compute)); `None` until the costs are measured (a profiled resident
    /// run and an eviction, or `prepare_standby` on the GPU).
    pub fn auto_keep_bytes(&self) -> Option<u64> {
        match self {
            Program::Cpu(p) => p.auto_keep_bytes(),
            Program::Cuda(p) => p.auto_keep_bytes(),
        }
    }

    pub fn read_variables(&self, names: &[String]) -> Result<VarValues, ExecError> {
        match self {
            Program::Cpu(p) => p.read_variables(names),
            Program::Cuda(p) => p.read_variables(names),
        }
    }

    pub fn write_variables(&mut self, values: VarValues) -> Result<(), ExecError> {
        match self {
            Program::Cpu(p) => p.write_variables(values),
            Program::Cuda(p) => p.write_variables(values),
        }
    }

    /// Moves the persistent memory to host memory; bytes copied.
    pub fn evict(&mut self) -> Result<u64, ExecError> {
        match self {
            Program::Cpu(p) => p.evict(),
            Program::Cuda(p) => p.evict(),
        }
    }

    pub fn is_resident(&self) -> bool {
        match self {
            Program::Cpu(p) => p.is_resident(),
            Program::Cuda(p) => p.is_resident(),
        }
    }

    /// Runs the next iterations in the shared ephemeral memory of `lane`
    /// (a process-unique key; `None`: the program's own). CPU programs get
    /// their lane's memory handed in with each call instead
    /// ([`Program::run_in`]): nothing to do.
    pub fn bind_lane(&mut self, lane: Option<u64>) -> Result<(), ExecError> {
        match self {
            Program::Cpu(_) => Ok(()),
            Program::Cuda(p) => p.bind_lane(lane),
        }
    }

    /// The ephemeral bytes (as admission counts them) the program will use
    /// once a Run fetched `fetches`, when that is a change: the CUDA
    /// executor re-plans to keep outputs its plan lets die early; the CPU
    /// executor copies them out as they are made (always `None`).
    pub fn ephemeral_need_for(&self, fetches: &[String]) -> Result<Option<u64>, ExecError> {
        match self {
            Program::Cpu(_) => Ok(None),
            Program::Cuda(p) => p.ephemeral_need_for(fetches),
        }
    }

    /// Device bytes mapped to this program alone now (its lane's shared
    /// memory not counted); `None` on the CPU.
    pub fn own_device_bytes(&self) -> Option<u64> {
        match self {
            Program::Cpu(_) => None,
            Program::Cuda(p) => Some(p.own_device_bytes() as u64),
        }
    }

    /// GPU inference programs get ready to be switched before their first
    /// request (see `CudaProgram::prepare_standby`); nothing on the CPU.
    pub fn prepare_standby(&mut self) -> Result<StandbyTimes, ExecError> {
        match self {
            Program::Cpu(_) => Ok(StandbyTimes::default()),
            Program::Cuda(p) => p.prepare_standby(),
        }
    }

    /// The group plan `strategy` would use now.
    pub fn plan(&self, strategy: Strategy) -> GroupPlan {
        match self {
            Program::Cpu(p) => p.plan(strategy),
            Program::Cuda(p) => p.plan(strategy),
        }
    }

    pub fn persistent_bytes(&self) -> u64 {
        match self {
            Program::Cpu(p) => p.persistent_bytes(),
            Program::Cuda(p) => p.persistent_bytes(),
        }
    }

    pub fn layout(&self) -> &Layout {
        match self {
            Program::Cpu(p) => p.layout(),
            Program::Cuda(p) => p.layout(),
        }
    }

    /// Measured host → device (or host copy) bandwidth, bytes/s.
    pub fn bandwidth(&self) -> Option<f64> {
        match self {
            Program::Cpu(p) => p.bandwidth(),
            Program::Cuda(p) => p.bandwidth(),
        }
    }

    /// The iteration time the switching planner plans with, seconds (see
    /// the backends' `planned_compute_secs`).
    pub fn planned_compute_secs(&self) -> Option<f64> {
        match self {
            Program::Cpu(p) => p.planned_compute_secs(),
            Program::Cuda(p) => p.planned_compute_secs(),
        }
    }
}
