"""Qwen3.5's multi-token-prediction (MTP) layer as a drafter: held from the file only when asked, its drafts the
ones a full-sequence computation of the layer gives, and the output exactly what speculation off gives, with
a layer that predicts nothing (random weights: the chooser backs off) and one that predicts exactly (a
constructed bigram whose MTP layer passes the next token's embedding to the head: nearly every draft kept)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine_helpers import checked_generate
from swarmkv import LLM, SamplingParams
from swarmkv.engine.mtp import MTPDrafter
from swarmkv.errors import UnsupportedModelError
from swarmkv.models.attention import CausalSelfAttention
from swarmkv.models.decoder import DecoderForCausalLM
from swarmkv.models.gguf_linear import GGUFEmbedding, GGUFLinear
from swarmkv.models.loader import LoadedModel, load_model
from swarmkv.plan.checkpoint import load_checkpoint
from swarmkv.spec.chooser import DraftChooser, mtp_draft_length
from swarmkv.structured.grammars import json_schema_grammar
from tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 Qwen3.5 GGUF with llama.cpp's MTP block (untied head, so a bigram can be built on it)."""
    path = tmp_path_factory.mktemp("mtp") / "q35-mtp.gguf"
    return write_tiny_gguf(path, "qwen35", projections=Q.F32, embedding=Q.F32, tied=False, mtp=True)


@pytest.fixture(scope="module")
def random_mtp(mtp_file: Path) -> LoadedModel:
    return load_model(mtp_file, dtype="float32", mtp=True)


@pytest.fixture(scope="module")
def exact_mtp(mtp_file: Path) -> LoadedModel:
    loaded = load_model(mtp_file, dtype="float32", mtp=True)
    make_exact_bigram(loaded.model)
    return loaded


def _weight(module: torch.nn.Module) -> torch.Tensor:
    """A float layer's weight (an all-float file loads as float layers; a GGUF-held one's single block)."""
    if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
        return module.weight
    assert isinstance(module, GGUFLinear | GGUFEmbedding)
    (block,) = module.blocks
    assert isinstance(block.weight, torch.Tensor)
    return block.weight


@torch.no_grad()
def make_exact_bigram(model: DecoderForCausalLM, seed: int = 0) -> None:
    """Every layer adds nothing (its output projections zero), so the last hidden state is the current token's
    normed embedding; the head scores token v by the embedding of pi^-1(v), so the model continues t with
    pi(t). The MTP layer's projection keeps only the next token's (normed) embedding and its layer adds
    nothing, so it scores the token after next as the model will: it predicts exactly."""
    for layer in [*model.layers, *(model.mtp.layers if model.mtp is not None else [])]:
        outputs = [layer.mlp.down_proj]
        if layer.self_attn is not None:
            outputs.append(layer.self_attn.o_proj)
        if layer.linear_attn is not None:
            outputs.append(layer.linear_attn.out_proj)
        for module in outputs:
            _weight(module).zero_()
    embed = _weight(model.embed_tokens)
    perm = torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(seed))
    _weight(model.lm_head).copy_(embed[torch.argsort(perm)])  # row v: the embedding of pi^-1(v)
    assert model.mtp is not None
    hidden = model.config.hidden_size
    fc = _weight(model.mtp.fc)
    fc.zero_()
    fc[:, :hidden] = torch.eye(hidden)
    for norm in (model.norm, model.mtp.norm, model.mtp.pre_fc_norm_embedding, model.mtp.pre_fc_norm_hidden):
        norm.weight.fill_(1.0)


def _prompts(count: int = 5) -> list[list[int]]:
    """A shared head of two pages, then each request's own tail."""
    generator = torch.Generator().manual_seed(7)
    head = torch.randint(0, 1024, (40,), generator=generator).tolist()
    return [head + torch.randint(0, 1024, (5 + 3 * i,), generator=generator).tolist() for i in range(count)]


def test_the_layer_is_held_only_when_asked(mtp_file: Path, random_mtp: LoadedModel) -> None:
    plain = load_model(mtp_file, dtype="float32")
    assert plain.model.mtp is None and plain.config.mtp_layers == 0
    assert plain.config.checkpoint_mtp_layers == 1
    assert random_mtp.model.mtp is not None and random_mtp.config.mtp_layers == 1
    # Its attention gets a KV slab after the decoder's one attention layer.
    assert (plain.config.num_attention_layers, random_mtp.config.num_attention_layers) == (1, 2)
    f32 = torch.float32
    assert random_mtp.config.kv_bytes_per_token(f32) == 2 * plain.config.kv_bytes_per_token(f32)
    # Asked of a file without the layer, nothing changes.
    path = write_tiny_gguf(mtp_file.parent / "no-mtp.gguf", "qwen35", projections=Q.F32, tied=False)
    assert load_model(path, dtype="float32", mtp=True).model.mtp is None


