//! The per-key cap, the bulkhead of load shedding (`load_shedding.per_key`): one key holds at most
//! `max_active_requests` requests in flight proxy-wide, so one client's slow requests cannot take
//! the whole concurrency. The counts live in a bounded table of shared-data sets of [`WAYS`]
//! entries, each one key's requests on one worker with that worker's heartbeat; each worker also
//! keeps its own exact count per key, which the entries mirror.
//!
//! Invariants: exact across workers, and never looser: a request whose set has no free entry is
//! refused (`untracked`); a worker that dies stops counting after [`STALE_AFTER_MS`]; a release
//! whose write is lost is published again by the heartbeat.
//!
//! Rationale: docs/design.md, section "The per-key cap (bulkhead)".

use crate::config::{KeyPart, PerKey};
use crate::primitives::inflight::{HEARTBEAT_MS, STALE_AFTER_MS};
use crate::primitives::record::{DecodeError, Reader, Writer};
use crate::primitives::store::{update, Attempt, SharedStore, StoreError, Stored};
use crate::primitives::time::MonoMillis;
use std::cell::RefCell;
use std::collections::HashMap;
use std::num::NonZeroU64;
use std::rc::Rc;

/// Entries of one set.
pub const WAYS: usize = 8;

const RECORD_VERSION: u8 = 1;
const HEADER_LEN: usize = 4;
const ENTRY_LEN: usize = 8 + 8 + 4 + 8;

/// One key's requests in flight on one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    key: u64,
    vm: u64,
    in_flight: u32,
    heartbeat: MonoMillis,
}

fn is_live(entry: &Entry, now: MonoMillis) -> bool {
    now.saturating_since(entry.heartbeat) < STALE_AFTER_MS && entry.heartbeat.saturating_since(now) < STALE_AFTER_MS
}

/// A set's entries. Layout (little-endian): version `u8`, entry count `u8`, 2 zero bytes, then
/// per entry key hash `u64`, worker id `u64`, in flight `u32`, heartbeat (monotonic ms) `u64`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct KeySet {
    entries: Vec<Entry>,
}

impl KeySet {
    /// Reads a set; `None` for anything malformed (it is not trusted).
    fn decode(bytes: &[u8]) -> Option<KeySet> {
        fn read(bytes: &[u8]) -> Result<KeySet, DecodeError> {
            let mut reader = Reader::new(bytes);
            let [version, count, _, _] = reader.array::<HEADER_LEN>()?;
            if version != RECORD_VERSION || usize::from(count) > WAYS || reader.remaining() != usize::from(count).saturating_mul(ENTRY_LEN) {
                return Err(DecodeError::Malformed);
            }
            let entries = (0..count)
                .map(|_| Ok(Entry { key: reader.u64()?, vm: reader.u64()?, in_flight: reader.u32()?, heartbeat: MonoMillis(reader.u64()?) }))
                .collect::<Result<_, DecodeError>>()?;
            Ok(KeySet { entries })
        }
        read(bytes).ok()
    }

    fn encode(&self) -> Vec<u8> {
        let count = self.entries.len().min(WAYS);
        let mut out = Vec::with_capacity(HEADER_LEN.saturating_add(count.saturating_mul(ENTRY_LEN)));
        out.put(&[RECORD_VERSION, u8::try_from(count).unwrap_or(u8::MAX), 0, 0]);
        for e in self.entries.iter().take(count) {
            out.put_u64(e.key);
            out.put_u64(e.vm);
            out.put_u32(e.in_flight);
            out.put_u64(e.heartbeat.0);
        }
        out
    }

    /// Requests of `key` in flight on live workers other than `vm`.
    fn others(&self, key: u64, vm: u64, now: MonoMillis) -> u32 {
        self.entries
            .iter()
            .filter(|e| e.key == key && e.vm != vm && is_live(e, now))
            .fold(0u32, |sum, e| sum.saturating_add(e.in_flight))
    }

