"""The chunked DeltaNet rule against its own definitions: the exact triangular inverse and the
token-by-token recurrence, including decays strong enough to push naive products into denormals."""

import numpy as np
import pytest

from duet.engine.backend import compiled
from duet.engine.cache import DeltaNetState
from duet.engine.backend.cpu_ops import CHUNK, decay, delta_rule_chunked, delta_rule_rows, l2_normalize, unit_lower_inverse

SMALLEST_NORMAL = np.finfo(np.float32).tiny


def denormals(a: np.ndarray) -> int:
    return int(np.count_nonzero((a != 0) & (np.abs(a) < SMALLEST_NORMAL)))


def random_rule_inputs(rng, T: int, heads: int, d: int, strongest_log_decay: float):
    q = l2_normalize(rng.standard_normal((T, heads, d), dtype=np.float32)) * np.float32(d**-0.5)
    k = l2_normalize(rng.standard_normal((T, heads, d), dtype=np.float32))
    v = rng.standard_normal((T, heads, d), dtype=np.float32)
    beta = rng.uniform(0.05, 0.95, (T, heads)).astype(np.float32)
    log_decay = rng.uniform(strongest_log_decay, 0.0, (T, heads)).astype(np.float32)
    return q, k, v, beta, log_decay


def chunk_systems(rng, strongest_log_decay: float, heads: int = 64):
    """L [heads, C, C] and its pair decays for one chunk per head, as delta_rule_chunked forms them."""
    _, k, _, beta, log_decay = random_rule_inputs(rng, CHUNK, heads, 64, strongest_log_decay)
    k, beta, G = k.transpose(1, 0, 2), beta.T, np.cumsum(log_decay.T, axis=-1)  # head-major
    below = np.tril(np.ones((CHUNK, CHUNK), bool))
    pair_decay = decay(np.where(below, G[:, :, None] - G[:, None, :], -np.inf))
    return (beta[..., None] * k) @ k.transpose(0, 2, 1) * pair_decay, pair_decay


def exact_inverse(L: np.ndarray) -> np.ndarray:
    return np.linalg.inv(np.eye(CHUNK) + np.tril(L.astype(np.float64), -1))


def test_inverse_matches_the_exact_inverse():
    L, pair_decay = chunk_systems(np.random.default_rng(0), strongest_log_decay=-0.3)
    assert np.abs(unit_lower_inverse(L, pair_decay > 0) - exact_inverse(L)).max() < 1e-5


def test_strong_decays_give_no_denormals_and_drop_only_what_fp32_cannot_show():
    # -42 per token, as random weights of the 0.8B geometry give: naive products of the chunk's
    # decays reach e^-1000; in a prefill of that model the inverse held 1546 denormals in 65536 entries.
    L, pair_decay = chunk_systems(np.random.default_rng(1), strongest_log_decay=-42.0)
    got = unit_lower_inverse(L, pair_decay > 0)
    assert denormals(got) == 0
    assert np.abs(got - exact_inverse(L)).max() < 1e-6  # what was dropped sat below e^-30 of the unit diagonal


@pytest.mark.parametrize("strongest_log_decay", [-0.5, -42.0])
def test_chunked_rule_equals_the_token_by_token_recurrence(strongest_log_decay):
    rng = np.random.default_rng(2)
    T, heads, d = 3 * CHUNK + 5, 4, 32
    q, k, v, beta, log_decay = random_rule_inputs(rng, T, heads, d, strongest_log_decay)
    start = rng.standard_normal((heads, d, d)).astype(np.float32) * np.float32(0.1)

    out, end = delta_rule_chunked(q, k, v, beta, log_decay, start.copy())
    state = DeltaNetState(1, 1, heads, d, d)
    state.recurrent = start.copy()
    expected = delta_rule_rows(q, k, v, beta, log_decay, state)

    assert denormals(out) == 0 and denormals(end) == 0
    assert np.abs(out - expected).max() < 1e-4 * np.abs(expected).max()
    assert np.abs(end - state.recurrent).max() < 1e-4 * np.abs(state.recurrent).max()


def float64_recurrence(q, k, v, beta, log_decay, S):
    """REFERENCE.md section 1 step 5 in float64, token by token: outputs and the state after each row."""
    S, outs, states = S.astype(np.float64), [], []
    for t in range(q.shape[0]):
        S = np.exp(log_decay[t].astype(np.float64))[:, None, None] * S
        u = beta[t, :, None] * (v[t] - np.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t][:, :, None] * u[:, None, :]
        outs.append(np.einsum("hkv,hk->hv", S, q[t]))
        states.append(S)
    return np.stack(outs), states


