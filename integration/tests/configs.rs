//! Configuration checks: bad filter configurations make Envoy refuse to start, with a log line
//! that names the field; `{}` is accepted. (Every Envoy config in the repository is validated
//! and started in `operator.rs`.)


use floodgate_integration::*;

struct BadConfig {
    what: &'static str,
    config: String,
    /// The field path the error line must name (followed by `:`).
    path: &'static str,
    /// A word the error line must contain (case-insensitive), if the problem has a stable one.
    keyword: Option<&'static str>,
}

fn bad(what: &'static str, config: Value, path: &'static str, keyword: Option<&'static str>) -> BadConfig {
    BadConfig {
        what,
        config: config.to_string(),
        path,
        keyword,
    }
}

fn rule(extra: Value) -> Value {
    let mut r = json!({"name": "r", "key": [{"header": "x-api-key"}], "limit": 5, "window": "10s"});
    for (k, v) in extra.as_object().expect("object") {
        if v.is_null() {
            r.as_object_mut().expect("object").remove(k);
        } else {
            r[k] = v.clone();
        }
    }
    r
}

#[test]
fn bad_configurations_are_refused_with_the_field_named() {
    let cases = vec![
        bad(
            "unparsable duration",
            json!({"rate_limits": [rule(json!({"window": "ten seconds"}))]}),
            "rate_limits[0].window",
            Some("duration"),
        ),
        bad(
            "zero limit",
            json!({"rate_limits": [rule(json!({"limit": 0}))]}),
            "rate_limits[0].limit",
            Some("positive"),
        ),
        bad(
            "negative limit",
            json!({"rate_limits": [rule(json!({"limit": -3}))]}),
            "rate_limits[0].limit",
            None,
        ),
        bad(
            "limit of the wrong type",
            json!({"rate_limits": [rule(json!({"limit": "5"}))]}),
            "rate_limits[0].limit",
            None,
        ),
        bad(
            "duplicate rule name",
            json!({"rate_limits": [rule(json!({})), rule(json!({"key": ["source_ip"]}))]}),
            "rate_limits[1].name",
            Some("duplicate"),
        ),
        bad(
            "unknown field in a rule",
            json!({"rate_limits": [rule(json!({"limt": 5}))]}),
            "rate_limits[0].limt",
            Some("unknown field"),
        ),
        bad(
            "unknown top-level field",
            json!({"rate_limit": []}),
            "rate_limit",
            Some("unknown field"),
        ),
        bad(
            "rate_limits not a list",
            json!({"rate_limits": rule(json!({}))}),
            "rate_limits",
            None,
        ),
        bad(
            "empty key list",
            json!({"rate_limits": [rule(json!({"key": []}))]}),
            "rate_limits[0].key",
            None,
        ),
        bad(
            "unknown key part",
            json!({"rate_limits": [rule(json!({"key": ["cookie"]}))]}),
            "rate_limits[0].key",
            None,
        ),
        bad(
            "rule name with a space",
            json!({"rate_limits": [rule(json!({"name": "has space"}))]}),
            "rate_limits[0].name",
            None,
        ),
        bad(
            "rule name of 65 characters",
            json!({"rate_limits": [rule(json!({"name": "n".repeat(65)}))]}),
            "rate_limits[0].name",
            None,
        ),
        bad(
            "missing limit",
            json!({"rate_limits": [rule(json!({"limit": null}))]}),
            "rate_limits[0]",
            Some("limit"),
        ),
        bad(
            "unknown missing_key mode",
            json!({"rate_limits": [rule(json!({"missing_key": "sometimes"}))]}),
            "rate_limits[0].missing_key",
            None,
        ),
        bad(
            "unknown ratelimit_headers mode",
            json!({"ratelimit_headers": "sometimes"}),
            "ratelimit_headers",
            None,
        ),
        bad(
            "zero max_active_requests",
            json!({"load_shedding": {"max_active_requests": 0}}),
            "load_shedding.max_active_requests",
            Some("positive"),
        ),
        bad(
            "shed_at above 1",
            json!({"load_shedding": {"max_active_requests": 5, "classes": [{"name": "a", "shed_at": 1.5}], "default_class": "a"}}),
            "load_shedding.classes[0].shed_at",
            Some("fraction"),
        ),
        bad(
            "default class that is not a class",
            json!({"load_shedding": {"max_active_requests": 5, "default_class": "bulk"}}),
            "load_shedding.default_class",
            Some("not one of the classes"),
        ),
        bad(
            "unknown rule mode",
            json!({"rate_limits": [rule(json!({"mode": "sometimes"}))]}),
            "rate_limits[0].mode",
            Some("shadow"),
        ),
        bad(
            "unknown top-level mode",
            json!({"mode": "dry-run"}),
            "mode",
            Some("enforce"),
        ),
        bad(
            "routes beside cluster selection",
            json!({
                "rate_limits": [rule(json!({"match": {"routes": ["api"]}}))],
                "cluster_selection": {"route_header": "x-cluster", "clusters": ["a"]},
            }),
            "rate_limits[0].match.routes",
            Some("cluster_selection"),
        ),
        bad(
            "health path without a leading slash",
            json!({"health": {"path": "health"}}),
            "health.path",
            None,
        ),
    ];
    let mut problems = Vec::new();
    for case in &cases {
        let log = Envoy::start_expecting_failure(&case.config);
        match config_error_line(&log) {
            None => problems.push(format!(
                "{}: no `invalid configuration` line; config {}; end of log:\n{}",
                case.what,
                case.config,
                tail(&log, 15)
            )),
            Some(line) => {
                println!("{}: {line}", case.what);
                let names_field = line.contains(&format!("{}:", case.path))
                    || line.contains(&format!("{}[", case.path))
                    || line.contains(&format!("{}.", case.path));
                let has_keyword = case
                    .keyword
                    .is_none_or(|k| line.to_lowercase().contains(&k.to_lowercase()));
                if !names_field || !has_keyword {
                    problems.push(format!(
                        "{}: expected the field `{}`{} in: {line}",
                        case.what,
                        case.path,
                        case.keyword.map(|k| format!(" and `{k}`")).unwrap_or_default()
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn invalid_json_is_refused() {
    let log = Envoy::start_expecting_failure(r#"{"rate_limits": ["#);
    let line = config_error_line(&log);
    println!("{line:?}");
    assert!(line.is_some(), "no `invalid configuration` line:\n{}", tail(&log, 15));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_configuration_is_accepted_and_passes_traffic() {
    let upstream = Upstream::start();
    let envoy = Envoy::start("{}", &upstream);
    for i in 0..10 {
        let r = get(envoy.addr(), &format!("/x/{i}"), &[("x-api-key", "k")]).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.text(), UPSTREAM_BODY);
        assert!(r.header("ratelimit").is_none(), "no rules, no ratelimit header");
    }
    assert_eq!(upstream.total(), 10);
    let failures = wasm_failures(&envoy.log());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The module under test is the one `wasm-build.sh` gives users: without the exports of the
/// callbacks floodgate does not implement (`trim/`), so Envoy never calls them, and with every
/// callback floodgate does implement (every other test here runs it in Envoy).
#[test]
fn the_module_exports_the_callbacks_floodgate_implements_and_no_other_per_request_one() {
    let path = wasm_module();
    let module = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let exports = floodgate_trim::exports(&module).expect("a WebAssembly module");
    for unused in floodgate_trim::UNUSED_CALLBACKS {
        assert!(
            !exports.iter().any(|e| e == unused),
            "{} exports {unused}, which Envoy would call on every response for nothing: build it with ./wasm-build.sh",
            path.display()
        );
    }
    let implemented = [
        "proxy_on_vm_start",
        "proxy_on_configure",
        "proxy_on_tick",
        "proxy_on_context_create",
        "proxy_on_request_headers",
        "proxy_on_request_body",
        "proxy_on_request_trailers",
        "proxy_on_response_headers",
        "proxy_on_response_trailers",
        "proxy_on_http_call_response",
        "proxy_on_log",
        "proxy_on_done",
        "proxy_on_delete",
        "proxy_on_memory_allocate",
    ];
    for callback in implemented {
        assert!(exports.iter().any(|e| e == callback), "{} lacks {callback}", path.display());
    }
}
