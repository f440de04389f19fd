"""Triton kernels of a Gated DeltaNet layer over the engine's state slots: the causal conv and the recurrent
gated delta rule, each reading a sequence's state from its slot and writing the new state back in place.

A step's sequences are described by two int64 device tensors: `starts` [N + 1] (sequence n holds rows
[starts[n], starts[n + 1]) of the flat batch) and `slots` [N] (its state slot; -1 for a graph's padding rows,
which start from a zero state and store nothing). So one launch serves every sequence of a step, and a
decode step's launches are the same on every replay of its CUDA graph. The torch twins are in
`swarmkv.models.gated_delta`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The FLA kernels and the torch reference normalise q and k with this epsilon added to the squared norm.
L2_NORM_EPS = 1e-6
CONV_BLOCK_CHANNELS = 64
CONV_BLOCK_TOKENS = 16  # at most: a decode step's programs take one token each
DELTA_BLOCK_V = 16  # value columns per program: the state tile is [Dk, DELTA_BLOCK_V] in registers


@triton.jit
def _sequence(starts_ptr, slots_ptr, seq):
    """Sequence seq's first row, its number of rows and its state slot (-1: a padding row)."""
    start = tl.load(starts_ptr + seq)
    return start, tl.load(starts_ptr + seq + 1) - start, tl.load(slots_ptr + seq)


@triton.jit
def _window_of(windows_ptr, slot, channels, num_channels, WINDOW_LEN: tl.constexpr):
    """Pointers to `channels`' windows in `slot` (slot 0's for a padding row, whose accesses are masked):
    windows [slots, C, K-1], oldest input first, stand for the K-1 inputs before a sequence's new rows."""
    return windows_ptr + tl.maximum(slot, 0).to(tl.int64) * num_channels * WINDOW_LEN + channels * WINDOW_LEN


@triton.jit
def _window_after(
    x_ptr,
    x_row_stride,
    window,
    start,
    length,
    channels,
    keep,
    WINDOW_LEN: tl.constexpr,
    WINDOW_POW2: tl.constexpr,
):
    """The last K-1 inputs of window ++ x[start : start + length], [BLOCK_C, WINDOW_POW2] (0 outside `keep`,
    the live entries)."""
    source = length - WINDOW_LEN + tl.arange(0, WINDOW_POW2)
    from_x = tl.load(
        x_ptr + (start + source)[None, :] * x_row_stride + channels[:, None],
        mask=keep & (source >= 0)[None, :],
        other=0.0,
    )
    from_window = tl.load(
        window[:, None] + (source + WINDOW_LEN)[None, :], mask=keep & (source < 0)[None, :], other=0.0
    )
    return from_x.to(window.dtype.element_ty) + from_window.to(window.dtype.element_ty)


@triton.jit
def _store_new_window(
    x_ptr,
    x_row_stride,
    window,
    start,
    length,
    channels,
    keep_channels,
    WINDOW_LEN: tl.constexpr,
    WINDOW_POW2: tl.constexpr,
):
    """Overwrite the window with the last K-1 inputs of window ++ x[start : start + length]."""
    index = tl.arange(0, WINDOW_POW2)
    keep = (index < WINDOW_LEN)[None, :] & keep_channels[:, None]
    new_window = _window_after(
        x_ptr, x_row_stride, window, start, length, channels, keep, WINDOW_LEN, WINDOW_POW2
    )
    # Entries move within a window: every thread's reads finish before any thread writes.
    tl.debug_barrier()
    tl.store(window[:, None] + index[None, :], new_window, mask=keep)


