"""Gated DeltaNet math (causal conv, chunked and recurrent gated delta rule, gated RMSNorm) against the
transformers Qwen3.5 reference, and the chaining that lets prefill chunks and decode steps continue a sequence."""

from __future__ import annotations

import pytest
import torch

from swarmkv.models.gated_delta import (
    causal_conv,
    causal_conv_step,
    gated_delta_chunked,
    gated_delta_step,
    gated_rms_norm,
)

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

NUM_K_HEADS, NUM_V_HEADS = 2, 4  # GQA: each key head serves two consecutive value heads
K_HEAD_DIM, V_HEAD_DIM = 8, 6  # unequal, so a transposed state fails
NUM_CHANNELS, KERNEL_SIZE = 12, 4
LENGTHS = [1, 5, 63, 64, 65, 130]
# float64 runs compare our own forms to each other; the reference computes in float32 whatever its inputs.
TIGHT = {"atol": 1e-10, "rtol": 1e-10}
LOOSE = {"atol": 1e-4, "rtol": 1e-4}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64).to(dtype)


def _delta_inputs(num_tokens: int, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """q, k, v, g, beta for one sequence, with decays from near 1 to strong enough to underflow a chunk."""
    g = -torch.exp(2 * _randn(num_tokens, NUM_V_HEADS, seed=seed + 3, dtype=torch.float64) - 1)
    return {
        "q": _randn(num_tokens, NUM_K_HEADS, K_HEAD_DIM, seed=seed, dtype=dtype),
        "k": _randn(num_tokens, NUM_K_HEADS, K_HEAD_DIM, seed=seed + 1, dtype=dtype),
        "v": _randn(num_tokens, NUM_V_HEADS, V_HEAD_DIM, seed=seed + 2, dtype=dtype),
        "g": g.to(dtype),
        "beta": torch.sigmoid(_randn(num_tokens, NUM_V_HEADS, seed=seed + 4, dtype=dtype)),
    }


def _initial_state(seed: int, dtype: torch.dtype) -> torch.Tensor:
    return 0.5 * _randn(NUM_V_HEADS, K_HEAD_DIM, V_HEAD_DIM, seed=seed, dtype=dtype)


def _slice(inputs: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {name: t[start:stop] for name, t in inputs.items()}


def _reference(
    inputs: dict[str, torch.Tensor], state: torch.Tensor, form: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformers rule for one sequence (a batch of one), returning (outputs, final state) unbatched."""
    fn = qwen3_5.torch_chunk_gated_delta_rule if form == "chunk" else qwen3_5.torch_recurrent_gated_delta_rule
    batched = {name: t.unsqueeze(0) for name, t in inputs.items()}
    out, final = fn(
        query=batched["q"],
        key=batched["k"],
        value=batched["v"],
        g=batched["g"],
        beta=batched["beta"],
        initial_state=state.unsqueeze(0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert final is not None
    return out[0], final[0]


def _step_loop(inputs: dict[str, torch.Tensor], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our recurrent form, one token at a time, for one sequence."""
    states = state.unsqueeze(0)
    outputs = []
    for t in range(inputs["q"].shape[0]):
        out, states = gated_delta_step(**{name: x[t : t + 1] for name, x in inputs.items()}, states=states)
        outputs.append(out[0])
    return torch.stack(outputs), states[0]


# -- causal conv ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_tokens", LENGTHS)
def test_causal_conv_fresh_matches_reference(num_tokens: int, dtype: torch.dtype) -> None:
    x = _randn(num_tokens, NUM_CHANNELS, seed=num_tokens, dtype=dtype)
    weight = _randn(NUM_CHANNELS, KERNEL_SIZE, seed=99, dtype=dtype)
    window = torch.zeros(NUM_CHANNELS, KERNEL_SIZE - 1, dtype=dtype)
    out, new_window = causal_conv(x, window, weight)
    expected = qwen3_5.causal_conv1d_fn(x.t().unsqueeze(0), weight, None, activation="silu")[0].t()
    tol = TIGHT if dtype == torch.float64 else LOOSE
    assert out.dtype == dtype and out.shape == (num_tokens, NUM_CHANNELS)
    torch.testing.assert_close(out, expected, **tol)
    padded = torch.cat([window, x.t()], dim=1)
    torch.testing.assert_close(new_window, padded[:, -(KERNEL_SIZE - 1) :], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 65])
def test_causal_conv_continues_window_like_reference(num_tokens: int, dtype: torch.dtype) -> None:
    x = _randn(num_tokens, NUM_CHANNELS, seed=num_tokens, dtype=dtype)
    weight = _randn(NUM_CHANNELS, KERNEL_SIZE, seed=99, dtype=dtype)
    window = _randn(NUM_CHANNELS, KERNEL_SIZE - 1, seed=7, dtype=dtype)
    out, new_window = causal_conv(x, window, weight)
    conv_state = window.unsqueeze(0).clone()  # the reference updates it in place
    expected = qwen3_5.causal_conv1d_update(x.t().unsqueeze(0), conv_state, weight, None, "silu")[0].t()
    tol = TIGHT if dtype == torch.float64 else LOOSE
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(new_window, conv_state[0], rtol=0, atol=0)


def test_causal_conv_short_input_keeps_older_window_entries() -> None:
    window = torch.arange(NUM_CHANNELS * 3, dtype=torch.float64).reshape(NUM_CHANNELS, 3)
    x = torch.full((1, NUM_CHANNELS), -1.0, dtype=torch.float64)
    _, new_window = causal_conv(x, window, torch.ones(NUM_CHANNELS, KERNEL_SIZE, dtype=torch.float64))
    torch.testing.assert_close(new_window, torch.cat([window[:, 1:], x.t()], dim=1), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cuts", [[40], [1, 2], [2, 3, 63], [64]])
def test_causal_conv_in_pieces_equals_whole(cuts: list[int], dtype: torch.dtype) -> None:
    x = _randn(70, NUM_CHANNELS, seed=5, dtype=dtype)
    weight = _randn(NUM_CHANNELS, KERNEL_SIZE, seed=6, dtype=dtype)
    start_window = _randn(NUM_CHANNELS, KERNEL_SIZE - 1, seed=8, dtype=dtype)
    whole, whole_window = causal_conv(x, start_window, weight)
    window, pieces = start_window, []
    for start, stop in zip([0, *cuts], [*cuts, x.shape[0]], strict=True):
        out, window = causal_conv(x[start:stop], window, weight)
        pieces.append(out)
    tol = TIGHT if dtype == torch.float64 else LOOSE
    torch.testing.assert_close(torch.cat(pieces), whole, **tol)
    torch.testing.assert_close(window, whole_window, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_causal_conv_steps_equal_prefill(dtype: torch.dtype) -> None:
    num_prefill, num_steps, batch = 3, 6, 2
    x = _randn(batch, num_prefill + num_steps, NUM_CHANNELS, seed=11, dtype=dtype)
    weight = _randn(NUM_CHANNELS, KERNEL_SIZE, seed=12, dtype=dtype)
    zero = torch.zeros(NUM_CHANNELS, KERNEL_SIZE - 1, dtype=dtype)
    wholes = [causal_conv(x[b], zero, weight)[0] for b in range(batch)]
    windows = torch.stack([causal_conv(x[b, :num_prefill], zero, weight)[1] for b in range(batch)])
    tol = TIGHT if dtype == torch.float64 else LOOSE
    for t in range(num_prefill, num_prefill + num_steps):
        out, windows = causal_conv_step(x[:, t], windows, weight)
        assert out.shape == (batch, NUM_CHANNELS) and windows.shape == (batch, NUM_CHANNELS, KERNEL_SIZE - 1)
        torch.testing.assert_close(out, torch.stack([w[t] for w in wholes]), **tol)


# -- gated delta rule -------------------------------------------------------------------------------------------


def test_reference_computes_in_float32() -> None:
    """Why float64 runs are checked against our own recurrent form rather than the reference."""
    inputs = _delta_inputs(5, seed=0, dtype=torch.float64)
    _, final = _reference(inputs, _initial_state(1, torch.float64), "chunk")
    assert final.dtype == torch.float32


@pytest.mark.parametrize("num_tokens", LENGTHS)
def test_chunked_matches_reference_float32(num_tokens: int) -> None:
    inputs = _delta_inputs(num_tokens, seed=num_tokens, dtype=torch.float32)
    state = _initial_state(1, torch.float32)
    out, final = gated_delta_chunked(**inputs, state=state)
    assert out.shape == (num_tokens, NUM_V_HEADS, V_HEAD_DIM) and out.dtype == torch.float32
    assert final.shape == state.shape and final.dtype == torch.float32
    for form in ("chunk", "recurrent"):
        expected_out, expected_final = _reference(inputs, state, form)
        torch.testing.assert_close(out, expected_out, **LOOSE)
        torch.testing.assert_close(final, expected_final, **LOOSE)


@pytest.mark.parametrize("num_tokens", LENGTHS)
def test_chunked_float64_matches_reference_and_own_recurrent_form(num_tokens: int) -> None:
    inputs = _delta_inputs(num_tokens, seed=num_tokens, dtype=torch.float64)
    state = _initial_state(2, torch.float64)
    out, final = gated_delta_chunked(**inputs, state=state)
    assert out.dtype == torch.float64 and final.dtype == torch.float64
    step_out, step_final = _step_loop(inputs, state)
    torch.testing.assert_close(out, step_out, **TIGHT)
    torch.testing.assert_close(final, step_final, **TIGHT)
    expected_out, expected_final = _reference(inputs, state, "recurrent")
    torch.testing.assert_close(out, expected_out, **LOOSE)
    torch.testing.assert_close(final, expected_final.double(), **LOOSE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_step_matches_reference_batched(dtype: torch.dtype) -> None:
    batch = 3
    inputs = _delta_inputs(batch, seed=21, dtype=dtype)  # one token for each of `batch` sequences
    states = 0.5 * _randn(batch, NUM_V_HEADS, K_HEAD_DIM, V_HEAD_DIM, seed=22, dtype=dtype)
    out, new_states = gated_delta_step(**inputs, states=states)
    assert out.shape == (batch, NUM_V_HEADS, V_HEAD_DIM) and new_states.dtype == dtype
    # The batch of sequences is the reference's batch dim, each one token long.
    expected_out, expected_states = qwen3_5.torch_recurrent_gated_delta_rule(
        query=inputs["q"].unsqueeze(1),
        key=inputs["k"].unsqueeze(1),
        value=inputs["v"].unsqueeze(1),
        g=inputs["g"].unsqueeze(1),
        beta=inputs["beta"].unsqueeze(1),
        initial_state=states,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out, expected_out[:, 0], **LOOSE)
    torch.testing.assert_close(new_states, expected_states.to(dtype), **LOOSE)


def test_chunk_size_does_not_change_results() -> None:
    inputs = _delta_inputs(130, seed=31, dtype=torch.float64)
    state = _initial_state(32, torch.float64)
    out64, final64 = gated_delta_chunked(**inputs, state=state)
    out16, final16 = gated_delta_chunked(**inputs, state=state, chunk_size=16)
    torch.testing.assert_close(out16, out64, **TIGHT)
    torch.testing.assert_close(final16, final64, **TIGHT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cuts", [[64], [1, 2], [5, 70], [63, 65]])
def test_chunked_in_pieces_equals_whole(cuts: list[int], dtype: torch.dtype) -> None:
    inputs = _delta_inputs(130, seed=41, dtype=dtype)
    start_state = _initial_state(42, dtype)
    whole, whole_state = gated_delta_chunked(**inputs, state=start_state)
    state, pieces = start_state, []
    for start, stop in zip([0, *cuts], [*cuts, 130], strict=True):
        out, state = gated_delta_chunked(**_slice(inputs, start, stop), state=state)
        pieces.append(out)
    tol = TIGHT if dtype == torch.float64 else LOOSE
    torch.testing.assert_close(torch.cat(pieces), whole, **tol)
    torch.testing.assert_close(state, whole_state, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_steps_after_prefill_equal_whole_sequence(dtype: torch.dtype) -> None:
    """Two sequences of different prefill lengths, decoded together in one batch."""
    num_prefills, num_steps = [65, 3], 5
    sequences = [_delta_inputs(n + num_steps, seed=50 + n, dtype=dtype) for n in num_prefills]
    starts = [_initial_state(60 + i, dtype) for i in range(len(sequences))]
    wholes = [gated_delta_chunked(**seq, state=s) for seq, s in zip(sequences, starts, strict=True)]
    states = torch.stack(
        [
            gated_delta_chunked(**_slice(seq, 0, n), state=s)[1]
            for seq, n, s in zip(sequences, num_prefills, starts, strict=True)
        ]
    )
    tol = TIGHT if dtype == torch.float64 else LOOSE
    for step in range(num_steps):
        positions = [n + step for n in num_prefills]
        batch = {
            name: torch.stack([seq[name][p] for seq, p in zip(sequences, positions, strict=True)])
            for name in sequences[0]
        }
        out, states = gated_delta_step(**batch, states=states)
        expected = torch.stack([whole[0][p] for whole, p in zip(wholes, positions, strict=True)])
        torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(states, torch.stack([whole[1] for whole in wholes]), **tol)


def test_low_precision_inputs_keep_a_float32_state() -> None:
    inputs = _delta_inputs(70, seed=71, dtype=torch.bfloat16)
    state = _initial_state(72, torch.float32)
    out, final = gated_delta_chunked(**inputs, state=state)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    expected_out, expected_final = _reference(inputs, state, "chunk")
    torch.testing.assert_close(final, expected_final, **LOOSE)
    torch.testing.assert_close(out, expected_out, atol=2e-2, rtol=2e-2)
    step_out, step_states = gated_delta_step(**_slice(inputs, 0, 1), states=state.unsqueeze(0))
    assert step_out.dtype == torch.bfloat16 and step_states.dtype == torch.float32


def test_chunked_does_not_modify_its_inputs() -> None:
    inputs = _delta_inputs(65, seed=81, dtype=torch.float64)
    state = _initial_state(82, torch.float64)
    copies = {name: t.clone() for name, t in inputs.items()}
    state_copy = state.clone()
    gated_delta_chunked(**inputs, state=state)
    gated_delta_step(**_slice(inputs, 0, 1), states=state.unsqueeze(0))
    for name, t in inputs.items():
        torch.testing.assert_close(t, copies[name], rtol=0, atol=0)
    torch.testing.assert_close(state, state_copy, rtol=0, atol=0)


# -- gated RMSNorm ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [
        (torch.float32, {"atol": 1e-6, "rtol": 1e-6}),
        (torch.float64, LOOSE),
        (torch.bfloat16, {"atol": 2e-2, "rtol": 2e-2}),
    ],
)
def test_gated_rms_norm_matches_reference(dtype: torch.dtype, tol: dict[str, float]) -> None:
    x = _randn(10, V_HEAD_DIM, seed=91, dtype=dtype)
    gate = _randn(10, V_HEAD_DIM, seed=92, dtype=dtype)
    weight = 1 + 0.1 * _randn(V_HEAD_DIM, seed=93, dtype=dtype)
    norm = qwen3_5.Qwen3_5RMSNormGated(V_HEAD_DIM, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        expected = norm(x, gate)
    out = gated_rms_norm(x, gate, weight, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **tol)


def test_gated_rms_norm_float64_is_exact_math() -> None:
    x = _randn(4, V_HEAD_DIM, seed=94, dtype=torch.float64)
    gate = _randn(4, V_HEAD_DIM, seed=95, dtype=torch.float64)
    weight = _randn(V_HEAD_DIM, seed=96, dtype=torch.float64)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5) * weight * gate * torch.sigmoid(gate)
    torch.testing.assert_close(gated_rms_norm(x, gate, weight, 1e-5), expected, **TIGHT)
