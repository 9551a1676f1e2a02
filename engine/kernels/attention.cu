// Causal GQA attention for decode and verify (1..16 query rows) over the two KV caches:
//   bf16   keys/values u16 [kv, capacity, HD]
//   q4     engine/cache.py Q4KVCache: rows rotated by diag(signs) then H / sqrt(HD) (H Sylvester's
//          Hadamard), 4-bit codes (value 2i low nibble, 2i+1 high, each + 8) with an f16 scale
//          per 32; the first SINK rows and the RECENT rows before each query exact (fp32).
// Query row t (position start + t) sees positions 0 .. start + t; query head h reads KV head
// h / (heads / kv). scores = (q . k) * HD^-0.5, softmax, sum of p v.
//
// Flash-decoding: each block takes a chunk of one row's keys and writes the chunk's (max, sum of
// e^(s - max), sum of e^(s - max) v); the combine rescales the chunks to one max and divides. On the
// bf16 cache a block serves every query head of a KV head, so a key is loaded once for all of them,
// and both steps run in one launch (attention_bf16_*: the last chunk to arrive combines); the q4
// cache's exact and quantized partials and QSA's sparse ones end in attention_combine. The q4 cache never unrotates a row: with k = diag(s) H_n r,
// q . k = (H_n diag(s) q) . r, so the block rotates q once; and sum_j p_j v_j = diag(s) H_n
// (sum_j p_j r_j), so the rotated chunks' sums are unrotated once, in the combine.
#include "common.cuh"

#define ATT_WARPS 4
#define GQA_MAX 8     // query heads a bf16 block serves in one pass over its keys (more: another pass)
#define Q4_SINK 4      // engine.cache.SINK_ROWS
#define Q4_RECENT 128  // engine.cache.RECENT_ROWS

// In-place Walsh-Hadamard butterflies over n (a power of two <= 256) shared floats, by the block.
__device__ void block_fwht(float* v, int n) {
  for (int half = 1; half < n; half <<= 1) {
    __syncthreads();
    for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
      const int i = (p / half) * 2 * half + p % half;
      const float a = v[i], b = v[i + half];
      v[i] = a + b;
      v[i + half] = a - b;
    }
  }
  __syncthreads();
}

// ------------------------------------------------------------------------- row sources ---
// Each gives, for query row t ending at `end` (= start + t + 1), a range [lo, hi) of row
// indices, and the D = HD / 32 dims lane * D .. lane * D + D - 1 of a row's key or value.

