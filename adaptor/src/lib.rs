//! `lanes-adaptor`: the library a job links to talk to a Lanes service.
//!
//! It owns the graph IR (an arena of typed nodes), the builder, and the
//! wire contract. It knows nothing of CUDA, lanes or scheduling.

pub mod amp;
pub mod autodiff;
pub mod checkpoint;
pub mod client;
pub mod graph;
pub mod nn;
#[cfg(feature = "onnx")]
pub mod onnx;
pub mod optim;
pub mod placement;
pub mod saved;
pub mod tensor;
pub mod wire;
pub mod zoo;

pub use amp::{AmpError, Precision};
pub use autodiff::{gradients, trainable_variables, AutodiffError};
pub use checkpoint::CheckpointError;
pub use client::{
    check_endpoint, BufferOutputs, Client, ClientError, ClientOptions, EndpointError, FeedBuffers,
    PendingBufferRun, PendingRun, Session,
};
pub use graph::{
    validate, Conv2dAttrs, Entry, Graph, GraphBuilder, GraphError, GraphLimits, Node, NodeId, Op,
    Outlet, Part, Pool2dAttrs, ValidGraph, VarValues,
};
pub use optim::{
    lr_variable, training_graph, training_graph_at, training_graph_from, training_graph_grouped,
    LossScale, Optimizer, ParamGroup, TrainError, TrainOptions, TrainingGraph, FOUND_INF_NODE,
    GROWTH_TRACKER_VARIABLE, SCALE_VARIABLE,
};
pub use tensor::{bf16, f16, DType, Shape, Tensor, TensorData, TensorError, TensorType};
pub use wire::auth::AuthKey;
pub use wire::{ErrorCode, JobKind, Limits, SessionId, SessionSpec, WireError};
pub use zoo::{Arch, ModelGraph, ZooError};
