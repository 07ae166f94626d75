//! Cross-checks of a configuration found by [`crate::find_configurations`] against the Envoy
//! configuration around it: the route that must read `cluster_selection.route_header`, the
//! clusters of `cluster_selection` and `global`, the routes' room for a request body the estimate
//! reads, and the address `source_ip` stands for.
//!
//! Invariant: [`check`] refuses a configuration only when its bytes could not be told or the
//! module's own parser ([`Config::parse`]) refuses it, with the parser's message; the cross-checks
//! only add warnings.

use crate::discover::Found;
use crate::envoy::EnvoyContext;
use floodgate::config::{Config, KeyPart};

/// Room for one more frame in a stream's buffer, beyond the estimate's bound and one read.
const FRAME_BYTES: u64 = 64 << 10;

/// A configuration that parsed, with remarks about how it fits its Envoy configuration.
#[derive(Debug)]
pub struct Checked {
    /// The parsed configuration.
    pub config: Config,
    /// Remarks that do not make it invalid.
    pub warnings: Vec<String>,
}

/// The rules that read their estimate from the request body, where the file's routes let Envoy
/// hold less of a body than the estimate's bound plus one read from the client: Envoy answers
/// `413` to such a request when its first bytes come alone and the rest at once. One warning
/// names every such rule and the room the largest bound needs.
fn body_buffer_warnings(config: &Config, envoy: &EnvoyContext) -> Vec<String> {
    let Some(limit) = envoy.body_buffer_limit else { return Vec::new() };
    let mut short = Vec::new();
    let mut needed = 0;
    for (index, rule) in config.rate_limits.iter().enumerate() {
        let Some(estimate) = rule.cost.as_ref().and_then(|cost| cost.estimate.as_ref()) else { continue };
        if estimate.body.is_none() && estimate.sum.is_none() {
            continue;
        }
        let bound = estimate.max_body_bytes.map_or(floodgate::config::DEFAULT_ESTIMATE_BODY_BYTES, |b| u64::from(b.get().get()));
        let rule_needs = bound.saturating_add(envoy.read_limit).saturating_add(FRAME_BYTES);
        if limit < rule_needs {
            short.push(format!("rate_limits[{index}] (\"{name}\", up to {bound} bytes)", name = rule.name));
            needed = needed.max(rule_needs);
        }
    }
    if short.is_empty() {
        return Vec::new();
    }
    let routes = if limit == 0 {
        "a route of this file sets no request_body_buffer_limit".to_owned()
    } else {
        format!("a route of this file sets request_body_buffer_limit: {limit}")
    };
    let (rules, read) = (short.join(", "), envoy.read_limit);
    vec![format!(
        "{rules}: {verb} {its} estimate from the request body, but {routes}: Envoy holds what it read of a body plus \
         one read from the client (up to the listener's per_connection_buffer_limit_bytes, {read}) and answers 413 past \
         the stream's limit, so a long body whose first bytes come alone is refused. Set request_body_buffer_limit: \
         {needed} (or more) on the routes (Envoy 1.37 and later; docs/llm.md, \"The estimate in the request body\")",
        verb = if short.len() == 1 { "reads" } else { "read" },
        its = if short.len() == 1 { "its" } else { "their" },
    )]
}

