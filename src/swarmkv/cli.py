"""The `swarmkv` command: one subcommand per tool, user errors as one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from swarmkv.errors import SwarmkvError

Register = Callable[[argparse._SubParsersAction], None]


def _registrars() -> list[Register]:
    from swarmkv.cluster.cli import register as serve  # the server's command with the cluster's flags
    from swarmkv.generate_cli import register as generate
    from swarmkv.lint.cli import register as lint
    from swarmkv.plan.cli import register as plan
    from swarmkv.swarm.cli import register as swarm

    return [generate, swarm, plan, serve, lint]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, every subcommand included."""
    parser = argparse.ArgumentParser(prog="swarmkv", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for register in _registrars():
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `swarmkv` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (SwarmkvError, ValueError, OSError) as exc:
        print(f"swarmkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
