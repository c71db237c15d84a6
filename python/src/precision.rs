//! The `precision=` and `loss_scale=` arguments of the loaders
//! (docs/precision.md).

use crate::errors::local;
use lanes_adaptor::{LossScale, Precision};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The keys of a `loss_scale=` dict: `torch.amp.GradScaler`'s arguments.
const KEYS: [&str; 5] = [
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "enabled",
];

/// A `precision=` argument: None is fp32; an unknown name is a ValueError.
pub fn parse_precision(py: Python<'_>, p: Option<&str>) -> PyResult<Precision> {
    match p {
        None => Ok(Precision::F32),
        Some(s) => s
            .parse()
            .map_err(|e: lanes_adaptor::AmpError| local(py, PyValueError::new_err(e.to_string()))),
    }
}

/// A `loss_scale=` argument: None is PyTorch's defaults; a dict sets any of
/// [`KEYS`] (the rest keep their defaults). Only fp16-mixed scales a loss:
/// settings with another precision, or an unknown key, are a ValueError;
/// `enabled: False` (a disabled `GradScaler`) is no scaling, which only
/// the other precisions have. Values out of range are refused by the
/// training graph (`TrainError::BadLossScale`, a ValueError too).
pub fn parse_loss_scale(
    py: Python<'_>,
    d: Option<&Bound<'_, PyDict>>,
    precision: Precision,
) -> PyResult<LossScale> {
    let mut ls = LossScale::default();
    let Some(d) = d else {
        return Ok(ls);
    };
    let bad = |msg: String| local(py, PyValueError::new_err(msg));
    let fp16 = precision == Precision::F16Mixed;
    let enabled = match d.get_item("enabled")? {
        Some(v) => v.is_truthy()?,
        None => true,
    };
    if !enabled {
        if fp16 {
            return Err(bad(
                "a disabled GradScaler (loss scaling enabled=False) cannot train \
                 precision=\"fp16-mixed\", whose steps always scale the loss: \
                 enable it, or train fp32 or bf16-mixed (a GradScaler of the default device \
                 \"cuda\" disables itself where CUDA is not available: make it with \
                 torch.amp.GradScaler(\"cpu\", ...), the service scales on its own device \
                 either way, or pass a dict)"
                    .into(),
            ));
        }
        return Ok(ls);
    }
    if !fp16 {
        return Err(bad(format!(
            "loss scaling settings are for precision=\"fp16-mixed\" (the only one that scales \
             the loss), not {precision}"
        )));
    }
    for (k, v) in d.iter() {
        let key: String = k.extract()?;
        match key.as_str() {
            "enabled" => {}
            "init_scale" => ls.init_scale = v.extract()?,
            "growth_factor" => ls.growth_factor = v.extract()?,
            "backoff_factor" => ls.backoff_factor = v.extract()?,
            "growth_interval" => {
                let n: i64 = v.extract()?;
                ls.growth_interval = u32::try_from(n)
                    .map_err(|_| bad(format!("growth_interval {n} is not in [1, 2^24]")))?;
            }
            _ => {
                return Err(bad(format!(
                    "loss scaling has no setting `{key}` (it takes {})",
                    KEYS.join(", ")
                )))
            }
        }
    }
    Ok(ls)
}
