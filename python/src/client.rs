//! `lanes.Client`, `lanes.Session` and `lanes.RunHandle`.
//!
//! A `Client` is one connection (a ZeroMQ DEALER) behind a mutex; its
//! sessions share it. Every call that waits on the service releases the GIL
//! (`Python::detach`), so other Python threads run meanwhile; calls on one
//! client from several threads take turns on its connection.

use crate::convert::{tensor_from_numpy, values_from_dict, values_to_dict};
use crate::errors::{client_error, local, onnx_error, zoo_error, ModelError, SessionClosedError};
use crate::precision::{parse_loss_scale, parse_precision};
use crate::{graph, optim, zoo};
use lanes_adaptor::graph::add_entry;
use lanes_adaptor::onnx::{import_file, ImportOptions};
use lanes_adaptor::{training_graph_grouped, ParamGroup, TrainError, TrainOptions};
use lanes_adaptor::{
    Client as Conn, ClientError, ClientOptions, FeedBuffers, Graph, JobKind, PendingRun, SessionId,
    SessionSpec, Tensor, TensorType, VarValues,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

mod buffers;
mod fetch;

use buffers::reply_hint;
pub use buffers::Buffers;
use fetch::Fetch;

/// The connection; `None` once `Client.close` dropped it.
type Shared = Arc<Mutex<Option<Conn>>>;

/// Runs `f` on the connection (even if a thread panicked while holding it:
/// the client keeps no invariant a half-done request could break, replies
/// are matched by request id); `Closed` after `Client.close`.
fn with<T>(
    conn: &Shared,
    f: impl FnOnce(&mut Conn) -> Result<T, ClientError>,
) -> Result<T, ClientError> {
    let mut guard = conn.lock().unwrap_or_else(|e| e.into_inner());
    match guard.as_mut() {
        Some(c) => f(c),
        None => Err(ClientError::Closed),
    }
}

/// A connection to one `lanes serve`.
#[pyclass(frozen, module = "lanes._lanes")]
#[derive(Debug)]
pub struct Client {
    conn: Shared,
    endpoint: String,
}

#[pymethods]
impl Client {
    #[new]
    #[pyo3(signature = (endpoint="tcp://127.0.0.1:5555", *, timeout=300.0, connect_timeout=5.0, name=None, shared_memory=true, busy_poll=0.0, adaptive_wait=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        endpoint: &str,
        timeout: f64,
        connect_timeout: f64,
        name: Option<String>,
        shared_memory: bool,
        busy_poll: f64,
        adaptive_wait: bool,
    ) -> PyResult<Self> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(PyValueError::new_err(
                "timeout must be a positive number of seconds",
            ));
        }
        if !(connect_timeout.is_finite() && connect_timeout > 0.0) {
            return Err(PyValueError::new_err(
                "connect_timeout must be a positive number of seconds",
            ));
        }
        if !(busy_poll.is_finite() && (0.0..=1.0).contains(&busy_poll)) {
            return Err(PyValueError::new_err(
                "busy_poll must be between 0 and 1 second (0: wait without spinning)",
            ));
        }
        let options = ClientOptions {
            timeout: Duration::from_secs_f64(timeout),
            connect_timeout: Duration::from_secs_f64(connect_timeout),
            name: name.unwrap_or_else(|| format!("python/{}", env!("CARGO_PKG_VERSION"))),
            shared_memory,
            busy_poll: Duration::from_secs_f64(busy_poll),
            adaptive_wait,
            ..ClientOptions::default()
        };
        let ep = endpoint.to_string();
        let conn = py
            .detach(move || Conn::connect_with(&ep, options))
            .map_err(client_error)?;
        Ok(Client {
            conn: Arc::new(Mutex::new(Some(conn))),
            endpoint: endpoint.to_string(),
        })
    }

    /// Connects to the service where a job is admitted soonest, among
    /// `endpoints` or the services of a `lanes host --directory` file
    /// (`lanes_adaptor::placement`, docs/multi-gpu.md): where a job of
    /// `persistent` + `ephemeral` bytes fits now, the least loaded; else
    /// the shortest admission queue; without sizes, by load only.
    /// Unreachable services are skipped; `NoServiceError` when none
    /// answers, naming each endpoint and why.
    #[staticmethod]
    #[pyo3(signature = (endpoints=None, *, directory=None, persistent=None, ephemeral=None, timeout=300.0, connect_timeout=5.0, name=None))]
    #[allow(clippy::too_many_arguments)]
    fn connect_best(
        py: Python<'_>,
        endpoints: Option<Vec<String>>,
        directory: Option<std::path::PathBuf>,
        persistent: Option<u64>,
        ephemeral: Option<u64>,
        timeout: f64,
        connect_timeout: f64,
        name: Option<String>,
    ) -> PyResult<Self> {
        use lanes_adaptor::placement::{connect_best, Directory, JobSize};
        let placement_error = |e: lanes_adaptor::placement::PlacementError| {
            local(py, crate::errors::NoServiceError::new_err(e.to_string()))
        };
        let endpoints = match (endpoints, directory) {
            (Some(e), None) => e,
            (None, Some(path)) => Directory::read(&path).map_err(placement_error)?.endpoints(),
            _ => {
                return Err(PyValueError::new_err(
                    "give endpoints or directory (one of them)",
                ))
            }
        };
        for (v, what) in [(timeout, "timeout"), (connect_timeout, "connect_timeout")] {
            if !(v.is_finite() && v > 0.0) {
                return Err(PyValueError::new_err(format!(
                    "{what} must be a positive number of seconds"
                )));
            }
        }
        let need = match (persistent, ephemeral) {
            (None, None) => None,
            (p, t) => Some(JobSize {
                persistent: p.unwrap_or(0),
                ephemeral: t.unwrap_or(0),
            }),
        };
        let options = ClientOptions {
            timeout: Duration::from_secs_f64(timeout),
            connect_timeout: Duration::from_secs_f64(connect_timeout),
            name: name.unwrap_or_else(|| format!("python/{}", env!("CARGO_PKG_VERSION"))),
            ..ClientOptions::default()
        };
        let (conn, placement) = py
            .detach(move || connect_best(&endpoints, need, options))
            .map_err(placement_error)?;
        Ok(Client {
            conn: Arc::new(Mutex::new(Some(conn))),
            endpoint: placement.endpoint,
        })
    }

    /// The endpoint this client is connected to.
    #[getter]
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Opens a session: `kind` is "inference" or "training"; larger
    /// `priority` runs first under priority policies; `slo_ms` states a
    /// latency objective for its Runs (milliseconds, positive and finite,
    /// at most an hour: `ValueError` otherwise), whose attainment
    /// `status()` reports.
    #[pyo3(signature = (name, kind="inference", priority=0, expected_iterations=None, slo_ms=None))]
    fn session(
        &self,
        py: Python<'_>,
        name: &str,
        kind: &str,
        priority: i32,
        expected_iterations: Option<u64>,
        slo_ms: Option<f64>,
    ) -> PyResult<Session> {
        let kind = match kind {
            "inference" => JobKind::Inference,
            "training" => JobKind::Training,
            other => {
                return Err(PyValueError::new_err(format!(
                    "kind must be \"inference\" or \"training\", not {other:?}"
                )))
            }
        };
        let mut spec = SessionSpec::new(name, kind).with_priority(priority);
        if let Some(n) = expected_iterations {
            spec = spec.with_expected_iterations(n);
        }
        if let Some(ms) = slo_ms {
            spec = spec
                .with_slo_ms(ms)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
        }
        let conn = self.conn.clone();
        let id = py
            .detach(move || {
                with(&conn, |c| {
                    let s = c.open_session(spec)?;
                    let id = s.id();
                    // The session stays open: the Python `Session` closes
                    // it by id (`close_in`); forgetting the borrow frees
                    // nothing it owns.
                    std::mem::forget(s);
                    Ok(id)
                })
            })
            .map_err(client_error)?;
        Ok(Session {
            conn: self.conn.clone(),
            id,
            name: name.to_string(),
            state: Mutex::new(State::default()),
        })
    }

    /// The service's sessions and queue, as a dict.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let conn = self.conn.clone();
        let report = py
            .detach(move || with(&conn, |c| c.status()))
            .map_err(client_error)?;
        let text = serde_json::to_string(&report)
            .map_err(|e| PyValueError::new_err(format!("status report: {e}")))?;
        py.import("json")?.call_method1("loads", (text,))
    }

    /// Closes the connection now (waiting for no reply); the service
    /// reclaims sessions still open. Later calls raise `SessionClosedError`.
    fn close(&self, py: Python<'_>) {
        let conn = self.conn.clone();
        let old = py.detach(move || conn.lock().unwrap_or_else(|e| e.into_inner()).take());
        drop(old);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("lanes.Client({:?})", self.endpoint)
    }
}

