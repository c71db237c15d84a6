//! Model-sized graphs for the planner's quality test and bench: ResNet-50/152,
//! Inception-v3 and BERT-base, inference or training. Training graphs get
//! their backward pass from a small tape (the IR's grad ops, gradients
//! summed where a tensor has several readers) and an SGD-with-momentum
//! update per weight. Weights are variables without values: planning needs
//! types only.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use lanes_adaptor::{
    validate, Conv2dAttrs, GraphBuilder, GraphLimits, Op, Outlet, Pool2dAttrs, TensorType,
    ValidGraph,
};
use std::collections::{HashMap, HashSet};

/// One recorded forward op, enough to emit its backward rule.
enum Rec {
    Conv {
        x: Outlet,
        w: Outlet,
        y: Outlet,
        attrs: Conv2dAttrs,
    },
    BnTrain {
        x: Outlet,
        gamma: Outlet,
        beta: Outlet,
        y: Outlet,
        mean: Outlet,
        invstd: Outlet,
    },
    Unary {
        x: Outlet,
        y: Outlet,
        grad: Op,
        /// Backward reads the op's output (softmax) instead of its input.
        reads_output: bool,
    },
    Pool {
        x: Outlet,
        y: Outlet,
        attrs: Pool2dAttrs,
        avg: bool,
    },
    Concat {
        xs: Vec<Outlet>,
        y: Outlet,
    },
    Add {
        a: Outlet,
        b: Outlet,
        y: Outlet,
    },
    Gap {
        x: Outlet,
        y: Outlet,
    },
    MatMul {
        a: Outlet,
        b: Outlet,
        y: Outlet,
        tb: bool,
    },
    Scale {
        x: Outlet,
        y: Outlet,
        f: f32,
    },
    Reshape {
        x: Outlet,
        y: Outlet,
    },
    Transpose {
        x: Outlet,
        y: Outlet,
        perm: Vec<usize>,
    },
    LayerNorm {
        x: Outlet,
        gamma: Outlet,
        beta: Outlet,
        y: Outlet,
    },
    Embedding {
        table: Outlet,
        ids: Outlet,
        y: Outlet,
        rows: usize,
    },
    Ce {
        logits: Outlet,
        labels: Outlet,
    },
}

struct Net {
    b: GraphBuilder,
    train: bool,
    tape: Vec<Rec>,
    params: Vec<Outlet>,
}

