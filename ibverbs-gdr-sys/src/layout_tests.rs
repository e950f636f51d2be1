//! Layout tests: sizes and offsets measured with gcc on x86_64 against rdma-core 44's headers
//! (the program is in the comment at the bottom), for the structs the hand-written code and the
//! safe layer touch. bindgen's own layout tests are off because they would pin every struct to
//! x86_64; these run where the numbers were measured.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use core::mem::{align_of, offset_of, size_of};

use crate::*;

#[test]
fn context_and_op_table() {
    assert_eq!(size_of::<ibv_context>(), 328);
    assert_eq!(size_of::<ibv_context_ops>(), 256);
    assert_eq!(offset_of!(ibv_context, ops), 8);
    assert_eq!(offset_of!(ibv_context, mutex), 280);
    assert_eq!(offset_of!(ibv_context, abi_compat), 320);
    assert_eq!(offset_of!(ibv_context_ops, poll_cq), 88);
    assert_eq!(offset_of!(ibv_context_ops, req_notify_cq), 96);
    assert_eq!(offset_of!(ibv_context_ops, post_send), 200);
    assert_eq!(offset_of!(ibv_context_ops, post_recv), 208);
}

#[test]
fn verbs_context_container_of() {
    assert_eq!(size_of::<verbs_context>(), 648);
    assert_eq!(offset_of!(verbs_context, query_port), 0);
    assert_eq!(offset_of!(verbs_context, sz), 312);
    assert_eq!(offset_of!(verbs_context, context), 320);
    assert_eq!(__VERBS_ABI_IS_EXTENDED as usize, usize::MAX);
}

#[test]
fn work_requests_and_completions() {
    assert_eq!(size_of::<ibv_send_wr>(), 128);
    assert_eq!(offset_of!(ibv_send_wr, opcode), 28);
    assert_eq!(offset_of!(ibv_send_wr, send_flags), 32);
    assert_eq!(offset_of!(ibv_send_wr, __bindgen_anon_1), 36); // imm_data / invalidate_rkey
    assert_eq!(offset_of!(ibv_send_wr, wr), 40);
    assert_eq!(size_of::<ibv_recv_wr>(), 32);
    assert_eq!(size_of::<ibv_sge>(), 16);
    assert_eq!(size_of::<ibv_wc>(), 48);
    assert_eq!(offset_of!(ibv_wc, status), 8);
    assert_eq!(offset_of!(ibv_wc, opcode), 12);
    assert_eq!(offset_of!(ibv_wc, byte_len), 20);
    assert_eq!(offset_of!(ibv_wc, __bindgen_anon_1), 24); // imm_data
    assert_eq!(offset_of!(ibv_wc, qp_num), 28);
}

#[test]
fn attributes() {
    assert_eq!(size_of::<ibv_port_attr>(), 52);
    assert_eq!(align_of::<ibv_port_attr>(), 4);
    assert_eq!(offset_of!(ibv_port_attr, active_mtu), 8);
    assert_eq!(offset_of!(ibv_port_attr, gid_tbl_len), 12);
    assert_eq!(offset_of!(ibv_port_attr, lid), 34);
    assert_eq!(offset_of!(ibv_port_attr, link_layer), 46);
    assert_eq!(size_of::<ibv_device_attr>(), 232);
    assert_eq!(size_of::<ibv_qp_attr>(), 144);
    assert_eq!(offset_of!(ibv_qp_attr, path_mtu), 8);
    assert_eq!(offset_of!(ibv_qp_attr, ah_attr), 56);
    assert_eq!(offset_of!(ibv_qp_attr, max_dest_rd_atomic), 127);
    assert_eq!(offset_of!(ibv_qp_attr, timeout), 130);
    assert_eq!(size_of::<ibv_qp_init_attr>(), 64);
    assert_eq!(size_of::<ibv_ah_attr>(), 32);
    assert_eq!(size_of::<ibv_global_route>(), 24);
    assert_eq!(size_of::<ibv_gid>(), 16);
    assert_eq!(size_of::<ibv_gid_entry>(), 32);
    assert_eq!(offset_of!(ibv_gid_entry, gid_type), 24);
    assert_eq!(offset_of!(ibv_gid_entry, ndev_ifindex), 28);
}

#[test]
fn objects() {
    assert_eq!(size_of::<ibv_mr>(), 48);
    assert_eq!(offset_of!(ibv_mr, lkey), 36);
    assert_eq!(offset_of!(ibv_mr, rkey), 40);
    assert_eq!(size_of::<ibv_qp>(), 160);
    assert_eq!(offset_of!(ibv_qp, qp_num), 52);
    assert_eq!(offset_of!(ibv_qp, state), 56);
    assert_eq!(size_of::<ibv_cq>(), 128);
    assert_eq!(size_of::<ibv_comp_channel>(), 16);
}

#[test]
fn rdma_cm() {
    assert_eq!(size_of::<rdma_cm_id>(), 416);
    assert_eq!(offset_of!(rdma_cm_id, verbs), 0);
    assert_eq!(offset_of!(rdma_cm_id, qp), 24);
    assert_eq!(offset_of!(rdma_cm_id, port_num), 348);
    assert_eq!(size_of::<rdma_cm_event>(), 80);
    assert_eq!(offset_of!(rdma_cm_event, status), 20);
    assert_eq!(offset_of!(rdma_cm_event, param), 24);
    assert_eq!(size_of::<rdma_conn_param>(), 24);
    assert_eq!(size_of::<rdma_event_channel>(), 4);
}

#[test]
fn constants_match_the_header() {
    assert_eq!(IBV_WC_SUCCESS, 0);
    assert_eq!(IBV_WC_REM_ACCESS_ERR, 10);
    assert_eq!(IBV_WC_GENERAL_ERR, 21);
    assert_eq!(IBV_WR_RDMA_WRITE, 0);
    assert_eq!(IBV_WR_RDMA_WRITE_WITH_IMM, 1);
    assert_eq!(IBV_WR_SEND, 2);
    assert_eq!(IBV_WR_RDMA_READ, 4);
    assert_eq!(IBV_QPS_RTS, 3);
    assert_eq!(IBV_ACCESS_OPTIONAL_RANGE, 0x3ff0_0000);
    assert_eq!(IBV_GID_TYPE_ROCE_V2, 2);
    assert_eq!(IBV_LINK_LAYER_ETHERNET, 2);
}

// gcc -o l l.c && ./l, with for each checked struct/member:
//   printf("size %s %zu\n", #t, sizeof(t)); printf("off %s.%s %zu\n", #t, #f, offsetof(t, f));
