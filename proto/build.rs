//! Compiles the protocol definitions with a pure-Rust protobuf compiler, so
//! building berth needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["csi.proto", "berth/v1/agent.proto"];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
