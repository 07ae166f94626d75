//! The watchdog: a liveness answer, apart from the health endpoint's readiness, that fails
//! while the proxy is degraded in ways a restart cures.
//!
//! **What it sees.** Every worker VM writes a heartbeat into one shared record per filter
//! namespace at its heartbeat (every second, [`HEARTBEAT_MS`]): when it first and last beat,
//! its loop lag and since when it lags, its Wasm linear memory, and whether it is back from a
//! silence. The liveness probe is answered by whichever worker gets it, from that record: a
//! blocked worker cannot answer, but another worker sees that it went silent. The answer fails
//! (`503`) while
//! - a worker is **silent**: its last heartbeat is older than `worker_silence`, while another
//!   VM of the proxy (another worker, or the main thread's) beats. A VM is a **worker** once it
//!   serves an HTTP stream ([`Watchdog::serving`]: its first stream writes its entry at once,
//!   heartbeat or not, so a worker blocked by its very first request is seen); it counts from
//!   then. The main thread's VM beats too but serves no stream: it tells the others' silence
//!   apart and is no worker; nor is a VM that validated a configuration and never ticked. One
//!   that was **retired** cleanly (its configuration replaced or removed, the VM shut down:
//!   [`Watchdog::retire`]) is not silent; nor one that was **replaced**, a VM that started after
//!   it went silent (Envoy's `FAIL_RELOAD` made a new VM for the crashed one). How many workers
//!   there are is the record's business: each worker's entry is in it;
//! - a worker is **back from a silence** and has not yet beaten `recover_after` times in a row
//!   on time since;
//! - a worker has **lagged** past `max_loop_lag` for `lag_for`: the lag is measured at each
//!   heartbeat (how late it came, or the load-shedding lag probe's median when there is one,
//!   whichever is larger); it starts at a heartbeat that late and ends only after
//!   `recover_after` heartbeats in a row under it;
//! - a worker's **linear memory** is past `max_memory_mb` (Wasm memory never shrinks: a leak
//!   stays until the VM is replaced).
//!
//! **Why it does not flap.** Each failure must last its configured time before it counts, and
//! recovery needs `recover_after` good observations in a row: a worker that lags every other
//! heartbeat, or stalls for longer than `worker_silence` every few seconds, keeps the answer
//! failing rather than toggling it. Overload the proxy copes with (shedding at
//! `max_active_requests`, a loop lag under `max_loop_lag`, or over it for less than `lag_for`)
//! never fails it: the restart that liveness triggers would make that overload worse.
//!
//! Record layout (little-endian): the list header ([`Reader::list_header`]: version, 3 zero
//! bytes, `u32` count), then per entry: VM id `u64`, started `u64`, last heartbeat `u64`
//! (monotonic ms), lagging since `u64` (0: not lagging), linear memory in bytes `u64` (0:
//! unknown), loop lag in ms `u32`, heartbeats still to recover `u8`, flags `u8` (bit 0:
//! retired, bit 1: serves streams), 2 zero bytes.

use crate::config;
use crate::primitives::inflight::{HEARTBEAT_MS, MAX_VMS};
use crate::primitives::record::{DecodeError, Reader, Writer};
use crate::primitives::store::{update, Attempt, SharedStore, StoreError};
use crate::primitives::time::MonoMillis;

const RECORD_VERSION: u8 = 1;
const ENTRY_LEN: usize = 8 * 5 + 4 + 1 + 1 + 2;
const RETIRED: u8 = 1;
const SERVES: u8 = 2;

/// One VM's heartbeat, as the record holds it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Beat {
    /// The VM's random id.
    pub vm: u64,
    /// When it started: its first configuration, or else its first heartbeat.
    pub first: MonoMillis,
    /// Its last heartbeat.
    pub last: MonoMillis,
    /// Since when its loop lags past `max_loop_lag` (not yet recovered), if it does.
    pub lagging_since: Option<MonoMillis>,
    /// Its Wasm linear memory, in bytes, if known.
    pub memory_bytes: Option<u64>,
    /// Its loop lag at its last heartbeat, in milliseconds.
    pub lag_ms: u32,
    /// Good heartbeats it still needs after a silence.
    pub recovering: u8,
    /// Its configuration was retired cleanly.
    pub retired: bool,
    /// It serves HTTP streams: a worker (the main thread's VM serves none).
    pub serves: bool,
}

/// The watchdog's shared record: one entry per VM.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// The entries.
    pub beats: Vec<Beat>,
}

