//! `Session.buffers()`: NumPy arrays that live in a session's feed buffers.
//!
//! The buffers are a segment of shared memory (a memfd) the service reads
//! each Run's inputs from and writes its outputs to. Python maps the same
//! memory a second time (`mmap.mmap` of another descriptor of it), and the
//! arrays are `numpy.frombuffer` views of that mapping: their memory is
//! Python's own, kept for as long as any array (through its base, the
//! `mmap`) lives, whatever becomes of the buffers or the session. So a
//! view never dangles and no code here is unsafe. Closing the buffers (or
//! the session) only stops Runs from them.
//!
//! Also `Session.run`'s own feed buffers (each array copied into them) and
//! the size of the reply slot a model's outputs need.

use super::{with, Fetch, Session};
use crate::convert::{feed_type, write_feed};
use crate::errors::{client_error, local, FeedError, SessionClosedError};
use lanes_adaptor::{BufferOutputs, ClientError, DType, FeedBuffers, Graph, Tensor, TensorType};
use pyo3::exceptions::{PyKeyError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// A session's feed buffers, with an array viewing each input's place.
#[pyclass(frozen, module = "lanes._lanes")]
#[derive(Debug)]
pub struct Buffers {
    session: Py<Session>,
    /// The buffers; `None` once closed. Held for the whole of a Run, so
    /// Runs from one `Buffers` on several threads take turns.
    inner: Mutex<Option<FeedBuffers>>,
    /// Set by `close` (read without waiting for a Run that holds `inner`).
    closed: AtomicBool,
    /// Bytes of the reply slot.
    reply_bytes: usize,
    /// The reply slot's size as asked for (the key of its reuse).
    asked_reply: usize,
    /// Python's own mapping of the segment (an `mmap.mmap`).
    map: Py<PyAny>,
    /// `{input name: array}`, in the model's order.
    inputs: Py<PyDict>,
    names: Vec<String>,
}

/// What a Run from the buffers gave.
enum Ran {
    Tensors(Vec<Tensor>),
    InSlot(Vec<(TensorType, std::ops::Range<usize>)>),
}

/// The NumPy dtype of `dtype` (bfloat16: ml_dtypes').
fn numpy_dtype<'py>(py: Python<'py>, dtype: DType) -> PyResult<Bound<'py, PyAny>> {
    Ok(match dtype {
        DType::F32 => "<f4".into_pyobject(py)?.into_any(),
        DType::I64 => "<i8".into_pyobject(py)?.into_any(),
        DType::F16 => "<f2".into_pyobject(py)?.into_any(),
        DType::BF16 => py
            .import("ml_dtypes")
            .and_then(|m| m.getattr("bfloat16"))
            .map_err(|e| {
                PyTypeError::new_err(format!(
                    "bfloat16 buffers need the ml_dtypes package for their NumPy dtype \
                     (pip install ml-dtypes): {e}"
                ))
            })?,
    })
}

/// An array of type `ty` viewing `map` from byte `at`; read-only unless
/// `writable`.
fn view<'py>(
    map: &Bound<'py, PyAny>,
    ty: &TensorType,
    at: usize,
    writable: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let py = map.py();
    let kw = PyDict::new(py);
    kw.set_item("dtype", numpy_dtype(py, ty.dtype)?)?;
    kw.set_item("count", ty.shape.numel())?;
    kw.set_item("offset", at)?;
    let flat = py
        .import("numpy")?
        .call_method("frombuffer", (map,), Some(&kw))?;
    let a = flat.call_method1("reshape", (PyTuple::new(py, ty.shape.dims())?,))?;
    if !writable {
        let kw = PyDict::new(py);
        kw.set_item("write", false)?;
        a.call_method("setflags", (), Some(&kw))?;
    }
    Ok(a)
}

/// Buffers for `session`'s inputs (`shapes` overrides some by name),
/// with a reply slot of `reply_bytes` (else as large as the session's
/// outputs need, when known).
pub(super) fn make(
    session: &Bound<'_, Session>,
    shapes: Option<BTreeMap<String, Vec<usize>>>,
    reply_bytes: Option<usize>,
) -> PyResult<Buffers> {
    let py = session.py();
    let s = session.get();
    s.live(py)?;
    let (mut types, hint) = {
        let st = s.state();
        (st.inputs.clone(), st.reply_bytes)
    };
    if types.is_empty() {
        return Err(local(
            py,
            FeedError::new_err(format!(
                "session `{}` has no model with inputs: load one before asking for its buffers",
                s.name
            )),
        ));
    }
    let names: Vec<String> = types.iter().map(|(n, _)| n.clone()).collect();
    for (name, dims) in shapes.unwrap_or_default() {
        let Some((_, ty)) = types.iter_mut().find(|(n, _)| *n == name) else {
            return Err(no_input(&name, &names));
        };
        *ty = TensorType::new(ty.dtype, dims);
    }
    let reply = reply_bytes
        .or(hint)
        .unwrap_or(lanes_adaptor::client::DEFAULT_REPLY_BYTES);
    // The last closed buffers' segment, when it has these inputs and room
    // for the reply.
    let spare = s
        .state()
        .spare
        .take()
        .filter(|(asked, b)| *asked == reply && holds(b, &types));
    let made = match spare {
        Some((_, b)) => b,
        None => new_buffers(py, s, &types, reply).map_err(client_error)?,
    };
    let file = made.segment_file().map_err(client_error)?;
    let map = py
        .import("mmap")?
        .getattr("mmap")?
        .call1((file.as_raw_fd(), made.segment_len()))?;
    // The mapping took a descriptor of its own.
    drop(file);
    let inputs = PyDict::new(py);
    for (name, _) in &types {
        let (at, ty) = made
            .feed_place(name)
            .ok_or_else(|| no_input(name, &names))?;
        inputs.set_item(name, view(&map, ty, at, true)?)?;
    }
    Ok(Buffers {
        session: session.clone().unbind(),
        reply_bytes: made.reply_bytes(),
        asked_reply: reply,
        inner: Mutex::new(Some(made)),
        closed: AtomicBool::new(false),
        map: map.unbind(),
        inputs: inputs.unbind(),
        names,
    })
}

