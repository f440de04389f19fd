"""What a client rebuilds from a tool-call stream, shared by the Hermes and XML parser tests."""

from __future__ import annotations

from swarmkv.api.tool_call_stream import CallPiece


def assemble_calls(pieces: list[CallPiece]) -> list[tuple[str, str, str]]:
    """What a client rebuilds from streamed pieces: (id, name, arguments) per call, in order."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        if piece.name is not None:
            assert piece.index not in calls, "a call opened twice"
            calls[piece.index] = [piece.id, piece.name, ""]
        calls[piece.index][2] += piece.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [(c[0], c[1], c[2]) for _, c in sorted(calls.items())]
