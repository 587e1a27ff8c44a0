"""The ``pdserve`` command: :mod:`cli.main` is the parser and entry point, one module per
subcommand beside it. Nothing else in the repository imports this package."""
