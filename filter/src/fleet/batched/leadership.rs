//! Leadership of the flusher: the one worker VM per proxy that sends the proxy's batches, at most
//! one per `sync_interval`. The leader renews a leadership record in shared data (its VM id and a
//! heartbeat) at each tick; a VM whose tick finds the heartbeat older than
//! [`LEADERSHIP_STALE_INTERVALS`] intervals (at least [`LEADERSHIP_STALE_MIN_MS`]) takes it over
//! with a compare-and-swap, so a dead or replaced VM is replaced within about a second.
//!
//! Invariants: two VMs never both lead after the same read. A batch names its source (the VM id)
//! and a sequence number strictly increasing per source; a batch that fails is sent again unchanged
//! at the next tick until confirmed, also by a VM that lost the leadership meanwhile, so the store
//! applies each batch exactly once and a new leader's batches cannot shadow it.
//!
//! Rationale: docs/design.md, section "Batched consistency".

use super::outbox::Delta;
use super::protocol::{self, Counter, ProtocolError, Totals};
use crate::fleet::Answer;
use crate::primitives::record::{DecodeError, Fill, Reader, Writer};
use crate::primitives::store::{update_from, Attempt, SharedStore, StoreError};
use crate::primitives::time::UnixMillis;

/// A leadership whose heartbeat is this many intervals old is taken over...
pub const LEADERSHIP_STALE_INTERVALS: u64 = 5;
/// ...and at least this old (ms).
pub const LEADERSHIP_STALE_MIN_MS: u64 = 1000;
/// Compare-and-swap attempts of one claim: a lost race means another VM just wrote the
/// leadership, which is the answer (it leads), so there is no second attempt.
const CLAIM_ATTEMPTS: u32 = 1;

/// The leadership record: the leader's VM id and heartbeat (little-endian `u64`s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leadership {
    /// The leading VM.
    pub vm: u64,
    /// Its last renewal.
    pub heartbeat: UnixMillis,
}

impl Leadership {
    fn decode(bytes: &[u8]) -> Result<Leadership, DecodeError> {
        let mut reader = Reader::new(bytes);
        let leadership = Leadership { vm: reader.u64()?, heartbeat: UnixMillis(reader.u64()?) };
        reader.end()?;
        Ok(leadership)
    }

    fn encode(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        let mut writer = Fill::new(&mut out);
        writer.put_u64(self.vm);
        writer.put_u64(self.heartbeat.0);
        out
    }
}

/// Renews or takes the leadership under `key` for VM `vm` if it is free, its own, or stale; returns
/// whether `vm` leads. One read and at most one write.
pub fn lead<S: SharedStore + ?Sized>(
    store: &S,
    key: &str,
    vm: u64,
    now: UnixMillis,
    interval_ms: u64,
) -> Result<bool, StoreError> {
    let stale_after = interval_ms.saturating_mul(LEADERSHIP_STALE_INTERVALS).max(LEADERSHIP_STALE_MIN_MS);
    let mut read = store.get(key)?;
    let claimed = update_from(store, key, &mut read, CLAIM_ATTEMPTS, |current| {
        let free = match current.and_then(|s| Leadership::decode(&s.value).ok()) {
            None => true,
            Some(leader) if leader.vm == vm => true,
            // A heartbeat from the future (a clock step) counts as stale too, past the same margin.
            Some(leader) => {
                now.saturating_since(leader.heartbeat) >= stale_after
                    || leader.heartbeat.saturating_since(now) >= stale_after
            }
        };
        if free {
            Attempt::Write(Leadership { vm, heartbeat: now }.encode(), true)
        } else {
            Attempt::Done(false)
        }
    });
    match claimed {
        Err(StoreError::CasMismatch) => Ok(false),
        other => other,
    }
}

/// A batch: its sequence number and deltas, in the order of its counters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// The sequence number.
    pub seq: u64,
    /// The deltas, merged per rule, key and bucket (taken out of a [`super::outbox::Deltas`]).
    pub deltas: Vec<Delta>,
}

impl Batch {
    /// The request body.
    pub fn body(&self, source: u64) -> Vec<u8> {
        let counters: Vec<Counter> = self
            .deltas
            .iter()
            .map(|d| Counter { key: d.key, window_ms: d.window_ms, bucket: d.bucket, delta: d.delta, refund: d.refund })
            .collect();
        protocol::encode_request(source, self.seq, &counters)
    }
}

/// Why a batch was not confirmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The call failed with this status, or without one.
    Status(Option<u32>),
    /// The `200` could not be read.
    Protocol(ProtocolError),
}

/// A VM's sending side. It lives as long as the VM (across configuration changes).
#[derive(Clone, Debug)]
pub struct Flusher {
    /// The source id of this VM's batches.
    pub source: u64,
    next_seq: u64,
    batch: Option<Batch>,
    /// The call in flight: its token and when it was sent.
    call: Option<(u32, UnixMillis)>,
}

impl Flusher {
    /// A flusher for source `source`.
    pub fn new(source: u64) -> Flusher {
        Flusher { source, next_seq: 1, batch: None, call: None }
    }

    /// The batch waiting for confirmation, if any.
    pub fn pending(&self) -> Option<&Batch> {
        self.batch.as_ref()
    }

    /// Whether a call is in flight (and not older than `timeout_ms`: a call the host never
    /// answered counts as failed after that).
    pub fn busy(&mut self, now: UnixMillis, timeout_ms: u64) -> bool {
        match self.call {
            Some((_, sent)) if now.saturating_since(sent) <= timeout_ms.saturating_mul(2) && sent <= now => true,
            Some(_) => {
                self.call = None;
                false
            }
            None => false,
        }
    }