// D consecutive bf16 values widened, in one load (16 bytes at D = 8: HD 256) where D allows.
template <int D>
__device__ __forceinline__ void load_bf16_dims(const u16* p, float* d) {
  if constexpr (D % 8 == 0) {
#pragma unroll
    for (int v = 0; v < D / 8; ++v) {
      const uint4 w = reinterpret_cast<const uint4*>(p)[v];
      const u32 pairs[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        d[8 * v + 2 * k] = __uint_as_float(pairs[k] << 16);
        d[8 * v + 2 * k + 1] = __uint_as_float(pairs[k] & 0xFFFF0000u);
      }
    }
  } else if constexpr (D % 2 == 0) {
#pragma unroll
    for (int k = 0; k < D / 2; ++k) {
      const u32 pair = reinterpret_cast<const u32*>(p)[k];
      d[2 * k] = __uint_as_float(pair << 16);
      d[2 * k + 1] = __uint_as_float(pair & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int e = 0; e < D; ++e) d[e] = bf16_to_f32(p[e]);
  }
}

template <int HD>
struct Bf16Rows {  // all positions 0 .. end - 1
  const u16 *keys, *values;  // [kv, capacity, HD], already offset to the KV head
  __device__ void range(int end, int& lo, int& hi) const { lo = 0; hi = end; }
  __device__ void load(const u16* base, int i, int lane, float* d) const {
    load_bf16_dims<HD / WARP>(base + (size_t)i * HD + lane * (HD / WARP), d);
  }
  __device__ void key(int i, int lane, float* d) const { load(keys, i, lane, d); }
  __device__ void value(int i, int lane, float* d) const { load(values, i, lane, d); }
};

template <int HD>
struct Q4Rows {  // the quantized middle: positions SINK .. end - RECENT - 1, in the rotated basis
  const u8 *key_codes, *value_codes;     // [kv, capacity, HD / 2]
  const u16 *key_scales, *value_scales;  // [kv, capacity, HD / 32] f16 bits
  __device__ void range(int end, int& lo, int& hi) const { lo = Q4_SINK; hi = max(Q4_SINK, end - Q4_RECENT); }
  __device__ void load(const u8* codes, const u16* scales, int i, int lane, float* d) const {
    constexpr int D = HD / WARP;
    const float scale = f16_to_f32(scales[(size_t)i * (HD / 32) + lane * D / 32]);
    const u8* c = codes + (size_t)i * (HD / 2) + lane * D / 2;
#pragma unroll
    for (int e = 0; e < D; e += 2) {
      const u32 byte = c[e / 2];
      d[e] = (float)(int)((byte & 0xF) - 8) * scale;
      d[e + 1] = (float)(int)((byte >> 4) - 8) * scale;
    }
  }
  __device__ void key(int i, int lane, float* d) const { load(key_codes, key_scales, i, lane, d); }
  __device__ void value(int i, int lane, float* d) const { load(value_codes, value_scales, i, lane, d); }
};

template <int HD>
struct ExactRows {  // the sink and the recent window: index i < n_sink is sink row i, then the ring
  const float *sink_keys, *sink_values;  // [kv, SINK, HD]
  const float *ring_keys, *ring_values;  // [kv, ring_rows, HD], position p at row p % ring_rows
  int ring_rows;
  __device__ int n_sink(int end) const { return min(end, Q4_SINK); }
  __device__ void range(int end, int& lo, int& hi) const {
    lo = 0;
    hi = n_sink(end) + max(0, end - max(Q4_SINK, end - Q4_RECENT));  // no recent rows before the sink is full
  }
  __device__ const float* row(const float* sink, const float* ring, int i, int end) const {
    const int ns = n_sink(end);
    if (i < ns) return sink + (size_t)i * HD;
    const int position = max(Q4_SINK, end - Q4_RECENT) + (i - ns);
    return ring + (size_t)(position % ring_rows) * HD;
  }
  int end_;  // set per block
  __device__ void key(int i, int lane, float* d) const {
    const float* p = row(sink_keys, ring_keys, i, end_) + lane * (HD / WARP);
#pragma unroll
    for (int e = 0; e < HD / WARP; ++e) d[e] = p[e];
  }
  __device__ void value(int i, int lane, float* d) const {
    const float* p = row(sink_values, ring_values, i, end_) + lane * (HD / WARP);
#pragma unroll
    for (int e = 0; e < HD / WARP; ++e) d[e] = p[e];
  }
};

// -------------------------------------------------------------------------- partials ---
// The block's warps' running max, sum and weighted values of one head (merge_* in shared memory,
// warp w's at [w]) rescaled to their common max and written to partial slot `slot`: an empty chunk
// (every warp's max -inf) writes (-inf, 0) and zeros.
template <int HD>
__device__ __forceinline__ void write_merged(const float* merge_m, const float* merge_l, const float (*merge_acc)[HD],
                                             size_t slot, float* part_ml, float* part_acc) {
  float M = NEG_INF;
#pragma unroll
  for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, merge_m[w]);
  for (int i = threadIdx.x; i < HD; i += blockDim.x) {
    float a = 0.0f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w)
      if (merge_m[w] != NEG_INF) a += expf(merge_m[w] - M) * merge_acc[w][i];
    part_acc[slot * HD + i] = a;
  }
  if (threadIdx.x == 0) {
    float L = 0.0f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w)
      if (merge_m[w] != NEG_INF) L += expf(merge_m[w] - M) * merge_l[w];
    part_ml[2 * slot] = M;
    part_ml[2 * slot + 1] = L;
  }
}

// Block (chunk c, query head h, row t): rows lo + c * chunk .. of the source's range; warp w takes
// every ATT_WARPS-th row with its own running max m, sum l and weighted values acc (D dims per
// lane); the four warps merge in shared memory. Output slot: chunk_offset + c of n_slots.
template <int HD, class Rows>
__device__ void attention_partial(const Rows& rows, const float* qs, int row_lo, int row_hi, int t, int h, int heads,
                                  int chunk, int chunk_offset, int n_slots, float scale, float* part_ml,
                                  float* part_acc) {
  constexpr int D = HD / WARP;
  __shared__ float merge_m[ATT_WARPS], merge_l[ATT_WARPS];
  __shared__ float merge_acc[ATT_WARPS][HD];
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int lo = row_lo + blockIdx.x * chunk, hi = min(row_hi, lo + chunk);
  float q[D], acc[D];
#pragma unroll
  for (int e = 0; e < D; ++e) { q[e] = qs[lane * D + e]; acc[e] = 0.0f; }
  float m = NEG_INF, l = 0.0f;
  for (int i = lo + warp; i < hi; i += ATT_WARPS) {
    float kd[D], vd[D];
    rows.key(i, lane, kd);
    float s = 0.0f;
#pragma unroll
    for (int e = 0; e < D; ++e) s += q[e] * kd[e];
    s = warp_sum(s) * scale;
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new);  // 0 on the first row (m = -inf)
    const float p = expf(s - m_new);
    rows.value(i, lane, vd);
    l = l * correction + p;
#pragma unroll
    for (int e = 0; e < D; ++e) acc[e] = acc[e] * correction + p * vd[e];
    m = m_new;
  }
  if (lane == 0) { merge_m[warp] = m; merge_l[warp] = l; }
