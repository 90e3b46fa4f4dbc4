"""The expand/contract rule of the migrations (``storage/migrations/README.md``), checked from their
source: :func:`check_source` reads a migration with ``ast`` and lists what its ``upgrade()`` does that
the previous release's code could not run beside; :func:`previous_release` and :func:`still_named` ask
git whether that code still names what a contract migration removes. No tests here.

*The previous release* of a migration is the code of the commit just before the one that added the
migration's file (``git log --diff-filter=A -- <file>``, that commit's parent); while the file is not
committed yet, ``HEAD``. There are no release tags: this is the code a deploy of the migration replaces.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ROOT / "storage" / "migrations" / "versions"
#: Files of the migrations written before the rule; they are not checked (0014 drops and renames tables).
BASELINE = frozenset(
    {
        "0001_initial_schema",
        "0002_network_tokens",
        "0003_agentic",
        "0004_account_updater",
        "0005_tenant_admin",
        "0006_job_subjects",
        "0007_proxies",
        "0009_reactors",
        "0010_wallets",
        "0011_allowances",
        "0012_delivery_jobs",
        "0013_token_idempotency_keys",
        "0014_key_versions",
    }
)
#: What a migration's module-level ``contracts`` may name: ``{"table": ["t"], "column": ["t.c"],
#: "constraint": ["name"]}``.
CONTRACT_KINDS = ("table", "column", "constraint")
#: SQL in ``op.execute`` (or any ``.execute``) that removes or changes what exists: a DROP (other than
#: DROP NOT NULL, which only loosens, and DROP INDEX CONCURRENTLY), a RENAME, a column's new type, SET
#: NOT NULL, and an index built without CONCURRENTLY.
CONTRACTING_SQL = (
    (re.compile(r"\bDROP\b(?!\s+NOT\s+NULL)(?!\s+INDEX\s+CONCURRENTLY)", re.I), "DROP"),
    (re.compile(r"\bRENAME\b", re.I), "RENAME"),
    (re.compile(r"\bALTER\s+COLUMN\s+\S+\s+(SET\s+DATA\s+)?TYPE\b", re.I), "ALTER ... TYPE"),
    (re.compile(r"\bSET\s+NOT\s+NULL\b", re.I), "SET NOT NULL"),
    (re.compile(r"\bCREATE\s+(UNIQUE\s+)?INDEX\b(?!\s+CONCURRENTLY)", re.I), "CREATE INDEX without CONCURRENTLY"),
)


@dataclass(frozen=True)
class Refusal:
    """One operation of ``upgrade()`` the previous release's code cannot run beside: its ``line``, the
    operation (``what``), ``why``, and the objects it contracts (``(kind, name)``; empty when no
    declaration can make it acceptable, e.g. an index built without CONCURRENTLY)."""

    line: int
    what: str
    why: str
    objects: tuple[tuple[str, str], ...] = ()
    sql: str | None = None  # the statement's text, for SQL refusals

    def __str__(self) -> str:
        return f"line {self.line}: {self.what}: {self.why}"


@dataclass
class Verdict:
    """What :func:`check_source` found: ``refused`` (never acceptable as written, or contracting an
    object the migration does not declare) and ``contracted`` (declared contracts the migration
    performs: acceptable when the previous release no longer names them, see :func:`still_named`)."""

    refused: list[Refusal] = field(default_factory=list)
    contracted: list[tuple[str, str]] = field(default_factory=list)


def _string(node: ast.expr | None) -> str | None:
    """The text of a string literal, or of ``op.f("name")``; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "f" and node.args:
        return _string(node.args[0])
    return None


def _strings(node: ast.AST) -> str:
    """Every string literal under ``node``, joined by spaces (the text of a SQL statement)."""
    return " ".join(
        child.value for child in ast.walk(node) if isinstance(child, ast.Constant) and isinstance(child.value, str)
    )


def _argument(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value for k in call.keywords)


def _has_keyword(call: ast.Call, name: str) -> bool:
    return any(k.arg == name for k in call.keywords)


def declared_contracts(tree: ast.Module) -> dict[str, list[str]]:
    """The module-level ``contracts`` of a migration (``{}`` when it has none). ValueError when it is not a
    literal dict of :data:`CONTRACT_KINDS` to lists of names (columns as ``table.column``)."""
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "contracts" for t in targets):
            value = ast.literal_eval(node.value) if node.value is not None else None
            if not isinstance(value, dict) or not all(
                kind in CONTRACT_KINDS and isinstance(names, list | tuple) and all(isinstance(n, str) for n in names)
                for kind, names in value.items()
            ):
                raise ValueError(f"contracts must map {CONTRACT_KINDS} to lists of names, not {value!r}")
            if any("." not in name for name in value.get("column", ())):
                raise ValueError("a contracted column is named table.column")
            return {kind: list(names) for kind, names in value.items()}
    return {}