#[derive(Debug, Default)]
struct State {
    closed: bool,
    inputs: Vec<(String, TensorType)>,
    /// What `run` fetches when given no `fetch`.
    outputs: Vec<String>,
    /// `run`'s feed buffers in shared memory, for the feeds (names and
    /// types) of the last `run`; taken out while a `run` uses them.
    buffers: Option<FeedBuffers>,
    /// The service cannot take feed buffers (not on this host, or shared
    /// memory is off): `run` sends its feeds in the request.
    no_buffers: bool,
    /// Another thread's `run` has the buffers out.
    buffers_out: bool,
    /// Bytes of the reply slot the buffers are made with, when a Run's
    /// outputs did not fit the default one.
    reply_bytes: Option<usize>,
    /// The feed buffers of the last closed `Buffers`, for the next
    /// `buffers()` of the same inputs: the service keeps every segment a
    /// session was given until the session closes, so buffers made anew
    /// for each request would hold a segment each.
    /// With the reply slot size they were asked for.
    spare: Option<(usize, FeedBuffers)>,
}

/// A job's session on the service.
#[pyclass(frozen, module = "lanes._lanes")]
#[derive(Debug)]
pub struct Session {
    conn: Shared,
    id: SessionId,
    name: String,
    state: Mutex<State>,
}