impl Record {
    /// Reads a record, refusing anything malformed.
    pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
        let mut reader = Reader::new(bytes);
        let (version, count) = reader.list_header(ENTRY_LEN)?;
        if version != RECORD_VERSION || count > MAX_VMS {
            return Err(DecodeError::Malformed);
        }
        let nonzero = |ms: u64| (ms != 0).then_some(ms);
        let beats = (0..count)
            .map(|_| {
                let vm = reader.u64()?;
                let first = MonoMillis(reader.u64()?);
                let last = MonoMillis(reader.u64()?);
                let lagging_since = nonzero(reader.u64()?).map(MonoMillis);
                let memory_bytes = nonzero(reader.u64()?);
                let lag_ms = reader.u32()?;
                let [recovering, flags, _, _] = reader.array::<4>()?;
                Ok(Beat { vm, first, last, lagging_since, memory_bytes, lag_ms, recovering, retired: flags & RETIRED != 0, serves: flags & SERVES != 0 })
            })
            .collect::<Result<Vec<_>, DecodeError>>()?;
        Ok(Record { beats })
    }

    /// Writes the record.
    pub fn encode(&self) -> Vec<u8> {
        let count = self.beats.len().min(MAX_VMS);
        let mut out = Vec::with_capacity(8usize.saturating_add(count.saturating_mul(ENTRY_LEN)));
        out.put_list_header(RECORD_VERSION, count);
        for beat in self.beats.iter().take(count) {
            out.put_u64(beat.vm);
            out.put_u64(beat.first.0);
            out.put_u64(beat.last.0);
            out.put_u64(beat.lagging_since.map_or(0, |t| t.0.max(1)));
            out.put_u64(beat.memory_bytes.unwrap_or(0));
            out.put_u32(beat.lag_ms);
            let flags = if beat.retired { RETIRED } else { 0 } | if beat.serves { SERVES } else { 0 };
            out.put(&[beat.recovering, flags, 0, 0]);
        }
        out
    }

    /// Reads the record at `key` (absent or malformed: empty).
    fn read(store: &dyn SharedStore, key: &str) -> Record {
        store.get(key).ok().flatten().and_then(|s| Record::decode(&s.value).ok()).unwrap_or_default()
    }

    /// Whether a VM started (was configured) after `beat` last beat: it was replaced. The VMs
    /// of a proxy are configured as it starts, before it takes requests; a VM configured later
    /// is one Envoy made for a failed one, or a new VM configuration.
    fn replaced(&self, beat: &Beat) -> bool {
        self.beats.iter().any(|other| other.vm != beat.vm && other.first > beat.last)
    }
}

/// One worker VM's own side of the watchdog, kept between its heartbeats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerState {
    /// When it started (was configured), or else its first heartbeat.
    first: Option<MonoMillis>,
    /// Its last heartbeat.
    last: Option<MonoMillis>,
    /// Since when it lags, until `recover_after` good heartbeats in a row.
    lagging_since: Option<MonoMillis>,
    /// Good heartbeats in a row while `lagging_since` is set.
    good_in_a_row: u32,
    /// Good heartbeats it still needs after a silence.
    recovering: u32,
    /// The lag measured at the last heartbeat.
    lag_ms: u64,
    /// Its entry says it serves streams.
    serves: bool,
}

impl WorkerState {
    /// The state of a VM configured at `now`: its entry, once written, says it started then
    /// ([`Beat::first`]), which tells a VM that replaced a silent one: it started after the
    /// silent one last beat.
    pub fn started(now: MonoMillis) -> WorkerState {
        WorkerState { first: Some(now), ..WorkerState::default() }
    }

    /// Whether its entry says it serves streams ([`Watchdog::serving`]).
    pub fn serves(&self) -> bool {
        self.serves
    }
}

/// Why a worker fails the liveness answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Problem {
    /// No heartbeat for this long, while another worker beats.
    Silent {
        /// Since its last heartbeat, in milliseconds.
        for_ms: u64,
    },
    /// Back from a silence, this many good heartbeats short of recovered.
    Recovering {
        /// Heartbeats still needed.
        heartbeats_left: u8,
    },
    /// Its loop has lagged past `max_loop_lag` for this long.
    Lagging {
        /// Since it started, in milliseconds.
        for_ms: u64,
    },
    /// Its linear memory is past `max_memory_mb`.
    Memory {
        /// Its memory, in bytes.
        bytes: u64,
    },
}

