//! Regenerates adaptor/src/onnx/proto.rs from adaptor/proto/onnx.proto.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::env::args().nth(1).ok_or("usage: protogen ADAPTOR_DIR")?;
    let proto_dir = format!("{root}/proto");
    let fds = protox::compile([format!("{proto_dir}/onnx.proto")], [proto_dir.as_str()])?;
    let out = std::env::temp_dir().join("lanes-onnx-protogen");
    std::fs::create_dir_all(&out)?;
    prost_build::Config::new()
        .out_dir(&out)
        .compile_fds(fds)?;
    std::fs::copy(out.join("onnx.rs"), format!("{root}/src/onnx/proto.rs"))?;
    Ok(())
}
