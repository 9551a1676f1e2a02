"""Trellis-coded weights (REFERENCE.md section 4; QTIP-style bitshift trellis with a 1MAD code).

Bit layout. A tile is 16 x 8 weights (16 output rows by 8 input columns, row-major: weight
t = 8 * row + column, TILE = 128 weights). Its code is a circular ("tail-biting") stream of
TILE * k bits, weight t owning bits [t*k, t*k + k), most significant bit first. Weight t's state
is the STATE_BITS = 16 bit window that ends with its own bits, wrapping around the stream, read
MSB first. Equivalently the states form a shift register, state_t = ((state_{t-1} << k) | b_t) &
0xFFFF, and the circle closes: state_0 continues state_{TILE-1}. Stored, a tile is its stream
packed into TILE * k / 8 bytes (np.packbits order: stream bit 0 is the MSB of byte 0).

Level function (1MAD): x = state * C mod 2^32, b = sum of the 4 bytes of x (0..1020),
level = ((b + 2) >> 2) - 128, an int8 in -128..127. On the GPU the byte sum is one
dp4a(x, 0x40404040, 128) = 64 * b + 128 = 64 * (b + 2): its byte 1 is (b + 2) >> 2 = level + 128.

Multipliers. MULTIPLIERS[k] was chosen by measurement in two stages, on samples other than the
benchmark's. (1) Screen: 120 candidates np.random.default_rng(31337 + k).integers(2**24, 2**32,
size=120) | 1 plus the previous choice; those whose levels over all 65,536 states have |mean| < 0.5,
std 35..37.5 and excess kurtosis -0.35..-0.25 (the Irwin-Hall shape of a sum of four uniform
bytes; 2 to 4 per rate failed) ranked by free Viterbi MSE on two samples of 4 x 1,024 unit
Gaussians (rng 100 and 200) at step 1.0 / 1.07 / 1.10 times 1/std(levels) for k = 2 / 3 / 4 (the
two samples' rankings correlate 0.83 / 0.97 / 0.94). (2) The screen's best 6 and the previous
choice (the 2-bit one was among them) through rank_multipliers on 64 held-out tiles
(np.random.default_rng(300)) at steps STEPS[k] * (0.975, 1, 1.025); lowest kept. Its spread:
2 bits 0.07023..0.07085, 3 bits 0.017743..0.017872, 4 bits 0.004523..0.004563, the previous
multipliers (0x155B2CD7, 0xD4EBAABD, 0x5E3261F9) 0.4%, 0.7% and 0.4% above the kept ones. Most odd C
are about as good; a few are much worse (3 bits: up to 0.0234 in the screen).

Tail-biting costs the tile format 2 to 3% over the same code run as one long stream (what the
seed's article measured; `duet bench trellis` prints both). On one set of 4 x 1,024 Gaussians at
2 bits (previous multiplier) a free Viterbi over each 1,024-sample stream gives 0.0684, tail-biting
circles of 1,024 / 256 / 128 samples 0.0690 / 0.0694 / 0.0705. Circles this short also make the
half-rotation's guess at the shared bits matter: re-closing the circle at REFINE_CUTS
(see encode_states) took the benchmark's 2-bit tiles from 0.0716 to 0.0711 at one step (0.0709
and 0.0708 with cuts at 32 and 96 as well; each cut is one more Viterbi pass, 50% more time).

Incoherence. Before coding, a weight [N, K] is rotated along K in blocks of HADAMARD_BLOCK = 128:
W_rot[:, block] = (W[:, block] * signs[block]) @ H / sqrt(128), H the Sylvester Hadamard matrix
and signs +-1 from np.random.default_rng(seed). The rotation is orthogonal, so
W @ x = W_rot @ rotate(x): activations get the same rotation at run time. Each rotated row is
divided by its RMS (the per-row scale), coded at one global step, and dequantized as
level * row_scale with row_scale = RMS * step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duet.engine.errors import DuetError

TILE_ROWS, TILE_COLS = 16, 8
TILE = TILE_ROWS * TILE_COLS
STATE_BITS = 16
N_STATES = 1 << STATE_BITS
HADAMARD_BLOCK = 128
RATES = (2, 3, 4)
# The code itself: a GPU decoder must use these multipliers and level_of_states's function.
MULTIPLIERS = {2: 0x38D766E7, 3: 0x8AB0639B, 4: 0x10D48F1F}
# Step of a level in units of the data's RMS (levels have std ~36): centred on the best of a scan
# of 0.8/36 .. 1.1/36 on 2,048 unit Gaussians (seed 123) per rate, and on where the benchmark's
# per-sequence searches landed; SCALES is the small search around it.
STEPS = {2: 1.0 / 36, 3: 1.05 / 36, 4: 1.075 / 36}
SCALES = {k: tuple(np.float32(STEPS[k] * f) for f in (0.95, 0.975, 1.0, 1.025, 1.05)) for k in RATES}
ENCODE_CHUNK = 32
# Where encode_states re-closes the circle after the half-rotation's pass (weight indices).
REFINE_CUTS = (64,)
DP4A_ONES = 0x40404040
DP4A_BIAS = 128


# ------------------------------------------------------------------------------------ code ---

def level_of_states(states: np.ndarray, multiplier: int) -> np.ndarray:
    """1MAD level (int8 as int16 values -128..127) of each 16-bit state."""
    x = states.astype(np.uint32) * np.uint32(multiplier)  # wraps mod 2^32
    b = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
    return (((b + 2) >> 2).astype(np.int16) - 128)


def dp4a(a: np.ndarray, b: int, c: int) -> np.ndarray:
    """__dp4a on unsigned bytes: c + sum over the 4 byte lanes of a_i * b_i, mod 2^32."""
    a = a.astype(np.uint64)
    total = np.full(a.shape, c, dtype=np.uint64)
    for shift in (0, 8, 16, 24):
        total += ((a >> shift) & 0xFF) * ((b >> shift) & 0xFF)
    return (total & 0xFFFFFFFF).astype(np.uint32)


def level_of_states_dp4a(states: np.ndarray, multiplier: int) -> np.ndarray:
    """The GPU form: byte 1 of dp4a(state * C, 0x40404040, 128), minus 128."""
    x = states.astype(np.uint32) * np.uint32(multiplier)
    return ((dp4a(x, DP4A_ONES, DP4A_BIAS) >> 8) & 0xFF).astype(np.int16) - 128


def level_table(k: int) -> np.ndarray:
    """Levels of all 65,536 states for rate k, as float32 (the decoder's and encoder's codebook)."""
    return level_of_states(np.arange(N_STATES), MULTIPLIERS[k]).astype(np.float32)


# ------------------------------------------------------------------------- decode (tiles) ---

def unpack_states(packed: np.ndarray, k: int) -> np.ndarray:
    """packed uint8 [n, TILE*k/8] -> states [n, TILE] (uint32): the circular 16-bit windows."""
    bits = np.unpackbits(packed, axis=1)  # [n, L], stream order
    length = TILE * k
    ends = (np.arange(TILE) + 1) * k  # window of weight t is bits [ends[t] - 16, ends[t]) mod L
    index = (ends[:, None] - STATE_BITS + np.arange(STATE_BITS)[None, :]) % length  # [TILE, 16]
    weights = (1 << np.arange(STATE_BITS - 1, -1, -1)).astype(np.uint32)
    return bits[:, index].astype(np.uint32) @ weights


def decode_tiles(packed: np.ndarray, k: int) -> np.ndarray:
    """packed uint8 [n, TILE*k/8] -> int8 levels [n, TILE]."""
    return level_of_states(unpack_states(packed, k), MULTIPLIERS[k]).astype(np.int8)


def pack_states(states: np.ndarray, k: int) -> np.ndarray:
    """states [n, TILE] of a consistent circular path -> packed uint8 [n, TILE*k/8] (own bits only)."""
    own = (states & ((1 << k) - 1)).astype(np.uint8)  # b_t, k bits each
    bits = (own[:, :, None] >> np.arange(k - 1, -1, -1, dtype=np.uint8)) & 1  # MSB first
    return np.packbits(bits.reshape(len(states), TILE * k), axis=1)


# -------------------------------------------------------------------------- encode (Viterbi) ---

def _viterbi(target: np.ndarray, levels: np.ndarray, k: int, prefix: np.ndarray | None) -> np.ndarray:
    """Least-squares state path for target [n, T] (already divided by the step) -> states [n, T].

    Cost layout: costs are held as [n, 2^k, 2^(16-k)] indexed (b, m) for state s = (m << k) | b,
    so that adding a step's errors broadcasts over an outer axis. The predecessors of a state with
    s >> k = mid are (hi << (16-k)) | mid for the 2^k values of hi; in (b, m) layout a predecessor
    sits at b = mid & (2^k - 1), m = (hi << (16-2k)) | (mid >> k). So the best cost into each mid
    is a min over axis 2 of costs viewed [n, 2^k (b), 2^k (hi), 2^(16-2k)], transposed back to
    natural mid order. Backpointers store hi (uint8) per (step, mid).
    With prefix [n] (the top 16-k bits the circle fixes), the path must start in a state whose
    top 16-k bits are prefix and end in one whose low 16-k bits are prefix.
    """
    n, steps = target.shape
    n_hi, n_mid = 1 << k, 1 << (STATE_BITS - k)
    states = (np.arange(n_mid)[None, :] << k) | np.arange(n_hi)[:, None]  # [2^k, 2^(16-k)] (b, m)
    by_bm = levels[states]
    cost = (target[:, 0, None, None] - by_bm[None]) ** 2  # [n, b, m]
    if prefix is not None:
        starts = np.arange(n_mid)[None, None, :] == prefix[:, None, None]
        cost = np.where(starts, cost, np.float32(np.inf))
    back = np.empty((steps, n, n_mid), dtype=np.uint8)
    for t in range(1, steps):
        best, back[t] = _min_over_predecessors(cost, k)
        cost = (target[:, t, None, None] - by_bm[None]) ** 2
        cost += best[:, None, :]
    if prefix is not None:
        closes = (states[None] & (n_mid - 1)) == prefix[:, None, None]
        cost = np.where(closes, cost, np.float32(np.inf))
    last = states.reshape(-1)[cost.reshape(n, -1).argmin(axis=1)]
    return _backtrack(back, last, k)


def _min_over_predecessors(cost: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """cost [n, b, m] -> (best cost into each mid [n, 2^(16-k)], the hi attaining it, uint8)."""
    n, n_hi = len(cost), 1 << k
    grouped = cost.reshape(n, n_hi, n_hi, -1)  # [n, b, hi, mid >> k]
    best = grouped.min(axis=2)
    arg = np.zeros(best.shape, dtype=np.uint8)
    for hi in range(1, n_hi):  # the largest hi attaining the min; uint8 arithmetic is the fast path
        arg = np.maximum(arg, (grouped[:, :, hi] == best).view(np.uint8) * np.uint8(hi))
    # mid = ((mid >> k) << k) | b: natural mid order is the transpose of (b, mid >> k).
    return best.transpose(0, 2, 1).reshape(n, -1), arg.transpose(0, 2, 1).reshape(n, -1)


def _backtrack(back: np.ndarray, last: np.ndarray, k: int) -> np.ndarray:
    steps, n, _ = back.shape
    low = STATE_BITS - k
    states = np.empty((n, steps), dtype=np.int64)
    states[:, -1] = last
    rows = np.arange(n)
    for t in range(steps - 1, 0, -1):
        mid = states[:, t] >> k
        states[:, t - 1] = (back[t, rows, mid].astype(np.int64) << low) | mid
    return states


def free_path(target: np.ndarray, k: int) -> np.ndarray:
    """Least-squares path [n, T] for target [n, T] with a free start and end: the code run as one
    long stream, not a storable tile (its first state holds 16-k bits of its own)."""
    return _viterbi(np.asarray(target, dtype=np.float32), level_table(k), k, None)


def encode_tiles(target: np.ndarray, k: int) -> np.ndarray:
    """target [n, TILE] in units of a level step -> packed tail-biting streams uint8 [n, TILE*k/8].

    ENCODE_CHUNK tiles at a time: a tile's Viterbi holds 256 KB of costs and 128 * 2^(16-k) bytes
    of backpointers (2 MB at k = 2).
    """
    chunks = [encode_states(target[i:i + ENCODE_CHUNK], k) for i in range(0, len(target), ENCODE_CHUNK)]
    return pack_states(np.concatenate(chunks), k)


def encode_states(target: np.ndarray, k: int) -> np.ndarray:
    """target [n, TILE] in units of a level step -> the chosen circular state paths [n, TILE].

    Tail-biting (QTIP Alg. 4): code the sequence rotated by half with a free Viterbi; its path is
    consistent all round except where it was cut, at `half`. Closing it at 0 (holding the 16-k bits
    that weight TILE-1 shares with weight 0 to what that path chose there) and coding again gives a
    circular path. Then each of REFINE_CUTS closes the current circular path at another place:
    the bits shared across that cut stay, every other bit is coded afresh. The current path is
    among the candidates, so no pass can raise a tile's error; each frees the bits the previous
    pass held, which the half-rotation's guess had fixed.
    """
    levels = level_table(k)
    target = np.asarray(target, dtype=np.float32)
    half = TILE // 2
    path = np.roll(_viterbi(np.roll(target, -half, axis=1), levels, k, None), half, axis=1)
    for cut in (0, *REFINE_CUTS):
        path = _closed_at(target, levels, k, path, cut)
    return path


def _closed_at(target: np.ndarray, levels: np.ndarray, k: int, path: np.ndarray, cut: int) -> np.ndarray:
    """Best circular path [n, TILE] that keeps path's 16-k bits shared by weights cut-1 and cut.

    Those are the low bits of state cut-1 and the top bits of state cut: in the sequence rotated to
    start at `cut` they are where the stream starts and where it ends.
    """
    shared = path[:, cut - 1] & ((1 << (STATE_BITS - k)) - 1)  # cut 0: index -1, weight TILE - 1
    closed = _viterbi(np.roll(target, -cut, axis=1), levels, k, shared)
    return np.roll(closed, cut, axis=1)


def quantize_sequences(x: np.ndarray, k: int, step: float) -> tuple[np.ndarray, np.ndarray]:
    """x [n, TILE] -> (packed codes, reconstruction) at a given global step (x ~ level * step)."""
    packed = encode_tiles(x / np.float32(step), k)
    return packed, decode_tiles(packed, k).astype(np.float32) * np.float32(step)


def best_scale_mse(x: np.ndarray, k: int, scales=None) -> tuple[float, float]:
    """(lowest MSE, its step) of trellis coding x [n, TILE] over a small global-step search."""
    results = []
    for step in scales or SCALES[k]:
        _, recon = quantize_sequences(x, k, step)
        results.append((float(np.mean((recon - x) ** 2)), float(step)))
    return min(results)


def level_moments(multiplier: int) -> tuple[float, float, float]:
    """(mean, std, excess kurtosis) of the levels over all 65,536 states."""
    levels = level_of_states(np.arange(N_STATES), multiplier).astype(np.float64)
    centred = levels - levels.mean()
    var = np.mean(centred ** 2)
    return float(levels.mean()), float(np.sqrt(var)), float(np.mean(centred ** 4) / var ** 2 - 3)


def near_gaussian(multiplier: int) -> bool:
    mean, std, kurt = level_moments(multiplier)
    return abs(mean) < 0.5 and 35.0 <= std <= 37.5 and -0.35 <= kurt <= -0.25


def rank_multipliers(candidates, k: int, x: np.ndarray, scales) -> list[tuple[float, int]]:
    """[(Viterbi MSE on x at the best of scales, C)] for the near-Gaussian candidates, best first."""
    saved = MULTIPLIERS[k]
    ranked = []
    try:
        for c in candidates:
            if near_gaussian(int(c)):
                MULTIPLIERS[k] = int(c)
                ranked.append((best_scale_mse(x, k, scales)[0], int(c)))
    finally:
        MULTIPLIERS[k] = saved
    return sorted(ranked)


# ---------------------------------------------------------------- matrices (incoherence) ---

def rotation_signs(k_dim: int, seed: int) -> np.ndarray:
    """+-1 float32 [K]: the seeded random signs of the rotation."""
    return np.where(np.random.default_rng(seed).random(k_dim) < 0.5, -1, 1).astype(np.float32)


def _hadamard_blocks(x: np.ndarray) -> np.ndarray:
    """x [..., K] -> each 128-block times H / sqrt(128), by the fast Walsh-Hadamard butterflies.

    H is the Sylvester Hadamard matrix, H_2n = [[H_n, H_n], [H_n, -H_n]], symmetric.

    Elementwise adds in a fixed order, so a row's result never depends on the other rows (a BLAS
    product could change its summation order with the row count).
    """
    shape = x.shape
    y = x.reshape(-1, HADAMARD_BLOCK)
    half = 1
    while half < HADAMARD_BLOCK:
        pairs = y.reshape(len(y), -1, 2, half)  # butterflies join i and i + half in blocks of 2 * half
        y = np.concatenate([pairs[:, :, :1] + pairs[:, :, 1:], pairs[:, :, :1] - pairs[:, :, 1:]], axis=2)
        half *= 2
    return (y.reshape(shape) * np.float32(1 / np.sqrt(HADAMARD_BLOCK))).astype(np.float32)


def rotate_inputs(x: np.ndarray, seed: int) -> np.ndarray:
    """x [..., K] -> x rotated along K in 128-blocks: block @ diag(signs) @ H / sqrt(128).

    Orthogonal, so W @ x = rotate_inputs(W) @ rotate_inputs(x) for W [N, K].
    """
    return _hadamard_blocks(x.astype(np.float32) * rotation_signs(x.shape[-1], seed))


def unrotate_inputs(x: np.ndarray, seed: int) -> np.ndarray:
    """Inverse of rotate_inputs (H is symmetric and H @ H = 128 I)."""
    return _hadamard_blocks(x.astype(np.float32)) * rotation_signs(x.shape[-1], seed)


def to_tiles(w: np.ndarray) -> np.ndarray:
    """[N, K] -> tiles [N/16 * K/8, 128]: row-tile major, then column tile; row-major inside."""
    n, k_dim = w.shape
    return w.reshape(n // TILE_ROWS, TILE_ROWS, k_dim // TILE_COLS, TILE_COLS).transpose(0, 2, 1, 3).reshape(-1, TILE)


def from_tiles(tiles: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Inverse of to_tiles."""
    n, k_dim = shape
    return tiles.reshape(n // TILE_ROWS, k_dim // TILE_COLS, TILE_ROWS, TILE_COLS).transpose(0, 2, 1, 3).reshape(n, k_dim)


@dataclass(frozen=True)
class TrellisWeight:
    """A trellis-coded weight [N, K]: W ~ unrotate(level * row_scale) along K.

    packed     uint8 [N/16 * K/8, 128*k/8]  tile streams in to_tiles order
    row_scale  float32 [N]                  RMS of the rotated row times the rate's step
    """

    packed: np.ndarray
    row_scale: np.ndarray
    shape: tuple[int, int]
    k: int
    seed: int

    def decode_rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows start..stop-1: (levels as float32 [r, K/128, 128] in the rotated basis, row_scale [r])."""
        n, k_dim = self.shape
        first, last = start // TILE_ROWS, -(-stop // TILE_ROWS)
        tiles_per_row_tile = k_dim // TILE_COLS
        packed = self.packed[first * tiles_per_row_tile:last * tiles_per_row_tile]
        levels = from_tiles(decode_tiles(packed, self.k), ((last - first) * TILE_ROWS, k_dim))
        rows = levels[start - first * TILE_ROWS:stop - first * TILE_ROWS].astype(np.float32)
        return rows.reshape(stop - start, -1, HADAMARD_BLOCK), self.row_scale[start:stop]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.row_scale.nbytes

    def take_rows(self, rows: np.ndarray) -> TrellisWeight:
        """The weight of `rows` (qwen3_next's fused projections split by head), without re-coding.

        A tile codes 16 rows together, so rows must come in whole 16-row bands (band b: rows
        16b .. 16b + 15 in order); any band order works, the tiles move as they are.
        """
        rows = np.asarray(rows)
        n, k_dim = self.shape
        bands = rows[::TILE_ROWS] // TILE_ROWS
        if len(rows) % TILE_ROWS or not np.array_equal(rows, (bands[:, None] * TILE_ROWS + np.arange(TILE_ROWS)).ravel()):
            raise DuetError(f"a trellis weight [{n}, {k_dim}] codes rows in 16-row tiles; this model splits it at "
                            "rows that cut a tile: convert it to int4 instead")
        tiles = self.packed.reshape(n // TILE_ROWS, k_dim // TILE_COLS, -1)[bands]  # [bands, K/8, tile bytes]
        return TrellisWeight(tiles.reshape(-1, self.packed.shape[1]), self.row_scale[rows], (len(rows), k_dim),
                             self.k, self.seed)

    def dequantize_rotated(self) -> np.ndarray:
        levels, scale = self.decode_rows(0, self.shape[0])
        return levels.reshape(self.shape) * scale[:, None]

    def dequantize(self) -> np.ndarray:
        """The fp32 weight [N, K] in the original basis."""
        return unrotate_inputs(self.dequantize_rotated(), self.seed)


def quantize_matrix(w: np.ndarray, k: int, seed: int, step: float) -> TrellisWeight:
    """Rotate W [N, K] (N % 16 == 0, K % 128 == 0) along K, scale rows to unit RMS, trellis-code."""
    rotated = rotate_inputs(w, seed)
    rms = np.sqrt(np.mean(rotated.astype(np.float64) ** 2, axis=1)).astype(np.float32)
    rms = np.where(rms > 0, rms, np.float32(1))
    packed = encode_tiles(to_tiles(rotated / rms[:, None]) / np.float32(step), k)
    return TrellisWeight(packed, rms * np.float32(step), tuple(w.shape), k, seed)


def rotated_int8_activations(x: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """x [T, K] -> the w4a8 route's activations for trellis weights: rotated like the weights, then
    int8 per 128-block (one rotation block): (q [T, K/128, 128] integers in fp32, scale [T, K/128]).

    An integer dot of a block, |sum| <= 128 * 128 * 127 < 2^24, is exact in fp32.
    """
    blocks = rotate_inputs(x, seed).reshape(len(x), -1, HADAMARD_BLOCK)
    scale = np.abs(blocks).max(axis=-1) / np.float32(127)
    safe = np.where(scale > 0, scale, np.float32(1))[..., None]
    return np.rint(blocks / safe), scale
