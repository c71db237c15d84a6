//! Reference architectures for `lanes bench`, built layer for layer as
//! torchvision's `resnet50`, `resnet152`, `inception_v3` (eval, no aux head)
//! and transformers' `BertModel` (bert-base-uncased config, no attention
//! mask, pooler included). Weights are random (timing does not depend on
//! them); batch norms hold their inference statistics.
//!
//! Also included by `tests/conformance/main.rs` to run whole models on both
//! backends.

use anyhow::{bail, Context};
use lanes_adaptor::{
    Conv2dAttrs, Graph, GraphBuilder, Outlet, Pool2dAttrs, Tensor, TensorType, VarValues,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A built model: graph, initial variables, the placeholders to feed and the
/// output to fetch.
#[derive(Debug)]
pub struct Built {
    pub graph: Graph,
    pub vars: VarValues,
    pub inputs: Vec<(String, TensorType)>,
    pub output: String,
    /// Range of integer inputs (token ids), 0 for image models.
    pub vocab: usize,
}

/// `name` at `batch` (image models at their standard resolution; BERT at
/// sequence length `seq`).
pub fn build(name: &str, batch: usize, seq: usize) -> anyhow::Result<Built> {
    match name {
        "resnet50" => resnet(&[3, 4, 6, 3], batch, 224),
        "resnet152" => resnet(&[3, 8, 36, 3], batch, 224),
        "inception_v3" => inception_v3(batch, 299),
        "bert_base" => bert(batch, seq, &BertConfig::base()),
        m => bail!("unknown model `{m}` (resnet50, resnet152, inception_v3, bert_base)"),
    }
}

/// Builder plus a seeded generator for weights.
pub struct Net {
    pub g: GraphBuilder,
    rng: StdRng,
    count: usize,
}

impl Net {
    pub fn new(seed: u64) -> Self {
        Net {
            g: GraphBuilder::new(),
            rng: StdRng::seed_from_u64(seed),
            count: 0,
        }
    }

    /// Uniform(-b, b) with b = 1/sqrt(fan_in) (PyTorch's default bound for biases
    /// and, up to a constant, for weights).
    pub fn param(&mut self, name: &str, dims: &[usize], fan_in: usize) -> Outlet {
        let b = 1.0 / (fan_in.max(1) as f32).sqrt();
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n).map(|_| self.rng.gen_range(-b..b)).collect();
        let t =
            Tensor::from_f32(dims.to_vec(), v).unwrap_or_else(|_| Tensor::full(dims.to_vec(), 0.0));
        let name = self.unique(name);
        self.g.variable(&name, t)
    }

    pub fn constant_param(&mut self, name: &str, dims: &[usize], v: f32) -> Outlet {
        let name = self.unique(name);
        self.g.variable(&name, Tensor::full(dims.to_vec(), v))
    }

    /// Variable names are numbered so that repeated layers in one scope stay
    /// unique.
    fn unique(&mut self, name: &str) -> String {
        self.count += 1;
        format!("{name}_{}", self.count)
    }

    /// conv (no bias) + inference batch norm (+ relu).
    #[allow(clippy::too_many_arguments)]
    pub fn conv_bn(
        &mut self,
        x: Outlet,
        cout: usize,
        k: [usize; 2],
        stride: usize,
        pad: [usize; 2],
        eps: f32,
        relu: bool,
    ) -> Outlet {
        let cin = self.g.dims(x)[1];
        let w = self.param("weight", &[cout, cin, k[0], k[1]], cin * k[0] * k[1]);
        let y = self.g.conv2d(
            x,
            w,
            None,
            Conv2dAttrs {
                stride: [stride, stride],
                padding: pad,
                ..Conv2dAttrs::default()
            },
        );
        let gamma = self.constant_param("bn_gamma", &[cout], 1.0);
        let beta = self.constant_param("bn_beta", &[cout], 0.0);
        let mean = self.constant_param("bn_mean", &[cout], 0.0);
        let var = self.constant_param("bn_var", &[cout], 1.0);
        let y = self.g.batch_norm(y, gamma, beta, mean, var, eps);
        if relu {
            self.g.relu(y)
        } else {
            y
        }
    }

    /// x [..., in] W [in, out] + b.
    pub fn linear(&mut self, x: Outlet, out: usize) -> Outlet {
        let d = self.g.dims(x);
        let cin = d[d.len() - 1];
        let w = self.param("weight", &[cin, out], cin);
        let b = self.param("bias", &[out], cin);
        let y = self.g.matmul(x, w);
        self.g.add(y, b)
    }

    pub fn finish(
        self,
        inputs: Vec<(String, TensorType)>,
        output: Outlet,
        vocab: usize,
    ) -> anyhow::Result<Built> {
        let mut g = self.g;
        g.set_name(output, "output");
        let (graph, vars) = g.finish().context("building the model graph")?;
        Ok(Built {
            graph,
            vars,
            inputs,
            output: "output".into(),
            vocab,
        })
    }
}

