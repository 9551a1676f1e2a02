"""Compiled twins (numba) of the sampler's steps on the host: the op set's top-k candidates,
engine/sampling.py's warpers (temperature, top-k, top-p), softmax and draw, and the sampled rules of
speculative.accept.

A sampled cycle on the demo ran ~40 numpy calls a draft and ~60 a verify pass, each on a few dozen
numbers: 0.45 ms of a 1.4 ms cycle, against ~30 us of arithmetic. These take one call a step.

Numerics, against engine/sampling.py's numpy code (tests/engine/test_sampling_kernels.py):
- candidates, warpers, draws: the same bits. Temperature is the same float32 division; top-k keeps
  what is at or above the k-th largest value (selection, no arithmetic); a draw sums float64 in
  numpy's cumsum order and compares the same quotients.
- acceptance: speculative.accept's loop step for step on the softmax below, the residual in float32
  with numpy's sum order: the same verdict, from the same uniforms of the sampler's own generator.
- softmax: float64 as numpy's (the maximum subtracted, the sum in numpy's pairwise order), with
  exp from the C library where numpy has its own vector exp: a result may differ in the last bits of
  float64 (4 ulp at most in the tests; 4% of values differ at all), a float32 probability only where
  that straddles a float32 rounding boundary (none of the tests' 10^5), and top-p's kept set only where
  the mass above a token is within those ulp of top_p.
"""

from __future__ import annotations

import numpy as np

from duet.engine.backend import compiled

jit = compiled.kernel_jit()
_prange = compiled._prange  # a global of numba.prange's own value: numba sees a parallel loop only so

# numpy sums a contiguous float row in blocks of this many, eight accumulators each (pairwise.c).
PAIRWISE_BLOCK = 128


def available() -> bool:
    """Whether these kernels run: numba importable and DUET_CPU_KERNELS not set to numpy (compiled.unavailable)."""
    return compiled.unavailable() is None


@jit
def _block_sum(a, lo, n, zero):
    """sum(a[lo : lo + n]), n <= PAIRWISE_BLOCK, in numpy's order: under 8 terms one by one from
    `zero` (0 in a's dtype: numpy sums float32 in float32); else eight interleaved partial sums added
    as ((0+1)+(2+3))+((4+5)+(6+7)), then the tail."""
    if n < 8:
        total = zero
        for i in range(lo, lo + n):
            total += a[i]
        return total
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    whole = n - n % 8
    for i in range(lo + 8, lo + whole, 8):
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for i in range(lo + whole, lo + n):
        total += a[i]
    return total


@jit
def _pairwise_sum(a, n, zero):
    """sum(a[:n]) in numpy's pairwise order, in the dtype of `zero` (a's: 0.0 for float64, np.float32(0)
    for float32): blocks of up to PAIRWISE_BLOCK summed as _block_sum, a longer range as the sum of its
    halves (cut at a multiple of 8). The recursion runs on an explicit stack: numba's disk cache loads
    recursive functions wrongly (a crash on the second run)."""
    starts, lengths, phases = np.empty(64, np.int64), np.empty(64, np.int64), np.empty(64, np.int64)
    sums = np.empty(64, a.dtype)
    top, held = 0, 0
    starts[0], lengths[0], phases[0] = 0, n, 0
    while top >= 0:
        lo, m = starts[top], lengths[top]
        half = m // 2 - (m // 2) % 8
        if m <= PAIRWISE_BLOCK:
            sums[held] = _block_sum(a, lo, m, zero)
            held += 1
            top -= 1
        elif phases[top] < 2:  # push the left half, then the right
            phases[top] += 1
            first = phases[top] == 1
            starts[top + 1], lengths[top + 1], phases[top + 1] = (lo, half, 0) if first else (lo + half, m - half, 0)
            top += 1
        else:  # both halves summed: left + right
            held -= 1
            sums[held - 1] = sums[held - 1] + sums[held]
            top -= 1
    return sums[0]


@jit
def _softmax64_of(values, out):
    """out[:n] = softmax of values[:n] (float64, all finite): numpy's _softmax64 of a compact row."""
    n = len(values)
    top = values[0]
    for i in range(1, n):
        if values[i] > top:
            top = values[i]
    for i in range(n):
        out[i] = np.exp(np.float64(values[i]) - np.float64(top))
    total = _pairwise_sum(out, n, 0.0)
    for i in range(n):
        out[i] /= total


