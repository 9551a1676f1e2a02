// W4A8 ("ampere" route): int8 activations against integer weight levels, integer dot products
// per block, fp32 rescale and sum (DESIGN.md contracts; CPU reference engine/backend/cpu.py
// W4A8Linear and TrellisLinear).
//
//   quantize_int8_blocks   x fp32 [T, K] -> q int8 [T, K], scale fp32 [T, K/32]
//                          scale = absmax / 127, q = rint(x / scale) (ties to even), as
//                          engine/quant/activation.py, bit for bit (IEEE division, no fma).
//   rotate_quantize_int8   the trellis route's activations: each 128-block times diag(signs) and
//                          the Walsh-Hadamard butterflies (the CPU's order of adds, so the
//                          rotation is bit-identical), / sqrt(128), then int8 per 128-block.
//   int8_gemv_<codec>      y [T, N] for T <= 16 from weights decoded to int8 per 32-input unit:
//                          y[t, n] = sum_u dot_u(levels, q[t]) * (wscale[n, u] * ascale[t, u]).
//   trellis_gemv           y[t, n] = row_scale[n] * sum_b ascale[t, b] * dot_b(levels, q[t]),
//                          levels decoded from the tile streams by the 1MAD + dp4a trick.
#include "common.cuh"

#define MAX_T 16  // token rows per weight read (a decode step or a verify of 1 + 15 drafts)

// --------------------------------------------------------------- activation quantization ---

// One warp per 32-input block, one input per lane. Launch: blocks of 256 threads, T * K / 32 warps.
extern "C" __global__ void quantize_int8_blocks(const float* __restrict__ x, signed char* __restrict__ q,
                                                float* __restrict__ scale, long long n_blocks) {
  const long long block = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
  if (block >= n_blocks) return;  // whole warps leave together: n_blocks counts warps
  const float v = x[block * 32 + threadIdx.x % WARP];
  const float s = warp_max(fabsf(v)) / 127.0f;
  const float safe = s > 0.0f ? s : 1.0f;  // an all-zero block: scale 0, codes 0
  q[block * 32 + threadIdx.x % WARP] = (signed char)rintf(v / safe);
  if (threadIdx.x % WARP == 0) scale[block] = s;
}

// One warp per 128-block; lane L holds inputs 4L .. 4L+3. The CPU's butterflies
// (trellis._hadamard_blocks) run stages half = 1, 2, 4, ..., 64 and replace (a, b) = (y[i],
// y[i + half]) by (a + b, a - b) for every i with bit `half` clear. Stages 1 and 2 pair inputs
// inside a lane; stages 4..64 pair lane L with lane L ^ (half / 4), the lower lane keeping a + b
// and the upper one a - b with a the lower's value: the same operands in the same order, so the
// same fp32 results.
extern "C" __global__ void rotate_quantize_int8(const float* __restrict__ x, const float* __restrict__ signs,
                                                signed char* __restrict__ q, float* __restrict__ scale,
                                                long long n_blocks, int K) {
  const long long block = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
  if (block >= n_blocks) return;
  const int lane = threadIdx.x % WARP;
  const long long base = block * 128 + 4 * lane;
  const int col = (int)(base % K);  // the signs run along K
  float y[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) y[i] = x[base + i] * signs[col + i];
  // half = 1 and 2: within the lane
  float a = y[0] + y[1], b = y[0] - y[1], c = y[2] + y[3], d = y[2] - y[3];
  y[0] = a + c; y[1] = b + d; y[2] = a - c; y[3] = b - d;
#pragma unroll
  for (int half_lanes = 1; half_lanes < WARP; half_lanes <<= 1) {
    const bool upper = lane & half_lanes;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float other = __shfl_xor_sync(0xffffffffu, y[i], half_lanes);
      y[i] = upper ? other - y[i] : y[i] + other;
    }
  }
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    y[i] = y[i] * 0.08838834764831845f;  // float32(1 / sqrt(128)), as the CPU's constant
    m = fmaxf(m, fabsf(y[i]));
  }
  const float s = warp_max(m) / 127.0f;
  const float safe = s > 0.0f ? s : 1.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) q[base + i] = (signed char)rintf(y[i] / safe);
  if (lane == 0) scale[block] = s;
}