impl Session {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn live(&self, py: Python<'_>) -> PyResult<()> {
        if self.state().closed {
            Err(local(
                py,
                SessionClosedError::new_err(format!("session `{}` is closed", self.name)),
            ))
        } else {
            Ok(())
        }
    }

    fn load(
        &self,
        py: Python<'_>,
        graph: Graph,
        vars: VarValues,
        inputs: Vec<(String, TensorType)>,
        outputs: Vec<String>,
    ) -> PyResult<()> {
        self.live(py)?;
        let (conn, id) = (self.conn.clone(), self.id);
        let hint = reply_hint(&graph, &outputs);
        py.detach(move || with(&conn, |c| c.load_in(id, &graph, vars)))
            .map_err(client_error)?;
        let mut st = self.state();
        st.inputs = inputs;
        st.outputs = outputs;
        // Buffers made from now on have a reply slot the outputs fit.
        st.reply_bytes = hint;
        if hint.is_some() {
            st.buffers = None;
        }
        Ok(())
    }

    fn feeds_and_fetch(
        &self,
        feeds: &Bound<'_, PyDict>,
        fetch: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Vec<(String, Tensor)>, Fetch)> {
        let mut tensors = Vec::with_capacity(feeds.len());
        for (k, v) in feeds.iter() {
            let name: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err("feed names must be strings"))?;
            let t = tensor_from_numpy(&name, &v)?;
            tensors.push((name, t));
        }
        let fetch = self.fetch_of(fetch)?;
        Ok((tensors, fetch))
    }

    /// What `fetch` asks for: None → the model's outputs as a dict, a name
    /// → that array, a sequence of names → a list.
    fn fetch_of(&self, fetch: Option<&Bound<'_, PyAny>>) -> PyResult<Fetch> {
        Ok(match fetch {
            None => Fetch::Dict(self.state().outputs.clone()),
            Some(f) if f.is_instance_of::<PyString>() => Fetch::One(f.extract()?),
            Some(f) => Fetch::List(
                f.try_iter()?
                    .map(|x| x?.extract::<String>())
                    .collect::<PyResult<_>>()
                    .map_err(|_| {
                        PyTypeError::new_err("fetch must be a name or a sequence of names")
                    })?,
            ),
        })
    }
}

