// Flash-Next's own steps (engine/flash_next.py, FlashCpuOps: the numerics these reproduce, in fp32):
//   hyper-connections  the residual is hc streams [T, hc * H]; stream s of token t is the H values at
//                      t * hc * H + s * H. A stream's norm is norms.cu's rms_norm with one weight row
//                      per stream; the mixing and the injection are here.
//   PLE                the n-gram rows are gathered on the host (the table is a host table); the gate
//                      of key against query per stream and the dilated conv with its state are here.
//   QSA indexer        block keys pooled as blocks complete, blocks scored against the indexer's
//                      queries, the top blocks and the tail listed per query row; the sparse attention
//                      over the listed rows is attention.cu's (sparse_attention_partial_*).
#include "common.cuh"

// ------------------------------------------------------------------- hyper-connections ---

// out = silu(x / divisor): the input mixer's activation between its low-rank projections (divisor hc).
extern "C" __global__ void silu_div(const float* __restrict__ x, float* __restrict__ out, float divisor, long long n) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx < n) out[idx] = silu_f(x[idx] / divisor);
}

// The block's input: mixed[t, i] = mean over streams s of sigmoid(logits[t, s, i]) * normed[t, s, i].
// normed, logits [T, hc * H]; mixed [T, H]; n = T * H. Streams summed in order, then divided by hc
// (numpy's mean). Launch: a thread per output.
extern "C" __global__ void hc_mix(const float* __restrict__ normed, const float* __restrict__ logits,
                                  float* __restrict__ mixed, int H, int hc, long long n) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  const long long first = (idx / H) * hc * H + idx % H;  // stream 0's element
  float sum = 0.0f;
  for (int s = 0; s < hc; ++s) sum += sigmoid_f(logits[first + (long long)s * H]) * normed[first + (long long)s * H];
  mixed[idx] = sum / (float)hc;
}

// The block's output back into every stream: out_streams[t, s, i] = streams[t, s, i] + w * out[t, i],
// w = 2 sigmoid(logits[t, s] / hc) (the injection weight). streams, out_streams [T, hc * H]; out [T, H];
// logits [T, hc]; n = T * hc * H. Launch: a thread per output.
extern "C" __global__ void hc_inject(const float* __restrict__ streams, const float* __restrict__ out,
                                     const float* __restrict__ logits, float* __restrict__ out_streams, int H, int hc,
                                     long long n) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  const long long stream_row = idx / H;  // t * hc + s
  const float weight = 2.0f * sigmoid_f(logits[stream_row] / (float)hc);
  out_streams[idx] = streams[idx] + weight * out[(stream_row / hc) * H + idx % H];
}

// ----------------------------------------------------------------------------------- PLE ---

// The gate of stream s of token t: g = key . query / root_h over the stream's H values (key and query
// normed, [T, hc * H]; root_h = sqrt(H) in fp32), then sign(g) sqrt(max(|g|, 1e-6)); the value row
// value[t] [H] weighed by sigmoid of that into the stream: gated [T, hc * H].
// Launch: grid T * hc (a block per stream row), block 256.
extern "C" __global__ void ple_gate(const float* __restrict__ key, const float* __restrict__ query,
                                    const float* __restrict__ value, float* __restrict__ gated, int H, int hc,
                                    float root_h) {
  __shared__ float scratch[WARP];
  const size_t row = blockIdx.x, t = row / hc;
  float dot = 0.0f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) dot += key[row * H + i] * query[row * H + i];
  const float g = block_sum(dot, scratch) / root_h;
  const float sign = (float)((g > 0.0f) - (g < 0.0f));  // numpy's sign: 0 at 0
  const float weight = sigmoid_f(sqrtf(fmaxf(fabsf(g), 1e-6f)) * sign);
  for (int i = threadIdx.x; i < H; i += blockDim.x) gated[row * H + i] = weight * value[t * H + i];
}

// The dilated causal depthwise conv over x [T, C] (the normed gated values), its state the last
// R = (K - 1) * dilation inputs: window = [history ; x] [R + T, C] (kept: the next state is its last R
// rows, a rollback's any R rows of it), out[t, c] = gated[t, c] + silu(sum_k window[t + k * dilation, c]
// * taps[c, k]); tap k reads the input (K - 1 - k) * dilation rows back, taps summed in order.
// Launch: a thread per channel (it writes the window column it then reads: no other thread touches it).
extern "C" __global__ void ple_conv(const float* __restrict__ x, const float* __restrict__ taps,
                                    const float* __restrict__ history, float* __restrict__ window,
                                    const float* __restrict__ gated, float* __restrict__ out, int T, int C, int K,
                                    int dilation) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int R = (K - 1) * dilation;
  for (int j = 0; j < R + T; ++j)
    window[(size_t)j * C + c] = j < R ? history[(size_t)j * C + c] : x[(size_t)(j - R) * C + c];
  for (int t = 0; t < T; ++t) {
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) sum += window[(size_t)(t + k * dilation) * C + c] * taps[(size_t)c * K + k];
    out[(size_t)t * C + c] = gated[(size_t)t * C + c] + silu_f(sum);
  }
}

// -------------------------------------------------------------------------- QSA indexer ---

