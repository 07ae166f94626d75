//! The product's docs kept true to the product:
//!
//! * README.md stays short (at most [`README_MAX_LINES`] lines), keeps the two commands (the demo
//!   and the one `.ci/run` runs) and shows where to install floodgate (Envoy, Docker Compose,
//!   Istio) among its first sections, with the Envoy and Istio versions of docs/operations.md;
//! * every relative link of README.md and docs/*.md reaches an existing file, and every `#anchor`
//!   a heading of its page;
//! * a code block marked `<!-- shipped: FILE -->` (or `FILE#key`, several allowed) holds what the
//!   shipped file holds (its comments aside), and a YAML block showing a manifest of envoy/ must
//!   carry that mark;
//! * docs/configuration.md lists every metric the module defines, and no other: against the
//!   table of `filter/src/pipeline/stats.rs` (each with the same type), and against the `/stats`
//!   of a real Envoy running the module with every feature configured; docs/observability.md's
//!   label table names every per-rule, per-class and per-cluster metric, and the `stats_tags`
//!   regexes of the shipped configurations match them;
//! * each field's default in the reference's tables is the schema's `default`, and each table
//!   lists its object's fields;
//! * the Docker Compose demo runs the demo's floodgate configuration, and its header lists the
//!   walkthrough's commands;
//! * the reference's contents link every section and object, and statements the product
//!   contradicts (limits per process only, a second overshoot bound) do not come back.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use floodgate::config::Config;
use floodgate_cli::{find_configurations, parse_documents, Options};
use floodgate_integration::*;

/// The README's length limit: what it does, how to try it and install it, the versions it
/// supports, one benchmark table and links; everything else has its page under docs/.
const README_MAX_LINES: usize = 200;

fn read(relative: &str) -> String {
    std::fs::read_to_string(workspace_root().join(relative)).unwrap_or_else(|e| panic!("read {relative}: {e}"))
}

fn markdown_files() -> Vec<String> {
    let mut files = vec!["README.md".to_owned()];
    let mut docs: Vec<String> = std::fs::read_dir(workspace_root().join("docs"))
        .expect("docs/")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// A fenced code block: its language, its text (dedented by its fence's indentation), the line
/// of its fence, and the `<!-- shipped: ... -->` mark on the line before it, if any.
struct Block {
    origin: String,
    lang: String,
    text: String,
    shipped: Option<String>,
}

fn blocks(file: &str) -> Vec<Block> {
    let text = read(file);
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let indent = line.len() - line.trim_start().len();
        if let Some(lang) = line.trim_start().strip_prefix("```") {
            let shipped = i
                .checked_sub(1)
                .and_then(|p| lines[p].trim().strip_prefix("<!-- shipped:"))
                .and_then(|m| m.strip_suffix("-->"))
                .map(|m| m.trim().to_owned());
            let start = i;
            let mut body = String::new();
            i += 1;
            while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                let l = lines[i];
                body.push_str(l.get(indent.min(l.len() - l.trim_start().len())..).unwrap_or(""));
                body.push('\n');
                i += 1;
            }
            out.push(Block {
                origin: format!("{file}:{}", start + 1),
                lang: lang.trim().to_owned(),
                text: body,
                shipped,
            });
        }
        i += 1;
    }
    out
}

/// The text of a Markdown page outside its code blocks.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// The headings (`#` lines outside code blocks) of a Markdown page.
fn headings(text: &str) -> Vec<(usize, String)> {
    prose(text)
        .lines()
        .filter_map(|l| {
            let level = l.chars().take_while(|c| *c == '#').count();
            (level > 0 && l[level..].starts_with(' ')).then(|| (level, l[level..].trim().to_owned()))
        })
        .collect()
}

/// The anchors GitHub gives a page's headings, in order with their level and text: lower case,
/// punctuation dropped, spaces as `-`, a repeated one suffixed `-1`, `-2`, ...
fn heading_anchors(text: &str) -> Vec<(usize, String, String)> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = Vec::new();
    for (level, heading) in headings(text) {
        let slug: String = heading
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        let anchor = if *n == 0 { slug.clone() } else { format!("{slug}-{n}") };
        *n += 1;
        out.push((level, heading, anchor));
    }
    out
}

fn anchors(text: &str) -> BTreeSet<String> {
    heading_anchors(text).into_iter().map(|(_, _, a)| a).collect()
}

