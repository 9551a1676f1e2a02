"""The chunked DeltaNet rule against its own definitions: the exact triangular inverse and the
token-by-token recurrence, including decays strong enough to push naive products into denormals."""

import numpy as np
import pytest

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
