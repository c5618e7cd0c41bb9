"""A registry that builds topologies by name; :class:`TopologyReg` is decent-dp's spelling of it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import ClassVar, TypeVar

from decent_optim_wrapper.topo.base import Topology

__all__ = ["TopologyFactory", "TopologyReg"]

T = TypeVar("T", bound=type[Topology])


class TopologyFactory:
    """Registry of topology classes by name.

    Built-ins are registered when :mod:`decent_optim_wrapper.topo` is imported. Register your own
    with :meth:`add_topology` (or the :meth:`register` decorator) and pass its name as ``topology``.
    """

    _registry: ClassVar[dict[str, type[Topology]]] = {}
    #: The registered classes by name, a live and read-only view of the registry.
    registered: ClassVar[Mapping[str, type[Topology]]] = MappingProxyType(_registry)

    @classmethod
    def add_topology(cls, name: str, topology_cls: type[Topology]) -> None:
        """Register ``topology_cls`` under ``name``; registering a name again replaces the class.

        Instances then report ``name`` as :attr:`Topology.name`, as :meth:`name_of` does (the first of
        its names for a class registered under several).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"Topology name must be a non-empty string, got {name!r}.")
        if not (isinstance(topology_cls, type) and issubclass(topology_cls, Topology)):
            raise TypeError(
                f"TopologyFactory.add_topology({name!r}, ...) needs a subclass of Topology, got "
                f"{topology_cls!r}."
            )
        replaced = cls._registry.get(name)
        cls._registry[name] = topology_cls
        # Topology.name reads the name from the class; refresh it on both classes this call can change.
        for changed in (replaced, topology_cls):
            if changed is not None:
                changed._registered_name = cls._first_name(changed)

    @classmethod
    def register(cls, name: str) -> Callable[[T], T]:
        """Class decorator form of :meth:`add_topology`."""

        def decorate(topology_cls: T) -> T:
            cls.add_topology(name, topology_cls)
            return topology_cls

        return decorate

    @classmethod
    def names(cls) -> list[str]:
        """The registered names, sorted."""
        return sorted(cls._registry)

    @classmethod
    def get(cls, name: str) -> type[Topology]:
        """The class registered under ``name``."""
        try:
            return cls._registry[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"Unknown topology {name!r}. Registered topologies: {', '.join(cls.names())}. "
                "Register your own with TopologyFactory.add_topology(name, cls)."
            ) from None

    @classmethod
    def create(cls, name: str, world_size: int, local_world_size: int = 1) -> Topology:
        """Build the topology registered under ``name`` for ``world_size`` ranks."""
        return cls.get(name)(world_size, local_world_size)

    @classmethod
    def name_of(cls, topology_cls: type[Topology]) -> str:
        """The name ``topology_cls`` is registered under, else its class name."""
        return cls._first_name(topology_cls) or topology_cls.__name__

    @classmethod
    def _first_name(cls, topology_cls: type[Topology]) -> str | None:
        """The first name in registry order that maps to ``topology_cls`` itself, else ``None``."""
        for name, registered in cls._registry.items():
            if registered is topology_cls:
                return name
        return None


class TopologyReg:
    """decent-dp's registry API over the same registry as :class:`TopologyFactory`.

    A class registered with ``@TopologyReg.register("name")`` is found by ``TopologyFactory.create``
    and by ``topology="name"`` in the front-ends, and :attr:`registry` lists the classes registered
    through :class:`TopologyFactory` (built-ins included)::

        @TopologyReg.register("custom-topology")
        class CustomTopology(Topology):
            def _get_topo_edges(self) -> list[list[Edge]]: ...

        TopologyReg.registry["custom-topology"] is TopologyFactory.get("custom-topology")  # True
    """

    #: Name -> class, a live, read-only view of ``TopologyFactory``'s registry. Register through
    #: :meth:`register` (or ``TopologyFactory.add_topology``), which also keeps :attr:`Topology.name` right.
    registry: ClassVar[Mapping[str, type[Topology]]] = TopologyFactory.registered

    @staticmethod
    def register(name: str) -> Callable[[T], T]:
        """Class decorator: register the class under ``name``, as :meth:`TopologyFactory.register` does."""
        return TopologyFactory.register(name)