    /// Sets `vm`'s count of `key` (removing its entry at 0), dropping dead and empty entries;
    /// false if there is no room for it.
    fn publish(&mut self, key: u64, vm: u64, in_flight: u32, now: MonoMillis) -> bool {
        self.entries.retain(|e| !(e.key == key && e.vm == vm) && is_live(e, now) && e.in_flight > 0);
        if in_flight == 0 {
            return true;
        }
        if self.entries.len() >= WAYS {
            return false;
        }
        self.entries.push(Entry { key, vm, in_flight, heartbeat: now });
        true
    }
}

/// A set as read (`None`: absent). A malformed record is not trusted: it is replaced at the next
/// write.
fn set_of(stored: Option<&Stored>) -> KeySet {
    stored.and_then(|s| KeySet::decode(&s.value)).unwrap_or_default()
}

/// This worker's own counts per key (exact: a worker is single-threaded), shared by the permits.
pub type LocalKeys = Rc<RefCell<HashMap<u64, u32>>>;

/// A request's hold on one unit of its key's cap, released exactly once: by
/// [`PerKeyCap::release`] when the stream ends (or its refusal is sent), or, should the stream
/// vanish without that, by `Drop`, which lowers the worker's count for the heartbeat to publish.
#[derive(Debug)]
#[must_use = "an admitted request must release its key's unit when its stream ends"]
pub struct KeyPermit {
    key: u64,
    local: LocalKeys,
    released: bool,
}

impl KeyPermit {
    fn end(&mut self) {
        if !self.released {
            self.released = true;
            if let Some(count) = self.local.borrow_mut().get_mut(&self.key) {
                *count = count.saturating_sub(1);
            }
        }
    }
}

impl Drop for KeyPermit {
    fn drop(&mut self) {
        self.end();
    }
}

/// Why a request was refused by its key's cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapRefusal {
    /// The key has `in_flight` requests in flight, the cap.
    Full {
        /// Its requests in flight proxy-wide.
        in_flight: u32,
    },
    /// The key's set has no free entry (every one is another key in flight), or its record
    /// could not be updated: the request cannot be counted, so it is not admitted.
    Untracked,
}

/// The per-key cap of one configuration.
#[derive(Clone, Debug)]
pub struct PerKeyCap {
    /// The key parts it reads.
    pub key: Vec<KeyPart>,
    /// Requests of one key in flight at most.
    pub max_active_requests: u32,
    sets: NonZeroU64,
    key_prefix: String,
}

impl PerKeyCap {
    /// The cap of `config`, its records under `namespace`.
    pub fn new(config: &PerKey, namespace: &str) -> PerKeyCap {
        let entries = u64::from(config.capacity.get().get());
        PerKeyCap {
            key: config.key.clone(),
            max_active_requests: config.max_active_requests.get().get(),
            sets: NonZeroU64::new(entries.div_ceil(WAYS as u64)).unwrap_or(NonZeroU64::MIN),
            key_prefix: format!("floodgate/{namespace}/per-key/{}x{WAYS}/", config.capacity.get()),
        }
    }

    /// The prefix of its records: configurations with the same one share the table (and a
    /// VM's counts in it).
    pub fn table(&self) -> &str {
        &self.key_prefix
    }

    fn set_key(&self, key: u64) -> String {
        format!("{}{}", self.key_prefix, key.checked_rem(self.sets.get()).unwrap_or(0))
    }

    fn read<S: SharedStore + ?Sized>(&self, store: &S, set_key: &str) -> Result<KeySet, StoreError> {
        Ok(set_of(store.get(set_key)?.as_ref()))
    }

