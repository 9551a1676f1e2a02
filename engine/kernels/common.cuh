// Shared device helpers for duet's kernels. No CUDA headers are included: bf16 and fp16 values
// travel as their bit patterns (uint16 / packed uint32) and every conversion is one PTX
// instruction, so NVRTC needs no include path beyond this folder and the code means the same
// under NVRTC and nvcc.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

#define WARP 32
#define NEG_INF __int_as_float(0xff800000u)

// ---------------------------------------------------------------------------------- loads ---

// A streamed weight is read exactly once per pass: `.nc` takes the read-only (texture) path and
// `L1::no_allocate` keeps it from evicting the activations and scales that every warp re-reads
// from L1. 16 bytes per thread per instruction is the widest global load.
__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ u32 ld_stream_u32(const void* p) {
  u32 r;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ u32 ld_stream_u16(const void* p) {
  u16 r;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}

// ----------------------------------------------------------------------- float formats ---

// bf16 is the top half of an fp32: widening is a shift, exact.
__device__ __forceinline__ float bf16_to_f32(u32 bits16) { return __uint_as_float(bits16 << 16); }

// fp32 -> bf16 bits, round to nearest even (what engine.quant.activation.f32_to_bf16_bits does).
__device__ __forceinline__ u16 f32_to_bf16(float x) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

// Two fp32 -> one bf16x2 register: `lo` lands in bits 0..15, `hi` in 16..31.
__device__ __forceinline__ u32 f32x2_to_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float f16_to_f32(u16 bits) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(bits));
  return r;
}

__device__ __forceinline__ u16 f32_to_f16(float x) {
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

// ----------------------------------------------------------------------- bit tricks ---

// lop3 evaluates any 3-input boolean function in one instruction; the immediate is the truth
// table of f(a, b, c) on a = 0xF0, b = 0xCC, c = 0xAA. (a & b) | c -> (0xF0 & 0xCC) | 0xAA = 0xEA.
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// W4 nibble pair -> two exact bf16 levels (REFERENCE.md section 3). `word` holds eight nibbles,
// input 8j + i at bits 4i..4i+3 stored as u = level + 8. For i in 0..3,
//   (word >> 4i) & 0x000F000F | 0x43004300
// puts u_i in the low mantissa bits of a bf16 128.0 (0x4300) in the low half, u_{i+4} in the high
// half: bf16 spacing at 128 is exactly 1, so the halves ARE 128 + u_i and 128 + u_{i+4}. One
// fma.rn.bf16x2 with 1.0 (0x3F80) and -136.0 (0xC308) subtracts 136 = 128 + 8 exactly, giving the
// signed levels u - 8 in -8..7. Two instructions per pair; the halves hold inputs i and i + 4.
__device__ __forceinline__ u32 w4_pair_bf16x2(u32 word, int i) {
  u32 biased = and_or(word >> (4 * i), 0x000F000Fu, 0x43004300u);
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(biased), "r"(0x3F803F80u), "r"(0xC308C308u));
  return r;
}

// Byte permute: result byte i = byte sel_i of the 8-byte value {hi:lo} (sel nibble i, 0..7).
__device__ __forceinline__ u32 prmt(u32 lo, u32 hi, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(sel));
  return r;
}

// ------------------------------------------------------------------------ reductions ---

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : NEG_INF;
  return warp_max(v);
}

// One head of D values, a value a thread (blockDim.x == D, at most 256): the zero-centred RMSNorm
// (w = 1 + weight), then NeoX RoPE on the first rotary_dim dims, pairs (i, i + rotary_dim / 2), angle
// = position * inv_freq[i] in fp32 (inv_freq as the CPU's rope_tables computes it). Returns this
// thread's element; `normed` is the block's shared [256] scratch of the normed head. Attention's
// q and k heads (qk_norm_rope) and Flash-Next's pooled index keys (index_pool) both go through it.
__device__ __forceinline__ float norm_rope_head(float v, const float* __restrict__ w, const float* __restrict__ inv_freq,
                                                int position, int D, int rotary_dim, float eps, float* scratch,
                                                float* normed) {
  const int i = threadIdx.x;
  const float denom = sqrtf(block_sum(v * v, scratch) / (float)D + eps);
  normed[i] = v / denom * w[i];
  __syncthreads();
  const int half = rotary_dim / 2;
  float r = normed[i];
  if (i < rotary_dim) {
    const float angle = (float)position * inv_freq[i % half];
    const float c = cosf(angle), s = sinf(angle);
    r = i < half ? normed[i] * c - normed[i + half] * s : normed[i] * c + normed[i - half] * s;
  }
  return r;
}


// ------------------------------------------------------------------ scalar functions ---
// The CPU forward's definitions (engine/model.py), in fp32.

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
// log(1 + e^x) as numpy's logaddexp(0, x): max + log1p(exp(-|x|)).
__device__ __forceinline__ float softplus_f(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }

// ------------------------------------------------------------------ emitted activations ---
// A Linear's input written by the kernel that makes it, beside its fp32 value, in the forms the
// op set's Linears read (engine/backend/cupy_backend.py Activations), so no Linear launches a
// conversion: forms & EMIT_BF16: bf16 bits (the w4a16 route's rounding, f32_to_bf16_bits');
// forms & EMIT_INT8: int8 codes and a scale per 32 (quantize_int8_blocks', bit for bit). idx is
// the value's index in the row-major [T, K] output; the 32 lanes of a warp must hold the 32 values
// of one 32-block (K % 32 == 0 and consecutive indices per warp), all of them active.
#define EMIT_BF16 1
#define EMIT_INT8 2