def test_more_than_one_mtp_layer_is_refused(random_mtp: LoadedModel) -> None:
    config = dataclasses.replace(random_mtp.config, checkpoint_mtp_layers=2, mtp_layers=2)
    with pytest.raises(UnsupportedModelError, match="2 MTP layers"):
        DecoderForCausalLM(config)


def test_the_planner_counts_the_layer_and_its_kv_only_with_mtp(mtp_file: Path) -> None:
    without, with_mtp = (load_checkpoint(mtp_file, mtp=mtp) for mtp in (False, True))
    plain, held = without.gguf_weights, with_mtp.gguf_weights
    assert plain is not None and held is not None
    assert plain.skipped and not held.skipped  # the MTP block's tensors: left out, then held
    assert held.total_bytes > plain.total_bytes
    assert (without.shape.num_kv_layers, with_mtp.shape.num_kv_layers) == (1, 2)


OPTIONS = [
    {},
    # Preemption: KV pages for two or three of the five requests, state slots for all of them.
    {"kv_cache_memory": 1100 * 2**10, "state_memory": 860 * 2**10, "block_size": 8},
    {"max_num_batched_tokens": 24, "block_size": 4},  # chunked prefills beside drafts, small pages
]


@pytest.mark.parametrize("method", ["mtp", "both"])
@pytest.mark.parametrize("options", OPTIONS, ids=["shared", "preempting", "chunked"])
@pytest.mark.parametrize("which", ["random", "exact"])
def test_greedy_output_is_identical_with_mtp(
    which: str, options: dict[str, object], method: str, request: pytest.FixtureRequest
) -> None:
    loaded: LoadedModel = request.getfixturevalue(f"{which}_mtp")
    prompts = _prompts()
    off = checked_generate(LLM(loaded=loaded, speculation="off", **options), prompts, GREEDY)  # type: ignore[arg-type]
    llm = LLM(loaded=loaded, speculative_method=method, **options)  # type: ignore[arg-type]
    on = checked_generate(llm, prompts, GREEDY)
    assert on == off
    stats = llm.engine.snapshot()
    assert stats.generated_tokens == sum(len(o) for o in on)
    assert stats.spec_mtp_draft_tokens > 0
    if which == "exact" and method == "mtp":
        # Every draft token is the model's own next choice; the chooser drafts the most it may.
        assert stats.spec_accepted_mtp_tokens == stats.spec_mtp_draft_tokens
        assert stats.steps < 0.6 * stats.generated_tokens
    if which == "random":
        # A layer that predicts nothing is tried, then backed off: few drafts over the replies.
        assert stats.spec_accepted_mtp_tokens <= 2
        assert stats.spec_mtp_draft_tokens < 0.4 * stats.generated_tokens
    if "kv_cache_memory" in options:
        assert stats.preemptions > 0
    kv = llm.engine.core.kv
    assert kv.num_in_use == 0 and kv.num_free + kv.num_cached == kv.num_pages  # nothing leaked


