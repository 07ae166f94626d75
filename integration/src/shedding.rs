//! The load-shedding filter configuration that several tests share, and the health endpoint it
//! exposes.

use serde_json::{json, Value};

/// The health endpoint the shedding tests configure.
pub const HEALTH_PATH: &str = "/floodgate/health";

/// A filter configuration with load shedding at `max` in flight (classes critical 1.0, normal
/// 0.6, low 0.3; default normal; `retry-after` 2 s) and the health endpoint at [`HEALTH_PATH`].
pub fn shedding_config(max: u32) -> Value {
    json!({
        "load_shedding": {
            "max_active_requests": max,
            "classes": [
                {"name": "critical", "shed_at": 1.0},
                {"name": "normal", "shed_at": 0.6},
                {"name": "low", "shed_at": 0.3}
            ],
            "default_class": "normal",
            "retry_after": "2s"
        },
        "health": {"path": HEALTH_PATH}
    })
}
