//! `GraphBuilder`: Lanes' graph IR built from Python, one op at a time.
//!
//! Importers written in Python (`lanes.torch`) emit ops through it; each op
//! is given as its JSON form (`"Add"`, `{"Conv2d": {"stride": [1, 1], …}}`:
//! the serde form of `lanes_adaptor::graph::Op`) and its output types are
//! inferred at once, so a shape the op refuses is an error at the op that
//! caused it, with the importer still knowing which source line that was.

use std::sync::{Mutex, MutexGuard};

use lanes_adaptor::graph::{GraphBuilder as Builder, NodeId, Op, Outlet};
use lanes_adaptor::{DType, TensorType};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::convert::tensor_from_numpy;
use crate::errors::ModelError;

/// An outlet as Python sees it: (node index, output slot).
pub type PyOutlet = (u32, u32);

fn outlet(o: PyOutlet) -> Outlet {
    Outlet::new(NodeId(o.0), o.1)
}

fn py_outlet(o: Outlet) -> PyOutlet {
    (o.node.0, o.slot)
}

/// A graph under construction (see the module's documentation).
#[pyclass(frozen, module = "lanes._lanes", name = "GraphBuilder")]
#[derive(Debug)]
pub struct GraphBuilder {
    inner: Mutex<Option<Builder>>,
}

impl GraphBuilder {
    fn lock(&self) -> MutexGuard<'_, Option<Builder>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The builder, or an error once a session has taken it.
    fn with<T>(&self, f: impl FnOnce(&mut Builder) -> T) -> PyResult<T> {
        match self.lock().as_mut() {
            Some(b) => Ok(f(b)),
            None => Err(ModelError::new_err(
                "this GraphBuilder was already loaded into a session",
            )),
        }
    }

    /// The builder's error, as a `ModelError`, if the last call made one.
    fn check(b: &Builder) -> PyResult<()> {
        match b.error() {
            Some(e) => Err(ModelError::new_err(e.to_string())),
            None => Ok(()),
        }
    }

    /// Takes the builder out (a session loads it).
    pub fn take(&self) -> PyResult<Builder> {
        let b = self.lock().take().ok_or_else(|| {
            ModelError::new_err("this GraphBuilder was already loaded into a session")
        })?;
        Self::check(&b)?;
        Ok(b)
    }

    /// The outlet of the node called `name`.
    pub fn resolve(b: &Builder, name: &str) -> Option<Outlet> {
        let (node, slot) = match name.rsplit_once(':') {
            Some((n, s)) => (n, s.parse::<u32>().ok()?),
            None => (name, 0),
        };
        let i = b.graph_nodes().iter().position(|n| n.name == node)?;
        Some(Outlet::new(NodeId(i as u32), slot))
    }
}

fn parse_dtype(dtype: &str) -> PyResult<DType> {
    match dtype {
        "float32" => Ok(DType::F32),
        "int64" => Ok(DType::I64),
        "float16" => Ok(DType::F16),
        "bfloat16" => Ok(DType::BF16),
        other => Err(PyValueError::new_err(format!(
            "dtype `{other}`: Lanes graphs hold float32, float16, bfloat16 and int64 tensors"
        ))),
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::I64 => "int64",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
    }
}

#[pymethods]
impl GraphBuilder {
    #[new]
    fn new() -> Self {
        GraphBuilder {
            inner: Mutex::new(Some(Builder::new())),
        }
    }

    /// Whether every backend runs the op whose JSON form is `op` on
    /// float16/bfloat16 inputs (`lanes_adaptor::amp::takes_half`); the
    /// others take float32, after a Cast.
    #[staticmethod]
    fn takes_half(op: &str) -> PyResult<bool> {
        let op: Op = serde_json::from_str(op)
            .map_err(|e| PyValueError::new_err(format!("op `{op}` is not a Lanes op: {e}")))?;
        Ok(lanes_adaptor::amp::takes_half(&op))
    }

