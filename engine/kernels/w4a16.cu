// W4A16 ("warp" route): y[t, n] = sum_g scale[n, g] * sum_{k in group g} level[n, k] * x[t, k]
// for 1..16 token rows t per weight read, bf16 activations, fp32 accumulation a group at a time.
//
// Weight layout (engine/quant/w4.py, W4Weight, streamed as stored):
//   packed  u32 [N, K/8]    word j of row n: input 8j + i in bits 4i..4i+3 as level + 8
//   scales  u16 [N, K/128]  bf16 bits of the scale of inputs 128g .. 128g+127
// Activations x: bf16 bits u16 [T, K] (round-to-nearest-even of the fp32 input). Output fp32 [T, N].
//
// Tensor cores: mma.sync.m16n8k16 bf16 with the weights as the 16 x 16 A operand (16 output rows
// by 16 inputs) and up to 8 tokens as the 16 x 8 B operand; a second n8 tile reuses the same
// decoded A registers, so 16 rows cost one weight read and one dequant.
//
// A block owns one 16-row tile; its WARPS warps split the tile's 128-groups (warp w takes groups
// w, w + WARPS, ...), and blockIdx.y splits them further across blocks when N is too small to
// fill the GPU: each split writes its own partial output, and the tile's last split to finish
// (an arrival count per tile) sums them in split order into the output, so the result does not
// depend on scheduling and no second kernel runs.
#include "common.cuh"

#define W4_WARPS 8
#define W4_STAGES 2  // groups in flight per warp: the next group's words load while this one computes

// PTX fragment layout of m16n8k16 (groupID = lane / 4, tig = lane % 4):
//   A regs a0..a3 (bf16x2): a0 row groupID,   k 2tig, 2tig+1     a1 row groupID+8, same k
//                           a2 row groupID,   k 2tig+8, 2tig+9   a3 row groupID+8, same k
//   B regs b0, b1:          b0 k 2tig, 2tig+1 of token groupID   b1 k 2tig+8, 2tig+9
//   C/D c0..c3 (fp32):      c0, c1 row groupID, tokens 2tig, 2tig+1; c2, c3 row groupID+8
// A dot product does not care which physical input sits in which k slot as long as A and B agree,
// so we choose the slots that make both loads cheap:
//   thread tig reads words 4tig .. 4tig+3 of the group for its two rows (one 16-byte load each);
//   word c (inputs 128g + 32tig + 8c + 0..7) feeds two mmas: pairs (i, i+4) for i = 0, 1 to the
//   first (slots 2tig/2tig+1 and 2tig+8/2tig+9), i = 2, 3 to the second.
//   The B side therefore needs the same eight inputs of its token as pairs (x0,x4) (x1,x5)
//   (x2,x6) (x3,x7): one 16-byte load and four byte permutes.
__device__ __forceinline__ void mma_bf16_16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct GroupWords {
  uint4 lo, hi;   // words 4tig..4tig+3 of rows groupID and groupID + 8
  u32 s_lo, s_hi;  // their bf16 scales
};

__device__ __forceinline__ void load_group(GroupWords& w, const u32* row_lo, const u32* row_hi,
                                           const u16* scale_lo, const u16* scale_hi, int g, int tig) {
  w.lo = ld_stream_u4(row_lo + g * 16 + 4 * tig);
  w.hi = ld_stream_u4(row_hi + g * 16 + 4 * tig);
  w.s_lo = ld_stream_u16(scale_lo + g);
  w.s_hi = ld_stream_u16(scale_hi + g);
}

