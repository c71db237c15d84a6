//! Inference requests: JSON tensors, Triton's binary tensor data
//! extension (a JSON header of `Inference-Header-Content-Length` bytes
//! followed by the tensors' raw little-endian row-major bytes, each
//! tensor's length in its `parameters.binary_data_size`) and tensors in
//! shared memory regions. Responses are written by `response.rs`.

use lanes_adaptor::{DType, Tensor, TensorData, TensorType};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::body::Chunks;
use super::error::ApiError;
use super::model::{ModelInfo, TensorSpec};
use super::response::Out;
use super::shm::{self, ParamValue, Regions, ShmSlice};

/// The protocol's name of a Lanes element type.
pub fn datatype(d: DType) -> &'static str {
    match d {
        DType::F32 => "FP32",
        DType::I64 => "INT64",
        DType::F16 => "FP16",
        DType::BF16 => "BF16",
    }
}

/// Triton's configuration name of a Lanes element type.
pub fn config_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "TYPE_FP32",
        DType::I64 => "TYPE_INT64",
        DType::F16 => "TYPE_FP16",
        DType::BF16 => "TYPE_BF16",
    }
}

#[derive(Debug, Deserialize)]
struct RequestBody {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    inputs: Vec<InputBody>,
    #[serde(default)]
    outputs: Option<Vec<OutputBody>>,
}

#[derive(Debug, Deserialize)]
struct InputBody {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    #[serde(default)]
    data: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct OutputBody {
    name: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
}

/// A decoded inference request, checked against the model.
#[derive(Debug)]
pub struct Decoded {
    pub id: Option<String>,
    /// Rows along the batch dimension (1 for a model that does not batch).
    pub rows: usize,
    /// One feed per model input, in the model's order.
    pub feeds: Vec<(String, Feed)>,
    /// The outputs asked for (all, in the model's order, when none named),
    /// and how each is wanted.
    pub outputs: Vec<(String, Out)>,
}

/// An input's values as the request brought them.
#[derive(Debug, Clone)]
pub enum Feed {
    /// Binary data: little-endian bytes of the request body, not copied
    /// yet (written once where the service reads them, [`Feed::write_to`]).
    Raw { ty: TensorType, bytes: Chunks },
    /// Values read from JSON or from typed gRPC contents.
    Tensor(Tensor),
    /// Little-endian bytes in a registered shared memory region, not
    /// copied yet (written once where the service reads them).
    Shm { ty: TensorType, slice: ShmSlice },
}

impl Feed {
    pub fn ty(&self) -> TensorType {
        match self {
            Feed::Raw { ty, .. } | Feed::Shm { ty, .. } => ty.clone(),
            Feed::Tensor(t) => t.ty(),
        }
    }

    /// Writes the values, native-endian, into `dst`, which must be exactly
    /// as long; false (nothing written) when it is not.
    pub fn write_to(&self, dst: &mut [u8]) -> bool {
        let from_tensor = |t: &Tensor, dst: &mut [u8]| {
            let b = t.data().ne_bytes();
            let fits = b.len() == dst.len();
            if fits {
                dst.copy_from_slice(b);
            }
            fits
        };
        match self {
            Feed::Tensor(t) => from_tensor(t, dst),
            #[cfg(target_endian = "little")]
            Feed::Raw { bytes, .. } => bytes.copy_to(dst),
            #[cfg(target_endian = "little")]
            Feed::Shm { slice, .. } => slice.read_into(dst),
            #[cfg(not(target_endian = "little"))]
            Feed::Raw { .. } | Feed::Shm { .. } => self
                .clone()
                .into_tensor()
                .is_ok_and(|t| from_tensor(&t, dst)),
        }
    }

