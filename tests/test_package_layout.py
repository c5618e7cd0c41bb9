"""The package's import graph: dependencies run one way, between the package's layers and between the
engine's sub-packages, with no circle and no import of another room's private names.

Read from the source (every ``import``/``from ... import``, also those inside functions), so the test
holds for imports made lazily too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

PACKAGE = Path(__file__).resolve().parent.parent / "decent_optim_wrapper"
NAME = "decent_optim_wrapper"

# The engine's rooms in layer order: a room imports only from rooms of a lower layer (or itself).
ENGINE_LAYERS = {
    "engine.errors": 0,
    "engine.wire": 1,
    "engine.fleet": 1,
    "engine.exchange": 2,
    "engine.rules": 3,
    "engine.state": 4,
    # coordination at the engine's top: options, layout, survival, recovery, checkpointing, engine
    "engine": 5,
}

# The package's layers: topologies <- engine <- front-ends <- the rest. optim depends on torch and checks.
PACKAGE_LAYERS = {
    "checks": -1,  # what a number argument must be: used by every layer
    "topo": 0,
    "optim": 0,
    "engine": 1,
    # the front doors, in their own folder: shared parts, then each front-end
    "front_ends.base": 2,  # what both report of their engine
    "front_ends.inner_step": 2,  # the front-ends' shared step machinery
    "front_ends.optimizer": 3,
    "front_ends.data_parallel_backward": 3,  # the module front-end's helpers, below the class
    "front_ends.data_parallel_state": 4,
    "front_ends.data_parallel": 5,
    "front_ends": 6,  # the folder's face, re-exporting both front-ends
    "wrapper": 7,  # the public paths of the two front-ends (the seed README's contract)
    "data_parallel": 7,
    "monitor": 7,  # reads the members' status records from the store
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([NAME, *parts])] = path
    return found


def _imports(path: Path, module: str) -> list[tuple[str, list[str]]]:
    """(imported module, names imported from it) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            found.append((base, [alias.name for alias in node.names]))
    return found


