//! Launching a fused chain (see `fuse.rs`) and choosing, per node, between
//! it and the node's own kernels.

use lanes_adaptor::{DType, NodeId, Outlet};

use super::device::{grid, warps};
use super::fuse::{Act, Chain, Role, SoftmaxChain, Stage};
use super::ops::plane_rows;
use super::program::{op_err, CudaProgram};
use crate::exec::ExecError;

/// Kernel flags (`elementwise.cu`, FUSE_*).
const BIAS: i32 = 1;
const BN: i32 = 2;
const RES: i32 = 4;
const RELU: i32 = 8;

impl CudaProgram {
    /// Runs node `id` as fusion decided: its own kernels, nothing (inside
    /// a chain), or the chain's kernel (its last node).
    pub(super) fn step(&self, id: NodeId) -> Result<(), ExecError> {
        match self.fusion.role(id) {
            Role::Plain | Role::ConvWithoutBias => self.exec(id),
            Role::Skip => Ok(()),
            Role::Last(k) => {
                let chain = self.fusion.chains.get(k).ok_or_else(|| {
                    let node = &self.graph.graph().nodes[id.index()];
                    op_err(id, node, format!("fused chain {k} is missing"))
                })?;
                self.exec_chain(chain)
            }
            Role::Softmax(k) => {
                let chain = self.fusion.softmax.get(k).ok_or_else(|| {
                    let node = &self.graph.graph().nodes[id.index()];
                    op_err(id, node, format!("fused softmax chain {k} is missing"))
                })?;
                self.exec_softmax(chain)
            }
        }
    }

