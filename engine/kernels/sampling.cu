// Token choice on the device: argmax, top-k, and the int4 head's ranking rescored by the bf16 head
// (REFERENCE.md section 6: the cheap head picks the candidates, the ids are the bf16 head's).
//
// Ranking key: a (value, index) pair as one u64 whose unsigned order is "larger value first, then
// lower index" (numpy's argmax and stable argsort(-x) orders): the high word is the float's bits
// made monotonic (negative floats have every bit flipped, positive ones the sign bit set), the low
// word is ~index. Key 0 is below every real key and marks an entry already taken.
#include "common.cuh"

#define TOPK_CHUNK 4096  // values per block in the first top-k pass; also the most candidates the second pass takes

__device__ __forceinline__ u64 rank_key(float v, u32 index) {
  const u32 bits = __float_as_uint(v);
  const u32 ordered = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
  return ((u64)ordered << 32) | (u64)(~index);
}

__device__ __forceinline__ u32 key_index(u64 key) { return ~(u32)key; }

__device__ __forceinline__ float key_value(u64 key) {
  const u32 ordered = (u32)(key >> 32);
  return __uint_as_float(ordered & 0x80000000u ? ordered & 0x7FFFFFFFu : ~ordered);
}

__device__ __forceinline__ u64 u64_max(u64 a, u64 b) { return a > b ? a : b; }

__device__ u64 block_max_key(u64 v, u64* scratch) {
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v = u64_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0;
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v = u64_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Index of the largest value of each row (the first on ties). Launch: grid R, block 1024.
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int* __restrict__ out, int V) {
  __shared__ u64 scratch[WARP];
  const float* row = x + (size_t)blockIdx.x * V;
  u64 best = 0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) best = u64_max(best, rank_key(row[i], i));
  best = block_max_key(best, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = key_index(best);
}

// k rounds of "take the largest key, mark it taken" over n keys in shared memory.
__device__ void select_top(u64* keys, int n, int k, u64* out, u64* scratch) {
  for (int round = 0; round < k; ++round) {
    u64 best = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) best = u64_max(best, keys[i]);
    best = block_max_key(best, scratch);
    if (threadIdx.x == 0) out[round] = best;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
      if (keys[i] == best) keys[i] = 0;  // keys are unique (the index is in them)
  }
}

// Pass 1: each block takes TOPK_CHUNK values of one row and writes its k best keys to
// candidates [R, chunks, k]. Launch: grid (chunks, R), block 256.
extern "C" __global__ void topk_chunks(const float* __restrict__ x, u64* __restrict__ candidates, int V, int k) {
  __shared__ u64 keys[TOPK_CHUNK];
  __shared__ u64 scratch[WARP];
  const int chunk = blockIdx.x, chunks = gridDim.x, r = blockIdx.y;
  const int lo = chunk * TOPK_CHUNK, n = min(TOPK_CHUNK, V - lo);
  for (int i = threadIdx.x; i < n; i += blockDim.x) keys[i] = rank_key(x[(size_t)r * V + lo + i], lo + i);
  __syncthreads();
  select_top(keys, n, k, candidates + ((size_t)r * chunks + chunk) * k, scratch);
}

// Pass 2: the k best of a row's chunks * k candidates (at most TOPK_CHUNK), best first, as
// indices [R, k] and values [R, k]; key 0 (fewer than k values in the row) gives index -1.
// Launch: grid R, block 256.
extern "C" __global__ void topk_merge(const u64* __restrict__ candidates, int n, int k, int* __restrict__ index,
                                      float* __restrict__ value) {
  __shared__ u64 keys[TOPK_CHUNK];
  __shared__ u64 scratch[WARP];
  __shared__ u64 best[TOPK_CHUNK / 16];
  const int r = blockIdx.x;
  for (int i = threadIdx.x; i < n; i += blockDim.x) keys[i] = candidates[(size_t)r * n + i];
  __syncthreads();
  select_top(keys, n, k, best, scratch);
  __syncthreads();
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    index[r * k + i] = best[i] ? (int)key_index(best[i]) : -1;
    value[r * k + i] = best[i] ? key_value(best[i]) : NEG_INF;
  }
}

// Rescoring: logits[t, c] = bf16 head row candidates[t, c] . hidden[t] in fp32 (the bf16 route's
// product: exact bf16 weights, fp32 activations). One warp per candidate, eight weights per
// 16-byte load. Launch: grid (ceil(k / 8), T), block 256; H % 256 == 0.
extern "C" __global__ void rescore_candidates(const float* __restrict__ hidden, const u16* __restrict__ head,
                                              const int* __restrict__ candidates, float* __restrict__ logits, int H,
                                              int k) {
  const int lane = threadIdx.x % WARP, c = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP, t = blockIdx.y;
  if (c >= k) return;
  const int id = candidates[t * k + c];
  if (id < 0) {
    if (lane == 0) logits[t * k + c] = NEG_INF;
    return;
  }
  const u16* row = head + (size_t)id * H;
  const float* x = hidden + (size_t)t * H;
  float sum = 0.0f;
  for (int i = 8 * lane; i < H; i += 8 * WARP) {
    const uint4 w = ld_stream_u4(row + i);
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      sum += bf16_to_f32(words[j] & 0xFFFFu) * x[i + 2 * j];
      sum += bf16_to_f32(words[j] >> 16) * x[i + 2 * j + 1];
    }
  }
  sum = warp_sum(sum);
  if (lane == 0) logits[t * k + c] = sum;
}

// The best rescored candidate per row: largest logit, the lower token id on ties (the bf16 head's
// own argmax order). Launch: grid T, block 32; k <= 1024.
extern "C" __global__ void pick_rescored(const float* __restrict__ logits, const int* __restrict__ candidates,
                                         int* __restrict__ out, int k) {
  const int t = blockIdx.x;
  u64 best = 0;
  for (int c = threadIdx.x; c < k; c += WARP) {
    const int id = candidates[t * k + c];
    if (id >= 0) best = u64_max(best, rank_key(logits[t * k + c], id));
  }
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) best = u64_max(best, __shfl_xor_sync(0xffffffffu, best, o));
  if (threadIdx.x == 0) out[t] = key_index(best);
}

// The output ring of captured cycles: row (*count % slots) of ring [slots, blockDim.x] <- ids[0 .. n)
// (-1 past n), then *count + 1, so the host reads the ids of many graph replays after one sync.
// Launch: grid 1, block = the ring's width (at most 1024).
extern "C" __global__ void ring_push(const int* __restrict__ ids, int n, int* __restrict__ ring, int slots,
                                     unsigned long long* count) {
  const unsigned long long c = *count;
  const int t = threadIdx.x;
  ring[(c % slots) * blockDim.x + t] = t < n ? ids[t] : -1;
  __syncthreads();  // every thread has read *count before it moves on
  if (t == 0) *count = c + 1;
}