fn pool(k: usize, s: usize, p: usize) -> Pool2dAttrs {
    Pool2dAttrs {
        kernel: [k, k],
        stride: [s, s],
        padding: [p, p],
    }
}

/// torchvision ResNet with Bottleneck blocks (v1.5: stride on the 3x3).
pub fn resnet(layers: &[usize; 4], batch: usize, res: usize) -> anyhow::Result<Built> {
    let mut n = Net::new(50);
    let ty = TensorType::f32([batch, 3, res, res]);
    let x = n.g.placeholder("input", ty.clone());
    n.g.push_scope("stem");
    let mut x = n.conv_bn(x, 64, [7, 7], 2, [3, 3], 1e-5, true);
    x = n.g.max_pool2d(x, pool(3, 2, 1));
    n.g.pop_scope();
    let mut inplanes = 64;
    for (li, &blocks) in layers.iter().enumerate() {
        let planes = 64 << li;
        for b in 0..blocks {
            let stride = if b == 0 && li > 0 { 2 } else { 1 };
            n.g.push_scope(&format!("layer{}_{b}", li + 1));
            let identity = if stride != 1 || inplanes != planes * 4 {
                n.g.push_scope("downsample");
                let d = n.conv_bn(x, planes * 4, [1, 1], stride, [0, 0], 1e-5, false);
                n.g.pop_scope();
                d
            } else {
                x
            };
            let y = n.conv_bn(x, planes, [1, 1], 1, [0, 0], 1e-5, true);
            let y = n.conv_bn(y, planes, [3, 3], stride, [1, 1], 1e-5, true);
            let y = n.conv_bn(y, planes * 4, [1, 1], 1, [0, 0], 1e-5, false);
            let y = n.g.add(y, identity);
            x = n.g.relu(y);
            n.g.pop_scope();
            inplanes = planes * 4;
        }
    }
    let x = n.g.global_avg_pool(x);
    n.g.push_scope("fc");
    let y = n.linear(x, 1000);
    n.g.pop_scope();
    n.finish(vec![("input".into(), ty)], y, 0)
}

/// BasicConv2d of Inception-v3: conv + BN(eps 1e-3) + relu.
fn bc(n: &mut Net, x: Outlet, cout: usize, k: [usize; 2], s: usize, p: [usize; 2]) -> Outlet {
    n.conv_bn(x, cout, k, s, p, 1e-3, true)
}

fn inception_a(n: &mut Net, x: Outlet, pool_features: usize) -> Outlet {
    let b1 = bc(n, x, 64, [1, 1], 1, [0, 0]);
    let b5 = bc(n, x, 48, [1, 1], 1, [0, 0]);
    let b5 = bc(n, b5, 64, [5, 5], 1, [2, 2]);
    let b3 = bc(n, x, 64, [1, 1], 1, [0, 0]);
    let b3 = bc(n, b3, 96, [3, 3], 1, [1, 1]);
    let b3 = bc(n, b3, 96, [3, 3], 1, [1, 1]);
    let bp = n.g.avg_pool2d(x, pool(3, 1, 1), true);
    let bp = bc(n, bp, pool_features, [1, 1], 1, [0, 0]);
    n.g.concat(&[b1, b5, b3, bp], 1)
}