// ------------------------------------------------------------------------ weight codecs ---
// Each codec decodes 32-input unit u of one weight row into eight int8x4 words, inputs 4i..4i+3
// in word i (natural order, matching the activation's bytes), and returns the unit's fp32 scale.
// `row` is the row's first byte; `scales` the row's scale words (scale_words(K) of them a row).
// GGUF blocks are not streamed as the file stores them (34- and 18-byte blocks put a unit's bytes at
// 2-byte boundaries): at upload they become a quant plane, each unit's bytes 16-byte aligned and read
// with 16-byte loads as W4's are, and a plane of scale words (cupy_backend.gguf_planes).

// Per byte a - b mod 256: nibble - 8 as a two's-complement int8 in every byte at once.
__device__ __forceinline__ u32 sub8_bytes(u32 v) { return __vsub4(v, 0x08080808u); }

// A W4 word (inputs 0..7 at bits 4i, each level + 8) as two int8x4: inputs 0..3 and 4..7.
__device__ __forceinline__ void w4_word_levels(u32 word, u32& first, u32& second) {
  const u32 even = word & 0x0F0F0F0Fu;         // inputs 0, 2, 4, 6 of the word, one per byte
  const u32 odd = (word >> 4) & 0x0F0F0F0Fu;   // inputs 1, 3, 5, 7
  first = sub8_bytes(prmt(even, odd, 0x5140));   // bytes: even0 odd0 even1 odd1 = inputs 0..3
  second = sub8_bytes(prmt(even, odd, 0x7362));  // inputs 4..7
}

struct W4Codec {  // engine W4 layout: word j holds inputs 8j + i at bits 4i; bf16 scale per 128
  static __device__ __forceinline__ int scale_words(int K) { return K / 128; }
  static __device__ __forceinline__ float decode(const u8* row, const u16* scales, int u, u32* lv) {
    const uint4 w = ld_stream_u4(row + 16 * u);
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) w4_word_levels(words[j], lv[2 * j], lv[2 * j + 1]);
    return bf16_to_f32(ld_stream_u16(scales + u / 4));
  }
};

struct Q8_0Codec {  // planes: the 32 int8 levels of a unit (32 bytes), its f16 scale d
  static __device__ __forceinline__ int scale_words(int K) { return K / 32; }
  static __device__ __forceinline__ float decode(const u8* row, const u16* scales, int u, u32* lv) {
    const uint4 a = ld_stream_u4(row + 32 * u), b = ld_stream_u4(row + 32 * u + 16);
    lv[0] = a.x; lv[1] = a.y; lv[2] = a.z; lv[3] = a.w;
    lv[4] = b.x; lv[5] = b.y; lv[6] = b.z; lv[7] = b.w;
    return f16_to_f32(ld_stream_u16(scales + u));
  }
};

struct Q4_0Codec {  // planes: a unit's 16 bytes (input k < 16 the low nibble of byte k, k >= 16 the high of k - 16), f16 d
  static __device__ __forceinline__ int scale_words(int K) { return K / 32; }
  static __device__ __forceinline__ float decode(const u8* row, const u16* scales, int u, u32* lv) {
    const uint4 w = ld_stream_u4(row + 16 * u);
    const u32 qs[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lv[i] = sub8_bytes(qs[i] & 0x0F0F0F0Fu);
      lv[4 + i] = sub8_bytes((qs[i] >> 4) & 0x0F0F0F0Fu);
    }
    return f16_to_f32(ld_stream_u16(scales + u));
  }
};

// IQ4_XS's 16 non-uniform levels (gguf_blocks.IQ4_KVALUES) as four little-endian int8x4 words.
// A table lookup for four nibbles at once, with no local memory: prmt picks a byte out of 8 by a
// 3-bit selector, so entries 0..7 come from (tab0, tab1) and 8..15 from (tab2, tab3); bit 3 of
// each nibble chooses between the two per byte.
__device__ __forceinline__ u32 iq4_lookup(u32 nibbles) {  // one nibble (0..15) per byte
  const u32 low3 = nibbles & 0x07070707u;
  const u32 packed = low3 | (low3 >> 4);                      // byte selectors 0,1 in bits 0..7, 2,3 in 16..23
  const u32 sel = (packed & 0xFFu) | ((packed >> 8) & 0xFF00u);  // four 4-bit selectors
  const u32 from_low = prmt(0xBFAD9881u, 0xF6EADDCFu, sel);   // -127 -104 -83 -65 | -49 -35 -22 -10
  const u32 from_high = prmt(0x26190D01u, 0x71594535u, sel);  //    1   13  25  38 |  53  69  89 113
  const u32 high = ((nibbles >> 3) & 0x01010101u) * 0xFFu;    // 0xFF in bytes whose nibble is >= 8
  return (from_high & high) | (from_low & ~high);
}