impl Net {
    fn new(train: bool) -> Self {
        Net {
            b: GraphBuilder::new(),
            train,
            tape: Vec::new(),
            params: Vec::new(),
        }
    }
    fn dims(&self, o: Outlet) -> Vec<usize> {
        self.b.dims(o)
    }
    fn var(&mut self, shape: &[usize]) -> Outlet {
        self.b
            .op1(Op::Variable(TensorType::f32(shape.to_vec())), &[])
    }
    fn param(&mut self, shape: &[usize]) -> Outlet {
        let p = self.var(shape);
        self.params.push(p);
        p
    }
    fn conv(&mut self, x: Outlet, out: usize, k: usize, stride: usize) -> Outlet {
        self.conv_k(x, out, [k, k], stride, [k / 2, k / 2])
    }
    fn conv_k(
        &mut self,
        x: Outlet,
        out: usize,
        k: [usize; 2],
        stride: usize,
        padding: [usize; 2],
    ) -> Outlet {
        let c = self.dims(x)[1];
        let w = self.param(&[out, c, k[0], k[1]]);
        let attrs = Conv2dAttrs {
            stride: [stride, stride],
            padding,
            ..Conv2dAttrs::default()
        };
        let y = self.b.conv2d(x, w, None, attrs);
        self.tape.push(Rec::Conv { x, w, y, attrs });
        y
    }
    fn max_pool(&mut self, x: Outlet, k: usize, stride: usize, pad: usize) -> Outlet {
        let attrs = Pool2dAttrs {
            kernel: [k, k],
            stride: [stride, stride],
            padding: [pad, pad],
        };
        let y = self.b.max_pool2d(x, attrs);
        self.tape.push(Rec::Pool {
            x,
            y,
            attrs,
            avg: false,
        });
        y
    }
    fn avg_pool(&mut self, x: Outlet, k: usize, stride: usize, pad: usize) -> Outlet {
        let attrs = Pool2dAttrs {
            kernel: [k, k],
            stride: [stride, stride],
            padding: [pad, pad],
        };
        let y = self.b.avg_pool2d(x, attrs, true);
        self.tape.push(Rec::Pool {
            x,
            y,
            attrs,
            avg: true,
        });
        y
    }
    fn concat(&mut self, xs: &[Outlet]) -> Outlet {
        let y = self.b.concat(xs, 1);
        self.tape.push(Rec::Concat { xs: xs.to_vec(), y });
        y
    }
    fn gap(&mut self, x: Outlet) -> Outlet {
        let y = self.b.global_avg_pool(x);
        self.tape.push(Rec::Gap { x, y });
        y
    }
    fn bn(&mut self, x: Outlet) -> Outlet {
        let c = self.dims(x)[1];
        let (gamma, beta) = (self.param(&[c]), self.param(&[c]));
        let (m, v) = (self.var(&[c]), self.var(&[c]));
        if !self.train {
            return self.b.batch_norm(x, gamma, beta, m, v, 1e-5);
        }
        let o = self.b.op(
            Op::BatchNormTrain {
                eps: 1e-5,
                momentum: 0.1,
            },
            &[x, gamma, beta, m, v],
        );
        self.tape.push(Rec::BnTrain {
            x,
            gamma,
            beta,
            y: o[0],
            mean: o[1],
            invstd: o[2],
        });
        o[0]
    }
    fn unary(&mut self, x: Outlet, op: Op, grad: Op, reads_output: bool) -> Outlet {
        let y = self.b.op1(op, &[x]);
        self.tape.push(Rec::Unary {
            x,
            y,
            grad,
            reads_output,
        });
        y
    }
    fn relu(&mut self, x: Outlet) -> Outlet {
        self.unary(x, Op::Relu, Op::ReluGrad, false)
    }
    fn add(&mut self, a: Outlet, b: Outlet) -> Outlet {
        let y = self.b.add(a, b);
        self.tape.push(Rec::Add { a, b, y });
        y
    }
    fn matmul(&mut self, a: Outlet, b: Outlet, tb: bool) -> Outlet {
        let y = self.b.matmul_t(a, b, false, tb);
        self.tape.push(Rec::MatMul { a, b, y, tb });
        y
    }
    fn reshape(&mut self, x: Outlet, shape: &[usize]) -> Outlet {
        let y = self.b.reshape(x, shape);
        self.tape.push(Rec::Reshape { x, y });
        y
    }
    fn transpose(&mut self, x: Outlet, perm: &[usize]) -> Outlet {
        let y = self.b.transpose(x, perm);
        self.tape.push(Rec::Transpose {
            x,
            y,
            perm: perm.to_vec(),
        });
        y
    }
    fn layer_norm(&mut self, x: Outlet) -> Outlet {
        let d = *self.dims(x).last().unwrap();
        let (gamma, beta) = (self.param(&[d]), self.param(&[d]));
        let y = self.b.layer_norm(x, gamma, beta, 1e-12);
        self.tape.push(Rec::LayerNorm { x, gamma, beta, y });
        y
    }
    /// x [.., i] @ W [i, o] + bias [o].
    fn linear(&mut self, x: Outlet, o: usize) -> Outlet {
        let i = *self.dims(x).last().unwrap();
        let w = self.param(&[i, o]);
        let bias = self.param(&[o]);
        let y = self.matmul(x, w, false);
        self.add(y, bias)
    }

