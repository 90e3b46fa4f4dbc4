"""The Alembic migrations (``versions/``), applied by ``tessera migrate`` once per deploy while the
previous release still serves (README, Upgrading).

Every migration after the baseline (0001 to 0014, which predate the rule) is *expand* or *contract*
(``README.md`` here):

- expand: only additions the previous release's code ignores: new tables, nullable columns or columns
  with a server default, indexes built CONCURRENTLY in an ``autocommit_block()``, constraints added NOT
  VALID then validated, backfills in batches;
- contract: drops and renames of what the previous release's code no longer reads or writes, one release
  after the code stopped using them, declared in the module's ``contracts``; a rename is add + copy +
  drop across releases.

The previous release of a migration is the code of the commit just before the one that added its file.
``tests/storage/test_migration_rule.py`` checks the rule.
"""