// Block keys of newly complete blocks: block b = first_block + blockIdx.x pools the raw index keys
// raw[b * ratio .. + ratio) [d] (mean: summed in order, divided by ratio), zero-centred RMSNorm (w = 1 +
// k_norm), then NeoX RoPE on the first rotary_dim dims at the position of the block's first token,
// b * ratio + offset (offset 1 in the MTP layer, whose positions run one ahead of its cache rows).
// Writes blocks[b] [d]. Launch: grid (new blocks), block d (32 .. 256, whole warps).
extern "C" __global__ void index_pool(const float* __restrict__ raw, const float* __restrict__ w,
                                      const float* __restrict__ inv_freq, float* __restrict__ blocks, int first_block,
                                      int ratio, int rotary_dim, int offset, float eps) {
  __shared__ float scratch[WARP];
  __shared__ float normed[256];
  const int d = blockDim.x, i = threadIdx.x, b = first_block + blockIdx.x;
  float sum = 0.0f;
  for (int r = 0; r < ratio; ++r) sum += raw[((size_t)b * ratio + r) * d + i];
  blocks[(size_t)b * d + i] =
      norm_rope_head(sum / (float)ratio, w, inv_freq, b * ratio + offset, d, rotary_dim, eps, scratch, normed);
}

// Block scores of query row t (cache row *start + t): for each complete block b (b < (row + 1) / ratio),
// scores[t, b] = sum over heads h, in order, of relu(q[t, h] . blocks[b]) (q normed and rotated,
// [T, heads, d]); -inf for the blocks past the row's, up to n_blocks. A warp per block, lanes along d.
// Launch: grid (ceil(n_blocks / 8), T), block 256.
extern "C" __global__ void index_scores(const float* __restrict__ q, const float* __restrict__ blocks,
                                        const int* __restrict__ start, float* __restrict__ scores, int heads, int d,
                                        int ratio, int n_blocks) {
  const int lane = threadIdx.x % WARP, b = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP, t = blockIdx.y;
  if (b >= n_blocks) return;
  const int complete = (*start + t + 1) / ratio;
  float total = NEG_INF;
  if (b < complete) {
    total = 0.0f;
    for (int h = 0; h < heads; ++h) {
      const float* qh = q + ((size_t)t * heads + h) * d;
      float dot = 0.0f;
      for (int e = lane; e < d; e += WARP) dot += qh[e] * blocks[(size_t)b * d + e];
      total += fmaxf(warp_sum(dot), 0.0f);
    }
  }
  if (lane == 0) scores[(size_t)t * n_blocks + b] = total;
}

#define QSA_MAX_TOP 1024  // top blocks a row may keep (indexer_budget / indexer_compress_ratio)

// The larger of two (score, block) pairs, the earlier block on a tie (numpy's stable argsort of -scores).
__device__ __forceinline__ void keep_best(float& score, int& block, float other_score, int other_block) {
  if (other_score > score || (other_score == score && other_block < block)) {
    score = other_score;
    block = other_block;
  }
}

// The cache rows query row t (cache row *start + t) reads, ascending, into selected[t] (width entries)
// and their count into counts[t]: every row up to its own while it has no more complete blocks than
// top_blocks; else its top_blocks best blocks (scores[t], which this overwrites) in block order, ratio
// rows each, then the incomplete tail. The top blocks are found one at a time: a block-wide argmax,
// the winner's score then set to -inf (every score is a relu sum >= 0, so it never wins again); the
// chosen blocks are placed in order by their ranks. Launch: grid T, block 256.
extern "C" __global__ void qsa_select(float* __restrict__ scores, const int* __restrict__ start,
                                      int* __restrict__ selected, int* __restrict__ counts, int n_blocks, int ratio,
                                      int top_blocks, int width) {
  __shared__ int chosen[QSA_MAX_TOP];
  __shared__ float warp_score[WARP];
  __shared__ int warp_block[WARP];
  const int t = blockIdx.x, row = *start + t, complete = (row + 1) / ratio;
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
  float* s = scores + (size_t)t * n_blocks;
  int* out = selected + (size_t)t * width;
  if (complete <= top_blocks) {
    for (int j = threadIdx.x; j <= row; j += blockDim.x) out[j] = j;
    if (threadIdx.x == 0) counts[t] = row + 1;
    return;
  }
  for (int k = 0; k < top_blocks; ++k) {
    float best = NEG_INF;
    int block = complete;  // past every block: loses every tie
    for (int j = threadIdx.x; j < complete; j += blockDim.x) keep_best(best, block, s[j], j);
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1)
      keep_best(best, block, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, block, o));
    if (lane == 0) { warp_score[warp] = best; warp_block[warp] = block; }
    __syncthreads();
    if (warp == 0) {
      best = lane < warps ? warp_score[lane] : NEG_INF;
      block = lane < warps ? warp_block[lane] : complete;
#pragma unroll
      for (int o = WARP / 2; o > 0; o >>= 1)
        keep_best(best, block, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, block, o));
      if (lane == 0) { chosen[k] = block; s[block] = NEG_INF; }
    }
    __syncthreads();
  }
  for (int k = threadIdx.x; k < top_blocks; k += blockDim.x) {
    int rank = 0;
    for (int j = 0; j < top_blocks; ++j) rank += chosen[j] < chosen[k];
    for (int r = 0; r < ratio; ++r) out[rank * ratio + r] = chosen[k] * ratio + r;
  }
  const int tail = complete * ratio, listed = top_blocks * ratio;
  for (int j = threadIdx.x; tail + j <= row; j += blockDim.x) out[listed + j] = tail + j;
  if (threadIdx.x == 0) counts[t] = listed + row + 1 - tail;
}
