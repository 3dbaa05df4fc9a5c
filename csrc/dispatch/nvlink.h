// Expert-parallel dispatch and combine over peer buffers (specs/dispatch.md, "NVLink peer buffers").
//
// Every rank owns a few symmetric regions: the same byte layout on every rank, each rank's copy mapped
// into every other rank's address space (CUDA IPC within a node; on "virtual ranks" several copies in
// one process). The kernels take this rank's id, the world size and the table of the ranks' base
// addresses, so the same code serves P processes on P GPUs and P virtual ranks on one device.
//
// Data-moving kernels never wait for another rank: every cross-rank ordering point is `barrier`, a small
// separate kernel (release/acquire on signal words at system scope). Callers run the phases
//   dispatch: barrier, notify, barrier, send, barrier, layout (prepare + permute + layout_meta)
//   combine:  barrier, push, barrier, local reduce (unpermute)
//   combine backward: barrier, local unpermute_bwd into the own combine region, barrier, pull
// so on virtual ranks a barrier is "every rank arrives, then every rank waits", in stream order.
//
// Sizes: P ranks, M = max_tokens_per_rank, k slots, El local experts, C = capacity (expert rows a rank
// receives at most; tokens past it are dropped and counted). Receive rows X = min(P * M, C).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moe::dispatch {

constexpr int kMaxRanks = 64;

// The header region: signal words, the barrier's epoch, the drop counter, the count inbox.
struct Header {
  uint64_t signals[kMaxRanks];  // signals[s]: the last barrier epoch rank s reached, written by s
  uint64_t epoch;               // barriers this rank has run (only its own barrier kernel touches it)
  uint64_t dropped;             // (token, rank) copies this rank sent that the capacity dropped, cumulative
  int32_t inbox[kMaxRanks][2];  // inbox[s] = {tokens, expert rows} rank s sends this rank in this dispatch
};

// Byte offsets inside a rank's dispatch region, the same on every rank for one call.
struct DispatchLayout {
  int64_t src;     // [P*M] int32 pairs {source rank, source token}
  int64_t idx;     // [P*M, k] int32 local expert of each slot, -1 when not local or dropped
  int64_t w;       // [P*M, k] fp32 routing weight of each slot
  int64_t x;       // [X, row_bytes] payload rows
  int64_t scales;  // [X, scale_bytes] payload scale rows
  int64_t bytes;   // total
};
DispatchLayout dispatch_layout(int32_t ranks, int64_t max_tokens, int64_t k, int64_t x_rows, int64_t row_bytes,
                               int64_t scale_bytes);
constexpr size_t header_bytes() { return (sizeof(Header) + 255) / 256 * 256; }

// The combine region: [M*k, row_bytes] rows (one per source slot) then [M*k] fp32.
__host__ __device__ inline int64_t combine_rows_offset() { return 0; }
__host__ __device__ inline int64_t combine_floats_offset(int64_t max_tokens, int64_t k, int64_t row_bytes) {
  return (max_tokens * k * row_bytes + 255) / 256 * 256;
}
__host__ __device__ inline int64_t combine_bytes(int64_t max_tokens, int64_t k, int64_t row_bytes) {
  return combine_floats_offset(max_tokens, k, row_bytes) + max_tokens * k * int64_t(sizeof(float));
}

struct World {
  int32_t rank;
  int32_t ranks;
  const uint64_t* bases;  // [ranks] device array: each rank's base address of the region in use
};

// mode: 1 arrive (signal every rank), 2 wait (until every rank signalled), 3 both.
void barrier(World header, int mode, cudaStream_t stream);

struct NotifyParams {
  World header;
  const int32_t* indices;  // [T, k] global experts, -1 (or anything outside [0, E)) = dropped slot
  int64_t num_tokens;
  int64_t k;
  int32_t local_experts;  // El: rank d owns experts [d*El, (d+1)*El)
  int32_t* send_token;    // [T, P] token's position among this rank's tokens for rank d, -1: not sent
  int32_t* send_slot;     // [T, P] its first expert row among this rank's rows for rank d
};
// Per destination rank: prefix counts over this rank's tokens, then the totals into that rank's inbox.
void notify(const NotifyParams& p, cudaStream_t stream);

struct SendParams {
  World header;
  World data;  // dispatch regions
  DispatchLayout layout;
  const void* x;            // [T, row_bytes]
  const void* scales;       // [T, scale_bytes] or null
  const float* weights;     // [T, k]
  const int32_t* indices;   // [T, k]
  const int32_t* send_token;
  const int32_t* send_slot;
  int32_t* source_rows;     // [T, k] t*k + j where slot j reached its expert, -1 otherwise
  int64_t num_tokens;
  int64_t k;
  int64_t row_bytes;
  int64_t scale_bytes;
  int64_t max_tokens;       // M
  int64_t x_rows;           // X
  int64_t capacity;         // C
  int32_t local_experts;
  int32_t num_sms;          // blocks, bounded so the copy can overlap with compute
};
// Each token travels once per destination rank that owns one of its experts, with its local expert
// list, weights and (optional) scale row; offsets come from the ranks' inboxes.
void send(const SendParams& p, cudaStream_t stream);

struct PrepareParams {
  World header;
  int32_t* idx;             // this rank's [P*M, k] slot table (in its dispatch region)
  int64_t rows;             // X: rows the permute reads
  int64_t k;
  int32_t* num_received;    // [1] out: N = min(tokens received, X)
};
// N = sum of the inbox, at most X (rows at or past X only ever hold dropped tokens: a delivered token's
// row is below its expert rows' end, itself at most C); slots of rows [N, X) become -1, so the permute
// of rows [0, X) that follows sees only this dispatch's rows.
void prepare(const PrepareParams& p, cudaStream_t stream);

struct LayoutParams {
  const int32_t* num_received;  // [1]
  const int32_t* src;           // [X] pairs, this rank's region
  const int32_t* idx;           // [X, k]
  const float* w;               // [X, k]
  const void* scales;           // [X, scale_bytes] or null
  const int32_t* row_map;       // [X, k] from permute: grouped row of each received slot
  int32_t* handle_src;          // [X, 2] out: copy of src (rows < N)
  float* row_weights;           // [R] out: weight of each grouped row (pre-filled with 0)
  int32_t* local_indices;       // [R] out: local expert of each grouped row (pre-filled with -1)
  void* grouped_scales;         // [R, scale_bytes] out or null
  int64_t rows;                 // X
  int64_t k;
  int64_t scale_bytes;
};
void layout_meta(const LayoutParams& p, cudaStream_t stream);

struct MoveParams {
  World data;                   // combine regions
  const int32_t* num_received;  // [1]
  const int32_t* src;           // [X, 2] handle copy
  const int32_t* row_map;       // [X, k]
  void* rows;                   // push: [R, row_bytes] read; pull: [R, row_bytes] written
  const float* floats;          // push only: [R] fp32 sent beside the rows, or null
  int64_t received_rows;        // X
  int64_t k;
  int64_t row_bytes;
  int64_t max_tokens;           // M
  int32_t num_sms;
  // pull only: zero the padding rows [start + total, start + size) of each local expert
  const int32_t* starts = nullptr;
  const int32_t* totals = nullptr;
  const int32_t* group_sizes = nullptr;
  int32_t local_experts = 0;
};
// push: grouped row of (received row i, slot j) -> its source rank's combine region, row t*k + j.
void push(const MoveParams& p, cudaStream_t stream);
// pull: the reverse read: source's combine row t*k + j -> grouped row of (i, j).
void pull(const MoveParams& p, cudaStream_t stream);

}  // namespace moe::dispatch