    /// Admits a request of the key of hash `key` on worker `vm` (its counts `local`), or
    /// refuses it.
    pub fn try_acquire<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        vm: u64,
        local: &LocalKeys,
        key: u64,
        now: MonoMillis,
    ) -> Result<KeyPermit, CapRefusal> {
        let set_key = self.set_key(key);
        let mine = local.borrow().get(&key).copied().unwrap_or(0);
        let published = update(store, &set_key, |current| {
            let mut set = set_of(current);
            let in_flight = set.others(key, vm, now).saturating_add(mine);
            if in_flight >= self.max_active_requests {
                return Attempt::Done(Err(CapRefusal::Full { in_flight }));
            }
            if !set.publish(key, vm, mine.saturating_add(1), now) {
                return Attempt::Done(Err(CapRefusal::Untracked));
            }
            Attempt::Write(set.encode(), Ok(()))
        });
        match published {
            Ok(Ok(())) => {
                *local.borrow_mut().entry(key).or_insert(0) = mine.saturating_add(1);
                Ok(KeyPermit { key, local: Rc::clone(local), released: false })
            }
            Ok(Err(refusal)) => Err(refusal),
            Err(_) => Err(CapRefusal::Untracked),
        }
    }

    /// Ends an admitted request: lowers the worker's count and publishes it (should the write
    /// fail, the heartbeat does).
    pub fn release<S: SharedStore + ?Sized>(&self, store: &S, vm: u64, mut permit: KeyPermit, now: MonoMillis) {
        permit.end();
        let count = permit.local.borrow().get(&permit.key).copied().unwrap_or(0);
        if self.publish(store, vm, permit.key, count, now) && count == 0 {
            permit.local.borrow_mut().remove(&permit.key);
        }
    }

    fn publish<S: SharedStore + ?Sized>(&self, store: &S, vm: u64, key: u64, count: u32, now: MonoMillis) -> bool {
        let set_key = self.set_key(key);
        update(store, &set_key, |current| {
            let mut set = set_of(current);
            let published = match set.entries.iter().find(|e| e.key == key && e.vm == vm) {
                Some(e) => e.in_flight == count && now.saturating_since(e.heartbeat) < HEARTBEAT_MS,
                None => count == 0,
            };
            if published {
                return Attempt::Done(true);
            }
            // Lowering always fits; a count the worker already holds was granted before.
            set.publish(key, vm, count, now);
            Attempt::Write(set.encode(), true)
        })
        .unwrap_or(false)
    }

    /// Once a second: refreshes this worker's entries (so they stay live), publishes counts whose
    /// write was lost, and forgets keys with nothing in flight once published.
    pub fn heartbeat<S: SharedStore + ?Sized>(&self, store: &S, vm: u64, local: &LocalKeys, now: MonoMillis) {
        let keys: Vec<(u64, u32)> = local.borrow().iter().map(|(k, c)| (*k, *c)).collect();
        for (key, count) in keys {
            if self.publish(store, vm, key, count, now) && count == 0 {
                let mut local = local.borrow_mut();
                if local.get(&key) == Some(&0) {
                    local.remove(&key);
                }
            }
        }
    }

    /// Requests of the key of hash `key` in flight proxy-wide, as this worker reads them.
    pub fn in_flight<S: SharedStore + ?Sized>(&self, store: &S, vm: u64, local: &LocalKeys, key: u64, now: MonoMillis) -> u32 {
        let mine = local.borrow().get(&key).copied().unwrap_or(0);
        self.read(store, &self.set_key(key)).map_or(mine, |set| set.others(key, vm, now).saturating_add(mine))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::cast_precision_loss)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::primitives::store::MemoryStore;

    const T0: MonoMillis = MonoMillis(1_000_000);

    fn cap(max: u32) -> PerKeyCap {
        let config = Config::parse(
            format!(r#"{{"load_shedding":{{"per_key":{{"key":[{{"header":"x-k"}}],"max_active_requests":{max},"capacity":16}}}}}}"#).as_bytes(),
        )
        .unwrap();
        PerKeyCap::new(config.load_shedding.as_ref().unwrap().per_key.as_ref().unwrap(), "t")
    }

    #[test]
    fn a_key_holds_at_most_its_cap_across_workers_and_comes_back_to_zero() {
        let store = MemoryStore::new();
        let cap = cap(3);
        let (a, b): (LocalKeys, LocalKeys) = (LocalKeys::default(), LocalKeys::default());
        let mut permits = Vec::new();
        for i in 0..10 {
            let (vm, local) = if i % 2 == 0 { (1, &a) } else { (2, &b) };
            if let Ok(permit) = cap.try_acquire(&store, vm, local, 42, T0) {
                permits.push((vm, permit));
            }
        }
        assert_eq!(permits.len(), 3, "exactly the cap");
        assert_eq!(cap.try_acquire(&store, 1, &a, 42, T0).unwrap_err(), CapRefusal::Full { in_flight: 3 });
        assert!(cap.try_acquire(&store, 1, &a, 43, T0).is_ok(), "another key is not affected");
        for (vm, permit) in permits {
            cap.release(&store, vm, permit, T0);
        }
        assert_eq!(cap.in_flight(&store, 1, &a, 42, T0), 0);
        assert!(!a.borrow().contains_key(&42) && !b.borrow().contains_key(&42), "nothing left to follow");
    }

    #[test]
    fn a_dropped_permit_is_published_by_the_heartbeat_and_a_dead_worker_expires() {
        let store = MemoryStore::new();
        let cap = cap(2);
        let (a, b): (LocalKeys, LocalKeys) = (LocalKeys::default(), LocalKeys::default());
        let permit = cap.try_acquire(&store, 1, &a, 7, T0).unwrap();
        drop(permit); // the stream vanished without its release
        assert_eq!(cap.in_flight(&store, 2, &b, 7, T0), 1, "not yet published");
        cap.heartbeat(&store, 1, &a, T0);
        assert_eq!(cap.in_flight(&store, 2, &b, 7, T0), 0);
        // Worker 1 takes two and dies: after STALE_AFTER_MS its entry no longer counts.
        let held: Vec<_> = (0..2).map(|_| cap.try_acquire(&store, 1, &a, 7, T0).unwrap()).collect();
        assert!(cap.try_acquire(&store, 2, &b, 7, T0.plus_ms(STALE_AFTER_MS - 1)).is_err());
        assert!(cap.try_acquire(&store, 2, &b, 7, T0.plus_ms(STALE_AFTER_MS)).is_ok());
        drop(held);
    }

    #[test]
    fn a_full_set_refuses_what_it_cannot_count() {
        let store = MemoryStore::new();
        let cap = cap(100); // 16 entries: 2 sets of 8
        let local = LocalKeys::default();
        // Keys of set 0 (even hashes), each in flight once: 8 fill it.
        let held: Vec<_> = (0..8).map(|i| cap.try_acquire(&store, 1, &local, i * 2, T0).unwrap()).collect();
        assert_eq!(cap.try_acquire(&store, 1, &local, 100, T0).unwrap_err(), CapRefusal::Untracked);
        assert!(cap.try_acquire(&store, 1, &local, 0, T0).is_ok(), "a key already there still counts");
        assert!(cap.try_acquire(&store, 1, &local, 101, T0).is_ok(), "the other set has room");
        drop(held);
    }

    #[test]
    fn records_round_trip_and_refuse_corruption() {
        let mut set = KeySet::default();
        assert!(set.publish(1, 2, 3, T0));
        assert!(set.publish(4, 5, 6, T0));
        let bytes = set.encode();
        assert_eq!(KeySet::decode(&bytes), Some(set));
        for cut in 0..bytes.len() {
            assert_eq!(KeySet::decode(&bytes[..cut]), None, "cut at {cut}");
        }
        let mut bad = bytes.clone();
        bad[1] = 9;
        assert_eq!(KeySet::decode(&bad), None);
    }
}
