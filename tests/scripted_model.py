"""A scripted checkpoint: a tiny float32 Llama whose greedy reply is known, for tests of tool-calling loops.

`make_scripted_checkpoint(folder)` writes config.json, model.safetensors, tokenizer.json and
tokenizer_config.json (the Qwen3 chat template, Hermes tool calls), so the folder loads like any model
(`LLM(folder)`, `swarmkv serve --model folder`). Greedy decoding replies, whatever the conversation:

* when the user's message is the last one: `WEATHER_CALL`, then the end of turn;
* when tool results are the last message: `ANSWER`, then the end of turn;
* when the server starts the reply inside a call it forces (`<tool_call>\\n{"name": "` for "required", up
  to `{"city": "` for a named tool, whichever tool it names): the rest of `WEATHER_CALL` on from the
  prefix's last piece (`FORCED_CALL_TAIL` after a named tool's prefix), then the end of turn;
* after anything else (a raw prompt, a thinking prefix): the end of turn at once.

How: the model is a bigram. Its tokenizer is byte-level (one token per byte, no merges) plus added tokens,
one per piece of the script, so each scripted token is the one context of the next. `vocabulary="qwen3"`
builds on the real Qwen3 tokenizer instead (its merges, plus the same added tokens), so a harness's
25K-token prompt is 25K tokens rather than 90K bytes; `arch="qwen3_5"` writes the same script into a
Qwen3.5 hybrid (Gated DeltaNet layers and a gated full-attention layer, all zero, so the recurrent
states are carried, snapshot and restored like a real hybrid's, without changing a logit). The generation prompt
`<|im_start|>assistant\\n` is one token, and after tool results it is merged with their end
(`</tool_response><|im_end|>\\n<|im_start|>assistant\\n`, the Qwen3 template's rendering), so the prompt's
last token alone says whose message came last. Each token embeds as a one-hot vector on its class (a
scripted piece, or "any other token"); the layer's attention and MLP are zero, so the residual stream
stays that one-hot vector; the LM head maps each class to its next token with a logit of `MARGIN` (up to
the final norm's rounding), every other logit exactly 0, on every CPU and SIMD width.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# Sets HF_HUB_OFFLINE before transformers is imported anywhere.
from conftest_tokenizer_helpers import qwen_dir

CITY = "Paris"
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."
# What a forced call's reply adds after the server's prefix, which ends inside the city's string.
FORCED_CALL_TAIL = 'Paris"}}\n</tool_call>'

END_OF_TURN = "<|im_end|>"
GENERATION_PROMPT = "<|im_start|>assistant\n"
AFTER_TOOL_RESULTS = "</tool_response><|im_end|>\n<|im_start|>assistant\n"
# The reply's tokens; each is also the context that predicts the next. The arguments' opening is its
# own token because the server's forced prefix ends with it.
CALL_PIECES = (
    "<tool_call>",
    '\n{"name": "',
    "get_weather",
    '", "arguments": ',
    '{"city": "',
    CITY,
    '"}}\n',
    "</tool_call>",
)
ANSWER_PIECES = ("It is", " sunny", " in Paris.")
assert "".join(CALL_PIECES) == WEATHER_CALL and "".join(ANSWER_PIECES) == ANSWER

# Qwen3's special tokens the template writes; the two prompt tokens above are special too (never generated).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", END_OF_TURN, GENERATION_PROMPT, AFTER_TOOL_RESULTS)
MARKUP_TOKENS = ("<tool_response>", "</tool_response>", "<think>", "</think>")
# Context -> the next token, greedily. Every other token predicts the end of turn.
SCRIPT: dict[str, str] = {
    GENERATION_PROMPT: CALL_PIECES[0],
    **dict(zip(CALL_PIECES, (*CALL_PIECES[1:], END_OF_TURN), strict=True)),
    AFTER_TOOL_RESULTS: ANSWER_PIECES[0],
    **dict(zip(ANSWER_PIECES, (*ANSWER_PIECES[1:], END_OF_TURN), strict=True)),
}

MARGIN = 25.0  # the chosen token's logit; every other logit is 0
HIDDEN_SIZE = 32  # one dimension per context class (len(SCRIPT) + 1), rounded up
MAX_POSITIONS = 8192


def _byte_alphabet() -> list[str]:
    """The byte-level pre-tokenizer's character for each byte, in byte order (GPT-2's table)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


Vocabulary = Literal["bytes", "qwen3"]
ScriptedArch = Literal["llama", "qwen3_5"]


def scripted_tokenizer(vocabulary: Vocabulary = "bytes") -> Tokenizer:
    """The base tokens (bytes: ids 0-255 are bytes 0-255; qwen3: Qwen3's), then the special, markup and script tokens."""
    if vocabulary == "qwen3":
        tokenizer = Tokenizer.from_file(str(qwen_dir() / "tokenizer.json"))
    else:
        vocab = {char: byte for byte, char in enumerate(_byte_alphabet())}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
    # Added tokens match leftmost-longest, so the merged prompt tokens win over their parts.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    pieces = dict.fromkeys((*MARKUP_TOKENS, *CALL_PIECES, *ANSWER_PIECES))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in pieces])
    return tokenizer


