//! The header cannot drift from the Rust side: status values and layouts are checked here.

use crate::error::{ALL_STATUSES, ERR_LAST, Status};
use std::collections::HashMap;

const HEADER: &str = include_str!("../../include/gsc.h");

/// `NAME = value` entries of the `gsc_status_t` enum in include/gsc.h.
fn header_statuses() -> HashMap<String, i32> {
    let start = HEADER.find("typedef enum {\n    GSC_OK").expect("gsc_status_t enum in gsc.h");
    let end = start + HEADER[start..].find("} gsc_status_t;").expect("end of gsc_status_t");
    let mut out = HashMap::new();
    for line in HEADER[start..end].lines() {
        let line = line.split("/*").next().unwrap().trim();
        let Some((name, value)) = line.split_once('=') else { continue };
        let value: i32 = value.trim().trim_end_matches(',').trim().parse().unwrap_or_else(|_| panic!("bad value in {line:?}"));
        assert!(out.insert(name.trim().to_string(), value).is_none(), "{name} twice in gsc.h");
    }
    out
}

#[test]
fn header_status_values_equal_the_rust_codes() {
    let mut header = header_statuses();
    for s in ALL_STATUSES {
        let v = header.remove(s.c_name()).unwrap_or_else(|| panic!("{} is missing from include/gsc.h", s.c_name()));
        assert_eq!(v, s.code(), "{} is {v} in gsc.h but {} in src/error.rs", s.c_name(), s.code());
    }
    assert_eq!(header.remove("GSC_ERR_LAST"), Some(ERR_LAST), "GSC_ERR_LAST");
    assert!(header.is_empty(), "statuses in gsc.h that src/error.rs does not have: {:?}", header.keys());
}

/// `#define NAME (UINT64_C(1) << n)` values of the header.
fn header_bits() -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for line in HEADER.lines() {
        let Some(rest) = line.strip_prefix("#define ") else { continue };
        let mut it = rest.split_whitespace();
        let (Some(name), Some(_)) = (it.next(), it.next()) else { continue };
        if let Some(n) = rest.split("<<").nth(1)
            && rest.contains("UINT64_C(1)")
        {
            let n: u32 = n.trim().trim_end_matches(')').trim().parse().unwrap();
            out.insert(name.to_string(), 1u64 << n);
        }
    }
    out
}

