// Gated DeltaNet for short calls (a decode step or a verify of 1 + k rows): the causal depthwise
// conv and the recurrent rule token by token in one launch, recording what a verify's rollback to any
// row needs: the state before the launch and each row's inputs to the rule, which deltanet_keep replays
// (engine/model.py; engine/backend/cpu_ops.py causal_conv, delta_rule_rows; engine/cache.py).
#include "common.cuh"

// ------------------------------------------------------------------------- causal conv ---
// The conv's history is a ring of positions: ring [CONV_RING, C] holds the input (in_proj's q | k | v
// columns) of position p in row p mod CONV_RING. A call at positions P .. P + T - 1 reads rows P - KW + 1
// .. P - 1 from the ring and writes rows P .. P + T - 1 into it; with CONV_RING >= KW - 1 + T those rows
// never meet, so the blocks of one launch read the history while others write the new rows (no race,
// no second launch), and a rollback to n rows needs no copy: the next call starts at P + n and reads
// rows written before it. Rows of positions below 0 hold zeros (the ring starts zeroed).
//
#define CONV_RING 32  // a power of two (a row is a mask away; a division by a runtime value spilled registers)
                      // >= KW - 1 + MAX_ROWS for conv kernels up to 17 taps

__device__ __forceinline__ int ring_row(int position) { return position & (CONV_RING - 1); }

// conv_silu: silu(sum_j x(t - (KW - 1) + j, c) * taps[c, j]) for row t of the call and channel c, x(r)
// the call's row r (r >= 0: mixed + r * in_stride) or position P + r's ring row; summed j = 0, 1, ...
// with separate multiply and add roundings, as numpy does them (engine/backend/cpu_ops.causal_conv).
__device__ __forceinline__ float conv_silu(const float* __restrict__ mixed, const float* __restrict__ taps,
                                           const float* __restrict__ ring, int P, int t, int c, int C, int KW,
                                           long long in_stride) {
  float sum = 0.0f;
  for (int j = 0; j < KW; ++j) {
    const int r = t - (KW - 1) + j;
    const float x = r >= 0 ? mixed[(size_t)r * in_stride + c] : ring[(size_t)ring_row(P + r) * C + c];
    sum = __fadd_rn(sum, __fmul_rn(x, taps[(size_t)c * KW + j]));
  }
  return silu_f(sum);
}

// The call's rows of channel c into the ring (by the one block that owns c).
__device__ __forceinline__ void conv_to_ring(const float* __restrict__ mixed, float* __restrict__ ring, int P, int T,
                                             int c, int C, long long in_stride) {
  for (int t = 0; t < T; ++t) ring[(size_t)ring_row(P + t) * C + c] = mixed[(size_t)t * in_stride + c];
}

