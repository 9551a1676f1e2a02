// Norms, RoPE and gates of the Qwen3.5 forward, fused where one row's data meets (engine/model.py:
// rms_norm, apply_rope, l2_normalize, silu, sigmoid). All fp32; one block per row unless noted.
#include "common.cuh"

// y = x / sqrt(mean(x^2) + eps) * w over rows of D (zero-centred norms pass w = 1 + weight). w holds
// weight_rows rows of D and row r takes w's row r % weight_rows: 1 for one weight, hc for Flash-Next's
// streams (x [T, hc * H] as rows of H: stream s of every token its own weight row). y also in the
// emitted forms (common.cuh). Launch: grid R, block 256.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                                    int D, int weight_rows, float eps,
                                    u16* y_bf16, signed char* y_q, float* y_scale, int forms) {
  __shared__ float scratch[WARP];
  const float* row = x + (size_t)blockIdx.x * D;
  const float* weight = w + (size_t)(blockIdx.x % weight_rows) * D;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) ss += row[i] * row[i];
  const float denom = sqrtf(block_sum(ss, scratch) / (float)D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = row[i] / denom * weight[i];
    y[(size_t)blockIdx.x * D + i] = v;
    emit_forms(v, (size_t)blockIdx.x * D + i, forms, y_bf16, y_q, y_scale);
  }
}

// A decoder layer's residual add and the norm after it: sum = x + delta (the new residual), y =
// sum / sqrt(mean(sum^2) + eps) * w, rows of D (w = 1 + weight), y also in the emitted forms
// (common.cuh; D % 32 == 0 when forms ask for int8). One pass instead of an add, a norm and the
// next Linear's conversion: two launches less and the residual read once. Launch: grid R, block 256.
extern "C" __global__ void add_rms_norm(const float* __restrict__ x, const float* __restrict__ delta,
                                        const float* __restrict__ w, float* __restrict__ sum, float* __restrict__ y,
                                        int D, float eps,
                                        u16* y_bf16, signed char* y_q, float* y_scale, int forms) {
  __shared__ float scratch[WARP];
  const size_t base = (size_t)blockIdx.x * D;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = x[base + i] + delta[base + i];
    sum[base + i] = v;
    ss += v * v;
  }
  const float denom = sqrtf(block_sum(ss, scratch) / (float)D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = sum[base + i] / denom * w[i];
    y[base + i] = v;
    emit_forms(v, base + i, forms, y_bf16, y_q, y_scale);
  }
}

// Attention q and k heads: zero-centred RMSNorm over the head (w = 1 + weight), then NeoX RoPE on
// the first rotary_dim dims, pairs (i, i + rotary_dim / 2), angle = position * inv_freq[i] in fp32
// (inv_freq as the CPU's rope_tables computes it, uploaded once). The position of row t is
// *start + t, read on the device so a captured graph replays at any position.
// Blocks h < q_heads take query head h of row t at xq + t * q_row_stride + h * q_head_stride
// (q_proj packs [query | gate] per head) with wq into yq [T, q_heads, D]; the rest key head
// j = h - q_heads at xk + t * k_row_stride + j * D with wk: both sets in one launch (no key heads:
// queries only). The keys go to yk [T, k_heads, D], or with APPEND straight into a bf16 cache
// [k_heads, capacity, D] at index *cache_start + t, beside the value head j of row t read at
// v + t * v_row_stride + j * D (kv_append_bf16's rounding, a launch less a layer).
// Launch: grid (q_heads + k_heads, T), block D (64 .. 256).
template <bool APPEND>
__device__ void qk_heads(const float* __restrict__ xq, const float* __restrict__ xk, const float* __restrict__ wq,
                         const float* __restrict__ wk, const float* __restrict__ inv_freq, const int* __restrict__ start,
                         float* __restrict__ yq, float* __restrict__ yk, int D, long long q_row_stride,
                         long long k_row_stride, int q_heads, int q_head_stride, int rotary_dim, float eps,
                         const float* __restrict__ v, long long v_row_stride, u16* __restrict__ keys,
                         u16* __restrict__ values, const int* __restrict__ cache_start, int capacity) {
  __shared__ float scratch[WARP];
  __shared__ float normed[256];
  const int h = blockIdx.x, t = blockIdx.y, i = threadIdx.x;
  const bool query = h < q_heads;
  const int head = query ? h : h - q_heads, heads = query ? q_heads : gridDim.x - q_heads;
  const float x = query ? xq[(size_t)t * q_row_stride + (size_t)head * q_head_stride + i]
                        : xk[(size_t)t * k_row_stride + (size_t)head * D + i];
  const float y = norm_rope_head(x, query ? wq : wk, inv_freq, *start + t, D, rotary_dim, eps, scratch, normed);
  if (query || !APPEND) {
    (query ? yq : yk)[((size_t)t * heads + head) * D + i] = y;
    return;
  }
  const size_t at = ((size_t)head * capacity + *cache_start + t) * D + i;
  keys[at] = f32_to_bf16(y);
  values[at] = f32_to_bf16(v[(size_t)t * v_row_stride + (size_t)head * D + i]);
}

