"""``gefen inspect PATH``: describe a native, portable or DCP checkpoint and verify its digests."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .errors import UsageError

__all__ = ["UNKNOWN_FORMAT_EXIT", "register"]

#: Exit status of ``gefen inspect`` for a format it does not know (0: OK, 1: CORRUPT).
UNKNOWN_FORMAT_EXIT = 3


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "inspect",
        help="describe a native, portable or DCP checkpoint and verify it (exit 1 corrupt, 3 unknown format)",
        description=(
            "Describe the checkpoint at PATH: its kind, format and version, the implementation that wrote it, its "
            "parameters (shape, state variant, bytes) and key facts; then verify it: DCP folders (gefen-dcp "
            "GefenDCPState and portable states) are loaded through gefen-dcp's own loaders, which check every chunk's "
            "SHA-256 and every catalog digest; portable documents are checked against their completion digest; "
            "native state dicts (Gefen, GefenMuon, composite, torch) and canonical local state, which carry no "
            "digest, are checked structurally; a dict holding one under a key and a folder of torch.save files "
            "(optimizer.pt) are read too. Every problem names where it is. Exits 0 when nothing is wrong (OK), 1 "
            "when something is (CORRUPT), 3 when gefen does not know the format and verified nothing (UNKNOWN "
            "FORMAT: what was recognised is printed). Files are read with torch.load(weights_only=True)."
        ),
    )
    parser.add_argument("path", metavar="PATH", help="a torch.save file or a DCP checkpoint folder")
    parser.add_argument("--no-verify", action="store_true", help="describe DCP folders from their records only")
    parser.add_argument("--json", action="store_true", help="print the description as JSON")
    parser.add_argument(
        "--max-parameters", type=_count, default=40, help="parameters listed in the table (default %(default)s)"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..inspect import inspect_checkpoint

    try:
        description = inspect_checkpoint(args.path, verify=not args.no_verify)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(description.to_json(), indent=2))
    else:
        print(description.format_text(max_parameters=args.max_parameters))
        if args.no_verify and description.status == "OK":
            print("  (--no-verify: DCP data was not read; its digests were not checked)")
    return {"OK": 0, "CORRUPT": 1}.get(description.status, UNKNOWN_FORMAT_EXIT)
