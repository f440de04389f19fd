"""fp8 KV scales, calibrated once at start-up: the largest |K| and |V| each layer produces on a short text."""

from __future__ import annotations

import torch

from swarmkv.engine.kv_cache import KVCache
from swarmkv.models.attention import CausalSelfAttention
from swarmkv.models.decoder import DecoderForCausalLM
from swarmkv.tokenizer import Tokenizer

# Prose, code and a tool schema: the kinds of text an agent's context holds.
CALIBRATION_TEXT = (
    "You are a careful coding agent. Read the failing test, find the bug and fix it with the smallest change.\n"
    "def merge(intervals):\n    intervals.sort(key=lambda x: x[0])\n    out = [intervals[0]]\n"
    "    for start, end in intervals[1:]:\n        if start <= out[-1][1]:\n"
    "            out[-1][1] = max(out[-1][1], end)\n        else:\n            out.append([start, end])\n"
    '    return out\n{"name": "run_tests", "parameters": {"type": "object", "properties": {"path": '
    '{"type": "string"}}}}\nThe capital of France is Paris. 1, 2, 3, 5, 8, 13, 21, 34.'
)


class _AmaxRecorder(CausalSelfAttention):
    """Causal attention that also records each layer's largest |K| and |V|."""

    def __init__(self, num_layers: int) -> None:
        self.k_amax: list[torch.Tensor] = [torch.zeros(())] * num_layers
        self.v_amax: list[torch.Tensor] = [torch.zeros(())] * num_layers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k_amax[layer] = k.abs().amax().float()
        self.v_amax[layer] = v.abs().amax().float()
        return super().attend(layer, q, k, v)


@torch.inference_mode()
def calibrate_kv_scales(model: DecoderForCausalLM, cache: KVCache, tokenizer: Tokenizer) -> None:
    """Run the calibration text once and set the cache's per-layer fp8 scales from what it produced."""
    ids = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)[: model.config.max_position_embeddings]
    device = cache.k.device
    recorder = _AmaxRecorder(model.config.num_attention_layers)
    model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), recorder)
    k_amax = torch.stack(recorder.k_amax).tolist()  # one host sync for every layer
    v_amax = torch.stack(recorder.v_amax).tolist()
    cache.calibrate(k_amax, v_amax)
