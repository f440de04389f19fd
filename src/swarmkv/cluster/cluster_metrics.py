"""The ingress's /metrics: each replica's Prometheus text with a `replica` label, plus the router's counters."""

from __future__ import annotations

import re
from collections.abc import Mapping

ROUTE_DECISIONS = "swarmkv_route_decisions_total"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")


def label_replica(text: str, replica: str) -> list[str]:
    """The sample lines of one replica's exposition, each with `replica="..."` added."""
    label = f'replica="{_escape(replica)}"'
    lines = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if line.startswith("#") or match is None:
            continue
        name, labels, rest = match.groups()
        inner = labels[1:-1] if labels else ""
        lines.append(f"{name}{{{label}{',' + inner if inner else ''}}}{rest}")
    return lines


def merge(replicas: Mapping[str, str], decisions: Mapping[tuple[str, str], int]) -> str:
    """One exposition: each metric's HELP and TYPE once, then its samples from every replica, then the
    route decisions counter."""
    headers: dict[str, dict[str, None]] = {}  # family -> its "# HELP" and "# TYPE" lines, once
    samples: dict[str, list[str]] = {}
    for replica, text in sorted(replicas.items()):
        family = ""
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split()[2]
                headers.setdefault(family, {})[line] = None
            elif line.strip() and not line.startswith("#"):
                samples.setdefault(family, []).extend(label_replica(line, replica))
    out: list[str] = []
    for family in dict.fromkeys([*headers, *samples]):
        out += list(headers.get(family, {}))
        out += samples.get(family, [])
    out += [
        f"# HELP {ROUTE_DECISIONS} Requests the cluster's router placed, by policy and reason.",
        f"# TYPE {ROUTE_DECISIONS} counter",
    ]
    for (policy, reason), count in sorted(decisions.items()):
        out.append(
            f'{ROUTE_DECISIONS}{{policy="{_escape(policy)}",reason="{_escape(reason)}"}} {float(count)}'
        )
    return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