@jit
def softmax_rows(logits, out):
    """out[t] = softmax in float64 of row t over its finite entries, 0 elsewhere (sampling._softmax64
    of a row), stored in out's dtype (float32: sampling.probabilities)."""
    T, C = logits.shape
    where = np.empty(C, np.int64)
    values = np.empty(C, np.float64)
    probs = np.empty(C, np.float64)
    for t in range(T):
        n = 0
        for c in range(C):
            out[t, c] = 0.0
            if logits[t, c] > -np.inf:
                where[n] = c
                values[n] = logits[t, c]
                n += 1
        if n == 0:
            continue
        _softmax64_of(values[:n], probs)
        for i in range(n):
            out[t, where[i]] = probs[i]


@jit
def _kth_largest(row, k, heap):
    """The k-th largest of row (1 <= k <= len(row)), counted with repeats as np.partition counts them:
    the least of a min-heap of the k largest seen. NaNs are skipped."""
    size = 0
    for value in row:
        if value != value:
            continue
        if size < k:  # fill: sift the new value up
            i = size
            size += 1
            while i > 0 and heap[(i - 1) // 2] > value:
                heap[i] = heap[(i - 1) // 2]
                i = (i - 1) // 2
            heap[i] = value
        elif value > heap[0]:  # replace the least: sift down
            i = 0
            while True:
                child = 2 * i + 1
                if child >= k:
                    break
                if child + 1 < k and heap[child + 1] < heap[child]:
                    child += 1
                if heap[child] >= value:
                    break
                heap[i] = heap[child]
                i = child
            heap[i] = value
    return heap[0]


@jit
def _top_k_columns(logits, k, temperature):
    """(values [T, C], columns [C]) as CpuOps.top_k_candidates: the columns where some row's
    logits / temperature reach that row's k-th largest, ascending; the logits there, -inf where the
    row does not keep the column. Dividing by a positive temperature keeps the order, so the k-th
    largest of the quotients is the quotient of the k-th largest logit: one division a row there, and
    the comparisons (where x / t may round onto the k-th from below) in a loop LLVM vectorizes."""
    T, V = logits.shape
    heap = np.empty(k, np.float32)
    kth = np.empty(T, np.float32)
    kept = np.zeros(V, np.bool_)
    for t in range(T):
        kth[t] = _kth_largest(logits[t], k, heap) / temperature
        row, threshold = logits[t], kth[t]
        for j in range(V):
            kept[j] |= row[j] / temperature >= threshold
    columns = np.flatnonzero(kept)
    values = np.empty((T, len(columns)), np.float32)
    for t in range(T):
        for c in range(len(columns)):
            value = logits[t, columns[c]]
            values[t, c] = value if value / temperature >= kth[t] else -np.inf
    return values, columns


def top_k_columns(logits: np.ndarray, top_k: int, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    return _top_k_columns(np.ascontiguousarray(logits, np.float32), top_k, np.float32(temperature))


@jit
def _top_k_in_place(row, k, heap):
    """sampling._top_k of one row: -inf below the k-th largest finite value, when more than k are finite."""
    finite = 0
    for value in row:
        if value > -np.inf:
            finite += 1
    if finite <= k:
        return
    threshold = _kth_largest(row, k, heap)
    for c in range(len(row)):
        if row[c] < threshold:
            row[c] = -np.inf


@jit
def _top_p_in_place(row, top_p, where, values, probs):
    """sampling._top_p of one row: over the finite entries, most likely first (ties in column order),
    a token goes when the probability of those before it reaches top_p."""
    n = 0
    for c in range(len(row)):
        if row[c] > -np.inf:
            where[n] = c
            values[n] = row[c]
            n += 1
    if n == 0:
        return
    _softmax64_of(values[:n], probs)
    order = np.argsort(-values[:n], kind="mergesort")  # stable: equal values keep column order
    running = 0.0
    for i in order:
        running += probs[i]
        if running - probs[i] >= top_p:  # the mass above, as numpy's cumsum(p) - p (not the sum before: rounding)
            row[where[i]] = -np.inf


@jit
def _warp_rows(logits, temperature, top_k, top_p):
    """sampling._process after the penalties, without min-p: logits / temperature, then top-k, then top-p."""
    T, C = logits.shape
    out = np.empty((T, C), np.float32)
    heap = np.empty(max(top_k, 1), np.float32)
    where = np.empty(C, np.int64)
    values = np.empty(C, np.float64)
    probs = np.empty(C, np.float64)
    for t in range(T):
        for c in range(C):
            out[t, c] = logits[t, c] / temperature
        if 0 < top_k < C:
            _top_k_in_place(out[t], top_k, heap)
        if top_p < 1.0:
            _top_p_in_place(out[t], top_p, where, values, probs)
    return out


def warp_rows(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Rows [T, C] or one row [C] of float32 logits, warped (shape kept)."""
    rows = np.ascontiguousarray(logits, np.float32).reshape(-1, logits.shape[-1])
    return _warp_rows(rows, np.float32(temperature), int(top_k), float(top_p)).reshape(logits.shape)


@jit
def _draw_index(probs, u):
    """Sampler.draw: the first entry whose cumulative probability, over the nonzero entries in
    float64 and divided by their total, passes u (in [0, 1))."""
    total = 0.0
    last = -1
    for i in range(len(probs)):
        if probs[i] > 0:
            total += np.float64(probs[i])
            last = i
    below = 0.0
    for i in range(len(probs)):
        if probs[i] > 0:
            below += np.float64(probs[i])
            if below / total > u:
                return i
    return last


def draw_index(probs: np.ndarray, u: float) -> int:
    return int(_draw_index(np.ascontiguousarray(probs), float(u)))


@jit
def _probability_at(token, probs, ids):
    """speculative._probability_of: probs[j] where ids[j] == token (ids ascending), else 0, as float64."""
    at = np.searchsorted(ids, token)
    return np.float64(probs[at]) if at < ids.shape[0] and ids[at] == token else 0.0


@jit
def _residual_draw(p, p_ids, q, q_ids, u):
    """speculative._draw_residual: an id drawn at u from norm(max(0, p - q)) over the ids either covers
    (np.union1d of two ascending id lists is their merge), p where that is all 0; the float32
    difference, numpy's float32 sum and the quotient as speculative.residual computes them."""
    n = p_ids.shape[0] + q_ids.shape[0]
    union, rest, p_on = np.empty(n, np.int64), np.empty(n, np.float32), np.empty(n, np.float32)
    i = j = m = 0
    while i < p_ids.shape[0] or j < q_ids.shape[0]:
        take_p = j == q_ids.shape[0] or (i < p_ids.shape[0] and p_ids[i] <= q_ids[j])
        take_q = i == p_ids.shape[0] or (j < q_ids.shape[0] and q_ids[j] <= p_ids[i])
        union[m] = p_ids[i] if take_p else q_ids[j]
        p_on[m] = p[i] if take_p else np.float32(0)
        difference = p_on[m] - (q[j] if take_q else np.float32(0))
        rest[m] = difference if difference > 0 else np.float32(0)
        i += take_p
        j += take_q
        m += 1
    total = _pairwise_sum(rest, m, np.float32(0))
    if total > 0:
        for c in range(m):
            rest[c] = rest[c] / total
        return union[_draw_index(rest[:m], u)]
    return union[_draw_index(p_on[:m], u)]


@jit
def accept_rows(target, columns, drafts, q, q_ids, q_counts, lossy_rule, bitgen):
    """speculative.accept's sampled rules in one call: (drafts kept, the token after them, lossy
    keeps). target [k + 1, C]: the verify rows' processed logits over the ascending ids `columns`;
    draft i's q over q_ids[i, :q_counts[i]] (ascending), one-hot on the draft where q_counts[i] < 0.
    Each row's float32 softmax (softmax_rows), the probabilities read by id, the comparisons in
    float64, the residual and bonus draws as the Python rule makes them, with the same uniforms in the
    same order from the sampler's own generator (compiled.next_uniform at `bitgen`), so its state
    after is too."""
    k, C = drafts.shape[0], columns.shape[0]
    probs = np.empty((1, C), np.float32)
    lossy = 0
    for i in range(k):
        softmax_rows(target[i : i + 1], probs)
        x = drafts[i]
        p_x = _probability_at(x, probs[0], columns)
        n = q_counts[i]
        q_x = 1.0 if n < 0 else _probability_at(x, q[i, :n], q_ids[i, :n])
        if compiled.next_uniform(bitgen) * q_x < p_x:  # u < p(x) / q(x) without dividing
            continue
        if n < 0:
            r = _residual_draw(probs[0], columns, np.ones(1, np.float32), drafts[i : i + 1], compiled.next_uniform(bitgen))
        else:
            r = _residual_draw(probs[0], columns, q[i, :n], q_ids[i, :n], compiled.next_uniform(bitgen))
        if lossy_rule and p_x >= _probability_at(r, probs[0], columns):
            lossy += 1
            continue
        return i, r, lossy
    softmax_rows(target[k : k + 1], probs)
    return k, columns[_draw_index(probs[0], compiled.next_uniform(bitgen))], lossy


@jit
def mtp_sampled_drafts(hidden, embed, draft_rows, draft_ids, norms, eps, fc, qkv_proj, heads, q_norm, k_norm, start, inv_freq,
                       keys, values, past, o_proj, gate_up, down, top_k, temperature, top_p, uniforms, drafts, q, q_ids, counts,
                       shared, tally, member, members):
    """A drafter's sampled MTP drafts in one call, as compiled.mtp_greedy_drafts with a draw for the
    argmax: per draft, the draft head's logits over its rows (draft_rows: bf16 lanes of the ids
    draft_ids), the candidates top-k keeps (_top_k_columns), warped (_warp_rows), their float32
    softmax q (softmax_rows) and the draw at uniforms[i] (_draw_index): the steps and bits of
    Model.draft_candidates and speculative._draw_draft without penalties or min-p. Draft i's q and
    its ids fill q[i, :counts[i]] and q_ids[i, :counts[i]]. A team kernel as mtp_greedy_drafts (shared,
    tally as it takes them): every member draws the same drafts, member 0 writes them."""
    h, stage = hidden.copy(), 0
    for i in range(drafts.shape[0]):
        scores, place, stage = compiled.draft_scores(draft_rows, h, shared, i, fc, qkv_proj, o_proj, gate_up, down, tally, stage, members)
        kept, columns = _top_k_columns(scores, top_k, temperature)
        warped = _warp_rows(kept, temperature, top_k, top_p)
        probs = np.empty(warped.shape, np.float32)
        softmax_rows(warped, probs)
        drafted = draft_ids[columns[_draw_index(probs[0], uniforms[i])]]
        if member == 0:
            n = columns.shape[0]
            counts[i] = n
            for c in range(n):
                q[i, c] = probs[0, c]
                q_ids[i, c] = draft_ids[columns[c]]
            drafts[i] = drafted
        if i + 1 < drafts.shape[0]:
            stage = compiled.mtp_draft_pass(drafted, embed, h, norms, eps, fc, qkv_proj, heads, q_norm, k_norm, start + i, inv_freq,
                                            keys, values, past + i, o_proj, gate_up, down, place, tally, stage, members)


@compiled._parallel_jit
def mtp_sampled_drafts_team(args, members):
    """mtp_sampled_drafts' members on numba's threads at once (threads.in_team)."""
    for member in _prange(members):
        mtp_sampled_drafts(*args, np.int64(member), members)  # prange's index is unsigned: one signature, not two


def mtp_drafting_steps() -> list:
    """compile_kernels' steps for a model with an MTP plan (cpu_ops.CpuOps.mtp_plan): the one-call
    passes (compiled.mtp_kernel_steps) and the sampled drafts' kernel, on the same tiny head."""
    steps = compiled.mtp_kernel_steps()
    if not steps:
        return []
    head = compiled.tiny_mtp_head()
    rows, ids = head[-1], np.zeros((2, 64), np.int64)
    args = lambda: (np.ones((1, 64), np.float32), rows, rows, np.arange(64), *head, 2, np.float32(0.7), 0.9, np.full(2, 0.5),
                    np.zeros(2, np.int64), np.zeros((2, 64), np.float32), ids, np.zeros(2, np.int64),
                    *compiled.drafting_scratch(2, rows, head))
    return steps + [lambda: mtp_sampled_drafts(*args(), 0, 1), lambda: mtp_sampled_drafts_team(args(), 2)]


def host_steps(mtp_plan: bool) -> list:
    """compiled.compile_kernels' steps beside the model kernels (its `also`): the sampler's, which every
    backend runs on the host, and for a model with an MTP plan its one-call passes' (mtp_drafting_steps)."""
    return [warm_up, *(mtp_drafting_steps() if mtp_plan else [])]


def compile_first_run_share() -> None:
    """A first run's helper process (compiled.compile_kernels): the sampler's kernels and the MTP passes',
    into the disk cache, while the run compiles the model's."""
    compiled.run_compile_steps(host_steps(mtp_plan=True))


FIRST_RUN_HELPER = "from duet.engine.backend import compiled_sampling; compiled_sampling.compile_first_run_share()"


def warm_up() -> None:
    """Compile (or load from the disk cache) each kernel for the argument types the sampler passes."""
    rows = np.array([[1.0, 3.0, -np.inf, 2.0]], np.float32)
    top_k_columns(rows, 2, 0.7)
    warp_rows(rows, 0.7, 2, 0.9)
    for dtype in (np.float32, np.float64):
        softmax_rows(rows, np.empty(rows.shape, dtype))
        draw_index(np.array([0.25, 0.0, 0.75], dtype), 0.5)
    generator = np.random.Generator(np.random.PCG64(0))
    accept_rows(np.concatenate([rows, rows]), np.arange(4), np.array([1]), np.ones((1, 1), np.float32), np.array([[1]]),
                np.array([1]), False, generator.bit_generator.ctypes.bit_generator.value)
