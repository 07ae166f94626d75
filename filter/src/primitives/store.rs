//! Envoy shared data behind a small trait, and the compare-and-swap discipline every writer
//! follows: [`update`] is the filter's one read-modify-write loop, and [`insert_if_absent`] creates
//! a key exactly once (Envoy ignores the CAS token of a write to a key that does not exist, and has
//! no insert-if-absent nor delete). [`MemoryStore`] reproduces those semantics for unit tests and
//! native tools.
//!
//! Invariant: a decision is always taken on the value it replaces: a write that loses a race reads
//! again and decides again ([`write_back`]), at most [`MAX_ATTEMPTS`] times, so no update is lost.
//!
//! Rationale: docs/design.md, section "Shared data and compare-and-swap".

use std::collections::HashMap;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::Mutex;

/// A CAS token from the host (never zero: zero means "don't check").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cas(pub NonZeroU32);

/// A value read from the store and the token to write it back with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The bytes (empty for a key whose value was "removed").
    pub value: Vec<u8>,
    /// The key's CAS token, if the host gave one.
    pub cas: Option<Cas>,
}

/// Why a store operation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// The key changed since it was read.
    CasMismatch,
    /// The host refused with this status code.
    Host(u32),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::CasMismatch => f.write_str("CAS mismatch"),
            StoreError::Host(code) => write!(f, "host status {code}"),
        }
    }
}

/// Process-wide key-value data with compare-and-swap, as Envoy's shared data provides it.
pub trait SharedStore {
    /// Reads a key; `None` when it does not exist.
    fn get(&self, key: &str) -> Result<Option<Stored>, StoreError>;
    /// Writes a key. With `Some(cas)` the write fails with [`StoreError::CasMismatch`] if the
    /// key exists with another token; **a missing key is inserted whatever the token** (Envoy).
    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError>;
}

/// The scratch key whose rewrites issue fresh CAS tokens for [`insert_if_absent`].
pub const TOKEN_KEY: &str = "floodgate/cas-token";

/// Creates `key` with `value` if and only if it does not exist yet. Returns `Ok(true)` when this
/// call created it, `Ok(false)` when it already existed (its value untouched).
pub fn insert_if_absent<S: SharedStore + ?Sized>(
    store: &S,
    key: &str,
    value: &[u8],
) -> Result<bool, StoreError> {
    store.set(TOKEN_KEY, b"", None)?;
    let token = store
        .get(TOKEN_KEY)?
        .and_then(|stored| stored.cas)
        .ok_or(StoreError::Host(0))?;
    match store.set(key, value, Some(token)) {
        Ok(()) => Ok(true),
        Err(StoreError::CasMismatch) => Ok(false),
        Err(other) => Err(other),
    }
}

/// Writes `value` over what was read (`read` is `None` when the key was absent), failing with
/// [`StoreError::CasMismatch`] if anyone wrote or created the key since.
pub fn write_back<S: SharedStore + ?Sized>(
    store: &S,
    key: &str,
    read: Option<&Stored>,
    value: &[u8],
) -> Result<(), StoreError> {
    match read {
        Some(Stored { cas: Some(cas), .. }) => store.set(key, value, Some(*cas)),
        // A host that gave no token for an existing key cannot be written safely.
        Some(Stored { cas: None, .. }) => Err(StoreError::Host(0)),
        None => match insert_if_absent(store, key, value)? {
            true => Ok(()),
            false => Err(StoreError::CasMismatch),
        },
    }
}

/// Attempts of one [`update`] before it gives up on contention. Each lost race means another
/// worker wrote the key in between, so this many in a row is extreme contention on one key; the
/// caller then answers as its mechanism's contention says (a refusal, a lost best-effort write).
pub const MAX_ATTEMPTS: u32 = 32;

/// What one attempt of an [`update`] decided on the value it read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Attempt<B, T> {
    /// Write these bytes over the value read, and answer `T` once the write lands.
    Write(B, T),
    /// Answer `T` without writing.
    Done(T),
}

