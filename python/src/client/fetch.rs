//! How a Run's results come back to Python.

use crate::convert::tensor_to_numpy;
use crate::errors::{local, FeedError};
use lanes_adaptor::Tensor;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// How a Run's results come back: one array, a list, or a dict by name.
#[derive(Debug, Clone)]
pub(super) enum Fetch {
    One(String),
    List(Vec<String>),
    Dict(Vec<String>),
}

impl Fetch {
    pub(super) fn names(&self) -> Vec<String> {
        match self {
            Fetch::One(n) => vec![n.clone()],
            Fetch::List(v) | Fetch::Dict(v) => v.clone(),
        }
    }

    pub(super) fn build<'py>(
        &self,
        py: Python<'py>,
        outs: Vec<Tensor>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let arrays = outs
            .into_iter()
            .map(|t| tensor_to_numpy(py, t))
            .collect::<PyResult<Vec<_>>>()?;
        self.build_arrays(py, arrays)
    }

    /// [`Fetch::build`] from the outputs as arrays already.
    pub(super) fn build_arrays<'py>(
        &self,
        py: Python<'py>,
        outs: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let names = self.names();
        if outs.len() != names.len() {
            return Err(local(
                py,
                FeedError::new_err(format!(
                    "asked for {} fetches, the service returned {}",
                    names.len(),
                    outs.len()
                )),
            ));
        }
        Ok(match self {
            Fetch::One(_) => match outs.into_iter().next() {
                Some(a) => a,
                None => py.None().into_bound(py),
            },
            Fetch::List(_) => PyList::new(py, outs)?.into_any(),
            Fetch::Dict(names) => {
                let d = PyDict::new(py);
                for (n, a) in names.iter().zip(outs) {
                    d.set_item(n, a)?;
                }
                d.into_any()
            }
        })
    }
}
