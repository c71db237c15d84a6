//! Inference responses: JSON tensors, binary tensor data behind the JSON
//! header, and outputs written into shared memory regions instead.

use lanes_adaptor::{Tensor, TensorData};
use serde_json::{Map, Value};

use super::error::ApiError;
use super::model::ModelInfo;
use super::shm::{ParamValue, ShmSlice};
use super::tensors::datatype;

/// How an output is wanted.
#[derive(Debug, Clone)]
pub enum Out {
    /// As JSON numbers.
    Json,
    /// As binary data behind the JSON header.
    Binary,
    /// Written into a shared memory region; the response carries no data.
    Shm(ShmSlice),
}

/// Writes the outputs wanted in shared memory (`wanted`, in the order of
/// `outputs`) into their regions.
pub fn write_shm_outputs<'a>(
    wanted: impl Iterator<Item = (&'a str, Option<&'a ShmSlice>)>,
    outputs: &[Tensor],
) -> Result<(), ApiError> {
    for ((name, slice), t) in wanted.zip(outputs) {
        if let Some(s) = slice {
            s.write_from(&format!("output `{name}`"), &le_bytes(t))?;
        }
    }
    Ok(())
}

/// The parameters an output written into shared memory answers with.
pub fn shm_answer<'a>(slice: &'a ShmSlice, t: &Tensor) -> Vec<(&'static str, ParamValue<'a>)> {
    vec![
        ("shared_memory_region", ParamValue::Text(slice.region())),
        (
            "shared_memory_offset",
            ParamValue::UInt(slice.offset() as u64),
        ),
        (
            "shared_memory_byte_size",
            ParamValue::UInt(t.data().ne_bytes().len() as u64),
        ),
    ]
}

/// An encoded response: the body, and the JSON header's length when
/// binary data follows it.
#[derive(Debug)]
pub struct Encoded {
    pub body: Vec<u8>,
    pub header_len: Option<usize>,
}

fn json_data(t: &Tensor) -> Value {
    match t.data() {
        TensorData::F32(v) => Value::Array(v.iter().map(|&x| Value::from(x as f64)).collect()),
        TensorData::I64(v) => Value::Array(v.iter().map(|&x| Value::from(x)).collect()),
        TensorData::F16(v) => Value::Array(v.iter().map(|&x| Value::from(x.to_f64())).collect()),
        TensorData::BF16(v) => Value::Array(v.iter().map(|&x| Value::from(x.to_f64())).collect()),
    }
}

/// A tensor's values as little-endian bytes: its own storage on a
/// little-endian host (no copy).
pub fn le_bytes(t: &Tensor) -> std::borrow::Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    {
        std::borrow::Cow::Borrowed(t.data().ne_bytes())
    }
    #[cfg(not(target_endian = "little"))]
    {
        std::borrow::Cow::Owned(t.to_le_bytes())
    }
}

/// The response to a request: `outputs` are the fetched tensors, in the
/// order of `wanted`. Binary outputs are copied once, straight after the
/// JSON header in the body.
pub fn encode(
    model: &ModelInfo,
    id: Option<String>,
    wanted: &[(String, Out)],
    outputs: &[Tensor],
) -> Encoded {
    let mut binary = 0usize;
    let mut list = Vec::with_capacity(outputs.len());
    for ((name, out), t) in wanted.iter().zip(outputs) {
        let shape: Vec<usize> = t.shape().dims().to_vec();
        let mut o = serde_json::json!({
            "name": name,
            "datatype": datatype(t.dtype()),
            "shape": shape,
        });
        match out {
            Out::Binary => {
                let n = t.data().ne_bytes().len();
                o["parameters"] = serde_json::json!({ "binary_data_size": n });
                binary += n;
            }
            Out::Json => o["data"] = json_data(t),
            Out::Shm(slice) => {
                let mut p = Map::new();
                for (k, v) in shm_answer(slice, t) {
                    let v = match v {
                        ParamValue::Text(s) => Value::from(s),
                        ParamValue::UInt(n) => Value::from(n),
                        ParamValue::Int(n) => Value::from(n),
                        ParamValue::Other => Value::Null,
                    };
                    p.insert(k.to_string(), v);
                }
                o["parameters"] = Value::Object(p);
            }
        }
        list.push(o);
    }
    let mut head = serde_json::json!({
        "model_name": model.name,
        "model_version": model.version,
        "outputs": list,
    });
    if let Some(id) = id {
        head["id"] = Value::from(id);
    }
    let head = head.to_string();
    if !wanted.iter().any(|(_, o)| matches!(o, Out::Binary)) {
        return Encoded {
            body: head.into_bytes(),
            header_len: None,
        };
    }
    let mut body = Vec::with_capacity(head.len() + binary);
    body.extend_from_slice(head.as_bytes());
    for ((_, out), t) in wanted.iter().zip(outputs) {
        if matches!(out, Out::Binary) {
            body.extend_from_slice(&le_bytes(t));
        }
    }
    Encoded {
        body,
        header_len: Some(head.len()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::oip::model::TensorSpec;
    use lanes_adaptor::DType;

    fn model() -> ModelInfo {
        ModelInfo {
            name: "m".into(),
            version: "1".into(),
            max_batch_size: 4,
            inputs: vec![],
            outputs: vec![TensorSpec {
                name: "y".into(),
                dtype: DType::F32,
                dims: vec![1],
            }],
            batching: None,
        }
    }

    #[test]
    fn binary_outputs_follow_the_header() {
        let m = model();
        let t = Tensor::from_f32(vec![1, 1], vec![2.5]).unwrap();
        let e = encode(
            &m,
            Some("7".into()),
            &[("y".into(), Out::Binary)],
            std::slice::from_ref(&t),
        );
        let n = e.header_len.unwrap();
        let head: Value = serde_json::from_slice(&e.body[..n]).unwrap();
        assert_eq!(head["id"], "7");
        assert_eq!(head["outputs"][0]["parameters"]["binary_data_size"], 4);
        assert_eq!(&e.body[n..], &2.5f32.to_le_bytes());
        let e = encode(&m, None, &[("y".into(), Out::Json)], &[t]);
        assert!(e.header_len.is_none());
        let head: Value = serde_json::from_slice(&e.body).unwrap();
        assert_eq!(head["outputs"][0]["data"][0], 2.5);
        assert_eq!(head["outputs"][0]["shape"], serde_json::json!([1, 1]));
    }
}
