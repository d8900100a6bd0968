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
    // The part of etcd's v3 API the servers use as their store: a client
    // of a real etcd, no server.
    let etcd = ["etcd/kv.proto", "etcd/rpc.proto"];
    for f in &etcd {
        println!("cargo:rerun-if-changed={f}");
    }
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(protox::compile(etcd, ["."])?)?;
    Ok(())
}
