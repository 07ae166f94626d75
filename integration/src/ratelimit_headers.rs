//! Parsing the rate-limit response headers (`ratelimit`, `ratelimit-policy`): a structured item
//! into its policy name and parameters.

use std::collections::BTreeMap;

/// Parses a structured `ratelimit` / `ratelimit-policy` item such as `"per-key";r=0;t=7` into the
/// policy name and its parameters.
pub fn parse_ratelimit_item(value: &str) -> (String, BTreeMap<String, String>) {
    let mut parts = value.trim().split(';');
    let name = parts.next().unwrap_or("").trim();
    assert!(
        name.len() >= 2 && name.starts_with('"') && name.ends_with('"'),
        "policy name is not a quoted string in {value:?}"
    );
    let params = parts
        .map(|p| {
            let (k, v) = p
                .split_once('=')
                .unwrap_or_else(|| panic!("parameter without '=' in {value:?}"));
            (k.trim().to_string(), v.trim().to_string())
        })
        .collect();
    (name[1..name.len() - 1].to_string(), params)
}

/// An integer parameter of a parsed `ratelimit` item; panics if missing or not an integer.
pub fn int_param(params: &BTreeMap<String, String>, key: &str) -> i64 {
    params
        .get(key)
        .unwrap_or_else(|| panic!("missing parameter {key} in {params:?}"))
        .parse()
        .unwrap_or_else(|_| panic!("parameter {key} is not an integer in {params:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ratelimit_items() {
        let (n, p) = parse_ratelimit_item("\"per-key\";r=0;t=7");
        assert_eq!(n, "per-key");
        assert_eq!(int_param(&p, "r"), 0);
        assert_eq!(int_param(&p, "t"), 7);
    }
}