    /// Adds the loss (training) and finishes the graph.
    fn finish(mut self, logits: Outlet) -> ValidGraph {
        if self.train {
            let n = self.dims(logits)[0];
            let labels = self.b.placeholder("labels", TensorType::i64([n]));
            let loss = self.b.cross_entropy(logits, labels);
            self.b.set_name(loss, "loss");
            self.tape.push(Rec::Ce { logits, labels });
            self.backward();
        } else {
            self.b.set_name(logits, "logits");
        }
        let (g, _) = self.b.finish().unwrap();
        validate(g, &GraphLimits::default()).unwrap()
    }

    fn backward(&mut self) {
        let tape = std::mem::take(&mut self.tape);
        let mut grads: HashMap<Outlet, Outlet> = HashMap::new();
        let params: HashSet<Outlet> = self.params.iter().copied().collect();
        // Gradients flow to activations and parameters, never to feeds.
        let needs = |o: &Outlet, b: &GraphBuilder| -> bool {
            params.contains(o)
                || !matches!(
                    b.graph_nodes()[o.node.index()].op,
                    Op::Placeholder(_) | Op::Variable(_)
                )
        };
        let b = &mut self.b;
        for rec in tape.iter().rev() {
            match rec {
                Rec::Ce { logits, labels } => {
                    let one = b.scalar(1.0);
                    let d = b.op1(Op::CrossEntropyGrad, &[*logits, *labels, one]);
                    acc(b, &mut grads, *logits, d);
                }
                Rec::MatMul { a, b: w, y, tb } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    let (ad, wd) = (b.dims(*a), b.dims(*w));
                    let da = b.matmul_t(dy, *w, false, !tb);
                    acc(b, &mut grads, *a, da);
                    if wd.len() == 2 && ad.len() > 2 {
                        // Weight shared over batch axes: flatten them, then one GEMM.
                        let rows: usize = ad[..ad.len() - 1].iter().product();
                        let a2 = b.reshape(*a, &[rows, ad[ad.len() - 1]]);
                        let dy2 = b.reshape(dy, &[rows, *b.dims(dy).last().unwrap()]);
                        let dw = if *tb {
                            b.matmul_t(dy2, a2, true, false)
                        } else {
                            b.matmul_t(a2, dy2, true, false)
                        };
                        acc(b, &mut grads, *w, dw);
                    } else {
                        let dw = if *tb {
                            b.matmul_t(dy, *a, true, false)
                        } else {
                            b.matmul_t(*a, dy, true, false)
                        };
                        if needs(w, b) {
                            acc(b, &mut grads, *w, dw);
                        }
                    }
                }
                Rec::Gap { x, y } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    let d = b.dims(*x);
                    let r = b.reshape(dy, &[d[0], d[1], 1, 1]);
                    let r = b.broadcast_to(r, &d);
                    let s = b.scale(r, 1.0 / (d[2] * d[3]) as f32);
                    acc(b, &mut grads, *x, s);
                }
                Rec::Add { a, b: c, y } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    for t in [*a, *c] {
                        let td = b.dims(t);
                        let d = if td == b.dims(dy) {
                            dy
                        } else {
                            b.sum_to(dy, &td)
                        };
                        if needs(&t, b) {
                            acc(b, &mut grads, t, d);
                        }
                    }
                }
                Rec::Unary {
                    x,
                    y,
                    grad,
                    reads_output,
                } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    let src = if *reads_output { *y } else { *x };
                    let d = b.op1(grad.clone(), &[src, dy]);
                    acc(b, &mut grads, *x, d);
                }
                Rec::Scale { x, y, f } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    let d = b.scale(dy, *f);
                    acc(b, &mut grads, *x, d);
                }
                Rec::Reshape { x, y } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    let d = b.dims(*x);
                    let r = b.reshape(dy, &d);
                    acc(b, &mut grads, *x, r);
                }
                Rec::Transpose { x, y, perm } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    let mut inv = vec![0; perm.len()];
                    for (i, &p) in perm.iter().enumerate() {
                        inv[p] = i;
                    }
                    let t = b.transpose(dy, &inv);
                    acc(b, &mut grads, *x, t);
                }
                Rec::Pool { x, y, attrs, avg } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    let op = if *avg {
                        Op::AvgPool2dGrad {
                            pool: *attrs,
                            count_include_pad: true,
                        }
                    } else {
                        Op::MaxPool2dGrad(*attrs)
                    };
                    let d = b.op1(op, &[*x, dy]);
                    acc(b, &mut grads, *x, d);
                }
                Rec::Concat { xs, y } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    let mut start = 0;
                    for x in xs {
                        let c = b.dims(*x)[1];
                        let d = b.slice(dy, 1, start, start + c);
                        start += c;
                        acc(b, &mut grads, *x, d);
                    }
                }
                Rec::BnTrain {
                    x,
                    gamma,
                    beta,
                    y,
                    mean,
                    invstd,
                } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    let o = b.op(Op::BatchNormTrainGrad, &[*x, *gamma, *mean, *invstd, dy]);
                    acc(b, &mut grads, *x, o[0]);
                    acc(b, &mut grads, *gamma, o[1]);
                    acc(b, &mut grads, *beta, o[2]);
                }
                Rec::LayerNorm { x, gamma, beta, y } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    let o = b.op(Op::LayerNormGrad { eps: 1e-12 }, &[*x, *gamma, dy]);
                    acc(b, &mut grads, *x, o[0]);
                    acc(b, &mut grads, *gamma, o[1]);
                    acc(b, &mut grads, *beta, o[2]);
                }
                Rec::Conv { x, w, y, attrs } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    let (xd, wd) = (b.dims(*x), b.dims(*w));
                    if needs(x, b) {
                        let input_shape = [xd[0], xd[1], xd[2], xd[3]];
                        let dx = b.op1(
                            Op::Conv2dGradInput {
                                attrs: *attrs,
                                input_shape,
                            },
                            &[dy, *w],
                        );
                        acc(b, &mut grads, *x, dx);
                    }
                    let filter_shape = [wd[0], wd[1], wd[2], wd[3]];
                    let dw = b.op1(
                        Op::Conv2dGradFilter {
                            attrs: *attrs,
                            filter_shape,
                        },
                        &[*x, dy],
                    );
                    acc(b, &mut grads, *w, dw);
                }
                Rec::Embedding {
                    table,
                    ids,
                    y,
                    rows,
                } => {
                    let Some(dy) = grads.remove(y) else { continue };
                    let d = b.op1(
                        Op::EmbeddingGrad {
                            num_embeddings: *rows,
                        },
                        &[*ids, dy],
                    );
                    acc(b, &mut grads, *table, d);
                }
            }
        }
        for p in self.params.clone() {
            let Some(&d) = grads.get(&p) else { continue };
            let buf = b.op1(Op::Variable(b.ty(p).unwrap().clone()), &[]);
            b.op(
                Op::SgdUpdate {
                    lr: 0.01,
                    momentum: 0.9,
                    weight_decay: 0.0,
                    nesterov: false,
                },
                &[p, d, buf],
            );
        }
    }
}

