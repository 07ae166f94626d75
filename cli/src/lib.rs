//! floodgate's operator tooling, behind the `floodgate` command.
//!
//! [`find_configurations`] finds every floodgate configuration in a file: a bare JSON
//! configuration, an Envoy bootstrap or xDS resource file (YAML or JSON) with HTTP Wasm filters that
//! load floodgate, or an Istio `WasmPlugin` manifest. For each it gives the exact bytes the module
//! would receive in `on_configure`. [`check`] parses them with
//! [`floodgate::config::Config::parse`], the very parser the module runs, so this command and the
//! proxy accept and refuse the same configurations with the same field-named messages.
//! [`explain`] tells what the module would do with one request. [`run`] is the command line
//! itself.
//!
//! Inside, the dependencies go one way: the dispatch ([`run`] and its subcommands, in the crate
//! root) uses `cross_check` ([`check`]), which judges what `discover` ([`find_configurations`])
//! found; both read the Envoy configuration around a filter through `envoy` ([`EnvoyContext`],
//! [`ClientAddress`]). The root re-exports their public items.

pub mod explain;
mod cross_check;
mod discover;
mod envoy;

pub use cross_check::{check, Checked};
pub use discover::{find_configurations, parse_documents, Found, Options, WASM_FILTER_TYPE};
pub use envoy::{ClientAddress, EnvoyContext, HCM_TYPE};

use floodgate::selection::partition::Partitioner;
use std::io::{Read, Write};

/// The JSON Schema (draft 2020-12) of the configuration: `schema/floodgate.schema.json`.
pub const SCHEMA: &str = include_str!("../../schema/floodgate.schema.json");

/// The configurations of a file ([`find_configurations`]), each with the prefix of its lines
/// (`FILE: ` or `FILE: location: `); `None`, the problem written to `err`, when there are none.
fn configurations(name: &str, contents: &[u8], options: Options, err: &mut dyn Write) -> Option<Vec<(String, Found)>> {
    match find_configurations(name, contents, options) {
        Ok(found) => Some(
            found
                .into_iter()
                .map(|item| {
                    let prefix =
                        if item.location.is_empty() { format!("{name}: ") } else { format!("{name}: {}: ", item.location) };
                    (prefix, item)
                })
                .collect(),
        ),
        Err(problem) => {
            let _ = writeln!(err, "{name}: {problem}");
            None
        }
    }
}

/// Checks one file: every configuration in it, printed to `out` (valid) or `err` (invalid, with
/// warnings). Returns whether every configuration is valid.
pub fn validate_file(name: &str, contents: &[u8], options: Options, out: &mut dyn Write, err: &mut dyn Write) -> bool {
    let Some(found) = configurations(name, contents, options, err) else { return false };
    let mut all_valid = true;
    for (prefix, item) in &found {
        match check(item) {
            Ok(checked) => {
                let _ = writeln!(out, "{prefix}ok: {}", checked.config.summary());
                for warning in &checked.warnings {
                    let _ = writeln!(err, "{prefix}warning: {warning}");
                }
            }
            Err(problem) => {
                all_valid = false;
                let _ = writeln!(err, "{prefix}{problem}");
                for warning in &item.warnings {
                    let _ = writeln!(err, "{prefix}warning: {warning}");
                }
            }
        }
    }
    all_valid
}

