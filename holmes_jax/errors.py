"""The one error type for bad user input (config, topology, data paths).

Entry points catch :class:`ConfigError`, print its one-line message and exit with code 2;
library callers (notebooks) get an ordinary ``ValueError`` subclass. Messages name the key,
the value and the rule, e.g. ``model.num_heads=5: must divide model.hidden_size=128``.
"""


class ConfigError(ValueError):
    """A user-supplied setting is unknown, mistyped or impossible."""
