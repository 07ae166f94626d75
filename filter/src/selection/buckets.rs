//! A cluster's request statistics: a rolling window of stat buckets plus the sticky bucket.
//!
//! Buckets are aligned to multiples of the bucket width on the clock they are read with; `epoch` is
//! the index of the newest one (`now / width`). Moving to a later epoch ages the oldest buckets
//! out, one per elapsed width, and each that held data is copied over the sticky bucket, so after
//! any gap the sticky bucket holds the newest data that ever left the window.
//!
//! Success rate, with `f_i`, `s_i` the finished and successful counts of bucket `i` (0 = newest),
//! `d` the decay factor and `n` the number of clusters:
//!
//! ```text
//! rate = Σ s_i·d^(−i) / Σ f_i·d^(−i)                if any f_i > 0
//!      = max(s_sticky / f_sticky, floor / n)        else if f_sticky > 0
//!      = 1                                          otherwise
//! ```
//!
//! Rationale: docs/design.md, section "Cluster selection".

/// Which data a success rate is computed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Basis {
    /// Requests finished within the window.
    Window,
    /// None in the window, but the sticky bucket has some.
    Sticky,
    /// No data at all.
    NoData,
}

/// Finished and successful requests of one bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Requests that finished (success or failure).
    pub finished: u32,
    /// Of those, the successful ones.
    pub succeeded: u32,
}

impl Tally {
    fn has_data(self) -> bool {
        self.finished > 0
    }
}

/// The rolling window and the sticky bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buckets {
    /// Index of the newest bucket (`now / width`).
    pub epoch: u64,
    /// Newest first; as many as configured.
    pub recent: Vec<Tally>,
    /// The newest data that aged out of the window.
    pub sticky: Tally,
}

impl Buckets {
    /// An empty window of `count` buckets whose newest bucket is `epoch`.
    pub fn new(count: usize, epoch: u64) -> Buckets {
        Buckets {
            epoch,
            recent: vec![Tally::default(); count],
            sticky: Tally::default(),
        }
    }

    /// Ages the window forward so that its newest bucket is `epoch`. An earlier `epoch` (a clock
    /// step backwards) changes nothing: data then goes to the newest bucket.
    pub fn advance_to(&mut self, epoch: u64) {
        let steps = epoch.saturating_sub(self.epoch);
        if steps == 0 {
            return;
        }
        let count = self.recent.len();
        let shifts = usize::try_from(steps).map_or(count, |s| s.min(count));
        for _ in 0..shifts {
            if let Some(oldest) = self.recent.pop() {
                if oldest.has_data() {
                    self.sticky = oldest;
                }
                self.recent.insert(0, Tally::default());
            }
        }
        self.epoch = epoch;
    }

    /// Where the success rate comes from.
    pub fn basis(&self) -> Basis {
        if self.recent.iter().any(|t| t.has_data()) {
            Basis::Window
        } else if self.sticky.has_data() {
            Basis::Sticky
        } else {
            Basis::NoData
        }
    }

    /// Counts one finished request in the newest bucket.
    pub fn record(&mut self, succeeded: bool) {
        let tally = Tally {
            finished: 1,
            succeeded: u32::from(succeeded),
        };
        self.add(self.epoch, tally);
    }

    /// Adds requests that finished during bucket `epoch`: to that bucket while it is in the
    /// window, to the newest for a later epoch (a clock step), nowhere once it aged out.
    pub fn add(&mut self, epoch: u64, tally: Tally) {
        let age = usize::try_from(self.epoch.saturating_sub(epoch)).unwrap_or(usize::MAX);
        if let Some(bucket) = self.recent.get_mut(age) {
            bucket.finished = bucket.finished.saturating_add(tally.finished);
            bucket.succeeded = bucket
                .succeeded
                .saturating_add(tally.succeeded)
                .min(bucket.finished);
        }
    }

    /// The success rate (module doc): `decay_factor` ≥ 1, `floor` already divided by the number
    /// of clusters.
    pub fn success_rate(&self, decay_factor: f64, floor: f64) -> f64 {
        let (mut finished, mut succeeded, mut weight) = (0.0f64, 0.0f64, 1.0f64);
        for tally in &self.recent {
            finished += weight * f64::from(tally.finished);
            succeeded += weight * f64::from(tally.succeeded);
            weight /= decay_factor;
        }
        match self.basis() {
            // Positive: some bucket has data and the weights underflow nowhere (decay ≤ 1000,
            // at most 60 buckets).
            Basis::Window if finished > 0.0 => (succeeded / finished).clamp(0.0, 1.0),
            Basis::Window | Basis::NoData => 1.0,
            Basis::Sticky => {
                let sticky = f64::from(self.sticky.succeeded) / f64::from(self.sticky.finished);
                sticky.clamp(0.0, 1.0).max(floor)
            }
        }
    }
}
