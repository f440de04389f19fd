"""`swarmkv generate`: answers on the default model, JSON and raw modes, and one-line errors for bad models."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest

from swarmkv.cli import main
from swarmkv.models.default import default_model_path
from swarmkv.tokenizer import Tokenizer
from tiny_models import edit_config, make_tiny_checkpoint

QUESTION = "What is the capital of France?"
ERROR_PREFIX = "swarmkv generate: error: "


def run_generate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run `swarmkv generate ARGS` in-process; return (exit code, stdout, stderr)."""
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def run_tiny(capsys: pytest.CaptureFixture[str], tiny: Path, *args: str) -> tuple[int, str, str]:
    """`run_generate` on the tiny model, with a pool of a few pages: the default 1 GiB took a second or more
    to zero a run."""
    return run_generate(capsys, "--model", str(tiny), "--kv-cache-memory", "16MiB", *args)


def assert_one_line_error(code: int, out: str, err: str, expected: str) -> None:
    """Exit code 2, nothing on stdout, and exactly one line on stderr that contains `expected`."""
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(ERROR_PREFIX), err
    assert "Traceback" not in err
    assert expected in err, err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 checkpoint with the real Qwen3 tokenizer and chat template."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "qwen3", "qwen3")


# ---- answers --------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.e2e
@pytest.mark.slow
def test_default_model_answers_paris_end_to_end() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "swarmkv.cli", "generate", "--prompt", QUESTION, "--max-tokens", "24"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_json_output_on_a_chat_prompt(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    code, out, err = run_tiny(capsys, tiny, "--prompt", "Hello there", "--max-tokens", "5", "--json")

    assert code == 0, err
    record = json.loads(out)
    assert set(record) >= {"text", "token_ids", "prompt_token_ids", "finish_reason"}
    assert 1 <= len(record["token_ids"]) <= 5
    assert record["text"] == Tokenizer.from_hf_dir(tiny).decode(record["token_ids"])
    reference = AutoTokenizer.from_pretrained(str(tiny))
    expected = reference.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=False
    )
    assert record["prompt_token_ids"] == reference.encode(expected, add_special_tokens=False)


def test_raw_prompt_skips_the_chat_template(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_tiny(capsys, tiny, "--prompt", "Hello there", "--max-tokens", "3", "--raw", "--json")

    assert code == 0, err
    record = json.loads(out)
    assert record["prompt_token_ids"] == Tokenizer.from_hf_dir(tiny).encode("Hello there")
    code, out, err = run_tiny(capsys, tiny, "--prompt", "Hello", "--max-tokens", "3", "--raw")
    assert code == 0, err
    assert out.endswith("\n") and not out.lstrip().startswith("{")


# ---- one-line errors ------------------------------------------------------------------------------


def truncated_default(num_bytes: int) -> Callable[[Path], Path]:
    """A writer of the default GGUF's first `num_bytes` bytes, as an interrupted download leaves it."""

    def write(folder: Path) -> Path:
        with default_model_path().open("rb") as source:
            data = source.read(num_bytes)
        path = folder / "truncated.gguf"
        path.write_bytes(data)
        return path

    return write


def write_bytes(name: str, data: bytes) -> Callable[[Path], Path]:
    """A writer of a file holding `data`."""

    def write(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(data)
        return path

    return write


def gpt2_gguf(folder: Path) -> Path:
    path = folder / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 1024,
}


def config_only(*, without: str | None = None) -> Callable[[Path], Path]:
    """A writer of a folder holding only config.json: LLAMA_CONFIG, less the field `without`."""

    def write(folder: Path) -> Path:
        raw = {key: value for key, value in LLAMA_CONFIG.items() if key != without}
        (folder / "config.json").write_text(json.dumps(raw))
        return folder

    return write


BAD_MODELS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "missing-path": (lambda folder: folder / "no-such-model", "model path does not exist"),
    "empty-directory": (lambda folder: folder, "no model in"),
    "config-without-weights": (config_only(), "no weights in"),
    "config-lacking-a-field": (config_only(without="hidden_size"), "lacks required field 'hidden_size'"),
    "gguf-cut-in-header": (truncated_default(100_000), "damaged or truncated GGUF"),
    "gguf-cut-in-tensors": (truncated_default(60_000_000), "damaged or truncated GGUF"),
    "garbage-bytes": (write_bytes("garbage.gguf", bytes(range(256)) * 8), "is not a GGUF file"),
    "empty-file": (write_bytes("empty.gguf", b""), "is not a GGUF file"),
    "gguf-magic-then-garbage": (write_bytes("bad.gguf", b"GGUF\x03\x00\x00\x00" + b"\xff" * 64), "damaged"),
    "gpt2-gguf": (gpt2_gguf, "unsupported GGUF architecture 'gpt2'"),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_bad_model_path_is_one_line_error(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write, expected = BAD_MODELS[case]
    model = write(tmp_path)

    assert_one_line_error(*run_generate(capsys, "--model", str(model), "--prompt", "hi"), expected)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture"),
        ({"layer_types": ["full_attention", "linear_attention"]}, "linear_attention"),
    ],
    ids=["gpt2-architecture", "linear-attention"],
)
def test_unsupported_checkpoint_is_one_line_error(
    changes: dict[str, Any], expected: str, tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    for file in tiny.iterdir():
        if file.name == "config.json":
            (folder / file.name).write_text(file.read_text())
        else:
            (folder / file.name).symlink_to(file)
    edit_config(folder, **changes)

    assert_one_line_error(*run_generate(capsys, "--model", str(folder), "--prompt", "hi"), expected)


@pytest.mark.e2e
def test_error_from_the_console_entry_point_has_no_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    result = subprocess.run(
        [sys.executable, "-m", "swarmkv.cli", "generate", "--model", str(missing), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(result.returncode, result.stdout, result.stderr, str(missing))