// --------------------------------------------------------------------- recurrent rule ---
// Per value head h (key head h / (Hv / Hk), repeat-interleave) and row t:
//   beta = sigmoid(b[t, h]);  g = decay_rate[h] * softplus(a[t, h] + dt_bias[h])
//   S = e^g S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q
// with q | k | v the causal conv (conv_silu) of in_proj's rows: mixed [T, C = 2 Hk DK + Hv DV] with row
// t at mixed + t * in_stride (read in place from the whole in_proj output), taps [C, KW], ring as
// above, the call's first position at *start. q and k (key head hk's query at channel hk * DK, its key
// at (Hk + hk) * DK) are L2-normalised here (eps 1e-6; q also times q_scale = DK^-0.5), as
// engine/backend/cpu_ops.l2_normalize: no launch of their own. b and a [T, Hv] with row t at
// + t * ba_stride (in place from wider rows); or, with K > 0 (a W4 checkpoint keeps in_proj_b/a in
// 16 bit), this launch makes them: ba_w [2 Hv, K] bf16 bits (b's rows, then a's) times x [T, K], the
// layer's normed input, by two warps (bf16_gemv's row_dots and sums: the same bits, no launch of their
// own). S [Hv, DK, DV] fp32, updated in place; out [T, Hv, DV]. With `record` (a call a verify may roll
// back), prior [Hv, DK, DV] receives S as the launch found it and row_inputs [T, Hv, ROW_INPUTS(DK, DV)]
// each row's k (normalised) | v | beta | e^g: one state and a few vectors a row, where a copy of S
// after every row cost T - 1 states (3 MB a layer and row at the 27B's 48 heads of 128 x 128). A
// rollback that keeps every row touches nothing; one to row n replays rows 0 .. n - 1 from prior
// (deltanet_keep, the same delta_update: the same bits as this launch had there).
//
// A block owns 32 value columns of one head: thread (j = tid / 4, part = tid % 4) holds column j's
// rows part, part + 4, ..., in registers for the whole call, so S is read once and written once
// (and prior once when recording). The four parts of a column are adjacent lanes: S^T k and S^T q are two
// shuffles. For a fixed register the warp touches 4 rows x 8 consecutive columns: whole 32-byte
// sectors. Each block convolves the channels it reads (a key head's q and k again in each of its
// blocks: 2 DK x KW products a row); the first block of a key head's first value head writes q and k
// into the ring, each block its value columns.
//
// Then the gated norm per row and value head (engine/model.py's DeltaNet; REFERENCE.md section 1):
// y = o * rsqrt(mean(o^2) + eps) * w * gate(z), gate silu (sigmoid with `sigmoid`), z row t at
// z + t * z_stride (in place from in_proj's rows), w [DV]; y [T, Hv * DV] and the forms out_proj reads
// (emit_forms). A head's norm needs all its columns: the last of its DV / 32 blocks to finish (an
// arrival count a head, left at 0 for the next launch) reads the o [T, Hv, DV] the others wrote and
// norms every row, as a launch of its own did (thread-strided sums of squares, then block_sum).
// Launch: grid (Hv, DV / 32), block 128.
// The gated norm of head h's rows (see above), by one block. o was written by the head's other blocks
// in this launch: read past L1 (__ldcg), never through the read-only cache a const __restrict__
// pointer lets the compiler pick.
__device__ __forceinline__ void gated_norm(const float* out, const float* __restrict__ z,
                                           const float* __restrict__ w, float eps, int sigmoid, float* __restrict__ y,
                                           u16* y_bf16, signed char* y_q, float* y_scale, int forms, int T, int Hv,
                                           int DV, int h, long long z_stride, float* scratch) {
  for (int t = 0; t < T; ++t) {
    const float* row = out + ((size_t)t * Hv + h) * DV;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < DV; i += blockDim.x) ss += __ldcg(row + i) * __ldcg(row + i);
    const float denom = sqrtf(block_sum(ss, scratch) / (float)DV + eps);
    for (int i = threadIdx.x; i < DV; i += blockDim.x) {  // whole warps a pass (DV % 32 == 0): emit_forms' int8 blocks
      const float gate = z[(size_t)t * z_stride + (size_t)h * DV + i];
      const float value = __ldcg(row + i) / denom * w[i] * (sigmoid ? sigmoid_f(gate) : silu_f(gate));
      const size_t at = ((size_t)t * Hv + h) * DV + i;
      y[at] = value;
      emit_forms(value, at, forms, y_bf16, y_q, y_scale);
    }
  }
}

#define ROW_INPUTS(DK, DV) ((DK) + (DV) + 2)  // a row's recorded k | v | beta | e^g, a value head

// One row of the rule on a thread's rows part, part + 4, ... of column j of S (s, in registers): S = e^g S;
// u = beta (v - S^T k); S += k u^T. The four parts of a column are adjacent lanes. Both kernels below
// run this code, so a replayed row has the bits the launch had.
template <int R>
__device__ __forceinline__ void delta_update(float (&s)[R], const float* k, int part, float decay, float beta, float v) {
  float pred = 0.0f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    s[i] *= decay;
    pred += s[i] * k[part + 4 * i];
  }
  pred += __shfl_xor_sync(0xffffffffu, pred, 1);
  pred += __shfl_xor_sync(0xffffffffu, pred, 2);
  const float u = (v - pred) * beta;
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] += k[part + 4 * i] * u;
}

