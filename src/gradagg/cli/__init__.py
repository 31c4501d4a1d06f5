"""The ``gradagg`` command line: parse, read, apply the contract, write; nothing else.

* :mod:`gradagg.cli.parser`: the options and ``--help`` of every subcommand;
* :mod:`gradagg.cli.commands`: ``verify``, and ``owner-sum`` and ``mean`` handed to
  :mod:`gradagg.rows.commands` (read, apply, write) where the ``rows`` extra is installed
  (without it: one line naming the install, exit 2); ``demo`` and ``parity`` are their own
  packages, imported only when named;
* :mod:`gradagg.cli.signals`: SIGTERM and SIGHUP as exceptions, and the exit status of every ending.

Exit status: 0 success, 1 a check failed (``verify``, ``demo``, ``parity``), 2 usage
or input error, reported as one line ``gradagg: error: ...`` on stderr naming the file
or stream, never a traceback; 130 interrupted (Ctrl-C), 143 terminated (SIGTERM), 129
hung up (SIGHUP): an interrupted run leaves ``-o``'s file as it was and no temporary file.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradagg.cli import signals
from gradagg.cli.parser import build_parser, parse

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    Called as the program (``argv`` None: the ``gradagg`` script, ``python -m
    gradagg``), SIGTERM and SIGHUP become exceptions, so that an output being
    written is cleaned up as on Ctrl-C. Called with an ``argv`` list, nothing
    global changes. With no arguments at all, the list of commands is printed
    on stderr and the status is 2 (a script that lost its arguments fails).
    """
    args = parse(argv)
    if argv is None:
        signals.raise_on_termination()
    return signals.run(args.handler, args)
