//! Optimizers a training session is built with (PyTorch's semantics).

use lanes_adaptor::Optimizer;
use pyo3::prelude::*;

/// `torch.optim.SGD`.
#[pyclass(frozen, module = "lanes._lanes", name = "SGD")]
#[derive(Debug, Clone, Copy)]
pub struct Sgd(pub Optimizer);

#[pymethods]
impl Sgd {
    #[new]
    #[pyo3(signature = (lr, momentum=0.0, weight_decay=0.0, nesterov=false))]
    fn new(lr: f32, momentum: f32, weight_decay: f32, nesterov: bool) -> Self {
        Sgd(Optimizer::Sgd {
            lr,
            momentum,
            weight_decay,
            nesterov,
        })
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.0)
    }
}

/// `torch.optim.Adam`.
#[pyclass(frozen, module = "lanes._lanes", name = "Adam")]
#[derive(Debug, Clone, Copy)]
pub struct Adam(pub Optimizer);

#[pymethods]
impl Adam {
    #[new]
    #[pyo3(signature = (lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0))]
    fn new(lr: f32, betas: (f32, f32), eps: f32, weight_decay: f32) -> Self {
        Adam(Optimizer::Adam {
            lr,
            beta1: betas.0,
            beta2: betas.1,
            eps,
            weight_decay,
        })
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.0)
    }
}

/// `torch.optim.AdamW`.
#[pyclass(frozen, module = "lanes._lanes", name = "AdamW")]
#[derive(Debug, Clone, Copy)]
pub struct AdamW(pub Optimizer);

#[pymethods]
impl AdamW {
    #[new]
    #[pyo3(signature = (lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2))]
    fn new(lr: f32, betas: (f32, f32), eps: f32, weight_decay: f32) -> Self {
        AdamW(Optimizer::AdamW {
            lr,
            beta1: betas.0,
            beta2: betas.1,
            eps,
            weight_decay,
        })
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.0)
    }
}

/// The optimizer an `SGD`, `Adam` or `AdamW` object stands for.
pub fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Optimizer> {
    if let Ok(o) = obj.cast::<Sgd>() {
        return Ok(o.get().0);
    }
    if let Ok(o) = obj.cast::<Adam>() {
        return Ok(o.get().0);
    }
    if let Ok(o) = obj.cast::<AdamW>() {
        return Ok(o.get().0);
    }
    Err(pyo3::exceptions::PyTypeError::new_err(
        "optimizer must be lanes.SGD, lanes.Adam or lanes.AdamW",
    ))
}