    /// The values as a tensor of their own (one copy of binary data);
    /// why not.
    pub fn into_tensor(self) -> Result<Tensor, String> {
        match self {
            Feed::Tensor(t) => Ok(t),
            Feed::Raw { ty, bytes } => {
                let parts: Vec<&[u8]> = bytes.parts().collect();
                lanes_adaptor::wire::tensor_from_chunks(&ty, &parts).map_err(|e| e.to_string())
            }
            Feed::Shm { ty, slice } => {
                let mut v = vec![0u8; slice.len()];
                if !slice.read_into(&mut v) {
                    return Err(format!(
                        "the shared memory object of region `{}` shrank below the region",
                        slice.region()
                    ));
                }
                lanes_adaptor::wire::tensor_from_chunks(&ty, &[&v]).map_err(|e| e.to_string())
            }
        }
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::BadRequest(msg.into())
}

fn flag(params: &Option<Map<String, Value>>, key: &str) -> Result<Option<bool>, ApiError> {
    match params.as_ref().and_then(|p| p.get(key)) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(bad(format!("parameter `{key}` must be a boolean"))),
    }
}

/// The JSON header's length in a body of `body_len` bytes: the whole
/// body without `Inference-Header-Content-Length` (`header_len`).
pub fn json_len(body_len: usize, header_len: Option<&str>) -> Result<usize, ApiError> {
    match header_len {
        None => Ok(body_len),
        Some(h) => {
            let n: usize = h.trim().parse().map_err(|_| {
                bad(format!(
                    "Inference-Header-Content-Length `{h}` is not a byte count"
                ))
            })?;
            if n > body_len {
                return Err(bad(format!(
                    "Inference-Header-Content-Length is {n} but the body has {body_len} bytes"
                )));
            }
            Ok(n)
        }
    }
}

/// Splits a body into its JSON header and its binary part.
#[cfg(test)]
fn split_body<'a>(
    body: &'a [u8],
    header_len: Option<&str>,
) -> Result<(&'a [u8], &'a [u8]), ApiError> {
    json_len(body.len(), header_len).map(|n| body.split_at(n))
}

/// The shape a request's input must have: `rows` then the model's dims
/// for a batching model, the dims themselves otherwise; the rows.
fn check_shape(model: &ModelInfo, spec: &TensorSpec, shape: &[i64]) -> Result<usize, ApiError> {
    let mut dims = Vec::with_capacity(shape.len());
    for &d in shape {
        dims.push(usize::try_from(d).map_err(|_| {
            bad(format!(
                "input `{}`: dimension {d} of shape {shape:?} is negative",
                spec.name
            ))
        })?);
    }
    let want = model.shape_text(spec);
    if model.max_batch_size == 0 {
        if dims != spec.dims {
            return Err(bad(format!(
                "input `{}`: shape {shape:?} does not match the model's {want}",
                spec.name
            )));
        }
        return Ok(1);
    }
    match dims.split_first() {
        Some((&rows, rest)) if rest == spec.dims.as_slice() => {
            if rows == 0 || rows > model.max_batch_size {
                return Err(bad(format!(
                    "input `{}`: batch size {rows} is outside 1..={} (max_batch_size)",
                    spec.name, model.max_batch_size
                )));
            }
            Ok(rows)
        }
        _ => Err(bad(format!(
            "input `{}`: shape {shape:?} does not match the model's {want}",
            spec.name
        ))),
    }
}

fn flatten_into(v: &Value, out: &mut Vec<Value>, limit: usize) -> Result<(), ApiError> {
    match v {
        Value::Array(a) => {
            for x in a {
                flatten_into(x, out, limit)?;
            }
            Ok(())
        }
        x => {
            if out.len() >= limit {
                return Err(bad("more data elements than the shape holds"));
            }
            out.push(x.clone());
            Ok(())
        }
    }
}

fn json_tensor(name: &str, dtype: DType, dims: &[usize], data: &Value) -> Result<Tensor, ApiError> {
    let n = dims.iter().product::<usize>();
    let mut flat = Vec::with_capacity(n.min(1 << 20));
    flatten_into(data, &mut flat, n)?;
    if flat.len() != n {
        return Err(bad(format!(
            "input `{name}`: {} data elements for shape {dims:?} ({n} elements)",
            flat.len()
        )));
    }
    let not = |what: &str, x: &Value| bad(format!("input `{name}`: `{x}` is not {what}"));
    let floats = || -> Result<Vec<f32>, ApiError> {
        flat.iter()
            .map(|x| {
                x.as_f64()
                    .map(|f| f as f32)
                    .ok_or_else(|| not("a number", x))
            })
            .collect()
    };
    let data = match dtype {
        DType::F32 => TensorData::F32(floats()?),
        DType::F16 | DType::BF16 => TensorData::from_f32_rounded(dtype, &floats()?)
            .ok_or_else(|| bad(format!("input `{name}`: {dtype} is not a float type")))?,
        DType::I64 => TensorData::I64(
            flat.iter()
                .map(|x| x.as_i64().ok_or_else(|| not("an integer", x)))
                .collect::<Result<_, _>>()?,
        ),
    };
    Tensor::new(dims.to_vec(), data).map_err(|e| bad(format!("input `{name}`: {e}")))
}

