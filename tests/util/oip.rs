//! Shared by the Open Inference Protocol tests (`oip_http`, `oip_grpc`):
//! a model repository of small ONNX models and the reference outputs.

use std::path::{Path, PathBuf};

pub const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/onnx");

/// A model repository in Triton's layout, removed when dropped.
pub struct Repo(pub PathBuf);

impl Drop for Repo {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn put(dir: &Path, name: &str, bytes: &[u8], config: Option<&str>) {
    let v = dir.join(name).join("1");
    std::fs::create_dir_all(&v).unwrap();
    std::fs::write(v.join("model.onnx"), bytes).unwrap();
    if let Some(c) = config {
        std::fs::write(dir.join(name).join("config.pbtxt"), c).unwrap();
    }
}

pub fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{DATA}/{name}")).unwrap()
}

pub fn repo(tag: &str) -> Repo {
    let dir = std::env::temp_dir().join(format!("lanes-oip-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    put(
        &dir,
        "resnet18",
        &fixture("resnet18.onnx"),
        Some("max_batch_size: 4\n"),
    );
    put(&dir, "conv", &fixture("ops_conv.onnx"), None);
    put(&dir, "garbage", b"not a model", None);
    put(&dir, "hardmax", &fixture("unsupported_op.onnx"), None);
    Repo(dir)
}

pub fn npy(name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = lanes::npy::read(format!("{DATA}/{name}")).unwrap();
    (t.shape().dims().to_vec(), t.f32s().unwrap().to_vec())
}

pub fn close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-4 + 1e-4 * w.abs(), "{g} vs {w}");
    }
}
