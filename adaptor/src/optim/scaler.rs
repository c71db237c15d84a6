//! Loss scaling for fp16-mixed training, with `torch.amp.GradScaler`'s
//! semantics inside the one Run of an iteration (docs/precision.md, *Loss
//! scaling*): the loss multiplied by a scale variable before the backward
//! pass, each gradient unscaled in f32 by [`Op::AmpUnscale`], which also
//! chains a flag of any NaN or infinity through them; the optimizers skip
//! the step when the flag is set; [`Op::AmpScaleUpdate`] backs the scale
//! off or grows it.

use super::TrainError;
use crate::graph::{GraphBuilder, Op, Outlet};
use crate::tensor::Tensor;

/// Name of the variable holding the loss scale (one f32).
pub const SCALE_VARIABLE: &str = "amp/scale";
/// Name of the variable counting the clean steps since the scale last
/// changed (one f32).
pub const GROWTH_TRACKER_VARIABLE: &str = "amp/growth_tracker";
/// Name of the node whose second output (fetch key `amp/found_inf:1`) is 1
/// when this iteration's gradients overflowed and its step was skipped.
pub const FOUND_INF_NODE: &str = "amp/found_inf";

/// `GradScaler`'s settings, with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScale {
    /// The scale of the first step (PyTorch: 2^16).
    pub init_scale: f32,
    /// What the scale is multiplied by after `growth_interval` clean
    /// steps in a row (PyTorch: 2).
    pub growth_factor: f32,
    /// What the scale is multiplied by after an overflow (PyTorch: 0.5).
    pub backoff_factor: f32,
    /// Clean steps in a row before the scale grows (PyTorch: 2000).
    pub growth_interval: u32,
}

impl Default for LossScale {
    fn default() -> Self {
        LossScale {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl LossScale {
    /// Why these settings cannot scale a loss, if they cannot.
    fn check(&self) -> Result<(), TrainError> {
        let bad = |what: String| Err(TrainError::BadLossScale(what));
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return bad(format!(
                "init_scale {} must be positive and finite",
                self.init_scale
            ));
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad(format!(
                "growth_factor {} must be above 1",
                self.growth_factor
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(format!(
                "backoff_factor {} is not in (0, 1)",
                self.backoff_factor
            ));
        }
        if self.growth_interval == 0 || self.growth_interval > 1 << 24 {
            return bad(format!(
                "growth_interval {} is not in [1, 2^24]",
                self.growth_interval
            ));
        }
        Ok(())
    }
}

/// The scaler's variables in a graph under construction.
pub(super) struct Scaler {
    scale: Outlet,
    tracker: Outlet,
    settings: LossScale,
}

impl Scaler {
    /// Adds the scale and growth-tracker variables; returns the scaler and
    /// `loss` times the scale, the loss to differentiate.
    pub(super) fn scale_loss(
        g: &mut GraphBuilder,
        loss: Outlet,
        settings: LossScale,
    ) -> Result<(Scaler, Outlet), TrainError> {
        settings.check()?;
        // The loss's own shape ([] or [1]), so the product keeps it.
        let dims = g.dims(loss);
        let scale = g.variable(SCALE_VARIABLE, Tensor::full(dims, settings.init_scale));
        let tracker = g.variable(GROWTH_TRACKER_VARIABLE, Tensor::full([1], 0.0));
        let scaled = g.mul(loss, scale);
        Ok((
            Scaler {
                scale,
                tracker,
                settings,
            },
            scaled,
        ))
    }

    /// Replaces each gradient by its unscaled value; returns the flag of
    /// any overflow among them (`None` for no gradients).
    pub(super) fn unscale<'a>(
        &self,
        g: &mut GraphBuilder,
        grads: impl Iterator<Item = &'a mut Outlet>,
    ) -> Option<Outlet> {
        let mut found: Option<Outlet> = None;
        for gr in grads {
            let ins = [&[*gr, self.scale][..], found.as_slice()].concat();
            let outs = g.op(Op::AmpUnscale, &ins);
            // Two outputs when the inputs inferred; otherwise the builder
            // holds the error, which finishing the graph reports.
            let (Some(&u), Some(&f)) = (outs.first(), outs.get(1)) else {
                return None;
            };
            *gr = u;
            found = Some(f);
        }
        if let Some(f) = found {
            g.set_name(f, FOUND_INF_NODE);
        }
        found
    }

    /// Appends the scale's update from this iteration's flag; returns the
    /// names of the scaler's variables.
    pub(super) fn update(&self, g: &mut GraphBuilder, found: Outlet) -> Vec<String> {
        let s = self.settings;
        g.op(
            Op::AmpScaleUpdate {
                growth_factor: s.growth_factor,
                backoff_factor: s.backoff_factor,
                growth_interval: s.growth_interval,
            },
            &[self.scale, self.tracker, found],
        );
        vec![
            SCALE_VARIABLE.to_string(),
            GROWTH_TRACKER_VARIABLE.to_string(),
        ]
    }
}