/// The inputs of one request, checked one by one against the model as
/// they are read (from JSON and binary data, or from a gRPC message).
#[derive(Debug)]
pub struct Feeds<'m> {
    model: &'m ModelInfo,
    feeds: Vec<Option<Feed>>,
    rows: Option<usize>,
}

/// Where a checked input goes, and its dimensions.
#[derive(Debug)]
pub struct InputSlot {
    k: usize,
    pub dtype: DType,
    pub dims: Vec<usize>,
}

impl<'m> Feeds<'m> {
    pub fn new(model: &'m ModelInfo) -> Feeds<'m> {
        Feeds {
            model,
            feeds: vec![None; model.inputs.len()],
            rows: None,
        }
    }

    /// Checks an input's name (one of the model's, not given before), its
    /// datatype and its shape (and that its rows match the other inputs').
    pub fn check(&mut self, name: &str, dtype: &str, shape: &[i64]) -> Result<InputSlot, ApiError> {
        let model = self.model;
        let k = model
            .inputs
            .iter()
            .position(|s| s.name == name)
            .ok_or_else(|| {
                bad(format!(
                    "unknown input `{name}`; the model's inputs are {}",
                    model.input_names()
                ))
            })?;
        let spec = &model.inputs[k];
        if self.feeds[k].is_some() {
            return Err(bad(format!("input `{name}` is given twice")));
        }
        if dtype != datatype(spec.dtype) {
            return Err(bad(format!(
                "input `{name}`: datatype {dtype} does not match the model's {}",
                datatype(spec.dtype)
            )));
        }
        let r = check_shape(model, spec, shape)?;
        if let Some(x) = self.rows.filter(|&x| x != r) {
            return Err(bad(format!(
                "input `{name}`: batch size {r} differs from the other inputs' {x}"
            )));
        }
        self.rows = Some(r);
        Ok(InputSlot {
            k,
            dtype: spec.dtype,
            dims: shape.iter().map(|&d| d as usize).collect(),
        })
    }

    /// Keeps a checked input's values.
    pub fn put(&mut self, slot: InputSlot, feed: Feed) {
        self.feeds[slot.k] = Some(feed);
    }

    /// The rows and one feed per model input, in the model's order;
    /// an input not given is an error.
    pub fn finish(self) -> Result<(usize, Vec<(String, Feed)>), ApiError> {
        let mut out = Vec::with_capacity(self.feeds.len());
        for (spec, t) in self.model.inputs.iter().zip(self.feeds) {
            let t = t.ok_or_else(|| bad(format!("input `{}` is missing", spec.name)))?;
            out.push((spec.name.clone(), t));
        }
        Ok((self.rows.unwrap_or(1), out))
    }
}

/// A checked input's feed from its raw bytes (little-endian, row-major),
/// which must be exactly as many as its shape and datatype take; they are
/// not copied here.
pub fn raw_feed(name: &str, slot: &InputSlot, bytes: Chunks) -> Result<Feed, ApiError> {
    let want = slot.dims.iter().product::<usize>() * slot.dtype.size();
    if bytes.len() != want {
        return Err(bad(format!(
            "input `{name}`: {} bytes of data for shape {:?} of {} ({want} bytes)",
            bytes.len(),
            slot.dims,
            datatype(slot.dtype)
        )));
    }
    let ty = TensorType::new(slot.dtype, slot.dims.clone());
    Ok(Feed::Raw { ty, bytes })
}

/// A checked input's feed from a registered shared memory region: the
/// part named must take exactly the bytes of the input's shape and
/// datatype; they are not copied here.
pub fn shm_feed(
    regions: &Regions,
    name: &str,
    slot: &InputSlot,
    p: &shm::ShmParams,
) -> Result<Feed, ApiError> {
    let want = slot.dims.iter().product::<usize>() * slot.dtype.size();
    let slice = regions.slice("input", name, p, Some(want))?;
    let ty = TensorType::new(slot.dtype, slot.dims.clone());
    Ok(Feed::Shm { ty, slice })
}

/// A checked input's tensor from its elements.
pub fn typed_tensor(name: &str, slot: &InputSlot, data: TensorData) -> Result<Tensor, ApiError> {
    let n = slot.dims.iter().product::<usize>();
    if data.len() != n {
        return Err(bad(format!(
            "input `{name}`: {} data elements for shape {:?} ({n} elements)",
            data.len(),
            slot.dims
        )));
    }
    Tensor::new(slot.dims.clone(), data).map_err(|e| bad(format!("input `{name}`: {e}")))
}

/// Checks that an output asked for is one of the model's and not asked
/// for before (`earlier`).
pub fn check_output<'a>(
    model: &ModelInfo,
    name: &str,
    mut earlier: impl Iterator<Item = &'a str>,
) -> Result<(), ApiError> {
    if !model.outputs.iter().any(|s| s.name == name) {
        return Err(bad(format!(
            "unknown output `{name}`; the model's outputs are {}",
            model.output_names()
        )));
    }
    if earlier.any(|n| n == name) {
        return Err(bad(format!("output `{name}` is asked for twice")));
    }
    Ok(())
}

