"""Errors of the network core: one base, one subclass per case a caller can act on."""

from loom.errors import InvalidInputError


class NetError(InvalidInputError):
    """A request the network core cannot answer as asked; repeating it unchanged cannot help."""


class UnknownEndpointError(NetError):
    """A query named a region (or link) the network core does not know."""