def _resolve(target: str, names: list[str], modules: dict[str, Path]) -> list[str]:
    """The package's modules an import reaches: ``from pkg import mod`` reaches ``pkg.mod``."""
    if not target.startswith(NAME):
        return []
    reached = [target] if target in modules else []
    reached += [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
    return reached


def _room(module: str, layers: dict[str, int], prefix: str) -> str | None:
    """The longest key of ``layers`` that ``module`` (relative to ``prefix``) lies in."""
    if not module.startswith(prefix):
        return None
    rest = module[len(prefix) :].lstrip(".")
    best = None
    for room in layers:
        if (rest == room or rest.startswith(room + ".")) and (best is None or len(room) > len(best)):
            best = room
    return best


def _edges() -> list[tuple[str, str, list[str]]]:
    modules = _modules()
    edges = []
    for module, path in modules.items():
        for target, names in _imports(path, module):
            for reached in _resolve(target, names, modules):
                if reached != module:
                    edges.append((module, reached, names))
    return edges


def test_the_engines_rooms_import_only_from_lower_layers():
    wrong = []
    for source, target, _ in _edges():
        a = _room(source, ENGINE_LAYERS, NAME)
        b = _room(target, ENGINE_LAYERS, NAME)
        if a is None or b is None or a == b:
            continue
        if ENGINE_LAYERS[b] >= ENGINE_LAYERS[a]:
            wrong.append(f"{source} imports {target} ({a} may not import {b})")
    assert not wrong, "\n".join(wrong)


def test_the_packages_layers_run_one_way():
    wrong = []
    for source, target, _ in _edges():
        a = _room(source, PACKAGE_LAYERS, NAME)
        b = _room(target, PACKAGE_LAYERS, NAME)
        if a is None or b is None or a == b:
            continue
        if PACKAGE_LAYERS[b] >= PACKAGE_LAYERS[a]:
            wrong.append(f"{source} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_circles_between_modules():
    graph: dict[str, set[str]] = {}
    for source, target, _ in _edges():
        if target.startswith(source + "."):  # a package importing its own modules (re-exports)
            continue
        graph.setdefault(source, set()).add(target)
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_no_room_imports_another_rooms_private_names():
    wrong = []
    for source, target, names in _edges():
        a = _room(source, ENGINE_LAYERS, NAME) or source
        b = _room(target, ENGINE_LAYERS, NAME) or target
        if a == b:
            continue
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private:
            wrong.append(f"{source} imports {private} from {target}")
    assert not wrong, "\n".join(wrong)


def _classes() -> list[tuple[Path, ast.ClassDef]]:
    return [
        (path, node)
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    ]


# Classes whose annotations without a value are their fields, not another class's state.
_DECLARATIVE = ("dataclass", "NamedTuple", "TypedDict", "Protocol")


def _declarative(node: ast.ClassDef, known: set[str] = frozenset()) -> bool:  # type: ignore[assignment]
    """Fields (a dataclass, a typed dict, a protocol, or a class made of those: ``known``), an
    exception, or an interface whose methods raise ``NotImplementedError`` for its subclasses."""
    marks = [ast.unparse(d) for d in node.decorator_list] + [ast.unparse(b) for b in node.bases]
    if node.bases and all(ast.unparse(b) in known for b in node.bases):
        return True
    interface = any(
        isinstance(stmt, ast.FunctionDef) and "raise NotImplementedError" in ast.unparse(stmt)
        for stmt in node.body
    )
    return interface or any(kind in mark for mark in marks for kind in (*_DECLARATIVE, "Error"))


def _assigned_on_self(node: ast.ClassDef) -> set[str]:
    return {
        target.attr
        for sub in ast.walk(node)
        for target in (sub.targets if isinstance(sub, ast.Assign) else [getattr(sub, "target", None)])
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    }


def test_the_engine_holds_its_parts_without_mixins():
    # A mixin declares state that another class sets: an annotation without a value that the class
    # never assigns itself. The engine holds its parts instead and passes each what it needs.
    wrong = []
    classes = _classes()
    known = {node.name for _, node in classes if _declarative(node)}
    for path, node in classes:
        if "engine" not in path.relative_to(PACKAGE).parts:
            continue
        if node.name == "GossipEngine" and node.bases:
            wrong.append(f"GossipEngine inherits from {[ast.unparse(b) for b in node.bases]}")
        if _declarative(node, known):
            continue
        if len(node.bases) > 1:
            wrong.append(f"{path.name}: {node.name} has several bases")
        declared = {
            stmt.target.id
            for stmt in node.body
            if isinstance(stmt, ast.AnnAssign) and stmt.value is None and isinstance(stmt.target, ast.Name)
        }
        borrowed = declared - _assigned_on_self(node)
        if borrowed:
            wrong.append(f"{path.name}: {node.name} declares {sorted(borrowed)} that another class sets")
    assert not wrong, "\n".join(wrong)


def test_no_private_attribute_is_read_outside_its_class():
    # x._name is read only on self/cls/super(), or inside the class that defines _name (another
    # instance of the same class); the package's own names, not torch's (nor os._exit, the standard
    # library's way out of a process whose threads cannot be joined).
    wrong = []
    for path, cls in _classes() + [(p, None) for p in sorted(PACKAGE.rglob("*.py"))]:  # type: ignore[list-item]
        tree = cls if cls is not None else ast.parse(path.read_text())
        own = (
            set()
            if cls is None
            else _assigned_on_self(cls)
            | {
                getattr(stmt, "name", None) or ast.unparse(getattr(stmt, "target", stmt))
                for stmt in cls.body
                if isinstance(stmt, ast.FunctionDef | ast.AnnAssign | ast.Assign)
            }
        )
        nested = {
            id(n)
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef) and c is not tree
            for n in ast.walk(c)
        }
        for node in ast.walk(tree):
            if (
                id(node) in nested
                or not isinstance(node, ast.Attribute)
                or not isinstance(node.ctx, ast.Load)
            ):
                continue
            name, owner = node.attr, node.value
            if not name.startswith("_") or name.startswith("__"):
                continue
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls", "torch", "os"):
                continue
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue
            if ast.unparse(owner).startswith(("torch.", "dist.")) or name in own:
                continue
            wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "\n".join(sorted(set(wrong)))


# What lies outside the engine and reaches it as a user would: the front-ends and the integrations.
FRONT_DOORS = ("wrapper", "data_parallel", "metrics")


def test_front_doors_reach_the_engine_only_through_its_public_face():
    wrong = []
    for source, target, _ in _edges():
        rest = source[len(NAME) + 1 :]
        if rest not in FRONT_DOORS and not rest.startswith(("front_ends", "integrations", "monitor")):
            continue
        if target.startswith(f"{NAME}.engine."):
            wrong.append(f"{source} imports {target} (import it from {NAME}.engine)")
    assert not wrong, "\n".join(wrong)


def test_the_public_paths_of_the_front_ends_are_kept():
    """The seed README's import path, and the module front-end's, name the classes in ``front_ends/``."""
    import decent_optim_wrapper
    from decent_optim_wrapper.data_parallel import DecentralizedDataParallel
    from decent_optim_wrapper.front_ends import data_parallel, optimizer
    from decent_optim_wrapper.wrapper import DecentOptimWrapper

    assert DecentOptimWrapper is optimizer.DecentOptimWrapper is decent_optim_wrapper.DecentOptimWrapper
    assert DecentralizedDataParallel is data_parallel.DecentralizedDataParallel
    assert DecentralizedDataParallel is decent_optim_wrapper.DecentralizedDataParallel
