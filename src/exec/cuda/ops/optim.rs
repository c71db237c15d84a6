//! The in-place updates on CUDA: the optimizers (`sgd_update`,
//! `adam_update` then `step_incr`, each taking the optional learning-rate
//! scale and skip flag) and loss scaling (`amp_found_init` then
//! `amp_unscale`; `amp_scale_update`), kernels in `elementwise.cu`.

use lanes_adaptor::{Node, Op, TensorType};

use super::super::device::{blocks, grid};
use super::super::program::CudaProgram;
use super::geometry::i;
use crate::exec::ExecError;

impl CudaProgram {
    /// Runs `node`, an update or loss-scaling op, on its input addresses
    /// `inp` (of types `ity`) and output addresses `out`.
    pub(super) fn update(
        &self,
        node: &Node,
        inp: &[u64],
        ity: &[&TensorType],
        out: &[u64],
    ) -> Result<(), ExecError> {
        // An optional one-element input: its address and whether it is
        // there (any valid pointer, the gradient's, when absent).
        let opt = |k: usize| (*inp.get(k).unwrap_or(&inp[1]), i32::from(inp.len() > k));
        let n = ity[0].shape.numel();
        let n32 = i(n);
        match &node.op {
            Op::SgdUpdate {
                lr,
                momentum,
                weight_decay,
                nesterov,
            } => {
                let nest = i32::from(*nesterov);
                let ((scale, has), (skip, has_skip)) = (opt(3), opt(4));
                self.k(
                    "sgd_update",
                    grid(n),
                    &[
                        &inp[0],
                        &inp[1],
                        &inp[2],
                        &n32,
                        lr,
                        momentum,
                        weight_decay,
                        &nest,
                        &scale,
                        &has,
                        &skip,
                        &has_skip,
                    ],
                )
            }
            Op::AdamUpdate {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
            } => {
                let dec = i32::from(*decoupled);
                let ((scale, has), (skip, has_skip)) = (opt(5), opt(6));
                self.k(
                    "adam_update",
                    grid(n),
                    &[
                        &inp[0],
                        &inp[1],
                        &inp[2],
                        &inp[3],
                        &inp[4],
                        &n32,
                        lr,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        &dec,
                        &scale,
                        &has,
                        &skip,
                        &has_skip,
                    ],
                )?;
                self.k("step_incr", blocks(1, 32), &[&inp[4], &skip, &has_skip])
            }
            Op::AmpUnscale => {
                let (found_in, has_in) = opt(2);
                self.k(
                    "amp_found_init",
                    blocks(1, 32),
                    &[&out[1], &found_in, &has_in],
                )?;
                self.k(
                    "amp_unscale",
                    grid(n),
                    &[&out[0], &out[1], &inp[0], &inp[1], &n32],
                )
            }
            Op::AmpScaleUpdate {
                growth_factor,
                backoff_factor,
                growth_interval,
            } => {
                // Checked at validation to be at most 2^24.
                let interval = i(*growth_interval as usize);
                self.k(
                    "amp_scale_update",
                    blocks(1, 32),
                    &[
                        &inp[0],
                        &inp[1],
                        &inp[2],
                        growth_factor,
                        backoff_factor,
                        &interval,
                    ],
                )
            }
            other => Err(ExecError::Op {
                node: node.name.clone(),
                op: other.name(),
                reason: "not an update".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    /// Every kernel launched above is loaded, and defined in
    /// `elementwise.cu` with the parameters passed (counted).
    #[test]
    fn the_kernels_are_loaded_with_their_arities() {
        let src = include_str!("../kernels/elementwise.cu");
        for (k, params) in [
            ("sgd_update", 12),
            ("adam_update", 16),
            ("step_incr", 3),
            ("amp_found_init", 3),
            ("amp_unscale", 5),
            ("amp_scale_update", 6),
        ] {
            assert!(super::super::super::device::loads(k), "{k} is not loaded");
            let head = format!("void {k}(");
            let at = src
                .find(&head)
                .unwrap_or_else(|| panic!("{k} is not defined"));
            let rest = &src[at + head.len()..];
            let list = &rest[..rest.find(')').unwrap_or(0)];
            assert_eq!(list.split(',').count(), params, "{k}'s parameters: {list}");
        }
    }
}
