// bf16 route ("float"): y[t, n] = sum_k w[n, k] * x[t, k] for 1..16 token rows t per weight read,
// the weights bf16 as the checkpoint stores them (half fp32's bytes on the card and a pass), each
// widened exactly to fp32 and multiplied with the fp32 activations, fp32 sums: the CPU's
// BF16Linear numerics (engine/backend/compiled.py), up to the order of the sums.
//
// A warp owns a weight row: lane l reads inputs 8l .. 8l + 7 of every 256 (one 16-byte load of
// bf16 bits; the x rows two 16-byte loads each, from L1/L2: every warp of the block reads them)
// and keeps one running sum per token, adding a chunk's 8 products at a time in k order (common.cuh's
// row_dots); the lanes' sums meet in a fixed shuffle tree, so a row's bits never depend on the other
// rows or T.
#include "common.cuh"

#define DENSE_WARPS 8

extern "C" __global__ void __launch_bounds__(256) bf16_gemv(const u16* __restrict__ w, const float* __restrict__ x,
                                                            float* __restrict__ out, int N, int K, int T) {
  const int lane = threadIdx.x % WARP, row = blockIdx.x * DENSE_WARPS + threadIdx.x / WARP;
  if (row >= N) return;  // whole warps leave together
  float acc[DENSE_MAX_T];
  row_dots(w + (size_t)row * K, x, K, T, lane, acc);
#pragma unroll
  for (int t = 0; t < DENSE_MAX_T; ++t) {
    if (t < T) {
      const float sum = warp_sum(acc[t]);
      if (lane == 0) out[(size_t)t * N + row] = sum;
    }
  }
}

// An MLP's gate | up [2I, K]: a warp takes feature f's gate row f and up row I + f and writes
// silu(gate) * up into out [T, I] (silu_mul's step: no launch of its own). Launch: grid
// ceil(I / DENSE_WARPS), block 32 * DENSE_WARPS; as bf16_gemv otherwise.
extern "C" __global__ void __launch_bounds__(256) bf16_swiglu(const u16* __restrict__ w, const float* __restrict__ x,
                                                              float* __restrict__ out, int I, int K, int T) {
  const int lane = threadIdx.x % WARP, feature = blockIdx.x * DENSE_WARPS + threadIdx.x / WARP;
  if (feature >= I) return;
  float gate[DENSE_MAX_T], up[DENSE_MAX_T];
  row_dots(w + (size_t)feature * K, x, K, T, lane, gate);
  row_dots(w + (size_t)(I + feature) * K, x, K, T, lane, up);
#pragma unroll
  for (int t = 0; t < DENSE_MAX_T; ++t) {
    if (t < T) {
      const float g = warp_sum(gate[t]), u = warp_sum(up[t]);
      if (lane == 0) out[(size_t)t * I + feature] = silu_f(g) * u;
    }
  }
}

// Token rows of a bf16 table, widened exactly: out[t, :] = table[ids[t], :] as fp32, one launch for
// the gather and the widening. Launch: grid T, block 256.
extern "C" __global__ void embed_bf16(const u16* __restrict__ table, const int* __restrict__ ids,
                                      float* __restrict__ out, int H) {
  const size_t row = (size_t)ids[blockIdx.x] * H, at = (size_t)blockIdx.x * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) out[at + i] = bf16_to_f32(table[row + i]);
}