/// The `[text](target)` links of a page's prose, inline code left out.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(text).lines() {
        // Drop inline code spans.
        let mut clean = String::new();
        let mut code = false;
        for c in line.chars() {
            if c == '`' {
                code = !code;
            } else if !code {
                clean.push(c);
            }
        }
        let mut rest = clean.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_owned());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn the_readme_is_short_keeps_its_two_commands_and_shows_where_to_install_first() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    println!("README.md: {lines} lines (at most {README_MAX_LINES})");
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move detail to docs/"
    );

    // The two commands, in one sh block; .ci/run runs the test command.
    let commands = blocks("README.md")
        .into_iter()
        .find(|b| b.lang == "sh" && b.text.contains("./demo.sh"))
        .expect("README.md: a sh block with ./demo.sh");
    assert!(commands.text.lines().any(|l| l.starts_with("./demo.sh")), "{}", commands.text);
    assert!(commands.text.lines().any(|l| l.starts_with("./test.sh")), "{}", commands.text);
    assert!(read(".ci/run").lines().any(|l| l.trim() == "exec ./test.sh"), ".ci/run does not run ./test.sh");

    // Installing: among the first four sections, from the release's artifacts, for Envoy,
    // Docker Compose and Istio.
    let sections: Vec<String> = headings(&readme).into_iter().filter(|(l, _)| *l == 2).map(|(_, h)| h).collect();
    let install = sections.iter().position(|h| h.starts_with("Install")).expect("README.md: no Install section");
    assert!(install < 4, "README.md: the install section is section {} of {sections:?}", install + 1);
    let body = &readme[readme.find("## Install").expect("install")..];
    let body = &body[..body[3..].find("\n## ").map_or(body.len(), |e| e + 3)];
    let release = read("scripts/release.sh");
    let version = read("Cargo.toml")
        .lines()
        .find_map(|l| l.strip_prefix("version = \"").and_then(|v| v.strip_suffix('"')).map(str::to_owned))
        .expect("the workspace version in Cargo.toml");
    for (what, artifact) in [
        ("Envoy", "floodgate-<version>.wasm"),
        ("Docker Compose", "floodgate-<version>.wasm"),
        ("Istio", "floodgate-<version>-wasmplugin-image.tar"),
        ("validate", "floodgate-<version>-x86_64-unknown-linux-musl"),
    ] {
        assert!(release.contains(artifact), "scripts/release.sh no longer builds {artifact}");
        let named = artifact.replace("<version>", &version);
        assert!(body.contains(what), "README.md's install section says nothing of {what}");
        assert!(body.contains(&named), "README.md's install section does not use the release's {named} ({what})");
    }
}