#pragma unroll
  for (int e = 0; e < D; ++e) merge_acc[warp][lane * D + e] = acc[e];
  __syncthreads();
  write_merged<HD>(merge_m, merge_l, merge_acc, ((size_t)t * heads + h) * n_slots + chunk_offset + blockIdx.x,
                   part_ml, part_acc);
}

// Launch (all partials): grid (chunks, heads, T), block 128. q compact [T, heads, HD] fp32.
// part_ml [T, heads, n_slots, 2] and part_acc [T, heads, n_slots, HD] fp32.
template <int HD>
__device__ void attention_partial_bf16(const float* q, const u16* keys, const u16* values, int capacity,
                                       const int* start, int heads, int kv, int chunk, float scale,
                                       float* part_ml, float* part_acc, int n_slots) {
  __shared__ float qs[HD];
  const int h = blockIdx.y, t = blockIdx.z, kvh = h / (heads / kv);
  for (int i = threadIdx.x; i < HD; i += blockDim.x) qs[i] = q[((size_t)t * heads + h) * HD + i];
  __syncthreads();
  const Bf16Rows<HD> rows{keys + (size_t)kvh * capacity * HD, values + (size_t)kvh * capacity * HD};
  int lo, hi;
  rows.range(*start + t + 1, lo, hi);
  attention_partial<HD>(rows, qs, lo, hi, t, h, heads, chunk, 0, n_slots, scale, part_ml, part_acc);
}

// q4 cache, quantized middle rows, slots chunk_offset.. (after the exact rows' slots).
template <int HD>
__device__ void attention_partial_q4(const float* q, const float* signs, const u8* key_codes, const u16* key_scales,
                                     const u8* value_codes, const u16* value_scales, int capacity, const int* start,
                                     int heads, int kv, int chunk, float scale, float* part_ml, float* part_acc,
                                     int chunk_offset, int n_slots) {
  __shared__ float qs[HD];
  const int h = blockIdx.y, t = blockIdx.z, kvh = h / (heads / kv);
  for (int i = threadIdx.x; i < HD; i += blockDim.x) qs[i] = q[((size_t)t * heads + h) * HD + i] * signs[i];
  block_fwht(qs, HD);  // q_rot = H diag(s) q / sqrt(HD)
  for (int i = threadIdx.x; i < HD; i += blockDim.x) qs[i] *= 1.0f / sqrtf((float)HD);
  __syncthreads();
  const Q4Rows<HD> rows{key_codes + (size_t)kvh * capacity * (HD / 2), value_codes + (size_t)kvh * capacity * (HD / 2),
                        key_scales + (size_t)kvh * capacity * (HD / 32), value_scales + (size_t)kvh * capacity * (HD / 32)};
  int lo, hi;
  rows.range(*start + t + 1, lo, hi);
  attention_partial<HD>(rows, qs, lo, hi, t, h, heads, chunk, chunk_offset, n_slots, scale, part_ml, part_acc);
}

// q4 cache, exact rows (sink and recent window), slots 0..
template <int HD>
__device__ void attention_partial_exact(const float* q, const float* sink_keys, const float* sink_values,
                                        const float* ring_keys, const float* ring_values, int ring_rows,
                                        const int* start, int heads, int kv, int chunk, float scale, float* part_ml,
                                        float* part_acc, int n_slots) {
  __shared__ float qs[HD];
  const int h = blockIdx.y, t = blockIdx.z, kvh = h / (heads / kv);
  for (int i = threadIdx.x; i < HD; i += blockDim.x) qs[i] = q[((size_t)t * heads + h) * HD + i];
  __syncthreads();
  ExactRows<HD> rows{sink_keys + (size_t)kvh * Q4_SINK * HD, sink_values + (size_t)kvh * Q4_SINK * HD,
                     ring_keys + (size_t)kvh * ring_rows * HD, ring_values + (size_t)kvh * ring_rows * HD, ring_rows};
  rows.end_ = *start + t + 1;
  int lo, hi;
  rows.range(rows.end_, lo, hi);
  attention_partial<HD>(rows, qs, lo, hi, t, h, heads, chunk, 0, n_slots, scale, part_ml, part_acc);
}