fn inception_b(n: &mut Net, x: Outlet) -> Outlet {
    let b3 = bc(n, x, 384, [3, 3], 2, [0, 0]);
    let bd = bc(n, x, 64, [1, 1], 1, [0, 0]);
    let bd = bc(n, bd, 96, [3, 3], 1, [1, 1]);
    let bd = bc(n, bd, 96, [3, 3], 2, [0, 0]);
    let bp = n.g.max_pool2d(x, pool(3, 2, 0));
    n.g.concat(&[b3, bd, bp], 1)
}

fn inception_c(n: &mut Net, x: Outlet, c7: usize) -> Outlet {
    let b1 = bc(n, x, 192, [1, 1], 1, [0, 0]);
    let b7 = bc(n, x, c7, [1, 1], 1, [0, 0]);
    let b7 = bc(n, b7, c7, [1, 7], 1, [0, 3]);
    let b7 = bc(n, b7, 192, [7, 1], 1, [3, 0]);
    let bd = bc(n, x, c7, [1, 1], 1, [0, 0]);
    let bd = bc(n, bd, c7, [7, 1], 1, [3, 0]);
    let bd = bc(n, bd, c7, [1, 7], 1, [0, 3]);
    let bd = bc(n, bd, c7, [7, 1], 1, [3, 0]);
    let bd = bc(n, bd, 192, [1, 7], 1, [0, 3]);
    let bp = n.g.avg_pool2d(x, pool(3, 1, 1), true);
    let bp = bc(n, bp, 192, [1, 1], 1, [0, 0]);
    n.g.concat(&[b1, b7, bd, bp], 1)
}

fn inception_d(n: &mut Net, x: Outlet) -> Outlet {
    let b3 = bc(n, x, 192, [1, 1], 1, [0, 0]);
    let b3 = bc(n, b3, 320, [3, 3], 2, [0, 0]);
    let b7 = bc(n, x, 192, [1, 1], 1, [0, 0]);
    let b7 = bc(n, b7, 192, [1, 7], 1, [0, 3]);
    let b7 = bc(n, b7, 192, [7, 1], 1, [3, 0]);
    let b7 = bc(n, b7, 192, [3, 3], 2, [0, 0]);
    let bp = n.g.max_pool2d(x, pool(3, 2, 0));
    n.g.concat(&[b3, b7, bp], 1)
}

fn inception_e(n: &mut Net, x: Outlet) -> Outlet {
    let b1 = bc(n, x, 320, [1, 1], 1, [0, 0]);
    let b3 = bc(n, x, 384, [1, 1], 1, [0, 0]);
    let b3a = bc(n, b3, 384, [1, 3], 1, [0, 1]);
    let b3b = bc(n, b3, 384, [3, 1], 1, [1, 0]);
    let b3 = n.g.concat(&[b3a, b3b], 1);
    let bd = bc(n, x, 448, [1, 1], 1, [0, 0]);
    let bd = bc(n, bd, 384, [3, 3], 1, [1, 1]);
    let bda = bc(n, bd, 384, [1, 3], 1, [0, 1]);
    let bdb = bc(n, bd, 384, [3, 1], 1, [1, 0]);
    let bd = n.g.concat(&[bda, bdb], 1);
    let bp = n.g.avg_pool2d(x, pool(3, 1, 1), true);
    let bp = bc(n, bp, 192, [1, 1], 1, [0, 0]);
    n.g.concat(&[b1, b3, bd, bp], 1)
}

/// torchvision Inception-v3 in eval mode (no aux head, no input transform).
pub fn inception_v3(batch: usize, res: usize) -> anyhow::Result<Built> {
    let mut n = Net::new(3);
    let ty = TensorType::f32([batch, 3, res, res]);
    let x = n.g.placeholder("input", ty.clone());
    let x = bc(&mut n, x, 32, [3, 3], 2, [0, 0]);
    let x = bc(&mut n, x, 32, [3, 3], 1, [0, 0]);
    let x = bc(&mut n, x, 64, [3, 3], 1, [1, 1]);
    let x = n.g.max_pool2d(x, pool(3, 2, 0));
    let x = bc(&mut n, x, 80, [1, 1], 1, [0, 0]);
    let x = bc(&mut n, x, 192, [3, 3], 1, [0, 0]);
    let mut x = n.g.max_pool2d(x, pool(3, 2, 0));
    for pf in [32, 64, 64] {
        x = inception_a(&mut n, x, pf);
    }
    x = inception_b(&mut n, x);
    for c7 in [128, 160, 160, 192] {
        x = inception_c(&mut n, x, c7);
    }
    x = inception_d(&mut n, x);
    x = inception_e(&mut n, x);
    x = inception_e(&mut n, x);
    let x = n.g.global_avg_pool(x);
    let y = n.linear(x, 1000);
    n.finish(vec![("input".into(), ty)], y, 0)
}

