"""Qwen3.5 hybrids (Gated DeltaNet + gated attention): logits and greedy parity with transformers, loading.

The float64 reference is transformers with its float32 casts lifted (`float64_throughout`), so float64
parity is tight (1e-9; the two agree to ~1e-13). In float32 the two round alike: at 150 tokens both sit
~2e-3 from the exact logits (random weights, logits up to ~8) yet within ~1.5e-4 of each other. So float32
parity is 5e-4 to transformers' float32, and no further from exact than twice transformers' own distance.
"""

from __future__ import annotations

import json
import shutil
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from swarmkv.config import ModelConfig
from swarmkv.errors import ModelLoadError, UnsupportedModelError
from swarmkv.models.attention import CausalSelfAttention
from swarmkv.models.loader import LoadedModel, load_model
from tiny_models import (
    edit_config,
    float64_throughout,
    lengthen_recurrent_memory,
    make_tiny_checkpoint,
    make_tiny_qwen3_5_multimodal_checkpoint,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64}
FLOAT64_TOLERANCE = 1e-9
FLOAT32_TOLERANCE = 5e-4
PROMPT_LENGTHS = [1, 7, 64, 65, 150]  # one token, under a chunk, a chunk, just past it, several
ALTERNATING = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
GREEDY_TOKENS = 8
# The tokenizer's first ids only: an LM head over all 151k would be most of these tests' time, and has
# nothing to do with the hybrid layers (test_models.py runs whole-vocabulary checkpoints).
VOCAB = 1024


# Tiny tensors run fastest on one thread on a shared CPU (conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_ids(num_tokens: int, seed: int = 0) -> list[int]:
    """Seeded random ids below 384 (byte-level tokens of the Qwen tokenizer)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 384, (num_tokens,), generator=generator).tolist()


def swarmkv_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] in the model's dtype, every layer run by the cache-less reference backend."""
    input_ids = torch.tensor(ids, device=loaded.device)
    positions = torch.arange(len(ids), device=loaded.device)
    with torch.inference_mode():
        hidden = loaded.model(input_ids, positions, CausalSelfAttention())
        # Not compute_logits: it rounds to float32, which would hide float64 differences.
        return loaded.model.lm_head(hidden)


def exact_in_float64(model: Any) -> AbstractContextManager[None]:
    """Lift transformers' float32 casts for a float64 model; float32 models run as transformers wrote them."""
    return float64_throughout(model) if model.dtype == torch.float64 else nullcontext()


def hf_model(folder: Path, dtype: torch.dtype) -> Any:
    """transformers' Qwen3_5ForCausalLM from `folder`, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] from transformers in the model's dtype (float64 with its float32 casts lifted)."""
    with torch.inference_mode(), exact_in_float64(model):
        return model(torch.tensor([ids])).logits[0]