/// Adds `d` to the gradient of `k` (summing when `k` has several readers).
fn acc(b: &mut GraphBuilder, grads: &mut HashMap<Outlet, Outlet>, k: Outlet, d: Outlet) {
    let v = match grads.get(&k) {
        Some(&old) => b.add(old, d),
        None => d,
    };
    grads.insert(k, v);
}

fn conv_bn(n: &mut Net, x: Outlet, out: usize, k: usize, stride: usize, relu: bool) -> Outlet {
    let y = n.conv(x, out, k, stride);
    let y = n.bn(y);
    if relu {
        n.relu(y)
    } else {
        y
    }
}

/// ResNet with bottleneck blocks (ResNet-50: [3, 4, 6, 3]; -152: [3, 8, 36, 3]).
pub fn resnet(blocks: [usize; 4], batch: usize, train: bool) -> ValidGraph {
    let mut n = Net::new(train);
    let x = n.b.placeholder("x", TensorType::f32([batch, 3, 224, 224]));
    let mut h = conv_bn(&mut n, x, 64, 7, 2, true);
    h = n.max_pool(h, 3, 2, 1);
    let mut c_in = 64;
    for (stage, (&count, &width)) in blocks.iter().zip(&[64usize, 128, 256, 512]).enumerate() {
        for i in 0..count {
            let stride = if i == 0 && stage > 0 { 2 } else { 1 };
            let a = conv_bn(&mut n, h, width, 1, 1, true);
            let a = conv_bn(&mut n, a, width, 3, stride, true);
            let a = conv_bn(&mut n, a, width * 4, 1, 1, false);
            let short = if c_in != width * 4 || stride != 1 {
                conv_bn(&mut n, h, width * 4, 1, stride, false)
            } else {
                h
            };
            let s = n.add(a, short);
            h = n.relu(s);
            c_in = width * 4;
        }
    }
    let p = n.gap(h);
    let logits = n.linear(p, 1000);
    n.finish(logits)
}