/// One worker, as the liveness answer shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerView {
    /// Its VM id.
    pub vm: u64,
    /// Since its last heartbeat, in milliseconds.
    pub heartbeat_age_ms: u64,
    /// Its loop lag at its last heartbeat, in milliseconds.
    pub lag_ms: u32,
    /// Its linear memory, in bytes, if known.
    pub memory_bytes: Option<u64>,
    /// What fails it, if anything.
    pub problem: Option<Problem>,
}

/// The liveness verdict, as one worker reads the record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Liveness {
    /// The workers that count (serving streams, not retired, not replaced).
    pub workers: Vec<WorkerView>,
}

impl Liveness {
    /// Whether the proxy is alive: no worker fails.
    pub fn alive(&self) -> bool {
        self.workers.iter().all(|w| w.problem.is_none())
    }
}

/// The watchdog of a configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Watchdog {
    /// The liveness path.
    pub path: String,
    /// The shared record's key.
    key: String,
    /// `worker_silence`, in milliseconds.
    pub silence_ms: u64,
    /// `max_loop_lag`, in milliseconds.
    pub max_lag_ms: u64,
    /// `lag_for`, in milliseconds.
    pub lag_for_ms: u64,
    /// `max_memory_mb`, in bytes.
    pub max_memory_bytes: Option<u64>,
    /// `recover_after`.
    pub recover_after: u32,
}

impl Watchdog {
    /// The watchdog of `config` under `namespace` (the plugin's name).
    pub fn new(config: &config::Watchdog, namespace: &str) -> Watchdog {
        Watchdog {
            path: config.path.clone(),
            key: format!("floodgate/{namespace}/watchdog"),
            silence_ms: config.worker_silence.get().get(),
            max_lag_ms: config.max_loop_lag.get().get(),
            lag_for_ms: config.lag_for.get().get(),
            max_memory_bytes: config.max_memory_mb.map(|mb| u64::from(mb.get().get()).saturating_mul(1 << 20)),
            recover_after: config.recover_after.get().get().min(u32::from(u8::MAX)),
        }
    }

    /// The shared record's key.
    pub fn record_key(&self) -> &str {
        &self.key
    }

    /// A heartbeat of VM `vm` at `now` (`lag_hint`: the lag probe's view of the loop's lag,
    /// `memory_bytes`: the VM's linear memory): measures how late it came, moves the VM's
    /// state, and writes its entry. Entries of VMs that were replaced, or retired longer than
    /// `worker_silence` ago, are dropped on the way.
    pub fn heartbeat(
        &self,
        store: &dyn SharedStore,
        vm: u64,
        state: &mut WorkerState,
        now: MonoMillis,
        lag_hint: u64,
        memory_bytes: Option<u64>,
    ) -> Result<(), StoreError> {
        let gap = state.last.map(|last| now.saturating_since(last));
        let lag = gap.map_or(0, |gap| gap.saturating_sub(HEARTBEAT_MS)).max(lag_hint);
        state.last = Some(now);
        let first = *state.first.get_or_insert(now);
        state.lag_ms = lag;
        if gap.is_some_and(|gap| gap > self.silence_ms) {
            state.recovering = self.recover_after;
        } else {
            state.recovering = state.recovering.saturating_sub(1);
        }
        if lag >= self.max_lag_ms {
            state.good_in_a_row = 0;
            state.lagging_since.get_or_insert(MonoMillis(now.0.saturating_sub(lag)));
        } else if state.lagging_since.is_some() {
            state.good_in_a_row = state.good_in_a_row.saturating_add(1);
            if state.good_in_a_row >= self.recover_after {
                state.lagging_since = None;
                state.good_in_a_row = 0;
            }
        }
        let beat = Beat {
            vm,
            first,
            last: now,
            lagging_since: state.lagging_since,
            memory_bytes,
            lag_ms: u32::try_from(lag).unwrap_or(u32::MAX),
            recovering: u8::try_from(state.recovering).unwrap_or(u8::MAX),
            retired: false,
            serves: state.serves,
        };
        let (first, serves) = self.write(store, beat, now)?;
        state.first = Some(first);
        state.serves = serves;
        Ok(())
    }

