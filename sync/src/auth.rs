//! The proxies' credential: `authorization: Bearer <token>` on `POST /v1/sync` and
//! `POST /v1/lease`, checked against the configured tokens (`--token`, `--token-file`) before the
//! body is read, so a refused call writes nothing to Redis.
//!
//! The comparison takes the same time whatever the presented token holds: every configured
//! token is compared in full (no early exit at the first differing byte, nor at the first
//! matching token), so the timing of the answers tells nothing of a token's bytes.

use http::header::{HeaderMap, AUTHORIZATION};

/// What a call's credential is worth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No token is configured, or the call carries one of them.
    Allowed,
    /// No `authorization: Bearer ...` header (401).
    Missing,
    /// A bearer token that is none of the configured ones (403).
    Wrong,
}

/// The tokens a call may carry; none: every call is allowed.
#[derive(Clone, Default)]
pub struct Tokens(Vec<Vec<u8>>);

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} configured)", self.0.len())
    }
}

impl Tokens {
    /// These tokens (none: calls are not authenticated).
    pub fn new(tokens: &[String]) -> Tokens {
        Tokens(tokens.iter().map(|t| t.as_bytes().to_vec()).collect())
    }

    /// Whether calls must carry a token.
    pub fn required(&self) -> bool {
        !self.0.is_empty()
    }

    /// The verdict on a request's headers.
    pub fn check(&self, headers: &HeaderMap) -> Verdict {
        if !self.required() {
            return Verdict::Allowed;
        }
        let Some(presented) = headers.get(AUTHORIZATION).and_then(|value| bearer(value.as_bytes())) else {
            return Verdict::Missing;
        };
        let mut matched = false;
        for token in &self.0 {
            matched |= same(token, presented);
        }
        if matched {
            Verdict::Allowed
        } else {
            Verdict::Wrong
        }
    }
}

/// The token of `Bearer <token>` (the scheme in any case, spaces around the token allowed).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let scheme = value.get(..7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let token = value.get(7..)?.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// `expected == presented`, in a time that depends only on `expected`'s length.
fn same(expected: &[u8], presented: &[u8]) -> bool {
    let mut difference = u8::from(expected.len() != presented.len());
    for (at, byte) in expected.iter().enumerate() {
        difference |= byte ^ presented.get(at).copied().unwrap_or(!byte);
    }
    std::hint::black_box(difference) == 0
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use http::HeaderValue;

    fn headers(value: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(value) = value {
            headers.insert(AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn a_call_needs_one_of_the_tokens_when_there_are_any() {
        let (old, new) = ("old-token-0123456789".to_string(), "new-token-0123456789".to_string());
        let tokens = Tokens::new(&[old.clone(), new.clone()]);
        assert!(tokens.required());
        for (header, verdict) in [
            (Some(format!("Bearer {old}")), Verdict::Allowed),
            (Some(format!("bearer  {new} ")), Verdict::Allowed),
            (None, Verdict::Missing),
            (Some(old.clone()), Verdict::Missing),
            (Some(format!("Basic {old}")), Verdict::Missing),
            (Some("Bearer ".into()), Verdict::Missing),
            (Some(format!("Bearer {old}x")), Verdict::Wrong),
            (Some(format!("Bearer {}", &old[..19])), Verdict::Wrong),
            (Some("Bearer other-token-0123456".into()), Verdict::Wrong),
        ] {
            assert_eq!(tokens.check(&headers(header.as_deref())), verdict, "{header:?}");
        }
        let open = Tokens::new(&[]);
        assert!(!open.required());
        assert_eq!(open.check(&headers(None)), Verdict::Allowed);
        assert_eq!(format!("{tokens:?}"), "Tokens(2 configured)", "Debug shows no token");
    }

    #[test]
    fn the_comparison_is_exact() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"ab"));
        assert!(!same(b"ab", b"abc"));
        assert!(!same(b"abc", b""));
        // A presented byte equal to the complement of the expected one past the end is no match.
        assert!(!same(b"a", &[b'a', !b'a']));
    }
}
