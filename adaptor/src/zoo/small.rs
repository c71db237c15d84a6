//! Small models for tests and examples: MLP, LeNet-style CNN, ResNet-18 for
//! 32×32 inputs, and a 2-layer transformer encoder classifier.

use super::{Forward, Target};
use crate::nn::{Nn, WeightInit};
use crate::tensor::{Tensor, TensorType};

pub(super) fn mlp(
    mut nn: Nn,
    batch: usize,
    inputs: usize,
    hidden: &[usize],
    classes: usize,
) -> Forward {
    let ty = TensorType::f32([batch, inputs]);
    let mut h = nn.g.placeholder("input", ty.clone());
    for (i, &w) in hidden.iter().enumerate() {
        h = nn.linear(&format!("fc{}", i + 1), h, w, true);
        h = nn.g.relu(h);
    }
    let out = nn.linear(&format!("fc{}", hidden.len() + 1), h, classes, true);
    Forward {
        nn,
        inputs: vec![("input".into(), ty)],
        output: out,
        aux: None,
        target: Target::Classes(classes),
    }
}

pub(super) fn lenet(
    mut nn: Nn,
    batch: usize,
    channels: usize,
    image: usize,
    classes: usize,
) -> Forward {
    let ty = TensorType::f32([batch, channels, image, image]);
    let x = nn.g.placeholder("input", ty.clone());
    let d = WeightInit::TorchDefault;
    let b = Some(crate::nn::BiasInit::TorchDefault);
    let h = nn.conv2d("conv1", x, 6, [5, 5], [1, 1], [2, 2], d, b);
    let h = nn.g.relu(h);
    let h = nn.max_pool(h, 2, 2, 0);
    let pad = if image < 16 { 2 } else { 0 };
    let h = nn.conv2d("conv2", h, 16, [5, 5], [1, 1], [pad, pad], d, b);
    let h = nn.g.relu(h);
    let h = nn.max_pool(h, 2, 2, 0);
    let h = nn.g.flatten(h);
    let h = nn.linear("fc1", h, 120, true);
    let h = nn.g.relu(h);
    let h = nn.linear("fc2", h, 84, true);
    let h = nn.g.relu(h);
    let out = nn.linear("fc3", h, classes, true);
    Forward {
        nn,
        inputs: vec![("input".into(), ty)],
        output: out,
        aux: None,
        target: Target::Classes(classes),
    }
}

pub(super) fn resnet18_cifar(mut nn: Nn, batch: usize, classes: usize) -> Forward {
    let ty = TensorType::f32([batch, 3, 32, 32]);
    let x = nn.g.placeholder("input", ty.clone());
    let k = WeightInit::KaimingNormalFanOut;
    let mut h = nn.conv_bn("conv1", "bn1", x, 64, [3, 3], [1, 1], [1, 1], k, 1e-5, true);
    for (stage, planes) in [64, 128, 256, 512].into_iter().enumerate() {
        let stride = if stage == 0 { 1 } else { 2 };
        h = nn.scoped(&format!("layer{}", stage + 1), |nn| {
            let h = nn.basic_block("0", h, planes, stride);
            nn.basic_block("1", h, planes, 1)
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

/// Sizes of [`transformer`].
#[derive(Debug, Clone, Copy)]
pub(super) struct TransformerCfg {
    pub vocab: usize,
    pub seq: usize,
    pub dim: usize,
    pub heads: usize,
    pub ff: usize,
    pub classes: usize,
}

/// Token + learned position embeddings, two post-norm encoder layers
/// (`nn.TransformerEncoderLayer` with ReLU), mean over the sequence, linear classifier.
pub(super) fn transformer(mut nn: Nn, batch: usize, c: TransformerCfg) -> Forward {
    let ty = TensorType::i64([batch, c.seq]);
    let ids = nn.g.placeholder("input_ids", ty.clone());
    let e = nn.embedding("embed", ids, c.vocab, c.dim, None);
    let pos = Tensor::from_i64([c.seq], (0..c.seq as i64).collect())
        .unwrap_or_else(|_| Tensor::zeros(&TensorType::i64([c.seq])));
    let pos = nn.g.constant(pos);
    let pe = nn.embedding("pos_embed", pos, c.seq, c.dim, None);
    let mut h = nn.g.add(e, pe);
    for l in 0..2 {
        h = nn.scoped(&format!("layers/{l}"), |nn| {
            let a = nn.self_attention("self_attn", h, c.heads, None);
            let a = nn.g.add(h, a);
            let a = nn.layer_norm("norm1", a, 1e-5);
            let f = nn.linear("linear1", a, c.ff, true);
            let f = nn.g.relu(f);
            let f = nn.linear("linear2", f, c.dim, true);
            let f = nn.g.add(a, f);
            nn.layer_norm("norm2", f, 1e-5)
        });
    }
    let pooled = nn.g.mean(h, &[1], false);
    let out = nn.linear("classifier", pooled, c.classes, true);
    Forward {
        nn,
        inputs: vec![("input_ids".into(), ty)],
        output: out,
        aux: None,
        target: Target::Classes(c.classes),
    }
}