struct IQ4_XSCodec {  // planes: a unit's 16 bytes of level indices (nibbles as Q4_0's); per 256 inputs five
                      // scale words: the f16 d, then the 8 units' ls - 32 as int8 bytes; scale d * (ls - 32)
  static __device__ __forceinline__ int scale_words(int K) { return 5 * (K / 256); }
  static __device__ __forceinline__ float decode(const u8* row, const u16* scales, int u, u32* lv) {
    const u16* block = scales + 5 * (u / 8);
    const int ls = reinterpret_cast<const signed char*>(block + 1)[u % 8];
    const uint4 w = ld_stream_u4(row + 16 * u);
    const u32 qs[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lv[i] = iq4_lookup(qs[i] & 0x0F0F0F0Fu);
      lv[4 + i] = iq4_lookup((qs[i] >> 4) & 0x0F0F0F0Fu);
    }
    return f16_to_f32(ld_stream_u16(block)) * (float)ls;
  }
};

// ------------------------------------------------------------------ int8 GEMV (dp4a) ---
// A warp takes INT8_WARP_ROWS consecutive weight rows, lane L units L, L + 32, ... of each, so a
// warp's loads cover 32 consecutive units (contiguous bytes) of a row and every activation load
// serves all its rows (at 16 tokens the activation loads were 32 of every 33 bytes a warp read).
// Per unit, row and token: eight dp4a (exact int32), one fp32 multiply by weight scale x activation
// scale (the product formed first, as the CPU does), one fp32 add; a row's lanes are summed at the
// end. A row's sums run in the same order whatever rows share its warp and however many tokens run.
#define INT8_WARP_ROWS 4

// This lane's share of the sums of weight rows n .. n + rows - 1 (rows <= R) for T <= MT token rows
// into acc[r][t] (summed over lanes by the caller). The _t4 kernels (MT = 4: a decode step, a short
// verify) hold 16 sums a lane, the _t16 ones 64: each has the registers its rows need.
template <class Codec, int R, int MT>
__device__ __forceinline__ void int8_rows_dots(const u8* __restrict__ weights, const u16* __restrict__ scales,
                                               long long row_bytes, const signed char* __restrict__ q,
                                               const float* __restrict__ ascale, int n, int rows, int K, int T,
                                               int lane, float (&acc)[R][MT]) {
  const int U = K / 32;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t) acc[r][t] = 0.0f;
  for (int u = lane; u < U; u += WARP) {
    u32 lv[R][8];
    float ws[R];
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r < rows) ws[r] = Codec::decode(weights + (n + r) * row_bytes, scales + (size_t)(n + r) * Codec::scale_words(K), u, lv[r]);
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      if (t < T) {
        const uint4* a = reinterpret_cast<const uint4*>(q + (size_t)t * K + 32 * u);
        const uint4 a0 = a[0], a1 = a[1];
        const float as = ascale[(size_t)t * U + u];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (r < rows) {
            int dot = __dp4a((int)lv[r][0], (int)a0.x, 0);
            dot = __dp4a((int)lv[r][1], (int)a0.y, dot);
            dot = __dp4a((int)lv[r][2], (int)a0.z, dot);
            dot = __dp4a((int)lv[r][3], (int)a0.w, dot);
            dot = __dp4a((int)lv[r][4], (int)a1.x, dot);
            dot = __dp4a((int)lv[r][5], (int)a1.y, dot);
            dot = __dp4a((int)lv[r][6], (int)a1.z, dot);
            dot = __dp4a((int)lv[r][7], (int)a1.w, dot);
            acc[r][t] += (float)dot * (ws[r] * as);
          }
        }
      }
    }
  }
}