fn no_input(name: &str, names: &[String]) -> PyErr {
    PyKeyError::new_err(format!(
        "no input `{name}`; the model's inputs are {}",
        names
            .iter()
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// Whether `b` holds feeds of exactly these names and types, in order.
fn holds(b: &FeedBuffers, types: &[(String, TensorType)]) -> bool {
    b.feeds().count() == types.len()
        && b.feeds()
            .zip(types)
            .all(|((n, t), (m, u))| n == m && t == u)
}

/// New feed buffers in session `s` for `types`, with a reply slot of
/// `reply` bytes (the GIL released while the service makes them).
fn new_buffers(
    py: Python<'_>,
    s: &Session,
    types: &[(String, TensorType)],
    reply: usize,
) -> Result<FeedBuffers, ClientError> {
    let (conn, id, want) = (s.conn.clone(), s.id, types.to_vec());
    py.detach(move || {
        let refs: Vec<(&str, TensorType)> =
            want.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
        with(&conn, |c| c.feed_buffers_with_reply_in(id, &refs, reply))
    })
}

impl Buffers {
    /// `SessionClosedError` when the session or these buffers are closed.
    fn live(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.session.get();
        s.live(py)?;
        if self.closed.load(Ordering::Acquire) {
            return Err(local(
                py,
                SessionClosedError::new_err(format!(
                    "the buffers of session `{}` are closed",
                    s.name
                )),
            ));
        }
        Ok(())
    }
}

#[pymethods]
impl Buffers {
    /// `{input name: array}`: writable arrays in the shared memory the
    /// service reads each Run's inputs from.
    #[getter]
    fn inputs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.live(py)?;
        Ok(self.inputs.bind(py).clone())
    }

    /// The inputs' names, in the model's order.
    fn keys(&self) -> Vec<String> {
        self.names.clone()
    }

    fn __getitem__<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        self.live(py)?;
        self.inputs
            .bind(py)
            .get_item(name)?
            .ok_or_else(|| no_input(name, &self.names))
    }

    /// Copies `value` into input `name`'s array (`bufs[name][...] = value`).
    fn __setitem__(&self, py: Python<'_>, name: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let a = self.__getitem__(py, name)?;
        a.set_item(py.Ellipsis(), value)
    }

    fn __contains__(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    fn __len__(&self) -> usize {
        self.names.len()
    }

    /// Bytes of the reply slot: outputs that fit come back through it.
    #[getter]
    fn reply_bytes(&self) -> usize {
        self.reply_bytes
    }

    /// Runs one iteration with what the input arrays hold now (nothing is
    /// copied in). `fetch` as `Session.run`'s. With `copy=False`, outputs
    /// that came back through the reply slot are read-only arrays viewing
    /// it: valid until the next `run` of these buffers, which overwrites
    /// them in place (copy one to keep it).
    #[pyo3(signature = (fetch=None, *, copy=true))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        fetch: Option<&Bound<'py, PyAny>>,
        copy: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let s = self.session.get();
        s.live(py)?;
        let fetch: Fetch = s.fetch_of(fetch)?;
        let names = fetch.names();
        let conn = s.conn.clone();
        let inner = &self.inner;
        let ran = py.detach(|| -> Result<Option<(Ran, Option<usize>)>, ClientError> {
            let mut guard = inner.lock().unwrap_or_else(|e| e.into_inner());
            let Some(b) = guard.as_mut() else {
                return Ok(None);
            };
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            let outs = with(&conn, |c| c.run_buffers_in_place(b, &refs))?;
            let wanted = b.reply_wanted().filter(|&n| n > b.reply_bytes());
            let ran = match outs {
                BufferOutputs::InSlot(places) if !copy => Ran::InSlot(places),
                outs => Ran::Tensors(b.take(outs)?),
            };
            Ok(Some((ran, wanted)))
        });
        let Some((ran, wanted)) = ran.map_err(client_error)? else {
            self.live(py)?;
            // `live` raises for closed buffers; nothing else takes them.
            return Err(local(
                py,
                SessionClosedError::new_err("the buffers are closed"),
            ));
        };
        if let Some(n) = wanted {
            // Buffers made from now on have a slot that holds them.
            s.state().reply_bytes = Some(n);
        }
        match ran {
            Ran::Tensors(t) => fetch.build(py, t),
            Ran::InSlot(places) => {
                let map = self.map.bind(py);
                let arrays = places
                    .iter()
                    .map(|(ty, r)| view(map, ty, r.start, false))
                    .collect::<PyResult<Vec<_>>>()?;
                fetch.build_arrays(py, arrays)
            }
        }
    }

    /// Stops Runs from these buffers (arrays already taken stay readable:
    /// their memory is theirs). Their segment goes back to the session:
    /// the next `buffers()` of the same inputs reuses it, so arrays kept
    /// from these then view that one's inputs. Closing twice is harmless.
    fn close(&self, py: Python<'_>) {
        self.closed.store(true, Ordering::Release);
        let inner = &self.inner;
        let old = py.detach(|| inner.lock().unwrap_or_else(|e| e.into_inner()).take());
        let s = self.session.get();
        if let Some(b) = old {
            let mut st = s.state();
            if !st.closed {
                // A spare of other inputs goes (its segment stays with the
                // service until the session closes).
                st.spare = Some((self.asked_reply, b));
            }
        }
    }

    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire) || self.session.get().state().closed
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
        format!(
            "lanes.Buffers(session={:?}, inputs={:?})",
            self.session.get().name,
            self.names
        )
    }
}