__device__ void combine_head(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                             const float* __restrict__ signs, float* __restrict__ out, int HD, int h, int t, int heads,
                             int n_plain, int n_slots, const float* __restrict__ gates, long long gate_row_stride,
                             int gated, u16* y_bf16, signed char* y_q, float* y_scale, int forms);  // below

// bf16 cache, a block per (chunk c, KV head g, row t) for the G = heads / kv query heads that read g:
// each key and value is loaded once for all of them (16 bytes a lane at HD 256; a block a query head
// loaded it G times), in passes of GQA_MAX heads. Per head the sums run exactly as attention_partial's
// (warp w takes rows lo + w, lo + w + ATT_WARPS, ..., then the warps merge), into the same slots
// [t, h, c]. Chunks of GQA_CHUNK keys keep a short context's grid wide enough to fill the card.
template <int HD>
__device__ void attention_partial_group(const float* __restrict__ q, const u16* __restrict__ keys,
                                        const u16* __restrict__ values, int capacity, const int* start, int heads,
                                        int kv, int chunk, float scale, float* part_ml, float* part_acc) {
  constexpr int D = HD / WARP;
  __shared__ float qs[GQA_MAX][HD];
  __shared__ float merge_m[ATT_WARPS], merge_l[ATT_WARPS], merge_acc[ATT_WARPS][HD];
  const int g = blockIdx.y, t = blockIdx.z, G = heads / kv;
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const u16* K = keys + (size_t)g * capacity * HD;
  const u16* V = values + (size_t)g * capacity * HD;
  const int lo = blockIdx.x * chunk, hi = min(*start + t + 1, lo + chunk);
  for (int first = 0; first < G; first += GQA_MAX) {
    const int n = min(GQA_MAX, G - first);  // heads g * G + first .. + n - 1 this pass
    __syncthreads();  // the previous pass's reads of qs and the merge buffers are done
    for (int i = threadIdx.x; i < n * HD; i += blockDim.x)
      qs[i / HD][i % HD] = q[((size_t)t * heads + g * G + first + i / HD) * HD + i % HD];
    __syncthreads();
    float m[GQA_MAX], l[GQA_MAX], acc[GQA_MAX][D];
#pragma unroll
    for (int j = 0; j < GQA_MAX; ++j) {
      m[j] = NEG_INF;
      l[j] = 0.0f;
#pragma unroll
      for (int e = 0; e < D; ++e) acc[j][e] = 0.0f;
    }
#pragma unroll 2
    for (int i = lo + warp; i < hi; i += ATT_WARPS) {
      float kd[D], vd[D];
      load_bf16_dims<D>(K + (size_t)i * HD + lane * D, kd);
      load_bf16_dims<D>(V + (size_t)i * HD + lane * D, vd);
#pragma unroll
      for (int j = 0; j < GQA_MAX; ++j) {
        if (j < n) {
          float s = 0.0f;
#pragma unroll
          for (int e = 0; e < D; ++e) s += qs[j][lane * D + e] * kd[e];
          s = warp_sum(s) * scale;
          const float m_new = fmaxf(m[j], s);
          const float correction = expf(m[j] - m_new);  // 0 on the first row (m = -inf)
          const float p = expf(s - m_new);
          l[j] = l[j] * correction + p;
#pragma unroll
          for (int e = 0; e < D; ++e) acc[j][e] = acc[j][e] * correction + p * vd[e];
          m[j] = m_new;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < GQA_MAX; ++j) {  // a head at a time through the merge buffers (4 KB at HD 256, not 32)
      if (j >= n) break;
      __syncthreads();  // the previous head's merge reads are done
      if (lane == 0) { merge_m[warp] = m[j]; merge_l[warp] = l[j]; }
#pragma unroll
      for (int e = 0; e < D; ++e) merge_acc[warp][lane * D + e] = acc[j][e];
      __syncthreads();
      write_merged<HD>(merge_m, merge_l, merge_acc, ((size_t)t * heads + g * G + first + j) * gridDim.x + blockIdx.x,
                       part_ml, part_acc);
    }
  }
}

// bf16 cache in one launch: the group's chunk partials, then (the last chunk of a row and KV head to
// arrive, counted in arrivals[t * kv + g], left at 0) the combine of attention_combine for each of its
// query heads, gate and forms included. Launch: grid (chunks, kv, T), block 128.
template <int HD>
__device__ void attention_bf16(const float* q, const u16* keys, const u16* values, int capacity, const int* start,
                               int heads, int kv, int chunk, float scale, float* part_ml, float* part_acc,
                               int* arrivals, float* out, const float* gates, long long gate_row_stride, int gated,
                               u16* y_bf16, signed char* y_q, float* y_scale, int forms) {
  attention_partial_group<HD>(q, keys, values, capacity, start, heads, kv, chunk, scale, part_ml, part_acc);
  const int g = blockIdx.y, t = blockIdx.z, G = heads / kv;
  if (!last_to_arrive(arrivals + t * kv + g, gridDim.x)) return;
  for (int h = g * G; h < (g + 1) * G; ++h)
    combine_head(part_ml, part_acc, nullptr, out, HD, h, t, heads, gridDim.x, gridDim.x, gates, gate_row_stride, gated,
                 y_bf16, y_q, y_scale, forms);
}

#define ATTENTION_PARTIALS(HD)                                                                                  \
  extern "C" __global__ void __launch_bounds__(128, 4) attention_bf16_hd##HD(                                   \
      const float* q, const u16* keys, const u16* values, int capacity, const int* start, int heads, int kv,   \
      int chunk, float scale, float* part_ml, float* part_acc, int* arrivals, float* out, const float* gates,  \
      long long gate_row_stride, int gated, u16* y_bf16, signed char* y_q, float* y_scale, int forms) {        \
    attention_bf16<HD>(q, keys, values, capacity, start, heads, kv, chunk, scale, part_ml, part_acc, arrivals, \
                       out, gates, gate_row_stride, gated, y_bf16, y_q, y_scale, forms);                       \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(128) attention_partial_q4_hd##HD(                               \
      const float* q, const float* signs, const u8* key_codes, const u16* key_scales, const u8* value_codes,   \
      const u16* value_scales, int capacity, const int* start, int heads, int kv, int chunk, float scale,      \
      float* part_ml, float* part_acc, int chunk_offset, int n_slots) {                                        \
    attention_partial_q4<HD>(q, signs, key_codes, key_scales, value_codes, value_scales, capacity, start,      \
                             heads, kv, chunk, scale, part_ml, part_acc, chunk_offset, n_slots);               \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(128) attention_partial_exact_hd##HD(                            \
      const float* q, const float* sink_keys, const float* sink_values, const float* ring_keys,                \
      const float* ring_values, int ring_rows, const int* start, int heads, int kv, int chunk, float scale,    \
      float* part_ml, float* part_acc, int n_slots) {                                                          \
    attention_partial_exact<HD>(q, sink_keys, sink_values, ring_keys, ring_values, ring_rows, start, heads,    \
                                kv, chunk, scale, part_ml, part_acc, n_slots);                                 \
  }
ATTENTION_PARTIALS(64)
ATTENTION_PARTIALS(128)
ATTENTION_PARTIALS(256)

// ------------------------------------------------------------------- QSA's selected rows ---
// Flash-Next's indexed attention: query row t (cache row *start + t) reads only the cache rows
// selected[t, 0 .. counts[t]) (ascending, the row itself last; flash_next.cu's qsa_select lists them),
// so nothing is masked. The partials run attention_partial over list indices: `Selected` maps list
// index i to the cache row its source reads. On the q4 cache the list's exact rows (positions below
// the sink's end, and the recent window before the row's end) are its first and last entries and the
// quantized middle the run between them, found by binary search; the exact partial skips that run.
// Launch (each): grid (chunks, heads, T) over list indices, block 128; then attention_combine.

// The first index of ascending a[0 .. n) whose value is >= value (n if none).
__device__ int lower_bound(const int* a, int n, int value) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (a[mid] < value) lo = mid + 1; else hi = mid;
  }
  return lo;
}

