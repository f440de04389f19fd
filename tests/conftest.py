"""Fixtures shared across test modules."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported, and importing transformers' Qwen3.5 model imports it;
# those test modules are collected before the kernel tests, so the CPU interpreter is chosen here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # transformers' Qwen3.5 takes fla's kernels whenever fla imports, and fla's autotuned kernels cannot run
    # under the interpreter (no driver to time them): hidden here, transformers runs its torch reference.
    sys.modules.setdefault("fla", None)
    # SWARMKV_PLAIN_INTERPRETER=1 leaves the interpreter as triton ships it (to time the difference).
    if os.environ["TRITON_INTERPRET"] == "1" and not os.environ.get("SWARMKV_PLAIN_INTERPRETER"):
        from triton_interpreter import patch_nested_calls_once

        patch_nested_calls_once()

# Huge pages off for the suite (tests/test_huge_pages.py turns them back on): under the memory churn of hundreds
# of engines, each pool's first touch stalled in the kernel's compaction (kernels/huge_pages.py). Subprocesses
# inherit it.
os.environ.setdefault("SWARMKV_HUGE_PAGES", "off")

# glibc's malloc serves a block over its mmap threshold (at most 32 MiB) with a fresh mapping and unmaps it at
# free, so every step's large tensors (a prefill's activations and logits, a KV pool, a loaded model) fault
# their pages in, zeroed by the kernel, each time. From the heap instead (no mmap, no trimming of its top), freed
# pages are reused as they are. The process's own malloc is set up before this runs, so it reaches the xdist
# workers, started after conftest is read, and every subprocess; the memory a process holds is its peak.
os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736")

# Under pytest-xdist each worker gets its share of the cores, so workers do not oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from conftest_tokenizer_helpers import qwen_tokenizer, smol_tokenizer
from swarmkv.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    """Our tokenizer for the default SmolLM2 GGUF."""
    return smol_tokenizer()


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    """Our tokenizer for the Qwen3 HF files."""
    return qwen_tokenizer()


# The scripted checkpoint (tests/scripted_model.py): a tiny model whose greedy reply is a known tool call.
from pathlib import Path  # noqa: E402

from scripted_model import make_scripted_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def scripted_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scripted checkpoint's folder, built once per session (per xdist worker)."""
    return make_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "scripted")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's tiny tensors on one thread: a second one only adds synchronisation, and on a shared
    CPU its spinning slows every step several-fold (`pytestmark = pytest.mark.usefixtures(...)`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
