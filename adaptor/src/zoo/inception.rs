//! torchvision's Inception-v3 (`aux_logits=True`, 299×299 RGB input).
//! Every conv is torchvision's `BasicConv2d`: conv without bias, BatchNorm
//! with eps 0.001, ReLU; weights truncated-normal with std 0.1 (0.01 and
//! 0.001 for the auxiliary head's conv1 and fc), as torchvision initialises.

use super::{Forward, Target};
use crate::graph::Outlet;
use crate::nn::{BiasInit, Mode, Nn, WeightInit};
use crate::tensor::TensorType;

/// `BasicConv2d` named `name` (its conv is `name/conv`, its BN `name/bn`).
fn basic(
    nn: &mut Nn,
    name: &str,
    x: Outlet,
    out: usize,
    k: [usize; 2],
    s: usize,
    p: [usize; 2],
) -> Outlet {
    basic_std(nn, name, x, out, k, s, p, 0.1)
}

#[allow(clippy::too_many_arguments)]
fn basic_std(
    nn: &mut Nn,
    name: &str,
    x: Outlet,
    out: usize,
    k: [usize; 2],
    s: usize,
    p: [usize; 2],
    std: f32,
) -> Outlet {
    nn.scoped(name, |nn| {
        nn.conv_bn(
            "conv",
            "bn",
            x,
            out,
            k,
            [s, s],
            p,
            WeightInit::TruncNormal(std),
            1e-3,
            true,
        )
    })
}

fn sq(k: usize) -> [usize; 2] {
    [k, k]
}

fn inception_a(nn: &mut Nn, name: &str, x: Outlet, pool_features: usize) -> Outlet {
    nn.scoped(name, |nn| {
        let b1 = basic(nn, "branch1x1", x, 64, sq(1), 1, sq(0));
        let b5 = basic(nn, "branch5x5_1", x, 48, sq(1), 1, sq(0));
        let b5 = basic(nn, "branch5x5_2", b5, 64, sq(5), 1, sq(2));
        let b3 = basic(nn, "branch3x3dbl_1", x, 64, sq(1), 1, sq(0));
        let b3 = basic(nn, "branch3x3dbl_2", b3, 96, sq(3), 1, sq(1));
        let b3 = basic(nn, "branch3x3dbl_3", b3, 96, sq(3), 1, sq(1));
        let bp = nn.avg_pool(x, 3, 1, 1);
        let bp = basic(nn, "branch_pool", bp, pool_features, sq(1), 1, sq(0));
        nn.g.concat(&[b1, b5, b3, bp], 1)
    })
}

fn inception_b(nn: &mut Nn, name: &str, x: Outlet) -> Outlet {
    nn.scoped(name, |nn| {
        let b3 = basic(nn, "branch3x3", x, 384, sq(3), 2, sq(0));
        let bd = basic(nn, "branch3x3dbl_1", x, 64, sq(1), 1, sq(0));
        let bd = basic(nn, "branch3x3dbl_2", bd, 96, sq(3), 1, sq(1));
        let bd = basic(nn, "branch3x3dbl_3", bd, 96, sq(3), 2, sq(0));
        let bp = nn.max_pool(x, 3, 2, 0);
        nn.g.concat(&[b3, bd, bp], 1)
    })
}

fn inception_c(nn: &mut Nn, name: &str, x: Outlet, c7: usize) -> Outlet {
    let (r17, c71) = ([1, 7], [7, 1]);
    let (p17, p71) = ([0, 3], [3, 0]);
    nn.scoped(name, |nn| {
        let b1 = basic(nn, "branch1x1", x, 192, sq(1), 1, sq(0));
        let b7 = basic(nn, "branch7x7_1", x, c7, sq(1), 1, sq(0));
        let b7 = basic(nn, "branch7x7_2", b7, c7, r17, 1, p17);
        let b7 = basic(nn, "branch7x7_3", b7, 192, c71, 1, p71);
        let bd = basic(nn, "branch7x7dbl_1", x, c7, sq(1), 1, sq(0));
        let bd = basic(nn, "branch7x7dbl_2", bd, c7, c71, 1, p71);
        let bd = basic(nn, "branch7x7dbl_3", bd, c7, r17, 1, p17);
        let bd = basic(nn, "branch7x7dbl_4", bd, c7, c71, 1, p71);
        let bd = basic(nn, "branch7x7dbl_5", bd, 192, r17, 1, p17);
        let bp = nn.avg_pool(x, 3, 1, 1);
        let bp = basic(nn, "branch_pool", bp, 192, sq(1), 1, sq(0));
        nn.g.concat(&[b1, b7, bd, bp], 1)
    })
}