template <int DK>
__device__ void deltanet_rows(const float* __restrict__ mixed, const float* __restrict__ taps, float* __restrict__ ring,
                              const int* __restrict__ start, const float* __restrict__ b, const float* __restrict__ a,
                              const u16* __restrict__ ba_w, const float* __restrict__ x, int K,
                              const float* __restrict__ decay_rate, const float* __restrict__ dt_bias,
                              float* __restrict__ state, int record, float* __restrict__ prior,
                              float* __restrict__ row_inputs, float* __restrict__ out,
                              const float* __restrict__ z, const float* __restrict__ w, float eps, int sigmoid,
                              float* __restrict__ y, u16* y_bf16, signed char* y_q, float* y_scale, int forms,
                              int* __restrict__ arrivals, int T, int Hk, int Hv, int DV, int KW, long long in_stride,
                              float q_scale, long long ba_stride, long long z_stride) {
  constexpr int R = DK / 4;  // rows per thread
  __shared__ float qk[2][DK];
  __shared__ float scratch[WARP];
  __shared__ float ba[2][DENSE_MAX_T];  // b and a of this head a row, made here (K > 0)
  const int h = blockIdx.x, hk = h / (Hv / Hk);
  const int j = threadIdx.x / 4, part = threadIdx.x % 4;
  const int col = blockIdx.y * 32 + j;
  const int C = 2 * Hk * DK + Hv * DV, P = *start;
  const int q_channel = hk * DK + threadIdx.x, k_channel = (Hk + hk) * DK + threadIdx.x, v_channel = 2 * Hk * DK + h * DV + col;
  if (K > 0) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (warp < 2) {  // warp 0: in_proj_b's row h, warp 1: in_proj_a's
      float acc[DENSE_MAX_T];
      row_dots(ba_w + (size_t)(warp * Hv + h) * K, x, K, T, lane, acc);
#pragma unroll
      for (int t = 0; t < DENSE_MAX_T; ++t) {
        if (t < T) {
          const float sum = warp_sum(acc[t]);
          if (lane == 0) ba[warp][t] = sum;
        }
      }
    }
    __syncthreads();
  }
  float* S = state + (size_t)h * DK * DV;
  float s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = S[(size_t)(part + 4 * i) * DV + col];
  if (record) {
    float* before = prior + (size_t)h * DK * DV;
#pragma unroll
    for (int i = 0; i < R; ++i) before[(size_t)(part + 4 * i) * DV + col] = s[i];
  }

  for (int t = 0; t < T; ++t) {
    // this row's query and key, one element a thread (DK <= 128 = blockDim), normalised over the head;
    // block_sum's first barrier also ends the previous row's reads of qk
    const float qv = threadIdx.x < DK ? conv_silu(mixed, taps, ring, P, t, q_channel, C, KW, in_stride) : 0.0f;
    const float kv = threadIdx.x < DK ? conv_silu(mixed, taps, ring, P, t, k_channel, C, KW, in_stride) : 0.0f;
    const float q_norm = sqrtf(block_sum(qv * qv, scratch) + 1e-6f);
    const float k_norm = sqrtf(block_sum(kv * kv, scratch) + 1e-6f);
    if (threadIdx.x < DK) {
      qk[0][threadIdx.x] = qv / q_norm * q_scale;
      qk[1][threadIdx.x] = kv / k_norm;
    }
    __syncthreads();
    const float beta = sigmoid_f(K > 0 ? ba[0][t] : b[(size_t)t * ba_stride + h]);
    const float decay = expf(decay_rate[h] * softplus_f((K > 0 ? ba[1][t] : a[(size_t)t * ba_stride + h]) + dt_bias[h]));
    const float v = conv_silu(mixed, taps, ring, P, t, v_channel, C, KW, in_stride);
    delta_update(s, qk[1], part, decay, beta, v);
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < R; ++i) o += s[i] * qk[0][part + 4 * i];
    o += __shfl_xor_sync(0xffffffffu, o, 1);
    o += __shfl_xor_sync(0xffffffffu, o, 2);
    if (part == 0) out[((size_t)t * Hv + h) * DV + col] = o;
    if (record) {  // the row's k, beta and e^g by the head's first block, v by every block's columns
      float* inputs = row_inputs + ((size_t)t * Hv + h) * ROW_INPUTS(DK, DV);
      if (blockIdx.y == 0 && threadIdx.x < DK) inputs[threadIdx.x] = qk[1][threadIdx.x];
      if (blockIdx.y == 0 && threadIdx.x == 0) {
        inputs[DK + DV] = beta;
        inputs[DK + DV + 1] = decay;
      }
      if (part == 0) inputs[DK + col] = v;
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i) S[(size_t)(part + 4 * i) * DV + col] = s[i];
  // the call's rows into the ring: rows no block of this launch reads (see conv_silu)
  if (h % (Hv / Hk) == 0 && blockIdx.y == 0 && threadIdx.x < DK) {
    conv_to_ring(mixed, ring, P, T, q_channel, C, in_stride);
    conv_to_ring(mixed, ring, P, T, k_channel, C, in_stride);
  }
  if (part == 0) conv_to_ring(mixed, ring, P, T, v_channel, C, in_stride);

  // the gated norm, by the head's last block: the others' o are visible once their arrivals are
  if (!last_to_arrive(arrivals + h, gridDim.y)) return;
  gated_norm(out, z, w, eps, sigmoid, y, y_bf16, y_q, y_scale, forms, T, Hv, DV, h, z_stride, scratch);
}

