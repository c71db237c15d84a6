//! The program's pinned host image (what an eviction copies out and a
//! switch copies back), the standby that prepares an inference program's
//! first switch, and the link's measured bandwidth (docs/switching.md).

use super::*;
use crate::exec::StandbyTimes;

/// What bringing the host image up to date did.
pub(super) struct Refreshed {
    /// Bytes copied from the device.
    pub copied: u64,
    /// This call measured the link (no program of its size class had).
    pub link_measured: bool,
}

impl CudaProgram {
    /// Queues on `stream` the copy of the pinned host image's bytes
    /// `[lo, hi)` to the same place in the persistent region. The caller
    /// has mapped that range and synchronises `stream` before the image
    /// can go.
    pub(super) fn copy_image_range(
        &self,
        lo: usize,
        hi: usize,
        stream: &CudaStream,
    ) -> Result<(), ExecError> {
        let host = self
            .res
            .host
            .as_ref()
            .ok_or_else(|| dev_err("restore", "the evicted program has no host image"))?;
        let src = host.as_slice().map_err(|e| dev_err("pinned memory", e))?;
        let src = src
            .get(lo..hi)
            .filter(|_| hi <= self.res.bytes)
            .ok_or_else(|| dev_err("restore", "a range past the persistent region"))?;
        // SAFETY: [base + lo, base + hi) lies in the persistent region
        // (checked just above), mapped by the caller; the pinned source
        // lives in `self` and outlives the copy (the caller synchronises
        // `stream` first).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                self.base + lo as u64,
                src,
                stream.cu_stream(),
            )
        }
        .map_err(|e| dev_err("host to device copy", e))
    }

    /// Brings the pinned host image up to date (copying only when stale),
    /// measures the link once and caches the plans.
    pub(super) fn refresh_host_image(&mut self) -> Result<Refreshed, ExecError> {
        self.refresh_host_image_unmapping(false)
    }

    /// [`CudaProgram::refresh_host_image`] that, with `unmap_ephemeral`,
    /// also unmaps the arena's ephemeral part while the copy runs (once
    /// the iteration before has finished; the copy reads only the
    /// persistent region).
    pub(super) fn refresh_host_image_unmapping(
        &mut self,
        unmap_ephemeral: bool,
    ) -> Result<Refreshed, ExecError> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        self.sync()?;
        let bytes = self.res.bytes;
        let mut copied = 0u64;
        let mut link_measured = false;
        let mut unmap_ephemeral = unmap_ephemeral;
        if self.res.dirty || self.res.host.is_none() {
            if self.res.host.is_none() && bytes > 0 {
                // Written whole by the copy below before any read.
                self.res.host = Some(crate::exec::cuda::host_pool::take(&self.gpu.ctx, bytes)?);
            }
            if let Some(host) = self.res.host.as_mut() {
                let dst = host
                    .as_mut_slice()
                    .map_err(|e| dev_err("pinned memory", e))?;
                // SAFETY: the arena's first `bytes` bytes are the persistent
                // region; `dst` holds exactly `bytes` bytes and stays borrowed
                // until the synchronize below.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(
                        dst,
                        self.base,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(|e| dev_err("device to host copy", e))?;
                let unmapped = if std::mem::take(&mut unmap_ephemeral) {
                    self.arena.unmap_ephemeral()
                } else {
                    Ok(())
                };
                // Waited for whatever the unmap said: `dst` is written
                // until then.
                self.sync()?;
                unmapped?;
                copied = bytes as u64;
            }
            self.res.dirty = false;
        }
        if unmap_ephemeral {
            // Nothing was copied: not unmapped above.
            self.arena.unmap_ephemeral()?;
        }
        if self.res.link.is_none() {
            let (link, measured) = self.link()?;
            self.res.link = Some(link);
            link_measured = measured;
            self.res.plans.invalidate();
        }
        let costs = self.costs();
        self.res.plans.fill(&costs, 0);
        Ok(Refreshed {
            copied,
            link_measured,
        })
    }

    /// Standby for an inference program (no in-place updates): runs it with
    /// zero feeds until it is warm, profiled and recorded, takes the pinned
    /// host image, measures the link, plans the switch and records the
    /// pipelined plan's segments — so that the first eviction copies nothing
    /// and every switch replays recorded segments. A graph that updates
    /// variables is left alone (running it would change its state).
    pub fn prepare_standby(&mut self) -> Result<StandbyTimes, ExecError> {
        let mut times = StandbyTimes::default();
        if self.graph.part_updates(Part::Main) || !self.res.resident {
            return Ok(times);
        }
        let mut clock = std::time::Instant::now();
        let mut lap = || {
            let now = std::time::Instant::now();
            let d = now - clock;
            clock = now;
            d
        };
        let g = self.graph.graph();
        let feeds: BTreeMap<String, Tensor> = g
            .placeholders()
            .map(|(_, name, ty)| {
                let n = ty.shape.numel();
                let data = TensorData::zeros(ty.dtype, n);
                Tensor::new(ty.shape.clone(), data)
                    .map(|t| (name.to_string(), t))
                    .map_err(|e| dev_err("standby feeds", e))
            })
            .collect::<Result<_, _>>()?;
        // Warm-up, profile, record and time the recorded iteration.
        for _ in 0..3 {
            if self.res.graph_secs.is_some() && self.res.profile.is_some() {
                break;
            }
            self.run(&feeds, &[])?;
        }
        times.runs = lap();
        times.link_measured = self.refresh_host_image()?.link_measured;
        times.host_image = lap();
        if self.options.cuda_graph && self.capture_failures < CAPTURE_TRIES {
            let plan = self.plan(Strategy::Pipelined);
            let sg = self.record_segments(&plan)?;
            self.res.segments.insert((Strategy::Pipelined, 0), sg);
        }
        times.segments = lap();
        Ok(times)
    }

    /// The link's bandwidth and per-copy overhead: measured once per
    /// process for each size class of persistent regions (a power of two:
    /// small copies do not reach the link's peak), by the first program of
    /// that class to take its host image; later ones reuse it (each
    /// measurement copies the region twice).
    /// Whether this call measured it is the second value.
    fn link(&self) -> Result<((f64, f64), bool), ExecError> {
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock, PoisonError};
        static LINKS: OnceLock<Mutex<HashMap<u32, (f64, f64)>>> = OnceLock::new();
        let class = self.res.bytes.max(1).ilog2();
        let links = LINKS.get_or_init(Default::default);
        if let Some(&l) = links
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&class)
        {
            return Ok((l, false));
        }
        let l = self.measure_link()?;
        if l.0 > 0.0 {
            links
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(class, l);
        }
        Ok((l, true))
    }

    /// Times one copy of the whole persistent region from the pinned image
    /// and one copy per unit (writing the same bytes back: harmless):
    /// bandwidth and the fixed cost of one more copy.
    pub(super) fn measure_link(&self) -> Result<(f64, f64), ExecError> {
        let Some(host) = self.res.host.as_ref() else {
            return Ok((0.0, 0.0));
        };
        let src = host.as_slice().map_err(|e| dev_err("pinned memory", e))?;
        let copy = &self.res.copy;
        let e0 = self.event(copy, true)?;
        // SAFETY: the persistent region holds `src.len()` bytes at `base`; the
        // pinned source lives in `self` and the stream is synchronised below.
        unsafe { cudarc::driver::result::memcpy_htod_async(self.base, src, copy.cu_stream()) }
            .map_err(|e| dev_err("host to device copy", e))?;
        let e1 = self.event(copy, true)?;
        for &(lo, hi) in &self.res.ranges {
            self.copy_image_range(lo, hi, copy)?;
        }
        let e2 = self.event(copy, true)?;
        wait_idle(copy)?;
        let whole = f64::from(e0.elapsed_ms(&e1).map_err(|e| dev_err("event", e))?) / 1e3;
        let units = f64::from(e1.elapsed_ms(&e2).map_err(|e| dev_err("event", e))?) / 1e3;
        let bw = if whole > 0.0 {
            src.len() as f64 / whole
        } else {
            0.0
        };
        let n = self.res.ranges.len();
        let over = if n > 1 {
            ((units - whole) / (n - 1) as f64).max(0.0)
        } else {
            0.0
        };
        Ok((bw, over))
    }
}
