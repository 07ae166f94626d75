//! A stand-in for Envoy, for the harness's own tests: takes Envoy's `-c <bootstrap>` and
//! `--admin-address-path <file>` (other arguments are ignored), binds the admin port and every
//! listener's port of the bootstrap (JSON) on 127.0.0.1, exits with Envoy's message when one is
//! taken, and otherwise writes the admin address and answers `GET /ready` (`LIVE`) and
//! `GET /listeners?format=json` on the admin port until killed.

use std::io::{Read, Write};
use std::net::TcpListener;

use serde_json::{json, Value};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let (Some(config), Some(admin_path)) = (arg("-c"), arg("--admin-address-path")) else {
        eprintln!("usage: fake-envoy -c <bootstrap> --admin-address-path <file>");
        std::process::exit(2);
    };
    let text = std::fs::read_to_string(&config).unwrap_or_default();
    let bootstrap: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let port = |v: &Value| v["address"]["socket_address"]["port_value"].as_u64().and_then(|p| u16::try_from(p).ok()).unwrap_or(0);
    let bind = |port: u16| {
        TcpListener::bind(("127.0.0.1", port)).unwrap_or_else(|e| {
            eprintln!("[critical][main] cannot bind '127.0.0.1:{port}': {e}");
            std::process::exit(1);
        })
    };
    let admin = bind(port(&bootstrap["admin"]));
    let mut statuses = Vec::new();
    let mut held = Vec::new();
    for listener in bootstrap["static_resources"]["listeners"].as_array().into_iter().flatten() {
        let bound = bind(port(listener));
        let local = bound.local_addr().map(|a| a.port()).unwrap_or(0);
        statuses.push(json!({"name": listener["name"], "local_address": {"socket_address": {"address": "127.0.0.1", "port_value": local}}}));
        held.push(bound);
    }
    let address = admin.local_addr().map(|a| a.to_string()).unwrap_or_default();
    if std::fs::write(&admin_path, address).is_err() {
        std::process::exit(1);
    }
    let listeners = json!({"listener_statuses": statuses}).to_string();
    for stream in admin.incoming().flatten() {
        let mut stream = stream;
        let mut request = Vec::new();
        let mut chunk = [0u8; 1024];
        while !request.ends_with(b"\r\n\r\n") {
            match stream.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => request.extend_from_slice(&chunk[..n]),
            }
        }
        let request = String::from_utf8_lossy(&request);
        let body = if request.starts_with("GET /ready") { "LIVE\n" } else { listeners.as_str() };
        let _ = write!(stream, "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len());
    }
}
