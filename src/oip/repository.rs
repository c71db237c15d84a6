//! The model repository, in Triton's layout:
//!
//! ```text
//! DIR/NAME/config.pbtxt          optional; max_batch_size and dynamic_batching read
//! DIR/NAME/VERSION/model.onnx    VERSION a positive integer; the highest is served
//! ```
//!
//! `config.pbtxt` is protobuf text format; only `max_batch_size` and the
//! `dynamic_batching { max_queue_delay_microseconds preferred_batch_size }`
//! block are read, everything else is skipped (a file that does not
//! tokenize is an error naming the model).

use std::path::{Path, PathBuf};

/// `max_batch_size` of a model whose `config.pbtxt` does not give one and
/// whose inputs have a symbolic first dimension.
pub const DEFAULT_MAX_BATCH: usize = 8;

/// The file a version directory holds.
pub const MODEL_FILE: &str = "model.onnx";

/// Why the repository or a model in it cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum RepositoryError {
    #[error("`{0}` is not a directory")]
    NotADirectory(String),
    #[error("cannot read `{path}`: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("no model `{0}` in the repository")]
    NoModel(String),
    #[error("model `{name}` has no version directory (NAME/1/{MODEL_FILE}) holding {MODEL_FILE}")]
    NoVersion { name: String },
    #[error("model `{name}`: config.pbtxt: {reason}")]
    Config { name: String, reason: String },
}

/// Triton's `dynamic_batching` block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DynamicBatching {
    pub max_queue_delay_us: u64,
    pub preferred_batch_sizes: Vec<usize>,
}

/// What is read of `config.pbtxt`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelConfig {
    pub max_batch_size: Option<usize>,
    pub dynamic_batching: Option<DynamicBatching>,
}

/// One model to load: the repository's newest version of it, or the
/// model file a load request carried.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    pub name: String,
    pub version: u64,
    /// Where the model file is: in the repository, or the request's
    /// parameter that carried it (`file:1/model.onnx`).
    pub file: PathBuf,
    pub config: ModelConfig,
}

/// A repository directory.
#[derive(Debug, Clone)]
pub struct Repository {
    dir: PathBuf,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RepositoryError + '_ {
    move |source| RepositoryError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A model name that is one plain path component.
pub fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.starts_with('.')
        && !name.contains(['/', '\\', '\0'])
}

impl Repository {
    pub fn open(dir: &Path) -> Result<Repository, RepositoryError> {
        if !dir.is_dir() {
            return Err(RepositoryError::NotADirectory(dir.display().to_string()));
        }
        Ok(Repository {
            dir: dir.to_path_buf(),
        })
    }

    /// The models' names (the directories in it), sorted.
    pub fn names(&self) -> Result<Vec<String>, RepositoryError> {
        let mut names = Vec::new();
        for e in std::fs::read_dir(&self.dir).map_err(io(&self.dir))? {
            let e = e.map_err(io(&self.dir))?;
            if !e.path().is_dir() {
                continue;
            }
            if let Some(n) = e.file_name().to_str() {
                if plain_name(n) {
                    names.push(n.to_string());
                }
            }
        }
        names.sort();
        Ok(names)
    }

    /// The model `name`: its newest version holding a model file, and its
    /// configuration.
    pub fn entry(&self, name: &str) -> Result<ModelEntry, RepositoryError> {
        if !plain_name(name) {
            return Err(RepositoryError::NoModel(name.to_string()));
        }
        let dir = self.dir.join(name);
        if !dir.is_dir() {
            return Err(RepositoryError::NoModel(name.to_string()));
        }
        let mut best: Option<u64> = None;
        for e in std::fs::read_dir(&dir).map_err(io(&dir))? {
            let e = e.map_err(io(&dir))?;
            let v = e.file_name().to_str().and_then(|s| s.parse::<u64>().ok());
            if let Some(v) = v {
                if v > 0 && e.path().join(MODEL_FILE).is_file() && best.is_none_or(|b| v > b) {
                    best = Some(v);
                }
            }
        }
        let version = best.ok_or_else(|| RepositoryError::NoVersion {
            name: name.to_string(),
        })?;
        let cfg_path = dir.join("config.pbtxt");
        let config = if cfg_path.is_file() {
            let text = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
            parse_config(&text).map_err(|reason| RepositoryError::Config {
                name: name.to_string(),
                reason,
            })?
        } else {
            ModelConfig::default()
        };
        Ok(ModelEntry {
            name: name.to_string(),
            version,
            file: dir.join(version.to_string()).join(MODEL_FILE),
            config,
        })
    }
}

