//! Benchmark module: the naive per-key rate limiter floodgate is contrasted with in the memory
//! benchmark. One Envoy shared-data entry per distinct key (`naive/<x-api-key>`), holding a
//! fixed-window counter (window index `u64`, count `u32`), updated by compare-and-swap. Envoy
//! cannot delete shared-data keys, so its memory grows with every distinct key ever seen: that
//! is the point of the contrast. Requests without `x-api-key` pass.
//!
//! Configuration: `limit=N,window_ms=M` (defaults 1000000 and 60000).

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, Status};
use std::time::UNIX_EPOCH;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root { limit: 1_000_000, window_ms: 60_000 }));
}}

#[derive(Clone, Copy)]
struct Root {
    limit: u32,
    window_ms: u64,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let text = self
            .get_plugin_configuration()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("limit", v)) => match v.parse() {
                    Ok(v) if v > 0 => self.limit = v,
                    _ => return false,
                },
                Some(("window_ms", v)) => match v.parse() {
                    Ok(v) if v > 0 => self.window_ms = v,
                    _ => return false,
                },
                _ => {
                    log::error!("naive: bad configuration pair {pair:?}");
                    return false;
                }
            }
        }
        true
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream { root: *self }))
    }
}

struct Stream {
    root: Root,
}

impl Context for Stream {}

fn decode(bytes: &[u8]) -> (u64, u32) {
    if bytes.len() != 12 {
        return (0, 0);
    }
    let mut w = [0u8; 8];
    let mut c = [0u8; 4];
    w.copy_from_slice(&bytes[..8]);
    c.copy_from_slice(&bytes[8..]);
    (u64::from_le_bytes(w), u32::from_le_bytes(c))
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _n: usize, _eos: bool) -> Action {
        let Some(value) = self.get_http_request_header_bytes("x-api-key") else {
            return Action::Continue;
        };
        let now_ms = hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64);
        let window = now_ms / self.root.window_ms;
        let key = format!("naive/{}", String::from_utf8_lossy(&value));
        for _ in 0..16 {
            let (stored, cas) = self.get_shared_data(&key);
            let (w, count) = stored.as_deref().map_or((window, 0), decode);
            let count = if w == window { count } else { 0 };
            if count >= self.root.limit {
                self.send_http_response(429, vec![("content-type", "text/plain")], Some(b"rate limited\n"));
                return Action::Pause;
            }
            let mut record = [0u8; 12];
            record[..8].copy_from_slice(&window.to_le_bytes());
            record[8..].copy_from_slice(&(count + 1).to_le_bytes());
            match self.set_shared_data(&key, Some(&record), cas) {
                Ok(()) => return Action::Continue,
                Err(Status::CasMismatch) => continue,
                Err(_) => return Action::Continue,
            }
        }
        Action::Continue
    }
}
