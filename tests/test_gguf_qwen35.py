"""Qwen3.5 from llama.cpp's `qwen35` GGUF: the committed fixture (tests/fixtures/qwen35-tiny/, made once by
llama.cpp's own converter from the safetensors beside it, see make_qwen35_gguf.py) loads with the weights,
tokenizer and chat template of the safetensors checkpoint, and generates the same greedy tokens in float32.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fixtures.make_qwen35_gguf import FIXTURE, GGUF_NAME, HF_FILES, copy_tokenizer
from swarmkv import LLM, SamplingParams
from swarmkv.config import ModelConfig
from swarmkv.errors import ModelLoadError, UnsupportedModelError
from swarmkv.models.gguf_file import GGUFFile, open_gguf
from swarmkv.models.gguf_qwen35 import qwen35_hf_name, qwen35_tensor
from swarmkv.models.loader import LoadedModel, load_model

GGUF = FIXTURE / GGUF_NAME
GREEDY_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "一二三四五六七八九十",
    "<|im_start|>user\nHi there, who are you?<|im_end|>\n<|im_start|>assistant\n",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three primes."},
    {"role": "assistant", "content": "2, 3, 5."},
    {"role": "user", "content": "And the next one?"},
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture's safetensors checkpoint, with the Qwen3 tokenizer.json it was converted with."""
    folder = tmp_path_factory.mktemp("qwen35-tiny-hf")
    for name in HF_FILES:
        shutil.copyfile(FIXTURE / name, folder / name)
    copy_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def from_hf(hf_dir: Path) -> LoadedModel:
    return load_model(hf_dir, dtype="float32")


@pytest.fixture(scope="module")
def gguf_file() -> GGUFFile:
    """The fixture GGUF parsed (its 151,669 tokens and merges take about 10 s of CPU): once for the module."""
    return open_gguf(GGUF)


@pytest.fixture(scope="module")
def gguf_meta(gguf_file: GGUFFile) -> dict[str, Any]:
    return gguf_file.metadata


@pytest.fixture(scope="module")
def from_gguf(gguf_file: GGUFFile) -> LoadedModel:
    """load_model on the fixture GGUF, handed the module's parse of it instead of parsing the file again."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("swarmkv.models.gguf_file.open_gguf", lambda path: gguf_file)
        return load_model(GGUF, dtype="float32")


def tiled(tensor: torch.Tensor, dim: int, num_key_heads: int, head_dim: int) -> torch.Tensor:
    """Value heads along `dim` from Hugging Face's grouped order to llama.cpp's tiled one (written from its
    description, not its code: grouped head g * r + i goes to tiled position i * num_key_heads + g)."""
    heads = tensor.shape[dim] // head_dim
    r = heads // num_key_heads
    order = [g * r + i for i in range(r) for g in range(num_key_heads)]
    index = torch.tensor([h * head_dim + d for h in order for d in range(head_dim)])
    return tensor.index_select(dim, index)


def as_llama_cpp_orders(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The safetensors load's parameters with every linear-attention value head moved to the tiled order."""
    assert config.linear is not None
    shape = config.linear
    hk, dv = shape.num_key_heads, shape.value_head_dim
    out = dict(state)
    for name, tensor in state.items():
        if ".linear_attn." not in name:
            continue
        if name.endswith("in_proj.weight"):
            qk, v, z = tensor.split([2 * shape.key_dim, shape.value_dim, shape.value_dim])
            out[name] = torch.cat([qk, tiled(v, 0, hk, dv), tiled(z, 0, hk, dv)])
        elif name.endswith("in_proj_ba.weight"):
            b, a = tensor.chunk(2)
            out[name] = torch.cat([tiled(b, 0, hk, 1), tiled(a, 0, hk, 1)])
        elif name.endswith(("A_log", "dt_bias")):
            out[name] = tiled(tensor, 0, hk, 1)
        elif name.endswith("conv1d.weight"):
            qk, v = tensor.split([2 * shape.key_dim, shape.value_dim])
            out[name] = torch.cat([qk, tiled(v, 0, hk, dv)])
        elif name.endswith("out_proj.weight"):
            out[name] = tiled(tensor, 1, hk, dv)
    return out


