"""Every migration after the baseline is expand or contract (``storage/migrations/README.md``): the
previous release's code keeps serving while it runs. The checker (``tests/storage/migration_rule.py``)
is shown refusing what breaks that code and accepting what it ignores, on migration sources written
here; the git part (what the previous release still names) runs on this checkout's history."""

from __future__ import annotations

import textwrap
import uuid

import pytest

from tests.storage.migration_rule import (
    BASELINE,
    check_source,
    checked_files,
    git_missing,
    migration_files,
    previous_release,
    still_named,
)
from tests.storage.migration_rule import VERSIONS as VERSIONS_DIR
from tests.storage.migration_rule import _git as git

pytestmark = pytest.mark.unit


def migration(upgrade: str, *, head: str = "", downgrade: str = "pass") -> str:
    """The source of a migration whose ``upgrade()`` body is ``upgrade``, module-level ``head`` above it."""
    return (
        "import sqlalchemy as sa\nfrom alembic import op\n\n"
        + textwrap.dedent(head)
        + "\n\ndef upgrade() -> None:\n"
        + textwrap.indent(textwrap.dedent(upgrade).strip(), "    ")
        + "\n\n\ndef downgrade() -> None:\n"
        + textwrap.indent(textwrap.dedent(downgrade).strip(), "    ")
        + "\n"
    )


def refusals(upgrade: str, **kwargs: str) -> list[str]:
    return [refusal.what for refusal in check_source(migration(upgrade, **kwargs)).refused]


# ---- the migrations themselves -------------------------------------------------------------------


def test_the_baseline_names_migrations_that_exist():
    assert BASELINE <= {path.stem for path in migration_files()}
    assert checked_files(), "the newest migration is after the baseline and checked"


@pytest.mark.parametrize("path", checked_files(), ids=lambda path: path.stem)
def test_every_migration_after_the_baseline_is_expand_or_contract(path):
    verdict = check_source(path.read_text())
    assert verdict.refused == [], "\n".join(str(refusal) for refusal in verdict.refused)
    if not verdict.contracted:
        return
    if reason := git_missing():
        pytest.skip(f"{path.stem} contracts {verdict.contracted}; the previous release's code is not checked: {reason}")
    commit = previous_release(path)
    named = {obj: still_named(commit, *obj) for obj in verdict.contracted}
    assert not any(named.values()), f"the previous release ({commit[:12]}) still names {named}"


def test_the_last_baseline_migration_would_be_refused():
    """0014 predates the rule: it drops and renames ``tenant_data_keys`` under the running code."""
    verdict = check_source((VERSIONS_DIR / "0014_key_versions.py").read_text())
    assert [refusal.what for refusal in verdict.refused] == [
        "drop_table('tenant_data_keys')",
        "rename_table('tenant_data_keys_versioned')",
    ]
    assert verdict.contracted == []


# ---- what the checker refuses --------------------------------------------------------------------


def test_refuses_a_drop():
    assert refusals("op.drop_table('old_things')") == ["drop_table('old_things')"]
    assert refusals("op.drop_column('tokens', 'legacy')") == ["drop_column(tokens.legacy)"]
    batch = """
        with op.batch_alter_table('tokens') as batch_op:
            batch_op.drop_column('legacy')
    """
    assert refusals(batch) == ["drop_column(tokens.legacy)"]
    assert refusals("op.drop_constraint('uq_tokens_alias', 'tokens', type_='unique')") == [
        "drop_constraint('uq_tokens_alias')"
    ]
    assert refusals("op.execute('DROP TABLE old_things')") == ["SQL DROP"]
    assert refusals("op.execute(sa.text('ALTER TABLE tokens DROP COLUMN legacy'))") == ["SQL DROP"]


def test_refuses_a_rename():
    assert refusals("op.rename_table('tokens', 'vault_tokens')") == ["rename_table('tokens')"]
    assert refusals("op.alter_column('tokens', 'alias', new_column_name='handle')") == ["alter_column(tokens.alias)"]
    assert refusals("op.execute('ALTER TABLE tokens RENAME COLUMN alias TO handle')") == ["SQL RENAME"]


def test_refuses_a_changed_type_or_a_new_not_null():
    assert refusals("op.alter_column('tokens', 'alias', type_=sa.Text())") == ["alter_column(tokens.alias)"]
    assert refusals("op.alter_column('tokens', 'alias', nullable=False)") == ["alter_column(tokens.alias)"]
    assert refusals("op.execute('ALTER TABLE tokens ALTER COLUMN alias SET NOT NULL')") == ["SQL SET NOT NULL"]
    assert refusals("op.execute('ALTER TABLE tokens ALTER COLUMN alias TYPE text')") == ["SQL ALTER ... TYPE"]
    # the previous release inserts rows without the new column
    assert refusals("op.add_column('tokens', sa.Column('alias', sa.String(), nullable=False))") == [
        "add_column(tokens)"
    ]