    /// VM `vm` serves an HTTP stream at `now`: it is a worker. The first stream of a
    /// configuration writes so in its entry (creating it if the VM has not beaten yet, which
    /// counts as its first heartbeat); later ones cost nothing.
    pub fn serving(&self, store: &dyn SharedStore, vm: u64, state: &mut WorkerState, now: MonoMillis) -> Result<(), StoreError> {
        if state.serves {
            return Ok(());
        }
        let first = *state.first.get_or_insert(now);
        let last = *state.last.get_or_insert(now);
        let beat = Beat {
            vm,
            first,
            last,
            lagging_since: state.lagging_since,
            memory_bytes: linear_memory_bytes(),
            lag_ms: u32::try_from(state.lag_ms).unwrap_or(u32::MAX),
            recovering: u8::try_from(state.recovering).unwrap_or(u8::MAX),
            retired: false,
            serves: true,
        };
        let (first, _) = self.write(store, beat, now)?;
        state.first = Some(first);
        state.serves = true;
        Ok(())
    }

    /// Writes `beat` as its VM's entry at `now`: when it started and whether it serves
    /// streams stay what an earlier configuration of the VM wrote (a configuration change is
    /// not a new worker); entries of VMs that were replaced, or retired longer than
    /// `worker_silence` ago, are dropped on the way. Returns when the entry says it started and
    /// whether it serves streams.
    fn write(&self, store: &dyn SharedStore, mut beat: Beat, now: MonoMillis) -> Result<(MonoMillis, bool), StoreError> {
        let (vm, silence_ms) = (beat.vm, self.silence_ms);
        update(store, &self.key, |current| {
            let mut record = current.and_then(|s| Record::decode(&s.value).ok()).unwrap_or_default();
            if let Some(own) = record.beats.iter().find(|b| b.vm == vm) {
                beat.first = beat.first.min(own.first);
                // A stored `last` past `now` is no reading of this host's clock: it moves nothing.
                beat.last = beat.last.max(own.last.min(now));
                beat.serves |= own.serves;
            }
            record.beats.retain(|b| b.vm != vm);
            record.beats.push(beat);
            let snapshot = record.clone();
            record.beats.retain(|b| {
                let silent = now.saturating_since(b.last) > silence_ms;
                b.vm == vm || !(silent && (b.retired || snapshot.replaced(b)))
            });
            while record.beats.len() > MAX_VMS {
                // Full of live workers: the longest silent makes room.
                let oldest = record.beats.iter().enumerate().filter(|(_, b)| b.vm != vm).min_by_key(|(_, b)| b.last).map(|(i, _)| i);
                match oldest {
                    Some(index) => drop(record.beats.remove(index)),
                    None => break,
                }
            }
            Attempt::Write(record.encode(), (beat.first, beat.serves))
        })
    }

    /// VM `vm`'s configuration is retired cleanly at `now`: its entry stops counting (until a
    /// later configuration of the VM beats again).
    pub fn retire(&self, store: &dyn SharedStore, vm: u64, now: MonoMillis) -> Result<(), StoreError> {
        update(store, &self.key, |current| {
            let mut record = current.and_then(|s| Record::decode(&s.value).ok()).unwrap_or_default();
            let Some(own) = record.beats.iter_mut().find(|b| b.vm == vm) else {
                return Attempt::Done(());
            };
            own.retired = true;
            own.last = own.last.max(now);
            Attempt::Write(record.encode(), ())
        })
    }

    /// The verdict at `now`, from the record.
    pub fn verdict(&self, store: &dyn SharedStore, now: MonoMillis) -> Liveness {
        self.judge(&Record::read(store, &self.key), now)
    }

    /// The verdict on `record` at `now` (module doc).
    pub fn judge(&self, record: &Record, now: MonoMillis) -> Liveness {
        let age = |b: &Beat| now.saturating_since(b.last);
        let silent = |b: &Beat| age(b) > self.silence_ms;
        let counted = |b: &&Beat| !b.retired && b.serves;
        // Silence means something only while another VM beats (a worker or the main thread).
        let someone_beats = record.beats.iter().any(|b| !b.retired && !silent(b));
        let workers = record
            .beats
            .iter()
            .filter(counted)
            .filter(|b| !(silent(b) && record.replaced(b)))
            .filter(|b| someone_beats || !silent(b))
            .map(|b| {
                let problem = if silent(b) {
                    Some(Problem::Silent { for_ms: age(b) })
                } else if b.recovering > 0 {
                    Some(Problem::Recovering { heartbeats_left: b.recovering })
                } else if let Some(since) = b.lagging_since.filter(|since| now.saturating_since(*since) >= self.lag_for_ms) {
                    Some(Problem::Lagging { for_ms: now.saturating_since(since) })
                } else {
                    match (b.memory_bytes, self.max_memory_bytes) {
                        (Some(bytes), Some(max)) if bytes > max => Some(Problem::Memory { bytes }),
                        _ => None,
                    }
                };
                WorkerView { vm: b.vm, heartbeat_age_ms: age(b), lag_ms: b.lag_ms, memory_bytes: b.memory_bytes, problem }
            })
            .collect();
        Liveness { workers }
    }
}