def test_prefix_hits_and_a_grammar_stay_exact(exact_mtp: LoadedModel) -> None:
    grammar = json_schema_grammar(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    constrained = SamplingParams(max_tokens=24, temperature=0.0, grammar=grammar)
    runs = {}
    for mode in ("off", "on"):
        llm = LLM(loaded=exact_mtp, speculation=mode, speculative_method="both")
        first = checked_generate(llm, _prompts(2), GREEDY)
        again = checked_generate(llm, _prompts(3), GREEDY)  # the first two hit their whole prompts
        json = checked_generate(llm, _prompts(2), constrained)
        runs[mode] = (first, again, json, llm.engine.snapshot())
    assert runs["on"][:3] == runs["off"][:3]
    stats = runs["on"][3]
    assert stats.prefix_hit_tokens > 0 and stats.spec_accepted_mtp_tokens > 0


def _reference_drafts(model: DecoderForCausalLM, tokens: list[int], count: int) -> list[int]:
    """The MTP layer's greedy chain after `tokens`, computed over the whole sequence with no cache: the
    decoder's normed hidden states, the layer over (token p + 1, hidden p) for every p, then chained on its own
    output."""
    assert model.mtp is not None
    with torch.no_grad():
        ids = torch.tensor(tokens)
        positions = torch.arange(len(tokens))
        hidden = model(ids, positions, CausalSelfAttention())
        # Row p pairs the hidden state at p with the token at p + 1; the last row waits for the first draft.
        inputs, states = ids[1:].tolist(), hidden[:-1]
        out = model.mtp(model.embed_tokens(ids[1:]), states, positions[:-1], CausalSelfAttention())
        # The last prompt token's own row needs the token after it: the model's greedy choice there.
        nxt = int(model.compute_logits(hidden[-1:]).argmax())
        drafts: list[int] = []
        inputs.append(nxt)
        states = torch.cat([states, hidden[-1:]])
        for _ in range(count):
            out = model.mtp(
                model.embed_tokens(torch.tensor(inputs)),
                states,
                torch.arange(len(inputs)),
                CausalSelfAttention(),
            )
            token = int(model.compute_logits(out[-1:]).argmax())
            drafts.append(token)
            inputs.append(token)
            states = torch.cat([states, out[-1:]])
    return [nxt, *drafts]


def test_drafts_are_the_layer_over_the_whole_sequence(random_mtp: LoadedModel) -> None:
    """After a prefill split into chunks, the drafter's chain equals the layer run over the whole sequence
    from scratch: its KV, written chunk by chunk in the request's pages, is the KV the layer computes."""
    llm = LLM(loaded=random_mtp, speculative_method="mtp", max_num_batched_tokens=16, block_size=4)
    engine = llm.engine
    drafter = engine.executor.mtp
    assert isinstance(drafter, MTPDrafter)
    chooser = drafter.chooser
    assert isinstance(chooser, DraftChooser)
    prompt = _prompts(1)[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    sampled: list[int] = []
    while not sampled:
        for delta in engine.step():
            sampled += delta.new_token_ids
    length = mtp_draft_length(0.5, chooser.head_cost, chooser.mtp_tokens)
    expected = _reference_drafts(random_mtp.model, prompt, length)
    assert sampled[0] == expected[0]
    assert list(chooser._requests["a"].proposal) == expected[1:]


@pytest.mark.parametrize(
    ("rate", "head_cost", "longest", "length"),
    [(0.9, 0.05, 3, 3), (0.5, 0.1, 3, 2), (0.05, 0.2, 3, 0), (0.0, 0.0, 3, 0), (1.0, 0.0, 5, 5)],
)
def test_the_draft_length_pays_for_its_head_passes(
    rate: float, head_cost: float, longest: int, length: int
) -> None:
    assert mtp_draft_length(rate, head_cost, longest) == length


def _bench_mtp() -> ModuleType:
    """bench/mtp.py, whose exact-MTP file builder works on any qwen35 GGUF with an MTP block."""
    spec = importlib.util.spec_from_file_location("bench_mtp", Path(__file__).parents[1] / "bench" / "mtp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_c_decode_step_feeds_the_drafter(tmp_path: Path) -> None:
    """Quantized projections take the C decode step, which hands the drafter its rows' hidden states: the
    exact-MTP file bench/mtp.py builds has every draft accepted, and both files match speculation off."""
    source = write_tiny_gguf(tmp_path / "q8.gguf", "qwen35", projections=Q.Q8_0, mtp=True)
    exact = _bench_mtp().exact_mtp_file(source, tmp_path / "q8-exact.gguf")
    for path in (source, exact):
        loaded = load_model(path, dtype="float32", mtp=True)
        off = checked_generate(
            LLM(loaded=loaded, speculation="off", cpu_int8_activations=False), _prompts(), GREEDY
        )
        llm = LLM(loaded=loaded, speculative_method="mtp", cpu_int8_activations=False)
        assert llm.engine.runner.cpu_decode is not None
        assert checked_generate(llm, _prompts(), GREEDY) == off
        stats = llm.engine.snapshot()
        assert stats.spec_mtp_draft_tokens > 0
        if path == exact:
            assert stats.spec_accepted_mtp_tokens == stats.spec_mtp_draft_tokens
            assert stats.steps < 0.6 * stats.generated_tokens  # draft lengths follow measured costs
