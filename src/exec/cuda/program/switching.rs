//! Residency: evicting the persistent region to its host image and bringing
//! it back, pipelined with the iteration's compute (docs/switching.md).

use super::*;

/// `LANES_ARENA_FILL`: `zero` or `poison` (0xFF bytes: NaN) fills the
/// ephemeral part of an arena allocated by a switch; unset leaves it as is.
pub(super) fn arena_fill() -> Option<u8> {
    static FILL: std::sync::OnceLock<Option<u8>> = std::sync::OnceLock::new();
    *FILL.get_or_init(|| match std::env::var("LANES_ARENA_FILL").as_deref() {
        Ok("zero") => Some(0),
        Ok("poison") => Some(0xFF),
        _ => None,
    })
}

/// `LANES_SWITCH_TRACE=1`: every switch times its steps into its report
/// ([`SwitchTrace`]): timing events on both streams and the host's clock.
fn switch_trace() -> bool {
    static TRACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TRACE.get_or_init(|| std::env::var("LANES_SWITCH_TRACE").is_ok_and(|v| v == "1"))
}

/// Milliseconds from `a` to `b`.
fn between(a: &CudaEvent, b: &CudaEvent) -> Result<f64, ExecError> {
    a.elapsed_ms(b)
        .map(f64::from)
        .map_err(|e| dev_err("event", e))
}

/// Per-group cost on the compute side (one stream wait), seconds.
const WAIT_OVERHEAD: f64 = 2e-6;

impl CudaProgram {
    /// Whether the persistent region is on the device.
    pub fn is_resident(&self) -> bool {
        self.res.resident
    }

    /// Persistent bytes (variables and constants).
    pub fn persistent_bytes(&self) -> u64 {
        self.res.layout.bytes()
    }

    /// The unit layout (persistent tensors by first use).
    pub fn layout(&self) -> &Layout {
        &self.res.layout
    }

    /// Per-unit compute profile of the first resident iteration.
    pub fn profile(&self) -> Option<&Profile> {
        self.res.profile.as_ref()
    }

    /// Measured pinned host → device bandwidth in bytes/s (after an eviction).
    pub fn bandwidth(&self) -> Option<f64> {
        self.res.link.map(|(bw, _)| bw)
    }

    /// The group plan `strategy` would use now (for the units a partial
    /// eviction kept, when evicted so).
    pub fn plan(&self, strategy: Strategy) -> GroupPlan {
        let kept = if self.res.resident {
            0
        } else {
            self.res.kept_units
        };
        self.res.plans.get(strategy, kept, || self.costs())
    }

    /// Device bytes of the persistent region still mapped while evicted
    /// partially ([`CudaProgram::evict_keeping`]); 0 while resident or
    /// evicted whole.
    pub fn kept_bytes(&self) -> u64 {
        if self.res.resident {
            0
        } else {
            self.arena.kept_bytes() as u64
        }
    }

    /// Units kept on the device while evicted partially (0 otherwise).
    pub fn kept_units(&self) -> usize {
        if self.res.resident {
            0
        } else {
            self.res.kept_units
        }
    }

    /// The bytes `auto` keeps ([`crate::residency::auto_keep`] on the
    /// measured costs: the end of the last kept unit in the persistent
    /// region); `None` until the link was measured and the program
    /// profiled (`prepare_standby`, or a resident run and an eviction).
    pub fn auto_keep_bytes(&self) -> Option<u64> {
        self.res.link?;
        self.res.profile.as_ref()?;
        let units = crate::residency::auto_keep(&self.costs(), crate::residency::AUTO_KEEP_SLACK);
        Some(units.checked_sub(1).map_or(0, |u| self.res.ranges[u].1) as u64)
    }

    /// The iteration time the switching planner plans with (the profile
    /// scaled to the recorded iteration's time), seconds; `None` before a
    /// profile.
    pub fn planned_compute_secs(&self) -> Option<f64> {
        self.res.profile.as_ref()?;
        let c = self.costs();
        Some(c.prefix + c.compute.iter().sum::<f64>())
    }

    /// The measured costs (zeros where nothing was measured yet).
    pub(super) fn costs(&self) -> Costs {
        let res = &self.res;
        let n = res.layout.units.len();
        let mut profile = res.profile.clone().unwrap_or_else(|| Profile::zeros(n));
        // Switches replay recorded segments: scale the op-by-op profile to
        // the recorded iteration's time.
        let total = profile.prefix + profile.compute.iter().sum::<f64>();
        if let (Some(g), true) = (res.graph_secs, total > 0.0) {
            let f = g / total;
            profile.prefix *= f;
            profile.compute.iter_mut().for_each(|c| *c *= f);
        }
        let (bw, over) = res.link.unwrap_or((0.0, 0.0));
        Costs::from_bandwidth(
            &res.layout,
            bw,
            profile.compute,
            profile.prefix,
            over,
            WAIT_OVERHEAD,
        )
    }