#[test]
fn the_readme_s_supported_versions_are_those_of_docs_operations() {
    // docs/operations.md's table: | Envoy minor | tested with | status | Istio releases that embed it |
    let operations = read("docs/operations.md");
    let rows: Vec<Vec<String>> = operations
        .lines()
        .skip_while(|l| !l.starts_with("| Envoy minor |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(cells)
        .collect();
    assert!(rows.len() >= 2, "docs/operations.md: no compatibility table");
    let minors: Vec<&str> = rows.iter().map(|r| r[0].as_str()).collect();
    let readme = read("README.md").replace('\n', " ");
    let range = format!("Envoy {} to {}", minors[0], minors[minors.len() - 1]);
    assert!(readme.contains(&range), "README.md does not say \"{range}\"");
    let istio: Vec<(String, &str)> =
        rows.iter().filter_map(|r| r[3].strip_prefix("Istio ").map(|i| (i.to_owned(), r[0].as_str()))).collect();
    assert!(!istio.is_empty());
    let releases = istio.iter().map(|(i, _)| i.as_str()).collect::<Vec<_>>();
    let envoys = istio.iter().map(|(_, e)| *e).collect::<Vec<_>>();
    let said = |list: &[&str]| match list {
        [one] => (*one).to_owned(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
        [] => String::new(),
    };
    let claim = format!("Istio {} embed Envoy {}", said(&releases), said(&envoys));
    assert!(readme.contains(&claim), "README.md does not say \"{claim}\" (docs/operations.md's table)");
}

#[test]
fn every_link_of_the_readme_and_the_docs_resolves() {
    let root = workspace_root();
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = read(&file);
        let dir = Path::new(&file).parent().unwrap_or(Path::new("")).to_path_buf();
        for link in links(&text) {
            if link.starts_with("http://") || link.starts_with("https://") || link.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = link.split_once('#').map_or((link.as_str(), None), |(p, a)| (p, Some(a)));
            let target: PathBuf = if path.is_empty() { PathBuf::from(&file) } else { normalize(&dir.join(path)) };
            if !root.join(&target).exists() {
                problems.push(format!("{file}: ({link}): {} does not exist", target.display()));
                continue;
            }
            if let Some(anchor) = anchor {
                let page = std::fs::read_to_string(root.join(&target)).unwrap_or_default();
                if !anchors(&page).contains(anchor) {
                    problems
                        .push(format!("{file}: ({link}): no heading of {} has the anchor #{anchor}", target.display()));
                }
            }
        }
    }
    println!("{checked} relative links checked in README.md and docs/");
    assert!(checked > 100, "only {checked} links found: is the link parser broken?");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// A YAML or JSON file's documents with its comments gone (as values).
fn documents(text: &str) -> Vec<Value> {
    parse_documents(text).unwrap_or_else(|e| panic!("{e}:\n{text}")).into_iter().filter(|d| !d.is_null()).collect()
}

#[test]
fn every_block_that_shows_a_shipped_file_holds_what_the_file_holds() {
    let mut marked = 0;
    let mut problems = Vec::new();
    // Manifests of envoy/ by (kind, metadata.name): a block showing one must be marked.
    let mut manifests: BTreeMap<(String, String), String> = BTreeMap::new();
    for entry in std::fs::read_dir(workspace_root().join("envoy/istio")).expect("envoy/istio").flatten() {
        let name = format!("envoy/istio/{}", entry.file_name().to_string_lossy());
        for doc in documents(&read(&name)) {
            if let (Some(kind), Some(meta)) = (doc["kind"].as_str(), doc["metadata"]["name"].as_str()) {
                manifests.insert((kind.to_owned(), meta.to_owned()), name.clone());
            }
        }
    }
    for file in markdown_files() {
        for block in blocks(&file) {
            if let Some(mark) = &block.shipped {
                marked += 1;
                let shown = documents(&block.text);
                for target in mark.split_whitespace() {
                    let (path, key) = target.split_once('#').map_or((target, None), |(p, k)| (p, Some(k)));
                    let shipped = documents(&read(path));
                    let expected: Vec<Value> = match key {
                        None => shipped,
                        Some(key) => shipped.iter().map(|d| json!({ key: d[key].clone() })).collect(),
                    };
                    if shown != expected {
                        problems.push(format!(
                            "{}: the block differs from {target}:\nblock: {}\nfile:  {}",
                            block.origin,
                            serde_json::to_string(&shown).unwrap_or_default(),
                            serde_json::to_string(&expected).unwrap_or_default()
                        ));
                    }
                }
            } else if matches!(block.lang.as_str(), "yaml" | "yml") {
                for doc in parse_documents(&block.text).unwrap_or_default() {
                    if let (Some(kind), Some(meta)) = (doc["kind"].as_str(), doc["metadata"]["name"].as_str()) {
                        if let Some(file) = manifests.get(&(kind.to_owned(), meta.to_owned())) {
                            problems.push(format!(
                                "{}: shows {kind} {meta} of {file} without <!-- shipped: {file} --> on the line before",
                                block.origin
                            ));
                        }
                    }
                }
            }
        }
    }
    println!("{marked} blocks marked as shipped files, each equal to its file");
    assert!(marked >= 3, "only {marked} marked blocks: docs/istio.md and docs/observability.md have some");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The metric names of a Markdown or rustdoc table whose first column is `<prefix>.…`, with
/// the prefix as `floodgate`.
fn documented_metrics(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.trim_start_matches("//!").trim().strip_prefix("| `<prefix>."))
        .filter_map(|rest| rest.split_once('`').map(|(name, _)| format!("floodgate.{name}")))
        .collect()
}

#[test]
fn the_reference_and_the_module_source_list_the_same_metrics() {
    let reference = documented_metrics(&read("docs/configuration.md"));
    let source = documented_metrics(&read("filter/src/pipeline/stats.rs"));
    println!("{} metrics in docs/configuration.md, {} in filter/src/pipeline/stats.rs", reference.len(), source.len());
    assert!(reference.len() > 50, "{reference:?}");
    let missing: Vec<_> = source.difference(&reference).collect();
    let extra: Vec<_> = reference.difference(&source).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/configuration.md lacks {missing:?} and has {extra:?} beyond stats.rs"
    );
    // Every name the source builds is a listed metric: each stage's entries (`field: Kind
    // "name"` in its `metric_ids!` block), under the names its `define_named` call gives them
    // (`Stage::define_named(metrics, &|name| format!("{prefix}.…{name}"…)`).
    let listed: BTreeSet<String> = reference
        .iter()
        .map(|m| {
            let mut out = String::new();
            let mut skip = false;
            for c in m.trim_start_matches("floodgate.").chars() {
                match c {
                    '<' => {
                        skip = true;
                        out.push_str("{}");
                    }
                    '>' => skip = false,
                    _ if !skip => out.push(c),
                    _ => {}
                }
            }
            out
        })
        .collect();
    let code = read("filter/src/pipeline/stats.rs");
    let code = &code[code.find("\nuse ").expect("stats.rs: code after its doc")..];
    let code = code.split("#[cfg(test)]").next().unwrap_or(code);
    let mut entries: Vec<(String, String)> = Vec::new(); // (stage, last segments)
    let mut templates: Vec<(String, String)> = Vec::new(); // (stage, name with `{name}`)
    let mut stage = String::new();
    for line in code.lines() {
        if let Some(rest) = line.trim().strip_prefix("pub struct ") {
            stage = rest.split(|c: char| !c.is_alphanumeric() && c != '_').next().unwrap_or("").to_owned();
        }
        if let Some((field, rest)) = line.trim().split_once(": ") {
            let is_field = !field.is_empty() && field.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            for kind in ["Counter \"", "Gauge \"", "Histogram \""] {
                if let (true, Some(name)) = (is_field, rest.strip_prefix(kind).and_then(|r| r.split_once('"'))) {
                    entries.push((stage.clone(), name.0.to_owned()));
                }
            }
        }
        if let Some((before, after)) = line.split_once("::define_named(metrics, &|name| format!(\"") {
            let name = before.rsplit(|c: char| !c.is_alphanumeric() && c != '_').next().unwrap_or("");
            if let Some((template, _)) = after.split_once('"') {
                templates.push((name.to_owned(), template.trim_start_matches("{prefix}.").to_owned()));
            }
        }
    }
    println!("{} metric entries in {} stages of stats.rs", entries.len(), templates.len());
    assert!(entries.len() > 50 && templates.len() > 5, "stats.rs: {entries:?} {templates:?}");
    let mut built = BTreeSet::new();
    for (stage, name) in &entries {
        let named: Vec<_> = templates.iter().filter(|(s, _)| s == stage).collect();
        assert!(!named.is_empty(), "stats.rs: {stage} defines {name}, but no define_named call names it");
        built.extend(named.iter().map(|(_, template)| template.replace("{name}", name)));
    }
    println!("{} metric names built in stats.rs", built.len());
    let unlisted: Vec<_> = built.difference(&listed).collect();
    let unbuilt: Vec<_> = listed.difference(&built).collect();
    assert!(unlisted.is_empty(), "stats.rs builds metrics docs/configuration.md does not list: {unlisted:?}");
    assert!(unbuilt.is_empty(), "docs/configuration.md lists metrics stats.rs does not build: {unbuilt:?}");
}

/// The type column (`counter`, `gauge`, `histogram`) of a Markdown or rustdoc metric table, by
/// metric name as [`documented_metrics`] gives it.
fn documented_types(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.trim_start_matches("//!").trim().strip_prefix("| `<prefix>."))
        .filter_map(|rest| {
            let (name, rest) = rest.split_once("` | ")?;
            let kind = rest.split(' ').next()?;
            Some((format!("floodgate.{name}"), kind.to_owned()))
        })
        .collect()
}

#[test]
fn the_reference_and_the_module_source_give_each_metric_the_same_type() {
    let reference = documented_types(&read("docs/configuration.md"));
    let source = documented_types(&read("filter/src/pipeline/stats.rs"));
    assert!(reference.len() > 50, "{reference:?}");
    let differ: Vec<_> = reference.iter().filter(|(name, kind)| source.get(*name) != Some(kind)).collect();
    assert!(differ.is_empty(), "docs/configuration.md's types that filter/src/pipeline/stats.rs does not give: {differ:?}");
    assert_eq!(reference.len(), source.len(), "the same metrics (the_reference_and_the_module_source_list_the_same_metrics)");
}

/// A configuration with every feature that defines metrics: the rule `r` (and `tb`, a token
/// bucket that delays, `g`, and `t`, settled from the response body: the module that reads bodies
/// runs it), the classes `critical`, `normal`, `low` (with a queue), the clusters `a` and `b`.
fn every_feature() -> Value {
    json!({
        "rate_limits": [
            {"name": "r", "key": [{"header": "x-k"}], "limit": 100, "window": "1m", "scope": "global", "consistency": "leased"},
            {"name": "tb", "key": [{"header": "x-k"}], "limit": 100, "window": "1m", "algorithm": "token_bucket", "burst": 10, "max_delay": "1s"},
            {"name": "g", "key": [{"header": "x-k"}], "limit": 100, "window": "1m", "scope": "global"},
            {"name": "t", "key": [{"header": "x-k"}], "limit": 1000, "window": "1m",
             "cost": {"from": "response_body", "path": "usage.total_tokens", "estimate": {"default": 100, "max": 500}}}
        ],
        "global": {"cluster": "floodgate-sync", "sync_interval": "1s"},
        "load_shedding": {"max_active_requests": 100, "max_loop_lag": "1s",
                          "queue": {"max_queued": 10, "max_wait": "1s"},
                          "flow": {"key": [{"header": "x-k"}]},
                          "per_key": {"key": [{"header": "x-k"}], "max_active_requests": 5}},
        "cluster_selection": {"route_header": "x-floodgate-cluster", "clusters": ["a", "b"],
                              "partition": {"key": [{"header": "x-k"}], "size": 1}},
        "health": {"path": "/floodgate/health"}
    })
}

/// A `/stats` name of the module, with its rule, class or cluster as in the reference.
fn generalized(name: &str) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    let mut out: Vec<String> = parts.iter().map(|p| (*p).to_owned()).collect();
    match parts.as_slice() {
        ["floodgate", "rate_limit", rule, _] if ["r", "tb", "g", "t"].contains(rule) => out[2] = "<rule>".into(),
        ["floodgate", "load_shedding", class, _] if ["critical", "normal", "low"].contains(class) => {
            out[2] = "<class>".into()
        }
        ["floodgate", "cluster", cluster, _] if ["a", "b"].contains(cluster) => out[2] = "<cluster>".into(),
        _ => {}
    }
    out.join(".")
}

