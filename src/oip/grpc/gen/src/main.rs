//! Regenerates src/oip/grpc/inference.rs from src/oip/grpc/inference.proto.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).ok_or("usage: protogen GRPC_DIR")?;
    let fds = protox::compile([format!("{dir}/inference.proto")], [dir.as_str()])?;
    let out = std::env::temp_dir().join("lanes-oip-protogen");
    std::fs::create_dir_all(&out)?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // The client is generic over its channel: no `connect` tied to
        // tonic's transport, so the service needs only tonic's server.
        .build_transport(false)
        .out_dir(&out)
        .compile_fds(fds)?;
    std::fs::copy(out.join("inference.rs"), format!("{dir}/inference.rs"))?;
    Ok(())
}
