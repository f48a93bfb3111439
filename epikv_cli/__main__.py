"""``python -m epikv_cli`` runs the CLI."""

from .entry import main

main()
