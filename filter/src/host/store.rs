//! Envoy's shared data as a [`SharedStore`].

use crate::primitives::store::{Cas, SharedStore, StoreError, Stored};
use proxy_wasm::hostcalls;
use proxy_wasm::types::Status;
use std::num::NonZeroU32;

/// The process-wide shared data of this filter's `vm_id`.
pub struct EnvoyStore;

fn status_code(status: Status) -> StoreError {
    match status {
        Status::CasMismatch => StoreError::CasMismatch,
        other => StoreError::Host(other as u32),
    }
}

impl SharedStore for EnvoyStore {
    fn get(&self, key: &str) -> Result<Option<Stored>, StoreError> {
        match hostcalls::get_shared_data(key).map_err(status_code)? {
            (None, None) => Ok(None),
            // A key whose value was emptied still exists (Envoy keeps the key and its token).
            (value, cas) => Ok(Some(Stored {
                value: value.unwrap_or_default(),
                cas: cas.and_then(NonZeroU32::new).map(Cas),
            })),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<Cas>) -> Result<(), StoreError> {
        hostcalls::set_shared_data(key, Some(value), cas.map(|Cas(c)| c.get())).map_err(status_code)
    }
}