extern "C" __global__ void qk_norm_rope(const float* xq, const float* xk, const float* wq, const float* wk,
                                        const float* inv_freq, const int* start, float* yq, float* yk, int D,
                                        long long q_row_stride, long long k_row_stride, int q_heads,
                                        int q_head_stride, int rotary_dim, float eps) {
  qk_heads<false>(xq, xk, wq, wk, inv_freq, start, yq, yk, D, q_row_stride, k_row_stride, q_heads, q_head_stride,
                  rotary_dim, eps, nullptr, 0, nullptr, nullptr, nullptr, 0);
}

extern "C" __global__ void qk_norm_rope_append_bf16(const float* xq, const float* xk, const float* wq, const float* wk,
                                                    const float* inv_freq, const int* start, float* yq, int D,
                                                    long long q_row_stride, long long k_row_stride, int q_heads,
                                                    int q_head_stride, int rotary_dim, float eps, const float* v,
                                                    long long v_row_stride, u16* keys, u16* values,
                                                    const int* cache_start, int capacity) {
  qk_heads<true>(xq, xk, wq, wk, inv_freq, start, yq, nullptr, D, q_row_stride, k_row_stride, q_heads, q_head_stride,
                 rotary_dim, eps, v, v_row_stride, keys, values, cache_start, capacity);
}

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]: the SwiGLU of a fused gate|up product, also
// in the emitted forms (the down projection's input, common.cuh; n % 32 == 0, I % 32 == 0 when forms
// ask for int8: whole warps leave together).
extern "C" __global__ void silu_mul(const float* __restrict__ gate_up, float* __restrict__ out, int I, long long n,
                                    u16* y_bf16, signed char* y_q, float* y_scale, int forms) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  const long long t = idx / I, i = idx % I;
  const float v = silu_f(gate_up[t * 2 * I + i]) * gate_up[t * 2 * I + I + i];
  out[idx] = v;
  emit_forms(v, idx, forms, y_bf16, y_q, y_scale);
}

// Gated attention output: out[t, h, i] = attn[t, h, i] * sigmoid(gate), the gate being the second
// half of query head h's [query | gate], read in place from the stacked projection's rows
// (q_and_gate + t * row_stride + h * 2D).
// Also in the emitted forms (o_proj's input, common.cuh; heads * D % 32 == 0 when forms ask for int8).
extern "C" __global__ void attention_gate(const float* __restrict__ attn, const float* __restrict__ q_and_gate,
                                          float* __restrict__ out, int D, int heads, long long row_stride, long long n,
                                          u16* y_bf16, signed char* y_q, float* y_scale, int forms) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  const long long t = idx / ((long long)heads * D), h = idx / D % heads, i = idx % D;
  const float v = attn[idx] * sigmoid_f(q_and_gate[t * row_stride + h * 2 * D + D + i]);
  out[idx] = v;
  emit_forms(v, idx, forms, y_bf16, y_q, y_scale);
}
