"""``python -m vescale_plugins.bench`` (``vescale-bench``): veScale-FSDP and FSDP2 side by side.

Without a subcommand: both engines train the Llama-style decoder on this machine (``make
bench``; every GPU under CUDA, else 2 gloo ranks) and it prints a table, writes JSON and a
PNG plot. The subcommands compare other things side by side; ``SUBCOMMAND --help`` for theirs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vescale_plugins.bench import adam8bit, compare, gloo_collectives, host, init_memory, muon, scale, step

SUBCOMMANDS = {
    "step": step,
    "collectives": gloo_collectives,
    "adam8bit": adam8bit,
    "muon": muon,
    "init-memory": init_memory,
    "scale": scale,
    "host": host,
}
SUMMARIES = {
    "step": "the same comparison on a stack of Linear layers",
    "collectives": "gloo's all-gather / reduce-scatter against the in-place ones DBuffer uses",
    "adam8bit": "8-bit and flat AdamW against FSDP2 with torchao's and torch's",
    "muon": "distributed Muon against FSDP2's full_tensor() workaround",
    "init-memory": "peak memory of meta-device initialisation",
    "scale": "host work, set-up and padding at 1,024 to 16,384 ranks on torch's fake process group",
    "host": "host work per step and phase against FSDP2 and the unsharded model (W=1, 2, fake W)",
}


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The default comparison's parser (which takes the subcommands too), and each subcommand's."""
    parser = argparse.ArgumentParser(
        prog="python -m vescale_plugins.bench",
        usage="%(prog)s [SUBCOMMAND] [options]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_arguments(parser)
    subcommands = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", title="subcommands")
    for name, module in SUBCOMMANDS.items():
        sub = subcommands.add_parser(
            name, help=SUMMARIES[name], description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(sub)
    return parser, subcommands.choices


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The arguments; ``command`` names the subcommand (``None``: the default comparison)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subparsers = _parsers()
    args = parser.parse_args(argv)
    if args.command is None:
        return args
    if argv[0] != args.command:
        parser.error(
            f"options before {args.command!r} are the default comparison's: put {args.command}'s options after it"
        )
    # Parsed again on its own, so that the default comparison's options do not show up in it.
    return subparsers[args.command].parse_args(argv[1:], argparse.Namespace(command=args.command))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return (SUBCOMMANDS[args.command] if args.command else compare).run(args)


if __name__ == "__main__":
    sys.exit(main())