def _upgrade_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """``upgrade`` and the module-level functions it calls, directly or through others."""
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    if "upgrade" not in functions:
        return []
    found, todo = {"upgrade"}, ["upgrade"]
    while todo:
        for node in ast.walk(functions[todo.pop()]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                name = node.func.id
                if name in functions and name not in found and name != "downgrade":
                    found.add(name)
                    todo.append(name)
    return [functions[name] for name in sorted(found)]


class _Upgrade(ast.NodeVisitor):
    """Walks the upgrade functions, knowing the tables created there, the ``batch_alter_table`` aliases
    and whether it is inside an ``autocommit_block()``."""

    def __init__(self, created: set[str]) -> None:
        self.created = created
        self.batches: dict[str, str] = {}  # alias -> table
        self.autocommit = 0
        self.refusals: list[Refusal] = []

    def visit_With(self, node: ast.With) -> None:
        autocommit = 0
        for item in node.items:
            call = item.context_expr
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
                if call.func.attr == "autocommit_block":
                    autocommit += 1
                elif call.func.attr == "batch_alter_table" and isinstance(item.optional_vars, ast.Name):
                    table = _string(_argument(call, 0, "table_name"))
                    if table:
                        self.batches[item.optional_vars.id] = table
        self.autocommit += autocommit
        self.generic_visit(node)
        self.autocommit -= autocommit

    def _table_and_column(self, call: ast.Call, receiver: str | None) -> tuple[str | None, str | None]:
        if receiver in self.batches:
            return self.batches[receiver], _string(_argument(call, 0, "column_name"))
        return _string(_argument(call, 0, "table_name")), _string(_argument(call, 1, "column_name"))

    def _refuse(self, call: ast.Call, what: str, why: str, *objects: tuple[str, str], sql: str | None = None) -> None:
        self.refusals.append(Refusal(call.lineno, what, why, tuple(objects), sql))

    def visit_Call(self, call: ast.Call) -> None:
        self.generic_visit(call)
        if not isinstance(call.func, ast.Attribute):
            return
        name = call.func.attr
        receiver = call.func.value.id if isinstance(call.func.value, ast.Name) else None
        batch_table = self.batches.get(receiver or "")
        if name == "drop_table":
            table = _string(_argument(call, 0, "table_name")) or "?"
            self._refuse(call, f"drop_table({table!r})", "drops a table", ("table", table))
        elif name == "rename_table":
            table = _string(_argument(call, 0, "old_table_name")) or "?"
            self._refuse(
                call, f"rename_table({table!r})", "a rename is add + copy + drop across releases", ("table", table)
            )
        elif name == "drop_column":
            table, column = self._table_and_column(call, receiver)
            self._refuse(call, f"drop_column({table}.{column})", "drops a column", ("column", f"{table}.{column}"))
        elif name == "drop_constraint":
            constraint = _string(_argument(call, 0, "constraint_name")) or "?"
            self._refuse(call, f"drop_constraint({constraint!r})", "drops a constraint", ("constraint", constraint))
        elif name == "alter_column":
            table, column = self._table_and_column(call, receiver)
            changes = [k for k in ("new_column_name", "type_") if _has_keyword(call, k)]
            changes += ["nullable=False"] if _keyword_is(call, "nullable", False) else []
            if changes:
                why = f"changes {', '.join(changes)} of a column the previous release reads and writes"
                self._refuse(call, f"alter_column({table}.{column})", why, ("column", f"{table}.{column}"))
        elif name == "add_column":
            table = batch_table or _string(_argument(call, 0, "table_name"))
            column = _argument(call, 0 if batch_table else 1, "column")
            if table not in self.created and isinstance(column, ast.Call):
                not_null = _keyword_is(column, "nullable", False) or _keyword_is(column, "primary_key", True)
                if not_null and not _has_keyword(column, "server_default"):
                    self._refuse(
                        call,
                        f"add_column({table})",
                        "a NOT NULL column without a server default: the previous release's inserts fail",
                    )
        elif name == "create_index":
            table = batch_table or _string(_argument(call, 1, "table_name"))
            if table not in self.created:
                if not _keyword_is(call, "postgresql_concurrently", True):
                    self._refuse(
                        call,
                        f"create_index on {table}",
                        "an index on an existing table is built with postgresql_concurrently=True "
                        "(a plain build locks the table's writes meanwhile)",
                    )
                elif not self.autocommit:
                    self._refuse(
                        call,
                        f"create_index on {table}",
                        "CONCURRENTLY runs outside a transaction: inside `with op.get_context().autocommit_block():`",
                    )
        elif name in ("create_foreign_key", "create_check_constraint"):
            table = batch_table or _string(_argument(call, 1, "source_table" if "foreign" in name else "table_name"))
            if table not in self.created and not _keyword_is(call, "postgresql_not_valid", True):
                self._refuse(
                    call,
                    f"{name} on {table}",
                    "a constraint on an existing table is added with postgresql_not_valid=True, then validated "
                    "(VALIDATE CONSTRAINT) in a later step",
                )
        elif name == "create_unique_constraint":
            table = batch_table or _string(_argument(call, 1, "table_name"))
            if table not in self.created:
                self._refuse(
                    call,
                    f"create_unique_constraint on {table}",
                    "build a unique index CONCURRENTLY instead (a unique constraint scans under a lock)",
                )
        elif name in ("execute", "exec_driver_sql"):
            sql = _strings(call)
            for pattern, label in CONTRACTING_SQL:
                if pattern.search(sql):
                    self._refuse(call, f"SQL {label}", f"{sql[:120]!r}", sql=sql)
                    break


def check_source(source: str) -> Verdict:
    """Check a migration's source against the rule: its ``upgrade()`` (and the module's functions it
    calls) may only expand, or contract what its module-level ``contracts`` declares. SyntaxError for
    source that does not parse, ValueError for a malformed ``contracts``."""
    tree = ast.parse(source)
    contracts = declared_contracts(tree)
    declared = {(kind, name) for kind, names in contracts.items() for name in names}
    functions = _upgrade_functions(tree)
    created = {
        table
        for function in functions
        for node in ast.walk(function)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "create_table"
        if (table := _string(_argument(node, 0, "table_name")))
    }
    walker = _Upgrade(created)
    for function in functions:
        walker.visit(function)
    verdict = Verdict()
    for refusal in walker.refusals:
        if refusal.sql is not None:
            words = set(re.findall(r"\w+", refusal.sql))
            named = [(kind, name) for kind, name in sorted(declared) if name.rsplit(".", 1)[-1] in words]
            covered = bool(named)
        else:
            named = list(refusal.objects)
            covered = bool(named) and all(obj in declared for obj in named)
        if covered:
            verdict.contracted += [obj for obj in named if obj not in verdict.contracted]
        else:
            verdict.refused.append(refusal)
    return verdict


def migration_files() -> list[Path]:
    """Every migration file, in name order."""
    return sorted(path for path in VERSIONS.glob("[0-9]*.py"))


def checked_files() -> list[Path]:
    """The migration files the rule applies to: every one after the baseline."""
    return [path for path in migration_files() if path.stem not in BASELINE]


class NoHistory(Exception):
    """git cannot tell the previous release here (no git, no ``.git``, a history too shallow)."""


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def git_missing() -> str | None:
    """Why git cannot be asked here (no git command, no ``.git``, a shallow clone), or None when it can."""
    if shutil.which("git") is None:
        return "git is not installed"
    if not (ROOT / ".git").exists():
        return f"{ROOT} has no .git (an export of the source, not a checkout)"
    if _git("rev-parse", "--verify", "-q", "HEAD").returncode != 0:
        return "git rev-parse HEAD failed (no commit yet?)"
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        return "a shallow clone holds too little history to find a previous release (git fetch --unshallow)"
    return None


def previous_release(path: Path) -> str:
    """The commit (40 hex digits) of the previous release of the migration in ``path`` (this module's
    docstring): the parent of the commit that added the file, or ``HEAD`` while it is not committed.
    NoHistory when git cannot tell."""
    if reason := git_missing():
        raise NoHistory(reason)
    relative = str(path.resolve().relative_to(ROOT))
    added = _git("log", "--diff-filter=A", "--format=%H", "HEAD", "--", relative).stdout.split()
    base = f"{added[0]}^" if added else "HEAD"
    parent = _git("rev-parse", "--verify", "-q", f"{base}^{{commit}}")
    if parent.returncode != 0:
        raise NoHistory(f"{base} of {relative} is not in this clone's history (a shallow clone? git fetch --unshallow)")
    return parent.stdout.strip()


def still_named(commit: str, kind: str, name: str) -> list[str]:
    """The files of ``commit``'s tree, outside ``storage/migrations``, that name the object (a word match):
    a table or a constraint by its name, a column ``table.column`` where a file names both. Empty when
    the code of that commit no longer names it."""
    table, _, column = name.rpartition(".") if kind == "column" else ("", "", name)
    patterns = ["--all-match", "-e", table, "-e", column] if table else ["-e", column]
    found = _git("grep", "-l", "-w", "-F", *patterns, commit, "--", ".", ":(exclude)storage/migrations")
    if found.returncode not in (0, 1):
        raise NoHistory(f"git grep failed: {found.stderr.strip()}")
    return [line.split(":", 1)[1] for line in found.stdout.splitlines()]


def export_tree(commit: str, into: Path) -> Path:
    """The files of ``commit``'s tree written under ``into`` (``git archive | tar -x``); ``into``.
    CalledProcessError when git or tar fails."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True, timeout=120)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True, timeout=120)
    return into