template <class Codec, int MT>
__device__ void int8_gemv(const u8* __restrict__ weights, const u16* __restrict__ scales, long long row_bytes,
                          const signed char* __restrict__ q, const float* __restrict__ ascale,
                          float* __restrict__ out, int N, int K, int T) {
  const int lane = threadIdx.x % WARP;
  const int n = (blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP) * INT8_WARP_ROWS;
  if (n >= N) return;
  const int rows = min(INT8_WARP_ROWS, N - n);
  float acc[INT8_WARP_ROWS][MT];
  int8_rows_dots<Codec, INT8_WARP_ROWS, MT>(weights, scales, row_bytes, q, ascale, n, rows, K, T, lane, acc);
#pragma unroll
  for (int r = 0; r < INT8_WARP_ROWS; ++r) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      if (r < rows && t < T) {
        const float sum = warp_sum(acc[r][t]);
        if (lane == 0) out[(size_t)t * N + n + r] = sum;
      }
    }
  }
}

// An MLP's gate | up [2I, K] ending in SwiGLU: out[t, f] = silu(gate row f's sum) * (up row I + f's
// sum), each sum as int8_gemv makes it and silu_mul's step after (no silu_mul launch), also in the
// emitted forms (the down projection's input: an int8 block is 32 features, so a block of 8 warps
// takes 32 features, 4 a warp, and warp 0 emits them). I % 32 == 0.
template <class Codec, int MT>
__device__ void int8_swiglu(const u8* __restrict__ weights, const u16* __restrict__ scales, long long row_bytes,
                            const signed char* __restrict__ q, const float* __restrict__ ascale,
                            float* __restrict__ out, int I, int K, int T, u16* y_bf16, signed char* y_q,
                            float* y_scale, int forms) {
  __shared__ float swiglu[MT][WARP];
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int first = blockIdx.x * WARP + INT8_WARP_ROWS * warp;  // this warp's first feature
  float gate[INT8_WARP_ROWS][MT], up[INT8_WARP_ROWS][MT];
  int8_rows_dots<Codec, INT8_WARP_ROWS, MT>(weights, scales, row_bytes, q, ascale, first, INT8_WARP_ROWS, K, T, lane, gate);
  int8_rows_dots<Codec, INT8_WARP_ROWS, MT>(weights, scales, row_bytes, q, ascale, I + first, INT8_WARP_ROWS, K, T, lane,
                                            up);
#pragma unroll
  for (int f = 0; f < INT8_WARP_ROWS; ++f) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      if (t < T) {
        const float g = warp_sum(gate[f][t]), u = warp_sum(up[f][t]);
        if (lane == 0) swiglu[t][INT8_WARP_ROWS * warp + f] = silu_f(g) * u;
      }
    }
  }
  __syncthreads();
  if (warp != 0) return;
  for (int t = 0; t < T; ++t) {
    const float v = swiglu[t][lane];
    const size_t at = (size_t)t * I + blockIdx.x * WARP + lane;
    out[at] = v;
    emit_forms(v, at, forms, y_bf16, y_q, y_scale);
  }
}

// Launch: grid ceil(N / (8 INT8_WARP_ROWS)), block 256. row_bytes: bytes of one weight row of the quant
// plane (K / 2; Q8_0: K). int8_swiglu_*: grid I / 32, block 256 (8 warps of INT8_WARP_ROWS = 4 features); out [T, I].
#define INT8_KERNELS(codec_name, Codec, MT)                                                               \
  extern "C" __global__ void __launch_bounds__(256) int8_gemv_##codec_name##_t##MT(                      \
      const u8* weights, const u16* scales, long long row_bytes, const signed char* q, const float* ascale, \
      float* out, int N, int K, int T) {                                                                  \
    int8_gemv<Codec, MT>(weights, scales, row_bytes, q, ascale, out, N, K, T);                            \
  }                                                                                                       \
  extern "C" __global__ void __launch_bounds__(256) int8_swiglu_##codec_name##_t##MT(                    \
      const u8* weights, const u16* scales, long long row_bytes, const signed char* q, const float* ascale, \
      float* out, int I, int K, int T, u16* y_bf16, signed char* y_q, float* y_scale, int forms) {          \
    int8_swiglu<Codec, MT>(weights, scales, row_bytes, q, ascale, out, I, K, T, y_bf16, y_q, y_scale, forms); \
  }
