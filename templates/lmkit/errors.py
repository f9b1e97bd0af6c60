"""The template's own errors: it runs on TPU workers without tpuctl, so tpuctl's CLI maps these to BadInput."""

from __future__ import annotations


class TemplateError(Exception):
    """Base of the errors the BERT template raises for bad configs or data; one line, names the culprit."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class ConfigError(TemplateError, ValueError):
    """The config file is missing, malformed or breaks a rule. `field` is the dotted key at fault inside the
    config ("trainer.max_steps"; "" for the whole file) and `rule` what is wrong with it, so a host that checks
    a config before shipping it can name the field in its own terms."""

    def __init__(self, field: str, rule: str):
        super().__init__(f"config.{field}: {rule}" if field else f"config: {rule}")
        self.field = field
        self.rule = rule


class DataError(TemplateError, ValueError):
    """A corpus file or prepared data set is unusable; `path` names the file at fault."""


class AcceleratorError(TemplateError, RuntimeError):
    """The requested accelerator could not be found or initialised."""