#[test]
fn envoy_with_every_feature_shows_exactly_the_metrics_the_reference_lists() {
    let upstream = Upstream::start();
    let unused = free_port_addr();
    let config = every_feature();
    Config::parse(config.to_string().as_bytes()).unwrap_or_else(|e| panic!("every_feature(): {e}"));
    let envoy = Envoy::builder(config)
        .module(llm_wasm_module())
        .upstream(&upstream)
        .http2_cluster("floodgate-sync", &[unused])
        .cluster("a", &[upstream.addr()])
        .cluster("b", &[upstream.addr()])
        .route_by_header("x-floodgate-cluster")
        .start();
    // Metrics are defined at configuration; give the workers a moment to configure.
    std::thread::sleep(Duration::from_millis(500));
    let (status, page) = envoy.admin_get("/stats");
    assert_eq!(status, 200);
    let shown: BTreeSet<String> = page
        .lines()
        .filter_map(|l| l.split_once(": ").map(|(n, _)| n))
        .filter_map(|n| n.strip_prefix("wasmcustom."))
        .map(generalized)
        .collect();
    let reference = documented_metrics(&read("docs/configuration.md"));
    println!(
        "{} metric names in /stats (rule, class and cluster generalized), {} in the reference",
        shown.len(),
        reference.len()
    );
    let undocumented: Vec<_> = shown.difference(&reference).collect();
    let unseen: Vec<_> = reference.difference(&shown).collect();
    assert!(undocumented.is_empty(), "Envoy shows metrics docs/configuration.md does not list: {undocumented:?}");
    assert!(
        unseen.is_empty(),
        "docs/configuration.md lists metrics Envoy does not show with every feature on: {unseen:?}"
    );
}