#[pymethods]
impl Session {
    /// The session's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The service's id of this session.
    #[getter]
    fn id(&self) -> u64 {
        self.id.0
    }

    /// What to feed: `[(name, shape, dtype)]` of the loaded model.
    #[getter]
    fn inputs(&self) -> Vec<(String, Vec<usize>, String)> {
        self.state()
            .inputs
            .iter()
            .map(|(n, t)| (n.clone(), t.shape.dims().to_vec(), dtype_name(t)))
            .collect()
    }

    /// What `run` fetches when given no `fetch`.
    #[getter]
    fn outputs(&self) -> Vec<String> {
        self.state().outputs.clone()
    }

    /// Imports an ONNX file (opset 13 or later) at `batch` (the size of
    /// every input's symbolic first dimension; `dims` sizes other symbolic
    /// dimensions by name) and loads it. `precision` as `load_graph`'s:
    /// "fp16" or "bf16" serves an f32 model with its weights cast once.
    #[pyo3(signature = (path, batch=1, dims=None, precision=None))]
    fn load_onnx(
        &self,
        py: Python<'_>,
        path: std::path::PathBuf,
        batch: usize,
        dims: Option<BTreeMap<String, usize>>,
        precision: Option<&str>,
    ) -> PyResult<()> {
        let precision = parse_precision(py, precision)?;
        let opts = ImportOptions {
            batch,
            dims: dims.unwrap_or_default(),
            ..ImportOptions::default()
        };
        let m = py
            .detach(move || import_file(&path, &opts))
            .map_err(onnx_error)?;
        let outputs = m.outputs.iter().map(|(n, _)| n.clone()).collect();
        let (graph, vars) = lanes_adaptor::amp::apply(m.graph, m.vars, precision)
            .map_err(|e| local(py, ModelError::new_err(e.to_string())))?;
        self.load(py, graph, vars, m.inputs, outputs)
    }

    /// Loads a model of the zoo: for inference without `optimizer`, or its
    /// training graph (one `run` is one iteration; fetch `loss`) with one.
    /// `params` size the small models (see docs/python.md).
    #[pyo3(signature = (name, batch=1, optimizer=None, seed=0, **params))]
    fn load_zoo(
        &self,
        py: Python<'_>,
        name: &str,
        batch: usize,
        optimizer: Option<&Bound<'_, PyAny>>,
        seed: u64,
        params: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let arch = zoo::arch(name, params)?;
        match optimizer {
            None => {
                let m = py
                    .detach(|| arch.inference(batch, seed))
                    .map_err(zoo_error)?;
                self.load(py, m.graph, m.vars, m.inputs, vec![m.output])
            }
            Some(o) => {
                let opt = optim::extract(o)?;
                let (t, inputs) = py
                    .detach(|| arch.training(batch, seed, &opt))
                    .map_err(zoo_error)?;
                self.load(py, t.graph, t.vars, inputs, vec![t.loss])
            }
        }
    }

    /// Loads a graph built with `GraphBuilder` (for inference, or any graph
    /// whose Runs need no training step appended). `outputs`: the names
    /// `run` fetches by default. The builder is used up.
    /// With `save_to` (a directory) and `example` (a feed of every
    /// placeholder), the job is also saved there (`lanes bench infer --job`).
    /// `precision`: "fp32" (the default), "bf16" or "fp16" (weights stored
    /// and products computed in half; outputs come back float32), or
    /// "bf16-mixed" / "fp16-mixed" (f32 weights, products in half).
    #[pyo3(signature = (builder, outputs, save_to=None, example=None, precision=None))]
    fn load_graph(
        &self,
        py: Python<'_>,
        builder: &Bound<'_, graph::GraphBuilder>,
        outputs: Vec<String>,
        save_to: Option<std::path::PathBuf>,
        example: Option<&Bound<'_, PyDict>>,
        precision: Option<&str>,
    ) -> PyResult<()> {
        let precision = parse_precision(py, precision)?;
        let b = builder.get().take()?;
        let (g, vars) = b
            .finish()
            .map_err(|e| local(py, ModelError::new_err(e.to_string())))?;
        let (g, vars) = lanes_adaptor::amp::apply(g, vars, precision)
            .map_err(|e| local(py, ModelError::new_err(e.to_string())))?;
        if let Some(dir) = save_to {
            let fetch = outputs.first().cloned().unwrap_or_default();
            save_job(py, &dir, &g, &vars, fetch, false, example)?;
        }
        let inputs = placeholders(&g);
        self.load(py, g, vars, inputs, outputs)
    }