def test_refuses_a_plain_index_on_an_existing_table():
    assert refusals("op.create_index('ix_tokens_alias', 'tokens', ['alias'])") == ["create_index on tokens"]
    assert refusals("op.execute('CREATE INDEX ix_tokens_alias ON tokens (alias)')") == [
        "SQL CREATE INDEX without CONCURRENTLY"
    ]
    # CONCURRENTLY cannot run inside the migration's transaction
    outside = "op.create_index('ix_tokens_alias', 'tokens', ['alias'], postgresql_concurrently=True)"
    assert refusals(outside) == ["create_index on tokens"]


def test_refuses_a_constraint_checked_under_a_lock():
    assert refusals("op.create_foreign_key('fk_a_b', 'a', 'b', ['b_id'], ['id'])") == ["create_foreign_key on a"]
    assert refusals("op.create_check_constraint('ck_a', 'a', 'n > 0')") == ["create_check_constraint on a"]
    assert refusals("op.create_unique_constraint('uq_a', 'a', ['n'])") == ["create_unique_constraint on a"]


def test_looks_into_the_functions_upgrade_calls():
    helper = """
        def _swap(name):
            op.drop_table(name)
    """
    assert refusals("_swap('old_things')", head=helper) == ["drop_table('?')"]


# ---- what it accepts -----------------------------------------------------------------------------


def test_accepts_an_expand_migration():
    expand = """
        op.create_table('things', sa.Column('id', sa.Integer(), primary_key=True),
                        sa.Column('n', sa.Integer(), nullable=False))
        op.create_index('ix_things_n', 'things', ['n'])
        op.create_foreign_key('fk_things_self', 'things', 'things', ['n'], ['id'])
        op.add_column('tokens', sa.Column('alias', sa.String(), nullable=True))
        op.add_column('tokens', sa.Column('rank', sa.Integer(), server_default='0', nullable=False))
        op.alter_column('tokens', 'legacy', existing_type=sa.String(), nullable=True)
        op.create_foreign_key('fk_tokens_thing', 'tokens', 'things', ['thing_id'], ['id'], postgresql_not_valid=True)
        op.create_check_constraint('ck_tokens_rank', 'tokens', 'rank >= 0', postgresql_not_valid=True)
        op.execute('ALTER TABLE tokens VALIDATE CONSTRAINT ck_tokens_rank')
        op.execute('ALTER TABLE tokens ALTER COLUMN legacy DROP NOT NULL')
        op.execute("UPDATE tokens SET rank = 1 WHERE id IN (SELECT id FROM tokens WHERE rank IS NULL LIMIT 1000)")
        with op.get_context().autocommit_block():
            op.create_index('ix_tokens_alias', 'tokens', ['alias'], postgresql_concurrently=True)
            op.execute('CREATE INDEX CONCURRENTLY ix_tokens_rank ON tokens (rank)')
            op.execute('DROP INDEX CONCURRENTLY IF EXISTS ix_tokens_old')
    """
    undo = "op.drop_table('things')\nop.drop_column('tokens', 'alias')"
    verdict = check_source(migration(expand, downgrade=undo))  # downgrade is not the previous code's concern
    assert verdict.refused == []
    assert verdict.contracted == []


def test_a_declared_contract_is_left_to_the_history():
    head = 'contracts = {"table": ["old_things"], "column": ["tokens.legacy"]}'
    contract = """
        op.drop_table('old_things')
        op.drop_column('tokens', 'legacy')
        op.execute('DROP TABLE IF EXISTS old_things')
    """
    verdict = check_source(migration(contract, head=head))
    assert verdict.refused == []
    assert verdict.contracted == [("table", "old_things"), ("column", "tokens.legacy")]
    # what the migration does not declare stays refused
    assert refusals("op.drop_table('old_things')\nop.drop_table('tokens')", head=head) == ["drop_table('tokens')"]


def test_a_malformed_contract_declaration_is_an_error():
    with pytest.raises(ValueError, match="contracts"):
        check_source(migration("pass", head='contracts = {"tables": ["old_things"]}'))
    with pytest.raises(ValueError, match=r"table\.column"):
        check_source(migration("pass", head='contracts = {"column": ["legacy"]}'))


# ---- the previous release, from git --------------------------------------------------------------


@pytest.fixture
def history():
    if reason := git_missing():
        pytest.skip(f"the previous release is read from git: {reason}")


@pytest.mark.parametrize("stem", ["0014_key_versions", *(path.stem for path in checked_files())])
def test_the_previous_release_is_the_code_before_the_migration_was_added(history, stem):
    path = VERSIONS_DIR / f"{stem}.py"
    commit = previous_release(path)
    relative = path.relative_to(VERSIONS_DIR.parents[2])
    assert git("cat-file", "-e", f"{commit}:{relative}").returncode != 0, "the file is not in its previous release"
    assert git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0


def test_still_named_finds_what_the_code_names(history):
    head = git("rev-parse", "HEAD").stdout.strip()
    gone = f"gone_{uuid.uuid4().hex}"
    assert "storage/models.py" in still_named(head, "table", "jobs")
    assert "storage/models.py" in still_named(head, "column", "jobs.lease_owner")
    assert still_named(head, "table", gone) == []
    assert still_named(head, "column", f"jobs.{gone}") == []
    # a migration naming it does not count: only the code that serves
    assert all(not path.startswith("storage/migrations/") for path in still_named(head, "table", "tenant_data_keys"))
