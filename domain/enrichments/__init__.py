"""Enrichments: facts about a token's data that a provider knows (bank account verification)."""
