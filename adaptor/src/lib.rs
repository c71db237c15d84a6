//! `lanes-adaptor`: the library a job links to talk to a Lanes service.
//!
//! It owns the graph IR (an arena of typed nodes), the builder, and the
//! wire contract. It knows nothing of CUDA, lanes or scheduling.

pub mod client;
pub mod graph;
pub mod tensor;
pub mod wire;

pub use client::{Client, ClientError, ClientOptions, Session};
pub use graph::{
    validate, Conv2dAttrs, Graph, GraphBuilder, GraphError, GraphLimits, Node, NodeId, Op, Outlet,
    Pool2dAttrs, ValidGraph, VarValues,
};
pub use tensor::{DType, Shape, Tensor, TensorData, TensorError, TensorType};
pub use wire::{ErrorCode, JobKind, Limits, SessionId, SessionSpec, WireError};