/// Free loopback address nothing listens on.
fn free_port_addr() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr")
}

#[test]
fn the_label_table_and_the_stats_tags_cover_every_per_rule_class_and_cluster_metric() {
    let reference = documented_metrics(&read("docs/configuration.md"));
    let suffixes = |part: &str| -> BTreeSet<String> {
        reference.iter().filter_map(|m| m.split_once(&format!(".{part}.")).map(|(_, s)| s.to_owned())).collect()
    };
    let observability = read("docs/observability.md");
    let stats_tags: Vec<Value> = ["envoy/demo.yaml", "envoy/compose-envoy.yaml"]
        .iter()
        .flat_map(|f| documents(&read(f)))
        .filter_map(|d| d["stats_config"]["stats_tags"].as_array().cloned())
        .flatten()
        .collect();
    assert!(stats_tags.len() >= 6, "{stats_tags:?}");
    for (part, prom, tag) in [
        ("<rule>", "floodgate_rate_limit_", "rule"),
        ("<class>", "floodgate_load_shedding_", "class"),
        ("<cluster>", "floodgate_cluster_", "upstream_cluster"),
    ] {
        let expected = suffixes(part);
        assert!(!expected.is_empty(), "{part}");
        // The label table's first row for the family: `..._<part>_{a,b,...}` (and `..._x` gauges).
        let row = observability
            .lines()
            .find(|l| l.starts_with(&format!("| `{prom}{}_", part)))
            .unwrap_or_else(|| panic!("docs/observability.md: no row for {prom}{part}_..."));
        let first = row.split(" | ").next().unwrap_or("");
        let mut listed = BTreeSet::new();
        for group in first.split('{').skip(1) {
            if let Some((names, _)) = group.split_once('}') {
                listed.extend(names.split(',').map(|n| n.trim().to_owned()));
            }
        }
        for gauge in first.split("`..._").skip(1) {
            if let Some((name, _)) = gauge.split_once('`') {
                if !name.starts_with('{') {
                    listed.insert(name.to_owned());
                }
            }
        }
        assert_eq!(listed, expected, "docs/observability.md's {part} row against docs/configuration.md");
        for entry in stats_tags.iter().filter(|t| t["tag_name"] == tag) {
            let regex = entry["regex"].as_str().expect("regex");
            let alternatives: BTreeSet<String> = regex
                .rsplit_once("(?:")
                .and_then(|(_, r)| r.split_once(')'))
                .map(|(alts, _)| alts.split('|').map(str::to_owned).collect())
                .unwrap_or_default();
            assert_eq!(alternatives, expected, "the stats_tags regex for {tag} against docs/configuration.md");
        }
    }
    // Every other metric is named in the "unchanged (no label)" row.
    let unchanged = observability.lines().find(|l| l.ends_with("| unchanged (no label) |")).expect("the unchanged row");
    for metric in reference.iter().filter(|m| !m.contains('<')) {
        let prom = metric.replace(['.', '-'], "_");
        let covered = unchanged.split('`').skip(1).step_by(2).any(|pattern| pattern_covers(pattern, &prom));
        assert!(covered, "docs/observability.md's unchanged row does not cover {prom}");
    }
}