/// Parses a configuration found by [`find_configurations`](crate::find_configurations) with the
/// module's own parser, then cross-checks it against the Envoy configuration around it.
pub fn check(found: &Found) -> Result<Checked, String> {
    let bytes = found.bytes.as_ref().map_err(Clone::clone)?;
    let config = Config::parse(bytes).map_err(|err| err.to_string())?;
    let mut warnings = found.warnings.clone();
    if let (Some(selection), Some(envoy)) = (&config.cluster_selection, &found.envoy) {
        if let Some(headers) = &envoy.cluster_headers {
            let header = &selection.route_header;
            if !headers.iter().any(|h| h.eq_ignore_ascii_case(header)) {
                warnings.push(format!(
                    "cluster_selection.route_header: no route in this file reads \"{header}\" \
                     (the route must say `cluster_header: {header}`)"
                ));
            }
        }
        if let Some(clusters) = &envoy.static_clusters {
            for (index, cluster) in selection.clusters.iter().enumerate() {
                if !clusters.iter().any(|c| c == cluster.as_str()) {
                    warnings.push(format!(
                        "cluster_selection.clusters[{index}]: \"{cluster}\" is not one of this file's \
                         static_resources.clusters"
                    ));
                }
            }
        }
    }
    if let (Some(global), Some(clusters)) =
        (&config.global, found.envoy.as_ref().and_then(|envoy| envoy.static_clusters.as_ref()))
    {
        if !clusters.iter().any(|c| c == global.cluster.as_str()) {
            warnings.push(format!(
                "global.cluster: \"{}\" is not one of this file's static_resources.clusters (every batch to \
                 floodgate-sync would fail, and the global rules would hold per proxy only)",
                global.cluster
            ));
        }
    }
    if let Some(envoy) = &found.envoy {
        warnings.extend(body_buffer_warnings(&config, envoy));
    }
    if let Some(manager) = &found.connection_manager {
        if !manager.use_remote_address && !manager.detection_extensions {
            for (index, rule) in config.rate_limits.iter().enumerate() {
                if rule.key.iter().any(|part| matches!(part, KeyPart::SourceIp)) {
                    warnings.push(format!(
                        "rate_limits[{index}] (\"{name}\"): keys on source_ip, but this listener's connection \
                         manager does not set use_remote_address: true, so Envoy takes the client's address \
                         from X-Forwarded-For when a request has one ({nth}): a client that reaches this Envoy \
                         directly writes that header itself and gets a fresh quota with every request. At the \
                         edge set use_remote_address: true (the address is the TCP peer's); behind N proxies \
                         you trust that append to X-Forwarded-For, use_remote_address: true and \
                         xff_num_trusted_hops: N (docs/configuration.md, \"Which address source_ip is\")",
                        name = rule.name,
                        nth = match manager.xff_num_trusted_hops {
                            0 => "its last entry".to_owned(),
                            hops => format!("the {} entry from the right", ordinal(hops.saturating_add(1))),
                        },
                    ));
                }
            }
        }
    }
    Ok(Checked { config, warnings })
}

