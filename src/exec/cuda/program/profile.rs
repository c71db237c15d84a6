//! Timing a program's iterations op by op: the per-unit profile pipelined
//! switching plans with, and the per-op-kind breakdown of `lanes bench`.

use std::collections::BTreeMap;

use super::{dev_err, CudaEvent, CudaProgram, Profile, Strategy};
use crate::exec::cuda::device::blocks;
use crate::exec::{ExecError, HostFeed};

/// The longest a timed pass holds its stream for the host's launches
/// ([`CudaProgram::queued_behind_hold`]), nanoseconds of the device's clock.
const HOLD_LIMIT_NS: u64 = 50_000_000;

/// [`CudaProgram::profile_ops`]'s answer.
#[derive(Debug, Clone)]
pub struct OpProfile {
    pub by_op: Vec<(String, usize, f64)>,
    pub by_signature: Vec<(String, usize, f64)>,
}

impl CudaProgram {
    /// Runs one iteration op by op with a timing event after every node and
    /// returns the GPU time per op kind and per signature (the op with its
    /// attributes and input shapes) as (name, nodes, milliseconds), the
    /// largest first. A real iteration: in-place updates happen.
    pub fn profile_ops<F: HostFeed>(
        &mut self,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
    ) -> Result<OpProfile, ExecError> {
        if !self.res.resident {
            self.run_switching(feeds, fetches, Strategy::Pipelined)?;
        }
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        self.arena.map()?;
        let (feed_list, outs, _) = self.check_io(feeds, fetches)?;
        self.cover_fetches(&outs)?;
        for (o, t) in feed_list {
            self.upload(o, t)?;
        }
        let times = self.launch_timed()?;
        if self.graph.part_updates(lanes_adaptor::Part::Main) {
            self.res.dirty = true;
        }
        let mut by_op: BTreeMap<&'static str, (usize, f64)> = BTreeMap::new();
        let mut by_sig: BTreeMap<String, (usize, f64)> = BTreeMap::new();
        let g = self.graph.graph();
        for (id, secs) in self.graph.main_order().iter().zip(times) {
            // Nodes inside a fused chain launch nothing; the chain's kernel
            // counts under its own name (at its last node).
            let Some(name) = self.step_name(*id) else {
                continue;
            };
            let e = by_op.entry(name).or_default();
            e.0 += 1;
            e.1 += secs * 1e3;
            let node = &g.nodes[id.index()];
            let shapes: Vec<String> = node
                .inputs
                .iter()
                .map(|o| format!("{:?}", self.slot(*o).ty.shape.dims()))
                .collect();
            // A constant's signature is its type, not its values.
            let op = match &node.op {
                lanes_adaptor::Op::Constant(t) => format!("Constant({:?})", t.ty()),
                op => format!("{op:?}"),
            };
            let e = by_sig
                .entry(format!("{name} {op} <- {}", shapes.join(" ")))
                .or_default();
            e.0 += 1;
            e.1 += secs * 1e3;
        }
        let sorted = |m: Vec<(String, usize, f64)>| {
            let mut m = m;
            m.sort_by(|a, b| b.2.total_cmp(&a.2));
            m
        };
        Ok(OpProfile {
            by_op: sorted(
                by_op
                    .into_iter()
                    .map(|(op, (n, ms))| (op.to_string(), n, ms))
                    .collect(),
            ),
            by_signature: sorted(by_sig.into_iter().map(|(k, (n, ms))| (k, n, ms)).collect()),
        })
    }

    /// Queues what `queue` launches on the program's stream behind a kernel
    /// (`hold_until`) that holds the stream until `queue` has returned, so
    /// that timing events between the launches time the kernels back to
    /// back, as a recorded replay runs them. Launched op by op without it,
    /// short kernels waited for the host: ResNet-50's early units timed
    /// slower and its last ones faster than in a replay, and the pipelined
    /// switch planned on that ran its last group 0.3 ms past the plan's
    /// prediction (bf16, H100). The hold gives up after [`HOLD_LIMIT_NS`]
    /// (a host blocked on a full launch queue).
    fn queued_behind_hold<R>(
        &self,
        queue: impl FnOnce() -> Result<R, ExecError>,
    ) -> Result<R, ExecError> {
        use cudarc::driver::sys;
        // SAFETY: one i32, set to 0 below before the kernel is launched.
        let mut flag = unsafe {
            self.gpu.ctx.alloc_pinned_with_flags::<i32>(
                1,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(|e| dev_err("pinned memory", e))?;
        let host = flag.as_mut_ptr().map_err(|e| dev_err("pinned memory", e))?;
        // SAFETY: `host` points at the one i32 of `flag`, alive to the end.
        unsafe { std::ptr::write_volatile(host, 0) };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` is page-locked memory this context mapped
        // (DEVICEMAP); the call writes its device address into `device`.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) }
            .result()
            .map_err(|e| dev_err("pinned memory", e))?;
        self.k("hold_until", blocks(1, 32), &[&device, &HOLD_LIMIT_NS])?;
        let queued = queue();
        // SAFETY: as above; the kernel only reads it.
        unsafe { std::ptr::write_volatile(host, 1) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // The kernel reads `flag` until it sees the 1: keep it alive until
        // the stream has passed it.
        let synced = self.sync();
        let r = queued?;
        synced?;
        drop(flag);
        Ok(r)
    }

    /// Launches op by op with a timing event at each unit boundary and keeps
    /// the per-unit times.
    pub(super) fn launch_profiled(&mut self) -> Result<(), ExecError> {
        let unit_of = self.res.layout.unit_of_position();
        let marks = self.queued_behind_hold(|| {
            let mut marks: Vec<(Option<usize>, CudaEvent)> =
                vec![(None, self.event(&self.stream, true)?)];
            let mut current = None;
            self.launch_nodes_with(&mut |pos| {
                let u = unit_of.get(pos).copied().flatten();
                if u != current {
                    marks.push((current, self.event(&self.stream, true)?));
                    current = u;
                }
                Ok(())
            })?;
            marks.push((current, self.event(&self.stream, true)?));
            Ok(marks)
        })?;
        let mut profile = Profile::zeros(self.res.layout.units.len());
        for w in marks.windows(2) {
            let dt = f64::from(
                w[0].1
                    .elapsed_ms(&w[1].1)
                    .map_err(|e| dev_err("event", e))?,
            ) / 1e3;
            match w[1].0 {
                None => profile.prefix += dt,
                Some(u) => profile.compute[u] += dt,
            }
        }
        self.res.profile = Some(profile);
        self.res.plans.invalidate();
        Ok(())
    }

    /// Launches every node in order with a timing event between launches;
    /// returns each position's GPU time (seconds). Waits for the stream.
    pub(super) fn launch_timed(&self) -> Result<Vec<f64>, ExecError> {
        let n = self.graph.main_order().len();
        let marks = self.queued_behind_hold(|| {
            let mut marks = Vec::with_capacity(n + 1);
            self.launch_nodes_with(&mut |_| {
                marks.push(self.event(&self.stream, true)?);
                Ok(())
            })?;
            marks.push(self.event(&self.stream, true)?);
            Ok(marks)
        })?;
        marks
            .windows(2)
            .map(|w| {
                w[0].elapsed_ms(&w[1])
                    .map(|ms| f64::from(ms) / 1e3)
                    .map_err(|e| dev_err("event", e))
            })
            .collect()
    }
}
