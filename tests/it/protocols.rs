//! Every protocol and transport the proxy speaks keeps the promise: HTTP/2 and TLS on the listener and
//! bodies whole or not at all (`listener.rs`), a unix-socket listener (`socket.rs`), HTTP/1.1 trailers
//! (`trailers.rs`), gRPC (`grpc.rs`), JSON-RPC and MCP (`jsonrpc.rs`, the MCP SDK's programs in
//! `mcp_sdk/`), one request of many keys, JSON-RPC batches and GraphQL mutations (`batches.rs`, its
//! Python services and clients in `batches/`), and the upstream over TLS, a unix socket and HTTP/2
//! (`upstream_transports.rs`). One file per protocol.

mod batches;
mod grpc;
mod jsonrpc;
mod listener;
mod socket;
mod trailers;
mod upstream_transports;