/// A JSON parameter as [`shm::params`] reads it.
fn json_param(v: &Value) -> ParamValue<'_> {
    match v {
        Value::String(s) => ParamValue::Text(s),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => ParamValue::UInt(u),
            (None, Some(i)) => ParamValue::Int(i),
            _ => ParamValue::Other,
        },
        _ => ParamValue::Other,
    }
}

/// The shared memory parameters of a tensor's JSON `parameters`.
fn json_shm(
    what: &str,
    tensor: &str,
    params: &Option<Map<String, Value>>,
) -> Result<Option<shm::ShmParams>, ApiError> {
    shm::params(what, tensor, |k| {
        params.as_ref().and_then(|p| p.get(k)).map(json_param)
    })
}

/// Decodes and checks a request's JSON header and binary part; inputs
/// and outputs in shared memory are looked up in `regions`.
pub fn decode(
    model: &ModelInfo,
    json: &[u8],
    binary: Chunks,
    regions: &Regions,
) -> Result<Decoded, ApiError> {
    let req: RequestBody = serde_json::from_slice(json)
        .map_err(|e| bad(format!("malformed inference request: {e}")))?;
    let mut feeds = Feeds::new(model);
    // Where the next input's binary data starts.
    let mut at = 0usize;
    for input in &req.inputs {
        let slot = feeds.check(&input.name, &input.datatype, &input.shape)?;
        let binary_size = match input
            .parameters
            .as_ref()
            .and_then(|p| p.get("binary_data_size"))
        {
            None => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        bad(format!(
                            "input `{}`: binary_data_size must be a byte count",
                            input.name
                        ))
                    })?,
            ),
        };
        let in_shm = json_shm("input", &input.name, &input.parameters)?;
        if let Some(p) = in_shm {
            if binary_size.is_some() || input.data.is_some() {
                return Err(bad(format!(
                    "input `{}` names a shared memory region and also carries data",
                    input.name
                )));
            }
            let feed = shm_feed(regions, &input.name, &slot, &p)?;
            feeds.put(slot, feed);
            continue;
        }
        let tensor = match (binary_size, &input.data) {
            (Some(_), Some(_)) => {
                return Err(bad(format!(
                    "input `{}` has both data and binary_data_size",
                    input.name
                )))
            }
            (None, None) => return Err(bad(format!("input `{}` has no data", input.name))),
            (None, Some(data)) => {
                Feed::Tensor(json_tensor(&input.name, slot.dtype, &slot.dims, data)?)
            }
            (Some(size), None) => {
                let want = slot.dims.iter().product::<usize>() * slot.dtype.size();
                if size != want {
                    return Err(bad(format!(
                        "input `{}`: binary_data_size {size} for shape {:?} of {} ({want} bytes)",
                        input.name, input.shape, input.datatype
                    )));
                }
                let Some(mine) = binary.slice(at, size) else {
                    return Err(bad(format!(
                        "input `{}`: binary_data_size {size} but only {} binary bytes are left in the body",
                        input.name,
                        binary.len() - at
                    )));
                };
                at += size;
                raw_feed(&input.name, &slot, mine)?
            }
        };
        feeds.put(slot, tensor);
    }
    if binary.len() > at {
        return Err(bad(format!(
            "{} bytes of binary data follow the inputs' binary_data_size",
            binary.len() - at
        )));
    }
    let (rows, out) = feeds.finish()?;
    let all_binary = flag(&req.parameters, "binary_data_output")?.unwrap_or(false);
    let as_flag = |b: bool| if b { Out::Binary } else { Out::Json };
    let outputs = match &req.outputs {
        None => model
            .outputs
            .iter()
            .map(|s| (s.name.clone(), as_flag(all_binary)))
            .collect(),
        Some(list) => {
            let mut v: Vec<(String, Out)> = Vec::with_capacity(list.len());
            for o in list {
                check_output(model, &o.name, v.iter().map(|(n, _)| n.as_str()))?;
                let b = flag(&o.parameters, "binary_data")?;
                let out = match json_shm("output", &o.name, &o.parameters)? {
                    Some(p) if b == Some(true) => {
                        return Err(bad(format!(
                        "output `{}` is asked for in shared memory region `{}` and as binary data",
                        o.name, p.region
                    )))
                    }
                    Some(p) => Out::Shm(regions.slice("output", &o.name, &p, None)?),
                    None => as_flag(b.unwrap_or(all_binary)),
                };
                v.push((o.name.clone(), out));
            }
            v
        }
    };
    Ok(Decoded {
        id: req.id,
        rows,
        feeds: out,
        outputs,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn model(max_batch_size: usize) -> ModelInfo {
        ModelInfo {
            name: "m".into(),
            version: "1".into(),
            max_batch_size,
            inputs: vec![TensorSpec {
                name: "x".into(),
                dtype: DType::F32,
                dims: vec![2],
            }],
            outputs: vec![TensorSpec {
                name: "y".into(),
                dtype: DType::F32,
                dims: vec![1],
            }],
            batching: None,
        }
    }

    /// Regions with the extension off.
    fn off() -> Regions {
        Regions::new(false, shm::Limits::default())
    }

    fn chunks(b: &[u8]) -> Chunks {
        Chunks::one(axum::body::Bytes::copy_from_slice(b))
    }

    fn err(m: &ModelInfo, json: &str, bin: &[u8]) -> String {
        match decode(m, json.as_bytes(), chunks(bin), &off()) {
            Err(ApiError::BadRequest(s)) => s,
            other => panic!("{json}: {other:?}"),
        }
    }

    #[test]
    fn json_and_binary_inputs_decode_to_the_same_tensor() {
        let m = model(4);
        let a = decode(
            &m,
            br#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"FP32","data":[[1,2],[3,4]]}]}"#,
            Chunks::default(),
            &off(),
        )
        .unwrap();
        let bytes: Vec<u8> = [1f32, 2., 3., 4.]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let b = decode(
            &m,
            br#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"FP32","parameters":{"binary_data_size":16}}],
                "parameters":{"binary_data_output":true}}"#,
            chunks(&bytes),
            &off(),
        )
        .unwrap();
        assert_eq!(a.rows, 2);
        assert!(matches!(b.feeds[0].1, Feed::Raw { .. }));
        assert_eq!(
            a.feeds[0].1.clone().into_tensor().unwrap(),
            b.feeds[0].1.clone().into_tensor().unwrap()
        );
        let mut written = [0u8; 16];
        assert!(b.feeds[0].1.write_to(&mut written));
        assert_eq!(&written[..], &bytes[..]);
        assert!(a.feeds[0].1.write_to(&mut written));
        assert_eq!(&written[..], &bytes[..]);
        assert!(!b.feeds[0].1.write_to(&mut [0u8; 12]));
        assert!(matches!(&a.outputs[..], [(y, Out::Json)] if y == "y"));
        assert!(matches!(&b.outputs[..], [(y, Out::Binary)] if y == "y"));
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let m = model(4);
        let e = err(
            &m,
            r#"{"inputs":[{"name":"x","shape":[1,3],"datatype":"FP32","data":[1,2,3]}]}"#,
            &[],
        );
        assert!(e.contains("shape [1, 3]"), "{e}");
        let e = err(
            &m,
            r#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"INT64","data":[1,2]}]}"#,
            &[],
        );
        assert!(e.contains("datatype INT64"), "{e}");
        let e = err(
            &m,
            r#"{"inputs":[{"name":"x","shape":[5,2],"datatype":"FP32","data":[]}]}"#,
            &[],
        );
        assert!(e.contains("batch size 5"), "{e}");
        let e = err(
            &m,
            r#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1]}]}"#,
            &[],
        );
        assert!(e.contains("1 data elements"), "{e}");
        let e = err(
            &m,
            r#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1,"a"]}]}"#,
            &[],
        );
        assert!(e.contains("not a number"), "{e}");
        let e = err(
            &m,
            r#"{"inputs":[{"name":"z","shape":[1,2],"datatype":"FP32","data":[1,2]}]}"#,
            &[],
        );
        assert!(e.contains("unknown input `z`"), "{e}");
        let e = err(&m, r#"{"inputs":[]}"#, &[]);
        assert!(e.contains("missing"), "{e}");
        let e = err(&m, r#"{"inputs":[{"name":"x","#, &[]);
        assert!(e.contains("malformed"), "{e}");
        let e = err(
            &m,
            r#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#,
            &[0; 4],
        );
        assert!(e.contains("only 4 binary bytes"), "{e}");
        let e = err(
            &m,
            r#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#,
            &[0; 12],
        );
        assert!(e.contains("4 bytes of binary data follow"), "{e}");
        let e = err(
            &m,
            r#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1,2]}],"outputs":[{"name":"q"}]}"#,
            &[],
        );
        assert!(e.contains("unknown output `q`"), "{e}");
        let e = err(
            &m,
            r#"{"inputs":[{"name":"x","shape":[-1,2],"datatype":"FP32","data":[1,2]}]}"#,
            &[],
        );
        assert!(e.contains("negative"), "{e}");
    }

    #[test]
    fn inputs_and_outputs_in_shared_memory_name_their_regions() {
        let name = format!("lanes-test-{}-tensors", std::process::id());
        let path = std::path::Path::new("/dev/shm").join(&name);
        let bytes: Vec<u8> = [1f32, 2., 3., 4.]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let mut object = bytes.clone();
        object.resize(32, 0);
        std::fs::write(&path, &object).unwrap();
        let regions = Regions::new(true, shm::Limits::default());
        let registered = regions.register("r", &format!("/{name}"), 0, 32);
        let m = model(4);
        let d = decode(
            &m,
            br#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"FP32",
                  "parameters":{"shared_memory_region":"r","shared_memory_byte_size":16}}],
                "outputs":[{"name":"y","parameters":{"shared_memory_region":"r",
                  "shared_memory_offset":16,"shared_memory_byte_size":16}}]}"#,
            Chunks::default(),
            &regions,
        );
        let both = decode(
            &m,
            br#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"FP32","data":[1,2,3,4],
                  "parameters":{"shared_memory_region":"r","shared_memory_byte_size":16}}]}"#,
            Chunks::default(),
            &regions,
        );
        let out_both = decode(
            &m,
            br#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"FP32","data":[1,2,3,4]}],
                "outputs":[{"name":"y","parameters":{"binary_data":true,
                  "shared_memory_region":"r","shared_memory_byte_size":4}}]}"#,
            Chunks::default(),
            &regions,
        );
        let _ = std::fs::remove_file(&path);
        registered.unwrap();
        let d = d.unwrap();
        assert_eq!(d.rows, 2);
        assert!(matches!(d.feeds[0].1, Feed::Shm { .. }));
        let mut written = [0u8; 16];
        assert!(d.feeds[0].1.write_to(&mut written));
        assert_eq!(&written[..], &bytes[..]);
        assert_eq!(
            d.feeds[0].1.clone().into_tensor().unwrap(),
            Tensor::from_f32(vec![2, 2], vec![1., 2., 3., 4.]).unwrap()
        );
        match &d.outputs[..] {
            [(y, Out::Shm(s))] => {
                assert_eq!(
                    (y.as_str(), s.region(), s.offset(), s.len()),
                    ("y", "r", 16, 16)
                )
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(both, Err(ApiError::BadRequest(e)) if e.contains("also carries data")));
        assert!(
            matches!(out_both, Err(ApiError::BadRequest(e)) if e.contains("and as binary data"))
        );
    }

    #[test]
    fn a_model_that_does_not_batch_takes_its_exact_shape() {
        let m = model(0);
        let d = decode(
            &m,
            br#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1,2]}]}"#,
            Chunks::default(),
            &off(),
        )
        .unwrap();
        assert_eq!(d.rows, 1);
        let e = err(
            &m,
            r#"{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1,2]}]}"#,
            &[],
        );
        assert!(e.contains("does not match"), "{e}");
    }

    #[test]
    fn header_lengths_are_checked() {
        assert!(split_body(b"abc", Some("4")).is_err());
        assert!(split_body(b"abc", Some("x")).is_err());
        assert_eq!(
            split_body(b"abcd", Some("3")).unwrap(),
            (&b"abc"[..], &b"d"[..])
        );
        assert_eq!(split_body(b"abcd", None).unwrap(), (&b"abcd"[..], &b""[..]));
    }
}