/// This VM's Wasm linear memory, in bytes (none natively).
pub fn linear_memory_bytes() -> Option<u64> {
    #[cfg(target_arch = "wasm32")]
    {
        const PAGE: u64 = 64 * 1024;
        Some((core::arch::wasm32::memory_size(0) as u64).saturating_mul(PAGE))
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        None
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::primitives::store::MemoryStore;

    fn watchdog(json: &str) -> Watchdog {
        let config = Config::parse(format!(r#"{{"watchdog":{json}}}"#).as_bytes()).unwrap();
        Watchdog::new(config.watchdog.as_ref().unwrap(), "test")
    }

    fn default_watchdog() -> Watchdog {
        // worker_silence 5 s, max_loop_lag 2 s, lag_for 30 s, recover_after 3.
        watchdog(r#"{"path":"/alive"}"#)
    }

    const T0: u64 = 1_000_000;

    /// The VMs of one proxy (workers, the main thread's), beating on a fake clock.
    struct Proxy {
        dog: Watchdog,
        store: MemoryStore,
        states: Vec<(u64, WorkerState)>,
        now: MonoMillis,
    }

    impl Proxy {
        /// VMs `vms`, none serving a stream yet.
        fn new(dog: Watchdog, vms: &[u64]) -> Proxy {
            let now = MonoMillis(T0);
            Proxy { dog, store: MemoryStore::new(), states: vms.iter().map(|vm| (*vm, WorkerState::started(now))).collect(), now }
        }

        /// Workers `vms`, each serving its first stream at the start.
        fn workers(dog: Watchdog, vms: &[u64]) -> Proxy {
            let mut proxy = Proxy::new(dog, vms);
            for vm in vms {
                proxy.serve(*vm);
            }
            proxy
        }

        fn beat(&mut self, vm: u64, lag_hint: u64) {
            let (_, state) = self.states.iter_mut().find(|(v, _)| *v == vm).unwrap();
            self.dog.heartbeat(&self.store, vm, state, self.now, lag_hint, None).unwrap();
        }

        /// VM `vm` starts (is configured) now.
        fn start(&mut self, vm: u64) {
            let now = self.now;
            self.states.iter_mut().find(|(v, _)| *v == vm).unwrap().1 = WorkerState::started(now);
        }

        /// VM `vm` serves a stream now.
        fn serve(&mut self, vm: u64) {
            let (_, state) = self.states.iter_mut().find(|(v, _)| *v == vm).unwrap();
            self.dog.serving(&self.store, vm, state, self.now).unwrap();
        }

        fn vms(&self) -> Vec<u64> {
            self.verdict().workers.iter().map(|w| w.vm).collect()
        }

        /// `seconds` seconds of heartbeats on time from every worker in `beating`.
        fn run(&mut self, seconds: u64, beating: &[u64]) {
            for _ in 0..seconds {
                self.now = self.now.plus_ms(HEARTBEAT_MS);
                for vm in beating {
                    self.beat(*vm, 0);
                }
            }
        }

        fn verdict(&self) -> Liveness {
            self.dog.verdict(&self.store, self.now)
        }

        fn problem(&self, vm: u64) -> Option<Problem> {
            self.verdict().workers.iter().find(|w| w.vm == vm).and_then(|w| w.problem)
        }
    }

    #[test]
    fn the_record_reads_back_as_written_and_refuses_anything_else() {
        let record = Record {
            beats: vec![
                Beat { vm: 7, first: MonoMillis(1), last: MonoMillis(9), lagging_since: Some(MonoMillis(5)), memory_bytes: Some(1 << 20), lag_ms: 3, recovering: 2, retired: true, serves: true },
                Beat { vm: 8, first: MonoMillis(2), last: MonoMillis(3), ..Beat::default() },
            ],
        };
        let bytes = record.encode();
        assert_eq!(bytes.len(), 8 + 2 * ENTRY_LEN);
        assert_eq!(Record::decode(&bytes), Ok(record));
        assert_eq!(Record::decode(&bytes[..bytes.len() - 1]), Err(DecodeError::Malformed));
        let mut other = bytes.clone();
        other[0] = 9;
        assert_eq!(Record::decode(&other), Err(DecodeError::Malformed), "another version");
        assert_eq!(Record::decode(b""), Err(DecodeError::Malformed));
    }

    #[test]
    fn a_silent_worker_fails_liveness_after_worker_silence_while_another_beats() {
        let mut proxy = Proxy::workers(default_watchdog(), &[1, 2]);
        proxy.run(10, &[1, 2]);
        let verdict = proxy.verdict();
        assert!(verdict.alive(), "{verdict:?}");
        assert_eq!(verdict.workers.len(), 2, "both workers count");
        // Worker 1 stops: 5 s of silence are tolerated, not more.
        proxy.run(5, &[2]);
        assert!(proxy.verdict().alive(), "silent for exactly worker_silence: {:?}", proxy.verdict());
        proxy.run(1, &[2]);
        assert_eq!(proxy.problem(1), Some(Problem::Silent { for_ms: 6_000 }));
        assert!(!proxy.verdict().alive());
        assert_eq!(proxy.problem(2), None, "the worker that answers is fine");
        // Stays failing while it stays silent.
        proxy.run(60, &[2]);
        assert_eq!(proxy.problem(1), Some(Problem::Silent { for_ms: 66_000 }));
    }

    #[test]
    fn a_worker_back_from_silence_needs_recover_after_good_heartbeats_in_a_row() {
        let mut proxy = Proxy::workers(default_watchdog(), &[1, 2]);
        proxy.run(10, &[1, 2]);
        proxy.run(8, &[2]);
        assert!(!proxy.verdict().alive());
        // It comes back: the heartbeat that ends the silence and 2 more still fail; the third
        // good one in a row recovers.
        let mut seen = Vec::new();
        for _ in 0..4 {
            proxy.run(1, &[1, 2]);
            seen.push(proxy.verdict().alive());
        }
        assert_eq!(seen, [false, false, false, true], "{:?}", proxy.verdict());
        // Stalls of 6 s every 2 s: never green in between (no flapping).
        let mut greens = 0;
        for _ in 0..5 {
            proxy.run(6, &[2]);
            greens += u32::from(proxy.verdict().alive());
            for _ in 0..2 {
                proxy.run(1, &[1, 2]);
                greens += u32::from(proxy.verdict().alive());
            }
        }
        assert_eq!(greens, 0, "a worker that keeps stalling keeps liveness failing");
    }

    #[test]
    fn lag_fails_liveness_only_after_lag_for_and_recovers_after_good_heartbeats() {
        let mut proxy = Proxy::workers(watchdog(r#"{"path":"/alive","max_loop_lag":"2s","lag_for":"10s"}"#), &[1, 2]);
        proxy.run(5, &[1, 2]);
        // Worker 1's loop runs its timer 2.5 s late, every time (worker 2's is fine).
        let lagging = |proxy: &mut Proxy, beats: u32| {
            for _ in 0..beats {
                proxy.now = proxy.now.plus_ms(HEARTBEAT_MS + 2_500);
                proxy.beat(1, 0);
                proxy.beat(2, 0);
            }
        };
        // Each heartbeat 3.5 s after the previous, the first one 2.5 s late.
        lagging(&mut proxy, 3);
        assert!(proxy.verdict().alive(), "lagging for 9.5 s < lag_for: {:?}", proxy.verdict());
        lagging(&mut proxy, 1);
        assert_eq!(proxy.problem(1), Some(Problem::Lagging { for_ms: 13_000 }));
        // One heartbeat on time: not recovered (3 needed), nor after 2.
        proxy.run(2, &[1, 2]);
        assert!(!proxy.verdict().alive());
        proxy.run(1, &[1, 2]);
        assert!(proxy.verdict().alive(), "{:?}", proxy.verdict());
        // A loop lagging every other heartbeat lags still: it fails once that lasts lag_for,
        // and does not toggle.
        let mut seen = Vec::new();
        for _ in 0..6 {
            lagging(&mut proxy, 1);
            seen.push(proxy.verdict().alive());
            proxy.run(1, &[1, 2]);
            seen.push(proxy.verdict().alive());
        }
        let first_red = seen.iter().position(|alive| !alive).unwrap();
        assert!(seen[first_red..].iter().all(|alive| !alive), "no flapping once failing: {seen:?}");
    }

    #[test]
    fn overload_under_the_lag_threshold_or_shorter_than_lag_for_never_fails_liveness() {
        let mut proxy = Proxy::workers(default_watchdog(), &[1, 2]);
        proxy.run(5, &[1, 2]);
        // A minute of overload: the lag probe says 1.5 s (under max_loop_lag 2 s), heartbeats
        // come up to 900 ms late.
        for i in 0..60 {
            proxy.now = proxy.now.plus_ms(HEARTBEAT_MS + (i % 10) * 100);
            proxy.beat(1, 1_500);
            proxy.beat(2, 1_500);
            assert!(proxy.verdict().alive(), "{:?}", proxy.verdict());
        }
        // Bursts of 20 s past the threshold, 30 s apart: each shorter than lag_for 30 s.
        for _ in 0..3 {
            for _ in 0..10 {
                proxy.now = proxy.now.plus_ms(2_000);
                proxy.beat(1, 2_500);
                proxy.beat(2, 0);
                assert!(proxy.verdict().alive(), "{:?}", proxy.verdict());
            }
            proxy.run(30, &[1, 2]);
        }
        // A single 4.5 s stall (a long garbage collection): a lag spike, not a silence.
        proxy.now = proxy.now.plus_ms(4_500);
        proxy.beat(1, 0);
        proxy.beat(2, 0);
        assert!(proxy.verdict().alive(), "{:?}", proxy.verdict());
    }

    #[test]
    fn retired_replaced_and_short_lived_vms_are_not_silent_workers() {
        let mut proxy = Proxy::new(default_watchdog(), &[1, 2, 3, 4]);
        proxy.serve(1);
        proxy.serve(2);
        proxy.run(10, &[1, 2]);
        // Worker 1's configuration is retired cleanly, and it beats no more.
        proxy.dog.retire(&proxy.store, 1, proxy.now).unwrap();
        proxy.run(20, &[2]);
        let verdict = proxy.verdict();
        assert!(verdict.alive(), "{verdict:?}");
        assert_eq!(verdict.workers.iter().map(|w| w.vm).collect::<Vec<_>>(), vec![2]);
        assert_eq!(Record::read(&proxy.store, proxy.dog.record_key()).beats.len(), 1, "dropped once silent");
        // Worker 2's VM crashes; Envoy makes VM 3 for it (FAIL_RELOAD): 2 was replaced.
        proxy.run(1, &[]);
        proxy.start(3);
        proxy.run(1, &[3]);
        proxy.serve(3);
        proxy.run(10, &[3]);
        assert!(proxy.verdict().alive(), "{:?}", proxy.verdict());
        assert_eq!(proxy.vms(), vec![3]);
        // A VM that beats and vanishes without serving a stream (a VM that validated a
        // configuration) is no worker.
        proxy.start(4);
        proxy.run(1, &[3, 4]);
        proxy.run(10, &[3]);
        assert!(proxy.verdict().alive(), "{:?}", proxy.verdict());
        // Every worker silent (no tick anywhere): nothing to compare with, nothing fails.
        let mut proxy = Proxy::workers(default_watchdog(), &[1, 2]);
        proxy.run(10, &[1, 2]);
        proxy.now = proxy.now.plus_ms(60_000);
        assert!(proxy.verdict().alive(), "{:?}", proxy.verdict());
    }

    #[test]
    fn a_configuration_change_keeps_the_vm_s_first_heartbeat() {
        let mut proxy = Proxy::workers(default_watchdog(), &[1, 2]);
        proxy.run(10, &[1, 2]);
        proxy.run(7, &[2]);
        assert!(!proxy.verdict().alive());
        // Worker 2's configuration changes: retired, and a new configuration (new state) beats
        // in the same VM. It is no new VM: worker 1 still counts as silent.
        proxy.dog.retire(&proxy.store, 2, proxy.now).unwrap();
        proxy.states[1].1 = WorkerState::default();
        proxy.run(2, &[2]);
        assert!(matches!(proxy.problem(1), Some(Problem::Silent { .. })), "{:?}", proxy.verdict());
        let beats = Record::read(&proxy.store, proxy.dog.record_key()).beats;
        assert_eq!(beats.iter().find(|b| b.vm == 2).map(|b| (b.first, b.retired, b.serves)), Some((MonoMillis(T0), false, true)));
        assert_eq!(proxy.vms(), vec![1, 2], "still a worker before the new configuration serves a stream");
    }

    /// The main thread's VM (100) beats like the workers but serves no stream.
    const MAIN: u64 = 100;

    #[test]
    fn the_main_thread_is_no_worker_but_tells_a_silent_worker_apart() {
        let mut proxy = Proxy::new(default_watchdog(), &[MAIN, 1, 2]);
        proxy.run(10, &[MAIN, 1, 2]);
        assert_eq!(proxy.vms(), Vec::<u64>::new(), "no VM served a stream yet");
        proxy.serve(1);
        proxy.serve(2);
        proxy.serve(2);
        assert_eq!(proxy.vms(), vec![1, 2], "two workers, the main thread not among them");
        proxy.run(10, &[MAIN, 1, 2]);
        assert_eq!(proxy.vms(), vec![1, 2]);
        // The main thread stalls (a configuration update, a slow xDS answer): no worker fails.
        proxy.run(20, &[1, 2]);
        assert!(proxy.verdict().alive(), "{:?}", proxy.verdict());
        assert_eq!(proxy.vms(), vec![1, 2]);
        // One worker alone: when it is silent, the main thread's heartbeats tell so.
        let mut proxy = Proxy::new(default_watchdog(), &[MAIN, 1]);
        proxy.run(3, &[MAIN, 1]);
        proxy.serve(1);
        proxy.run(6, &[MAIN]);
        assert_eq!(proxy.problem(1), Some(Problem::Silent { for_ms: 6_000 }));
    }

    #[test]
    fn a_worker_blocked_by_its_first_stream_before_any_heartbeat_is_silent_then_recovers() {
        let mut proxy = Proxy::new(default_watchdog(), &[MAIN, 1, 2]);
        // 300 ms after the VMs started, before worker 1's first heartbeat, its first request
        // blocks it for 12 s.
        proxy.now = proxy.now.plus_ms(300);
        proxy.serve(1);
        let mut seen = Vec::new();
        for _ in 0..12 {
            proxy.run(1, &[MAIN, 2]);
            seen.push(proxy.verdict().alive());
        }
        assert_eq!(seen, [true, true, true, true, true, false, false, false, false, false, false, false], "red after worker_silence (5 s)");
        assert_eq!(proxy.problem(1), Some(Problem::Silent { for_ms: 12_000 }), "{:?}", proxy.verdict());
        // It runs again: back from a silence, recover_after (3) heartbeats on time, then green
        // for good.
        let mut seen = Vec::new();
        for _ in 0..10 {
            proxy.run(1, &[MAIN, 1, 2]);
            seen.push(proxy.verdict().alive());
        }
        assert_eq!(seen, [false, false, false, true, true, true, true, true, true, true], "{:?}", proxy.verdict());
    }

    #[test]
    fn a_worker_that_beat_once_then_blocked_is_silent_while_blocked_and_not_after() {
        let mut proxy = Proxy::new(default_watchdog(), &[MAIN, 1, 2]);
        proxy.serve(2);
        proxy.run(1, &[MAIN, 1, 2]);
        // Worker 1 beat once, serves a stream, and blocks for 8 s.
        proxy.serve(1);
        let mut seen = Vec::new();
        for _ in 0..8 {
            proxy.run(1, &[MAIN, 2]);
            seen.push(proxy.verdict().alive());
        }
        assert_eq!(seen, [true, true, true, true, true, false, false, false]);
        let mut seen = Vec::new();
        for _ in 0..10 {
            proxy.run(1, &[MAIN, 1, 2]);
            seen.push(proxy.verdict().alive());
        }
        assert_eq!(seen, [false, false, false, true, true, true, true, true, true, true], "{:?}", proxy.verdict());
        // A worker that never blocked is green from its first stream on.
        let mut proxy = Proxy::new(default_watchdog(), &[MAIN, 1]);
        proxy.run(1, &[MAIN, 1]);
        proxy.serve(1);
        for _ in 0..5 {
            proxy.run(1, &[MAIN, 1]);
            assert!(proxy.verdict().alive(), "{:?}", proxy.verdict());
        }
    }

    #[test]
    fn memory_past_the_bound_fails_liveness() {
        let dog = watchdog(r#"{"path":"/alive","max_memory_mb":64}"#);
        assert_eq!(dog.max_memory_bytes, Some(64 << 20));
        let store = MemoryStore::new();
        let mut state = WorkerState::default();
        let mut now = MonoMillis(T0);
        dog.serving(&store, 1, &mut state, now).unwrap();
        for memory in [32 << 20, 64 << 20, 65 << 20] {
            for _ in 0..3 {
                now = now.plus_ms(HEARTBEAT_MS);
                dog.heartbeat(&store, 1, &mut state, now, 0, Some(memory)).unwrap();
            }
        }
        let verdict = dog.verdict(&store, now);
        assert_eq!(verdict.workers[0].problem, Some(Problem::Memory { bytes: 65 << 20 }));
        assert!(default_watchdog().judge(&Record::read(&store, dog.record_key()), now).alive(), "no bound, no check");
        assert_eq!(linear_memory_bytes(), None, "natively");
    }
}
