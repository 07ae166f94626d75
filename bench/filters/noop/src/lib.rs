//! Benchmark module. With no configuration (or an empty one) it does nothing: every callback
//! returns at once, so its cost is the floor any proxy-wasm filter pays in Envoy (the VM calls,
//! the context's creation and destruction).
//!
//! Configured, it makes a fixed number of host calls of each kind per request, so the benchmark
//! can price one call of each kind by difference with the empty configuration. The
//! configuration is `kind=count` pairs separated by commas, e.g. `get=10` or `time=1,header=1`:
//!
//! | kind | per request |
//! |---|---|
//! | `time` | `get_current_time` |
//! | `header` | read request header `x-api-key` (bytes) |
//! | `absent` | read request header `x-absent` (not in the request) |
//! | `pairs` | read all request headers at once (`get_http_request_headers_bytes`) |
//! | `prop` | `get_property(["source", "address"])` |
//! | `get` | `get_shared_data` of an 84-byte record (floodgate's set size) |
//! | `set` | `set_shared_data` of that record, no CAS |
//! | `incr` | `increment_metric` on a counter |
//! | `resp` | add a response header (in the response headers callback) |

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};
use std::rc::Rc;

const KEY: &str = "bench/noop/record";
const RECORD: [u8; 84] = [7; 84];

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root { plan: Rc::new(Plan::default()) }));
}}

#[derive(Default, Clone, Copy)]
struct Plan {
    time: u32,
    header: u32,
    absent: u32,
    pairs: u32,
    prop: u32,
    get: u32,
    set: u32,
    incr: u32,
    resp: u32,
    counter: u32,
}

impl Plan {
    fn is_empty(&self) -> bool {
        self.time + self.header + self.absent + self.pairs + self.prop + self.get + self.set + self.incr + self.resp == 0
    }
}

struct Root {
    plan: Rc<Plan>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let text = self
            .get_plugin_configuration()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let mut plan = Plan::default();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((kind, count)) = pair.split_once('=') else {
                log::error!("noop: bad pair {pair:?}");
                return false;
            };
            let Ok(count) = count.trim().parse::<u32>() else {
                log::error!("noop: bad count in {pair:?}");
                return false;
            };
            let slot = match kind.trim() {
                "time" => &mut plan.time,
                "header" => &mut plan.header,
                "absent" => &mut plan.absent,
                "pairs" => &mut plan.pairs,
                "prop" => &mut plan.prop,
                "get" => &mut plan.get,
                "set" => &mut plan.set,
                "incr" => &mut plan.incr,
                "resp" => &mut plan.resp,
                other => {
                    log::error!("noop: unknown kind {other:?}");
                    return false;
                }
            };
            *slot = count;
        }
        if plan.get + plan.set > 0 && self.set_shared_data(KEY, Some(&RECORD), None).is_err() {
            return false;
        }
        if plan.incr > 0 {
            match hostcalls::define_metric(MetricType::Counter, "bench.noop.calls") {
                Ok(id) => plan.counter = id,
                Err(_) => return false,
            }
        }
        self.plan = Rc::new(plan);
        true
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream { plan: Rc::clone(&self.plan) }))
    }
}

struct Stream {
    plan: Rc<Plan>,
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _n: usize, _eos: bool) -> Action {
        let plan = *self.plan;
        if plan.is_empty() {
            return Action::Continue;
        }
        let mut sink = 0usize;
        for _ in 0..plan.time {
            sink = sink.wrapping_add(hostcalls::get_current_time().map_or(0, |t| t.elapsed().map_or(1, |d| d.as_nanos() as usize)));
        }
        for _ in 0..plan.header {
            sink = sink.wrapping_add(self.get_http_request_header_bytes("x-api-key").map_or(0, |v| v.len()));
        }
        for _ in 0..plan.absent {
            sink = sink.wrapping_add(self.get_http_request_header_bytes("x-absent").map_or(0, |v| v.len()));
        }
        for _ in 0..plan.pairs {
            sink = sink.wrapping_add(self.get_http_request_headers_bytes().len());
        }
        for _ in 0..plan.prop {
            sink = sink.wrapping_add(self.get_property(vec!["source", "address"]).map_or(0, |v| v.len()));
        }
        for _ in 0..plan.get {
            sink = sink.wrapping_add(self.get_shared_data(KEY).0.map_or(0, |v| v.len()));
        }
        for _ in 0..plan.set {
            let _ = self.set_shared_data(KEY, Some(&RECORD), None);
        }
        for _ in 0..plan.incr {
            let _ = hostcalls::increment_metric(plan.counter, 1);
        }
        if sink == usize::MAX {
            log::trace!("{sink}");
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _n: usize, _eos: bool) -> Action {
        for i in 0..self.plan.resp {
            self.add_http_response_header("x-bench", if i % 2 == 0 { "a" } else { "b" });
        }
        Action::Continue
    }
}
