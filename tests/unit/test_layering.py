"""Services and shared/ never import the ``infermesh`` CLI/supervisor package.

    infermesh/ (CLI, supervisor, local mesh) ──imports──► services/, shared/
    services/, shared/                       ──never──►   infermesh/

A service runs in its own process, started by ``infermesh up`` or by anything else (a container, a
test); what it needs from the CLI side belongs in shared/ or in the service (``shared/ports.py`` took
``free_port`` for the vLLM worker). The check parses every file, so an import inside a function, an
``importlib.import_module("infermesh...")`` or ``__import__`` counts too, and nothing is executed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("services", "shared")
FORBIDDEN = "infermesh"


def _is_forbidden(module: str | None) -> bool:
    return module is not None and (module == FORBIDDEN or module.startswith(FORBIDDEN + "."))


def forbidden_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) for each import of the ``infermesh`` package in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if _is_forbidden(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_forbidden(node.module):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            module = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(module, str) and _is_forbidden(module):
                found.append((node.lineno, module))
    return found


def test_no_module_under_services_or_shared_imports_infermesh():
    violations = [f"{path.relative_to(ROOT)}:{line}: imports {module}"
                  for layer in LAYERS for path in sorted((ROOT / layer).rglob("*.py"))
                  for line, module in forbidden_imports(path.read_text())]
    assert not violations, "services/ and shared/ must not depend on the CLI package:\n" + "\n".join(violations)


def test_the_check_sees_every_form_of_import():
    source = "\n".join([
        "import infermesh",
        "import infermesh.up as up",
        "from infermesh import cli",
        "def f():",
        "    from infermesh.processes import ProcessGroup",
        "importlib.import_module('infermesh.local')",
        "__import__('infermesh')",
    ])
    assert [line for line, _ in forbidden_imports(source)] == [1, 2, 3, 5, 6, 7]


def test_the_check_leaves_lookalike_names_alone():
    source = "\n".join([
        "import infermesh_extra",
        "from shared.ports import free_port",
        "from . import infermesh",
        "log = logging.getLogger('infermesh.edge')",
    ])
    assert forbidden_imports(source) == []
