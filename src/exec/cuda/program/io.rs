//! Host ↔ device: feeds uploaded, fetches downloaded, variables read and
//! written, and the checks of a Run's feeds and fetches.

use super::*;

impl CudaProgram {
    pub(super) fn upload<F: HostFeed>(&self, o: Outlet, t: &F) -> Result<(), ExecError> {
        self.upload_on(o, t, &self.stream)
    }

    pub(super) fn upload_on<F: HostFeed>(
        &self,
        o: Outlet,
        t: &F,
        stream: &CudaStream,
    ) -> Result<(), ExecError> {
        let dst = self.addr(o);
        let bytes = self.feed_bytes(o, t)?;
        // SAFETY: `dst` is the start of this outlet's range in the arena,
        // which holds exactly `bytes.len()` bytes (checked just above), and
        // the host bytes live until the stream is synchronised by the caller
        // (from page-locked memory the copy is asynchronous).
        let r =
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, bytes, stream.cu_stream()) };
        r.map_err(|e| dev_err("host to device copy", e))
    }

    /// The host bytes of feed `t` for outlet `o`, checked to be exactly
    /// its type's size.
    pub(super) fn feed_bytes<'t, F: HostFeed>(
        &self,
        o: Outlet,
        t: &'t F,
    ) -> Result<&'t [u8], ExecError> {
        let bytes = t.bytes();
        if bytes.len() != self.slot(o).ty.bytes() {
            return Err(dev_err(
                "host to device copy",
                "a feed's bytes do not match its type",
            ));
        }
        Ok(bytes)
    }

    /// Registers the shared segments `feeds` lie in (once each), so that
    /// their copies to the device are DMA from where the job wrote them.
    pub(super) fn pin_feeds<F: HostFeed>(&mut self, feeds: &BTreeMap<String, F>) {
        // The span of the feeds in each segment (a Run's feeds lie in one).
        let mut spans: Vec<(&Arc<AttachedSegment>, std::ops::Range<usize>)> = Vec::new();
        for f in feeds.values() {
            let (Some(seg), Some(at)) = (f.segment(), f.offset()) else {
                continue;
            };
            let end = at + f.bytes().len();
            match spans.iter_mut().find(|(s, _)| Arc::ptr_eq(s, seg)) {
                Some((_, r)) => *r = r.start.min(at)..r.end.max(end),
                None => spans.push((seg, at..end)),
            }
        }
        for (seg, range) in spans {
            self.pins.pin(seg, range);
        }
    }

    pub(super) fn download(&self, o: Outlet) -> Result<Tensor, ExecError> {
        let s = self.slot(o);
        let n = s.ty.shape.numel();
        let src = self.addr(o);
        let mut data = TensorData::zeros(s.ty.dtype, n);
        let dst = data.ne_bytes_mut();
        // SAFETY: the arena range holds the n values of the slot's dtype,
        // `dst.len()` bytes; the copy is awaited by the synchronize below
        // before `data` is used.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| dev_err("device to host copy", e))?;
        self.sync()?;
        Tensor::new(s.ty.shape.clone(), data).map_err(|e| dev_err("result", e))
    }

    /// The fetched outlets' values after the iteration (the stream idle):
    /// copied straight from the device into `into`'s places when it takes
    /// them, else downloaded as tensors.
    pub(super) fn fetch(
        &mut self,
        outs: &[Outlet],
        into: Option<&mut dyn FetchInto>,
    ) -> Result<Fetched, ExecError> {
        if let Some(into) = into {
            let types: Vec<TensorType> = outs.iter().map(|&o| self.slot(o).ty.clone()).collect();
            let segment = into.segment().cloned();
            let written = into.write(&types, &mut |places| {
                self.download_into(outs, places, segment.as_ref())
            })?;
            if written {
                return Ok(Fetched::Written);
            }
        }
        outs.iter()
            .map(|&o| self.download(o))
            .collect::<Result<_, _>>()
            .map(Fetched::Tensors)
    }

    /// Copies each outlet's values into its place, one per outlet of
    /// exactly its bytes, and waits for the copies. Places in `segment`'s
    /// writable mapping are registered page-locked the first time, so the
    /// copies are DMA into them.
    fn download_into(
        &mut self,
        outs: &[Outlet],
        places: &mut [&mut [u8]],
        segment: Option<&Arc<AttachedSegment>>,
    ) -> Result<(), ExecError> {
        if places.len() != outs.len()
            || outs
                .iter()
                .zip(places.iter())
                .any(|(&o, p)| p.len() != self.slot(o).ty.bytes())
        {
            return Err(dev_err(
                "device to host copy",
                "the places given do not match the fetched values",
            ));
        }
        let span = places
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| p.as_ptr() as usize..p.as_ptr() as usize + p.len())
            .reduce(|a, b| a.start.min(b.start)..a.end.max(b.end));
        if let (Some(seg), Some(span)) = (segment, span) {
            self.pins.pin_writable(seg, span);
        }
        let mut copied = Ok(());
        for (&o, place) in outs.iter().zip(places.iter_mut()) {
            if place.is_empty() {
                continue;
            }
            let src = self.addr(o);
            // SAFETY: the arena range holds the slot's `place.len()` bytes
            // (checked above), and `place` is borrowed exclusively until
            // this function returns, after the synchronize below has
            // awaited every copy queued here.
            let r = unsafe {
                cudarc::driver::result::memcpy_dtoh_async(place, src, self.stream.cu_stream())
            };
            if let Err(e) = r {
                copied = Err(dev_err("device to host copy", e));
                break;
            }
        }
        // Await what was queued even when a later copy failed.
        let synced = self.sync();
        copied.and(synced)
    }

    /// Fetch outlets, the part of the graph they need run, and the feeds
    /// of that part's placeholders in placeholder order, checked (a feed of
    /// a placeholder the part does not read is checked and not uploaded).
    #[allow(clippy::type_complexity)]
    pub(super) fn check_io<'t, F: HostFeed>(
        &self,
        feeds: &'t BTreeMap<String, F>,
        fetches: &[String],
    ) -> Result<(Vec<(Outlet, &'t F)>, Vec<Outlet>, Part), ExecError> {
        let g = self.graph.graph();
        for name in feeds.keys() {
            match g.find(name).map(|id| &g.nodes[id.index()].op) {
                Some(Op::Placeholder(_)) => {}
                _ => return Err(ExecError::UnknownFeed { name: name.clone() }),
            }
        }
        let outs = crate::exec::resolve_fetches(g, fetches)?;
        let part = crate::exec::part_for(&self.graph, &outs)?;
        let mut feed_list = Vec::new();
        for (id, name, ty) in g.placeholders() {
            let runs = self.graph.runs(part, id);
            let Some(t) = feeds.get(name) else {
                if runs {
                    return Err(ExecError::MissingFeed { name: name.into() });
                }
                continue;
            };
            if t.ty() != *ty {
                return Err(ExecError::FeedType {
                    name: name.into(),
                    expected: ty.clone(),
                    got: t.ty(),
                });
            }
            if runs {
                feed_list.push((Outlet::new(id, 0), t));
            }
        }
        Ok((feed_list, outs, part))
    }

    /// Current values of the named variables (all variables when `names` is empty).
    pub fn read_variables(&self, names: &[String]) -> Result<VarValues, ExecError> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        let g = self.graph.graph();
        let mut out = VarValues::new();
        let all: Vec<String>;
        let names = if names.is_empty() {
            all = g.variables().map(|(_, n, _)| n.to_string()).collect();
            &all
        } else {
            names
        };
        for n in names {
            let id = g
                .variables()
                .find(|(_, vn, _)| vn == n)
                .map(|(id, _, _)| id)
                .ok_or_else(|| ExecError::MissingVariable { name: n.clone() })?;
            let o = Outlet::new(id, 0);
            let t = if self.res.resident {
                self.download(o)?
            } else {
                self.read_host(o)?
            };
            out.insert(n.clone(), t);
        }
        Ok(out)
    }

    /// A persistent tensor's value from the pinned image (while evicted).
    pub(super) fn read_host(&self, o: Outlet) -> Result<Tensor, ExecError> {
        let s = self.slot(o);
        let host = self
            .res
            .host
            .as_ref()
            .ok_or_else(|| dev_err("read", "the evicted program has no host image"))?;
        let bytes = host.as_slice().map_err(|e| dev_err("pinned memory", e))?;
        let raw = &bytes[s.off..s.off + s.ty.bytes()];
        let mut data = TensorData::zeros(s.ty.dtype, s.ty.shape.numel());
        data.ne_bytes_mut().copy_from_slice(raw);
        Tensor::new(s.ty.shape.clone(), data).map_err(|e| dev_err("result", e))
    }

    /// Overwrites variables; each must exist and keep its type.
    pub fn write_variables(&mut self, values: VarValues) -> Result<(), ExecError> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| dev_err("bind", e))?;
        let g = self.graph.graph();
        let mut todo = Vec::new();
        for (name, t) in &values {
            let (id, ty) = g
                .variables()
                .find(|(_, vn, _)| vn == name)
                .map(|(id, _, ty)| (id, ty.clone()))
                .ok_or_else(|| ExecError::MissingVariable { name: name.clone() })?;
            if ty != t.ty() {
                return Err(ExecError::VariableType {
                    name: name.clone(),
                    expected: ty,
                    got: t.ty(),
                });
            }
            todo.push((Outlet::new(id, 0), t));
        }
        if !self.res.resident {
            // Into the pinned image, which the next run brings back.
            let offs: Vec<usize> = todo.iter().map(|(o, _)| self.slot(*o).off).collect();
            let host = self
                .res
                .host
                .as_mut()
                .ok_or_else(|| dev_err("write", "the evicted program has no host image"))?;
            let bytes = host
                .as_mut_slice()
                .map_err(|e| dev_err("pinned memory", e))?;
            for ((_, t), off) in todo.iter().zip(&offs) {
                let src: &[u8] = t.data().ne_bytes();
                bytes[*off..*off + src.len()].copy_from_slice(src);
            }
            // The kept block of a partial eviction gets them too (it is
            // not copied back at the switch).
            let kept = self.arena.kept_bytes();
            let mut uploaded = false;
            for ((o, t), off) in todo.iter().zip(offs) {
                if off + t.data().ne_bytes().len() <= kept {
                    self.upload(*o, *t)?;
                    uploaded = true;
                }
            }
            if uploaded {
                self.sync()?;
            }
            return Ok(());
        }
        for (o, t) in todo {
            self.upload(o, t)?;
        }
        self.res.dirty = true;
        self.sync()
    }
}