/// BasicConv2d of Inception-v3: conv (no bias), batch norm, ReLU.
fn bconv(
    n: &mut Net,
    x: Outlet,
    out: usize,
    k: [usize; 2],
    stride: usize,
    pad: [usize; 2],
) -> Outlet {
    let y = n.conv_k(x, out, k, stride, pad);
    let y = n.bn(y);
    n.relu(y)
}

fn c1(n: &mut Net, x: Outlet, out: usize) -> Outlet {
    bconv(n, x, out, [1, 1], 1, [0, 0])
}

fn c3(n: &mut Net, x: Outlet, out: usize, stride: usize, pad: usize) -> Outlet {
    bconv(n, x, out, [3, 3], stride, [pad, pad])
}

/// Inception-v3 as in torchvision (299×299 input, no auxiliary head).
pub fn inception_v3(batch: usize, train: bool) -> ValidGraph {
    let mut n = Net::new(train);
    let x = n.b.placeholder("x", TensorType::f32([batch, 3, 299, 299]));
    let n = &mut n;
    let mut h = c3(n, x, 32, 2, 0);
    h = c3(n, h, 32, 1, 0);
    h = c3(n, h, 64, 1, 1);
    h = n.max_pool(h, 3, 2, 0);
    h = c1(n, h, 80);
    h = c3(n, h, 192, 1, 0);
    h = n.max_pool(h, 3, 2, 0);
    for pf in [32, 64, 64] {
        // InceptionA
        let a = c1(n, h, 64);
        let b5 = c1(n, h, 48);
        let b5 = bconv(n, b5, 64, [5, 5], 1, [2, 2]);
        let d = c1(n, h, 64);
        let d = c3(n, d, 96, 1, 1);
        let d = c3(n, d, 96, 1, 1);
        let p = n.avg_pool(h, 3, 1, 1);
        let p = c1(n, p, pf);
        h = n.concat(&[a, b5, d, p]);
    }
    {
        // InceptionB
        let a = c3(n, h, 384, 2, 0);
        let d = c1(n, h, 64);
        let d = c3(n, d, 96, 1, 1);
        let d = c3(n, d, 96, 2, 0);
        let p = n.max_pool(h, 3, 2, 0);
        h = n.concat(&[a, d, p]);
    }
    for c7 in [128, 160, 160, 192] {
        // InceptionC
        let a = c1(n, h, 192);
        let b = c1(n, h, c7);
        let b = bconv(n, b, c7, [1, 7], 1, [0, 3]);
        let b = bconv(n, b, 192, [7, 1], 1, [3, 0]);
        let d = c1(n, h, c7);
        let d = bconv(n, d, c7, [7, 1], 1, [3, 0]);
        let d = bconv(n, d, c7, [1, 7], 1, [0, 3]);
        let d = bconv(n, d, c7, [7, 1], 1, [3, 0]);
        let d = bconv(n, d, 192, [1, 7], 1, [0, 3]);
        let p = n.avg_pool(h, 3, 1, 1);
        let p = c1(n, p, 192);
        h = n.concat(&[a, b, d, p]);
    }
    {
        // InceptionD
        let a = c1(n, h, 192);
        let a = c3(n, a, 320, 2, 0);
        let b = c1(n, h, 192);
        let b = bconv(n, b, 192, [1, 7], 1, [0, 3]);
        let b = bconv(n, b, 192, [7, 1], 1, [3, 0]);
        let b = c3(n, b, 192, 2, 0);
        let p = n.max_pool(h, 3, 2, 0);
        h = n.concat(&[a, b, p]);
    }
    for _ in 0..2 {
        // InceptionE
        let a = c1(n, h, 320);
        let b = c1(n, h, 384);
        let b1 = bconv(n, b, 384, [1, 3], 1, [0, 1]);
        let b2 = bconv(n, b, 384, [3, 1], 1, [1, 0]);
        let b = n.concat(&[b1, b2]);
        let d = c1(n, h, 448);
        let d = c3(n, d, 384, 1, 1);
        let d1 = bconv(n, d, 384, [1, 3], 1, [0, 1]);
        let d2 = bconv(n, d, 384, [3, 1], 1, [1, 0]);
        let d = n.concat(&[d1, d2]);
        let p = n.avg_pool(h, 3, 1, 1);
        let p = c1(n, p, 192);
        h = n.concat(&[a, b, d, p]);
    }
    assert_eq!(n.dims(h), vec![batch, 2048, 8, 8]);
    let p = n.gap(h);
    let logits = n.linear(p, 1000);
    std::mem::replace(n, Net::new(false)).finish(logits)
}