// __launch_bounds__(128, 4): four blocks an SM, up to 128 registers a thread; with the bare 128 ptxas held
// dk 128 at 72-80 registers and spilled.
#define DELTANET_ROWS(DK)                                                                                         \
  extern "C" __global__ void __launch_bounds__(128, 4) deltanet_rows_dk##DK(                                    \
      const float* mixed, const float* taps, float* ring, const int* start, const float* b, const float* a,       \
      const u16* ba_w, const float* x, int K, const float* decay_rate, const float* dt_bias, float* state,       \
      int record, float* prior, float* row_inputs, float* out, const float* z, const float* w, float eps,       \
      int sigmoid, float* y,                                                                                      \
      u16* y_bf16, signed char* y_q, float* y_scale, int forms, int* arrivals, int T, int Hk, int Hv, int DV,     \
      int KW, long long in_stride, float q_scale, long long ba_stride, long long z_stride) {                      \
    deltanet_rows<DK>(mixed, taps, ring, start, b, a, ba_w, x, K, decay_rate, dt_bias, state, record, prior,     \
                      row_inputs, out, z,                                                                         \
                      w, eps, sigmoid, y, y_bf16, y_q, y_scale, forms, arrivals, T, Hk, Hv, DV, KW, in_stride,    \
                      q_scale, ba_stride, z_stride);                                                              \
  }
DELTANET_ROWS(32)
DELTANET_ROWS(64)
DELTANET_ROWS(128)

// deltanet_keep: a verify's rollback to its first `rows` rows: S = prior, then rows 0 .. rows - 1 of
// row_inputs [*, Hv, ROW_INPUTS(DK, DV)] through delta_update, as deltanet_rows ran them (same blocks,
// same threads a column part, same code: the bits it had after row rows - 1). S, prior [Hv, DK, DV].
// Launch: grid (Hv, DV / 32), block 128.
template <int DK>
__device__ void deltanet_keep(const float* __restrict__ prior, const float* __restrict__ row_inputs,
                              float* __restrict__ state, int rows, int Hv, int DV) {
  constexpr int R = DK / 4;
  __shared__ float k[DK];
  const int h = blockIdx.x, j = threadIdx.x / 4, part = threadIdx.x % 4, col = blockIdx.y * 32 + j;
  const float* before = prior + (size_t)h * DK * DV;
  float s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = before[(size_t)(part + 4 * i) * DV + col];
  for (int t = 0; t < rows; ++t) {
    const float* inputs = row_inputs + ((size_t)t * Hv + h) * ROW_INPUTS(DK, DV);
    __syncthreads();  // the previous row's reads of k are done
    if (threadIdx.x < DK) k[threadIdx.x] = inputs[threadIdx.x];
    __syncthreads();
    delta_update(s, k, part, inputs[DK + DV + 1], inputs[DK + DV], inputs[DK + col]);
  }
  float* S = state + (size_t)h * DK * DV;
#pragma unroll
  for (int i = 0; i < R; ++i) S[(size_t)(part + 4 * i) * DV + col] = s[i];
}

#define DELTANET_KEEP(DK)                                                                                         \
  extern "C" __global__ void __launch_bounds__(128, 4) deltanet_keep_dk##DK(                                    \
      const float* prior, const float* row_inputs, float* state, int rows, int Hv, int DV) {                     \
    deltanet_keep<DK>(prior, row_inputs, state, rows, Hv, DV);                                                   \
  }
DELTANET_KEEP(32)
DELTANET_KEEP(64)
DELTANET_KEEP(128)
