//! Validated scalar values of the configuration: each rejects a bad input with a message that
//! says what was expected, so the config error names both the field and the problem.

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use std::fmt;
use std::num::{NonZeroU32, NonZeroU64};

/// The longest accepted duration: 366 days. Longer windows are almost certainly a typo, and the
/// bound keeps every product in the window arithmetic far from overflow.
pub const MAX_DURATION_MS: u64 = 366 * 24 * 3600 * 1000;

/// A positive duration in milliseconds, written in the config as `"250ms"`, `"10s"`, `"1m"`
/// or `"1h"` (a whole number and one unit).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DurationMs(NonZeroU64);

impl DurationMs {
    /// One millisecond.
    pub const MIN: DurationMs = DurationMs(NonZeroU64::MIN);

    /// The duration in milliseconds, never zero.
    pub fn get(self) -> NonZeroU64 {
        self.0
    }

    /// Builds a duration from milliseconds (`None` for zero).
    pub fn from_ms(ms: u64) -> Option<DurationMs> {
        NonZeroU64::new(ms).map(DurationMs)
    }

    /// Whole seconds, rounded up (as `RateLimit-Policy`'s `w` parameter wants them).
    pub fn ceil_secs(self) -> u64 {
        self.0.get().div_ceil(1000)
    }

    /// Parses `"<digits><unit>"` with unit `ms`, `s`, `m` or `h`.
    pub fn parse(text: &str) -> Result<DurationMs, String> {
        let bad = || {
            format!("{text:?} is not a duration (use a whole number and a unit: \"250ms\", \"10s\", \"1m\", \"1h\")")
        };
        let digits_end = text.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let (digits, unit) = text.split_at(digits_end);
        let unit_ms: u64 = match unit {
            "ms" => 1,
            "s" => 1000,
            "m" => 60_000,
            "h" => 3_600_000,
            _ => return Err(bad()),
        };
        let amount: u64 = digits.parse().map_err(|_| bad())?;
        let ms = amount
            .checked_mul(unit_ms)
            .filter(|ms| *ms <= MAX_DURATION_MS)
            .ok_or_else(|| format!("{text:?} is too long (at most 366 days)"))?;
        DurationMs::from_ms(ms).ok_or_else(|| format!("{text:?} must be longer than zero"))
    }
}

impl fmt::Display for DurationMs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.get();
        if ms % 3_600_000 == 0 {
            write!(f, "{}h", ms / 3_600_000)
        } else if ms % 60_000 == 0 {
            write!(f, "{}m", ms / 60_000)
        } else if ms % 1000 == 0 {
            write!(f, "{}s", ms / 1000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

impl<'de> Deserialize<'de> for DurationMs {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DurationVisitor;
        impl Visitor<'_> for DurationVisitor {
            type Value = DurationMs;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string such as \"250ms\", \"10s\", \"1m\" or \"1h\"")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<DurationMs, E> {
                DurationMs::parse(text).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(DurationVisitor)
    }
}

/// A fraction in (0, 1].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fraction(f64);

impl Fraction {
    /// The value, in (0, 1].
    pub fn get(self) -> f64 {
        self.0
    }

    /// A fraction from a constant of this crate, unchecked.
    pub(crate) fn trusted(value: f64) -> Fraction {
        Fraction(value)
    }
}

impl<'de> Deserialize<'de> for Fraction {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FractionVisitor;
        impl Visitor<'_> for FractionVisitor {
            type Value = Fraction;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a fraction in (0, 1]")
            }
            fn visit_f64<E: de::Error>(self, value: f64) -> Result<Fraction, E> {
                if value > 0.0 && value <= 1.0 {
                    Ok(Fraction(value))
                } else {
                    Err(E::custom(format!("must be a fraction in (0, 1], got {value}")))
                }
            }
            #[allow(clippy::cast_precision_loss)]
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<Fraction, E> {
                self.visit_f64(value as f64)
            }
            #[allow(clippy::cast_precision_loss)]
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<Fraction, E> {
                self.visit_f64(value as f64)
            }
        }
        deserializer.deserialize_any(FractionVisitor)
    }
}