#[test]
fn header_bits_equal_the_rust_constants() {
    use super::params::*;
    let bits = header_bits();
    let expect = [
        ("GSC_OP_ATTR_FIELD_CALLBACK", OP_ATTR_FIELD_CALLBACK),
        ("GSC_OP_ATTR_FIELD_USER_DATA", OP_ATTR_FIELD_USER_DATA),
        ("GSC_OP_ATTR_FIELD_FLAGS", OP_ATTR_FIELD_FLAGS),
        ("GSC_OP_ATTR_FIELD_MEMORY_TYPE", OP_ATTR_FIELD_MEMORY_TYPE),
        ("GSC_OP_ATTR_FIELD_RECV_INFO", OP_ATTR_FIELD_RECV_INFO),
        ("GSC_OP_ATTR_FIELD_CONDITION", OP_ATTR_FIELD_CONDITION),
        ("GSC_OP_ATTR_FLAG_NO_IMM_CMPL", OP_ATTR_FLAG_NO_IMM_CMPL),
        ("GSC_EP_CLOSE_FLAG_FORCE", EP_CLOSE_FLAG_FORCE),
        ("GSC_PARAM_FIELD_CONFIG", PARAM_FIELD_CONFIG),
        ("GSC_PARAM_FIELD_REQUEST_SIZE", PARAM_FIELD_REQUEST_SIZE),
        ("GSC_PARAM_FIELD_REQUEST_INIT", PARAM_FIELD_REQUEST_INIT),
        ("GSC_PARAM_FIELD_REQUEST_CLEANUP", PARAM_FIELD_REQUEST_CLEANUP),
        ("GSC_EP_PARAM_FIELD_ADDRESS", EP_PARAM_FIELD_ADDRESS),
        ("GSC_EP_PARAM_FIELD_ADDRESS_LENGTH", EP_PARAM_FIELD_ADDRESS_LENGTH),
        ("GSC_MEM_MAP_PARAM_FIELD_ADDRESS", MEM_MAP_PARAM_FIELD_ADDRESS),
        ("GSC_MEM_MAP_PARAM_FIELD_LENGTH", MEM_MAP_PARAM_FIELD_LENGTH),
        ("GSC_MEM_MAP_PARAM_FIELD_FLAGS", MEM_MAP_PARAM_FIELD_FLAGS),
        ("GSC_MEM_MAP_ALLOCATE", MEM_MAP_ALLOCATE),
        ("GSC_OP_ATTR_FIELD_CONDITION_OUT", OP_ATTR_FIELD_CONDITION_OUT),
        ("GSC_OP_ATTR_FLAG_NO_STREAM_WAIT", OP_ATTR_FLAG_NO_STREAM_WAIT),
        ("GSC_CONDITION_PARAM_FIELD_CATEGORY", super::condition::CONDITION_PARAM_FIELD_CATEGORY),
        ("GSC_CONDITION_PARAM_FIELD_CONTEXT", super::condition::CONDITION_PARAM_FIELD_CONTEXT),
        ("GSC_BUFFER_PARAM_FIELD_PARTITIONS", super::prepared::BUFFER_PARAM_FIELD_PARTITIONS),
        ("GSC_BUFFER_PARAM_FIELD_MEMORY_TYPE", super::prepared::BUFFER_PARAM_FIELD_MEMORY_TYPE),
        ("GSC_BUFFER_PARAM_FIELD_FLAGS", super::prepared::BUFFER_PARAM_FIELD_FLAGS),
        ("GSC_PREPARE_FLAG_GPU_ROUNDS", super::prepared::PREPARE_FLAG_GPU_ROUNDS),
        ("GSC_PREPARE_FLAG_PROXY", super::prepared::PREPARE_FLAG_PROXY),
    ];
    for (name, v) in expect {
        assert_eq!(bits.get(name), Some(&v), "{name}");
    }
    assert_eq!(bits.len(), expect.len(), "a bit in gsc.h has no Rust constant: {bits:?}");
    assert!(HEADER.contains("GSC_MEMORY_TYPE_HOST = 0") && MEMORY_TYPE_HOST == 0);
    assert!(HEADER.contains(&format!("#define GSC_UNIQUE_ID_BYTES {}\n", crate::bootstrap::UNIQUE_ID_BYTES)));
    assert!(HEADER.contains(&format!("#define GSC_UNIQUE_ID_STRING_LEN {}\n", super::bootstrap::UNIQUE_ID_STRING_LEN)));
    assert!(HEADER.contains("GSC_MEMORY_TYPE_CUDA = 1") && MEMORY_TYPE_CUDA == 1);
    assert!(HEADER.contains("GSC_PREPARE_SEND = 0") && super::prepared::PREPARE_SEND == 0);
    assert!(HEADER.contains("GSC_PREPARE_RECV = 1") && super::prepared::PREPARE_RECV == 1);
    for (i, name) in ["STREAM", "GRAPH", "KERNEL_TRIGGERED", "HOST_STREAM"].iter().enumerate() {
        assert!(HEADER.contains(&format!("GSC_CONDITION_CATEGORY_{name} = {i}")), "{name}");
    }
}

