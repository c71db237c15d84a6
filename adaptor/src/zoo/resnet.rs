//! torchvision's ResNet with Bottleneck blocks (v1.5: the stride sits on the
//! 3×3 conv), for 224×224 RGB input.

use super::{Forward, Target};
use crate::nn::{Nn, WeightInit};
use crate::tensor::TensorType;

/// ResNet with `layers` Bottleneck blocks per stage (ResNet-50: [3, 4, 6, 3],
/// ResNet-152: [3, 8, 36, 3]).
pub(super) fn resnet(mut nn: Nn, batch: usize, layers: [usize; 4], classes: usize) -> Forward {
    let ty = TensorType::f32([batch, 3, 224, 224]);
    let x = nn.g.placeholder("input", ty.clone());
    let k = WeightInit::KaimingNormalFanOut;
    let mut h = nn.conv_bn("conv1", "bn1", x, 64, [7, 7], [2, 2], [3, 3], k, 1e-5, true);
    h = nn.max_pool(h, 3, 2, 1);
    for (stage, (&blocks, planes)) in layers.iter().zip([64, 128, 256, 512]).enumerate() {
        let stride = if stage == 0 { 1 } else { 2 };
        h = nn.scoped(&format!("layer{}", stage + 1), |nn| {
            let mut h = h;
            for b in 0..blocks {
                h = nn.bottleneck(&b.to_string(), h, planes, if b == 0 { stride } else { 1 });
            }
            h
        });
    }
    let pooled = nn.g.global_avg_pool(h);
    let out = nn.linear("fc", pooled, classes, true);
    Forward {
        nn,
        inputs: vec![("input".into(), ty)],
        output: out,
        aux: None,
        target: Target::Classes(classes),
    }
}