/// `1` → "1st", `2` → "2nd", `3` → "3rd", `4` → "4th", ...
fn ordinal(n: u64) -> String {
    let suffix = match (n % 10, n % 100) {
        (1, 11) | (2, 12) | (3, 13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

// Every test that finds configurations and then checks them is here, discovery's included:
// `cross_check` imports `discover`, never the other way.
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::discover::{find_configurations, Options, WASM_FILTER_TYPE};

    fn find(name: &str, text: &str) -> Vec<Found> {
        find_configurations(name, text.as_bytes(), Options::default()).unwrap()
    }

    #[test]
    fn a_bare_json_file_is_the_configuration_byte_for_byte() {
        let text = "{\"rate_limits\": []}\n";
        let found = find("c.json", text);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].location, "");
        assert_eq!(found[0].bytes.as_deref().unwrap(), text.as_bytes());
        assert!(check(&found[0]).is_ok());
    }

    #[test]
    fn broken_json_gets_the_parsers_message() {
        let found = find("c.json", "{\"rate_limits\": [");
        let error = check(&found[0]).unwrap_err();
        assert!(error.contains("EOF"), "{error}");
        let found = find("c.conf", "{\"health\": {\"path\": \"/h\"},}");
        assert!(check(&found[0]).unwrap_err().contains("trailing comma"));
    }

    #[test]
    fn envoy_yaml_string_value_struct_and_bytes_value() {
        let yaml = r#"
static_resources:
  listeners:
  - name: front
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          route_config:
            virtual_hosts:
            - routes:
              - route: { cluster_header: X-Floodgate-Cluster }
          http_filters:
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: floodgate
                failure_policy: FAIL_CLOSED
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{"cluster_selection": {"clusters": ["a", "b"]}}'
          - name: other
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: edge
                root_id: x
                vm_config: { code: { local: { filename: /etc/floodgate.wasm } } }
                configuration:
                  "@type": type.googleapis.com/google.protobuf.Struct
                  value: { health: { path: 7 } }
          - name: b64
            typed_config:
              "@type": type.googleapis.com/udpa.type.v1.TypedStruct
              type_url: type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              value:
                config:
                  root_id: floodgate
                  failure_policy: FAIL_OPEN
                  configuration:
                    "@type": type.googleapis.com/google.protobuf.BytesValue
                    value: eyJoZWFsdGgiOnsicGF0aCI6Ii9oIn19
          - name: not-ours
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config: { name: auth }
  clusters:
  - name: a
"#;
        let found = find("e.yaml", yaml);
        let locations: Vec<&str> = found.iter().map(|f| f.location.as_str()).collect();
        assert_eq!(
            locations,
            [
                "listener \"front\", Wasm filter \"floodgate\"",
                "listener \"front\", Wasm filter \"edge\"",
                "listener \"front\", Wasm filter \"floodgate\" #2"
            ]
        );
        let first = check(&found[0]).unwrap();
        assert_eq!(
            first.warnings,
            ["cluster_selection.clusters[1]: \"b\" is not one of this file's static_resources.clusters"]
        );
        assert_eq!(
            check(&found[1]).unwrap_err(),
            "health.path: invalid type: integer `7`, expected a string"
        );
        assert!(found[1].warnings[0].starts_with("failure_policy is not set"));
        assert_eq!(found[2].bytes.as_deref().unwrap(), br#"{"health":{"path":"/h"}}"#);
        assert!(check(&found[2]).unwrap().warnings.is_empty());
    }

    #[test]
    fn a_route_without_the_cluster_header_is_reported() {
        let yaml = r#"
route_config: { virtual_hosts: [ { routes: [ { route: { cluster: a } } ] } ] }
http_filters:
- typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
    config:
      root_id: floodgate
      failure_policy: FAIL_CLOSED
      configuration:
        "@type": type.googleapis.com/google.protobuf.StringValue
        value: '{"cluster_selection": {"clusters": ["a"], "route_header": "x-c"}}'
"#;
        let found = find("snippet.yaml", yaml);
        assert_eq!(
            found[0].location,
            "Wasm filter \"floodgate\" at http_filters[0].typed_config"
        );
        let warnings = check(&found[0]).unwrap().warnings;
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].starts_with("cluster_selection.route_header: no route in this file reads \"x-c\""));
    }

    /// A listener whose connection manager sets `settings`, with a floodgate filter configured
    /// with `config`.
    fn edge_listener(settings: &str, config: &str) -> String {
        format!(
            r#"
static_resources:
  listeners:
  - name: edge
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          {settings}
          http_filters:
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: floodgate
                failure_policy: FAIL_CLOSED
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{config}'
"#
        )
    }

    #[test]
    fn a_source_ip_rule_without_use_remote_address_is_reported() {
        let per_ip = r#"{"rate_limits": [{"name": "by-key", "key": [{"header": "k"}], "limit": 5, "window": "1s"},
                                          {"name": "per-ip", "key": ["path", "source_ip"], "limit": 5, "window": "1s"}]}"#;
        let warnings = |settings: &str, config: &str| check(&find("e.yaml", &edge_listener(settings, config))[0]).unwrap().warnings;
        // Envoy's default (false): the client's address is the last X-Forwarded-For entry.
        for settings in ["stat_prefix: edge", "use_remote_address: false", "xff_num_trusted_hops: 1"] {
            let found = warnings(settings, per_ip);
            assert_eq!(found.len(), 1, "{settings}: {found:?}");
            assert!(
                found[0].starts_with("rate_limits[1] (\"per-ip\"): keys on source_ip, but this listener's connection manager does not set use_remote_address: true"),
                "{}",
                found[0]
            );
            assert!(found[0].contains("xff_num_trusted_hops"), "{}", found[0]);
        }
        // At the edge, or behind trusted proxies counted by xff_num_trusted_hops: nothing to say.
        assert!(warnings("use_remote_address: true", per_ip).is_empty());
        assert!(warnings("use_remote_address: true\n          xff_num_trusted_hops: 2", per_ip).is_empty());
        // An original-IP detection extension decides the address instead.
        assert!(warnings("original_ip_detection_extensions: [{name: xff}]", per_ip).is_empty());
        // No rule keyed on source_ip, or no connection manager in sight (an http_filters snippet).
        assert!(warnings("stat_prefix: edge", r#"{"rate_limits": [{"name": "a", "key": ["path"], "limit": 5, "window": "1s"}]}"#).is_empty());
        let snippet = format!(
            "http_filters:\n- typed_config:\n    \"@type\": {WASM_FILTER_TYPE}\n    config: {{name: floodgate, failure_policy: FAIL_CLOSED, configuration: {{\"@type\": type.googleapis.com/google.protobuf.StringValue, value: '{per_ip}'}}}}\n"
        );
        assert!(check(&find("s.yaml", &snippet)[0]).unwrap().warnings.is_empty());
    }

    #[test]
    fn a_global_cluster_the_file_does_not_define_is_reported() {
        let config = r#"{"rate_limits": [{"name": "t", "key": [{"header": "t"}], "limit": 5, "window": "1s", "scope": "global"}], "global": {"cluster": "floodgate-sync"}}"#;
        let listener = edge_listener("use_remote_address: true", config);
        let warnings = |yaml: &str| check(&find("g.yaml", yaml)[0]).unwrap().warnings;
        assert_eq!(
            warnings(&format!("{listener}  clusters:\n  - name: upstream\n")),
            ["global.cluster: \"floodgate-sync\" is not one of this file's static_resources.clusters (every batch to \
              floodgate-sync would fail, and the global rules would hold per proxy only)"]
        );
        assert!(warnings(&format!("{listener}  clusters:\n  - name: upstream\n  - name: floodgate-sync\n")).is_empty());
        // Without static clusters (they may come from CDS) there is nothing to compare with.
        assert!(warnings(&listener).is_empty());
    }

    #[test]
    fn a_body_estimate_without_room_for_the_body_in_the_routes_is_reported() {
        let config = r#"{"rate_limits": [{"name": "tokens", "key": [{"header": "k"}], "limit": 1000, "window": "1m",
            "cost": {"from": "response_body", "path": "usage.total_tokens",
                     "estimate": {"body": ["max_tokens"], "default": 256, "max": 4096}}}]}"#;
        let routes = |route_settings: &str| {
            format!(
                "route_config:\n            virtual_hosts:\n            - name: all\n              domains: [\"*\"]\n              \
                 routes:\n              - match: {{ prefix: \"/\" }}\n                route: {{ cluster: upstream }}\n{route_settings}"
            )
        };
        let warnings = |settings: &str, config: &str| check(&find("b.yaml", &edge_listener(settings, config))[0]).unwrap().warnings;
        let missing = warnings(&routes(""), config);
        assert_eq!(missing.len(), 1, "{missing:?}");
        assert!(missing[0].starts_with("rate_limits[0] (\"tokens\", up to 262144 bytes): reads its estimate from the request body, but a route of this file sets no request_body_buffer_limit"), "{}", missing[0]);
        assert!(missing[0].contains("request_body_buffer_limit: 1376256 (or more)"), "{}", missing[0]);
        let small = warnings(&routes("                request_body_buffer_limit: 1048576\n"), config);
        assert!(small[0].contains("sets request_body_buffer_limit: 1048576"), "{small:?}");
        assert!(warnings(&routes("                request_body_buffer_limit: 2097152\n"), config).is_empty());
        // Two rules short of room: one warning names both, with the room the larger bound needs.
        let two = config.replace("}}}]}", r#"}}}, {"name": "big", "key": [{"header": "k"}], "limit": 1000, "window": "1m",
            "cost": {"from": "response_body", "path": "usage.total_tokens",
                     "estimate": {"body": ["max_tokens"], "default": 256, "max": 4096, "max_body_bytes": 1048576}}}]}"#);
        let both = warnings(&routes(""), &two);
        assert_eq!(both.len(), 1, "{both:?}");
        assert!(both[0].starts_with("rate_limits[0] (\"tokens\", up to 262144 bytes), rate_limits[1] (\"big\", up to 1048576 bytes): read their estimate"), "{}", both[0]);
        assert!(both[0].contains("request_body_buffer_limit: 2162688 (or more)"), "{}", both[0]);
        // Without inline routes (RDS) or without a body estimate there is nothing to compare.
        assert!(warnings("stat_prefix: edge", config).is_empty());
        let header_only = config.replace(r#""body": ["max_tokens"], "#, r#""header": "x-max-tokens", "#);
        assert!(warnings(&routes(""), &header_only).is_empty());
    }

    #[test]
    fn the_shipped_llm_example_leaves_room_for_the_body() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy/llm.yaml")).expect("envoy/llm.yaml");
        let found = find("llm.yaml", &text);
        assert!(found[0].envoy.as_ref().is_some_and(|e| e.body_buffer_limit == Some(2 << 20)), "{:?}", found[0].envoy);
        assert!(check(&found[0]).unwrap().warnings.is_empty(), "{:?}", check(&found[0]).unwrap().warnings);
    }

    #[test]
    fn istio_wasm_plugins_in_a_multi_document_file() {
        let yaml = r#"
apiVersion: v1
kind: Namespace
metadata: { name: shop }
---
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: { name: floodgate, namespace: shop }
spec:
  url: oci://registry.example/floodgate:0.2.0
  pluginConfig:
    rate_limits:
    - { name: per-ip, key: [source_ip], limit: 100, window: 1m }
---
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: { name: limits }
spec:
  url: oci://registry.example/floodgate:0.2.0
"#;
        let found = find("istio.yaml", yaml);
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].location, "document 2, WasmPlugin \"shop/floodgate\"");
        assert!(check(&found[0])
            .unwrap()
            .config
            .summary()
            .contains("per-ip = 100 per 1m"));
        assert_eq!(found[1].bytes.as_deref().unwrap(), b"");
    }

    #[test]
    fn a_yaml_file_without_envoy_keys_is_a_configuration() {
        let error = find_configurations("compose.yaml", b"services:\n  envoy: {}\n", Options::default()).unwrap_err();
        assert!(error.starts_with("no floodgate configuration found"), "{error}");
        let found = find("c.yaml", "health:\n  path: /h\nrate_limit: []\n");
        assert_eq!(check(&found[0]).unwrap_err(), "rate_limit: unknown field `rate_limit`, expected one of `rate_limits`, `stat_prefix`, `ratelimit_headers`, `refusal_format`, `load_shedding`, `cluster_selection`, `health`, `watchdog`, `global`, `grpc`, `mode`, `access_log`");
    }
}
