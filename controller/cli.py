"""The ``drpo`` command. Subcommands grow with the system; today: ``demo`` and ``objectives``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from objectives.demo import format_table, weight_table

    print("Gradient weight w on r*A*grad log pi for one sampled token, measured by autograd through each")
    print("objective (1 = plain importance-weighted PG; 0 = clipped or masked). DRPO: w = 1 - sign(A(r-1))|pi-mu|/delta,")
    print("below 1 when the update diverges, negative (corrective) past |pi-mu| = delta, bounded however small mu is.\n")
    for advantage in (1.0, -1.0):
        print(f"A = {advantage:+g}")
        print(format_table(weight_table(advantage)))
        print()
    return 0


def _objectives(args: argparse.Namespace) -> int:
    import objectives
    from objectives.base import registry

    for name in objectives.available():
        cfg = registry()[name].config_cls
        fields = ", ".join(f"{k}={v.default}" for k, v in cfg.model_fields.items() if k != "type")
        doc = (cfg.__doc__ or "").strip().splitlines()[0]
        print(f"{name:16s} {fields:40s} {doc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="drpo", description="Distributed RL post-training with DRPO on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="print DRPO/DPPO/SPO/PPO gradient weights across mu and pi").set_defaults(fn=_demo)
    sub.add_parser("objectives", help="list registered objectives and their defaults").set_defaults(fn=_objectives)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
