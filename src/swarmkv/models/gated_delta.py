"""The math of Qwen3.5's Gated DeltaNet linear-attention layer in plain torch: the causal conv over q/k/v, the
gated delta rule (chunked for prefill, recurrent for decode) and the gated RMSNorm on its output.

The recurrence, per value head, with the state S [Dk, Dv], decay a_t = exp(g_t) and learning rate beta_t:
    S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T,    o_t = S_t^T q_t.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The FLA kernels and the reference model normalise q and k with this epsilon added to the squared norm.
_L2_NORM_EPS = 1e-6


def causal_conv(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU over one sequence's new inputs x [T, C], continuing from `window`
    [C, K-1] (the K-1 inputs before x, oldest first; zeros for a fresh sequence), weight [C, K].
    Returns (outputs [T, C] in x.dtype, the new window [C, K-1]: the last K-1 inputs of window ++ x)."""
    num_channels, kernel_size = weight.shape
    wide = _wide_dtype(x.dtype)
    inputs = torch.cat([window, x.t().to(window.dtype)], dim=1)  # [C, K-1+T]
    # No padding: the window supplies the K-1 inputs each early output needs, so there are exactly T outputs.
    out = F.conv1d(inputs.to(wide).unsqueeze(0), weight.to(wide).unsqueeze(1), groups=num_channels)
    # Sliced from the front, not with [-(K-1):], so that K == 1 keeps an empty window; T < K-1 keeps old inputs.
    new_window = inputs[:, inputs.shape[1] - (kernel_size - 1) :]
    return F.silu(out[0]).t().to(x.dtype), new_window


def causal_conv_step(
    x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: x [B, C], windows [B, C, K-1], weight [C, K] -> (outputs [B, C], new windows [B, C, K-1])."""
    wide = _wide_dtype(x.dtype)
    inputs = torch.cat([windows, x.unsqueeze(-1).to(windows.dtype)], dim=-1)  # [B, C, K]
    out = (inputs.to(wide) * weight.to(wide)).sum(-1)
    return F.silu(out).to(x.dtype), inputs[..., 1:]


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill: q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay, <= 0) and beta [T, Hv], state
    [Hv, Dk, Dv] (the state before these tokens). q and k are L2-normalised over Dk here and q scaled by
    Dk**-0.5 (as the model does with use_qk_l2norm_in_kernel=True); each key head serves Hv // Hk consecutive
    value heads. Computes in the state's dtype. Returns (outputs [T, Hv, Dv] in v.dtype, new state)."""
    num_tokens, num_v_heads, _ = v.shape
    out_dtype, dtype = v.dtype, state.dtype
    q, k = _normalise_qk(q, k, num_v_heads, dtype)
    # Heads first, then [Hv, chunks, chunk_size, ...]; the padded tail has k = 0, beta = 0 and g = 0, so it
    # writes nothing to the state and does not decay it.
    num_chunks = -(-num_tokens // chunk_size)
    pad_tokens = num_chunks * chunk_size - num_tokens
    q, k, v = (
        F.pad(t.to(dtype).transpose(0, 1), (0, 0, 0, pad_tokens)).unflatten(1, (num_chunks, chunk_size))
        for t in (q, k, v)
    )
    g, beta = (
        F.pad(t.to(dtype).t(), (0, pad_tokens)).unflatten(1, (num_chunks, chunk_size)) for t in (g, beta)
    )

    # log_decay[..., i] is the log of the decay from the chunk's start through token i.
    log_decay = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay_between[..., i, j] = decay from after token j through token i (j <= i); masked to -inf before the
    # exp because the j > i entries are growths that could overflow.
    decay_between = (
        (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    )

    # Token i's delta u_i = beta_i (v_i - (decayed state before i)^T k_i) depends on the deltas of earlier tokens
    # in its chunk through (I + M) U = beta V - beta decay K S0, with M[i, j] = beta_i decay(j->i) k_i.k_j for
    # j < i. Solving the unit lower-triangular system once per chunk leaves U = new_values - k_decayed @ S0.
    k_beta = k * beta.unsqueeze(-1)
    key_overlaps = (k_beta @ k.transpose(-1, -2)) * decay_between
    system = key_overlaps.tril(-1) + torch.eye(chunk_size, dtype=dtype, device=q.device)
    # One solve for both right-hand sides: the values and the decayed keys.
    solved = torch.linalg.solve_triangular(
        system,
        torch.cat([v * beta.unsqueeze(-1), k_beta * log_decay.exp().unsqueeze(-1)], dim=-1),
        upper=False,
        unitriangular=True,
    )
    new_values, k_decayed = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    intra_chunk_scores = (q @ k.transpose(-1, -2)) * decay_between
    q_decayed = q * log_decay.exp().unsqueeze(-1)
    # Each token's write, decayed to the chunk's end, and the whole chunk's decay of the carried state.
    k_to_chunk_end = k * (log_decay[..., -1:] - log_decay).exp().unsqueeze(-1)
    chunk_decay = log_decay[..., -1].exp()[..., None, None]

    outputs = torch.empty_like(new_values)
    for chunk in range(num_chunks):
        deltas = new_values[:, chunk] - k_decayed[:, chunk] @ state
        outputs[:, chunk] = q_decayed[:, chunk] @ state + intra_chunk_scores[:, chunk] @ deltas
        state = state * chunk_decay[:, chunk] + k_to_chunk_end[:, chunk].transpose(-1, -2) @ deltas
    outputs = outputs.flatten(1, 2)[:, :num_tokens].transpose(0, 1)
    return outputs.to(out_dtype).contiguous(), state


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (the recurrent form): q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], states
    [B, Hv, Dk, Dv] -> (outputs [B, Hv, Dv] in v.dtype, new states)."""
    dtype = states.dtype
    q, k = _normalise_qk(q, k, v.shape[1], dtype)
    decayed = states * g.to(dtype).exp()[..., None, None]
    # Row-vector matmuls [B, H, 1, Dk] @ [B, H, Dk, Dv]: batched GEMV, far cheaper per call than einsum.
    predicted = (k.unsqueeze(-2) @ decayed).squeeze(-2)
    deltas = (v.to(dtype) - predicted) * beta.to(dtype).unsqueeze(-1)
    new_states = decayed + k.unsqueeze(-1) * deltas.unsqueeze(-2)
    outputs = (q.unsqueeze(-2) @ new_states).squeeze(-2)
    return outputs.to(v.dtype), new_states


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [N, D] (plain weight, not 1 + weight) times SiLU(gate), computed in float32 or wider, in x.dtype."""
    wide = _wide_dtype(x.dtype)
    x_wide = x.to(wide)
    normed = x_wide * torch.rsqrt(x_wide.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.to(wide) * F.silu(gate.to(wide))).to(x.dtype)


def _wide_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _normalise_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [..., Hk, Dk] in `dtype`, L2-normalised over Dk, q scaled by Dk**-0.5, repeated to Hv heads."""
    q, k = q.to(dtype), k.to(dtype)
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + _L2_NORM_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + _L2_NORM_EPS)
    group_size = num_v_heads // k.shape[-2]
    if group_size > 1:
        q, k = (t.repeat_interleave(group_size, dim=-2) for t in (q, k))
    return q, k
