/*
 * Compiled by samples/gpu/build.py with the TT_VERBS_* offsets of bpf/ibverbs.c as -D
 * flags: the build fails unless each equals the real <infiniband/verbs.h>'s.
 */
#include <stddef.h>
#include <infiniband/verbs.h>

#define SAME(a, b) _Static_assert((a) == (b), #a " != " #b)
SAME(TT_VERBS_OFF_CTX_POLL_CQ, offsetof(struct ibv_context, ops.poll_cq));
SAME(TT_VERBS_OFF_CTX_POST_SEND, offsetof(struct ibv_context, ops.post_send));
SAME(TT_VERBS_OFF_CTX_POST_RECV, offsetof(struct ibv_context, ops.post_recv));
SAME(TT_VERBS_OFF_OBJ_CONTEXT, offsetof(struct ibv_pd, context));
SAME(TT_VERBS_OFF_OBJ_CONTEXT, offsetof(struct ibv_qp, context));
SAME(TT_VERBS_OFF_OBJ_CONTEXT, offsetof(struct ibv_cq, context));
SAME(TT_VERBS_OFF_OBJ_CONTEXT, offsetof(struct ibv_mr, context));
SAME(TT_VERBS_OFF_QP_NUM, offsetof(struct ibv_qp, qp_num));
SAME(TT_VERBS_OFF_MR_ADDR, offsetof(struct ibv_mr, addr));
SAME(TT_VERBS_OFF_MR_LENGTH, offsetof(struct ibv_mr, length));
SAME(TT_VERBS_OFF_MR_LKEY, offsetof(struct ibv_mr, lkey));
SAME(TT_VERBS_OFF_MR_RKEY, offsetof(struct ibv_mr, rkey));
SAME(TT_VERBS_OFF_WR_NEXT, offsetof(struct ibv_send_wr, next));
SAME(TT_VERBS_OFF_WR_NEXT, offsetof(struct ibv_recv_wr, next));
SAME(TT_VERBS_OFF_WR_SG_LIST, offsetof(struct ibv_send_wr, sg_list));
SAME(TT_VERBS_OFF_WR_SG_LIST, offsetof(struct ibv_recv_wr, sg_list));
SAME(TT_VERBS_OFF_WR_NUM_SGE, offsetof(struct ibv_send_wr, num_sge));
SAME(TT_VERBS_OFF_WR_NUM_SGE, offsetof(struct ibv_recv_wr, num_sge));
SAME(TT_VERBS_OFF_WR_OPCODE, offsetof(struct ibv_send_wr, opcode));
SAME(TT_VERBS_SGE_SIZE, sizeof(struct ibv_sge));
SAME(TT_VERBS_OFF_SGE_LENGTH, offsetof(struct ibv_sge, length));
SAME(TT_VERBS_WC_SIZE, sizeof(struct ibv_wc));
SAME(TT_VERBS_OFF_WC_STATUS, offsetof(struct ibv_wc, status));
SAME(TT_VERBS_OFF_WC_OPCODE, offsetof(struct ibv_wc, opcode));
SAME(TT_VERBS_OFF_WC_BYTE_LEN, offsetof(struct ibv_wc, byte_len));
SAME(TT_VERBS_OFF_WC_QP_NUM, offsetof(struct ibv_wc, qp_num));
SAME(TT_VERBS_OFF_ATTR_QP_STATE, offsetof(struct ibv_qp_attr, qp_state));
SAME(TT_VERBS_OFF_ATTR_DEST_QPN, offsetof(struct ibv_qp_attr, dest_qp_num));
SAME(TT_VERBS_IBV_QP_STATE, IBV_QP_STATE);
SAME(TT_VERBS_IBV_QP_DEST_QPN, IBV_QP_DEST_QPN);
SAME(TT_VERBS_IBV_WC_RECV, IBV_WC_RECV);
