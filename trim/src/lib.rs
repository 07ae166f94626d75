//! The last step of building the floodgate module (`wasm-build.sh` runs it): removes the exports
//! of proxy-wasm callbacks that floodgate does not implement, so that Envoy never calls them.
//!
//! The proxy-wasm Rust SDK exports every callback of the ABI from its dispatcher, whether the
//! filter implements it or not, and the host calls each one the module exports: Envoy
//! (proxy-wasm-cpp-host, `ContextBase::onResponseBody` and its siblings) skips a callback only
//! when the module has no export of that name. An unimplemented callback then costs a call into
//! the VM that does nothing: for `proxy_on_response_body`, one per data frame of every response
//! (about 4 000 instructions per request of a plain `GET`, measured in `docs/benchmarks.md`; more
//! for a response streamed in many frames). Removing the export removes the call; nothing else
//! in the module changes (the function stays, unreferenced, and every other section is copied
//! byte for byte).
//!
//! Only callbacks the host calls per request or per frame are listed ([`UNUSED_CALLBACKS`]): the
//! others (network filters, gRPC calls, queues) are never called for an HTTP filter that does
//! not use them, so removing them would gain nothing.

use wasm_encoder::{ExportKind, ExportSection, Module, RawSection};
use wasmparser::{ExternalKind, Parser, Payload, Validator};

/// The callbacks floodgate's HTTP filter does not implement and the host would call for every
/// request: the export goes, the host skips the call. A callback in this list must stay
/// unimplemented in `filter/src/host` (the host could never call it).
pub const UNUSED_CALLBACKS: &[&str] = &["proxy_on_response_body"];

/// An export every proxy-wasm module built with the Rust SDK has: a module without it is not
/// one, and is refused rather than rewritten.
const PROXY_WASM_MARKER: &str = "proxy_on_context_create";

/// A module with some exports removed.
#[derive(Debug)]
pub struct Trimmed {
    /// The rewritten module.
    pub module: Vec<u8>,
    /// The exports removed (those of the list the module still had).
    pub removed: Vec<String>,
}

/// Names the module exports, in order.
///
/// # Errors
/// The module cannot be parsed.
pub fn exports(module: &[u8]) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    for payload in Parser::new(0).parse_all(module) {
        if let Payload::ExportSection(reader) = payload.map_err(|e| format!("not a WebAssembly module: {e}"))? {
            for export in reader {
                names.push(export.map_err(|e| format!("export section: {e}"))?.name.to_string());
            }
        }
    }
    Ok(names)
}

/// `module` without the exports named in `remove` (those it does not have are ignored: trimming
/// a trimmed module changes nothing).
///
/// # Errors
/// The module cannot be parsed, or is not a proxy-wasm module (it does not export
/// `proxy_on_context_create`).
pub fn trim(module: &[u8], remove: &[&str]) -> Result<Trimmed, String> {
    let mut out = Module::new();
    let mut removed = Vec::new();
    let mut proxy_wasm = false;
    for payload in Parser::new(0).parse_all(module) {
        let payload = payload.map_err(|e| format!("not a WebAssembly module: {e}"))?;
        if let Payload::ExportSection(reader) = &payload {
            let mut exports = ExportSection::new();
            for export in reader.clone() {
                let export = export.map_err(|e| format!("export section: {e}"))?;
                proxy_wasm |= export.name == PROXY_WASM_MARKER;
                if remove.contains(&export.name) {
                    removed.push(export.name.to_string());
                    continue;
                }
                exports.export(export.name, export_kind(export.kind), export.index);
            }
            out.section(&exports);
        } else if let Some((id, range)) = payload.as_section() {
            // Every other section as it was (the code section whole: its entries, which the
            // parser also yields one by one, are not sections of their own).
            let data = module.get(range).ok_or("a section runs past the end of the module")?;
            out.section(&RawSection { id, data });
        }
    }
    if !proxy_wasm {
        return Err(format!("not a proxy-wasm module: it does not export {PROXY_WASM_MARKER}"));
    }
    let module = out.finish();
    // Never hand Envoy a module it would refuse.
    Validator::new().validate_all(&module).map_err(|e| format!("the trimmed module is not valid: {e}"))?;
    Ok(Trimmed { module, removed })
}

fn export_kind(kind: ExternalKind) -> ExportKind {
    match kind {
        ExternalKind::Func | ExternalKind::FuncExact => ExportKind::Func,
        ExternalKind::Table => ExportKind::Table,
        ExternalKind::Memory => ExportKind::Memory,
        ExternalKind::Global => ExportKind::Global,
        ExternalKind::Tag => ExportKind::Tag,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use wasm_encoder::{CodeSection, CustomSection, Function, FunctionSection, Instruction, TypeSection};

    /// A module of three functions, all exported, and a custom section.
    fn module(names: &[&str]) -> Vec<u8> {
        let mut m = Module::new();
        let mut types = TypeSection::new();
        types.ty().function([], []);
        m.section(&types);
        let mut functions = FunctionSection::new();
        let mut exports = ExportSection::new();
        let mut code = CodeSection::new();
        for (index, name) in (0u32..).zip(names) {
            functions.function(0);
            exports.export(name, ExportKind::Func, index);
            let mut body = Function::new([]);
            body.instruction(&Instruction::End);
            code.function(&body);
        }
        m.section(&functions);
        m.section(&exports);
        m.section(&code);
        m.section(&CustomSection { name: "producers".into(), data: b"floodgate test".as_slice().into() });
        m.finish()
    }

    #[test]
    fn removes_the_listed_exports_and_keeps_everything_else() {
        let before = module(&["proxy_on_context_create", "proxy_on_response_body", "proxy_on_log"]);
        let trimmed = trim(&before, UNUSED_CALLBACKS).unwrap();
        assert_eq!(trimmed.removed, ["proxy_on_response_body"]);
        assert_eq!(exports(&trimmed.module).unwrap(), ["proxy_on_context_create", "proxy_on_log"]);
        // Still a valid module (trim validates it), with its three functions and its custom
        // section.
        Validator::new().validate_all(&trimmed.module).unwrap();
        let customs: Vec<_> = Parser::new(0)
            .parse_all(&trimmed.module)
            .filter_map(|p| match p.unwrap() {
                Payload::CustomSection(c) => Some((c.name().to_string(), c.data().to_vec())),
                _ => None,
            })
            .collect();
        assert_eq!(customs, [("producers".to_string(), b"floodgate test".to_vec())]);
        let functions = Parser::new(0).parse_all(&trimmed.module).filter(|p| matches!(p, Ok(Payload::CodeSectionEntry(_)))).count();
        assert_eq!(functions, 3);
    }

    #[test]
    fn trimming_twice_changes_nothing_more() {
        let once = trim(&module(&["proxy_on_context_create", "proxy_on_response_body"]), UNUSED_CALLBACKS).unwrap();
        let twice = trim(&once.module, UNUSED_CALLBACKS).unwrap();
        assert!(twice.removed.is_empty());
        assert_eq!(twice.module, once.module);
    }

    #[test]
    fn refuses_what_is_not_a_proxy_wasm_module() {
        assert!(trim(&module(&["main"]), UNUSED_CALLBACKS).unwrap_err().contains("not a proxy-wasm module"));
        assert!(trim(b"\0asm\x01\0\0\0\xff", UNUSED_CALLBACKS).unwrap_err().contains("not a WebAssembly module"));
        assert!(trim(b"hello", UNUSED_CALLBACKS).is_err());
    }
}