/// The version of a model file sent in a load request, from its
/// parameter's name: `file:VERSION/model.onnx`, VERSION a positive
/// integer; `None` for any other name.
pub fn file_version(param: &str) -> Option<u64> {
    let (v, file) = param.strip_prefix("file:")?.split_once('/')?;
    // Digits without a leading zero: how a version directory is named.
    let digits = !v.is_empty() && !v.starts_with('0') && v.bytes().all(|b| b.is_ascii_digit());
    if file != MODEL_FILE || !digits {
        return None;
    }
    v.parse().ok()
}

/// Reads `max_batch_size` and `dynamic_batching` from a model
/// configuration in JSON (a load request's `config` parameter: Triton's
/// configuration as protobuf's JSON mapping, where 64-bit integers may be
/// strings); other fields are skipped.
pub fn parse_config_json(text: &str) -> Result<ModelConfig, String> {
    use serde_json::Value;
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("not a JSON object")?;
    fn uint(v: &Value, field: &str) -> Result<u64, String> {
        let n = match v {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.parse().ok(),
            _ => None,
        };
        n.ok_or_else(|| format!("{field}: `{v}` is not a non-negative integer"))
    }
    let size = |v: &Value, field: &str| {
        usize::try_from(uint(v, field)?).map_err(|_| format!("{field} is too large"))
    };
    let mut cfg = ModelConfig::default();
    if let Some(m) = obj.get("max_batch_size") {
        cfg.max_batch_size = Some(size(m, "max_batch_size")?);
    }
    if let Some(b) = obj.get("dynamic_batching") {
        let b = b.as_object().ok_or("dynamic_batching is not an object")?;
        let mut d = DynamicBatching::default();
        if let Some(x) = b.get("max_queue_delay_microseconds") {
            d.max_queue_delay_us = uint(x, "max_queue_delay_microseconds")?;
        }
        if let Some(p) = b.get("preferred_batch_size") {
            let list = p.as_array().ok_or("preferred_batch_size is not a list")?;
            for x in list {
                d.preferred_batch_sizes
                    .push(size(x, "preferred_batch_size")?);
            }
        }
        cfg.dynamic_batching = Some(d);
    }
    Ok(cfg)
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Word(String),
    Str,
    Punct(char),
}

fn tokenize(text: &str) -> Result<Vec<Tok>, String> {
    let mut out = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
        } else if c == '#' {
            for c in chars.by_ref() {
                if c == '\n' {
                    break;
                }
            }
        } else if c == '"' || c == '\'' {
            chars.next();
            let mut closed = false;
            while let Some(d) = chars.next() {
                if d == '\\' {
                    chars.next();
                } else if d == c {
                    closed = true;
                    break;
                }
            }
            if !closed {
                return Err("a string is not closed".into());
            }
            out.push(Tok::Str);
        } else if "{}[]:,;<>".contains(c) {
            chars.next();
            out.push(Tok::Punct(c));
        } else if c.is_alphanumeric() || "_-+.".contains(c) {
            let mut w = String::new();
            while let Some(&d) = chars.peek() {
                if d.is_alphanumeric() || "_-+.".contains(d) {
                    w.push(d);
                    chars.next();
                } else {
                    break;
                }
            }
            out.push(Tok::Word(w));
        } else {
            return Err(format!("unexpected character `{c}`"));
        }
    }
    Ok(out)
}

fn number(tok: Option<&Tok>, field: &str) -> Result<u64, String> {
    match tok {
        Some(Tok::Word(w)) => w
            .parse::<u64>()
            .map_err(|_| format!("{field}: `{w}` is not a non-negative integer")),
        _ => Err(format!("{field}: a number must follow")),
    }
}