const USAGE: &str = "\
usage:
  floodgate validate [--any-wasm] FILE...
      Checks floodgate configurations with the parser the Wasm module runs, and prints
      `FILE: ok: <what it enforces>` or `FILE: <field path>: <problem>` for each.
      FILE is a floodgate JSON configuration, an Envoy configuration (YAML or JSON: a bootstrap,
      an LDS/ECDS resource file, ...) whose envoy.filters.http.wasm filters load floodgate, or an
      Istio WasmPlugin manifest; `-` reads standard input. A Wasm filter or WasmPlugin counts as
      floodgate when its name, root_id, vm_id, module path or URL says \"floodgate\"; --any-wasm
      checks all of them. Exit status: 0 all valid, 1 something invalid or not found, 2 usage.
  floodgate partition FILE [PART...]
      With cluster_selection.partition: prints how the clusters are partitioned, and the
      partition of the key made of these PARTs (the values of the partition's key parts, in
      order, as the request carries them). The mapping depends on the configuration only, so it
      is what every proxy running it computes. FILE as for validate.
  floodgate explain CONFIG [--method M] [--path P] [--authority A] [--route NAME]
                           [--header name:value]... [--source-ip IP[:PORT]]
      Tells what the filter would do with the request described (by default GET /, without
      authority, route name, headers or source address), with the module's own code. CONFIG
      as FILE for validate; each configuration found is explained under a line
      `CONFIG[: location]:`, then, indented:
        request: the request as the filter sees it;
        mode: shadow (top-level), when the whole filter is in shadow;
        health: the health endpoint answers it (and then nothing else is listed);
        rate_limits[i] \"name\": applies | does not apply: <the first condition that fails:
          path, method, header, authority, route; or a key part missing, missing_key: skip>;
          a rule that applies has the lines
            mode: enforce | shadow (the rule's own mode or the top-level one);
            key: each key part and its value as the rule reads it (a header's value,
              source_ip without port, path without query);
            limit: N per WINDOW (overrides[i] | tier \"T\" named by header H | the rule's limit);
            cost: units now (1 per request | request header H | content-length),
              or later (the request body's bytes, a response header), capped at the limit;
            scope: proxy | global, consistency batched | leased;
        partition: the key and its clusters (cluster_selection.partition), or
          cluster selection: every cluster, without a partition;
        priority class: the class (load_shedding) and the thresholds that shed it;
        per-key cap: the key of load_shedding.per_key and its cap.
      Exit status: 0 explained, 1 a configuration invalid or none found, 2 usage.
  floodgate schema
      Prints the JSON Schema (draft 2020-12) of the configuration.
  floodgate --version | --help
";

/// The `floodgate` command: `args` without the program name. Returns the exit status.
pub fn run(args: &[String], out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let Some((command, rest)) = args.split_first() else {
        let _ = write!(err, "{USAGE}");
        return 2;
    };
    match command.as_str() {
        "validate" => {
            let any_wasm = rest.iter().any(|a| a == "--any-wasm");
            let files: Vec<&String> = rest.iter().filter(|a| *a != "--any-wasm").collect();
            if let Some(unknown) = files.iter().find(|a| a.starts_with("--")) {
                let _ = write!(err, "floodgate: unknown option {unknown}\n{USAGE}");
                return 2;
            }
            if files.is_empty() {
                let _ = write!(err, "floodgate validate: no FILE given\n{USAGE}");
                return 2;
            }
            let options = Options { any_wasm };
            let mut all_valid = true;
            for file in files {
                match read_input(file) {
                    Ok(contents) => all_valid &= validate_file(file, &contents, options, out, err),
                    Err(problem) => {
                        let _ = writeln!(err, "{file}: cannot read: {problem}");
                        all_valid = false;
                    }
                }
            }
            u8::from(!all_valid)
        }
        "partition" => {
            let Some((file, parts)) = rest.split_first() else {
                let _ = write!(err, "floodgate partition: no FILE given\n{USAGE}");
                return 2;
            };
            match read_input(file) {
                Ok(contents) => partition(file, &contents, parts, out, err),
                Err(problem) => {
                    let _ = writeln!(err, "{file}: cannot read: {problem}");
                    1
                }
            }
        }
        "explain" => {
            let (file, request) = match explain::Request::from_args(rest) {
                Ok(parsed) => parsed,
                Err(problem) => {
                    let _ = write!(err, "floodgate explain: {problem}\n{USAGE}");
                    return 2;
                }
            };
            match read_input(&file) {
                Ok(contents) => explain_file(&file, &contents, &request, out, err),
                Err(problem) => {
                    let _ = writeln!(err, "{file}: cannot read: {problem}");
                    1
                }
            }
        }
        "schema" if rest.is_empty() => {
            let _ = write!(out, "{SCHEMA}");
            0
        }
        "--version" | "version" => {
            let _ = writeln!(out, "floodgate {}", env!("CARGO_PKG_VERSION"));
            0
        }
        "--help" | "-h" | "help" => {
            let _ = write!(out, "{USAGE}");
            0
        }
        other => {
            let _ = write!(err, "floodgate: unknown command {other}\n{USAGE}");
            2
        }
    }
}

/// A file's contents, or standard input's for `-`.
fn read_input(file: &str) -> std::io::Result<Vec<u8>> {
    if file == "-" {
        let mut buffer = Vec::new();
        std::io::stdin().read_to_end(&mut buffer).map(|_| buffer)
    } else {
        std::fs::read(file)
    }
}

/// `floodgate explain`: every configuration of the file, under its location, explained for
/// `request` ([`explain::explain`]). Returns the exit status.
fn explain_file(name: &str, contents: &[u8], request: &explain::Request, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let Some(found) = configurations(name, contents, Options::default(), err) else { return 1 };
    let mut status = 0;
    for (prefix, item) in &found {
        match check(item) {
            Ok(checked) => {
                let _ = write!(out, "{}:\n{}", prefix.trim_end_matches(": "), explain::explain(&checked.config, request));
            }
            Err(problem) => {
                let _ = writeln!(err, "{prefix}{problem}");
                status = 1;
            }
        }
    }
    status
}

/// `floodgate partition`: for each configuration of the file with partitions, the summary and
/// the partition of the key made of `parts`, computed by the module's own code.
fn partition(name: &str, contents: &[u8], parts: &[String], out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let Some(found) = configurations(name, contents, Options::default(), err) else { return 1 };
    let mut shown = 0;
    for (prefix, item) in &found {
        let config = match check(item) {
            Ok(checked) => checked.config,
            Err(problem) => {
                let _ = writeln!(err, "{prefix}{problem}");
                return 1;
            }
        };
        let Some(selection) = &config.cluster_selection else { continue };
        let (Some(settings), Some(partitioner)) = (&selection.partition, Partitioner::new(selection)) else { continue };
        shown += 1;
        let _ = writeln!(out, "{prefix}{}", settings.summary(selection.clusters.len()));
        if parts.is_empty() {
            continue;
        }
        if parts.len() != settings.key.len() {
            let key: Vec<String> = settings.key.iter().map(ToString::to_string).collect();
            let _ = writeln!(
                err,
                "{prefix}the partition's key has {} part(s) ([{}]); {} value(s) given",
                settings.key.len(),
                key.join(", "),
                parts.len()
            );
            return 2;
        }
        let mut values = parts.iter();
        let Some(hash) = partitioner.key_hash(|_| values.next().map(String::as_bytes)) else { continue };
        let confinement = partitioner.confine(hash);
        let names: Vec<&str> =
            confinement.members.iter().filter_map(|i| selection.clusters.get(*i)).map(|c| c.as_str()).collect();
        let _ = writeln!(out, "{prefix}key {parts:?}: {}", names.join(", "));
    }
    if shown == 0 {
        let _ = writeln!(err, "{name}: no configuration with cluster_selection.partition");
        return 1;
    }
    0
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn partition_prints_a_key_s_clusters() {
        let dir = std::env::temp_dir().join(format!("floodgate-cli-partition-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("p.json");
        std::fs::write(
            &file,
            r#"{"cluster_selection": {"clusters": ["a", "b", "c", "d", "e", "f", "g", "h"], "partition": {"key": [{"header": "x-client"}], "size": 2}}}"#,
        )
        .unwrap();
        let name = file.display().to_string();
        let run_with = |args: &[&str]| {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
            let status = run(&args, &mut out, &mut err);
            (status, String::from_utf8_lossy(&out).into_owned(), String::from_utf8_lossy(&err).into_owned())
        };
        let (status, out, _) = run_with(&["partition", &name, "client-7"]);
        assert_eq!(status, 0);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], format!("{name}: partitions of 2 of 8 clusters by [header:x-client] (28 possible: a key shares its whole partition with 1 key in 28), refuse when unavailable"));
        let clusters = lines[1].strip_prefix(&format!("{name}: key [\"client-7\"]: ")).unwrap();
        assert_eq!(clusters.split(", ").count(), 2, "{clusters}");
        assert_eq!(run_with(&["partition", &name, "client-7"]).1, out, "stable");
        let (status, _, err) = run_with(&["partition", &name, "a", "b"]);
        assert_eq!(status, 2);
        assert!(err.contains("1 part(s) ([header:x-client]); 2 value(s) given"), "{err}");
        std::fs::write(&file, r#"{"health": {"path": "/h"}}"#).unwrap();
        let (status, _, err) = run_with(&["partition", &name]);
        assert_eq!(status, 1);
        assert!(err.contains("no configuration with cluster_selection.partition"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn run_reports_and_exits() {
        let dir = std::env::temp_dir().join(format!("floodgate-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.json");
        let bad = dir.join("bad.json");
        std::fs::write(&good, r#"{"health": {"path": "/h"}}"#).unwrap();
        std::fs::write(
            &bad,
            r#"{"rate_limits": [{"name": "a", "key": ["path"], "limit": 0, "window": "1s"}]}"#,
        )
        .unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let args = |files: &[&std::path::Path]| -> Vec<String> {
            std::iter::once("validate".to_owned())
                .chain(files.iter().map(|f| f.display().to_string()))
                .collect()
        };
        assert_eq!(run(&args(&[&good]), &mut out, &mut err), 0);
        assert_eq!(
            String::from_utf8_lossy(&out),
            format!("{}: ok: no rate limits; health endpoint /h\n", good.display())
        );
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert_eq!(run(&args(&[&good, &bad]), &mut out, &mut err), 1);
        assert_eq!(
            String::from_utf8_lossy(&err),
            format!(
                "{}: rate_limits[0].limit: must be a positive integer of at most 4294967295, got 0\n",
                bad.display()
            )
        );
        let (mut out, mut err) = (Vec::new(), Vec::new());
        assert_eq!(run(&["validate".into()], &mut out, &mut err), 2);
        assert_eq!(run(&["schema".into()], &mut out, &mut err), 0);
        assert_eq!(run(&["partition".into()], &mut out, &mut err), 2);
        assert!(String::from_utf8_lossy(&out).contains("2020-12"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