def swarmkv_greedy(loaded: LoadedModel, ids: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation recomputing the whole sequence per token (no cache, no state carried)."""
    tokens = list(ids)
    with torch.inference_mode():
        for _ in range(num_tokens):
            positions = torch.arange(len(tokens), device=loaded.device)
            hidden = loaded.model(
                torch.tensor(tokens, device=loaded.device), positions, CausalSelfAttention()
            )
            tokens.append(int(loaded.model.lm_head(hidden[-1:]).argmax()))
    return tokens[len(ids) :]


def hf_greedy(model: Any, ids: list[int], num_tokens: int) -> list[int]:
    """transformers' `generate(do_sample=False)`: chunked prefill, then token-by-token recurrent decode."""
    with torch.inference_mode(), exact_in_float64(model):
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Qwen3.5 as a CausalLM repo, as a ConditionalGeneration repo, and with alternating layers
    whose states decay slowly (transformers' init forgets within a token or two: the other two)."""
    root = tmp_path_factory.mktemp("qwen3_5")
    return {
        "causal": make_tiny_checkpoint(root / "causal", "qwen3_5", vocab_size=VOCAB),
        "multimodal": make_tiny_qwen3_5_multimodal_checkpoint(root / "multimodal", vocab_size=VOCAB),
        "alternating": lengthen_recurrent_memory(
            make_tiny_checkpoint(root / "alternating", "qwen3_5", layer_types=ALTERNATING, vocab_size=VOCAB)
        ),
    }


@pytest.fixture(scope="module")
def ours(folders: dict[str, Path]) -> dict[str, LoadedModel]:
    """swarmkv's reading of the CausalLM folder in both dtypes."""
    return {d: load_model(folders["causal"], dtype=d) for d in DTYPES}


@pytest.fixture(scope="module")
def theirs(folders: dict[str, Path]) -> dict[str, Any]:
    """transformers' reading of the CausalLM folder in both dtypes."""
    return {d: hf_model(folders["causal"], dtype) for d, dtype in DTYPES.items()}


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_float64_logits_match_transformers(
    length: int, ours: dict[str, LoadedModel], theirs: dict[str, Any]
) -> None:
    loaded = ours["float64"]
    ids = random_ids(length, seed=length)

    mine, reference = swarmkv_logits(loaded, ids), hf_logits(theirs["float64"], ids)

    assert mine.dtype == reference.dtype == torch.float64
    assert mine.shape == reference.shape == (length, loaded.config.vocab_size)
    assert (mine - reference).abs().max().item() <= FLOAT64_TOLERANCE
    # Guard against a vacuous pass: the logits must actually vary from token to token.
    assert reference.std(dim=-1).min().item() > 0.1


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_float32_logits_match_transformers(
    length: int, ours: dict[str, LoadedModel], theirs: dict[str, Any]
) -> None:
    ids = random_ids(length, seed=length)
    exact = hf_logits(theirs["float64"], ids)

    mine, reference = swarmkv_logits(ours["float32"], ids), hf_logits(theirs["float32"], ids)

    assert mine.dtype == reference.dtype == torch.float32
    assert (mine - reference).abs().max().item() <= FLOAT32_TOLERANCE
    # As accurate as transformers' float32: rounding noise, not a float32 path that drifts.
    my_error = (mine.double() - exact).abs().max().item()
    assert my_error <= 2 * (reference.double() - exact).abs().max().item() + 1e-5


def test_float64_reference_is_tighter_than_float32(theirs: dict[str, Any]) -> None:
    """The lifted float64 reference is what makes 1e-9 meaningful: its decode path agrees with its
    prefill path far below float32 noise, and it sits float32 noise away from the float32 model."""
    ids = random_ids(40, seed=11)
    model = theirs["float64"]
    prefill = hf_logits(model, ids)
    with torch.inference_mode(), float64_throughout(model):
        out = model(torch.tensor([ids[:-1]]), use_cache=True)
        decoded = model(torch.tensor([ids[-1:]]), cache=out.cache, use_cache=True)
    assert (decoded.logits[0, -1] - prefill[-1]).abs().max().item() <= 1e-10
    float32_noise = (hf_logits(theirs["float32"], ids).double() - prefill).abs().max().item()
    assert 1e-7 < float32_noise < 1e-2


@pytest.mark.parametrize("length", [1, 7, 65])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_decode_matches_transformers_generate(
    dtype: str, length: int, ours: dict[str, LoadedModel], theirs: dict[str, Any]
) -> None:
    ids = random_ids(length, seed=100 + length)

    tokens = swarmkv_greedy(ours[dtype], ids, GREEDY_TOKENS)

    assert tokens == hf_greedy(theirs[dtype], ids, GREEDY_TOKENS)
    assert len(set(tokens)) > 1  # a model stuck on one token would hide a wrong state


def test_config_is_normalised(folders: dict[str, Path]) -> None:
    raw = json.loads((folders["causal"] / "config.json").read_text())
    config = ModelConfig.from_hf_dict(raw)

    assert raw["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config.architecture == "qwen3_5"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (4, 64, 128)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.num_attention_layers == 1
    assert config.linear is not None
    assert (config.linear.num_key_heads, config.linear.num_value_heads) == (2, 4)
    assert (config.linear.key_head_dim, config.linear.value_head_dim) == (16, 16)
    assert config.linear.conv_kernel == 4
    assert config.partial_rotary_factor == 0.5
    assert config.attn_output_gate is True
    assert config.qk_norm and not config.tie_word_embeddings
    # Only the one attention layer keeps KV: K and V, 2 heads of 16 dims.
    assert config.kv_bytes_per_token(torch.float32) == 2 * 1 * 2 * 16 * 4


def test_multimodal_config_is_its_text_config(folders: dict[str, Path]) -> None:
    raw = json.loads((folders["multimodal"] / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in raw

    assert ModelConfig.from_hf_dir(folders["multimodal"]) == ModelConfig.from_hf_dir(folders["causal"])


def test_multimodal_checkpoint_loads_its_text_model(
    folders: dict[str, Path], ours: dict[str, LoadedModel]
) -> None:
    """The same seeded weights as the CausalLM repo, stored the released repos' way."""
    weights = load_file(folders["multimodal"] / "model.safetensors")
    assert any(name.startswith("model.visual.") for name in weights)
    assert any(name.startswith("model.language_model.layers.") for name in weights)

    loaded = load_model(folders["multimodal"], dtype="float64")
    ids = random_ids(65, seed=3)

    assert loaded.config.architecture == "qwen3_5"
    assert not any("visual" in name for name, _ in loaded.model.named_parameters())
    assert torch.equal(swarmkv_logits(loaded, ids), swarmkv_logits(ours["float64"], ids))


def test_alternating_layers_with_long_memory_match_transformers(folders: dict[str, Path]) -> None:
    """The states carry tens of tokens, so what crosses the delta rule's 64-token chunks counts."""
    loaded = load_model(folders["alternating"], dtype="float64")
    reference = hf_model(folders["alternating"], torch.float64)
    assert loaded.config.layer_types == tuple(ALTERNATING)
    assert loaded.config.num_attention_layers == 2

    for length in (65, 150):
        ids = random_ids(length, seed=5 + length)
        assert (
            swarmkv_logits(loaded, ids) - hf_logits(reference, ids)
        ).abs().max().item() <= FLOAT64_TOLERANCE
    ids = random_ids(70, seed=5)
    assert swarmkv_greedy(loaded, ids, GREEDY_TOKENS) == hf_greedy(reference, ids, GREEDY_TOKENS)


# ---- refusals -----------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(folders: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the CausalLM checkpoint, free to damage."""
    return Path(shutil.copytree(folders["causal"], tmp_path / "qwen3_5"))


def test_the_pristine_checkpoint_loads(checkpoint: Path) -> None:
    """The damage in the tests below is what fails, not the checkpoint itself."""
    assert load_model(checkpoint, dtype="float32").config.architecture == "qwen3_5"


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.linear_attn.A_log",
        "model.layers.1.linear_attn.in_proj_b.weight",
        "model.layers.2.linear_attn.dt_bias",
        "model.layers.0.linear_attn.conv1d.weight",
        "model.layers.1.linear_attn.norm.weight",
        "model.layers.3.self_attn.q_norm.weight",
    ],
)
def test_missing_tensor_is_named(checkpoint: Path, name: str) -> None:
    path = checkpoint / "model.safetensors"
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})

    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        load_model(checkpoint, dtype="float32")


def test_missing_tensor_of_a_multimodal_checkpoint_is_named(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = Path(shutil.copytree(folders["multimodal"], tmp_path / "multimodal"))
    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.language_model.layers.2.linear_attn.in_proj_a.weight"]
    save_file(tensors, path, metadata={"format": "pt"})

    # Either spelling names the tensor: the checkpoint's, or the text model's.
    with pytest.raises(ModelLoadError, match=r"layers\.2\.linear_attn\.in_proj_a\.weight"):
        load_model(folder, dtype="float32")


@pytest.mark.parametrize("architecture", ["Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"])
def test_mixture_of_experts_is_refused(checkpoint: Path, architecture: str) -> None:
    edit_config(checkpoint, architectures=[architecture], model_type="qwen3_5_moe")

    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        load_model(checkpoint, dtype="float32")
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        ModelConfig.from_hf_dir(checkpoint)