def _script_tables(tokenizer: Tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding (each token's context class, one-hot) and the LM head (each class's next token)."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    contexts = list(SCRIPT)
    assert len(contexts) < HIDDEN_SIZE
    embed = torch.zeros(vocab_size, HIDDEN_SIZE)
    embed[:, len(contexts)] = 1.0  # "any other token"
    lm_head = torch.zeros(vocab_size, HIDDEN_SIZE)
    # The final RMSNorm scales a one-hot vector to sqrt(HIDDEN_SIZE) (up to eps).
    lm_head[_id(tokenizer, END_OF_TURN), len(contexts)] = MARGIN / math.sqrt(HIDDEN_SIZE)
    for dim, context in enumerate(contexts):
        embed[_id(tokenizer, context)] = 0.0
        embed[_id(tokenizer, context), dim] = 1.0
        lm_head[_id(tokenizer, SCRIPT[context]), dim] = MARGIN / math.sqrt(HIDDEN_SIZE)
    return embed, lm_head


def scripted_weights(tokenizer: Tokenizer) -> dict[str, torch.Tensor]:
    """The Llama checkpoint's tensors, named as transformers' LlamaForCausalLM names them."""
    embed, lm_head = _script_tables(tokenizer)
    heads, kv_heads, head_dim, intermediate = _attention_shape()
    layer = "model.layers.0."
    return {
        "model.embed_tokens.weight": embed,
        f"{layer}input_layernorm.weight": torch.ones(HIDDEN_SIZE),
        f"{layer}self_attn.q_proj.weight": torch.zeros(heads * head_dim, HIDDEN_SIZE),
        f"{layer}self_attn.k_proj.weight": torch.zeros(kv_heads * head_dim, HIDDEN_SIZE),
        f"{layer}self_attn.v_proj.weight": torch.zeros(kv_heads * head_dim, HIDDEN_SIZE),
        f"{layer}self_attn.o_proj.weight": torch.zeros(HIDDEN_SIZE, heads * head_dim),
        f"{layer}post_attention_layernorm.weight": torch.ones(HIDDEN_SIZE),
        f"{layer}mlp.gate_proj.weight": torch.zeros(intermediate, HIDDEN_SIZE),
        f"{layer}mlp.up_proj.weight": torch.zeros(intermediate, HIDDEN_SIZE),
        f"{layer}mlp.down_proj.weight": torch.zeros(HIDDEN_SIZE, intermediate),
        "model.norm.weight": torch.ones(HIDDEN_SIZE),
        "lm_head.weight": lm_head,
    }


def _attention_shape() -> tuple[int, int, int, int]:
    """Heads, KV heads, head dim and MLP width of the one layer (its weights are zero)."""
    return 2, 1, HIDDEN_SIZE // 2, 2 * HIDDEN_SIZE


def _id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    assert token_id is not None, token
    return token_id


def _hf_config(tokenizer: Tokenizer, max_positions: int) -> dict[str, Any]:
    heads, kv_heads, head_dim, intermediate = _attention_shape()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": _id(tokenizer, END_OF_TURN),
        "pad_token_id": _id(tokenizer, "<|endoftext|>"),
        "torch_dtype": "float32",
    }


def _tokenizer_config(max_positions: int) -> dict[str, Any]:
    qwen = json.loads((qwen_dir() / "tokenizer_config.json").read_text(encoding="utf-8"))
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": END_OF_TURN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions,
        "chat_template": qwen["chat_template"],
    }


def _save_qwen3_5(folder: Path, tokenizer: Tokenizer, max_positions: int) -> None:
    """The script in a Qwen3.5 hybrid built by transformers: every layer's weights zero, so each adds nothing.

    Norm weights keep transformers' init (Qwen3.5's RMSNorm scales by 1 + weight, from zeros), and so do
    the recurrences' decay parameters; the residual stream stays the embedding's one-hot vector.
    """
    from transformers import AutoModelForCausalLM

    from tiny_models import tiny_hf_config

    heads, kv_heads, head_dim, intermediate = _attention_shape()
    config = tiny_hf_config(
        "qwen3_5",
        hidden_size=HIDDEN_SIZE,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=_id(tokenizer, END_OF_TURN),
        pad_token_id=_id(tokenizer, "<|endoftext|>"),
        layer_types=["linear_attention", "full_attention"],  # one of each is the hybrid; more only cost time
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    embed, lm_head = _script_tables(tokenizer)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name and not name.endswith(("A_log", "dt_bias")):
                param.zero_()
        model.get_input_embeddings().weight.copy_(embed)
        model.get_output_embeddings().weight.copy_(lm_head)
    model.save_pretrained(folder, safe_serialization=True)


def make_scripted_checkpoint(
    folder: Path,
    *,
    vocabulary: Vocabulary = "bytes",
    arch: ScriptedArch = "llama",
    max_positions: int = MAX_POSITIONS,
) -> Path:
    """Write the scripted checkpoint into `folder` (created if absent); return `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = scripted_tokenizer(vocabulary)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.dumps(_tokenizer_config(max_positions), indent=2)
    (folder / "tokenizer_config.json").write_text(config, encoding="utf-8")
    if arch == "qwen3_5":
        _save_qwen3_5(folder, tokenizer, max_positions)
        return folder
    (folder / "config.json").write_text(
        json.dumps(_hf_config(tokenizer, max_positions), indent=2), encoding="utf-8"
    )
    save_file(scripted_weights(tokenizer), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
