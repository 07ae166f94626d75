//! Fair shares between flows: `load_shedding.flow` (every class's flow key) and a class's own
//! `load_shedding.classes[].flow`. Within a class that has one, the in-flight slots and the
//! queue are shared fairly between the flows its key tells apart ([`crate::shedding::fair`]).
//! Rationale: docs/design.md, section "Fair shares between flows".
//!
//! Invariant: a checked flow has a key, 1 to [`MAX_FLOW_QUEUES`] queues and a hand of 1 to
//! `queues` of them, and its class has a queue of at most [`MAX_FLOW_QUEUED`] waiters.

use super::values::Positive;
use super::{ConfigError, KeyPart, LoadShedding};
use serde::Deserialize;

/// The most queues of a class with flows (which bounds its record).
pub const MAX_FLOW_QUEUES: u32 = 128;
/// The most requests a class with flows may queue proxy-wide (which bounds its record).
pub const MAX_FLOW_QUEUED: u32 = 1024;

/// A flow key and the queues flows are dealt to.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Flow {
    /// The parts of the request that name its flow (a tenant, a client), as a rate limit's `key`;
    /// requests without them are one flow.
    pub key: Vec<KeyPart>,
    /// Queues of the class: the flows' shuffle-shards (more queues, fewer flows share one).
    #[serde(default = "default_queues")]
    pub queues: Positive,
    /// Queues dealt to each flow; a flow takes the shortest of its hand, and keeps to it.
    #[serde(default = "default_hand_size")]
    pub hand_size: Positive,
}

fn default_queues() -> Positive {
    Positive::new(64).unwrap_or(Positive::ONE)
}

fn default_hand_size() -> Positive {
    Positive::new(4).unwrap_or(Positive::ONE)
}

impl Flow {
    /// One line for the start-up log.
    pub fn summary(&self) -> String {
        let key: Vec<String> = self.key.iter().map(ToString::to_string).collect();
        format!("fair shares per flow [{}] ({} queues, hands of {})", key.join(", "), self.queues.get(), self.hand_size.get())
    }
}

impl LoadShedding {
    /// The flow key of class `index`: its own, else the section's (`None`: not shared by flow).
    pub fn flow_of(&self, index: usize) -> Option<&Flow> {
        self.classes.get(index).and_then(|c| c.flow.as_ref()).or(self.flow.as_ref())
    }
}

fn error(path: String, problem: impl Into<String>) -> ConfigError {
    ConfigError { path, problem: problem.into() }
}

/// Checks `load_shedding.flow` and the classes' own.
pub fn validate(shedding: &LoadShedding) -> Result<(), ConfigError> {
    let own = shedding.classes.iter().enumerate().filter_map(|(i, c)| c.flow.as_ref().map(|f| (format!("load_shedding.classes[{i}].flow"), f)));
    let flows: Vec<(String, &Flow)> = shedding.flow.as_ref().map(|f| ("load_shedding.flow".to_owned(), f)).into_iter().chain(own).collect();
    let Some((first, _)) = flows.first() else { return Ok(()) };
    let Some(queue) = &shedding.queue else {
        return Err(error(first.clone(), "needs load_shedding.queue (flows share the class's slots and its queue; without a queue nothing waits)"));
    };
    if shedding.max_active_requests.is_none() {
        return Err(error(first.clone(), "needs max_active_requests (flows share the slots of the in-flight limit)"));
    }
    for (path, flow) in &flows {
        if flow.key.is_empty() {
            return Err(error(format!("{path}.key"), "must list at least one key part"));
        }
        let queues = flow.queues.get().get();
        if queues > MAX_FLOW_QUEUES {
            return Err(error(format!("{path}.queues"), format!("must be at most {MAX_FLOW_QUEUES}, got {queues}")));
        }
        let hand = flow.hand_size.get().get();
        if hand > queues {
            return Err(error(format!("{path}.hand_size"), format!("must be at most queues ({queues}), got {hand}")));
        }
    }
    for index in 0..shedding.classes.len() {
        if shedding.flow_of(index).is_none() {
            continue;
        }
        let queued = queue.class(shedding, index).max_queued;
        if queued > MAX_FLOW_QUEUED {
            let own = shedding.classes.get(index).and_then(|c| c.queue.as_ref()).and_then(|q| q.max_queued).is_some();
            let path = if own { format!("load_shedding.classes[{index}].queue.max_queued") } else { "load_shedding.queue.max_queued".to_owned() };
            return Err(error(path, format!("must be at most {MAX_FLOW_QUEUED} in a class shared by flow, got {queued}")));
        }
    }
    Ok(())
}
