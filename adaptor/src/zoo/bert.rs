//! BERT-base encoder with pooler (the sizes of `bert-base-uncased`):
//! vocabulary 30522, 512 positions, 2 token types, 12 layers of width 768,
//! 12 heads, feed-forward 3072, exact GELU, LayerNorm eps 1e-12; weights
//! `N(0, 0.02²)`, biases 0, as Hugging Face initialises. Every token attends
//! to every token (no padding mask).

use super::{Forward, Target};
use crate::nn::{BiasInit, Nn, WeightInit};
use crate::tensor::{Tensor, TensorType};

const VOCAB: usize = 30522;
const POSITIONS: usize = 512;
const HIDDEN: usize = 768;
const LAYERS: usize = 12;
const HEADS: usize = 12;
const FF: usize = 3072;
const STD: f32 = 0.02;
const EPS: f32 = 1e-12;

pub(super) fn bert_base(mut nn: Nn, batch: usize, seq: usize) -> Forward {
    let seq = seq.clamp(1, POSITIONS);
    let ids_ty = TensorType::i64([batch, seq]);
    let ids = nn.g.placeholder("input_ids", ids_ty.clone());
    let types = nn.g.placeholder("token_type_ids", ids_ty.clone());
    let w = WeightInit::Normal(STD);
    let zero = Some(BiasInit::Zeros);
    let mut h = nn.scoped("embeddings", |nn| {
        let we = nn.embedding("word_embeddings", ids, VOCAB, HIDDEN, Some(STD));
        let pos = Tensor::from_i64([seq], (0..seq as i64).collect())
            .unwrap_or_else(|_| Tensor::zeros(&TensorType::i64([seq])));
        let pos = nn.g.constant(pos);
        let pe = nn.embedding("position_embeddings", pos, POSITIONS, HIDDEN, Some(STD));
        let te = nn.embedding("token_type_embeddings", types, 2, HIDDEN, Some(STD));
        let e = nn.g.add(we, pe);
        let e = nn.g.add(e, te);
        nn.layer_norm("LayerNorm", e, EPS)
    });
    for l in 0..LAYERS {
        h = nn.scoped(&format!("encoder/layer/{l}"), |nn| {
            let a = nn.scoped("attention", |nn| {
                let a = nn.self_attention("self", h, HEADS, Some(STD));
                let a = nn.g.add(a, h);
                nn.layer_norm("LayerNorm", a, EPS)
            });
            let i = nn.linear_with("intermediate", a, FF, w, zero);
            let i = nn.g.gelu(i);
            let o = nn.linear_with("output", i, HIDDEN, w, zero);
            let o = nn.g.add(o, a);
            nn.layer_norm("output_LayerNorm", o, EPS)
        });
    }
    let out = nn.scoped("pooler", |nn| {
        let first = nn.g.slice(h, 1, 0, 1);
        let first = nn.g.reshape(first, &[batch, HIDDEN]);
        let p = nn.linear_with("dense", first, HIDDEN, w, zero);
        nn.g.tanh(p)
    });
    Forward {
        nn,
        inputs: vec![
            ("input_ids".into(), ids_ty.clone()),
            ("token_type_ids".into(), ids_ty),
        ],
        output: out,
        aux: None,
        target: Target::Features(HIDDEN),
    }
}