/// BERT-base encoder (12 layers, hidden 768, 12 heads, FFN 3072) with a
/// 2-class head on the first token.
pub fn bert_base(batch: usize, seq: usize, train: bool) -> ValidGraph {
    let (hid, heads, ffn, vocab) = (768usize, 12usize, 3072usize, 30522usize);
    let dh = hid / heads;
    let mut n = Net::new(train);
    let ids = n.b.placeholder("ids", TensorType::i64([batch, seq]));
    let table = n.param(&[vocab, hid]);
    let e = n.b.embedding(table, ids);
    n.tape.push(Rec::Embedding {
        table,
        ids,
        y: e,
        rows: vocab,
    });
    let pos = n.param(&[seq, hid]);
    let e = n.add(e, pos);
    let mut x = n.layer_norm(e);
    for _ in 0..12 {
        let q = n.linear(x, hid);
        let k = n.linear(x, hid);
        let v = n.linear(x, hid);
        let heads_of = |n: &mut Net, t: Outlet| {
            let t = n.reshape(t, &[batch, seq, heads, dh]);
            n.transpose(t, &[0, 2, 1, 3])
        };
        let (q, k, v) = (
            heads_of(&mut n, q),
            heads_of(&mut n, k),
            heads_of(&mut n, v),
        );
        let s = n.matmul(q, k, true);
        let f = 1.0 / (dh as f32).sqrt();
        let s2 = n.b.scale(s, f);
        n.tape.push(Rec::Scale { x: s, y: s2, f });
        let p = n.unary(
            s2,
            Op::Softmax { axis: 3 },
            Op::SoftmaxGrad { axis: 3 },
            true,
        );
        let c = n.matmul(p, v, false);
        let c = n.transpose(c, &[0, 2, 1, 3]);
        let c = n.reshape(c, &[batch, seq, hid]);
        let o = n.linear(c, hid);
        let r = n.add(o, x);
        let h = n.layer_norm(r);
        let f = n.linear(h, ffn);
        let f = n.unary(f, Op::Gelu, Op::GeluGrad, false);
        let f = n.linear(f, hid);
        let r = n.add(f, h);
        x = n.layer_norm(r);
    }
    // A 2-class head over the flattened sequence.
    let flat = n.reshape(x, &[batch, seq * hid]);
    let logits = n.linear(flat, 2);
    n.finish(logits)
}
