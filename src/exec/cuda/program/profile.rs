//! Timing a program's iterations op by op: the per-unit profile pipelined
//! switching plans with, and the per-op-kind breakdown of `lanes bench`.

use std::collections::BTreeMap;

use super::{dev_err, CudaEvent, CudaProgram, Profile, Strategy};
use crate::exec::{ExecError, HostFeed};

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
        let (feed_list, outs) = self.check_io(feeds, fetches)?;
        self.cover_fetches(&outs)?;
        for (o, t) in feed_list {
            self.upload(o, t)?;
        }
        let times = self.launch_timed()?;
        if self.res.updates {
            self.res.dirty = true;
        }
        let mut by_op: BTreeMap<&'static str, (usize, f64)> = BTreeMap::new();
        let mut by_sig: BTreeMap<String, (usize, f64)> = BTreeMap::new();
        let g = self.graph.graph();
        for (id, secs) in self.graph.order().iter().zip(times) {
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
            let e = by_sig
                .entry(format!("{name} {:?} <- {}", node.op, shapes.join(" ")))
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

    /// Launches op by op with a timing event at each unit boundary and keeps
    /// the per-unit times.
    pub(super) fn launch_profiled(&mut self) -> Result<(), ExecError> {
        let unit_of = self.res.layout.unit_of_position();
        let mut marks: Vec<(Option<usize>, CudaEvent)> =
            vec![(None, self.event(&self.stream, true)?)];
        let mut current = None;
        let launched = self.launch_nodes_with(&mut |pos| {
            let u = unit_of.get(pos).copied().flatten();
            if u != current {
                marks.push((current, self.event(&self.stream, true)?));
                current = u;
            }
            Ok(())
        });
        launched?;
        marks.push((current, self.event(&self.stream, true)?));
        self.sync()?;
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
        let n = self.graph.order().len();
        let mut marks = Vec::with_capacity(n + 1);
        self.launch_nodes_with(&mut |_| {
            marks.push(self.event(&self.stream, true)?);
            Ok(())
        })?;
        marks.push(self.event(&self.stream, true)?);
        self.sync()?;
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