@triton.jit
def _causal_conv_kernel(
    x_ptr,
    x_row_stride,
    w_ptr,
    w_row_stride,
    windows_ptr,
    out_ptr,
    starts_ptr,
    slots_ptr,
    num_channels,
    KERNEL: tl.constexpr,
    WINDOW_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STORE_WINDOWS: tl.constexpr,
):
    """One program per (sequence, channel block, token program): conv + SiLU of every num_programs(2)-th
    block of the sequence's tokens; with STORE_WINDOWS (one token program), then its new window."""
    start, length, slot = _sequence(starts_ptr, slots_ptr, tl.program_id(0))
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < num_channels
    has_state = slot >= 0
    window_len: tl.constexpr = KERNEL - 1
    window = _window_of(windows_ptr, slot, channels, num_channels, window_len)
    for t0 in range(tl.program_id(2) * BLOCK_T, length, tl.num_programs(2) * BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T)
        live = (tokens < length)[:, None] & channel_mask[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for tap in tl.static_range(KERNEL):
            source = tokens + tap - window_len  # relative to start; negative ones are in the window
            from_x = tl.load(
                x_ptr + (start + source)[:, None] * x_row_stride + channels[None, :],
                mask=live & (source >= 0)[:, None],
                other=0.0,
            )
            from_window = tl.load(
                window[None, :] + (source + window_len)[:, None],
                mask=live & (source < 0)[:, None] & has_state,
                other=0.0,
            )
            weight = tl.load(w_ptr + channels * w_row_stride + tap, mask=channel_mask, other=0.0)
            acc += (from_x.to(tl.float32) + from_window.to(tl.float32)) * weight.to(tl.float32)[None, :]
        out = acc * tl.sigmoid(acc)
        tl.store(
            out_ptr + (start + tokens)[:, None] * num_channels + channels[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=live,
        )
    if STORE_WINDOWS:
        # This program alone read these windows above: once its threads are done, it may overwrite them.
        tl.debug_barrier()
        _store_new_window(
            x_ptr,
            x_row_stride,
            window,
            start,
            length,
            channels,
            channel_mask & has_state,
            window_len,
            WINDOW_POW2,
        )


@triton.jit
def _conv_windows_kernel(
    x_ptr,
    x_row_stride,
    windows_ptr,
    starts_ptr,
    slots_ptr,
    num_channels,
    KERNEL: tl.constexpr,
    WINDOW_POW2: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program per (sequence, channel block): the new windows, after a conv launch that left them."""
    start, length, slot = _sequence(starts_ptr, slots_ptr, tl.program_id(0))
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    window = _window_of(windows_ptr, slot, channels, num_channels, KERNEL - 1)
    keep_channels = (channels < num_channels) & (slot >= 0)
    _store_new_window(
        x_ptr, x_row_stride, window, start, length, channels, keep_channels, KERNEL - 1, WINDOW_POW2
    )


def causal_conv(
    x: torch.Tensor,
    windows: torch.Tensor,
    weight: torch.Tensor,
    starts: torch.Tensor,
    slots: torch.Tensor,
    max_tokens: int = 1,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU of x [T, C] (rows contiguous, any row stride) per sequence, continuing
    from and updating `windows` [slots, C, K-1] in place; weight [C, K]. `max_tokens`, the longest sequence's
    rows if the host knows them, spreads long sequences over programs (any value computes the same): then a
    second launch stores the windows, which other programs of the first may still be reading; a decode step
    is one launch. Returns [T, C] in x.dtype."""
    num_tokens, num_channels = x.shape
    kernel_size = weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and windows.is_contiguous()
    assert windows.shape[1:] == (num_channels, kernel_size - 1) and kernel_size >= 2
    out = torch.empty(num_tokens, num_channels, dtype=x.dtype, device=x.device)
    block_tokens = min(CONV_BLOCK_TOKENS, triton.next_power_of_2(max(1, max_tokens)))
    token_programs = triton.cdiv(max(1, max_tokens), block_tokens)
    channel_blocks = triton.cdiv(num_channels, CONV_BLOCK_CHANNELS)
    window_pow2 = triton.next_power_of_2(kernel_size - 1)
    _causal_conv_kernel[(slots.shape[0], channel_blocks, token_programs)](
        x,
        x.stride(0),
        weight,
        weight.stride(0),
        windows,
        out,
        starts,
        slots,
        num_channels,
        KERNEL=kernel_size,
        WINDOW_POW2=window_pow2,
        BLOCK_T=block_tokens,
        BLOCK_C=CONV_BLOCK_CHANNELS,
        STORE_WINDOWS=token_programs == 1,
    )
    if token_programs > 1:
        _conv_windows_kernel[(slots.shape[0], channel_blocks)](
            x,
            x.stride(0),
            windows,
            starts,
            slots,
            num_channels,
            KERNEL=kernel_size,
            WINDOW_POW2=window_pow2,
            BLOCK_C=CONV_BLOCK_CHANNELS,
        )
    return out


@triton.jit
def _conv_positions_kernel(
    x_ptr,
    x_row_stride,
    windows_ptr,
    kept_ptr,
    starts_ptr,
    slots_ptr,
    num_channels,
    KERNEL: tl.constexpr,
    WINDOW_POW2: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program per (sequence, channel block): the window after each of the sequence's rows, at that
    row's index from the first sequence's first row in kept [R, C, K-1]; the slots' windows are only read."""
    start, length, slot = _sequence(starts_ptr, slots_ptr, tl.program_id(0))
    first = tl.load(starts_ptr)
    window_len: tl.constexpr = KERNEL - 1
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    window = _window_of(windows_ptr, slot, channels, num_channels, window_len)
    index = tl.arange(0, WINDOW_POW2)
    keep = (index < window_len)[None, :] & ((channels < num_channels) & (slot >= 0))[:, None]
    for row in range(length):
        kept = _window_after(
            x_ptr, x_row_stride, window, start, row + 1, channels, keep, window_len, WINDOW_POW2
        )
        at = (start - first + row).to(tl.int64) * num_channels + channels
        tl.store(kept_ptr + at[:, None] * window_len + index[None, :], kept, mask=keep)


def conv_positions(
    x: torch.Tensor, windows: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """The conv window after each row of the sequences `starts` and `slots` describe (rows [starts[0],
    starts[-1]) of x [T, C], `num_rows` of them), as decoding those rows one at a time leaves it in the
    slot: [num_rows, C, K-1] in windows.dtype. Reads `windows` [slots, C, K-1] before `causal_conv` updates
    them (the launches run in order on the stream)."""
    num_channels, window_len = windows.shape[1:]
    assert x.stride(1) == 1 and windows.is_contiguous() and x.shape[1] == num_channels
    kept = torch.empty(num_rows, num_channels, window_len, dtype=windows.dtype, device=windows.device)
    _conv_positions_kernel[(slots.shape[0], triton.cdiv(num_channels, CONV_BLOCK_CHANNELS))](
        x,
        x.stride(0),
        windows,
        kept,
        starts,
        slots,
        num_channels,
        KERNEL=window_len + 1,
        WINDOW_POW2=triton.next_power_of_2(window_len),
        BLOCK_C=CONV_BLOCK_CHANNELS,
    )
    return kept


@triton.jit
def _gated_delta_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    out_ptr,
    states_ptr,
    starts_ptr,
    slots_ptr,
    kept_ptr,
    kept_from,
    kept_end,
    q_row_stride,
    q_head_stride,
    k_row_stride,
    k_head_stride,
    v_row_stride,
    v_head_stride,
    scale,
    eps,
    NUM_K_HEADS: tl.constexpr,
    NUM_V_HEADS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    KEEP: tl.constexpr,
):
    """One program per (sequence, value head, value block): its state tile through its tokens, in order;
    with KEEP, the tile after each row in [kept_from, kept_end) too, at kept[row - kept_from]."""
    seq = tl.program_id(0) // NUM_V_HEADS
    v_head = tl.program_id(0) % NUM_V_HEADS
    k_head = v_head // (NUM_V_HEADS // NUM_K_HEADS)
    keys = tl.arange(0, BLOCK_K)
    values = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key_mask, value_mask = keys < DK, values < DV
    tile_mask = key_mask[:, None] & value_mask[None, :]
    start, length, slot = _sequence(starts_ptr, slots_ptr, seq)
    has_state = slot >= 0
    # states [slots, Hv, Dk, Dv]: this program alone reads and writes its tile, so in place is safe.
    tile = (
        states_ptr
        + (tl.maximum(slot, 0).to(tl.int64) * NUM_V_HEADS + v_head) * DK * DV
        + keys[:, None] * DV
        + values[None, :]
    )
    state = tl.load(tile, mask=tile_mask & has_state, other=0.0).to(tl.float32)
    for row in range(start, start + length):
        q = tl.load(q_ptr + row * q_row_stride + k_head * q_head_stride + keys, mask=key_mask, other=0.0)
        k = tl.load(k_ptr + row * k_row_stride + k_head * k_head_stride + keys, mask=key_mask, other=0.0)
        v = tl.load(v_ptr + row * v_row_stride + v_head * v_head_stride + values, mask=value_mask, other=0.0)
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + eps) * scale
        k = k / tl.sqrt(tl.sum(k * k) + eps)
        decay = tl.exp(tl.load(g_ptr + row * NUM_V_HEADS + v_head).to(tl.float32))
        beta = tl.load(beta_ptr + row * NUM_V_HEADS + v_head).to(tl.float32)
        state *= decay
        delta = beta * (v - tl.sum(state * k[:, None], 0))
        state += k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], 0)
        tl.store(
            out_ptr + (row * NUM_V_HEADS + v_head) * DV + values,
            out.to(out_ptr.dtype.element_ty),
            mask=value_mask,
        )
        if KEEP:
            kept_row = tl.maximum(row - kept_from, 0).to(tl.int64)
            tl.store(
                kept_ptr + (kept_row * NUM_V_HEADS + v_head) * DK * DV + keys[:, None] * DV + values[None, :],
                state.to(kept_ptr.dtype.element_ty),
                mask=tile_mask & (row >= kept_from) & (row < kept_end),
            )
    tl.store(tile, state.to(states_ptr.dtype.element_ty), mask=tile_mask & has_state)


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    starts: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
    kept_from: int = 0,
) -> torch.Tensor:
    """The gated delta rule token by token per sequence, from and into `states` [slots, Hv, Dk, Dv] in place:
    q, k [T, Hk, Dk], v [T, Hv, Dv] (last dim contiguous), g (log decay) and beta [T, Hv] contiguous. q and
    k are L2-normalised, q scaled by Dk**-0.5, as `models.gated_delta` does. Returns `out` [T, Hv, Dv] (new,
    in v.dtype, unless given), of which only the sequences' rows are written. `kept` [R, Hv, Dk, Dv], if
    given, receives the state after each row kept_from .. kept_from + R - 1 (a speculative chunk's rows)."""
    num_tokens, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1:]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and q.stride() == k.stride()
    assert g.is_contiguous() and beta.is_contiguous() and states.is_contiguous()
    assert states.shape[1:] == (num_v_heads, dk, dv) and num_v_heads % num_k_heads == 0
    if out is None:
        out = torch.empty(num_tokens, num_v_heads, dv, dtype=v.dtype, device=v.device)
    assert out.shape == v.shape and out.is_contiguous()
    if kept is not None:
        assert kept.shape[1:] == states.shape[1:] and kept.is_contiguous()
    block_v = min(DELTA_BLOCK_V, triton.next_power_of_2(dv))
    grid = (slots.shape[0] * num_v_heads, triton.cdiv(dv, block_v))
    _gated_delta_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        out,
        states,
        starts,
        slots,
        states if kept is None else kept,
        kept_from,
        kept_from + (0 if kept is None else kept.shape[0]),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        dk**-0.5,
        L2_NORM_EPS,
        NUM_K_HEADS=num_k_heads,
        NUM_V_HEADS=num_v_heads,
        DK=dk,
        DV=dv,
        BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        KEEP=kept is not None,
    )
    return out


def chunked_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    starts: torch.Tensor,
    starts_host: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Prefill chunks through fla's chunked gated delta rule (GPUs only: its kernels are autotuned, and
    Triton's interpreter has no driver to time them). Same contract as `gated_delta_recurrent`, except that
    `starts` begins at 0, `starts_host` is its host copy and no slot is -1. The slots' states are gathered
    for fla and its final states copied back: one read and one write of each prefill's state per layer."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        g.unsqueeze(0),
        beta.unsqueeze(0),
        scale=k.shape[-1] ** -0.5,
        initial_state=states.index_select(0, slots),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=starts,
        cu_seqlens_cpu=starts_host,
    )
    states.index_copy_(0, slots, final.to(states.dtype))
    return out[0]