INT8_KERNELS(w4, W4Codec, 4)
INT8_KERNELS(w4, W4Codec, 16)
INT8_KERNELS(q8_0, Q8_0Codec, 4)
INT8_KERNELS(q8_0, Q8_0Codec, 16)
INT8_KERNELS(q4_0, Q4_0Codec, 4)
INT8_KERNELS(q4_0, Q4_0Codec, 16)
INT8_KERNELS(iq4_xs, IQ4_XSCodec, 4)
INT8_KERNELS(iq4_xs, IQ4_XSCodec, 16)

// ---------------------------------------------------------- W4 on int8 tensor cores ---
// W4 weights on the w4a8 route, y [T, N] for 1..16 token rows per weight read: one
// mma.sync m16n8k32 s8 per 32-input unit of a 16-row tile and 8 tokens (a second n8 tile reuses the
// decoded weights), whose int32 dots are exact; then per unit, row and token, as int8_gemv and the
// CPU: acc += (float)dot * (weight scale x activation scale). dp4a took 8 instructions a unit, row
// and token: at 16 tokens the ALUs, not the memory, set the pace.
//
// PTX fragments of m16n8k32 .s8 (gid = lane / 4, tig = lane % 4; "k-int" j holds k 4j .. 4j + 3):
//   A a0: row gid, k-int tig    a1: row gid + 8, k-int tig    a2: row gid, k-int 4 + tig    a3: row gid + 8, k-int 4 + tig
//   B b0: token gid, k-int tig  b1: token gid, k-int 4 + tig
//   C c0, c1: row gid, tokens 2tig, 2tig + 1    c2, c3: row gid + 8
// Only A and B's agreement on which input sits in a k slot matters: thread tig puts the unit's inputs
// 8tig .. 8tig + 3 in k-int tig and 8tig + 4 .. 8tig + 7 in k-int 4 + tig, which is W4 word tig of the
// unit (w4_word_levels) and 8 consecutive activation bytes (one 8-byte load).
//
// A block owns a 16-row tile, its W4A8_WARPS warps split the tile's 128-groups (warp w: groups w, w +
// W4A8_WARPS, ...) and blockIdx.y splits them across blocks as w4a16.cu does; tile_sums (common.cuh)
// adds the warps' and the splits' sums in fixed orders. A row's sums run in the same order for any T.
#define W4A8_WARPS 8

__device__ __forceinline__ void mma_s8_16832(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int TILES>
__device__ void w4a8_mma(const u32* __restrict__ packed, const u16* __restrict__ scales,
                         const signed char* __restrict__ q, const float* __restrict__ ascale,
                         float* __restrict__ partial, float* __restrict__ out, int* __restrict__ arrivals, int N, int K,
                         int T) {
  __shared__ float red[W4A8_WARPS][16][16];  // per warp: [tile row][token]
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int gid = lane / 4, tig = lane % 4;
  const int G = K / 128, U = K / 32, row0 = blockIdx.x * 16;
  const u32* row_lo = packed + (size_t)(row0 + gid) * (K / 8);
  const u32* row_hi = row_lo + (size_t)8 * (K / 8);
  const u16* scale_lo = scales + (size_t)(row0 + gid) * G;
  const u16* scale_hi = scale_lo + (size_t)8 * G;

  float acc[TILES][4];
#pragma unroll
  for (int n = 0; n < TILES; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  for (int g = blockIdx.y * W4A8_WARPS + warp; g < G; g += W4A8_WARPS * gridDim.y) {
    u32 lo[4], hi[4];  // word tig of each of the group's 4 units, rows gid and gid + 8 (all loads first)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      lo[j] = ld_stream_u32(row_lo + 16 * g + 4 * j + tig);
      hi[j] = ld_stream_u32(row_hi + 16 * g + 4 * j + tig);
    }
    const float s_lo = bf16_to_f32(ld_stream_u16(scale_lo + g)), s_hi = bf16_to_f32(ld_stream_u16(scale_hi + g));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int u = 4 * g + j;
      u32 a0, a1, a2, a3;
      w4_word_levels(lo[j], a0, a2);
      w4_word_levels(hi[j], a1, a3);
#pragma unroll
      for (int n = 0; n < TILES; ++n) {
        const int token = 8 * n + gid, t0 = 8 * n + 2 * tig;
        uint2 b = make_uint2(0, 0);  // tokens past T multiply as zeros
        if (token < T) b = *reinterpret_cast<const uint2*>(q + (size_t)token * K + 32 * u + 8 * tig);
        int c[4] = {0, 0, 0, 0};
        mma_s8_16832(c, a0, a1, a2, a3, b.x, b.y);
        const float as0 = t0 < T ? ascale[(size_t)t0 * U + u] : 0.0f;
        const float as1 = t0 + 1 < T ? ascale[(size_t)(t0 + 1) * U + u] : 0.0f;
        acc[n][0] += (float)c[0] * (s_lo * as0);
        acc[n][1] += (float)c[1] * (s_lo * as1);
        acc[n][2] += (float)c[2] * (s_hi * as0);
        acc[n][3] += (float)c[3] * (s_hi * as1);
      }
    }
  }
  float sum;
  if (!tile_sums<W4A8_WARPS, TILES>(acc, red, partial, arrivals, N, T, sum)) return;
  const int r = threadIdx.x / 16, t = threadIdx.x % 16;
  if (t < T && t < 8 * TILES) out[(size_t)t * N + row0 + r] = sum;
}

