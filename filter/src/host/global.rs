//! The global scope's VM node, which outlives configurations ([`crate::fleet::batched`] keeps
//! its state; the root context's batch call and its answer are in the shell's module, beside
//! the other calls to `floodgate-sync`).

use crate::fleet::batched::VmNode;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

thread_local! {
    /// This VM's node per filter namespace: its deltas, view and flusher survive a
    /// configuration change (a new root context in the same VM).
    static NODES: RefCell<HashMap<String, Rc<RefCell<VmNode>>>> = RefCell::new(HashMap::new());
}

/// This VM's node for `namespace`.
pub fn node(namespace: &str, vm: u64) -> Rc<RefCell<VmNode>> {
    NODES.with(|nodes| {
        Rc::clone(
            nodes
                .borrow_mut()
                .entry(namespace.to_owned())
                .or_insert_with(|| Rc::new(RefCell::new(VmNode::new(vm)))),
        )
    })
}
