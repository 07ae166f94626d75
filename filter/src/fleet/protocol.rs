//! The JSON writers of both consistencies' calls to `floodgate-sync` ([`crate::fleet::batched`]'s
//! batches, [`crate::fleet::leased`]'s leases): numbers and hex ids appended byte by byte
//! (`core::fmt` took about 1 500 instructions per counter of a batch), numbers as serde_json
//! writes them.

/// Units of an ask's key that the proxy's batch on its way carries
/// ([`crate::fleet::batched::in_flight`]): the `carried` object of a lease entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Carried {
    /// The batch's source.
    pub source: u64,
    /// The batch's seq.
    pub seq: u64,
    /// The key's units in it that the ask's limit leaves out.
    pub units: u32,
    /// The longest window of the batch's counters.
    pub longest_window_ms: u64,
}

impl Carried {
    /// Appends `,"carried":{…}`.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b",\"carried\":{\"proxy\":\"");
        push_hex(out, u128::from(self.source), 16);
        out.extend_from_slice(b"\",\"seq\":");
        push_decimal(out, self.seq);
        out.extend_from_slice(b",\"units\":");
        push_decimal(out, u64::from(self.units));
        out.extend_from_slice(b",\"longest_window_ms\":");
        push_decimal(out, self.longest_window_ms);
        out.push(b'}');
    }
}

/// Appends the `digits` (≤ 32) low hex digits of `value`, lowercase, zero-padded.
pub fn push_hex(out: &mut Vec<u8>, value: u128, digits: usize) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut text = [b'0'; 32];
    for (pair, byte) in text.chunks_exact_mut(2).zip(value.to_be_bytes()) {
        let high = HEX.get(usize::from(byte >> 4)).copied().unwrap_or(b'0');
        let low = HEX.get(usize::from(byte & 0xf)).copied().unwrap_or(b'0');
        pair.copy_from_slice(&[high, low]);
    }
    out.extend_from_slice(text.get(text.len().saturating_sub(digits)..).unwrap_or_default());
}

/// Appends `value` in decimal.
pub fn push_decimal(out: &mut Vec<u8>, mut value: u64) {
    let mut text = [0u8; 20];
    let mut start = text.len();
    for slot in text.iter_mut().rev() {
        *slot = b'0'.saturating_add(u8::try_from(value % 10).unwrap_or(0));
        value /= 10;
        start = start.saturating_sub(1);
        if value == 0 {
            break;
        }
    }
    out.extend_from_slice(text.get(start..).unwrap_or_default());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_whole_at_their_extremes() {
        let mut out = Vec::new();
        for (value, text) in [(0, "0"), (7, "7"), (10, "10"), (u64::MAX, "18446744073709551615")] {
            out.clear();
            push_decimal(&mut out, value);
            assert_eq!(out, text.as_bytes());
        }
        out.clear();
        push_hex(&mut out, u128::MAX, 32);
        push_hex(&mut out, 0, 32);
        push_hex(&mut out, 0xabc, 16);
        assert_eq!(out, format!("{}{}{:016x}", "f".repeat(32), "0".repeat(32), 0xabc).as_bytes());
    }
}