template <class Rows>
struct Selected {
  Rows rows;
  const int* list;   // the query row's selected cache rows
  int skip_at, skip;  // list index i >= skip_at reads entry i + skip (the exact partial's jump over the middle)
  __device__ int at(int i) const { return list[i < skip_at ? i : i + skip]; }
  __device__ void key(int i, int lane, float* d) const { rows.key(at(i), lane, d); }
  __device__ void value(int i, int lane, float* d) const { rows.value(at(i), lane, d); }
};

template <int HD>
struct ExactByPosition {  // q4 cache's exact rows by position: the sink below Q4_SINK, else the ring
  const float *sink_keys, *sink_values, *ring_keys, *ring_values;
  int ring_rows;
  __device__ void load(const float* sink, const float* ring, int p, int lane, float* d) const {
    const float* row = (p < Q4_SINK ? sink + (size_t)p * HD : ring + (size_t)(p % ring_rows) * HD) + lane * (HD / WARP);
#pragma unroll
    for (int e = 0; e < HD / WARP; ++e) d[e] = row[e];
  }
  __device__ void key(int p, int lane, float* d) const { load(sink_keys, ring_keys, p, lane, d); }
  __device__ void value(int p, int lane, float* d) const { load(sink_values, ring_values, p, lane, d); }
};