    pub(super) fn event(&self, stream: &CudaStream, timing: bool) -> Result<CudaEvent, ExecError> {
        let flags =
            (!timing).then_some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let flags = flags.unwrap_or(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        stream
            .record_event(Some(flags))
            .map_err(|e| dev_err("record event", e))
    }

    /// Copies the persistent region to pinned host memory when the host
    /// image is stale (always for training state; once for an inference
    /// graph) and releases the device arena. Returns the bytes copied.
    pub fn evict(&mut self) -> Result<u64, ExecError> {
        self.evict_keeping(0)
    }

    /// [`CudaProgram::evict`] that keeps the persistent region's first
    /// units mapped, at least `bytes` of it (whole units, then whole
    /// pieces of the mapping granularity: the kept block is
    /// [`CudaProgram::kept_bytes`]; 0: evict whole). The next switch copies
    /// only the units beyond the kept block while the kept ones already
    /// compute. The arena's own memory is cut in two blocks at the kept
    /// size (`VmArena::set_keep`); when that cut changes, this eviction
    /// maps the kept block anew and fills it from the host image (a copy
    /// of the kept bytes, once per change). Evicting a partially evicted
    /// program whole (`bytes` 0) gives the kept block up too; otherwise a
    /// program already evicted is left as it is.
    pub fn evict_keeping(&mut self, bytes: u64) -> Result<u64, ExecError> {
        if !self.res.resident {
            if bytes == 0 && self.arena.kept_bytes() > 0 {
                self.gpu
                    .ctx
                    .bind_to_thread()
                    .map_err(|e| dev_err("bind", e))?;
                self.sync()?;
                self.arena.unmap()?;
                self.res.kept_units = 0;
                let costs = self.costs();
                self.res.plans.fill(&costs, 0);
            }
            return Ok(0);
        }
        let t0 = std::time::Instant::now();
        // The ephemeral part holds nothing between iterations: it is given
        // up while the persistent region is copied out (unmapping a lane's
        // block of a training job's T took longer than the copy).
        let copied = self.refresh_host_image_unmapping(true)?.copied;
        let t1 = std::time::Instant::now();
        // The fewest whole units holding `bytes`, then the block holding
        // them, and every unit inside that block.
        let ranges = &self.res.ranges;
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        let want = match ranges.iter().position(|r| r.1 >= bytes) {
            _ if bytes == 0 => 0,
            Some(u) => ranges[u].1,
            None => self.res.bytes,
        };
        let keep = self.arena.keep_for(want)?;
        let kept_units = ranges.iter().take_while(|r| r.1 <= keep).count();
        let costs = self.costs();
        self.res.plans.fill(&costs, kept_units);
        if kept_units > 0 {
            self.record_kept_segments(kept_units);
        }
        if keep == self.arena.keep() && (keep == 0 || self.arena.kept_bytes() > 0) {
            self.arena.unmap_keeping()?;
        } else {
            self.arena.unmap()?;
            self.arena.set_keep(keep)?;
            if keep > 0 {
                self.fill_kept()?;
            }
        }
        self.res.resident = false;
        self.res.kept_units = kept_units;
        // Room to stage the next switch's feeds (made here, off that
        // switch's path; without it the switch copies them after mapping).
        let feeds = self
            .graph
            .graph()
            .placeholders()
            .map(|(_, _, ty)| ty.bytes());
        let need = crate::exec::cuda::staging::bytes_for(feeds);
        if let Err(e) = crate::exec::cuda::staging::reserve(&self.gpu.ctx, need) {
            tracing::debug!(error = %e, need, "no room to stage feeds");
        }
        tracing::debug!(
            copied,
            kept = keep,
            host_ms = (t1 - t0).as_secs_f64() * 1e3,
            unmap_ms = t1.elapsed().as_secs_f64() * 1e3,
            "evicted"
        );
        Ok(copied)
    }

    /// Maps the kept block (just cut) and fills it from the host image
    /// (current: `refresh_host_image` ran).
    fn fill_kept(&mut self) -> Result<(), ExecError> {
        self.arena.map_kept()?;
        let n = self.arena.kept_bytes().min(self.res.bytes);
        let copy = self.res.copy.clone();
        self.copy_image_range(0, n, &copy)?;
        wait_idle(&self.res.copy)
    }

    /// Records the segments of the pipelined plan with `kept` units on the
    /// device (while resident, before a partial eviction), unless recorded:
    /// the first partial switch then replays too. Recording launches
    /// nothing; a failure only means that switch launches op by op.
    fn record_kept_segments(&mut self, kept: usize) {
        if !self.options.cuda_graph
            || self.capture_failures >= CAPTURE_TRIES
            || self.res.graph_secs.is_none()
            || self.res.link.is_none()
        {
            return;
        }
        let plan = self
            .res
            .plans
            .get(Strategy::Pipelined, kept, || self.costs());
        let key = (Strategy::Pipelined, kept);
        if self
            .res
            .segments
            .get(&key)
            .is_some_and(|sg| sg.starts == plan.starts)
        {
            return;
        }
        match self.record_segments(&plan) {
            Ok(sg) => {
                self.res.segments.insert(key, sg);
            }
            Err(e) => tracing::debug!(error = %e, "segments not recorded"),
        }
    }

    /// Runs one iteration; when the program is not resident, its persistent
    /// region comes back in the groups of `strategy` on the copy stream while
    /// the compute stream runs the nodes whose weights are there (each
    /// group's first node waits for that group's copy event).
    pub fn run_switching<F: HostFeed>(
        &mut self,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
        strategy: Strategy,
    ) -> Result<(Vec<Tensor>, Option<SwitchReport>), ExecError> {
        self.run_switching_to(feeds, fetches, strategy, None)
            .map(|(o, r)| (o.into_tensors(), r))
    }

    /// [`CudaProgram::run_switching`] whose fetched values go straight
    /// from the device into `into` when it takes them.
    pub fn run_switching_to<F: HostFeed>(
        &mut self,
        feeds: &BTreeMap<String, F>,
        fetches: &[String],
        strategy: Strategy,
        into: Option<&mut dyn FetchInto>,
    ) -> Result<(Fetched, Option<SwitchReport>), ExecError> {
        if self.res.resident {
            let out = self.run_to(feeds, fetches, into)?;
            return Ok((out, None));
        }
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        let traced = switch_trace();
        let t0 = std::time::Instant::now();
        let ms = |t: std::time::Instant| (t - t0).as_secs_f64() * 1e3;
        let mut trace = SwitchTrace::default();
        self.pin_feeds(feeds);
        let (feed_list, outs, part) = self.check_io(feeds, fetches)?;
        self.cover_fetches(&outs)?;
        let plan = self.plan(strategy);
        let fill = arena_fill();
        // Memory back under the arena's fixed address: the recorded graphs
        // stay valid. The persistent part's first group is mapped while
        // the feeds copy, its chunks beyond the first group while the
        // earlier groups copy (below); a fill maps it all at once.
        let units = &self.res.layout.units;
        // The first copied group's end (a partial eviction's kept group is
        // mapped already).
        let copied_from = usize::from(!plan.copies(0));
        let first = match plan.groups() {
            g if g <= copied_from => 0,
            _ => self.res.ranges[plan.range(copied_from, units.len()).end - 1].1,
        };
        trace.host_checked_ms = ms(std::time::Instant::now());
        let copy = &self.res.copy.clone();
        let start = traced.then(|| self.event(copy, true)).transpose()?;
        // The feeds first, before any mapping: into the staging buffer,
        // which is always mapped, so that they cross the link while the
        // host maps (docs/switching.md, *Feeds staged*). Then the own
        // part's first group, whose copy follows the feeds', then the
        // ephemeral part, where the feeds are moved on the compute stream.
        let staged = match fill {
            None => {
                let bytes = feed_list
                    .iter()
                    .map(|(o, t)| self.feed_bytes(*o, *t))
                    .collect::<Result<Vec<_>, _>>()?;
                crate::exec::cuda::staging::stage(&self.gpu.ctx, &bytes, copy)?
            }
            Some(_) => None,
        };
        let mut early: Option<CudaEvent> = None;
        let staged_in = match &staged {
            Some(_) => {
                let ev = self.event(copy, traced)?;
                trace.host_feeds_ms = ms(std::time::Instant::now());
                self.arena.map_own_deferred(first)?;
                trace.host_mapped_ms = ms(std::time::Instant::now());
                if plan.groups() > copied_from && plan.copies(copied_from) {
                    let r = plan.range(copied_from, units.len());
                    let (lo, hi) = (self.res.ranges[r.start].0, self.res.ranges[r.end - 1].1);
                    self.arena.map_through(hi)?;
                    self.copy_image_range(lo, hi, copy)?;
                    early = Some(self.event(copy, traced)?);
                    if traced {
                        trace.host_enqueued_ms.push(ms(std::time::Instant::now()));
                    }
                }
                Some(ev)
            }
            None => None,
        };
        // Without staging the ephemeral part first: the feeds land there,
        // and their copy runs while the host maps the own part's first
        // group (below). (Mapping only the pieces the feeds land in first,
        // then the rest under their copy, changed nothing inside a device
        // reservation: the rest took 0.3 ms, three times the copy;
        // docs/switching.md.)
        if fill.is_some() {
            self.arena.map()?;
        } else {
            self.arena.map_ephemeral()?;
        }
        trace.host_ephemeral_ms = ms(std::time::Instant::now());
        let base = self.base;
        let p = self.res.bytes;
        // The ephemeral part is left as mapped: every kernel
        // writes its outputs before anything reads them (checked by filling
        // it with NaN bytes under LANES_ARENA_FILL=poison and comparing with
        // resident runs, see docs/switching.md). The fill, when asked for,
        // runs on the compute stream around the feeds, which the copy stream
        // brings in first: a copy from pageable memory returns only once
        // done, so behind the weights it would hold up every launch.
        let mut fed: Vec<(usize, usize)> = feed_list
            .iter()
            .map(|(o, t)| {
                let off = self.slot(*o).off;
                (off, off + t.ty().bytes())
            })
            .collect();
        fed.sort_unstable();
        let mut at = p;
        for (lo, hi) in fed
            .iter()
            .copied()
            .chain([(self.mem.bytes, self.mem.bytes)])
        {
            if let (Some(byte), true) = (fill, lo > at) {
                // SAFETY: [base + at, base + lo) is inside the new arena.
                unsafe {
                    cudarc::driver::result::memset_d8_async(
                        base + at as u64,
                        byte,
                        lo - at,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(|e| dev_err("memset", e))?;
            }
            at = at.max(hi);
        }
        let feeds_staged = staged.is_some();
        let feeds_in = match (staged, staged_in) {
            (Some(st), Some(ev)) => {
                let dsts: Vec<u64> = feed_list.iter().map(|(o, _)| self.addr(*o)).collect();
                st.land(&ev, &dsts, &self.stream)?;
                ev
            }
            _ => {
                // The feeds first, on the copy stream: queued on the compute
                // stream behind the weights' copies instead, a feed from
                // pageable memory came in only after all of them (ResNet-50
                // on the H100: feeds in at 2.10 ms, after 1.86 ms of
                // weights; the pipeline then had nothing to overlap).
                for (o, t) in &feed_list {
                    self.upload_on(*o, *t, copy)?;
                }
                let feeds_in = self.event(copy, traced)?;
                trace.host_feeds_ms = ms(std::time::Instant::now());
                if fill.is_none() {
                    self.arena.map_own_deferred(first)?;
                }
                trace.host_mapped_ms = ms(std::time::Instant::now());
                self.stream
                    .wait(&feeds_in)
                    .map_err(|e| dev_err("stream wait", e))?;
                feeds_in
            }
        };
        let units = &self.res.layout.units;
        // An entry's Run launches its own nodes, op by op, each waiting
        // for the groups its position needs.
        let recorded = self
            .res
            .segments
            .get(&(strategy, plan.kept))
            .filter(|sg| part == Part::Main && sg.starts == plan.starts);
        let replayed = recorded.is_some();
        let mut done: Vec<CudaEvent> = Vec::new();
        // Recorded segments launch as their group's copy is queued: segment
        // k + 1 (group k's consumers; segment 0 is the prefix) waits for
        // group k's copy event on the compute stream, so the compute may
        // start before the host has mapped and queued the later groups.
        // (Against launching them all after the last copy was queued, no
        // difference showed on the H100: docs/switching.md.)
        let mut launched: Result<(), ExecError> = Ok(());
        let stream = &self.stream;
        let mut launch = |k: usize, wait: Option<&CudaEvent>| -> Result<(), ExecError> {
            let Some(sg) = recorded else { return Ok(()) };
            if let Some(ev) = wait {
                stream.wait(ev).map_err(|e| dev_err("stream wait", e))?;
            }
            if launched.is_ok() {
                if let Some(Some(g)) = sg.graphs.get(k) {
                    launched = g.launch().map_err(|e| dev_err("graph launch", e));
                }
            }
            if traced {
                done.push(
                    stream
                        .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                        .map_err(|e| dev_err("record event", e))?,
                );
            }
            Ok(())
        };
        launch(0, None)?;
        // Each group's first consumer and its copy's event (none for the
        // kept group: its bytes stayed on the device).
        let mut groups: Vec<(usize, Option<CudaEvent>)> = Vec::with_capacity(plan.groups());
        for k in 0..plan.groups() {
            let r = plan.range(k, units.len());
            if !plan.copies(k) {
                groups.push((units[r.start].first_use, None));
                launch(k + 1, None)?;
                continue;
            }
            if k == copied_from {
                if let Some(ev) = early.take() {
                    // Queued before the ephemeral part was mapped (above).
                    launch(k + 1, Some(&ev))?;
                    groups.push((units[r.start].first_use, Some(ev)));
                    continue;
                }
            }
            let (lo, hi) = (self.res.ranges[r.start].0, self.res.ranges[r.end - 1].1);
            // Mapped through `hi` first; the copy stream is synchronised
            // before returning.
            self.arena.map_through(hi)?;
            self.copy_image_range(lo, hi, copy)?;
            let ev = self.event(copy, traced)?;
            launch(k + 1, Some(&ev))?;
            groups.push((units[r.start].first_use, Some(ev)));
            if traced {
                trace.host_enqueued_ms.push(ms(std::time::Instant::now()));
            }
        }
        // Whatever the groups did not cover (the alignment tail past the
        // last unit, which no kernel reads).
        self.arena.map()?;
        let launched = if recorded.is_some() {
            for ev in groups.iter().filter_map(|(_, e)| e.as_ref()) {
                self.stream
                    .wait(ev)
                    .map_err(|e| dev_err("stream wait", e))?;
            }
            launched
        } else {
            let mut next = 0;
            let mut wait_until = |pos: usize| -> Result<(), ExecError> {
                while next < groups.len() && groups[next].0 <= pos {
                    if let Some(ev) = &groups[next].1 {
                        self.stream
                            .wait(ev)
                            .map_err(|e| dev_err("stream wait", e))?;
                    }
                    next += 1;
                }
                Ok(())
            };
            let launched = match part {
                Part::Main => self.launch_nodes_with(&mut wait_until),
                Part::Entry(k) => self.launch_entry_with(k, &mut wait_until),
            };
            wait_until(usize::MAX)?;
            launched
        };
        trace.host_launched_ms = ms(std::time::Instant::now());
        // Wait before copying to pageable memory (see `wait_idle`).
        let r: Result<Fetched, ExecError> = launched
            .and_then(|()| self.sync())
            .and_then(|()| self.fetch(&outs, into));
        self.sync()?;
        wait_idle(copy)?;
        trace.host_done_ms = ms(std::time::Instant::now());
        if let Some(e0) = &start {
            trace.feeds_in_ms = between(e0, &feeds_in)?;
            for e in groups.iter().filter_map(|(_, e)| e.as_ref()) {
                trace.copy_done_ms.push(between(e0, e)?);
            }
            for e in &done {
                trace.compute_done_ms.push(between(e0, e)?);
            }
        }
        self.res.resident = true;
        self.res.kept_units = 0;
        // A Run that updates nothing leaves the host image as good as it was.
        self.res.dirty = self.graph.part_updates(part);
        if part == Part::Main
            && !replayed
            && r.is_ok()
            && self.options.cuda_graph
            && self.capture_failures < CAPTURE_TRIES
        {
            // Record this cut's segments for the next switch.
            // Recording launches nothing: the switch's result is unchanged.
            match self.record_segments(&plan) {
                Ok(sg) => {
                    self.res.segments.insert((strategy, plan.kept), sg);
                }
                Err(e) => tracing::debug!(error = %e, "segments not recorded"),
            }
        }
        let units = &self.res.layout.units;
        let kept_bytes: u64 = units[..plan.kept.min(units.len())]
            .iter()
            .map(|u| u.bytes)
            .sum();
        let report = SwitchReport {
            strategy,
            replayed,
            groups: plan.groups(),
            bytes: self.res.layout.bytes() - kept_bytes,
            kept_bytes,
            predicted: plan.predicted,
            feeds_staged,
            trace: traced.then_some(trace),
        };
        r.map(|o| (o, Some(report)))
    }
}
