//! Load leveling's configuration: `load_shedding.queue` (a request the in-flight limit would
//! shed waits for a slot instead, in a bounded queue, for a bounded time) and each class's
//! overrides (`load_shedding.classes[].queue`). Rationale: docs/design.md, section "Load
//! leveling".

use super::values::{DurationMs, Positive};
use super::{ConfigError, LoadShedding};
use serde::Deserialize;

/// The longest accepted `max_wait`: a minute (a waiting request holds its connection).
pub const MAX_QUEUE_WAIT_MS: u64 = 60_000;
/// The most requests one class may queue proxy-wide.
pub const MAX_QUEUED: u32 = 100_000;

/// `load_shedding.queue`: the queue every class uses unless it overrides a field.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Queue {
    /// Requests of one class waiting at most, proxy-wide; the next is shed at once.
    pub max_queued: Positive,
    /// How long a request waits for a slot at most; then it is shed.
    pub max_wait: DurationMs,
    /// Which waiter a free slot goes to.
    #[serde(default)]
    pub order: QueueOrder,
    /// CoDel's target: a request that joins a queue standing for `interval` waits this long
    /// at most.
    #[serde(default = "default_target")]
    pub target: DurationMs,
    /// CoDel's interval: a queue that has not been empty for this long is a standing queue.
    #[serde(default = "default_interval")]
    pub interval: DurationMs,
}

/// A class's overrides of `load_shedding.queue`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassQueue {
    /// The class's own `max_queued`.
    #[serde(default)]
    pub max_queued: Option<Positive>,
    /// The class's own `max_wait`.
    #[serde(default)]
    pub max_wait: Option<DurationMs>,
}

/// Which waiter of a class a free slot goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueOrder {
    /// First come, first served while the queue is young; newest first once it has stood for
    /// `interval` (adaptive LIFO).
    #[default]
    AdaptiveLifo,
    /// First come, first served, always.
    Fifo,
}

fn default_target() -> DurationMs {
    DurationMs::from_ms(5).unwrap_or(DurationMs::MIN)
}

fn default_interval() -> DurationMs {
    DurationMs::from_ms(100).unwrap_or(DurationMs::MIN)
}

/// One class's queue, the section's fields with its overrides applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassLimits {
    /// Waiting requests at most, proxy-wide.
    pub max_queued: u32,
    /// The longest wait, ms.
    pub max_wait_ms: u64,
}

impl Queue {
    /// The queue of class `index` of `shedding`.
    pub fn class(&self, shedding: &LoadShedding, index: usize) -> ClassLimits {
        let own = shedding.classes.get(index).and_then(|c| c.queue.as_ref());
        ClassLimits {
            max_queued: own.and_then(|q| q.max_queued).unwrap_or(self.max_queued).get().get(),
            max_wait_ms: own.and_then(|q| q.max_wait).unwrap_or(self.max_wait).get().get(),
        }
    }

    /// A one-line summary.
    pub fn summary(&self) -> String {
        let order = match self.order {
            QueueOrder::AdaptiveLifo => "adaptive LIFO",
            QueueOrder::Fifo => "FIFO",
        };
        format!(
            "queue of {} per class for up to {} ({order}, {} once standing for {})",
            self.max_queued.get(),
            self.max_wait,
            self.target,
            self.interval
        )
    }
}

fn error(path: String, problem: String) -> ConfigError {
    ConfigError { path, problem }
}