// The list of query row t and its quantized run [middle_lo, middle_hi) on the q4 cache.
struct RowList {
  const int* list;
  int n, middle_lo, middle_hi;
  __device__ RowList(const int* selected, const int* counts, int width, int end, int t)
      : list(selected + (size_t)t * width), n(counts[t]) {
    middle_lo = lower_bound(list, n, Q4_SINK);
    middle_hi = lower_bound(list, n, max(Q4_SINK, end - Q4_RECENT));
  }
};

template <int HD>
__device__ void sparse_attention_partial_bf16(const float* q, const u16* keys, const u16* values, int capacity,
                                              const int* selected, const int* counts, int width, int heads, int kv,
                                              int chunk, float scale, float* part_ml, float* part_acc, int n_slots) {
  __shared__ float qs[HD];
  const int h = blockIdx.y, t = blockIdx.z, kvh = h / (heads / kv);
  for (int i = threadIdx.x; i < HD; i += blockDim.x) qs[i] = q[((size_t)t * heads + h) * HD + i];
  __syncthreads();
  const Selected<Bf16Rows<HD>> rows{{keys + (size_t)kvh * capacity * HD, values + (size_t)kvh * capacity * HD},
                                    selected + (size_t)t * width, width, 0};
  attention_partial<HD>(rows, qs, 0, counts[t], t, h, heads, chunk, 0, n_slots, scale, part_ml, part_acc);
}

// q4 cache, the listed rows of the quantized middle, slots chunk_offset.. (q rotated as in attention_partial_q4).
template <int HD>
__device__ void sparse_attention_partial_q4(const float* q, const float* signs, const u8* key_codes,
                                            const u16* key_scales, const u8* value_codes, const u16* value_scales,
                                            int capacity, const int* start, const int* selected, const int* counts,
                                            int width, int heads, int kv, int chunk, float scale, float* part_ml,
                                            float* part_acc, int chunk_offset, int n_slots) {
  __shared__ float qs[HD];
  const int h = blockIdx.y, t = blockIdx.z, kvh = h / (heads / kv);
  for (int i = threadIdx.x; i < HD; i += blockDim.x) qs[i] = q[((size_t)t * heads + h) * HD + i] * signs[i];
  block_fwht(qs, HD);
  for (int i = threadIdx.x; i < HD; i += blockDim.x) qs[i] *= 1.0f / sqrtf((float)HD);
  __syncthreads();
  const RowList listed(selected, counts, width, *start + t + 1, t);
  const Selected<Q4Rows<HD>> rows{{key_codes + (size_t)kvh * capacity * (HD / 2), value_codes + (size_t)kvh * capacity * (HD / 2),
                                   key_scales + (size_t)kvh * capacity * (HD / 32), value_scales + (size_t)kvh * capacity * (HD / 32)},
                                  listed.list, listed.n, 0};
  attention_partial<HD>(rows, qs, listed.middle_lo, listed.middle_hi, t, h, heads, chunk, chunk_offset, n_slots, scale,
                        part_ml, part_acc);
}

// q4 cache, the listed exact rows (the sink, the recent window), slots 0..
template <int HD>
__device__ void sparse_attention_partial_exact(const float* q, const float* sink_keys, const float* sink_values,
                                               const float* ring_keys, const float* ring_values, int ring_rows,
                                               const int* start, const int* selected, const int* counts, int width,
                                               int heads, int kv, int chunk, float scale, float* part_ml,
                                               float* part_acc, int n_slots) {
  __shared__ float qs[HD];
  const int h = blockIdx.y, t = blockIdx.z, kvh = h / (heads / kv);
  for (int i = threadIdx.x; i < HD; i += blockDim.x) qs[i] = q[((size_t)t * heads + h) * HD + i];
  __syncthreads();
  const RowList listed(selected, counts, width, *start + t + 1, t);
  const int middle = listed.middle_hi - listed.middle_lo;
  const Selected<ExactByPosition<HD>> rows{{sink_keys + (size_t)kvh * Q4_SINK * HD, sink_values + (size_t)kvh * Q4_SINK * HD,
                                            ring_keys + (size_t)kvh * ring_rows * HD, ring_values + (size_t)kvh * ring_rows * HD,
                                            ring_rows},
                                           listed.list, listed.middle_lo, middle};
  attention_partial<HD>(rows, qs, 0, listed.n - middle, t, h, heads, chunk, 0, n_slots, scale, part_ml, part_acc);
}