impl Session {
    /// `run` through feed buffers in shared memory: each array is copied
    /// once, straight into the segment the service reads it from (on the
    /// GPU: one DMA from there), and the request carries only a header.
    /// `None` when that path does not apply (shared memory unavailable,
    /// another thread's `run` holds the buffers, an array that is not
    /// float32/int64): the caller sends the feeds in the request, which
    /// also gives the usual errors.
    pub(super) fn run_buffered<'py>(
        &self,
        py: Python<'py>,
        feeds: &Bound<'py, PyDict>,
        fetch: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let mut types = Vec::with_capacity(feeds.len());
        for (k, v) in feeds.iter() {
            let (Ok(name), Some(ty)) = (k.extract::<String>(), feed_type(&v)) else {
                return Ok(None);
            };
            types.push((name, ty));
        }
        let buffers = {
            let mut st = self.state();
            if st.no_buffers || st.buffers_out {
                return Ok(None);
            }
            st.buffers_out = true;
            st.buffers.take()
        };
        // Whatever way this returns, the buffers are back (or gone) after.
        let _back = BuffersOut(self);
        let mut buffers = match buffers {
            Some(b) if holds(&b, &types) => b,
            _ => {
                let reply = self
                    .state()
                    .reply_bytes
                    .unwrap_or(lanes_adaptor::client::DEFAULT_REPLY_BYTES);
                match new_buffers(py, self, &types, reply) {
                    Ok(b) => b,
                    Err(ClientError::NoSharedMemory { .. }) => {
                        self.state().no_buffers = true;
                        return Ok(None);
                    }
                    Err(e) => return Err(client_error(e)),
                }
            }
        };
        for (k, v) in feeds.iter() {
            let name: String = k.extract()?;
            write_feed(&mut buffers, &name, &v)?;
        }
        let fetch = self.fetch_of(fetch)?;
        let names = fetch.names();
        let conn = self.conn.clone();
        let (buffers, outs) = py.detach(move || {
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            let outs = with(&conn, |c| c.run_buffers_in(&mut buffers, &refs));
            (buffers, outs)
        });
        {
            let mut st = self.state();
            match buffers.reply_wanted() {
                // Outputs larger than the slot: the next `run` makes
                // buffers whose slot holds them.
                Some(n) if n > buffers.reply_bytes() => st.reply_bytes = Some(n),
                _ => st.buffers = Some(buffers),
            }
        }
        fetch.build(py, outs.map_err(client_error)?).map(Some)
    }
}

/// Marks a session's feed buffers as no longer out when dropped.
struct BuffersOut<'a>(&'a Session);

impl Drop for BuffersOut<'_> {
    fn drop(&mut self) {
        self.0.state().buffers_out = false;
    }
}

/// Bytes of a reply slot that holds the outputs `outputs` of `g`, when
/// they need more than the default slot; `None` when they fit it or a
/// name does not resolve.
pub(super) fn reply_hint(g: &Graph, outputs: &[String]) -> Option<usize> {
    use lanes_adaptor::wire::shm::{FEED_ALIGN, REPLY_HEADER};
    // The slot's table (bincode of the types) is smaller than this.
    let mut need = REPLY_HEADER.checked_add(64)?;
    for name in outputs {
        let ty = g.outlet_type(g.resolve(name)?)?;
        need = need
            .checked_add(24 + 8 * ty.shape.rank())?
            .checked_add(ty.checked_bytes()?.checked_next_multiple_of(FEED_ALIGN)?)?
            .checked_add(FEED_ALIGN)?;
    }
    (need > lanes_adaptor::client::DEFAULT_REPLY_BYTES).then_some(need)
}