    /// The batch to send now: the unconfirmed one again, or a new one of `fresh` deltas (taken
    /// only when there is no unconfirmed batch; `None` when there is nothing to send).
    pub fn next_batch(&mut self, fresh: impl FnOnce() -> Option<Vec<Delta>>) -> Option<&Batch> {
        if self.batch.is_none() {
            let deltas = fresh()?;
            let seq = self.next_seq;
            self.next_seq = self.next_seq.saturating_add(1);
            self.batch = Some(Batch { seq, deltas });
        }
        self.batch.as_ref()
    }

    /// Records that the batch went out as call `token`.
    pub fn sent(&mut self, token: u32, now: UnixMillis) {
        self.call = Some((token, now));
    }

    /// Whether `token` is this flusher's call in flight.
    pub fn owns(&self, token: u32) -> bool {
        self.call.is_some_and(|(t, _)| t == token)
    }

    /// Takes the answer to call `token`: on a `200` that reads, the confirmed batch and its totals
    /// (the batch is done); otherwise why not (the batch stays, to be sent again).
    pub fn answered(&mut self, token: u32, answer: Answer) -> Result<(Batch, Vec<Totals>), Failure> {
        if !self.owns(token) {
            return Err(Failure::Status(None));
        }
        self.call = None;
        let sent = self.batch.as_ref().map_or(0, |b| b.deltas.len());
        match answer {
            Answer::Ok(body) => {
                let totals = protocol::decode_response(&body, sent).map_err(Failure::Protocol)?;
                let batch = self.batch.take().ok_or(Failure::Status(None))?;
                Ok((batch, totals))
            }
            Answer::Failed(status) => Err(Failure::Status(status)),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use crate::keys::fleet::FleetKey;
    use crate::primitives::store::MemoryStore;

    fn delta(n: u32) -> Delta {
        Delta { rule: 1, fingerprint: 2, key: FleetKey(3), window_ms: 1000, bucket: 9, delta: n, requests: n, refund: 0 }
    }

    #[test]
    fn one_vm_leads_and_a_silent_leader_is_replaced() {
        let store = MemoryStore::new();
        let t0 = UnixMillis(1_000_000);
        assert!(lead(&store, "l", 1, t0, 100).unwrap());
        assert!(!lead(&store, "l", 2, t0.plus_ms(200), 100).unwrap(), "1 renewed recently");
        assert!(lead(&store, "l", 1, t0.plus_ms(300), 100).unwrap(), "renewal");
        assert!(!lead(&store, "l", 2, t0.plus_ms(1200), 100).unwrap(), "stale after 1 s, not before");
        assert!(lead(&store, "l", 2, t0.plus_ms(1300), 100).unwrap(), "taken over");
        assert!(!lead(&store, "l", 1, t0.plus_ms(1400), 100).unwrap(), "the old leader learns it lost");
        // A heartbeat far in the future (the clock stepped back) does not pin the leadership forever.
        assert!(lead(&store, "l", 3, t0.plus_ms(1300 - 1000), 100).unwrap());
        store.set("l", b"garbage", None).unwrap();
        assert!(lead(&store, "l", 4, t0, 100).unwrap(), "an unreadable leadership is free");
    }

    #[test]
    fn a_failed_batch_is_sent_again_unchanged_and_new_deltas_wait() {
        let mut f = Flusher::new(0xabc);
        let t = UnixMillis(5_000);
        assert!(f.next_batch(|| None).is_none(), "nothing to send");
        let first = f.next_batch(|| Some(vec![delta(3)])).unwrap().clone();
        assert_eq!(first.seq, 1);
        f.sent(7, t);
        assert!(f.busy(t.plus_ms(10), 1000));
        assert_eq!(f.answered(7, Answer::Failed(Some(503))), Err(Failure::Status(Some(503))));
        let again = f.next_batch(|| panic!("the unconfirmed batch goes first")).unwrap().clone();
        assert_eq!(again, first, "same seq, same deltas");
        f.sent(8, t);
        assert_eq!(f.answered(7, Answer::Ok(Vec::new())), Err(Failure::Status(None)), "a stale token");
        let bad = f.answered(8, Answer::Ok(br#"{"version":1,"counters":[]}"#.to_vec()));
        assert!(matches!(bad, Err(Failure::Protocol(_))));
        f.sent(9, t);
        let (batch, totals) = f
            .answered(9, Answer::Ok(br#"{"version":1,"counters":[{"previous":1,"current":5}]}"#.to_vec()))
            .unwrap();
        assert_eq!(batch, first);
        assert_eq!(totals, vec![Totals { previous: 1, current: 5 }]);
        assert_eq!(f.next_batch(|| Some(vec![delta(1)])).unwrap().seq, 2, "the next batch is the next seq");
    }

    #[test]
    fn an_unanswered_call_stops_blocking_after_twice_the_timeout() {
        let mut f = Flusher::new(1);
        f.next_batch(|| Some(vec![delta(1)]));
        f.sent(1, UnixMillis(0));
        assert!(f.busy(UnixMillis(2000), 1000));
        assert!(!f.busy(UnixMillis(2001), 1000));
        assert_eq!(f.pending().unwrap().seq, 1, "still to be confirmed");
    }

    #[test]
    fn request_bodies_carry_the_source_and_the_seq() {
        let batch = Batch { seq: 12, deltas: vec![delta(4)] };
        let body: serde_json::Value = serde_json::from_slice(&batch.body(0x1f)).unwrap();
        assert_eq!(body["proxy"], "000000000000001f");
        assert_eq!(body["seq"], 12);
        assert_eq!(body["counters"][0]["delta"], 4);
    }
}