#define SPARSE_ATTENTION_PARTIALS(HD)                                                                           \
  extern "C" __global__ void __launch_bounds__(128) sparse_attention_partial_bf16_hd##HD(                      \
      const float* q, const u16* keys, const u16* values, int capacity, const int* selected, const int* counts, \
      int width, int heads, int kv, int chunk, float scale, float* part_ml, float* part_acc, int n_slots) {    \
    sparse_attention_partial_bf16<HD>(q, keys, values, capacity, selected, counts, width, heads, kv, chunk,     \
                                      scale, part_ml, part_acc, n_slots);                                       \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(128) sparse_attention_partial_q4_hd##HD(                        \
      const float* q, const float* signs, const u8* key_codes, const u16* key_scales, const u8* value_codes,   \
      const u16* value_scales, int capacity, const int* start, const int* selected, const int* counts,         \
      int width, int heads, int kv, int chunk, float scale, float* part_ml, float* part_acc, int chunk_offset, \
      int n_slots) {                                                                                            \
    sparse_attention_partial_q4<HD>(q, signs, key_codes, key_scales, value_codes, value_scales, capacity,      \
                                    start, selected, counts, width, heads, kv, chunk, scale, part_ml,          \
                                    part_acc, chunk_offset, n_slots);                                          \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(128) sparse_attention_partial_exact_hd##HD(                     \
      const float* q, const float* sink_keys, const float* sink_values, const float* ring_keys,                \
      const float* ring_values, int ring_rows, const int* start, const int* selected, const int* counts,       \
      int width, int heads, int kv, int chunk, float scale, float* part_ml, float* part_acc, int n_slots) {    \
    sparse_attention_partial_exact<HD>(q, sink_keys, sink_values, ring_keys, ring_values, ring_rows, start,    \
                                       selected, counts, width, heads, kv, chunk, scale, part_ml, part_acc,    \
                                       n_slots);                                                                \
  }
SPARSE_ATTENTION_PARTIALS(64)
SPARSE_ATTENTION_PARTIALS(128)
SPARSE_ATTENTION_PARTIALS(256)

// --------------------------------------------------------------------------- combine ---
// out[t, h] = (sum over slots of e^(m_c - M) acc_c, the rotated slots unrotated) / (sum e^(m_c - M) l_c).
// Slots [0, n_plain) are in the model's basis, [n_plain, n_slots) rotated (q4 middle rows; signs
// given). With `gated`, times sigmoid of query head h's gate, read in place from the stacked
// projection's row t (gates + t * gate_row_stride + h * 2HD + HD: attention_gate's step), and also
// in the emitted forms o_proj reads (common.cuh). The block's threads stride over the HD dims; the
// partials are read past L1 (they may come from other blocks of the same launch).
__device__ void combine_head(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                             const float* __restrict__ signs, float* __restrict__ out, int HD, int h, int t, int heads,
                             int n_plain, int n_slots, const float* __restrict__ gates, long long gate_row_stride,
                             int gated, u16* y_bf16, signed char* y_q, float* y_scale, int forms) {
  __shared__ float plain_sums[256], rotated[256];
  const size_t first = ((size_t)t * heads + h) * n_slots;
  float M = NEG_INF, L = 0.0f;
  for (int c = 0; c < n_slots; ++c) M = fmaxf(M, __ldcg(part_ml + 2 * (first + c)));
  for (int c = 0; c < n_slots; ++c) {
    const float m = __ldcg(part_ml + 2 * (first + c));
    if (m != NEG_INF) L += expf(m - M) * __ldcg(part_ml + 2 * (first + c) + 1);  // an empty chunk adds nothing
  }
  for (int i = threadIdx.x; i < HD; i += blockDim.x) {
    float plain = 0.0f, rot = 0.0f;
    for (int c = 0; c < n_slots; ++c) {
      const float m = __ldcg(part_ml + 2 * (first + c));
      if (m == NEG_INF) continue;
      const float a = expf(m - M) * __ldcg(part_acc + (first + c) * HD + i);
      if (c < n_plain) plain += a; else rot += a;
    }
    plain_sums[i] = plain;
    rotated[i] = rot;
  }
  if (n_slots > n_plain) block_fwht(rotated, HD);  // unrotate: (r @ H / sqrt(HD)) * signs
  __syncthreads();
  for (int i = threadIdx.x; i < HD; i += blockDim.x) {
    float plain = plain_sums[i];
    if (n_slots > n_plain) plain += rotated[i] * (1.0f / sqrtf((float)HD)) * signs[i];
    float v = plain / L;
    if (gated) v *= sigmoid_f(gates[(size_t)t * gate_row_stride + (size_t)h * 2 * HD + HD + i]);
    const size_t at = ((size_t)t * heads + h) * HD + i;
    out[at] = v;
    emit_forms(v, at, forms, y_bf16, y_q, y_scale);
  }
}

