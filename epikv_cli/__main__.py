"""``python -m epikv_cli`` runs the CLI."""

from .cli import main

main()
