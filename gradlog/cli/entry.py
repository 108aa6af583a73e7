"""Command line: `gradlog demo`, `gradlog report` and `gradlog diff`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gradlog.cli.planted import planted_summary


class _Rule(argparse.Action):
    """--fail-on/--warn/--note/--ignore KIND[:PATTERN]: collected in command-line order (the last match wins)."""

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: object, opt: object = None
    ) -> None:
        rules = list(getattr(ns, "rules", None) or [])
        rules.append((str(value), str(self.const)))
        ns.rules = rules


def _policy_flags(p: argparse.ArgumentParser) -> None:
    """The linter-style severity flags `gradlog report` and `gradlog diff` share (docs/verdict.md lists the kinds)."""
    g = p.add_argument_group(
        "policy",
        "change how much a kind of finding matters, optionally only for tensors matching a glob; later flags win, "
        "and all of them override the policy the run recorded. KIND: e.g. not_in_batch, partly.zero_grad, "
        "update_ratio_high, 'partly.*', '*' (docs/verdict.md lists them)",
    )
    for flag, severity, what in (
        ("--fail-on", "problem", "make it a problem (exit 1)"),
        ("--warn", "warning", "make it a warning"),
        ("--note", "note", "make it a note"),
        ("--ignore", "ignore", "leave it out of the verdict (still in the tables)"),
    ):
        g.add_argument(flag, action=_Rule, const=severity, dest="rules", metavar="KIND[:PATTERN]", help=what)
    p.set_defaults(rules=[])


def _demo(args: argparse.Namespace) -> int:
    from gradlog.cli.demo import run

    report = run(steps=args.steps, every=args.every, writer=args.writer, log_dir=args.log_dir, seed=args.seed)
    del report  # the demo succeeded; finding the planted bugs is its point
    return 0


def _report(args: argparse.Namespace) -> int:
    from gradlog.cli.report import run_report
    from gradlog.runformat.files import Limits

    limits = Limits(max_file_bytes=args.max_file_size, max_table_bytes=args.max_table_size, max_files=args.max_files)
    return run_report(
        args.path, as_json=args.json, plot=args.plot, band=args.band, spike=args.spike, limits=limits, rules=args.rules
    )


def _size(text: str) -> int:
    from gradlog.runformat.files import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def _diff(args: argparse.Namespace) -> int:
    from gradlog.cli.diff import run_diff

    return run_diff(
        args.checkpoints,
        as_json=args.json,
        plot_to=args.plot,
        include=args.include,
        exclude=args.exclude,
        progress=False if args.no_progress else None,
        rules=args.rules,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradlog", description="Which PyTorch weights are learning, and which never did."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    about = f"train a small model with {planted_summary()} and print what gradlog finds"
    demo = sub.add_parser("demo", help=about, description=about[0].upper() + about[1:] + ".")
    demo.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    demo.add_argument("--every", type=int, default=10, help="measure every k optimizer steps (default 10)")
    demo.add_argument("--writer", default="tensorboard", help="writer name: tensorboard (default) or memory")
    demo.add_argument("--log-dir", default=None, help="run folder for tensorboard (default runs/<timestamp>-<host>)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    report = sub.add_parser(
        "report",
        help="read a run back (TensorBoard log dir or event file, W&B offline run dir) and print its health",
        description="Exit status: 0 healthy, 1 problems found, 2 bad input.",
    )
    report.add_argument("path", help="TensorBoard log dir or event file, or W&B offline run dir")
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    report.add_argument("--plot", metavar="OUT.png", default=None, help="also draw the run (needs gradlog[plot])")
    report.add_argument(
        "--band",
        nargs=2,
        type=float,
        metavar=("LO", "HI"),
        default=None,
        help="judge update ratios against this fixed band (e.g. 1e-4 1e-2), not the run's own tensors",
    )
    report.add_argument("--spike", type=float, metavar="FACTOR", default=None, help="spike: >= x median, last (10)")
    report.add_argument(
        "--max-file-size", type=_size, metavar="SIZE", default="4G", help="largest event or W&B run file read (4G)"
    )
    report.add_argument(
        "--max-table-size", type=_size, metavar="SIZE", default="64M", help="largest W&B table file read (64M)"
    )
    report.add_argument(
        "--max-files", type=_count, metavar="N", default=20_000, help="most event/W&B run files searched (20000)"
    )
    _policy_flags(report)
    report.set_defaults(func=_report)
    diff = sub.add_parser(
        "diff",
        help="compare checkpoints of one model (torch.save, .safetensors, Hugging Face folders) for weights that "
        "never changed",
        description="Exit status: 0 every tensor changed, 1 findings, 2 bad input (unreadable file, different models).",
    )
    diff.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT", help="two or more, in training order")
    diff.add_argument("--json", action="store_true", help="print the findings as JSON")
    diff.add_argument("--plot", metavar="OUT.png", default=None, help="draw relative change per tensor and interval")
    diff.add_argument("--include", action="append", metavar="GLOB", help="compare only tensors matching (repeatable)")
    diff.add_argument("--exclude", action="append", metavar="GLOB", help="skip tensors matching (repeatable)")
    diff.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    _policy_flags(diff)
    diff.set_defaults(func=_diff)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