// Launch: grid (heads, T), block HD.
extern "C" __global__ void attention_combine(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                                             const float* __restrict__ signs, float* __restrict__ out, int HD,
                                             int n_plain, int n_slots, const float* __restrict__ gates,
                                             long long gate_row_stride, int gated, u16* y_bf16, signed char* y_q,
                                             float* y_scale, int forms) {
  combine_head(part_ml, part_acc, signs, out, HD, blockIdx.x, blockIdx.y, gridDim.x, n_plain, n_slots, gates,
               gate_row_stride, gated, y_bf16, y_q, y_scale, forms);
}

// ------------------------------------------------------------------------- appending ---
// New rows at positions *start + t: k compact [T, kv, HD] (normed and rotated), v read in place
// from the stacked projection's rows, [kv, HD] at v + t * v_row_stride.

// bf16 cache. Launch: grid (T, kv), block HD.
extern "C" __global__ void kv_append_bf16(const float* __restrict__ k, const float* __restrict__ v,
                                          u16* __restrict__ keys, u16* __restrict__ values, const int* start,
                                          int capacity, int HD, long long v_row_stride) {
  const int t = blockIdx.x, kvh = blockIdx.y, kv = gridDim.y, i = threadIdx.x;
  const size_t dst = ((size_t)kvh * capacity + *start + t) * HD + i;
  keys[dst] = f32_to_bf16(k[((size_t)t * kv + kvh) * HD + i]);
  values[dst] = f32_to_bf16(v[(size_t)t * v_row_stride + (size_t)kvh * HD + i]);
}

// q4 cache (Q4KVCache.append): the exact row to the ring (and the sink for positions < SINK); the
// rotated row r = H diag(s) x / sqrt(HD) coded per 32: scale = f16(absmax / 7),
// code = clip(rint(r / scale), -7, 7) + 8, value 2i in the low nibble. One warp per 32-group.
// blockIdx.z: 0 keys, 1 values. Launch: grid (T, kv, 2), block HD.
extern "C" __global__ void kv_append_q4(const float* __restrict__ k, const float* __restrict__ v,
                                        const float* __restrict__ signs, u8* key_codes, u16* key_scales,
                                        u8* value_codes, u16* value_scales, float* sink_keys, float* sink_values,
                                        float* ring_keys, float* ring_values, int ring_rows, const int* start,
                                        int capacity, int HD, long long v_row_stride) {
  __shared__ float r[256];
  const int t = blockIdx.x, kvh = blockIdx.y, kv = gridDim.y, i = threadIdx.x, lane = i % WARP;
  const bool is_value = blockIdx.z == 1;
  const int position = *start + t;
  const float x = is_value ? v[(size_t)t * v_row_stride + (size_t)kvh * HD + i] : k[((size_t)t * kv + kvh) * HD + i];
  float* ring = is_value ? ring_values : ring_keys;
  ring[((size_t)kvh * ring_rows + position % ring_rows) * HD + i] = x;
  if (position < Q4_SINK) (is_value ? sink_values : sink_keys)[((size_t)kvh * Q4_SINK + position) * HD + i] = x;
  r[i] = x * signs[i];
  block_fwht(r, HD);
  const float y = r[i] * (1.0f / sqrtf((float)HD));
  const u16 scale_bits = f32_to_f16(warp_max(fabsf(y)) / 7.0f);
  const float scale = f16_to_f32(scale_bits);
  const float level = scale == 0.0f ? 0.0f : fminf(7.0f, fmaxf(-7.0f, rintf(y / scale)));
  const u32 code = (u32)((int)level + 8);
  const u32 high = __shfl_down_sync(0xffffffffu, code, 1);  // the odd neighbour's code
  const size_t row = (size_t)kvh * capacity + position;
  if (lane % 2 == 0) (is_value ? value_codes : key_codes)[row * (HD / 2) + i / 2] = (u8)(code | (high << 4));
  if (lane == 0) (is_value ? value_scales : key_scales)[row * (HD / 32) + i / 32] = scale_bits;
}