template <int TILES>
__device__ __forceinline__ void group_mma(float (*acc)[4], const GroupWords& w, const u16* x, int K, int T,
                                          int g, int gid, int tig) {
  float part[TILES][4];
#pragma unroll
  for (int n = 0; n < TILES; ++n) part[n][0] = part[n][1] = part[n][2] = part[n][3] = 0.0f;
  const u32 lo[4] = {w.lo.x, w.lo.y, w.lo.z, w.lo.w}, hi[4] = {w.hi.x, w.hi.y, w.hi.z, w.hi.w};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    // Dequantize word c of both rows once; every token tile below reuses these registers.
    const u32 a0 = w4_pair_bf16x2(lo[c], 0), a1 = w4_pair_bf16x2(hi[c], 0);
    const u32 a2 = w4_pair_bf16x2(lo[c], 1), a3 = w4_pair_bf16x2(hi[c], 1);
    const u32 e0 = w4_pair_bf16x2(lo[c], 2), e1 = w4_pair_bf16x2(hi[c], 2);
    const u32 e2 = w4_pair_bf16x2(lo[c], 3), e3 = w4_pair_bf16x2(hi[c], 3);
#pragma unroll
    for (int n = 0; n < TILES; ++n) {
      const int token = 8 * n + gid;
      uint4 xa = make_uint4(0, 0, 0, 0);  // tokens past T multiply as zeros
      if (token < T) xa = *reinterpret_cast<const uint4*>(x + (size_t)token * K + 128 * g + 32 * tig + 8 * c);
      // xa = (x0,x1) (x2,x3) (x4,x5) (x6,x7), low half first; regroup into the weight's pairs.
      mma_bf16_16816(part[n], a0, a1, a2, a3, prmt(xa.x, xa.z, 0x5410), prmt(xa.x, xa.z, 0x7632));
      mma_bf16_16816(part[n], e0, e1, e2, e3, prmt(xa.y, xa.w, 0x5410), prmt(xa.y, xa.w, 0x7632));
    }
  }
  // The group's fp32 sums times its fp32-widened bf16 scale: c0, c1 belong to row groupID, c2, c3
  // to row groupID + 8.
  const float s_lo = bf16_to_f32(w.s_lo), s_hi = bf16_to_f32(w.s_hi);
#pragma unroll
  for (int n = 0; n < TILES; ++n) {
    acc[n][0] += s_lo * part[n][0];
    acc[n][1] += s_lo * part[n][1];
    acc[n][2] += s_hi * part[n][2];
    acc[n][3] += s_hi * part[n][3];
  }
}