/// Checks `load_shedding.queue` and the classes' overrides.
pub fn validate(shedding: &LoadShedding) -> Result<(), ConfigError> {
    let wait_bound = |path: String, wait: DurationMs| {
        if wait.get().get() > MAX_QUEUE_WAIT_MS {
            return Err(error(path, format!("must be at most {}s (a waiting request holds its connection), got {wait}", MAX_QUEUE_WAIT_MS / 1000)));
        }
        Ok(())
    };
    let queued_bound = |path: String, queued: Positive| {
        if queued.get().get() > MAX_QUEUED {
            return Err(error(path, format!("must be at most {MAX_QUEUED}, got {}", queued.get())));
        }
        Ok(())
    };
    let Some(queue) = &shedding.queue else {
        if let Some(index) = shedding.classes.iter().position(|c| c.queue.is_some()) {
            return Err(error(
                format!("load_shedding.classes[{index}].queue"),
                "needs load_shedding.queue (a class overrides the queue's fields; without a queue nothing waits)".into(),
            ));
        }
        return Ok(());
    };
    if shedding.max_active_requests.is_none() {
        return Err(error(
            "load_shedding.queue".into(),
            "needs max_active_requests (a request waits for a slot of the in-flight limit)".into(),
        ));
    }
    queued_bound("load_shedding.queue.max_queued".into(), queue.max_queued)?;
    wait_bound("load_shedding.queue.max_wait".into(), queue.max_wait)?;
    if queue.target.get() > queue.max_wait.get() {
        return Err(error(
            "load_shedding.queue.target".into(),
            format!("must be at most max_wait ({}), got {}", queue.max_wait, queue.target),
        ));
    }
    if queue.interval.get() < queue.target.get() {
        return Err(error(
            "load_shedding.queue.interval".into(),
            format!("must be at least target ({}), got {}", queue.target, queue.interval),
        ));
    }
    for (index, class) in shedding.classes.iter().enumerate() {
        let Some(own) = &class.queue else { continue };
        if let Some(queued) = own.max_queued {
            queued_bound(format!("load_shedding.classes[{index}].queue.max_queued"), queued)?;
        }
        if let Some(wait) = own.max_wait {
            wait_bound(format!("load_shedding.classes[{index}].queue.max_wait"), wait)?;
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::config::Config;

    fn error_of(shedding: &str) -> String {
        Config::parse(format!(r#"{{"load_shedding":{shedding}}}"#).as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn a_queue_is_checked_and_each_refusal_names_its_field() {
        let queue = |q: &str| format!(r#"{{"max_active_requests":4,"queue":{q}}}"#);
        let ok = Config::parse(format!(r#"{{"load_shedding":{}}}"#, queue(r#"{"max_queued":3,"max_wait":"2s"}"#)).as_bytes()).unwrap();
        let shedding = ok.load_shedding.unwrap();
        let parsed = shedding.queue.as_ref().unwrap();
        assert_eq!((parsed.target.get().get(), parsed.interval.get().get()), (5, 100), "CoDel's defaults");
        assert_eq!(parsed.class(&shedding, 0).max_wait_ms, 2000);
        assert!(error_of(&queue(r#"{"max_queued":0,"max_wait":"1s"}"#)).starts_with("load_shedding.queue.max_queued: must be a positive integer"));
        assert!(error_of(&queue(r#"{"max_queued":100001,"max_wait":"1s"}"#)).starts_with("load_shedding.queue.max_queued: must be at most 100000"));
        assert!(error_of(&queue(r#"{"max_queued":3,"max_wait":"0s"}"#)).starts_with("load_shedding.queue.max_wait: "));
        assert!(error_of(&queue(r#"{"max_queued":3,"max_wait":"2m"}"#)).starts_with("load_shedding.queue.max_wait: must be at most 60s"));
        assert!(error_of(&queue(r#"{"max_queued":3}"#)).starts_with("load_shedding.queue: missing field `max_wait`"));
        assert!(error_of(&queue(r#"{"max_queued":3,"max_wait":"1s","target":"2s"}"#)).starts_with("load_shedding.queue.target: must be at most max_wait"));
        assert!(error_of(&queue(r#"{"max_queued":3,"max_wait":"1s","target":"50ms","interval":"10ms"}"#)).starts_with("load_shedding.queue.interval: must be at least target"));
        assert!(error_of(&queue("[3, \"1s\"]")).starts_with("load_shedding.queue: must be a JSON object"));
        assert!(error_of(r#"{"max_loop_lag":"100ms","queue":{"max_queued":3,"max_wait":"1s"}}"#).starts_with("load_shedding.queue: needs max_active_requests"));
        let class = r#"{"max_active_requests":4,"classes":[{"name":"normal","shed_at":1.0,"queue":{"max_wait":"1s"}}]}"#;
        assert!(error_of(class).starts_with("load_shedding.classes[0].queue: needs load_shedding.queue"));
        let class = r#"{"max_active_requests":4,"queue":{"max_queued":3,"max_wait":"1s"},"classes":[{"name":"normal","shed_at":1.0,"queue":{"max_wait":"61s"}}]}"#;
        assert!(error_of(class).starts_with("load_shedding.classes[0].queue.max_wait: must be at most 60s"));
    }
}
