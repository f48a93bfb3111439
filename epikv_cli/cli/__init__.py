"""The ``epikv`` command: the only layer that imports typer or rich, and the only one that prints."""