/// Reads `max_batch_size` and `dynamic_batching` from a `config.pbtxt`.
pub fn parse_config(text: &str) -> Result<ModelConfig, String> {
    let toks = tokenize(text)?;
    let mut cfg = ModelConfig::default();
    let mut depth = 0usize;
    // Inside `dynamic_batching { … }`: the depth of its braces.
    let mut in_batching: Option<usize> = None;
    let mut i = 0;
    let as_usize = |v: u64, f: &str| usize::try_from(v).map_err(|_| format!("{f} is too large"));
    while i < toks.len() {
        let t = &toks[i];
        i += 1;
        match t {
            Tok::Punct('{') | Tok::Punct('<') => depth += 1,
            Tok::Punct('}') | Tok::Punct('>') => {
                depth = depth.checked_sub(1).ok_or("unbalanced `}`")?;
                if in_batching.is_some_and(|d| depth < d) {
                    in_batching = None;
                }
            }
            Tok::Word(w) if depth == 0 && w == "max_batch_size" => {
                if toks.get(i) == Some(&Tok::Punct(':')) {
                    i += 1;
                }
                let v = number(toks.get(i), w)?;
                i += 1;
                cfg.max_batch_size = Some(as_usize(v, w)?);
            }
            Tok::Word(w) if depth == 0 && w == "dynamic_batching" => {
                if toks.get(i) == Some(&Tok::Punct(':')) {
                    i += 1;
                }
                cfg.dynamic_batching = Some(DynamicBatching::default());
                in_batching = Some(depth + 1);
            }
            Tok::Word(w) if in_batching == Some(depth) => {
                let Some(b) = cfg.dynamic_batching.as_mut() else {
                    continue;
                };
                if toks.get(i) == Some(&Tok::Punct(':')) {
                    i += 1;
                }
                if w == "max_queue_delay_microseconds" {
                    b.max_queue_delay_us = number(toks.get(i), w)?;
                    i += 1;
                } else if w == "preferred_batch_size" {
                    if toks.get(i) == Some(&Tok::Punct('[')) {
                        i += 1;
                        while let Some(t) = toks.get(i) {
                            i += 1;
                            match t {
                                Tok::Punct(']') => break,
                                Tok::Punct(',') => {}
                                t => b
                                    .preferred_batch_sizes
                                    .push(as_usize(number(Some(t), w)?, w)?),
                            }
                        }
                    } else {
                        b.preferred_batch_sizes
                            .push(as_usize(number(toks.get(i), w)?, w)?);
                        i += 1;
                    }
                }
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unbalanced `{`".into());
    }
    Ok(cfg)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn config_fields_are_read_and_the_rest_skipped() {
        let text = r#"
            name: "resnet"   # a comment
            platform: "onnxruntime_onnx"
            max_batch_size: 16
            input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
            instance_group [ { kind: KIND_GPU count: 1 } ]
            dynamic_batching {
              preferred_batch_size: [ 4, 8 ]
              max_queue_delay_microseconds: 100
            }
        "#;
        let c = parse_config(text).unwrap();
        assert_eq!(c.max_batch_size, Some(16));
        assert_eq!(
            c.dynamic_batching,
            Some(DynamicBatching {
                max_queue_delay_us: 100,
                preferred_batch_sizes: vec![4, 8],
            })
        );
        let c = parse_config("dynamic_batching { }").unwrap();
        assert_eq!(c.max_batch_size, None);
        assert_eq!(c.dynamic_batching, Some(DynamicBatching::default()));
    }

    #[test]
    fn nested_fields_of_the_same_name_are_not_taken() {
        let c = parse_config("optimization { max_batch_size: 3 }").unwrap();
        assert_eq!(c.max_batch_size, None);
    }

    #[test]
    fn broken_configs_are_errors() {
        for bad in [
            "max_batch_size: -1",
            "max_batch_size: x",
            "dynamic_batching {",
            "}",
            "name: \"open",
            "max_batch_size",
            "a: $",
        ] {
            assert!(parse_config(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn json_configs_read_the_same_fields() {
        let c = parse_config_json(
            r#"{"name": "m", "backend": "onnxruntime", "max_batch_size": 4,
                "input": [{"name": "x", "dims": [3]}],
                "dynamic_batching": {"max_queue_delay_microseconds": "100",
                                     "preferred_batch_size": [2, 4]}}"#,
        )
        .unwrap();
        assert_eq!(c.max_batch_size, Some(4));
        assert_eq!(
            c.dynamic_batching,
            Some(DynamicBatching {
                max_queue_delay_us: 100,
                preferred_batch_sizes: vec![2, 4],
            })
        );
        assert_eq!(parse_config_json("{}").unwrap(), ModelConfig::default());
        for (bad, why) in [
            ("", "not JSON"),
            ("[1]", "not a JSON object"),
            (r#"{"max_batch_size": -1}"#, "max_batch_size: `-1`"),
            (r#"{"max_batch_size": "x"}"#, "max_batch_size"),
            (r#"{"dynamic_batching": 3}"#, "not an object"),
            (
                r#"{"dynamic_batching": {"preferred_batch_size": 4}}"#,
                "not a list",
            ),
            (
                r#"{"dynamic_batching": {"max_queue_delay_microseconds": 1.5}}"#,
                "max_queue_delay_microseconds",
            ),
        ] {
            let e = parse_config_json(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn request_files_name_a_version_and_model_onnx() {
        assert_eq!(file_version("file:1/model.onnx"), Some(1));
        assert_eq!(file_version("file:12/model.onnx"), Some(12));
        for bad in [
            "file:0/model.onnx",
            "file:+1/model.onnx",
            "file:01/model.onnx",
            "file:1/model.pt",
            "file:1/sub/model.onnx",
            "file:model.onnx",
            "file:x/model.onnx",
            "1/model.onnx",
            "config",
        ] {
            assert_eq!(file_version(bad), None, "{bad}");
        }
    }

    #[test]
    fn names_are_single_components() {
        for bad in ["", ".", "..", "a/b", ".hidden", "a\\b"] {
            assert!(!plain_name(bad), "{bad}");
        }
        assert!(plain_name("resnet-50_v1.2"));
    }
}
