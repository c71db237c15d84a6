//! The rules of the in-place optimizer updates and of loss scaling's ops
//! (`AmpUnscale`, `AmpScaleUpdate`): f32 only, one-element learning-rate
//! scales, skip flags and scaler state.

use super::{arity, arity_between, f32s, non_negative, positive, same_shape, Op, TensorType, R};

/// Output types of an update or loss-scaling op (the callers' match routes
/// only these here).
pub(super) fn infer(op: &Op, inputs: &[TensorType]) -> R<Vec<TensorType>> {
    match op {
        Op::SgdUpdate {
            lr,
            momentum,
            weight_decay,
            ..
        } => {
            arity_between(inputs, 3, 5)?;
            f32s(op, inputs)?;
            one_element(inputs, 3, "the learning-rate scale")?;
            one_element(inputs, 4, "the skip flag")?;
            non_negative(*lr, "lr")?;
            non_negative(*momentum, "momentum")?;
            non_negative(*weight_decay, "weight_decay")?;
            same_shape(&inputs[0], &inputs[1])?;
            same_shape(&inputs[0], &inputs[2])?;
            Ok(vec![])
        }
        Op::AdamUpdate {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            ..
        } => {
            arity_between(inputs, 5, 7)?;
            f32s(op, inputs)?;
            one_element(inputs, 5, "the learning-rate scale")?;
            one_element(inputs, 6, "the skip flag")?;
            non_negative(*lr, "lr")?;
            positive(*eps, "eps")?;
            non_negative(*weight_decay, "weight_decay")?;
            for (b, n) in [(beta1, "beta1"), (beta2, "beta2")] {
                if !(0.0..1.0).contains(b) {
                    return Err(format!("{n} {b} is not in [0, 1)"));
                }
            }
            for t in &inputs[1..4] {
                same_shape(&inputs[0], t)?;
            }
            one_element(inputs, 4, "step")?;
            Ok(vec![])
        }
        Op::AmpUnscale => {
            arity_between(inputs, 2, 3)?;
            f32s(op, inputs)?;
            one_element(inputs, 1, "the loss scale")?;
            one_element(inputs, 2, "the found flag")?;
            Ok(vec![inputs[0].clone(), TensorType::f32([1])])
        }
        Op::AmpScaleUpdate {
            growth_factor,
            backoff_factor,
            growth_interval,
        } => {
            arity(inputs, 3)?;
            f32s(op, inputs)?;
            for (k, what) in ["the loss scale", "the growth tracker", "the found flag"]
                .into_iter()
                .enumerate()
            {
                one_element(inputs, k, what)?;
            }
            if !(growth_factor.is_finite() && *growth_factor > 1.0) {
                return Err(format!("growth_factor {growth_factor} must be above 1"));
            }
            if !(*backoff_factor > 0.0 && *backoff_factor < 1.0) {
                return Err(format!("backoff_factor {backoff_factor} is not in (0, 1)"));
            }
            // The tracker counts in f32, exact up to 2^24.
            if *growth_interval == 0 || *growth_interval > 1 << 24 {
                return Err(format!(
                    "growth_interval {growth_interval} is not in [1, 2^24]"
                ));
            }
            Ok(vec![])
        }
        _ => Err(format!("{} is not an update", op.name())),
    }
}

/// Input `k`, when present, holds one element.
fn one_element(inputs: &[TensorType], k: usize, what: &str) -> R<()> {
    match inputs.get(k) {
        Some(t) if t.shape.numel() != 1 => {
            Err(format!("{what} must hold one element, got {}", t.shape))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn f(dims: &[usize]) -> TensorType {
        TensorType::f32(dims.to_vec())
    }

    #[test]
    fn unscale_gives_the_gradient_and_a_flag() {
        let out = infer(&Op::AmpUnscale, &[f(&[3, 2]), f(&[1])]).unwrap();
        assert_eq!(out, vec![f(&[3, 2]), f(&[1])]);
        let out = infer(&Op::AmpUnscale, &[f(&[4]), f(&[]), f(&[1])]).unwrap();
        assert_eq!(out, vec![f(&[4]), f(&[1])]);
        assert!(infer(&Op::AmpUnscale, &[f(&[4]), f(&[2])]).is_err());
        assert!(infer(&Op::AmpUnscale, &[f(&[4])]).is_err());
        let half = TensorType::new(crate::tensor::DType::F16, [4]);
        let e = infer(&Op::AmpUnscale, &[half, f(&[1])]).unwrap_err();
        assert!(e.contains("f32 only"), "{e}");
    }

    #[test]
    fn scale_update_checks_its_factors() {
        let ok = Op::AmpScaleUpdate {
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        };
        let ins = [f(&[1]), f(&[1]), f(&[1])];
        assert_eq!(infer(&ok, &ins).unwrap(), vec![]);
        for bad in [
            Op::AmpScaleUpdate {
                growth_factor: 1.0,
                backoff_factor: 0.5,
                growth_interval: 1,
            },
            Op::AmpScaleUpdate {
                growth_factor: 2.0,
                backoff_factor: 1.0,
                growth_interval: 1,
            },
            Op::AmpScaleUpdate {
                growth_factor: 2.0,
                backoff_factor: 0.5,
                growth_interval: 0,
            },
        ] {
            assert!(infer(&bad, &ins).is_err(), "{bad:?}");
        }
        assert!(infer(&ok, &[f(&[1]), f(&[2]), f(&[1])]).is_err());
    }

    #[test]
    fn updates_take_a_skip_flag_after_the_rate_scale() {
        let sgd = Op::SgdUpdate {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: false,
        };
        let p = f(&[3]);
        let base = [p.clone(), p.clone(), p.clone(), f(&[1])];
        assert!(infer(&sgd, &[&base[..], &[f(&[1])]].concat()).is_ok());
        assert!(infer(&sgd, &[&base[..], &[f(&[2])]].concat()).is_err());
        assert!(infer(&sgd, &[&base[..], &[f(&[1]), f(&[1])]].concat()).is_err());
    }
}