    /// The profile name of node `id`'s launches: `None` when it launches
    /// nothing of its own (inside a fused chain, or a reshape that is a
    /// view).
    pub(super) fn step_name(&self, id: NodeId) -> Option<&'static str> {
        let g = self.graph.graph();
        match self.fusion.role(id) {
            Role::Plain | Role::ConvWithoutBias if self.is_view(id) => None,
            Role::Plain | Role::ConvWithoutBias => Some(g.nodes[id.index()].op.name()),
            Role::Skip => None,
            Role::Last(k) => self.fusion.chains.get(k).map(Chain::name),
            Role::Softmax(k) => self.fusion.softmax.get(k).map(SoftmaxChain::name),
        }
    }

    /// True when node `id` is a reshape whose output is its input's bytes
    /// (a view, `compile::views`): it launches nothing.
    pub(super) fn is_view(&self, id: NodeId) -> bool {
        let node = &self.graph.graph().nodes[id.index()];
        matches!(node.op, lanes_adaptor::Op::Reshape { .. })
            && node
                .inputs
                .first()
                .is_some_and(|&i| self.addr(i) == self.addr(Outlet::new(id, 0)))
    }

    /// y = relu?(bn?(x + bias?) + residual?), or act(x + row bias), into
    /// the chain's output (and its half copy, `Chain::also`).
    fn exec_chain(&self, c: &Chain) -> Result<(), ExecError> {
        let y = self.addr(c.output());
        let x = self.addr(c.x);
        let dims = self.slot(c.x).ty.shape.dims().to_vec();
        let n: usize = dims.iter().product();
        if n == 0 {
            return Ok(());
        }
        if let Some((b, act)) = c.row {
            let bias = self.addr(b);
            let len = dims[dims.len() - 1];
            // unary_f's codes.
            let op: i32 = match act {
                Act::Relu => 0,
                Act::Gelu => 1,
            };
            // Every tensor holds at most i32::MAX elements (checked at load).
            if len % 4 == 0 && (y | x | bias) % 16 == 0 {
                let (n4, len4) = ((n / 4) as i32, (len / 4) as i32);
                return self.k("fused_row4", grid(n / 4), &[&y, &x, &bias, &n4, &len4, &op]);
            }
            let (n32, len32) = (n as i32, len as i32);
            return self.k("fused_row", grid(n), &[&y, &x, &bias, &n32, &len32, &op]);
        }
        let (ch, inner) = (dims[1], dims[2..].iter().product::<usize>());
        let mut flags = 0;
        let res = match c.residual {
            Some(r) => {
                flags |= RES;
                self.addr(r)
            }
            None => 0,
        };
        let bias = match c.bias {
            Some((_, b)) => {
                flags |= BIAS;
                self.addr(b)
            }
            None => 0,
        };
        let (mut gbmv, mut eps) = ([0u64; 4], 0f32);
        if let Some((p, e)) = c.bn {
            flags |= BN;
            for (k, o) in p.iter().enumerate() {
                gbmv[k] = self.addr(*o);
            }
            eps = e;
        }
        if c.relu {
            flags |= RELU;
        }
        let [g, b, m, v] = gbmv;
        let aligned = (y | x | res) % 16 == 0;
        let planes = n / inner.max(1);
        // Every tensor holds at most i32::MAX elements (checked at load).
        let (c32, inner32, n32) = (ch as i32, inner as i32, n as i32);
        // A chain touching a half tensor: the kernel over mixed types.
        let ydt = self.slot(c.output()).ty.dtype;
        let rdt = c.residual.map_or(DType::F32, |r| self.slot(r).ty.dtype);
        let xdt = self.slot(c.x).ty.dtype;
        let stages = [Stage::Bias, Stage::Bn, Stage::Add, Stage::Relu];
        // The half copy of the result: written too where the chain has one.
        let (y2, y2dt) = match c.also {
            Some(h) => (self.addr(h), self.slot(h).ty.dtype),
            None => (0, DType::F32),
        };
        let mixed = c.also.is_some()
            || [xdt, ydt, rdt]
                .into_iter()
                .chain(stages.iter().map(|&s| c.rounds(s)))
                .any(|d| d != DType::F32);
        if mixed {
            let node = &self.graph.graph().nodes[c.last().index()];
            let code = |d: DType| {
                dt_code(d).ok_or_else(|| {
                    op_err(
                        c.last(),
                        node,
                        format!("a fused chain does not read or write {d:?}"),
                    )
                })
            };
            let (xc, yc, rc, y2c) = (code(xdt)?, code(ydt)?, code(rdt)?, code(y2dt)?);
            let aligned = aligned && y2 % 16 == 0;
            let mut rd = 0i32;
            for (k, &s) in stages.iter().enumerate() {
                rd |= code(c.rounds(s))? << (2 * k);
            }
            if inner >= 32 && (1..=65_535).contains(&planes) {
                let vec4 = inner % 4 == 0 && aligned;
                let units = if vec4 { inner / 4 } else { inner };
                let v4 = i32::from(vec4);
                return self.k(
                    "fused_mixed_planes",
                    plane_rows(units, planes),
                    &[
                        &y, &yc, &y2, &y2c, &x, &xc, &res, &rc, &bias, &g, &b, &m, &v, &c32,
                        &inner32, &eps, &flags, &rd, &v4,
                    ],
                );
            }
            let vec4 = inner % 4 == 0 && n % 4 == 0 && aligned;
            let v4 = i32::from(vec4);
            let cfg = if vec4 { grid(n / 4) } else { grid(n) };
            return self.k(
                "fused_mixed_flat",
                cfg,
                &[
                    &y, &yc, &y2, &y2c, &x, &xc, &res, &rc, &bias, &g, &b, &m, &v, &n32, &c32,
                    &inner32, &eps, &flags, &rd, &v4,
                ],
            );
        }
        if inner >= 32 && (1..=65_535).contains(&planes) {
            let vec4 = inner % 4 == 0 && aligned;
            let units = if vec4 { inner / 4 } else { inner };
            let v4 = i32::from(vec4);
            return self.k(
                "fused_planes",
                plane_rows(units, planes),
                &[
                    &y, &x, &res, &bias, &g, &b, &m, &v, &c32, &inner32, &eps, &flags, &v4,
                ],
            );
        }
        let vec4 = inner % 4 == 0 && n % 4 == 0 && aligned;
        let v4 = i32::from(vec4);
        let cfg = if vec4 { grid(n / 4) } else { grid(n) };
        self.k(
            "fused_flat",
            cfg,
            &[
                &y, &x, &res, &bias, &g, &b, &m, &v, &n32, &c32, &inner32, &eps, &flags, &v4,
            ],
        )
    }

    /// A softmax chain (`fuse/softmax.rs`) as one kernel.
    fn exec_softmax(&self, c: &SoftmaxChain) -> Result<(), ExecError> {
        let g = self.graph.graph();
        let node = &g.nodes[c.softmax.index()];
        let dims = self
            .slot(Outlet::new(c.softmax, 0))
            .ty
            .shape
            .dims()
            .to_vec();
        let d = dims.last().copied().unwrap_or(1);
        let rows = dims.iter().product::<usize>() / d.max(1);
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let code = |o: Outlet| -> Result<i32, ExecError> {
            let d = self.slot(o).ty.dtype;
            dt_code(d).ok_or_else(|| {
                op_err(
                    c.softmax,
                    node,
                    format!("a fused softmax does not read or write {d:?}"),
                )
            })
        };
        // Every tensor holds at most i32::MAX elements (checked at load).
        let (rows32, d32) = (rows as i32, d as i32);
        // The softmax's own f32 output, or the NaN cleanup's after it.
        let own = if c.own {
            self.addr(Outlet::new(c.softmax, 0))
        } else if let Some(w) = c.nan_zero {
            self.addr(w)
        } else {
            0
        };
        let (half, hdt) = match c.half {
            Some(h) => (self.addr(h), code(h)?),
            None => (0, 0),
        };
        let x = self.addr(c.x);
        let xdt = code(c.x)?;
        if let Some(y) = c.y {
            // The gradient: dx into the half output, or f32 into its own.
            let (dx, dxdt) = if c.half.is_some() {
                (half, hdt)
            } else {
                (own, 0)
            };
            let y = self.addr(y);
            let has_post = i32::from(c.post_scale.is_some());
            let post = c.post_scale.unwrap_or(1.0);
            return self.k(
                "softmax_grad_mixed",
                warps(rows),
                &[&dx, &dxdt, &has_post, &post, &y, &x, &xdt, &rows32, &d32],
            );
        }
        let lead: Vec<usize> = {
            let mut l = vec![1usize; 4usize.saturating_sub(dims.len())];
            l.extend_from_slice(&dims[..dims.len() - 1]);
            l
        };
        let (l1, l2) = (lead[1] as i32, lead[2] as i32);
        let (mask, [m0, m1, m2]) = match c.mask {
            Some((o, st)) => (self.addr(o), st),
            None => (0, [0; 3]),
        };
        let has_scale = i32::from(c.scale.is_some());
        let scale = c.scale.unwrap_or(1.0);
        let nan_zero = i32::from(c.nan_zero.is_some());
        self.k(
            "softmax_mixed",
            warps(rows),
            &[
                &own, &half, &hdt, &x, &xdt, &mask, &has_scale, &scale, &l1, &l2, &m0, &m1, &m2,
                &rows32, &d32, &nan_zero,
            ],
        )
    }
}

/// A float type's code in the kernels' run-time typed loads and stores
/// (`dtype.cuh`: `load_dt`, `store_dt`, `round_dt`).
fn dt_code(d: DType) -> Option<i32> {
    match d {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        _ => None,
    }
}
