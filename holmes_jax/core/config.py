"""A run's config: frozen dataclasses loaded strictly from YAML, with ``--set`` overrides.

A run is described by one :class:`Config` holding nine sections (model, data, parallel,
optimizer, diloco, train, checkpoint, logging, distributed), defined in
:mod:`holmes_jax.core.sections` and re-exported here. ``docs/configuration.md`` lists every
key. YAML is loaded strictly. An unknown key, a wrong type or an impossible value raises
:class:`~holmes_jax.core.errors.ConfigError` whose one-line message names the key, the value
and the rule. An unknown key's message suggests the nearest known one. Every number that sizes
a loop or an allocation has an upper bound (:data:`holmes_jax.core.spec.CONFIG_LIMITS`),
checked first. Derived values are properties, never stored twice. Checks that need the device
count (``parallel.devices``, the data-parallel size) run once devices are known, on the
planner's view of the config (:meth:`holmes_jax.core.plan_request.ParallelSpec.degrees`).

Example::

    cfg = load_config("configs/quickstart.yaml", ["train.steps=100", "parallel.tensor=2"])
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from holmes_jax.core.diloco_config import DilocoConfig
from holmes_jax.core.errors import ConfigError
from holmes_jax.core.sections import (
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
)
from holmes_jax.core.spec import CONFIG_LIMITS, check_batch, check_choice
from holmes_jax.core.yamlio import apply_override, build_dataclass, choices, plain, read_yaml

__all__ = [
    "CONFIG_CHOICES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DilocoConfig",
    "DistributedConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "TrainConfig",
    "config_from_dict",
    "load_config",
]


@dataclass(frozen=True)
class Config:
    """A run's whole configuration: one field per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def validate(self) -> None:
        """Checks that need no devices. Raises ConfigError."""
        for key, bound in CONFIG_LIMITS.items():  # first: nothing below sizes anything huge
            value = self.get(key)
            if value is not None:
                bound.check(key, value)
        for key, allowed in CONFIG_CHOICES.items():
            check_choice(self.get(key), key, allowed)
        self.model.validate()
        self.data.validate()
        self.parallel.validate(self.model)
        self.optimizer.validate()
        self.diloco.validate(self.model, self.parallel)
        self.train.validate()
        self.checkpoint.validate()
        self.logging.validate(self.train)
        self.distributed.validate()
        if self.data.source != "tokens" and self.model.vocab_size < 256:
            raise ConfigError(
                f"model.vocab_size={self.model.vocab_size}: the byte tokenizer of "
                f"data.source='{self.data.source}' needs >= 256"
            )
        p = self.parallel
        if p.data:
            check_batch(self.train.global_batch_size, p.replica, p.data, p.microbatches)

    def get(self, key: str) -> Any:
        """The value of a ``section.field`` key."""
        section, name = key.split(".")
        return getattr(getattr(self, section), name)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (lists for tuples), the inverse of :func:`config_from_dict`."""
        return plain(dataclasses.asdict(self))

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)


# --------------------------------------------------------------------------- loading


# The config keys with a fixed set of values (a Literal type), and that set.
CONFIG_CHOICES: dict[str, tuple[Any, ...]] = choices(Config)


def load_config(path: str | os.PathLike | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load a YAML config strictly and apply dotted ``key=value`` overrides.

    Args:
      path: YAML file, or None for the built-in defaults.
      overrides: strings like ``"train.steps=100"`` or ``"parallel.layers_per_stage=[1,3]"``;
        values are parsed as YAML and then type-checked like file values.

    Returns:
      A validated :class:`Config`.

    Raises:
      ConfigError: unreadable file, unknown key, wrong type or impossible value.
    """
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        loaded = read_yaml(path, f"--config '{path}': file")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        raw = loaded
    for item in overrides:
        apply_override(raw, item, Config)
    return config_from_dict(raw, source)


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """Build and validate a Config from nested plain data (YAML or checkpoint metadata)."""
    try:
        cfg = build_dataclass(Config, raw, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    cfg.validate()
    return cfg