/// Whether `pattern` (`a_{b,c}`, `a_*`, or a name) covers the Prometheus name `name`.
fn pattern_covers(pattern: &str, name: &str) -> bool {
    if let Some(prefix) = pattern.strip_suffix('*') {
        return name.starts_with(prefix);
    }
    if let Some((head, rest)) = pattern.split_once('{') {
        if let Some((alts, tail)) = rest.split_once('}') {
            return alts.split(',').any(|a| name == format!("{head}{a}{tail}"));
        }
    }
    name == pattern
}

/// The reference's field tables (`| field | type | default | meaning |`) by the schema object
/// they describe: the heading above each table names it.
const TABLES: &[(&str, &str)] = &[
    ("Top level", ""),
    ("`rate_limits`", "rateLimitRule"),
    ("Costs (`cost`)", "cost"),
    ("Estimates (`cost.estimate`)", "estimate"),
    ("Weighted sums (`cost.sum`, `cost.estimate.sum`)", "sumTerm"),
    ("`load_shedding`", "loadShedding"),
    ("`load_shedding.queue`", "queue"),
    ("`load_shedding.flow`", "flow"),
    ("`load_shedding.per_key`", "perKey"),
    ("`cluster_selection`", "clusterSelection"),
    ("`cluster_selection.partition`", "partition"),
    ("`cluster_selection.concurrency_limit`", "concurrencyLimit"),
    ("`health`", "health"),
    ("`watchdog`", "watchdog"),
    ("`global`", "global"),
    ("`grpc`", "grpc"),
];