/// Sizes of a BERT encoder.
#[derive(Debug, Clone, Copy)]
pub struct BertConfig {
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub max_positions: usize,
}

impl BertConfig {
    pub fn base() -> Self {
        BertConfig {
            vocab: 30522,
            hidden: 768,
            layers: 12,
            heads: 12,
            intermediate: 3072,
            max_positions: 512,
        }
    }
}

fn layer_norm(n: &mut Net, x: Outlet, d: usize) -> Outlet {
    let g = n.constant_param("ln_gamma", &[d], 1.0);
    let b = n.constant_param("ln_beta", &[d], 0.0);
    n.g.layer_norm(x, g, b, 1e-12)
}

/// transformers' BertModel: embeddings, encoder, pooler (tanh on [CLS]).
/// The output is the pooled [batch, hidden] tensor.
pub fn bert(batch: usize, seq: usize, c: &BertConfig) -> anyhow::Result<Built> {
    if seq > c.max_positions || c.hidden % c.heads != 0 {
        bail!("sequence {seq} too long or heads do not divide hidden");
    }
    let (d, h) = (c.hidden, c.heads);
    let dh = d / h;
    let mut n = Net::new(11);
    let ids_ty = TensorType::i64([batch, seq]);
    let ids = n.g.placeholder("input_ids", ids_ty.clone());
    n.g.push_scope("embeddings");
    let word = n.param("word", &[c.vocab, d], d);
    let pos = n.param("position", &[c.max_positions, d], d);
    let typ = n.param("token_type", &[2, d], d);
    let pos_ids = n.g.constant(Tensor::from_i64(
        [1, seq],
        (0..seq as i64).collect::<Vec<_>>(),
    )?);
    let type_ids = n.g.constant(Tensor::from_i64([1, seq], vec![0; seq])?);
    let e = n.g.embedding(word, ids);
    let p = n.g.embedding(pos, pos_ids);
    let t = n.g.embedding(typ, type_ids);
    let e = n.g.add(e, p);
    let e = n.g.add(e, t);
    let mut x = layer_norm(&mut n, e, d);
    n.g.pop_scope();
    let scale = 1.0 / (dh as f32).sqrt();
    for l in 0..c.layers {
        n.g.push_scope(&format!("layer{l}"));
        let heads = |n: &mut Net, x: Outlet| {
            let y = n.linear(x, d);
            let y = n.g.reshape(y, &[batch, seq, h, dh]);
            n.g.transpose(y, &[0, 2, 1, 3])
        };
        let q = heads(&mut n, x);
        let k = heads(&mut n, x);
        let v = heads(&mut n, x);
        let s = n.g.matmul_t(q, k, false, true);
        let s = n.g.scale(s, scale);
        let p = n.g.softmax(s, 3);
        let a = n.g.matmul(p, v);
        let a = n.g.transpose(a, &[0, 2, 1, 3]);
        let a = n.g.reshape(a, &[batch, seq, d]);
        let a = n.linear(a, d);
        let a = n.g.add(a, x);
        let a = layer_norm(&mut n, a, d);
        let f = n.linear(a, c.intermediate);
        let f = n.g.gelu(f);
        let f = n.linear(f, d);
        let f = n.g.add(f, a);
        x = layer_norm(&mut n, f, d);
        n.g.pop_scope();
    }
    n.g.push_scope("pooler");
    let cls = n.g.slice(x, 1, 0, 1);
    let cls = n.g.reshape(cls, &[batch, d]);
    let y = n.linear(cls, d);
    let y = n.g.tanh(y);
    n.g.pop_scope();
    n.finish(vec![("input_ids".into(), ids_ty)], y, c.vocab)
}
