"""The bodies of the ``kvweave`` commands, one module per command: ``kvweave.commands.<name>.cmd_<name>(args)``
runs ``kvweave <name>`` with the parsed arguments and returns its exit status.

The parser and the dispatch (:func:`kvweave.cli.main`, which turns errors into one-line messages) are in
:mod:`kvweave.cli`, which re-exports every ``cmd_<name>``; the argument types and helpers the commands share are
in :mod:`kvweave.cli_args`. Each module imports only the standard library and :mod:`kvweave.cli_args` at import
time, so building the parser stays cheap; torch, transformers and the rest are imported inside the commands.
"""