/// A positive integer that fits in 32 bits (limits, capacities).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Positive(NonZeroU32);

impl Positive {
    /// One.
    pub const ONE: Positive = Positive(NonZeroU32::MIN);

    /// The value, never zero.
    pub fn get(self) -> NonZeroU32 {
        self.0
    }

    /// Builds a value (`None` for zero).
    pub fn new(value: u32) -> Option<Positive> {
        NonZeroU32::new(value).map(Positive)
    }
}

impl<'de> Deserialize<'de> for Positive {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PositiveVisitor;
        impl Visitor<'_> for PositiveVisitor {
            type Value = Positive;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a positive integer")
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<Positive, E> {
                u32::try_from(value)
                    .ok()
                    .and_then(Positive::new)
                    .ok_or_else(|| {
                        E::custom(format!(
                            "must be a positive integer of at most {}, got {value}",
                            u32::MAX
                        ))
                    })
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<Positive, E> {
                match u64::try_from(value) {
                    Ok(value) => self.visit_u64(value),
                    Err(_) => Err(E::custom(format!("must be a positive integer, got {value}"))),
                }
            }
            fn visit_f64<E: de::Error>(self, value: f64) -> Result<Positive, E> {
                Err(E::custom(format!("must be a positive integer, got {value}")))
            }
        }
        deserializer.deserialize_any(PositiveVisitor)
    }
}

/// A name used in metrics, shared-data keys and response fields: 1 to 64 characters of ASCII
/// letters, digits, `-`, `_` and `.`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Name(String);

impl Name {
    /// The name as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A name from a constant of this crate (unit-tested to be valid), unchecked.
    pub(crate) fn trusted(text: &str) -> Name {
        Name(text.to_owned())
    }

    /// Checks a name against the allowed alphabet and length.
    pub fn parse(text: &str) -> Result<Name, String> {
        let valid_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if text.is_empty() || text.len() > 64 || !text.chars().all(valid_char) {
            return Err(format!(
                "{text:?} is not a valid name (1 to 64 of letters, digits, '-', '_', '.')"
            ));
        }
        Ok(Name(text.to_owned()))
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NameVisitor;
        impl Visitor<'_> for NameVisitor {
            type Value = Name;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a name string")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Name, E> {
                Name::parse(text).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(NameVisitor)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_in_every_unit() {
        assert_eq!(DurationMs::parse("250ms").unwrap().get().get(), 250);
        assert_eq!(DurationMs::parse("10s").unwrap().get().get(), 10_000);
        assert_eq!(DurationMs::parse("1m").unwrap().get().get(), 60_000);
        assert_eq!(DurationMs::parse("1h").unwrap().get().get(), 3_600_000);
        assert_eq!(DurationMs::parse("60s").unwrap().to_string(), "1m");
        assert_eq!(DurationMs::parse("1500ms").unwrap().to_string(), "1500ms");
    }

    #[test]
    fn durations_refuse_nonsense_zero_and_overflow() {
        for bad in ["", "10", "s", "ten seconds", "1.5s", "-1s", "1 s", "1d", "10S"] {
            let err = DurationMs::parse(bad).unwrap_err();
            assert!(err.contains("is not a duration"), "{bad}: {err}");
        }
        assert!(DurationMs::parse("0s").unwrap_err().contains("longer than zero"));
        assert!(DurationMs::parse("99999999999999999999h").is_err());
        assert!(DurationMs::parse("9000h").unwrap_err().contains("too long"));
    }

    #[test]
    fn names_allow_a_safe_alphabet_only() {
        assert!(Name::parse("per-api-key_2.v1").is_ok());
        for bad in ["", "a b", "a\"b", "ü", &"x".repeat(65)] {
            assert!(Name::parse(bad).is_err(), "{bad}");
        }
    }
}