    /// Appends the training step to a forward graph built with
    /// `GraphBuilder` and loads it: gradients of `loss` (a node name) with
    /// respect to every variable of `groups` (a list of (names, optimizer)
    /// pairs, as `torch.optim` parameter groups), clipped by their global
    /// norm when `max_grad_norm` is given, then one in-place update each.
    /// Group k's learning rate is the variable `opt/group{k}/lr`. Returns
    /// (trained variables, optimizer-state variables). `outputs`: what
    /// `run` fetches by default (the loss when empty).
    /// `save_to` and `example` save the job as `load_graph`'s do (`lanes
    /// bench train --job`). `precision`: "fp32" (the default),
    /// "bf16-mixed" (products and convolutions in bf16, f32 weights,
    /// gradients and optimizer state) or "fp16-mixed" (the same in fp16,
    /// the loss scaled as by a `GradScaler`: variables `amp/scale` and
    /// `amp/growth_tracker`, docs/precision.md). `loss_scale`: fp16-mixed's
    /// `GradScaler` settings, a dict of any of `init_scale`,
    /// `growth_factor`, `backoff_factor` and `growth_interval` (the rest:
    /// PyTorch's defaults; a ValueError with another precision), or
    /// `enabled: False` (fp32 and bf16-mixed only: no scaling).
    /// `batches`: more steps of the same model, each `(name, builder,
    /// loss)` (a forward graph at another batch size, its variables named
    /// as this one's), trained with the same groups and options and joined
    /// as the graph's entry `name` on the same variables: a Run fetching
    /// `{name}/{loss}` takes that step (its feeds `{name}/{placeholder}`).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (builder, loss, groups, max_grad_norm=None, outputs=None, save_to=None, example=None, precision=None, loss_scale=None, batches=None))]
    fn load_training(
        &self,
        py: Python<'_>,
        builder: &Bound<'_, graph::GraphBuilder>,
        loss: &str,
        groups: Vec<(Vec<String>, Bound<'_, PyAny>)>,
        max_grad_norm: Option<f32>,
        outputs: Option<Vec<String>>,
        save_to: Option<std::path::PathBuf>,
        example: Option<&Bound<'_, PyDict>>,
        precision: Option<&str>,
        loss_scale: Option<&Bound<'_, PyDict>>,
        batches: Option<Vec<(String, Bound<'_, graph::GraphBuilder>, String)>>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        let precision = parse_precision(py, precision)?;
        let loss_scale = parse_loss_scale(py, loss_scale, precision)?;
        let b = builder.get().take()?;
        let mut more = Vec::new();
        for (name, eb, eloss) in batches.unwrap_or_default() {
            let eb = eb.get().take()?;
            let out = graph::GraphBuilder::resolve(&eb, &eloss).ok_or_else(|| {
                local(
                    py,
                    ModelError::new_err(format!("no node `{eloss}` to train as {name}'s loss")),
                )
            })?;
            more.push((name, eb, out));
        }
        let out = graph::GraphBuilder::resolve(&b, loss).ok_or_else(|| {
            local(
                py,
                ModelError::new_err(format!("no node `{loss}` to train as the loss")),
            )
        })?;
        let groups = groups
            .into_iter()
            .map(|(params, o)| {
                Ok(ParamGroup {
                    params,
                    optimizer: optim::extract(&o)?,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let opts = TrainOptions {
            groups,
            max_grad_norm,
            precision,
            loss_scale,
        };
        let train_err = |e: TrainError| match e {
            TrainError::BadLossScale(_) => local(py, PyValueError::new_err(e.to_string())),
            e => local(py, ModelError::new_err(e.to_string())),
        };
        let mut t = py
            .detach(|| training_graph_grouped(b, out, &opts))
            .map_err(train_err)?;
        for (name, eb, out) in more {
            let e = py
                .detach(|| training_graph_grouped(eb, out, &opts))
                .map_err(train_err)?;
            add_entry(
                &mut t.graph,
                &mut t.vars,
                e.graph,
                e.vars,
                &name,
                &format!("{name}/"),
                &[e.loss],
            )
            .map_err(|e| local(py, ModelError::new_err(e.to_string())))?;
        }
        if let Some(dir) = save_to {
            save_job(py, &dir, &t.graph, &t.vars, t.loss.clone(), true, example)?;
        }
        let inputs = placeholders(&t.graph);
        let outputs = outputs
            .filter(|o| !o.is_empty())
            .unwrap_or_else(|| vec![t.loss.clone()]);
        self.load(py, t.graph, t.vars, inputs, outputs)?;
        Ok((t.params, t.state))
    }

    /// Feed buffers of this session's own, with a writable NumPy array
    /// in them for each input (`bufs[name]`, `bufs.inputs`): write the
    /// inputs there and `bufs.run()` runs without copying them (see
    /// docs/python.md). `shapes` gives some inputs another shape than the
    /// model's; `reply_bytes` sizes the slot the outputs come back
    /// through (default: what the model's outputs need, when known).
    #[pyo3(signature = (shapes=None, reply_bytes=None))]
    fn buffers(
        slf: &Bound<'_, Self>,
        shapes: Option<BTreeMap<String, Vec<usize>>>,
        reply_bytes: Option<usize>,
    ) -> PyResult<Buffers> {
        buffers::make(slf, shapes, reply_bytes)
    }

    /// Runs one iteration. `feeds` maps placeholder names to float32/int64
    /// arrays. `fetch`: None → a dict of the model's outputs; a name → that
    /// array; a list of names → a list of arrays.
    #[pyo3(signature = (feeds, fetch=None))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        feeds: &Bound<'py, PyDict>,
        fetch: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.live(py)?;
        if let Some(outs) = self.run_buffered(py, feeds, fetch)? {
            return Ok(outs);
        }
        let (tensors, fetch) = self.feeds_and_fetch(feeds, fetch)?;
        let names = fetch.names();
        let (conn, id) = (self.conn.clone(), self.id);
        let outs = py
            .detach(move || {
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                with(&conn, |c| c.run_in(id, tensors, &refs))
            })
            .map_err(client_error)?;
        fetch.build(py, outs)
    }

    /// Sends one iteration without waiting for it; take its result with
    /// `wait(handle)`. Iterations of a session run in the order sent.
    #[pyo3(signature = (feeds, fetch=None))]
    fn submit_run(
        &self,
        py: Python<'_>,
        feeds: &Bound<'_, PyDict>,
        fetch: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<RunHandle> {
        self.live(py)?;
        let (tensors, fetch) = self.feeds_and_fetch(feeds, fetch)?;
        let names = fetch.names();
        let (conn, id) = (self.conn.clone(), self.id);
        let pending = py
            .detach(move || {
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                with(&conn, |c| c.submit_run_in(id, tensors, &refs))
            })
            .map_err(client_error)?;
        Ok(RunHandle {
            pending: Mutex::new(Some(pending)),
            fetch,
        })
    }

    /// The results of a Run sent with `submit_run` (each handle once).
    fn wait<'py>(&self, py: Python<'py>, handle: &RunHandle) -> PyResult<Bound<'py, PyAny>> {
        let pending = handle
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| PyValueError::new_err("this run was already waited for"))?;
        let conn = self.conn.clone();
        let outs = py
            .detach(move || with(&conn, |c| c.wait_run(pending)))
            .map_err(client_error)?;
        handle.fetch.build(py, outs)
    }

    /// Current values of variables by name (all when `names` is None).
    #[pyo3(signature = (names=None))]
    fn read_variables<'py>(
        &self,
        py: Python<'py>,
        names: Option<Vec<String>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        self.live(py)?;
        let names = names.unwrap_or_default();
        let (conn, id) = (self.conn.clone(), self.id);
        let values = py
            .detach(move || {
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                with(&conn, |c| c.read_variables_in(id, &refs))
            })
            .map_err(client_error)?;
        values_to_dict(py, values)
    }

    /// Overwrites variables (each must exist and keep its shape and dtype).
    fn write_variables(&self, py: Python<'_>, values: &Bound<'_, PyDict>) -> PyResult<()> {
        self.live(py)?;
        let values = values_from_dict(values)?;
        let (conn, id) = (self.conn.clone(), self.id);
        py.detach(move || with(&conn, |c| c.write_variables_in(id, values)))
            .map_err(client_error)
    }

    /// Closes the session; the service frees its memory. Closing twice is
    /// harmless.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        {
            let mut st = self.state();
            if st.closed {
                return Ok(());
            }
            st.closed = true;
            st.spare = None;
        }
        let (conn, id) = (self.conn.clone(), self.id);
        py.detach(move || with(&conn, |c| c.close_in(id)))
            .map_err(client_error)
    }