/// Reads `key` and updates it with a compare-and-swap: `attempt` gets the value read (`None`
/// for an absent key) and decides; a write that finds the key changed since the read reads it
/// again and asks `attempt` again, at most [`MAX_ATTEMPTS`] times. Returns the answer of the
/// attempt that wrote (or decided not to), [`StoreError::CasMismatch`] when every attempt lost
/// its race, or the host's error, which ends it at once.
pub fn update<S, B, T, F>(store: &S, key: &str, attempt: F) -> Result<T, StoreError>
where
    S: SharedStore + ?Sized,
    B: AsRef<[u8]>,
    F: FnMut(Option<&Stored>) -> Attempt<B, T>,
{
    let mut read = store.get(key)?;
    update_from(store, key, &mut read, MAX_ATTEMPTS, attempt)
}

/// [`update`] from a value the caller already read (`read`), in at most `attempts` attempts.
/// `read` is left holding the value the last attempt saw; nothing is read after the last
/// attempt.
pub fn update_from<S, B, T, F>(
    store: &S,
    key: &str,
    read: &mut Option<Stored>,
    attempts: u32,
    mut attempt: F,
) -> Result<T, StoreError>
where
    S: SharedStore + ?Sized,
    B: AsRef<[u8]>,
    F: FnMut(Option<&Stored>) -> Attempt<B, T>,
{
    for left in (0..attempts).rev() {
        let (bytes, answer) = match attempt(read.as_ref()) {
            Attempt::Done(answer) => return Ok(answer),
            Attempt::Write(bytes, answer) => (bytes, answer),
        };
        match write_back(store, key, read.as_ref(), bytes.as_ref()) {
            Ok(()) => return Ok(answer),
            Err(StoreError::CasMismatch) if left > 0 => *read = store.get(key)?,
            Err(error) => return Err(error),
        }
    }
    Err(StoreError::CasMismatch)
}

/// An in-memory [`SharedStore`] with Envoy's semantics: one global CAS counter starting at 1 and
/// skipping 0, tokens ignored for absent keys, token 0 (`None`) meaning an unchecked write.
#[derive(Default)]
pub struct MemoryStore {
    inner: Mutex<MemoryInner>,
}

#[derive(Default)]
struct MemoryInner {
    entries: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// How many keys exist.
    pub fn len(&self) -> usize {
        self.inner.lock().map_or(0, |inner| inner.entries.len())
    }