/// Splits a table row on its unescaped `|`.
fn cells(row: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cell = String::new();
    let mut chars = row.trim().trim_start_matches('|').chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cell.push('|');
                chars.next();
            }
            '|' => out.push(std::mem::take(&mut cell).trim().to_owned()),
            _ => cell.push(c),
        }
    }
    out
}

/// The scalar leaves of a JSON value, as text.
fn leaves(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Array(a) => a.iter().for_each(|v| leaves(v, out)),
        Value::Object(o) => o.values().for_each(|v| leaves(v, out)),
        Value::String(s) => out.push(s.clone()),
        other => out.push(other.to_string()),
    }
}

#[test]
fn the_reference_tables_give_every_field_and_the_schema_s_defaults() {
    let schema: Value = serde_json::from_str(floodgate_cli::SCHEMA).expect("the schema is JSON");
    let reference = read("docs/configuration.md");
    let mut tables: BTreeMap<String, Vec<Vec<String>>> = BTreeMap::new();
    let mut heading = String::new();
    let mut in_table = false;
    for line in prose(&reference).lines() {
        if let Some(h) = line.strip_prefix("### ").or_else(|| line.strip_prefix("#### ")) {
            heading = h.trim().to_owned();
            in_table = false;
        } else if line.starts_with("| field | type | default | meaning |") {
            assert!(
                TABLES.iter().any(|(h, _)| *h == heading),
                "docs/configuration.md: a field table under \"{heading}\", which this test does not know"
            );
            in_table = true;
        } else if in_table && line.starts_with("| `") && !cells(line)[0].contains("[].") {
            // (`classes[].name` rows describe the items of a list: another object.)
            tables.entry(heading.clone()).or_default().push(cells(line));
        } else if in_table && !line.starts_with('|') {
            in_table = false;
        }
    }
    let mut problems = Vec::new();
    let mut compared = 0;
    for (heading, def) in TABLES {
        let object = if def.is_empty() { &schema } else { &schema["$defs"][*def] };
        let properties = object["properties"].as_object().unwrap_or_else(|| panic!("$defs.{def}"));
        let required: BTreeSet<&str> =
            object["required"].as_array().map_or_else(BTreeSet::new, |r| r.iter().filter_map(Value::as_str).collect());
        let rows =
            tables.get(*heading).unwrap_or_else(|| panic!("docs/configuration.md: no field table under \"{heading}\""));
        let listed: BTreeSet<String> = rows.iter().map(|r| r[0].trim_matches('`').to_owned()).collect();
        let in_schema: BTreeSet<String> = properties.keys().cloned().collect();
        if listed != in_schema {
            problems.push(format!("\"{heading}\": the table lists {listed:?}, the schema ({def}) has {in_schema:?}"));
        }
        for row in rows {
            let name = row[0].trim_matches('`');
            let Some(property) = properties.get(name) else { continue };
            let cell = row.get(2).map(String::as_str).unwrap_or("");
            let default = property.get("default");
            compared += 1;
            let literal = cell
                .strip_prefix('`')
                .and_then(|c| c.strip_suffix('`'))
                .filter(|c| !c.contains('`'))
                .and_then(|c| serde_json::from_str::<Value>(c).ok());
            let ok = if cell == "required" {
                required.contains(name)
            } else if cell.starts_with("none") {
                default.is_none_or(Value::is_null) && !required.contains(name)
            } else if cell == "all defaults" {
                default.is_none_or(|d| d == &json!({}))
            } else if let Some(literal) = literal {
                default == Some(&literal)
            } else {
                // Described in words: the schema gives no single value (none, or `null` when the
                // words name no number), or each of its values appears in the words.
                match default {
                    None => true,
                    Some(Value::Null) => !cell.chars().any(|c| c.is_ascii_digit()),
                    Some(value) => {
                        let mut values = Vec::new();
                        leaves(value, &mut values);
                        values.iter().all(|v| cell.contains(v.as_str()))
                    }
                }
            };
            if !ok {
                problems.push(format!(
                    "\"{heading}\" `{name}`: the reference's default is {cell:?}, the schema's {} (required: {})",
                    default.map_or("none".to_owned(), Value::to_string),
                    required.contains(name)
                ));
            }
        }
    }
    println!("{compared} defaults compared between docs/configuration.md and the schema, in {} tables", TABLES.len());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_compose_demo_runs_the_demo_s_configuration_and_lists_its_walkthrough() {
    let configs = |file: &str| -> Vec<Config> {
        find_configurations(file, read(file).as_bytes(), Options::default())
            .unwrap_or_else(|e| panic!("{file}: {e}"))
            .into_iter()
            .map(|f| {
                let bytes = f.bytes.unwrap_or_else(|e| panic!("{file} {}: {e}", f.location));
                Config::parse(&bytes).unwrap_or_else(|e| panic!("{file} {}: {e}", f.location))
            })
            .collect()
    };
    let demo = configs("envoy/demo.yaml");
    let compose = configs("envoy/compose-envoy.yaml");
    assert_eq!(demo.len(), 2, "envoy/demo.yaml: two floodgate filters");
    assert_eq!(demo, compose, "envoy/compose-envoy.yaml's floodgate configurations differ from envoy/demo.yaml's");

    // The walkthrough's commands, each in the compose file's header.
    let guide = read("docs/getting-started.md");
    let header: String = read("envoy/docker-compose.yaml")
        .lines()
        .take_while(|l| l.starts_with('#'))
        .map(|l| format!("{}\n", l.trim_start_matches('#').trim()))
        .collect();
    let commands: Vec<&str> = prose_console_commands(&guide);
    assert!(commands.len() >= 9, "{commands:?}");
    for command in commands {
        assert!(
            header.lines().any(|l| l == command),
            "envoy/docker-compose.yaml's header lacks the walkthrough's `{command}`"
        );
    }
}

/// The `$ ` commands of a page's ```console blocks.
fn prose_console_commands(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut console = false;
    for line in text.lines() {
        if line.starts_with("```") {
            console = !console && line.trim() == "```console";
            continue;
        }
        if console {
            if let Some(command) = line.strip_prefix("$ ") {
                out.push(command);
            }
        }
    }
    out
}

#[test]
fn the_reference_s_contents_name_every_section_and_every_object() {
    let reference = read("docs/configuration.md");
    let contents = &reference[..reference.find("\n## ").expect("a section")];
    let linked: BTreeSet<String> =
        links(contents).into_iter().filter_map(|l| l.strip_prefix('#').map(str::to_owned)).collect();
    // Every `##` section, and every `###` heading under "Fields" (the objects of the configuration).
    let mut missing = Vec::new();
    let mut in_fields = false;
    for (level, heading, anchor) in heading_anchors(&reference) {
        if level == 2 {
            in_fields = heading == "Fields";
        }
        if (level == 2 || (level == 3 && in_fields)) && !linked.contains(&anchor) {
            missing.push(heading);
        }
    }
    assert!(missing.is_empty(), "docs/configuration.md's contents do not link {missing:?}");
}

/// Statements the docs once made that the product contradicts; each may not come back.
const RETIRED: &[(&str, &str)] = &[
    ("divide by the replica count", "a rule in global scope holds one quota across the fleet"),
    ("Limits are per Envoy process", "a rule in global scope holds one quota across the fleet"),
    ("rate × 3 × sync_interval", "the overshoot is stated once, in docs/global.md"),
];

#[test]
fn statements_the_product_contradicts_do_not_come_back() {
    let mut found = Vec::new();
    for file in markdown_files() {
        let text = read(&file);
        for (phrase, why) in RETIRED {
            if text.contains(phrase) {
                found.push(format!("{file}: \"{phrase}\" ({why})"));
            }
        }
    }
    // The overshoot bound of batched global quotas: stated in docs/global.md, linked elsewhere
    // (design.md derives it; benchmarks.md's method prints it beside each run, linking it).
    let global = read("docs/global.md");
    assert!(global.contains("**The bound, in batched consistency**"), "docs/global.md no longer states the bound");
    for file in markdown_files()
        .iter()
        .filter(|f| !["docs/global.md", "docs/design.md", "docs/benchmarks.md"].contains(&f.as_str()))
    {
        let text = prose(&read(file));
        if text.contains("(P − 1)") || text.contains("(P - 1)") {
            found.push(format!("{file}: restates the overshoot bound; link docs/global.md instead"));
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}