__device__ __forceinline__ void emit_forms(float v, size_t idx, int forms, u16* __restrict__ bf16,
                                           signed char* __restrict__ q, float* __restrict__ scale) {
  if (forms & EMIT_BF16) bf16[idx] = f32_to_bf16(v);
  if (forms & EMIT_INT8) {
    const float s = warp_max(fabsf(v)) / 127.0f;
    const float safe = s > 0.0f ? s : 1.0f;  // an all-zero block: scale 0, codes 0
    q[idx] = (signed char)rintf(v / safe);
    if (threadIdx.x % WARP == 0) scale[idx / 32] = s;
  }
}

// ---------------------------------------------------------------------------- bf16 rows ---
// A warp's dot products of one bf16 weight row with up to DENSE_MAX_T fp32 token rows (dense.cu's
// bf16_gemv; DeltaNet's in_proj_b/a rows in its own launch): lane l reads inputs 8l .. 8l + 7 of
// every 256 (one 16-byte load of bf16 bits, widened exactly) and keeps a running sum a token.
#define DENSE_MAX_T 16

// This lane's share of weight row wr [K] times x's T rows into acc[t] (summed over lanes by the caller).
__device__ __forceinline__ void row_dots(const u16* __restrict__ wr, const float* __restrict__ x, int K, int T,
                                         int lane, float* acc) {
#pragma unroll
  for (int t = 0; t < DENSE_MAX_T; ++t) acc[t] = 0.0f;
  for (int k = 8 * lane; k < K; k += 8 * WARP) {
    const uint4 bits = ld_stream_u4(wr + k);
    const u32 pairs[4] = {bits.x, bits.y, bits.z, bits.w};
    float wv[8];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      wv[2 * p] = __uint_as_float(pairs[p] << 16);  // bf16 is fp32's top half: exact
      wv[2 * p + 1] = __uint_as_float(pairs[p] & 0xFFFF0000u);
    }
#pragma unroll
    for (int t = 0; t < DENSE_MAX_T; ++t) {
      if (t < T) {
        const float4 lo = *reinterpret_cast<const float4*>(x + (size_t)t * K + k);
        const float4 hi = *reinterpret_cast<const float4*>(x + (size_t)t * K + k + 4);
        acc[t] += wv[0] * lo.x + wv[1] * lo.y + wv[2] * lo.z + wv[3] * lo.w + wv[4] * hi.x + wv[5] * hi.y +
                  wv[6] * hi.z + wv[7] * hi.w;
      }
    }
  }
}

// Launch: grid ceil(N / DENSE_WARPS), block 32 * DENSE_WARPS; K % 8 == 0, 1 <= T <= 16; x fp32 [T, K]
// contiguous, out fp32 [T, N].

// ----------------------------------------------------------------- last block to arrive ---
// Whether this block is the last of `blocks` to arrive at *count (the same answer in every thread).
// The block's writes before the call reach device scope before it counts (threadfence), so the last
// one sees every other block's (read them past L1: __ldcg); it sets *count back to 0 for the next
// launch (a captured graph replays the same counts). Every thread of the block calls it.
__device__ __forceinline__ bool last_to_arrive(int* count, int blocks) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(count, 1) == blocks - 1;
  __syncthreads();
  if (!last) return false;
  __threadfence();
  if (threadIdx.x == 0) *count = 0;
  return true;
}

// ------------------------------------------------------------------ 16-row tile sums ---
// The sums of a block's 16-row tile (rows 16 blockIdx.x ..) from its warps' mma accumulators (C
// layout, gid = lane / 4, tig = lane % 4: acc[n][0], acc[n][1] row gid, tokens 8n + 2tig, 8n + 2tig + 1;
// acc[n][2], acc[n][3] row gid + 8), added in warp order, into `sum` for thread (r = threadIdx.x / 16,
// t = threadIdx.x % 16): row r of the tile, token t. With gridDim.y splits of the groups, each split
// writes its sums into partial (splits x [T, N]) and the tile's last split to arrive
// (arrivals[blockIdx.x]) sums them in split order. Returns false in a block with nothing left to do.
// Blocks of 256 threads.
template <int WARPS, int TILES>
__device__ __forceinline__ bool tile_sums(const float (&acc)[TILES][4], float (&red)[WARPS][16][16],
                                          float* __restrict__ partial, int* __restrict__ arrivals, int N, int T,
                                          float& sum) {
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, gid = lane / 4, tig = lane % 4;
#pragma unroll
  for (int n = 0; n < TILES; ++n) {
    red[warp][gid][8 * n + 2 * tig] = acc[n][0];
    red[warp][gid][8 * n + 2 * tig + 1] = acc[n][1];
    red[warp][gid + 8][8 * n + 2 * tig] = acc[n][2];
    red[warp][gid + 8][8 * n + 2 * tig + 1] = acc[n][3];
  }
  __syncthreads();
  const int r = threadIdx.x / 16, t = threadIdx.x % 16;
  const bool mine = t < T && t < 8 * TILES;
  const size_t at = (size_t)t * N + blockIdx.x * 16 + r;
  sum = 0.0f;
  if (mine)
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += red[w][r][t];
  if (gridDim.y == 1) return true;
  if (mine) partial[(size_t)blockIdx.y * T * N + at] = sum;
  if (!last_to_arrive(arrivals + blockIdx.x, gridDim.y)) return false;
  sum = 0.0f;
  if (mine)
    for (int s = 0; s < (int)gridDim.y; ++s) sum += __ldcg(partial + (size_t)s * T * N + at);
  return true;
}
