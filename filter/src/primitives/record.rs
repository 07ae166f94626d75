//! The byte codec of every record the filter keeps in shared data: fields little-endian, in
//! layout order, read by a [`Reader`] that fails with [`DecodeError`] where the bytes end early
//! and written by a [`Writer`] (a `Vec`, or a [`Fill`] over a buffer of fixed length); a
//! fixed-size entry is read with [`field`] and built with [`entry`] in one piece. Each
//! record's layout, version and checks are its own module's; this one only moves the bytes, so
//! a field is read exactly as it was written.

/// Why a stored record could not be read: it is not trusted, and the next write replaces it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Truncated, padded, another version, or a field out of range.
    Malformed,
    /// Wrong length for its version (a record whose layout fixes its length).
    Length(usize),
    /// A version and layout (its first two bytes) this build does not know.
    Version(u8, u8),
    /// Two entries own the same key (no writer makes such a record: it is corrupt).
    Duplicate(u64),
}

/// Reads a record's fields in order.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { rest: bytes }
    }

    /// The next `N` bytes.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let (field, rest) = self.rest.split_first_chunk::<N>().ok_or(DecodeError::Malformed)?;
        self.rest = rest;
        Ok(*field)
    }

    /// The next `len` bytes, borrowed.
    pub fn bytes(&mut self, len: usize) -> Result<&'a [u8], DecodeError> {
        let (field, rest) = self.rest.split_at_checked(len).ok_or(DecodeError::Malformed)?;
        self.rest = rest;
        Ok(field)
    }

    /// The next `u32`.
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        self.array().map(u32::from_le_bytes)
    }

    /// The next `u64`.
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        self.array().map(u64::from_le_bytes)
    }

    /// The next `u128`.
    pub fn u128(&mut self) -> Result<u128, DecodeError> {
        self.array().map(u128::from_le_bytes)
    }

    /// The header of a list record (its version, 3 zero bytes and the `u32` count of its
    /// entries), checked against what follows: exactly that many entries of `entry_len` bytes.
    /// Returns the version and the count.
    pub fn list_header(&mut self, entry_len: usize) -> Result<(u8, usize), DecodeError> {
        let [version, _, _, _] = self.array()?;
        let count = usize::try_from(self.u32()?).map_err(|_| DecodeError::Malformed)?;
        if self.remaining() != count.saturating_mul(entry_len) {
            return Err(DecodeError::Malformed);
        }
        Ok((version, count))
    }

    /// How many bytes are left.
    pub fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// The bytes left, for a record nested at the end of another.
    pub fn rest(self) -> &'a [u8] {
        self.rest
    }

    /// Ends the record: anything left is padding, which no writer leaves.
    pub fn end(self) -> Result<(), DecodeError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Malformed)
        }
    }
}

/// The `N` bytes of a fixed-size entry from `at` (a field of its layout; zeros past its end,
/// which a layout within the entry never reaches).
pub fn field<const L: usize, const N: usize>(entry: &[u8; L], at: usize) -> [u8; N] {
    entry.get(at..).and_then(|rest| rest.first_chunk::<N>()).copied().unwrap_or([0; N])
}

/// A fixed-size entry of `M` fields of `N` bytes, in order (the first `L` bytes of them).
pub fn entry<const N: usize, const M: usize, const L: usize>(fields: [[u8; N]; M]) -> [u8; L] {
    let mut out = [0u8; L];
    for (chunk, field) in out.chunks_exact_mut(N).zip(fields) {
        chunk.copy_from_slice(&field);
    }
    out
}

/// Writes a record's fields in order.
pub trait Writer {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]);

    /// Appends a `u32`.
    fn put_u32(&mut self, value: u32) {
        self.put(&value.to_le_bytes());
    }

    /// Appends a `u64`.
    fn put_u64(&mut self, value: u64) {
        self.put(&value.to_le_bytes());
    }

    /// Appends a `u128`.
    fn put_u128(&mut self, value: u128) {
        self.put(&value.to_le_bytes());
    }

    /// Appends the header of a list record of `count` entries ([`Reader::list_header`]).
    fn put_list_header(&mut self, version: u8, count: usize) {
        self.put(&[version, 0, 0, 0]);
        self.put_u32(u32::try_from(count).unwrap_or(u32::MAX));
    }
}

impl Writer for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// A buffer of the record's fixed length, filled from its start (no allocation). Its layout
/// sizes it: bytes past its end are not written.
#[derive(Debug)]
pub struct Fill<'a> {
    buffer: &'a mut [u8],
    at: usize,
}

impl<'a> Fill<'a> {
    /// Fills `buffer` from its start.
    pub fn new(buffer: &'a mut [u8]) -> Fill<'a> {
        Fill { buffer, at: 0 }
    }
}

impl Writer for Fill<'_> {
    fn put(&mut self, bytes: &[u8]) {
        let end = self.at.saturating_add(bytes.len());
        if let Some(field) = self.buffer.get_mut(self.at..end) {
            field.copy_from_slice(bytes);
        }
        self.at = end;
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_size_entry_is_its_fields_in_order() {
        let built: [u8; 12] = entry([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]);
        assert_eq!(built, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(field::<12, 4>(&built, 4), [5, 6, 7, 8]);
        assert_eq!(u64::from_le_bytes(field(&built, 4)), u64::from_le_bytes([5, 6, 7, 8, 9, 10, 11, 12]));
        assert_eq!(field::<12, 4>(&built, 10), [0; 4], "past the end: zeros");
    }

    #[test]
    fn fields_read_back_as_written_and_truncation_is_malformed() {
        let mut out = Vec::new();
        out.put(&[7, 0]);
        out.put_u32(0x0102_0304);
        out.put_u64(u64::MAX - 1);
        out.put_u128(1 << 100);
        out.put(b"tail");
        assert_eq!(&out[2..6], &[4, 3, 2, 1], "little-endian");
        let mut fixed = [0u8; 34];
        let mut fill = Fill::new(&mut fixed);
        for chunk in out.chunks(5) {
            fill.put(chunk);
        }
        assert_eq!(&fixed[..], &out[..]);

        let mut reader = Reader::new(&out);
        assert_eq!(reader.array(), Ok([7, 0]));
        assert_eq!(reader.u32(), Ok(0x0102_0304));
        assert_eq!(reader.u64(), Ok(u64::MAX - 1));
        assert_eq!(reader.u128(), Ok(1 << 100));
        assert_eq!(reader.remaining(), 4);
        assert_eq!(reader.clone().end(), Err(DecodeError::Malformed), "padded");
        assert_eq!(reader.bytes(4), Ok(&b"tail"[..]));
        assert_eq!(reader.u32(), Err(DecodeError::Malformed), "truncated");
        assert_eq!(reader.end(), Ok(()));
        assert_eq!(Reader::new(&[1, 2, 3]).u32(), Err(DecodeError::Malformed));
        assert_eq!(Reader::new(&[1, 2, 3]).bytes(4), Err(DecodeError::Malformed));
    }

    #[test]
    fn a_list_header_counts_exactly_the_entries_that_follow() {
        let mut out = Vec::new();
        out.put_list_header(9, 2);
        out.put(&[1; 6]);
        assert_eq!(&out[..8], &[9, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(Reader::new(&out).list_header(3), Ok((9, 2)));
        assert_eq!(Reader::new(&out).list_header(2), Err(DecodeError::Malformed), "padded");
        assert_eq!(Reader::new(&out).list_header(4), Err(DecodeError::Malformed), "truncated");
        assert_eq!(Reader::new(&out[..7]).list_header(3), Err(DecodeError::Malformed));
    }
}
