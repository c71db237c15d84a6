//! Layers: Linear, Conv2d, BatchNorm2d, LayerNorm, Embedding, multi-head
//! self-attention and residual blocks, built into a [`GraphBuilder`] with
//! deterministic, seeded initial values.
//!
//! Initialisation follows PyTorch's defaults unless a model asks otherwise:
//! Linear and Conv2d weights Kaiming-uniform with `a = √5` (that is
//! `U(-1/√fan_in, 1/√fan_in)`), biases `U(-1/√fan_in, 1/√fan_in)`;
//! BatchNorm/LayerNorm weight 1, bias 0, running mean 0, running var 1;
//! Embedding `N(0, 1)`; the attention projections Xavier-uniform over the
//! fused `[3D, D]` input projection and zero biases, as `nn.MultiheadAttention`.
//!
//! Variables are named like PyTorch's state-dict keys with `/` for `.`:
//! `layer1/0/conv1/weight`, `bn1/running_mean`.

use crate::graph::{Conv2dAttrs, GraphBuilder, Op, Outlet, Pool2dAttrs};
use crate::tensor::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

/// Seeded source of initial values. The same seed and the same sequence of
/// layers give bit-identical variables.
#[derive(Debug, Clone)]
pub struct Init {
    rng: StdRng,
}

impl Init {
    pub fn new(seed: u64) -> Self {
        Init {
            rng: StdRng::seed_from_u64(seed),
        }
    }
    /// `U(-bound, bound)`.
    pub fn uniform(&mut self, shape: &[usize], bound: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v = (0..n)
            .map(|_| (self.rng.gen::<f32>() * 2.0 - 1.0) * bound)
            .collect();
        Tensor::from_f32(shape.to_vec(), v).unwrap_or_else(|_| Tensor::full(shape.to_vec(), 0.0))
    }
    /// `N(0, std²)`.
    pub fn normal(&mut self, shape: &[usize], std: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v = (0..n)
            .map(|_| {
                let z: f32 = StandardNormal.sample(&mut self.rng);
                z * std
            })
            .collect();
        Tensor::from_f32(shape.to_vec(), v).unwrap_or_else(|_| Tensor::full(shape.to_vec(), 0.0))
    }
    /// `N(0, std²)` truncated to `[-2, 2]` (absolute bounds, as
    /// `torch.nn.init.trunc_normal_` with its defaults).
    pub fn trunc_normal(&mut self, shape: &[usize], std: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            let z: f32 = StandardNormal.sample(&mut self.rng);
            let x = z * std;
            if (-2.0..=2.0).contains(&x) {
                v.push(x);
            }
        }
        Tensor::from_f32(shape.to_vec(), v).unwrap_or_else(|_| Tensor::full(shape.to_vec(), 0.0))
    }
}

/// How a weight is initialised. `fan_in`/`fan_out` count the receptive field.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WeightInit {
    /// PyTorch's default for Linear/Conv: Kaiming-uniform, `a = √5`.
    TorchDefault,
    /// `kaiming_normal_(mode="fan_out", nonlinearity="relu")` (torchvision ResNet).
    KaimingNormalFanOut,
    /// `N(0, std²)` (BERT uses 0.02).
    Normal(f32),
    /// Truncated normal (torchvision Inception-v3).
    TruncNormal(f32),
    /// Xavier (Glorot) uniform over the given fans.
    XavierUniform { fan_in: usize, fan_out: usize },
}

/// How a bias is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BiasInit {
    /// `U(-1/√fan_in, 1/√fan_in)`.
    TorchDefault,
    Zeros,
}

/// Whether layers are built for training (batch statistics, running-stat
/// updates) or inference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Train,
    Infer,
}

/// A graph under construction plus the initialiser and the mode: the
/// context every layer is built in.
#[derive(Debug)]
pub struct Nn {
    pub g: GraphBuilder,
    pub init: Init,
    pub mode: Mode,
}

impl Nn {
    pub fn new(seed: u64, mode: Mode) -> Self {
        Nn {
            g: GraphBuilder::new(),
            init: Init::new(seed),
            mode,
        }
    }

