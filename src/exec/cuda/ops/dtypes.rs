//! Which dtypes the CUDA kernels take: the ops that run on fp16/bf16
//! tensors (every other op is refused for them when a program is built) and
//! the kernel of each cast.

use lanes_adaptor::{DType, Op};

use crate::exec::ExecError;

/// Whether the CUDA backend runs `op` on fp16/bf16 tensors: the ops
/// docs/precision.md lists as half or f32 (elementwise maps, activations and
/// their gradients, copies, Cast, MatMul, convolutions) and the sums, means
/// and maxima (SumTo: a half bias's gradient). Every other op is f32 only
/// here, whatever shape inference allows.
fn takes_half(op: &Op) -> bool {
    matches!(
        op,
        Op::Placeholder(_)
            | Op::Variable(_)
            | Op::Constant(_)
            | Op::Add
            | Op::Sub
            | Op::Mul
            | Op::Div
            | Op::Relu
            | Op::Gelu
            | Op::Sigmoid
            | Op::Tanh
            | Op::Exp
            | Op::Log
            | Op::Sqrt
            | Op::Scale(_)
            | Op::Erf
            | Op::IsNan
            | Op::HardSigmoid
            | Op::HardSwish
            | Op::Clip { .. }
            | Op::ReluGrad
            | Op::GeluGrad
            | Op::SigmoidGrad
            | Op::TanhGrad
            | Op::HardSigmoidGrad
            | Op::HardSwishGrad
            | Op::Cast { .. }
            | Op::Reshape { .. }
            | Op::Assign
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::SliceGrad { .. }
            | Op::Concat { .. }
            | Op::BroadcastTo { .. }
            | Op::SumTo { .. }
            | Op::ReduceSum { .. }
            | Op::ReduceMean { .. }
            | Op::ReduceMax { .. }
            | Op::MatMul { .. }
            | Op::Conv2d(_)
            | Op::Conv2dGradInput { .. }
            | Op::Conv2dGradFilter { .. }
    )
}

/// Refuses a graph with a half tensor going into or out of an op the CUDA
/// kernels run in f32 only (`ExecError::UnsupportedDType`), before any
/// device work: such a kernel would read 16-bit values as f32.
pub(in crate::exec::cuda) fn check_half(g: &lanes_adaptor::Graph) -> Result<(), ExecError> {
    for node in &g.nodes {
        if takes_half(&node.op) {
            continue;
        }
        let ins = node
            .inputs
            .iter()
            .filter_map(|o| g.nodes.get(o.node.index())?.outputs.get(o.slot as usize));
        if let Some(t) = node.outputs.iter().chain(ins).find(|t| t.dtype.is_half()) {
            return Err(ExecError::UnsupportedDType {
                dtype: t.dtype,
                backend: "CUDA",
            });
        }
    }
    Ok(())
}

/// The kernel of a cast between two different dtypes (`elementwise.cu`):
/// every pair of float types, f32 ↔ i64 and i64 → fp16/bf16.
pub(super) fn cast_kernel(from: DType, to: DType) -> Option<&'static str> {
    use DType::{BF16, F16, F32, I64};
    Some(match (from, to) {
        (F32, I64) => "cast_f32_i64",
        (I64, F32) => "cast_i64_f32",
        (F32, F16) => "cast_f32_f16",
        (F32, BF16) => "cast_f32_bf16",
        (F16, F32) => "cast_f16_f32",
        (BF16, F32) => "cast_bf16_f32",
        (F16, BF16) => "cast_f16_bf16",
        (BF16, F16) => "cast_bf16_f16",
        (I64, F16) => "cast_i64_f16",
        (I64, BF16) => "cast_i64_bf16",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every cast the CPU reference does between two dtypes has a kernel
    /// that `device.rs` loads; a half → i64 cast (refused by the CPU too)
    /// has none.
    #[test]
    fn every_cast_has_a_loaded_kernel() {
        use DType::{BF16, F16, F32, I64};
        let all = [F32, F16, BF16, I64];
        let mut n = 0;
        for from in all {
            for to in all {
                if from == to {
                    continue;
                }
                match cast_kernel(from, to) {
                    Some(k) => {
                        assert!(crate::exec::cuda::device::loads(k), "{k} is not loaded");
                        n += 1;
                    }
                    None => assert!(from.is_half() && to == I64, "{from:?} -> {to:?}"),
                }
            }
        }
        assert_eq!(n, 10);
    }

    /// A half tensor into an f32-only op is refused before any device
    /// work (so also without a GPU); a half MatMul is not. (Graphs built
    /// by hand: shape inference may refuse the first one itself.)
    #[test]
    fn half_into_an_f32_only_op_is_refused() {
        use lanes_adaptor::{Graph, Node, NodeId, Outlet, TensorType};
        let graph = |dtype: DType, op: Op| Graph {
            nodes: vec![
                Node {
                    name: "x".into(),
                    op: Op::Placeholder(TensorType::new(dtype, [4, 4])),
                    inputs: vec![],
                    outputs: vec![TensorType::new(dtype, [4, 4])],
                },
                Node {
                    name: "y".into(),
                    op,
                    inputs: vec![Outlet::new(NodeId(0), 0); 2],
                    outputs: vec![TensorType::new(dtype, [4, 4])],
                },
            ],
            entries: Vec::new(),
        };
        for dtype in [DType::F16, DType::BF16] {
            let mm = Op::MatMul {
                transpose_a: false,
                transpose_b: false,
            };
            assert!(check_half(&graph(dtype, mm)).is_ok(), "{dtype:?} matmul");
            match check_half(&graph(dtype, Op::Softmax { axis: 1 })) {
                Err(ExecError::UnsupportedDType { dtype: d, backend }) => {
                    assert_eq!((d, backend), (dtype, "CUDA"));
                }
                other => panic!("{dtype:?} softmax: {other:?}"),
            }
        }
        assert!(check_half(&graph(DType::F32, Op::Softmax { axis: 1 })).is_ok());
    }
}