    /// A per-iteration input fed under `name`.
    #[pyo3(signature = (name, shape, dtype="float32"))]
    fn placeholder(&self, name: &str, shape: Vec<usize>, dtype: &str) -> PyResult<PyOutlet> {
        let dt = parse_dtype(dtype)?;
        self.with(|b| {
            let o = b.placeholder(name, TensorType::new(dt, shape));
            Self::check(b).map(|()| py_outlet(o))
        })?
    }

    /// A persistent tensor (weight, buffer) with its initial value, a
    /// float32 or int64 NumPy array.
    fn variable(&self, name: &str, value: &Bound<'_, PyAny>) -> PyResult<PyOutlet> {
        let t = tensor_from_numpy(name, value)?;
        self.with(|b| {
            let o = b.variable(name, t);
            Self::check(b).map(|()| py_outlet(o))
        })?
    }

    /// A constant embedded in the graph (a float32 or int64 array).
    fn constant(&self, value: &Bound<'_, PyAny>) -> PyResult<PyOutlet> {
        let t = tensor_from_numpy("constant", value)?;
        self.with(|b| {
            let o = b.constant(t);
            Self::check(b).map(|()| py_outlet(o))
        })?
    }

    /// Adds the op whose JSON form is `op` on `inputs`; returns its outputs.
    /// A node name may be given (it must be unique).
    #[pyo3(signature = (op, inputs, name=None))]
    fn op(&self, op: &str, inputs: Vec<PyOutlet>, name: Option<&str>) -> PyResult<Vec<PyOutlet>> {
        let op: Op = serde_json::from_str(op)
            .map_err(|e| PyValueError::new_err(format!("op `{op}` is not a Lanes op: {e}")))?;
        if op.is_source() {
            return Err(PyValueError::new_err(
                "sources are made with placeholder(), variable() and constant()",
            ));
        }
        let inputs: Vec<Outlet> = inputs.into_iter().map(outlet).collect();
        self.with(|b| {
            let outs = b.op(op, &inputs);
            if let (Some(n), Some(first)) = (name, outs.first()) {
                b.set_name(*first, n);
            }
            Self::check(b).map(|()| outs.into_iter().map(py_outlet).collect())
        })?
    }

    /// Renames the node of `outlet` (names are fetch keys).
    fn set_name(&self, outlet_: PyOutlet, name: &str) -> PyResult<()> {
        self.with(|b| {
            b.set_name(outlet(outlet_), name);
            Self::check(b)
        })?
    }

    /// Declares `outputs` (named first with `set_name`) an entry of the
    /// graph: a Run fetching them runs only the nodes they need, apart
    /// from the main iteration, and updates no variable (a training job's
    /// evaluation forward of its current weights; docs/protocol.md,
    /// *Entries*).
    fn entry(&self, name: &str, outputs: Vec<PyOutlet>) -> PyResult<()> {
        self.with(|b| {
            let outs: Vec<Outlet> = outputs.into_iter().map(outlet).collect();
            b.entry(name, &outs);
            Self::check(b)
        })?
    }

    /// The name of the node of `outlet`.
    fn name_of(&self, outlet_: PyOutlet) -> PyResult<String> {
        self.with(|b| b.name_of(outlet(outlet_)).to_string())
    }

    /// (shape, dtype) of `outlet`.
    fn type_of(&self, outlet_: PyOutlet) -> PyResult<(Vec<usize>, String)> {
        self.with(|b| {
            b.ty(outlet(outlet_))
                .map(|t| (t.shape.dims().to_vec(), dtype_name(t.dtype).to_string()))
                .ok_or_else(|| PyValueError::new_err(format!("no outlet {outlet_:?}")))
        })?
    }

    /// Number of nodes so far.
    fn __len__(&self) -> PyResult<usize> {
        self.with(|b| b.len())
    }

    fn __repr__(&self) -> String {
        match self.lock().as_ref() {
            Some(b) => format!("GraphBuilder({} nodes)", b.len()),
            None => "GraphBuilder(loaded)".to_string(),
        }
    }
}