fn inception_d(nn: &mut Nn, name: &str, x: Outlet) -> Outlet {
    nn.scoped(name, |nn| {
        let b3 = basic(nn, "branch3x3_1", x, 192, sq(1), 1, sq(0));
        let b3 = basic(nn, "branch3x3_2", b3, 320, sq(3), 2, sq(0));
        let b7 = basic(nn, "branch7x7x3_1", x, 192, sq(1), 1, sq(0));
        let b7 = basic(nn, "branch7x7x3_2", b7, 192, [1, 7], 1, [0, 3]);
        let b7 = basic(nn, "branch7x7x3_3", b7, 192, [7, 1], 1, [3, 0]);
        let b7 = basic(nn, "branch7x7x3_4", b7, 192, sq(3), 2, sq(0));
        let bp = nn.max_pool(x, 3, 2, 0);
        nn.g.concat(&[b3, b7, bp], 1)
    })
}

fn inception_e(nn: &mut Nn, name: &str, x: Outlet) -> Outlet {
    nn.scoped(name, |nn| {
        let b1 = basic(nn, "branch1x1", x, 320, sq(1), 1, sq(0));
        let b3 = basic(nn, "branch3x3_1", x, 384, sq(1), 1, sq(0));
        let b3a = basic(nn, "branch3x3_2a", b3, 384, [1, 3], 1, [0, 1]);
        let b3b = basic(nn, "branch3x3_2b", b3, 384, [3, 1], 1, [1, 0]);
        let b3 = nn.g.concat(&[b3a, b3b], 1);
        let bd = basic(nn, "branch3x3dbl_1", x, 448, sq(1), 1, sq(0));
        let bd = basic(nn, "branch3x3dbl_2", bd, 384, sq(3), 1, sq(1));
        let bda = basic(nn, "branch3x3dbl_3a", bd, 384, [1, 3], 1, [0, 1]);
        let bdb = basic(nn, "branch3x3dbl_3b", bd, 384, [3, 1], 1, [1, 0]);
        let bd = nn.g.concat(&[bda, bdb], 1);
        let bp = nn.avg_pool(x, 3, 1, 1);
        let bp = basic(nn, "branch_pool", bp, 192, sq(1), 1, sq(0));
        nn.g.concat(&[b1, b3, bd, bp], 1)
    })
}

fn aux_head(nn: &mut Nn, x: Outlet, classes: usize) -> Outlet {
    nn.scoped("AuxLogits", |nn| {
        let h = nn.avg_pool(x, 5, 3, 0);
        let h = basic(nn, "conv0", h, 128, sq(1), 1, sq(0));
        let h = basic_std(nn, "conv1", h, 768, sq(5), 1, sq(0), 0.01);
        let h = nn.g.global_avg_pool(h);
        nn.linear_with(
            "fc",
            h,
            classes,
            WeightInit::TruncNormal(0.001),
            Some(BiasInit::TorchDefault),
        )
    })
}

pub(super) fn inception_v3(mut nn: Nn, batch: usize, classes: usize) -> Forward {
    let ty = TensorType::f32([batch, 3, 299, 299]);
    let x = nn.g.placeholder("input", ty.clone());
    let n = &mut nn;
    let h = basic(n, "Conv2d_1a_3x3", x, 32, sq(3), 2, sq(0));
    let h = basic(n, "Conv2d_2a_3x3", h, 32, sq(3), 1, sq(0));
    let h = basic(n, "Conv2d_2b_3x3", h, 64, sq(3), 1, sq(1));
    let h = n.max_pool(h, 3, 2, 0);
    let h = basic(n, "Conv2d_3b_1x1", h, 80, sq(1), 1, sq(0));
    let h = basic(n, "Conv2d_4a_3x3", h, 192, sq(3), 1, sq(0));
    let h = n.max_pool(h, 3, 2, 0);
    let h = inception_a(n, "Mixed_5b", h, 32);
    let h = inception_a(n, "Mixed_5c", h, 64);
    let h = inception_a(n, "Mixed_5d", h, 64);
    let h = inception_b(n, "Mixed_6a", h);
    let h = inception_c(n, "Mixed_6b", h, 128);
    let h = inception_c(n, "Mixed_6c", h, 160);
    let h = inception_c(n, "Mixed_6d", h, 160);
    let h = inception_c(n, "Mixed_6e", h, 192);
    let aux = (n.mode == Mode::Train).then(|| aux_head(n, h, classes));
    let h = inception_d(n, "Mixed_7a", h);
    let h = inception_e(n, "Mixed_7b", h);
    let h = inception_e(n, "Mixed_7c", h);
    let h = n.g.global_avg_pool(h);
    let out = n.linear_with(
        "fc",
        h,
        classes,
        WeightInit::TruncNormal(0.1),
        Some(BiasInit::TorchDefault),
    );
    Forward {
        nn,
        inputs: vec![("input".into(), ty)],
        output: out,
        aux,
        target: Target::Classes(classes),
    }
}