    #[getter]
    fn closed(&self) -> bool {
        self.state().closed
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("lanes.Session({:?}, id={})", self.name, self.id.0)
    }
}

impl Drop for Session {
    /// A session dropped without `close` is closed if its connection is
    /// free; otherwise the service reclaims it when the client goes.
    fn drop(&mut self) {
        let closed = self.state.get_mut().map(|s| s.closed).unwrap_or(true);
        if closed {
            return;
        }
        if let Ok(mut guard) = self.conn.try_lock() {
            if let Some(c) = guard.as_mut() {
                // Nothing to tell anyone if this fails: the service also
                // reclaims a session whose client went.
                let _ = c.close_in(self.id);
            }
        }
    }
}

/// A Run sent ahead with `Session.submit_run`.
#[pyclass(frozen, module = "lanes._lanes")]
#[derive(Debug)]
pub struct RunHandle {
    pending: Mutex<Option<PendingRun>>,
    fetch: Fetch,
}

#[pymethods]
impl RunHandle {
    /// Whether its result was already taken.
    #[getter]
    fn done(&self) -> bool {
        self.pending.lock().map(|p| p.is_none()).unwrap_or(true)
    }
}

/// Saves a job (`lanes_adaptor::saved`) with its example feeds.
fn save_job(
    py: Python<'_>,
    dir: &std::path::Path,
    graph: &Graph,
    vars: &VarValues,
    fetch: String,
    training: bool,
    example: Option<&Bound<'_, PyDict>>,
) -> PyResult<()> {
    let feeds = match example {
        Some(d) => values_from_dict(d)?,
        None => {
            return Err(PyValueError::new_err(
                "save_to needs `example`: a feed of every placeholder",
            ))
        }
    };
    let job = lanes_adaptor::saved::SavedJob {
        graph: graph.clone(),
        fetch,
        training,
        vars: vars.clone(),
        feeds,
    };
    py.detach(|| lanes_adaptor::saved::save(dir, &job))
        .map_err(|e| local(py, ModelError::new_err(e.to_string())))
}

/// The placeholders of `g`, in graph order.
fn placeholders(g: &Graph) -> Vec<(String, TensorType)> {
    g.nodes
        .iter()
        .filter_map(|n| match &n.op {
            lanes_adaptor::graph::Op::Placeholder(t) => Some((n.name.clone(), t.clone())),
            _ => None,
        })
        .collect()
}

fn dtype_name(t: &TensorType) -> String {
    match t.dtype {
        lanes_adaptor::DType::F32 => "float32".into(),
        lanes_adaptor::DType::I64 => "int64".into(),
        lanes_adaptor::DType::F16 => "float16".into(),
        lanes_adaptor::DType::BF16 => "bfloat16".into(),
    }
}