    /// True when no key exists.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl SharedStore for MemoryStore {
    fn get(&self, key: &str) -> Result<Option<Stored>, StoreError> {
        let inner = self.inner.lock().map_err(|_| StoreError::Host(10))?;
        Ok(inner.entries.get(key).map(|(value, cas)| Stored {
            value: value.clone(),
            cas: NonZeroU32::new(*cas).map(Cas),
        }))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        let mut inner = self.inner.lock().map_err(|_| StoreError::Host(10))?;
        if let (Some((_, stored)), Some(Cas(expected))) = (inner.entries.get(key), cas) {
            if *stored != expected.get() {
                return Err(StoreError::CasMismatch);
            }
        }
        inner.next_cas = match inner.next_cas.wrapping_add(1) {
            0 => 1,
            next => next,
        };
        let issued = inner.next_cas;
        inner.entries.insert(key.to_owned(), (value.to_vec(), issued));
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn memory_store_ignores_the_token_for_absent_keys_like_envoy() {
        let store = MemoryStore::new();
        let bogus = Some(Cas(NonZeroU32::new(12345).unwrap()));
        store.set("k", b"a", bogus).unwrap();
        assert_eq!(store.set("k", b"b", bogus), Err(StoreError::CasMismatch));
        let read = store.get("k").unwrap().unwrap();
        store.set("k", b"c", read.cas).unwrap();
        assert_eq!(store.set("k", b"d", read.cas), Err(StoreError::CasMismatch));
        store.set("k", b"e", None).unwrap();
        assert_eq!(store.get("k").unwrap().unwrap().value, b"e");
    }

    #[test]
    fn insert_if_absent_creates_once() {
        let store = MemoryStore::new();
        assert!(insert_if_absent(&store, "k", b"first").unwrap());
        assert!(!insert_if_absent(&store, "k", b"second").unwrap());
        assert_eq!(store.get("k").unwrap().unwrap().value, b"first");
    }

    #[test]
    fn write_back_after_reading_absent_loses_to_a_concurrent_creator() {
        let store = MemoryStore::new();
        // Worker A reads: absent. Worker B creates the key and updates it.
        assert_eq!(store.get("k").unwrap(), None);
        write_back(&store, "k", None, b"B1").unwrap();
        let read = store.get("k").unwrap();
        write_back(&store, "k", read.as_ref(), b"B2").unwrap();
        // A's write, based on "absent", must fail rather than clobber B's updates.
        assert_eq!(write_back(&store, "k", None, b"A1"), Err(StoreError::CasMismatch));
        assert_eq!(store.get("k").unwrap().unwrap().value, b"B2");
    }

    /// A store whose next `lost` compare-and-swap writes find the key rewritten by another worker.
    struct Racing {
        inner: MemoryStore,
        lost: std::cell::Cell<u32>,
    }

    impl SharedStore for Racing {
        fn get(&self, key: &str) -> Result<Option<Stored>, StoreError> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
            if cas.is_some() && key != TOKEN_KEY && self.lost.get() > 0 {
                self.lost.set(self.lost.get() - 1);
                let current = self.inner.get(key)?.map(|s| s.value).unwrap_or_default();
                self.inner.set(key, &[current, b"+".to_vec()].concat(), None)?;
            }
            self.inner.set(key, value, cas)
        }
    }

    fn append(current: Option<&Stored>) -> Attempt<Vec<u8>, usize> {
        let mut value = current.map(|s| s.value.clone()).unwrap_or_default();
        value.push(b'a');
        let len = value.len();
        Attempt::Write(value, len)
    }

    #[test]
    fn an_update_decides_again_on_what_another_worker_wrote() {
        let store = Racing { inner: MemoryStore::new(), lost: std::cell::Cell::new(0) };
        assert_eq!(update(&store, "k", append), Ok(1));
        store.lost.set(MAX_ATTEMPTS - 1);
        assert_eq!(update(&store, "k", append), Ok(1 + MAX_ATTEMPTS as usize));
        assert_eq!(store.get("k").unwrap().unwrap().value.iter().filter(|b| **b == b'a').count(), 2, "nothing lost");
        store.lost.set(MAX_ATTEMPTS);
        assert_eq!(update(&store, "k", append), Err(StoreError::CasMismatch));
        assert_eq!(store.lost.get(), 0, "{MAX_ATTEMPTS} attempts, no more");
        assert_eq!(update(&store, "k", |_| Attempt::<Vec<u8>, _>::Done("kept")), Ok("kept"));
    }

    #[test]
    fn an_update_from_a_read_starts_on_it_and_leaves_the_last_one() {
        let store = Racing { inner: MemoryStore::new(), lost: std::cell::Cell::new(1) };
        store.inner.set("k", b"x", None).unwrap();
        let mut read = store.get("k").unwrap();
        let mut seen = Vec::new();
        let written = update_from(&store, "k", &mut read, 2, |current| {
            seen.push(current.map(|s| s.value.clone()));
            Attempt::Write(b"y", ())
        });
        assert_eq!(written, Ok(()));
        assert_eq!(seen, vec![Some(b"x".to_vec()), Some(b"x+".to_vec())]);
        assert_eq!(read.unwrap().value, b"x+");
        store.lost.set(1);
        let mut read = store.get("k").unwrap();
        assert_eq!(update_from(&store, "k", &mut read, 1, |_| Attempt::Write(b"z", ())), Err(StoreError::CasMismatch));
        assert_eq!(read.unwrap().value, b"y", "nothing is read after the last attempt");
    }
}