def greedy_tokens(loaded: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of the engine: chunked prefill, then recurrent decode."""
    llm = LLM(loaded=loaded, kv_cache_memory="8MiB", prefix_caching=False)
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


def test_fixture_is_small_and_made_by_llama_cpp(gguf_meta: dict[str, Any]) -> None:
    meta = gguf_meta
    assert meta["general.architecture"] == "qwen35"
    sizes = {name: (FIXTURE / name).stat().st_size for name in [GGUF_NAME, "model.safetensors"]}
    assert sum(sizes.values()) < 20 * 2**20, sizes
    # More value heads than key heads, so the converter reordered them.
    assert meta["qwen35.ssm.time_step_rank"] > meta["qwen35.ssm.group_count"]


def test_config_is_the_safetensors_config(from_hf: LoadedModel, from_gguf: LoadedModel) -> None:
    hf, gguf = from_hf.config, from_gguf.config
    assert hf.linear is not None and gguf.linear is not None
    assert gguf.linear.value_heads_tiled and not hf.linear.value_heads_tiled
    # The file stores the epsilon in float32.
    assert gguf.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-7)
    same = dataclasses.replace(
        gguf, rms_norm_eps=hf.rms_norm_eps, linear=dataclasses.replace(gguf.linear, value_heads_tiled=False)
    )
    assert same == hf


def test_weights_are_the_safetensors_weights(from_hf: LoadedModel, from_gguf: LoadedModel) -> None:
    expected = as_llama_cpp_orders(dict(from_hf.model.state_dict()), from_hf.config)
    loaded = dict(from_gguf.model.state_dict())
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        if name.endswith("A_log"):  # stored as -exp(A_log): one rounding each way
            torch.testing.assert_close(loaded[name], tensor, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(loaded[name], tensor), name


def test_greedy_tokens_are_the_safetensors_tokens(from_hf: LoadedModel, from_gguf: LoadedModel) -> None:
    prompts = [from_hf.tokenizer.encode(p) for p in PROMPTS]
    expected = greedy_tokens(from_hf, prompts)
    assert greedy_tokens(from_gguf, prompts) == expected
    assert len({tuple(t) for t in expected}) == len(PROMPTS)  # the prompts matter: not one repeated token


def test_grouped_head_order_would_change_the_tokens(from_hf: LoadedModel, from_gguf: LoadedModel) -> None:
    """The fixture is sensitive to the head order: llama.cpp's weights run in the Hugging Face order
    (the mapping broken on purpose) give other tokens."""
    assert from_gguf.config.linear is not None
    tiled_shape = from_gguf.config.linear
    mixers = [layer.linear_attn for layer in from_gguf.model.layers if layer.linear_attn is not None]
    prompts = [from_hf.tokenizer.encode(p) for p in PROMPTS]
    try:
        for mixer in mixers:
            mixer.shape = dataclasses.replace(tiled_shape, value_heads_tiled=False)
        broken = greedy_tokens(from_gguf, prompts)
    finally:
        for mixer in mixers:
            mixer.shape = tiled_shape
    expected = greedy_tokens(from_hf, prompts)
    assert all(b != e for b, e in zip(broken, expected, strict=True))


def test_tokenizer_and_chat_template_come_from_the_file(from_hf: LoadedModel, from_gguf: LoadedModel) -> None:
    hf, gguf = from_hf.tokenizer, from_gguf.tokenizer
    assert gguf.chat_template == hf.chat_template is not None
    for text in PROMPTS:
        assert gguf.encode(text) == hf.encode(text)
    rendered = hf.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert gguf.apply_chat_template(MESSAGES, add_generation_prompt=True) == rendered
    assert gguf.eos_token_ids == hf.eos_token_ids


def test_qwen35_moe_is_refused_with_the_reason(gguf_meta: dict[str, Any]) -> None:
    meta = {**gguf_meta, "general.architecture": "qwen35moe"}
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        ModelConfig.from_gguf_metadata(meta)


def test_missing_linear_attention_metadata_is_named(gguf_meta: dict[str, Any]) -> None:
    meta = {k: v for k, v in gguf_meta.items() if k != "qwen35.ssm.group_count"}
    with pytest.raises(ModelLoadError, match="qwen35.ssm.group_count"):
        ModelConfig.from_gguf_metadata(meta)


def test_a_damaged_decay_is_refused() -> None:
    """ssm_a = -exp(A_log) is negative; a non-negative one means a damaged file, not a NaN decay."""
    with pytest.raises(ModelLoadError, match="ssm_a"):
        qwen35_tensor("model.layers.0.linear_attn.A_log", torch.tensor([-0.5, 0.0]))


def test_multi_token_prediction_layers_are_skipped(from_gguf: LoadedModel) -> None:
    """A file converted with its MTP head has layers past the decoder's own: not ours to run."""
    assert qwen35_hf_name("blk.3.nextn.eh_proj.weight", from_gguf.config) is None
    assert qwen35_hf_name("blk.3.attn_norm.weight", from_gguf.config) is None
    with pytest.raises(ModelLoadError, match="unexpected tensor"):
        qwen35_hf_name("blk.0.ssm_mystery.weight", from_gguf.config)


def test_the_decoder_layer_count_excludes_multi_token_prediction(gguf_meta: dict[str, Any]) -> None:
    meta = {
        **gguf_meta,
        "qwen35.block_count": 4,
        "qwen35.nextn_predict_layers": 1,
        "qwen35.attention.recurrent_layers": [True, True, False, False],
    }
    config = ModelConfig.from_gguf_metadata(meta)
    assert config.num_layers == 3
    assert config.layer_types == ("linear_attention", "linear_attention", "full_attention")
