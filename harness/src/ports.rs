//! Free loopback ports for a configuration to bind.

use std::net::{SocketAddr, TcpListener};

/// `n` distinct free loopback ports. All `n` are held bound at once while they are picked: a port
/// bound and released one at a time can be handed out again by the kernel for the next pick, and
/// two listeners of one Envoy would then collide. Between the pick and Envoy's bind another
/// process can still take one; [`crate::Launch::start_with`] then starts again on others.
pub fn free_ports(n: usize) -> Vec<u16> {
    #[allow(clippy::expect_used)]
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a free loopback port"))
        .collect();
    listeners.iter().filter_map(|l| l.local_addr().ok()).map(|a| a.port()).collect()
}

/// `127.0.0.1:<port>`.
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}