// One n8 tile (T <= 8) or two (T <= 16). Launch: grid (N / 16, splits), block 256; N % 16 == 0,
// K % 128 == 0; with splits > 1, partial holds splits x [T, N] and arrivals N / 16 counts, 0 at launch.
extern "C" __global__ void __launch_bounds__(256) w4a8_mma_t8(const u32* packed, const u16* scales, const signed char* q,
                                                              const float* ascale, float* partial, float* out,
                                                              int* arrivals, int N, int K, int T) {
  w4a8_mma<1>(packed, scales, q, ascale, partial, out, arrivals, N, K, T);
}

extern "C" __global__ void __launch_bounds__(256) w4a8_mma_t16(const u32* packed, const u16* scales, const signed char* q,
                                                               const float* ascale, float* partial, float* out,
                                                               int* arrivals, int N, int K, int T) {
  w4a8_mma<2>(packed, scales, q, ascale, partial, out, arrivals, N, K, T);
}

// --------------------------------------------------------------------------- trellis ---
// engine/quant/trellis.py: a 16 x 8 tile (row-major, weight t = 8 * row + col) is a circular
// stream of 128 * k bits, MSB first; weight t's state is the 16-bit window ending at bit (t+1)k;
// level = byte 1 of dp4a(state * C, 0x40404040, 128), minus 128. Tiles are stored row tile major,
// then column tile: the 16 tiles of a 128-column block of a row tile are contiguous.
//
// A block owns one 16-row tile and TR_WARPS warps split its 128-blocks. Per 128-block a warp
// copies the 16 tile streams (16 * 16k bytes, coalesced) into shared memory, then lane
// (r = lane % 16, h = lane / 16) decodes row r of tiles 8h .. 8h+7: the 64 levels of row r over
// columns 64h .. 64h+63, kept as sixteen int8x4 registers for every token. The two halves' dots
// meet in one shuffle; the block's dot is exact before the activation scale multiplies it.
#define TR_WARPS 4
#define TR_MAX_TILE_BYTES 64  // k = 4: 128 * 4 / 8