def compiled_rows(q, k, v, beta, log_decay, S0):
    """compiled.delta_rule_rows over every head: (outputs [T, H, dv], the states after each row [T, H, dk,
    dv]: the call's last, and the others as a rollback to that row makes them, compiled.delta_replay)."""
    T, H, _ = q.shape
    last = np.empty(S0.shape, np.float32)
    out = np.empty((T, H, v.shape[2]), np.float32)
    decay = np.exp(log_decay)
    compiled.delta_rule_rows(S0, q, k, v, beta, decay, last, out, 0, H)
    states = [compiled.delta_replay(S0, (k, v, beta, decay), rows) for rows in range(1, T)]
    return out, np.stack(states + [last])


@pytest.mark.parametrize("d", [128, 80, 20])  # value columns in blocks of 64; of 64 and 16; in loops
def test_compiled_rows_follow_the_recurrence_and_give_a_row_its_bits_alone(d):
    """The fused kernel (compiled.delta_rule_rows, what compiled.deltanet_heads runs) against float64:
    within what fp32 rounding of dk-term sums allows (up to 128 terms of |S k| <= |S|; 1e-5 relative
    to |S| after 4 rows); a row's output and state are the same bits alone as among verify rows (a
    rollback replays its rows to the state the row left), and a head's whether it runs with the others
    or alone: for each way the kernel walks the value columns."""
    rng = np.random.default_rng(5)
    q, k, v, beta, log_decay = random_rule_inputs(rng, 4, 8, d, -2.0)
    S0 = rng.standard_normal((8, d, d)).astype(np.float32)
    out, states = compiled_rows(q, k, v, beta, log_decay, S0)
    want, want_states = float64_recurrence(q, k, v, beta, log_decay, S0)
    scale = np.abs(want_states[-1]).max()
    assert np.abs(out - want).max() <= 1e-5 * scale
    for got, expected in zip(states, want_states):
        assert np.abs(got - expected).max() <= 1e-5 * scale
    for rows in range(1, 4):  # the first rows alone: each row's output, and the state a rollback gives
        alone, alone_states = compiled_rows(q[:rows], k[:rows], v[:rows], beta[:rows], log_decay[:rows], S0)
        assert np.array_equal(alone, out[:rows]) and np.array_equal(alone_states[-1], states[rows - 1])
    split = np.empty_like(S0), np.empty_like(out)
    for lo, hi in ((0, 3), (3, 8)):
        compiled.delta_rule_rows(S0, q, k, v, beta, np.exp(log_decay), split[0], split[1], lo, hi)
    assert np.array_equal(split[0], states[-1]) and np.array_equal(split[1], out)


def test_the_fused_deltanet_step_matches_numpys_and_gives_a_row_its_bits_alone(tmp_path):
    """compiled.deltanet_heads (a decode or verify pass's per-head steps in one kernel) against the numpy
    steps it replaces (CpuOps without compiled steps), on a transformers-initialised layer and normed
    inputs the width of the hidden state (CpuOps.deltanet applies in_proj itself): within fp32 rounding
    of a few dk- and dv-term sums (1e-5 relative to the largest output); the state and output of a row
    are the same bits alone as among four rows."""
    from conftest import build_reference, save_reference
    from duet.engine import load_model
    from duet.engine.backend.cpu_ops import CpuOps
    from duet.engine.model import DeltaNet

    save_reference(build_reference("qwen3_5", seed=3), tmp_path, with_tokenizer=False)
    layer = next(l.mixer for l in load_model(tmp_path, tokenizer=False).model.layers if isinstance(l.mixer, DeltaNet))
    c = layer.config
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, layer.in_proj.shape[1])).astype(np.float32)
    S0 = rng.standard_normal((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)).astype(np.float32) * 0.1

    def run(rows: slice, kernels: str):
        state = layer.new_cache()
        state.recurrent = S0.copy()
        out = CpuOps(compiled_steps=kernels == "compiled").deltanet(layer, x[rows], state, 0)
        return out, state

    fused, fused_state = run(slice(0, 4), "compiled")
    numpy_out, numpy_state = run(slice(0, 4), "numpy")
    assert np.abs(fused - numpy_out).max() <= 1e-5 * np.abs(numpy_out).max()
    assert np.abs(fused_state.recurrent - numpy_state.recurrent).max() <= 1e-5 * np.abs(numpy_state.recurrent).max()
    first, first_state = run(slice(0, 1), "compiled")
    fused_state.keep(1)
    assert np.array_equal(first[0], fused[0]) and np.array_equal(first_state.recurrent, fused_state.recurrent)
