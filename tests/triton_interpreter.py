"""Triton's CPU interpreter, made cheaper for the test suite without changing what a kernel computes.

triton 3.7's interpreter patches `triton.language` (`_patch_lang`: `inspect.getmembers` over the language's
modules) before each kernel launch, and again at every call of a `@triton.jit` helper from inside a kernel,
for each program of the grid. Each patch covers the modules the function's globals name, `triton.language`
and/or `triton.language.core`. Here a launch patches both at once, and the nested calls, which would patch
the same modules the same way, patch nothing. That cut the interpreted Triton tests' time by about a
third (`tests/test_triton_backend.py`'s two-turn workload, profiled on the CI's 2-core CPU). Only the patch
is skipped; launches, grids and the kernels' arithmetic are the interpreter's own.
"""

from __future__ import annotations

from typing import Any

import triton.language as tl  # noqa: F401  (named in the globals `_patch_lang` reads)
from triton.language import core  # noqa: F401  (named in the globals `_patch_lang` reads)


def _both_languages() -> None:
    """A function whose globals name both language modules, `_patch_lang`'s argument at a launch."""


def patch_nested_calls_once() -> bool:
    """Make the interpreter patch `triton.language` once a launch, not again at each nested call; False
    (nothing changed) where triton or the interpreter's internals are not the ones this was written for."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or getattr(original, "swarmkv_once", False):
        return False
    active = [False]  # a launch's patch is in place (launches run one at a time: the patch is global)

    def patch_lang(fn: Any) -> Any:
        if active[0]:
            return scope_type()  # a helper called inside a launch: the launch's patch serves it
        scope = original(_both_languages)
        restore = scope.restore
        active[0] = True

        def restore_once() -> None:
            active[0] = False
            restore()

        scope.restore = restore_once
        return scope

    patch_lang.swarmkv_once = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    return True