    /// Runs `f` in the name scope `name`.
    pub fn scoped<T>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> T) -> T {
        self.g.push_scope(name);
        let r = f(self);
        self.g.pop_scope();
        r
    }

    fn weight(&mut self, shape: &[usize], fan_in: usize, fan_out: usize, wi: WeightInit) -> Tensor {
        match wi {
            WeightInit::TorchDefault => self
                .init
                .uniform(shape, 1.0 / (fan_in.max(1) as f32).sqrt()),
            WeightInit::KaimingNormalFanOut => self
                .init
                .normal(shape, (2.0 / fan_out.max(1) as f32).sqrt()),
            WeightInit::Normal(std) => self.init.normal(shape, std),
            WeightInit::TruncNormal(std) => self.init.trunc_normal(shape, std),
            WeightInit::XavierUniform { fan_in, fan_out } => self
                .init
                .uniform(shape, (6.0 / (fan_in + fan_out).max(1) as f32).sqrt()),
        }
    }

    fn bias(&mut self, n: usize, fan_in: usize, bi: BiasInit) -> Tensor {
        match bi {
            BiasInit::TorchDefault => self.init.uniform(&[n], 1.0 / (fan_in.max(1) as f32).sqrt()),
            BiasInit::Zeros => Tensor::full([n], 0.0),
        }
    }

    /// `nn.Linear(in, out)` on the last axis of `x`, PyTorch's default init.
    pub fn linear(&mut self, name: &str, x: Outlet, out: usize, bias: bool) -> Outlet {
        let bi = if bias {
            Some(BiasInit::TorchDefault)
        } else {
            None
        };
        self.linear_with(name, x, out, WeightInit::TorchDefault, bi)
    }

    /// Linear with chosen initialisation; weight `[out, in]` as PyTorch stores it.
    pub fn linear_with(
        &mut self,
        name: &str,
        x: Outlet,
        out: usize,
        wi: WeightInit,
        bias: Option<BiasInit>,
    ) -> Outlet {
        let inp = self.g.dims(x).last().copied().unwrap_or(0);
        self.scoped(name, |nn| {
            let w = nn.weight(&[out, inp], inp, out, wi);
            let w = nn.g.variable("weight", w);
            let y = nn.g.matmul_t(x, w, false, true);
            match bias {
                Some(bi) => {
                    let b = nn.bias(out, inp, bi);
                    let b = nn.g.variable("bias", b);
                    nn.g.add(y, b)
                }
                None => y,
            }
        })
    }

    /// `nn.Conv2d` (groups 1); weight `[out, in, kh, kw]`.
    #[allow(clippy::too_many_arguments)]
    pub fn conv2d(
        &mut self,
        name: &str,
        x: Outlet,
        out: usize,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        wi: WeightInit,
        bias: Option<BiasInit>,
    ) -> Outlet {
        let cin = self.g.dims(x).get(1).copied().unwrap_or(0);
        let fan_in = cin * kernel[0] * kernel[1];
        let fan_out = out * kernel[0] * kernel[1];
        self.scoped(name, |nn| {
            let w = nn.weight(&[out, cin, kernel[0], kernel[1]], fan_in, fan_out, wi);
            let w = nn.g.variable("weight", w);
            let b = bias.map(|bi| {
                let t = nn.bias(out, fan_in, bi);
                nn.g.variable("bias", t)
            });
            let attrs = Conv2dAttrs {
                stride,
                padding,
                dilation: [1, 1],
                groups: 1,
            };
            nn.g.conv2d(x, w, b, attrs)
        })
    }

    /// `nn.BatchNorm2d` (also fine for [N, C]): the training form normalises
    /// with batch statistics and updates the running ones in place.
    pub fn batch_norm(&mut self, name: &str, x: Outlet, eps: f32, momentum: f32) -> Outlet {
        let c = self.g.dims(x).get(1).copied().unwrap_or(0);
        let mode = self.mode;
        self.scoped(name, |nn| {
            let gamma = nn.g.variable("weight", Tensor::full([c], 1.0));
            let beta = nn.g.variable("bias", Tensor::full([c], 0.0));
            let mean = nn.g.variable("running_mean", Tensor::full([c], 0.0));
            let var = nn.g.variable("running_var", Tensor::full([c], 1.0));
            match mode {
                Mode::Train => nn.g.op(
                    Op::BatchNormTrain { eps, momentum },
                    &[x, gamma, beta, mean, var],
                )[..]
                    .first()
                    .copied()
                    .unwrap_or(x),
                Mode::Infer => nn.g.batch_norm(x, gamma, beta, mean, var, eps),
            }
        })
    }

    /// `nn.LayerNorm(D)` over the last axis.
    pub fn layer_norm(&mut self, name: &str, x: Outlet, eps: f32) -> Outlet {
        let d = self.g.dims(x).last().copied().unwrap_or(0);
        self.scoped(name, |nn| {
            let gamma = nn.g.variable("weight", Tensor::full([d], 1.0));
            let beta = nn.g.variable("bias", Tensor::full([d], 0.0));
            nn.g.layer_norm(x, gamma, beta, eps)
        })
    }

    /// `nn.Embedding(vocab, dim)`; `std` None means PyTorch's `N(0, 1)`.
    pub fn embedding(
        &mut self,
        name: &str,
        indices: Outlet,
        vocab: usize,
        dim: usize,
        std: Option<f32>,
    ) -> Outlet {
        self.scoped(name, |nn| {
            let t = nn.init.normal(&[vocab, dim], std.unwrap_or(1.0));
            let table = nn.g.variable("weight", t);
            nn.g.embedding(table, indices)
        })
    }

    /// Multi-head self-attention over `x` [B, S, D] (no mask), with separate
    /// query/key/value/output projections. `wi` None gives
    /// `nn.MultiheadAttention`'s init (Xavier-uniform over the fused
    /// [3D, D] projection, zero biases; output projection default weight,
    /// zero bias); `Some(std)` gives BERT's `N(0, std²)` with zero biases.
    pub fn self_attention(
        &mut self,
        name: &str,
        x: Outlet,
        heads: usize,
        std: Option<f32>,
    ) -> Outlet {
        let dims = self.g.dims(x);
        let (b, s, d) = match dims.as_slice() {
            &[b, s, d] => (b, s, d),
            _ => (0, 0, 0),
        };
        let heads = heads.max(1);
        let dh = d / heads;
        let (wi_in, wi_out) = match std {
            Some(std) => (WeightInit::Normal(std), WeightInit::Normal(std)),
            None => (
                WeightInit::XavierUniform {
                    fan_in: d,
                    fan_out: 3 * d,
                },
                WeightInit::TorchDefault,
            ),
        };
        let zero = Some(BiasInit::Zeros);
        self.scoped(name, |nn| {
            let proj = |nn: &mut Nn, n: &str| {
                let p = nn.linear_with(n, x, d, wi_in, zero);
                let p = nn.g.reshape(p, &[b, s, heads, dh]);
                nn.g.transpose(p, &[0, 2, 1, 3]) // [B, H, S, dh]
            };
            let q = proj(nn, "query");
            let k = proj(nn, "key");
            let v = proj(nn, "value");
            let scores = nn.g.matmul_t(q, k, false, true); // [B, H, S, S]
            let scores = nn.g.scale(scores, 1.0 / (dh.max(1) as f32).sqrt());
            let p = nn.g.softmax(scores, 3);
            let ctx = nn.g.matmul(p, v); // [B, H, S, dh]
            let ctx = nn.g.transpose(ctx, &[0, 2, 1, 3]);
            let ctx = nn.g.reshape(ctx, &[b, s, d]);
            nn.linear_with("output", ctx, d, wi_out, zero)
        })
    }

    /// Conv (no bias) + BatchNorm (+ ReLU): the common CNN unit.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_bn(
        &mut self,
        conv: &str,
        bn: &str,
        x: Outlet,
        out: usize,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        wi: WeightInit,
        eps: f32,
        relu: bool,
    ) -> Outlet {
        let y = self.conv2d(conv, x, out, kernel, stride, padding, wi, None);
        let y = self.batch_norm(bn, y, eps, 0.1);
        if relu {
            self.g.relu(y)
        } else {
            y
        }
    }

    /// torchvision's `BasicBlock` (two 3×3 convs, expansion 1), with a 1×1
    /// conv + BN shortcut when the shape changes.
    pub fn basic_block(&mut self, name: &str, x: Outlet, planes: usize, stride: usize) -> Outlet {
        let cin = self.g.dims(x).get(1).copied().unwrap_or(0);
        let k = WeightInit::KaimingNormalFanOut;
        self.scoped(name, |nn| {
            let s = [stride, stride];
            let h = nn.conv_bn("conv1", "bn1", x, planes, [3, 3], s, [1, 1], k, 1e-5, true);
            let h = nn.conv_bn(
                "conv2",
                "bn2",
                h,
                planes,
                [3, 3],
                [1, 1],
                [1, 1],
                k,
                1e-5,
                false,
            );
            let short = if stride != 1 || cin != planes {
                nn.scoped("downsample", |nn| {
                    nn.conv_bn("0", "1", x, planes, [1, 1], s, [0, 0], k, 1e-5, false)
                })
            } else {
                x
            };
            let y = nn.g.add(h, short);
            nn.g.relu(y)
        })
    }

    /// torchvision's `Bottleneck` (1×1, 3×3 with the stride, 1×1 ×4), with a
    /// 1×1 conv + BN shortcut when the shape changes.
    pub fn bottleneck(&mut self, name: &str, x: Outlet, planes: usize, stride: usize) -> Outlet {
        let cin = self.g.dims(x).get(1).copied().unwrap_or(0);
        let out = planes * 4;
        let k = WeightInit::KaimingNormalFanOut;
        self.scoped(name, |nn| {
            let s = [stride, stride];
            let h = nn.conv_bn(
                "conv1",
                "bn1",
                x,
                planes,
                [1, 1],
                [1, 1],
                [0, 0],
                k,
                1e-5,
                true,
            );
            let h = nn.conv_bn("conv2", "bn2", h, planes, [3, 3], s, [1, 1], k, 1e-5, true);
            let h = nn.conv_bn(
                "conv3",
                "bn3",
                h,
                out,
                [1, 1],
                [1, 1],
                [0, 0],
                k,
                1e-5,
                false,
            );
            let short = if stride != 1 || cin != out {
                nn.scoped("downsample", |nn| {
                    nn.conv_bn("0", "1", x, out, [1, 1], s, [0, 0], k, 1e-5, false)
                })
            } else {
                x
            };
            let y = nn.g.add(h, short);
            nn.g.relu(y)
        })
    }

    /// Max pooling with a square window.
    pub fn max_pool(&mut self, x: Outlet, k: usize, stride: usize, pad: usize) -> Outlet {
        self.g.max_pool2d(
            x,
            Pool2dAttrs {
                kernel: [k, k],
                stride: [stride, stride],
                padding: [pad, pad],
            },
        )
    }

    /// Average pooling with a square window (PyTorch's `count_include_pad=True`).
    pub fn avg_pool(&mut self, x: Outlet, k: usize, stride: usize, pad: usize) -> Outlet {
        self.g.avg_pool2d(
            x,
            Pool2dAttrs {
                kernel: [k, k],
                stride: [stride, stride],
                padding: [pad, pad],
            },
            true,
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::tensor::TensorType;

    #[test]
    fn init_is_seeded_and_bounded() {
        let a = Init::new(7).uniform(&[100], 0.5);
        let b = Init::new(7).uniform(&[100], 0.5);
        let c = Init::new(8).uniform(&[100], 0.5);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.f32s().unwrap().iter().all(|v| v.abs() <= 0.5));
        let t = Init::new(1).trunc_normal(&[1000], 3.0);
        assert!(t.f32s().unwrap().iter().all(|v| v.abs() <= 2.0));
    }

    #[test]
    fn linear_default_init_bound_and_names() {
        let mut nn = Nn::new(0, Mode::Infer);
        let x = nn.g.placeholder("x", TensorType::f32([2, 16]));
        let y = nn.linear("fc", x, 4, true);
        assert_eq!(nn.g.dims(y), vec![2, 4]);
        let vars = nn.g.var_values();
        let w = vars.get("fc/weight").unwrap();
        assert_eq!(w.shape().dims(), &[4, 16]);
        assert!(w.f32s().unwrap().iter().all(|v| v.abs() <= 0.25));
        assert!(vars.contains_key("fc/bias"));
    }

    #[test]
    fn attention_and_blocks_infer() {
        let mut nn = Nn::new(0, Mode::Train);
        let x = nn.g.placeholder("x", TensorType::f32([2, 5, 8]));
        let y = nn.self_attention("attn", x, 2, None);
        assert_eq!(nn.g.dims(y), vec![2, 5, 8]);
        let img = nn.g.placeholder("img", TensorType::f32([1, 8, 8, 8]));
        let b = nn.bottleneck("b", img, 4, 2);
        assert_eq!(nn.g.dims(b), vec![1, 16, 4, 4]);
        let c = nn.basic_block("c", img, 8, 1);
        assert_eq!(nn.g.dims(c), vec![1, 8, 8, 8]);
        assert!(nn.g.error().is_none(), "{:?}", nn.g.error());
    }
}
