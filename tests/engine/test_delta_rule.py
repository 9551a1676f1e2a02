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


def test_compiled_rows_follow_the_recurrence_and_give_a_row_its_bits_alone(monkeypatch):
    """The fused kernel (compiled.delta_rule_rows, what delta_rule_rows runs) against float64: within
    what fp32 rounding of dk-term sums allows (128 terms of |S k| <= |S|; 1e-5 relative to |S| after
    4 rows); a row's output and state are the same bits alone as among verify rows."""
    monkeypatch.delenv(compiled.KERNELS_ENV, raising=False)  # the compiled path, whatever the environment says
    rng = np.random.default_rng(5)
    q, k, v, beta, log_decay = random_rule_inputs(rng, 4, 8, 128, -2.0)
    S0 = rng.standard_normal((8, 128, 128)).astype(np.float32)
    state = DeltaNetState(1, 2, 8, 128, 128)
    state.recurrent = S0
    out = delta_rule_rows(q, k, v, beta, log_decay, state)
    want, want_states = float64_recurrence(q, k, v, beta, log_decay, S0)
    scale = np.abs(want_states[-1]).max()
    assert np.abs(out - want).max() <= 1e-5 * scale
    for got, expected in zip(state.row_states, want_states):
        assert np.abs(got - expected).max() <= 1e-5 * scale
    assert np.array_equal(state.recurrent, state.row_states[-1])
    alone = DeltaNetState(1, 2, 8, 128, 128)
    alone.recurrent = S0
    first = delta_rule_rows(q[:1], k[:1], v[:1], beta[:1], log_decay[:1], alone)
    assert np.array_equal(first[0], out[0]) and np.array_equal(alone.recurrent, state.row_states[0])
