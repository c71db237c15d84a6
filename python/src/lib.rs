//! The `lanes` Python package's native module, `lanes._lanes`: the Lanes
//! client (`lanes_adaptor::Client`) with NumPy arrays in and out. See
//! docs/python.md.

mod client;
mod convert;
mod errors;
mod graph;
mod optim;
mod precision;
mod zoo;

use pyo3::prelude::*;

#[pymodule]
fn _lanes(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("PROTOCOL_VERSION", lanes_adaptor::wire::PROTOCOL_VERSION)?;
    m.add("ZOO_MODELS", zoo::NAMES.to_vec())?;
    m.add_class::<client::Client>()?;
    m.add_class::<client::Session>()?;
    m.add_class::<client::RunHandle>()?;
    m.add_class::<client::Buffers>()?;
    m.add_class::<graph::GraphBuilder>()?;
    m.add_class::<optim::Sgd>()?;
    m.add_class::<optim::Adam>()?;
    m.add_class::<optim::AdamW>()?;
    errors::register(m)?;
    Ok(())
}
