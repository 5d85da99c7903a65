"""`python -m trainwatch`: the same as the `trainwatch` command."""

from trainwatch.cli import entry

entry()