// SWIGLU: the matrix is an MLP's gate | up with each 16-row tile holding gate rows 8b .. 8b + 7 and
// then the up rows of the same features (cupy_backend.SwiGLUW4A16Linear lays them so), and the
// epilogue writes silu(gate) * up [T, N / 2] (and its bf16 bits with forms & EMIT_BF16, the down
// projection's input) instead of the product: silu_mul's launch folded in.
template <int TILES, bool SWIGLU>
__device__ void w4a16_gemm(const u32* __restrict__ packed, const u16* __restrict__ scales,
                           const u16* __restrict__ x, float* __restrict__ partial, float* __restrict__ out,
                           int* __restrict__ arrivals, int N, int K, int T, u16* __restrict__ out_bf16, int forms) {
  __shared__ float red[W4_WARPS][16][16];  // per warp: [tile row][token]
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int gid = lane / 4, tig = lane % 4;
  const int G = K / 128, row0 = blockIdx.x * 16;
  const int stride = W4_WARPS * gridDim.y;  // groups between two of this warp's
  const u32* row_lo = packed + (size_t)(row0 + gid) * (K / 8);
  const u32* row_hi = row_lo + (size_t)8 * (K / 8);
  const u16* scale_lo = scales + (size_t)(row0 + gid) * G;
  const u16* scale_hi = scale_lo + (size_t)8 * G;

  float acc[TILES][4];
#pragma unroll
  for (int n = 0; n < TILES; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

  // Software pipeline: W4_STAGES groups' words are in flight; stage s of the unrolled loop below
  // always uses buf[s], so the ring stays in registers.
  GroupWords buf[W4_STAGES];
  const int first = blockIdx.y * W4_WARPS + warp;
#pragma unroll
  for (int s = 0; s < W4_STAGES; ++s)
    if (first + s * stride < G) load_group(buf[s], row_lo, row_hi, scale_lo, scale_hi, first + s * stride, tig);
  for (int g = first; g < G; g += W4_STAGES * stride) {
#pragma unroll
    for (int s = 0; s < W4_STAGES; ++s) {
      const int gs = g + s * stride;
      if (gs < G) {
        const GroupWords cur = buf[s];
        const int next = gs + W4_STAGES * stride;
        if (next < G) load_group(buf[s], row_lo, row_hi, scale_lo, scale_hi, next, tig);
        group_mma<TILES>(acc, cur, x, K, T, gs, gid, tig);
      }
    }
  }

  // The warps' sums in a fixed order (deterministic), then the splits' (common.cuh)
  float sum;
  if (!tile_sums<W4_WARPS, TILES>(acc, red, partial, arrivals, N, T, sum)) return;
  const int r = threadIdx.x / 16, t = threadIdx.x % 16;  // 256 threads = 16 rows x 16 tokens
  const bool mine = t < T && t < 8 * TILES;
  const size_t at = (size_t)t * N + row0 + r;
  if (!SWIGLU) {
    if (mine) out[at] = sum;
    return;
  }
  __shared__ float pre[16][16];  // [tile row][token]: gate rows 0..7, up rows 8..15
  pre[r][t] = sum;
  __syncthreads();
  if (mine && r < 8) {
    const float v = silu_f(pre[r][t]) * pre[r + 8][t];
    const size_t feature = (size_t)t * (N / 2) + blockIdx.x * 8 + r;
    out[feature] = v;
    if (forms & EMIT_BF16) out_bf16[feature] = f32_to_bf16(v);
  }
}

// One n8 tile (T <= 8) or two (T <= 16). Launch: grid (N / 16, splits), block 256; N % 16 == 0,
// K % 128 == 0; with splits > 1, partial holds splits x [T, N] and arrivals N / 16 counts, 0 at launch.
extern "C" __global__ void __launch_bounds__(256) w4a16_gemm_t8(const u32* packed, const u16* scales, const u16* x,
                                                                float* partial, float* out, int* arrivals, int N,
                                                                int K, int T) {
  w4a16_gemm<1, false>(packed, scales, x, partial, out, arrivals, N, K, T, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(256) w4a16_gemm_t16(const u32* packed, const u16* scales, const u16* x,
                                                                 float* partial, float* out, int* arrivals, int N,
                                                                 int K, int T) {
  w4a16_gemm<2, false>(packed, scales, x, partial, out, arrivals, N, K, T, nullptr, 0);
}

// The SwiGLU epilogue's: out [T, N / 2] = silu(gate) * up, out_bf16 its bits where forms ask.
extern "C" __global__ void __launch_bounds__(256) w4a16_swiglu_t8(const u32* packed, const u16* scales, const u16* x,
                                                                  float* partial, float* out, int* arrivals, int N,
                                                                  int K, int T, u16* out_bf16, int forms) {
  w4a16_gemm<1, true>(packed, scales, x, partial, out, arrivals, N, K, T, out_bf16, forms);
}

extern "C" __global__ void __launch_bounds__(256) w4a16_swiglu_t16(const u32* packed, const u16* scales, const u16* x,
                                                                   float* partial, float* out, int* arrivals, int N,
                                                                   int K, int T, u16* out_bf16, int forms) {
  w4a16_gemm<2, true>(packed, scales, x, partial, out, arrivals, N, K, T, out_bf16, forms);
}

// fp32 -> bf16 bits, round to nearest even: the w4a16 route's activation rounding.
extern "C" __global__ void f32_to_bf16_bits(const float* __restrict__ x, u16* __restrict__ out, long long n) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = f32_to_bf16(x[i]);
}
