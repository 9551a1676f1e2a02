// Gated DeltaNet for short calls (a decode step or a verify of 1 + k rows): the causal depthwise
// conv and the recurrent rule token by token, keeping the state after every row so the verify can
// roll back to any row (engine/model.py causal_conv, delta_rule_rows; engine/cache.py).
#include "common.cuh"

// ------------------------------------------------------------------------- causal conv ---
// mixed [T, C] (in_proj_qkv's output; row t at mixed + t * in_stride, so it may sit inside the
// wider rows of the whole in_proj output), taps [C, KW] oldest input first, conv_state [KW-1, C].
// window [KW-1+T, C] <- conv_state rows then mixed rows (kept for a rollback: the state after row
// n is window[n : n + KW-1]); out[t, c] = silu(sum_j window[t + j, c] * taps[c, j]), summed
// j = 0, 1, ... with separate multiply and add roundings as numpy does them; conv_state <- the
// last KW-1 window rows. One thread per channel. Launch: grid ceil(C / 256), block 256.
extern "C" __global__ void causal_conv_silu(const float* __restrict__ mixed, const float* __restrict__ taps,
                                            float* __restrict__ conv_state, float* __restrict__ window,
                                            float* __restrict__ out, int T, int C, int KW, long long in_stride) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int j = 0; j < KW - 1; ++j) window[(size_t)j * C + c] = conv_state[(size_t)j * C + c];
  for (int t = 0; t < T; ++t) window[(size_t)(KW - 1 + t) * C + c] = mixed[(size_t)t * in_stride + c];
  for (int t = 0; t < T; ++t) {
    float sum = 0.0f;
    for (int j = 0; j < KW; ++j) sum = __fadd_rn(sum, __fmul_rn(window[(size_t)(t + j) * C + c], taps[c * KW + j]));
    out[(size_t)t * C + c] = silu_f(sum);
  }
  for (int j = 0; j < KW - 1; ++j) conv_state[(size_t)j * C + c] = window[(size_t)(T + j) * C + c];
}

// --------------------------------------------------------------------- recurrent rule ---
// Per value head h (key head h / (Hv / Hk), repeat-interleave) and row t:
//   beta = sigmoid(b[t, h]);  g = decay_rate[h] * softplus(a[t, h] + dt_bias[h])
//   S = e^g S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q
// q and k are read raw from the conv output, row t at qk + t * qk_stride (key head hk's query at
// column hk * DK, its key at (Hk + hk) * DK), and L2-normalised here (eps 1e-6; q also times q_scale =
// DK^-0.5), as engine/backend/cpu_ops.l2_normalize: no launch of their own. v [T, Hv, DV] with row t
// at v + t * v_stride, b and a [T, Hv] with row t at + t * ba_stride (all read in place from wider
// rows: the conv output, the in_proj output); S [Hv, DK, DV] fp32, updated in place; snapshots
// [T, Hv, DK, DV] receives S after every row; out [T, Hv, DV].
//
// A block owns 32 value columns of one head: thread (j = tid / 4, part = tid % 4) holds column j's
// rows part, part + 4, ..., in registers for the whole call, so S is read once and written once
// (plus the snapshots). The four parts of a column are adjacent lanes: S^T k and S^T q are two
// shuffles. For a fixed register the warp touches 4 rows x 8 consecutive columns: whole 32-byte
// sectors. Launch: grid (Hv, DV / 32), block 128.
template <int DK>
__device__ void deltanet_rows(const float* __restrict__ qk_rows, const float* __restrict__ v,
                              const float* __restrict__ b, const float* __restrict__ a,
                              const float* __restrict__ decay_rate, const float* __restrict__ dt_bias,
                              float* __restrict__ state, float* __restrict__ snapshots, float* __restrict__ out,
                              int T, int Hk, int Hv, int DV, long long qk_stride, float q_scale, long long v_stride,
                              long long ba_stride) {
  constexpr int R = DK / 4;  // rows per thread
  __shared__ float qk[2][DK];
  __shared__ float scratch[WARP];
  const int h = blockIdx.x, hk = h / (Hv / Hk);
  const int j = threadIdx.x / 4, part = threadIdx.x % 4;
  const int col = blockIdx.y * 32 + j;
  float* S = state + (size_t)h * DK * DV;
  float s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = S[(size_t)(part + 4 * i) * DV + col];

  for (int t = 0; t < T; ++t) {
    // this row's query and key, one element a thread (DK <= 128 = blockDim), normalised over the head;
    // block_sum's first barrier also ends the previous row's reads of qk
    const float* row = qk_rows + (size_t)t * qk_stride;
    const float qv = threadIdx.x < DK ? row[(size_t)hk * DK + threadIdx.x] : 0.0f;
    const float kv = threadIdx.x < DK ? row[(size_t)(Hk + hk) * DK + threadIdx.x] : 0.0f;
    const float q_norm = sqrtf(block_sum(qv * qv, scratch) + 1e-6f);
    const float k_norm = sqrtf(block_sum(kv * kv, scratch) + 1e-6f);
    if (threadIdx.x < DK) {
      qk[0][threadIdx.x] = qv / q_norm * q_scale;
      qk[1][threadIdx.x] = kv / k_norm;
    }
    __syncthreads();
    const float beta = sigmoid_f(b[(size_t)t * ba_stride + h]);
    const float decay = expf(decay_rate[h] * softplus_f(a[(size_t)t * ba_stride + h] + dt_bias[h]));
    float pred = 0.0f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      s[i] *= decay;
      pred += s[i] * qk[1][part + 4 * i];
    }
    pred += __shfl_xor_sync(0xffffffffu, pred, 1);
    pred += __shfl_xor_sync(0xffffffffu, pred, 2);
    const float u = (v[(size_t)t * v_stride + (size_t)h * DV + col] - pred) * beta;
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      s[i] += qk[1][part + 4 * i] * u;
      o += s[i] * qk[0][part + 4 * i];
    }
    o += __shfl_xor_sync(0xffffffffu, o, 1);
    o += __shfl_xor_sync(0xffffffffu, o, 2);
    if (part == 0) out[((size_t)t * Hv + h) * DV + col] = o;
    float* snap = snapshots + ((size_t)t * Hv + h) * DK * DV;
#pragma unroll
    for (int i = 0; i < R; ++i) snap[(size_t)(part + 4 * i) * DV + col] = s[i];
  }
#pragma unroll
  for (int i = 0; i < R; ++i) S[(size_t)(part + 4 * i) * DV + col] = s[i];
}

#define DELTANET_ROWS(DK)                                                                                   \
  extern "C" __global__ void __launch_bounds__(128) deltanet_rows_dk##DK(                                  \
      const float* qk, const float* v, const float* b, const float* a, const float* decay_rate,             \
      const float* dt_bias, float* state, float* snapshots, float* out, int T, int Hk, int Hv, int DV,      \
      long long qk_stride, float q_scale, long long v_stride, long long ba_stride) {                        \
    deltanet_rows<DK>(qk, v, b, a, decay_rate, dt_bias, state, snapshots, out, T, Hk, Hv, DV, qk_stride,    \
                      q_scale, v_stride, ba_stride);                                                        \
  }
DELTANET_ROWS(32)
DELTANET_ROWS(64)
DELTANET_ROWS(128)