// The 8 levels of row r of one tile (stream bytes `tile`, `tile_bytes` of them) as two int8x4.
__device__ __forceinline__ void trellis_row_levels(const u8* tile, int tile_bytes, int k, u32 multiplier, int r,
                                                   u32* lv) {
  const int L = 8 * tile_bytes;                     // stream bits
  const int first = ((8 * r + 1) * k - 16 + L) % L;  // window start of the row's first weight
  const int byte0 = first / 8;
  u64 bits = 0;  // 8 stream bytes from byte0 on, wrapping: covers 16 + 7k + 7 <= 51 bits
#pragma unroll
  for (int i = 0; i < 8; ++i) bits = (bits << 8) | tile[(byte0 + i) % tile_bytes];
  const int skip = first - 8 * byte0;
  u32 lvl[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const u32 state = (u32)(bits >> (64 - 16 - (skip + c * k))) & 0xFFFFu;
    // 1MAD: byte sum of state * C by one dp4a against 64 in every byte plus 128: the result is
    // 64 * (b + 2), so byte 1 is (b + 2) >> 2 = level + 128 (REFERENCE.md section 4).
    lvl[c] = __dp4a(state * multiplier, 0x40404040u, 128u);
  }
  // Gather the byte 1s: prmt selector 1 = byte 1 of the first operand, 5 = byte 1 of the second.
  const u32 w0 = prmt(prmt(lvl[0], lvl[1], 0x0051), prmt(lvl[2], lvl[3], 0x0051), 0x5410);
  const u32 w1 = prmt(prmt(lvl[4], lvl[5], 0x0051), prmt(lvl[6], lvl[7], 0x0051), 0x5410);
  // level + 128 in 0..255 -> level as a two's-complement byte: flip the top bit.
  lv[0] = w0 ^ 0x80808080u;
  lv[1] = w1 ^ 0x80808080u;
}

// Launch: grid N / 16, block 128. packed: tile streams, tile_bytes = 16 k; q int8 [T, K] and
// ascale [T, K / 128] from rotate_quantize_int8.
extern "C" __global__ void __launch_bounds__(128) trellis_gemv(const u8* __restrict__ packed, int k, u32 multiplier,
                                                               const float* __restrict__ row_scale,
                                                               const signed char* __restrict__ q,
                                                               const float* __restrict__ ascale,
                                                               float* __restrict__ out, int N, int K, int T) {
  __shared__ __align__(16) u8 streams[TR_WARPS][16 * TR_MAX_TILE_BYTES];
  __shared__ float red[TR_WARPS][16][MAX_T];
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int r = lane % 16, h = lane / 16;
  const int tile_bytes = 16 * k, B = K / 128;
  const u8* row_tile = packed + (size_t)blockIdx.x * (K / 8) * tile_bytes;
  float acc[MAX_T];
#pragma unroll
  for (int t = 0; t < MAX_T; ++t) acc[t] = 0.0f;

  for (int b = warp; b < B; b += TR_WARPS) {
    const uint4* src = reinterpret_cast<const uint4*>(row_tile + (size_t)b * 16 * tile_bytes);
    uint4* dst = reinterpret_cast<uint4*>(streams[warp]);
    for (int i = lane; i < tile_bytes; i += WARP) dst[i] = ld_stream_u4(src + i);  // 16 tiles = tile_bytes uint4
    __syncwarp();
    u32 lv[16];
#pragma unroll
    for (int j = 0; j < 8; ++j) trellis_row_levels(streams[warp] + (8 * h + j) * tile_bytes, tile_bytes, k, multiplier, r, lv + 2 * j);
    __syncwarp();  // the next block's copy overwrites streams[warp]
#pragma unroll
    for (int t = 0; t < MAX_T; ++t) {
      if (t < T) {
        const uint4* a = reinterpret_cast<const uint4*>(q + (size_t)t * K + 128 * b + 64 * h);
        int dot = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint4 av = a[i];
          dot = __dp4a((int)lv[4 * i], (int)av.x, dot);
          dot = __dp4a((int)lv[4 * i + 1], (int)av.y, dot);
          dot = __dp4a((int)lv[4 * i + 2], (int)av.z, dot);
          dot = __dp4a((int)lv[4 * i + 3], (int)av.w, dot);
        }
        dot += __shfl_xor_sync(0xffffffffu, dot, 16);  // columns 0..63 + 64..127: the block's exact dot
        acc[t] += (float)dot * ascale[(size_t)t * B + b];
      }
    }
  }
  if (h == 0) {
#pragma unroll
    for (int t = 0; t < MAX_T; ++t) red[warp][r][t] = acc[t];
  }
  __syncthreads();
  const int row = threadIdx.x / 8;  // 128 threads: 16 rows x 8 token slots, two tokens each
  for (int t = threadIdx.x % 8; t < T; t += 8) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < TR_WARPS; ++w) sum += red[w][row][t];
    out[(size_t)t * N + blockIdx.x * 16 + row] = row_scale[blockIdx.x * 16 + row] * sum;
  }
}
