//! Pattern fusion before lowering: the exact GELU that exporters write out
//! as `x / √2 → Erf → + 1 → x · … → · 0.5` (PyTorch's `nn.GELU`, Hugging
//! Face's `gelu`) becomes one `gelu` op, provided no other node or graph
//! output reads the intermediate values.

use std::collections::{HashMap, HashSet};

use super::attrs::Attrs;
use super::fold;
use super::proto::GraphProto;
use super::value::from_proto;

/// Nodes to skip, and the node that yields each fused GELU with its input.
#[derive(Debug, Default)]
pub struct Fusions {
    pub skip: HashSet<usize>,
    /// Index of the pattern's last node -> the name of the GELU's input.
    pub gelu: HashMap<usize, String>,
}

/// Finds the GELU patterns in `g`.
pub fn find(g: &GraphProto) -> Fusions {
    let mut consumers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, n) in g.node.iter().enumerate() {
        for x in &n.input {
            consumers.entry(x.as_str()).or_default().push(i);
        }
    }
    for o in &g.output {
        if let Some(name) = o.name.as_deref() {
            consumers.entry(name).or_default().push(usize::MAX);
        }
    }
    let producer: HashMap<&str, usize> = g
        .node
        .iter()
        .enumerate()
        .flat_map(|(i, n)| n.output.iter().map(move |o| (o.as_str(), i)))
        .collect();
    // The value of a one-element constant (a Constant node or an initializer).
    let scalar = |name: &str| -> Option<f32> {
        let h = match producer.get(name) {
            Some(&i) if g.node[i].op_type.as_deref() == Some("Constant") => {
                let a = Attrs(&g.node[i].attribute);
                fold::eval("Constant", &a, &[], 16).ok()??.pop()?
            }
            Some(_) => return None,
            None => from_proto(
                g.initializer
                    .iter()
                    .find(|t| t.name.as_deref() == Some(name))?,
                16,
            )
            .ok()?,
        };
        h.scalar_f32().ok()
    };
    let near = |v: Option<f32>, want: f32| v.is_some_and(|v| (v - want).abs() <= 1e-6 * want.abs());
    // The single node reading `value` if it is `op`: (index, its other input).
    let only = |value: &str, op: &str| -> Option<(usize, String)> {
        match consumers.get(value).map(Vec::as_slice) {
            Some(&[j]) if j != usize::MAX && g.node[j].op_type.as_deref() == Some(op) => {
                let n = &g.node[j];
                let other = n.input.iter().find(|x| x.as_str() != value)?.clone();
                if n.input.len() != 2 && op != "Erf" {
                    return None;
                }
                Some((j, other))
            }
            _ => None,
        }
    };
    let mut f = Fusions::default();
    for (i, n) in g.node.iter().enumerate() {
        let op = n.op_type.as_deref();
        let (Some(x), Some(c), Some(d)) = (n.input.first(), n.input.get(1), n.output.first())
        else {
            continue;
        };
        let scaled = match op {
            Some("Div") => near(scalar(c), std::f32::consts::SQRT_2),
            Some("Mul") => near(scalar(c), std::f32::consts::FRAC_1_SQRT_2),
            _ => false,
        };
        if !scaled || f.skip.contains(&i) {
            continue;
        }
        let found = (|| {
            let j = match consumers.get(d.as_str()).map(Vec::as_slice) {
                Some(&[j]) if j != usize::MAX && g.node[j].op_type.as_deref() == Some("Erf") => j,
                _ => return None,
            };
            let e = g.node[j].output.first()?;
            let (k, one) = only(e, "Add")?;
            if !near(scalar(&one), 1.0) {
                return None;
            }
            let (l, xx) = only(g.node[k].output.first()?, "Mul")?;
            if &xx != x {
                return None;
            }
            let (p, half) = only(g.node[l].output.first()?, "Mul")?;
            if !near(scalar(&half), 0.5) {
                return None;
            }
            Some([j, k, l, p])
        })();
        if let Some([j, k, l, p]) = found {
            f.skip.extend([i, j, k, l]);
            f.gelu.insert(p, x.clone());
        }
    }
    f
}
