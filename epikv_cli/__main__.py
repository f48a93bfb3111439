"""``python -m epikv_cli`` runs the CLI."""

from epikv_cli.cli.entry import main

main()