/// Compile a C program that prints the header's struct layouts and compare them with the
/// `#[repr(C)]` mirrors. Skipped (with a note) where no C compiler is installed.
#[test]
fn header_struct_layouts_equal_the_rust_mirrors() {
    use super::params::*;
    use std::mem::{offset_of, size_of};
    let dir = std::env::temp_dir().join(format!("gsc-capi-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("layout.c");
    let exe = dir.join("layout");
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
    std::fs::write(
        &src,
        r#"#include <stdio.h>
#include <stddef.h>
#include "gsc.h"
#define S(t) printf(#t " %zu\n", sizeof(t))
#define O(t, f) printf(#t "." #f " %zu\n", offsetof(t, f))
int main(void) {
    S(gsc_request_param_t); O(gsc_request_param_t, flags); O(gsc_request_param_t, cb);
    O(gsc_request_param_t, user_data); O(gsc_request_param_t, memory_type);
    O(gsc_request_param_t, recv_info); O(gsc_request_param_t, condition);
    O(gsc_request_param_t, condition_out);
    S(gsc_condition_out_t); O(gsc_condition_out_t, done_node); O(gsc_condition_out_t, device_handle);
    S(gsc_condition_param_t); O(gsc_condition_param_t, category); O(gsc_condition_param_t, context);
    S(gsc_tag_recv_info_t); O(gsc_tag_recv_info_t, length);
    S(gsc_params_t); O(gsc_params_t, config); O(gsc_params_t, config_count);
    O(gsc_params_t, request_size); O(gsc_params_t, request_init); O(gsc_params_t, request_cleanup);
    S(gsc_config_pair_t); O(gsc_config_pair_t, value);
    S(gsc_worker_params_t);
    S(gsc_ep_params_t); O(gsc_ep_params_t, address); O(gsc_ep_params_t, address_length);
    S(gsc_mem_map_params_t); O(gsc_mem_map_params_t, address); O(gsc_mem_map_params_t, length);
    O(gsc_mem_map_params_t, flags);
    S(gsc_buffer_param_t); O(gsc_buffer_param_t, direction); O(gsc_buffer_param_t, buffer);
    O(gsc_buffer_param_t, length); O(gsc_buffer_param_t, tag); O(gsc_buffer_param_t, partitions);
    O(gsc_buffer_param_t, memory_type); O(gsc_buffer_param_t, flags);
    S(gsc_status_t); S(gsc_memory_type_t); S(gsc_unique_id_t);
    S(gsc_coll_desc_t); O(gsc_coll_desc_t, sendbuf); O(gsc_coll_desc_t, count); O(gsc_coll_desc_t, root);
    S(gsc_peer_transfer_t); O(gsc_peer_transfer_t, buf); O(gsc_peer_transfer_t, count);
    O(gsc_peer_transfer_t, datatype); O(gsc_peer_transfer_t, peer);
    return 0;
}
"#,
    )
    .unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let built = std::process::Command::new(&cc).arg("-std=c99").arg("-I").arg(include).arg(&src).arg("-o").arg(&exe).status();
    match built {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("compiling the layout probe failed: {s}"),
        Err(e) => {
            eprintln!("note: no C compiler ({cc}: {e}); struct layouts not checked");
            return;
        }
    }
    let out = std::process::Command::new(&exe).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let c: HashMap<&str, usize> = text.lines().filter_map(|l| l.split_once(' ')).map(|(k, v)| (k, v.parse().unwrap())).collect();
    let rust = [
        ("gsc_request_param_t", size_of::<RequestParam>()),
        ("gsc_request_param_t.flags", offset_of!(RequestParam, flags)),
        ("gsc_request_param_t.cb", offset_of!(RequestParam, cb)),
        ("gsc_request_param_t.user_data", offset_of!(RequestParam, user_data)),
        ("gsc_request_param_t.memory_type", offset_of!(RequestParam, memory_type)),
        ("gsc_request_param_t.recv_info", offset_of!(RequestParam, recv_info)),
        ("gsc_request_param_t.condition", offset_of!(RequestParam, condition)),
        ("gsc_request_param_t.condition_out", offset_of!(RequestParam, condition_out)),
        ("gsc_coll_desc_t", size_of::<super::comm::CollDesc>()),
        ("gsc_coll_desc_t.sendbuf", offset_of!(super::comm::CollDesc, sendbuf)),
        ("gsc_coll_desc_t.count", offset_of!(super::comm::CollDesc, count)),
        ("gsc_coll_desc_t.root", offset_of!(super::comm::CollDesc, root)),
        ("gsc_peer_transfer_t", size_of::<super::comm::CPeerTransfer>()),
        ("gsc_peer_transfer_t.buf", offset_of!(super::comm::CPeerTransfer, buf)),
        ("gsc_peer_transfer_t.count", offset_of!(super::comm::CPeerTransfer, count)),
        ("gsc_peer_transfer_t.datatype", offset_of!(super::comm::CPeerTransfer, datatype)),
        ("gsc_peer_transfer_t.peer", offset_of!(super::comm::CPeerTransfer, peer)),
        ("gsc_condition_out_t", size_of::<super::params::ConditionOut>()),
        ("gsc_condition_out_t.done_node", offset_of!(super::params::ConditionOut, done_node)),
        ("gsc_condition_out_t.device_handle", offset_of!(super::params::ConditionOut, device_handle)),
        ("gsc_condition_param_t", size_of::<super::condition::ConditionParam>()),
        ("gsc_condition_param_t.category", offset_of!(super::condition::ConditionParam, category)),
        ("gsc_condition_param_t.context", offset_of!(super::condition::ConditionParam, context)),
        ("gsc_tag_recv_info_t", size_of::<TagRecvInfo>()),
        ("gsc_tag_recv_info_t.length", offset_of!(TagRecvInfo, length)),
        ("gsc_params_t", size_of::<Params>()),
        ("gsc_params_t.config", offset_of!(Params, config)),
        ("gsc_params_t.config_count", offset_of!(Params, config_count)),
        ("gsc_params_t.request_size", offset_of!(Params, request_size)),
        ("gsc_params_t.request_init", offset_of!(Params, request_init)),
        ("gsc_params_t.request_cleanup", offset_of!(Params, request_cleanup)),
        ("gsc_config_pair_t", size_of::<ConfigPair>()),
        ("gsc_config_pair_t.value", offset_of!(ConfigPair, value)),
        ("gsc_worker_params_t", size_of::<WorkerParams>()),
        ("gsc_ep_params_t", size_of::<EpParams>()),
        ("gsc_ep_params_t.address", offset_of!(EpParams, address)),
        ("gsc_ep_params_t.address_length", offset_of!(EpParams, address_length)),
        ("gsc_mem_map_params_t", size_of::<MemMapParams>()),
        ("gsc_mem_map_params_t.address", offset_of!(MemMapParams, address)),
        ("gsc_mem_map_params_t.length", offset_of!(MemMapParams, length)),
        ("gsc_mem_map_params_t.flags", offset_of!(MemMapParams, flags)),
        ("gsc_buffer_param_t", size_of::<super::prepared::BufferParam>()),
        ("gsc_buffer_param_t.direction", offset_of!(super::prepared::BufferParam, direction)),
        ("gsc_buffer_param_t.buffer", offset_of!(super::prepared::BufferParam, buffer)),
        ("gsc_buffer_param_t.length", offset_of!(super::prepared::BufferParam, length)),
        ("gsc_buffer_param_t.tag", offset_of!(super::prepared::BufferParam, tag)),
        ("gsc_buffer_param_t.partitions", offset_of!(super::prepared::BufferParam, partitions)),
        ("gsc_buffer_param_t.memory_type", offset_of!(super::prepared::BufferParam, memory_type)),
        ("gsc_buffer_param_t.flags", offset_of!(super::prepared::BufferParam, flags)),
        ("gsc_status_t", size_of::<i32>()),
        ("gsc_memory_type_t", size_of::<u32>()),
        ("gsc_unique_id_t", size_of::<super::bootstrap::CUniqueId>()),
    ];
    for (name, v) in rust {
        assert_eq!(c.get(name), Some(&v), "{name}: C says {:?}, Rust says {v}", c.get(name));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `gsc_...(` names declared as functions in the header: `gsc_status_t NAME(` and the like.
fn header_functions() -> std::collections::BTreeSet<String> {
    // The header without its comments (which name functions too).
    let mut code = String::new();
    let mut rest = HEADER;
    while let Some(i) = rest.find("/*") {
        code.push_str(&rest[..i]);
        rest = &rest[i + rest[i..].find("*/").expect("unterminated comment in gsc.h") + 2..];
    }
    code.push_str(rest);
    code.lines()
        .filter(|l| !l.starts_with('#'))
        .flat_map(|l| {
            l.match_indices("gsc_")
                .filter_map(|(i, _)| {
                    let rest = &l[i..];
                    let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    rest[name.len()..].starts_with('(').then_some(name)
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `extern "C" fn gsc_...` names in src/capi/.
fn exported_functions() -> std::collections::BTreeSet<String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/capi");
    let mut out = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for part in text.split("extern \"C\" fn ").skip(1) {
            let name: String = part.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if name.starts_with("gsc_") && name.len() > 4 {
                out.insert(name);
            }
        }
    }
    out
}

#[test]
fn header_declares_exactly_the_exported_functions() {
    let (declared, exported) = (header_functions(), exported_functions());
    assert!(exported.len() > 50, "found only {} exports: {exported:?}", exported.len());
    let missing: Vec<_> = exported.difference(&declared).collect();
    let extra: Vec<_> = declared.difference(&exported).collect();
    assert!(missing.is_empty(), "exported but not declared in include/gsc.h: {missing:?}");
    assert!(extra.is_empty(), "declared in include/gsc.h but not exported: {extra:?}");
}

/// `NAME = value` entries of the enum that ends with `} TYPE;`.
fn header_enum(ty: &str) -> Vec<(String, i32)> {
    let end = HEADER.find(&format!("}} {ty};")).unwrap_or_else(|| panic!("{ty} in gsc.h"));
    let start = HEADER[..end].rfind("typedef enum {").unwrap();
    HEADER[start..end]
        .lines()
        .filter_map(|l| l.split("/*").next().unwrap().trim().trim_end_matches(',').split_once('='))
        .map(|(n, v)| (n.trim().to_string(), v.trim().parse().unwrap()))
        .collect()
}

#[test]
fn header_datatypes_and_ops_equal_the_rust_values() {
    use crate::collectives::{DataType, RedOp};
    let types = header_enum("gsc_datatype_t");
    let names =
        ["INT8", "UINT8", "INT32", "UINT32", "INT64", "UINT64", "FLOAT16", "FLOAT32", "FLOAT64", "BFLOAT16", "FLOAT8E4M3", "FLOAT8E5M2"];
    assert_eq!(types.len(), DataType::ALL.len());
    for ((name, v), (t, want)) in types.iter().zip(DataType::ALL.iter().zip(names)) {
        assert_eq!((name.as_str(), *v), (format!("GSC_{want}").as_str(), t.nccl()), "{}", t.name());
    }
    let ops = header_enum("gsc_red_op_t");
    assert_eq!(ops.len(), RedOp::ALL.len());
    for (name, v) in ops {
        assert_eq!(name, format!("GSC_{}", RedOp::from_nccl(v).unwrap().name().to_uppercase()), "value {v}");
    }
}

#[test]
fn peer_transfer_entries_are_checked_and_named_by_index() {
    use super::comm::{CPeerTransfer, gsc_comm_transfers, peer_transfers};
    use crate::collectives::{PeerOp, PeerTransfer};
    assert_eq!(header_enum("gsc_peer_op_t"), [("GSC_PEER_SEND".to_string(), 0), ("GSC_PEER_RECV".to_string(), 1)]);
    let mut buf = [0u32; 4];
    let ptr: *mut std::ffi::c_void = buf.as_mut_ptr().cast();
    let entry = |op, count, datatype, peer| CPeerTransfer { op, buf: ptr, count, datatype, peer };
    let good = [entry(0, 3, 2, 1), entry(1, 4, 9, 0)];
    let addr = ptr as u64;
    assert_eq!(
        peer_transfers(&good).unwrap(),
        [PeerTransfer { op: PeerOp::Send, buf: addr, bytes: 12, peer: 1 }, PeerTransfer { op: PeerOp::Recv, buf: addr, bytes: 8, peer: 0 }]
    );
    for (bad, text) in [
        (entry(2, 1, 2, 0), "transfer 1: op 2 is not a gsc_peer_op_t"),
        (entry(0, 1, 99, 0), "transfer 1: datatype 99 is not a gsc_datatype_t"),
        (entry(1, 1, 2, -3), "transfer 1: peer is negative (-3)"),
        (entry(0, usize::MAX / 2, 2, 0), "transfer 1: 9223372036854775807 elements of 4 bytes overflow"),
    ] {
        let err = peer_transfers(&[entry(0, 3, 2, 1), bad]).unwrap_err();
        assert_eq!((err.status(), err.message()), (Status::InvalidParam, text));
    }
    // Without a communicator the handle is refused before the entries are read.
    // SAFETY: NULL handles; nothing is dereferenced.
    let st = unsafe { gsc_comm_transfers(std::ptr::null_mut(), std::ptr::null(), 3, std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(st, Status::InvalidHandle.code());
}
