//! Python exceptions: every failure is a `LanesError` (or a subclass)
//! carrying the wire error code when the service answered with one.

use lanes_adaptor::onnx::OnnxError;
use lanes_adaptor::{ClientError, ErrorCode, TensorError, ZooError};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    lanes._lanes,
    LanesError,
    PyException,
    "A Lanes call failed; `code` and `code_name` name the service's error code (None when the client failed before the service answered)."
);
create_exception!(
    lanes._lanes,
    NoServiceError,
    LanesError,
    "Nothing answered at the endpoint (no `lanes serve` there?)."
);
create_exception!(
    lanes._lanes,
    LanesTimeoutError,
    LanesError,
    "The service did not answer within the client's timeout."
);
create_exception!(
    lanes._lanes,
    ServiceGoneError,
    LanesError,
    "The service is stopping (`code_name` ShuttingDown) or the connection to it was lost; its sessions are gone."
);
create_exception!(
    lanes._lanes,
    SessionClosedError,
    LanesError,
    "The session was closed."
);
create_exception!(
    lanes._lanes,
    ModelError,
    LanesError,
    "A model could not be imported or built (ONNX import, model zoo), or the service refused its graph."
);
create_exception!(
    lanes._lanes,
    FeedError,
    LanesError,
    "A feed or fetch did not fit the loaded graph (wrong name, shape or dtype)."
);

/// A `cls` exception with `message`, its `code` and `code_name` set.
fn raise(py: Python<'_>, err: PyErr, code: Option<ErrorCode>) -> PyErr {
    let value = err.value(py);
    let (num, name) = match code {
        Some(c) => (Some(c.as_u16()), Some(code_name(c))),
        None => (None, None),
    };
    // Setting attributes on a fresh exception instance cannot fail short of
    // memory exhaustion; if it does, the exception still carries its message.
    let _ = value.setattr("code", num);
    let _ = value.setattr("code_name", name);
    err
}

/// `BadFeed`, `InvalidGraph`, … (`Unknown(n)` for a code this client does
/// not know).
pub fn code_name(code: ErrorCode) -> String {
    format!("{code:?}")
}

/// The Python exception for a client error.
pub fn client_error(err: ClientError) -> PyErr {
    let message = err.to_string();
    let code = err.code();
    Python::attach(|py| {
        let e = match &err {
            ClientError::NoService { .. } => NoServiceError::new_err(message),
            ClientError::Timeout { .. } => LanesTimeoutError::new_err(message),
            ClientError::Closed => SessionClosedError::new_err(message),
            ClientError::ServiceGone { .. } => ServiceGoneError::new_err(message),
            ClientError::Service { code, .. } => match code {
                ErrorCode::BadFeed | ErrorCode::UnknownFetch | ErrorCode::BadVariable => {
                    FeedError::new_err(message)
                }
                ErrorCode::InvalidGraph | ErrorCode::MemoryTooLarge => ModelError::new_err(message),
                ErrorCode::UnknownSession => SessionClosedError::new_err(message),
                ErrorCode::ShuttingDown => ServiceGoneError::new_err(message),
                _ => LanesError::new_err(message),
            },
            _ => LanesError::new_err(message),
        };
        raise(py, e, code)
    })
}

pub fn onnx_error(err: OnnxError) -> PyErr {
    Python::attach(|py| raise(py, ModelError::new_err(err.to_string()), None))
}

pub fn zoo_error(err: ZooError) -> PyErr {
    Python::attach(|py| raise(py, ModelError::new_err(err.to_string()), None))
}

pub fn tensor_error(name: &str, err: TensorError) -> PyErr {
    Python::attach(|py| raise(py, FeedError::new_err(format!("`{name}`: {err}")), None))
}

/// A `LanesError` subclass raised by this client itself (no wire code).
pub fn local(py: Python<'_>, err: PyErr) -> PyErr {
    raise(py, err, None)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("LanesError", py.get_type::<LanesError>())?;
    m.add("NoServiceError", py.get_type::<NoServiceError>())?;
    m.add("LanesTimeoutError", py.get_type::<LanesTimeoutError>())?;
    m.add("SessionClosedError", py.get_type::<SessionClosedError>())?;
    m.add("ServiceGoneError", py.get_type::<ServiceGoneError>())?;
    m.add("ModelError", py.get_type::<ModelError>())?;
    m.add("FeedError", py.get_type::<FeedError>())?;
    Ok(())
}
